"""The scaled-dot-product-attention backend a GPU picks on each torch release, and the call of that backend.

``at::native::scaled_dot_product_attention`` (``aten/src/ATen/native/transformers/
attention.cpp``) asks ``sdp::select_sdp_backend``
(``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) for a backend: the
checks of each backend in priority order, for the GPU of the trace's profile and
the cuDNN of the release's wheel (:data:`CUDNN_OF_RELEASE`). The router then
calls it as the composite does, with its own pre-processing: the boolean-mask
conversion, flash's head-dim padding to a multiple of 8, the memory-efficient
kernel's aligned bias. Each threshold below is named with the function it is
read from; ``tests/test_cuda_routing.py`` (``test_*_is_pinned_*``) reads them
again from the installed CUDA build's ``libtorch_cuda.so``.
"""

from __future__ import annotations

import math
import os
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_release import of_release, torch_minor as _release
from pytest_torchmem.engine.tracing.devices.cuda.routes import (
    FLOATS,
    HALVES,
    NNFunctions,
    Router,
    aten,
    bind,
    on_gpu,
    route,
)

__all__ = ["CUDNN_OF_RELEASE", "CUDNN_VERSION", "SDPBackend", "cudnn_version", "select_sdp_backend"]

# torch's private names (engine/torch_compat/torch_private.py): the SDPA backends' order
_get_sdp_priority_order: Final = private("torch._C._get_sdp_priority_order")

#: The cuDNN each torch release's PyPI CUDA wheel installs (``cudnnGetVersion()``,
#: read as ``torch.backends.cudnn.version()`` in each: nvidia-cudnn 9.10.2 for
#: 2.10.0+cu128, 9.19 for 2.11.0+cu130, 9.20 for 2.12.1 and 2.13.0, 9.24 for
#: 2.14.1, 9.26 for 2.15.0+cu132); a CPU build models the CUDA wheel of its release.
#: tests/test_cuda_routing.py checks it against the cuDNN each CUDA wheel pins.
CUDNN_OF_RELEASE: Final = {
    (2, 10): 91002,
    (2, 11): 91900,
    (2, 12): 92000,
    (2, 13): 92000,
    (2, 14): 92400,
    (2, 15): 92600,
}


def cudnn_version(release: tuple[int, int] | None = None) -> int:
    """The cuDNN version modelled for torch ``release`` (the installed one by default);
    outside the window, that of the nearest release of it."""
    return of_release(CUDNN_OF_RELEASE, _release() if release is None else release)


#: The cuDNN version modelled for the installed torch (see :func:`cudnn_version`).
CUDNN_VERSION: Final = cudnn_version()

# -- the thresholds of sdp_utils.cpp and attention.cpp --------------------------------
# (compute capabilities as (major, minor); cuDNN versions as cudnnGetVersion() numbers)

#: ``check_prefer_cudnn_attention`` (inlined in ``select_sdp_backend``:
#: ``cmpq $0x1656c``): cuDNN attention goes first with a cuDNN newer than 9.15.0.
CUDNN_PREFERRED_AFTER: Final = 91500
#: ``check_head_dim_size_flash``: ``max_size = c10::SymInt(256)``.
FLASH_MAX_HEAD_DIM: Final = 256
#: ``check_flash_attention_hardware_support``: ``check_sm_version<sm80, sm121>``.
FLASH_SM: Final = ((8, 0), (12, 1))
#: ``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``: on these
#: GPUs flash's backward takes no head dim in (192, 224], nor above 224 with dropout.
FLASH_BACKWARD_HEAD_DIM_SM: Final = (((8, 6), (8, 9)), ((12, 0), (12, 1)))
FLASH_BACKWARD_HEAD_DIM_LIMITS: Final = (192, 224)
#: ``check_mem_efficient_hardware_support``: ``check_sm_version<sm50, sm121>``.
MEM_EFFICIENT_SM: Final = ((5, 0), (12, 1))
#: ``minimum_gemm_alignment`` (``check_head_dim_size_mem_efficient``): head dims a
#: multiple of 4 from sm80, and of ``128 / bits per element`` where tensor cores run.
MEM_EFFICIENT_SM80_ALIGNMENT: Final = 4
GEMM_ALIGNMENT_BITS: Final = 128
#: ``check_data_ptr_alignment_mem_efficient`` (from 2.13): the storage offset of q, k
#: and v a multiple of 8 elements for fp16/bf16 (``[True]``), of 4 for others.
MEM_EFFICIENT_OFFSET_ALIGNMENT: Final = {False: 4, True: 8}
#: ``check_cudnn_hardware_support``: ``check_sm_version<sm80, sm121>``.
CUDNN_SM: Final = ((8, 0), (12, 1))
#: ``check_cudnn_dropout`` (``can_use_cudnn_attention`` before 2.15): no dropout with
#: a cuDNN strictly between 9.11.0 and 9.14.0.
CUDNN_DROPOUT_BUG: Final = (91100, 91400)
#: ``check_cudnn_tensor_shapes``: head dims a multiple of 8, at most 128, and more on
#: some GPUs and cuDNNs, by release (read from each wheel's ``libtorch_cuda.so``; see
#: :func:`cudnn_max_head_dim`): 256 on sm90 with a cuDNN from 9.1.0 (2.10 to 2.13:
#: ``cmpq $0x16377``); exactly (d_qk, d_v) = (192, 128) on major 10 with a cuDNN newer
#: than 9.10 (2.11 to 2.13: ``cmpq $0x163db``, ``cmpl $0xa``, ``$0xc0``); from 2.14, 256
#: on sm90 and major 10 with a cuDNN newer than 9.22 (``cmp $0x16828``), on (10, 7)
#: only with one newer than 9.25 (``movabs $0x70000000a``, ``cmp $0x16954``), else
#: (192, 128) there with a cuDNN newer than 9.10.
CUDNN_MAX_HEAD_DIM: Final = 128
CUDNN_SM90_MAX_HEAD_DIM: Final = 256
CUDNN_SM90_D256_SINCE: Final = 91000
CUDNN_HEAD_DIM_MULTIPLE: Final = 8
#: (d_qk, d_v) that major 10 (from 2.14 also sm90) takes with a cuDNN newer than 9.10.
CUDNN_192_128: Final = (192, 128)
CUDNN_192_128_AFTER: Final = 91099
#: From 2.14: 256 with a cuDNN newer than this on sm90 and major 10 (but (10, 7)) ...
CUDNN_D256_AFTER: Final = 92200
#: ... and on (10, 7) with a cuDNN newer than this.
CUDNN_SM107_D256_AFTER: Final = 92500
#: ``check_cudnn_d256_bprop_head_dim`` (from 2.14): with a cuDNN newer than 9.22 (and
#: on (10, 7) not newer than 9.25) the backward takes head dims (d_qk, d_v) up to
#: (128, 128), or exactly (192, 128) or (256, 256).
CUDNN_BPROP_HEAD_DIMS_AFTER: Final = 92200
CUDNN_SM107_BPROP_FIXED_AFTER: Final = 92500
CUDNN_BPROP_SMALL_HEAD_DIM: Final = 128
CUDNN_BPROP_LARGE_HEAD_DIMS: Final = ((192, 128), (256, 256))
#: ``attention.cpp: scaled_dot_product_attention``: flash pads q, k, v's head dim to a
#: multiple of 8 (``pad_last_dim<8, false>``; 2.10 passes the 8 as an argument).
FLASH_HEAD_DIM_ALIGNMENT: Final = 8
#: ``attention.cpp: preprocess_mask``: ``mem_eff_alignment = 8``.
MEM_EFFICIENT_BIAS_ALIGNMENT: Final = 8
#: ``attention.cpp: convert_boolean_attn_mask_cudnn``: a masked-out position's additive
#: value for cuDNN (the float16 minimum), ``-inf`` for the others.
CUDNN_MASK_FILL: Final = -65504.0
#: The release from which the cuDNN branch converts a boolean mask as the others do.
CUDNN_MASK_FILL_UNTIL_AFTER: Final = (2, 12)


class SDPBackend:
    """``sdp::SDPBackend`` values (as ``torch._C._get_sdp_priority_order`` lists them)."""

    ERROR = -1
    MATH = 0
    FLASH = 1
    EFFICIENT = 2
    CUDNN = 3
    OVERRIDEABLE = 4


def _sm_in(cc: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    """``check_sm_version<low, high>``: ``low <= cc <= high``."""
    return low <= cc <= high


def _prefer_cudnn_attention(cc: tuple[int, int]) -> bool:
    """``check_prefer_cudnn_attention`` (sdp_utils.cpp, read from each release's
    ``libtorch_cuda.so``): unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``, a cuDNN
    newer than 9.15.0 (``cudnn_version > 91500``) on compute capability 9.x or
    10.x; 2.10 to 2.12 also ask for minor 0 or 3 (sm90, sm100, sm103), 2.13 on
    any minor. With 2.10's cuDNN 9.10 it is never preferred."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1":
        return False
    if CUDNN_VERSION <= CUDNN_PREFERRED_AFTER or cc[0] not in (9, 10):
        return False
    return _release() >= (2, 13) or cc[1] in (0, 3)


def _priority_order(cc: tuple[int, int]) -> list[int]:
    """``priority_order``: the context's order, which the first CUDA call sets to
    cuDNN-first where cuDNN attention is preferred (unless the user set one)."""
    order = list(_get_sdp_priority_order())
    default = [SDPBackend.FLASH, SDPBackend.EFFICIENT, SDPBackend.MATH, SDPBackend.CUDNN, SDPBackend.OVERRIDEABLE]
    if order == default and _prefer_cudnn_attention(cc):
        return [SDPBackend.CUDNN, SDPBackend.FLASH, SDPBackend.EFFICIENT, SDPBackend.MATH]
    return order


def _requires_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``input_requires_grad``: grad mode on and any of q, k, v requires grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _dense_checks(q, k, v, mask, gqa_ok: bool, enable_gqa: bool, ignore_singleton: bool) -> bool:  # type: ignore[no-untyped-def]
    """``check_batch_size_and_num_heads_dense``, ``check_nonzero_sequence_lengths_dense``
    and ``check_last_dim_stride_equals_1_dense`` (sdp_utils_cpp.h)."""
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    qh, kh, vh = q.size(-3), k.size(-3), v.size(-3)
    if enable_gqa and gqa_ok:
        if not (qh % kh == 0 and kh == vh):
            return False
    elif not (qh == kh == vh):
        return False
    if q.size(-2) == 0 or k.size(-2) == 0:
        return False
    strides_one = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if ignore_singleton:
        strides_one = strides_one or q.size(-1) == 1
    mask_ok = mask is None or mask.stride(-1) == 1
    return strides_one and mask_ok


def _low_precision_ok(q: torch.Tensor, cc: tuple[int, int]) -> bool:
    """``check_dtypes_low_precision``: fp16/bf16 on sm80+, fp16 before."""
    allowed = HALVES if cc[0] >= 8 else (torch.float16,)
    return q.dtype in allowed


def _attn_mask_shape_ok(q: torch.Tensor, k: torch.Tensor, mask: Any) -> bool:
    """``check_attn_mask_shape`` (sdp_utils_cpp.h)."""
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    if mask.size(-2) not in (q.size(2), 1) or mask.size(-1) not in (k.size(2), 1):
        return False
    if mask.dim() == 2:
        return True
    if mask.dim() == 4:
        return mask.size(0) in (1, q.size(0)) and mask.size(1) in (1, q.size(1))
    return False


def _can_use_flash(q, k, v, mask, dropout_p, is_causal, enable_gqa, cc) -> bool:  # type: ignore[no-untyped-def]
    """``can_use_flash_attention`` (sdp_utils.cpp)."""
    if not torch.backends.cuda.flash_sdp_enabled():
        return False
    if not (q.dim() == k.dim() == v.dim() == 4) or mask is not None:
        return False
    d = q.size(-1)
    if not (d == k.size(-1) == v.size(-1) and d <= FLASH_MAX_HEAD_DIM):
        return False
    if not _sm_in(cc, *FLASH_SM):
        return False
    sm86_89 = any(_sm_in(cc, *sm) for sm in FLASH_BACKWARD_HEAD_DIM_SM)
    low, high = FLASH_BACKWARD_HEAD_DIM_LIMITS
    if _requires_grad(q, k, v) and sm86_89 and ((low < d <= high) or (d > high and dropout_p > 0)):
        return False
    if is_causal and q.size(-2) != k.size(-2):
        return False
    if not _low_precision_ok(q, cc):
        return False
    return _dense_checks(q, k, v, mask, True, enable_gqa, True)


def _can_use_mem_efficient(q, k, v, mask, dropout_p, is_causal, enable_gqa, cc) -> bool:  # type: ignore[no-untyped-def]
    """``can_use_mem_efficient_attention`` (sdp_utils.cpp)."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return False
    if not _sm_in(cc, *MEM_EFFICIENT_SM):
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    is_half = q.dtype in HALVES
    align = MEM_EFFICIENT_SM80_ALIGNMENT if cc[0] >= 8 else 1
    if cc[0] >= 8 or (cc[0] >= 7 and is_half):  # use_tensor_cores
        align = max(align, GEMM_ALIGNMENT_BITS // (16 if is_half else 32))
    dq, dv = q.size(-1), v.size(-1)
    if not (dq == k.size(-1) and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    if not _dense_checks(q, k, v, mask, False, enable_gqa, False):
        return False
    allowed = FLOATS if cc[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype in allowed and _offsets_aligned_mem_efficient(q, k, v, cc)


def _offsets_aligned_mem_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cc: tuple[int, int]) -> bool:
    """``check_data_ptr_alignment_mem_efficient`` (sdp_utils.cpp, from torch 2.13; read
    from its ``libtorch_cuda.so``): on sm80+ each of q, k, v starts
    ``storage_offset * element_size`` bytes into its storage, which must be a
    multiple of ``element_size * (8 for fp16/bf16, else 4)`` (16 bytes for fp16,
    bf16 and fp32): q, k, v split from a fused projection at an offset that is not
    a multiple of 8 half elements go to another backend."""
    if _release() < (2, 13) or cc[0] < 8:
        return True
    per = MEM_EFFICIENT_OFFSET_ALIGNMENT[q.dtype in HALVES]
    return all(t.storage_offset() % per == 0 for t in (q, k, v))


def _can_use_cudnn(q, k, v, mask, dropout_p, is_causal, enable_gqa, cc) -> bool:  # type: ignore[no-untyped-def]
    """``can_use_cudnn_attention`` (sdp_utils.cpp), for the cuDNN of :data:`CUDNN_VERSION`."""
    if dropout_p > 0.0 and CUDNN_DROPOUT_BUG[0] < CUDNN_VERSION < CUDNN_DROPOUT_BUG[1]:
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not _low_precision_ok(q, cc) or not _attn_mask_shape_ok(q, k, mask):
        return False
    if not _sm_in(cc, *CUDNN_SM):
        return False
    if not _dense_checks(q, k, v, mask, True, True, True):
        return False
    # check_cudnn_tensor_shapes
    s_q, s_k, d_qk, d_v = q.size(2), k.size(2), q.size(3), v.size(3)
    head_limit = cudnn_max_head_dim(d_qk, d_v, cc)
    multiple = CUDNN_HEAD_DIM_MULTIPLE
    if d_qk > head_limit or d_v > head_limit or d_qk % multiple or d_v % multiple:
        return False
    # cuDNN takes no key/value of length 1, nor a query of length 1 with dropout
    if s_k == 1 or (s_q == 1 and dropout_p != 0.0):
        return False
    return _cudnn_bprop_head_dims_ok(q, k, v, cc)


def cudnn_max_head_dim(
    d_qk: int, d_v: int, cc: tuple[int, int], release: tuple[int, int] | None = None, cudnn: int | None = None
) -> int:
    """The largest head dim ``check_cudnn_tensor_shapes`` lets cuDNN attention take on a GPU
    of compute capability ``cc`` (see :data:`CUDNN_MAX_HEAD_DIM`), for torch ``release``
    with its wheel's ``cudnn`` (default: the running one's)."""
    release = _release() if release is None else release
    cudnn = cudnn_version(release) if cudnn is None else cudnn
    pair = (d_qk, d_v) == CUDNN_192_128 and cudnn > CUDNN_192_128_AFTER
    if release < (2, 14):
        if cudnn >= CUDNN_SM90_D256_SINCE and cc == (9, 0):
            return CUDNN_SM90_MAX_HEAD_DIM
        if release >= (2, 11) and cc[0] == 10 and pair:
            return CUDNN_192_128[0]
        return CUDNN_MAX_HEAD_DIM
    if cc == (10, 7) and cudnn > CUDNN_SM107_D256_AFTER:
        return CUDNN_SM90_MAX_HEAD_DIM
    if cc == (9, 0) or cc[0] == 10:
        if cc != (10, 7) and cudnn > CUDNN_D256_AFTER:
            return CUDNN_SM90_MAX_HEAD_DIM
        if pair:
            return CUDNN_192_128[0]
    return CUDNN_MAX_HEAD_DIM


def _cudnn_bprop_head_dims_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cc: tuple[int, int]) -> bool:
    """``check_cudnn_d256_bprop_head_dim`` (sdp_utils.cpp from torch 2.14, read from its
    ``libtorch_cuda.so``): when a gradient is needed, on sm90 (compute capability
    (9, 0)) or 10.x (but (10, 7) with a cuDNN up to 9.25) with a cuDNN newer than
    9.22, cuDNN's backward takes head dims (d_qk, d_v) of at most (128, 128),
    (192, 128) or (256, 256) only."""
    if _release() < (2, 14) or not _requires_grad(q, k, v) or CUDNN_VERSION <= CUDNN_BPROP_HEAD_DIMS_AFTER:
        return True
    fixed = CUDNN_VERSION > CUDNN_SM107_BPROP_FIXED_AFTER
    if not (cc == (9, 0) or (cc[0] == 10 and (fixed or cc != (10, 7)))):
        return True
    d_qk, d_v = q.size(3), v.size(3)
    small = CUDNN_BPROP_SMALL_HEAD_DIM
    return (d_qk <= small and d_v <= small) or (d_qk, d_v) in CUDNN_BPROP_LARGE_HEAD_DIMS


def select_sdp_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    cc: tuple[int, int],
) -> int:
    """``sdp::select_sdp_backend`` (sdp_utils.cpp) for a GPU of compute capability ``cc``."""
    if not any(
        (
            torch.backends.cuda.math_sdp_enabled(),
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(),
        )
    ):
        return SDPBackend.ERROR
    checks = {
        SDPBackend.CUDNN: _can_use_cudnn,
        SDPBackend.FLASH: _can_use_flash,
        SDPBackend.EFFICIENT: _can_use_mem_efficient,
    }
    for backend in _priority_order(cc):
        check = checks.get(backend)
        if check is not None:
            if check(q, k, v, mask, dropout_p, is_causal, enable_gqa, cc):
                return backend
        elif backend == SDPBackend.MATH and torch.backends.cuda.math_sdp_enabled():
            return SDPBackend.MATH
    return SDPBackend.ERROR


def _scale(q: torch.Tensor, scale: float | None) -> float:
    """``sdp::calculate_scale``."""
    return scale if scale is not None else 1.0 / math.sqrt(q.size(-1))


def _bool_mask_to_additive(mask: Any, dtype: torch.dtype, fill: float) -> Any:
    """``convert_boolean_attn_mask`` (``fill=-inf``) / ``_cudnn`` (``fill=-65504``)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    device = mask.device if fill == -math.inf else torch.device("cpu")
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype, device=device))


def _compute_logsumexp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``should_compute_logsumexp``."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _pad_last_dim(t: torch.Tensor, alignment: int, slice_back: bool) -> torch.Tensor:
    """``pad_last_dim<alignment, slice>`` / ``pad_bias<alignment>``."""
    last = t.size(-1)
    if last % alignment == 0 and not slice_back:
        return t
    padded = torch.constant_pad_nd(t, (0, alignment - last % alignment))
    return padded[..., :last] if slice_back else padded


def _aligned(t: torch.Tensor, alignment: int) -> bool:
    """``aligned_tensor<alignment>``."""
    return all(t.stride(i) % alignment == 0 for i in range(t.dim() - 1)) and t.stride(-1) == 1


def _math_mask(mask: Any, dtype: torch.dtype) -> Any:
    """``convert_boolean_attn_mask`` as the math path calls it in 2.10 to 2.15 (its ops
    on torch's own fake cuda tensors, ``tests/device_audit.py``): ``where(mask, 0, -inf)``,
    the zero a 0-d tensor of ``dtype`` on the mask's device; no ``logical_not``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device), -math.inf)


def _sdpa_math(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):  # type: ignore[no-untyped-def]
    """``_scaled_dot_product_attention_math`` with CUDA's ``at::dropout``
    (``native_dropout``); used when dropout is on, where meta's composite
    would take the bernoulli path. As the composite does: the scaling by a number
    (``mul.Scalar``), the boolean mask made additive without negating it
    (:func:`_math_mask`), the mask added out of place (the device audit found the
    scaling by a wrapped number, ``logical_not`` and an in-place add here before)."""
    origin = q.dtype
    reduce_low = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()

    def acc(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32) if (not reduce_low and t.dtype in HALVES and not t.is_nested) else t

    q_acc, k_acc, v_acc = acc(q), acc(k), acc(v)
    negative = scale is not None and scale < 0
    factor = math.sqrt(_scale(q_acc, abs(scale) if negative else scale))
    query = aten.mul.Scalar(q_acc, -factor if negative else factor)
    if is_causal:
        causal = torch.ones(query.size(-2), k_acc.size(-2), dtype=torch.bool, device=query.device).tril()
        mask = _math_mask(causal, query.dtype)
    if enable_gqa and not (q.size(-3) == k.size(-3) == v.size(-3)):
        k_acc = k_acc.repeat_interleave(query.size(-3) // k_acc.size(-3), -3)
        v_acc = v_acc.repeat_interleave(query.size(-3) // v_acc.size(-3), -3)
    attn = torch.matmul(query, aten.mul.Scalar(k_acc.transpose(-2, -1), factor))
    if mask is not None:
        attn = attn + mask
    attn = aten._safe_softmax.default(attn, -1)
    if dropout_p > 0.0:
        if dropout_p < 1.0 and attn.numel() > 0:
            attn = aten.native_dropout.default(attn, dropout_p, True)[0]
        else:
            attn = torch.dropout(attn, dropout_p, True)
    out = torch.matmul(attn, v_acc).to(origin)
    attn.to(origin)  # the second output of the op: made, then dropped by the caller
    return out


@route(NNFunctions.scaled_dot_product_attention)
def _sdpa(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::native::scaled_dot_product_attention``: the backend
    :func:`select_sdp_backend` picks for the trace's GPU, called as the composite does."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = bind(
        args, kwargs, names, (None, 0.0, False, None, False)
    )
    gpu = router.context.gpu
    if (
        gpu is None
        or not (on_gpu(q) and on_gpu(k) and on_gpu(v))
        or q.is_nested or k.is_nested or v.is_nested
        or not (q.dtype == k.dtype == v.dtype)
    ):
        return func(*args, **kwargs)
    backend = select_sdp_backend(q, k, v, mask, dropout_p, is_causal, enable_gqa, gpu.compute_capability)
    if backend == SDPBackend.CUDNN:
        # 2.10 and 2.11: convert_boolean_attn_mask_cudnn (-65504, a host scalar); from 2.12
        # (pytorch#177868) the cuDNN branch converts as the others (-inf, the zero a 0-d
        # tensor on the mask's device)
        fill = CUDNN_MASK_FILL if _release() < CUDNN_MASK_FILL_UNTIL_AFTER else -math.inf
        mask = _bool_mask_to_additive(mask, q.dtype, fill)
        out = aten._scaled_dot_product_cudnn_attention.default(
            q, k, v, mask, _compute_logsumexp(q, k, v), dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if backend == SDPBackend.FLASH:
        head = q.size(-1)
        og_scale = _scale(q, scale)
        qp, kp, vp = (_pad_last_dim(t, FLASH_HEAD_DIM_ALIGNMENT, False) for t in (q, k, v))
        out = aten._scaled_dot_product_flash_attention.default(
            qp, kp, vp, dropout_p, is_causal, False, scale=og_scale
        )[0]
        return out[..., :head] if out.size(-1) != head else out
    if backend == SDPBackend.EFFICIENT:
        mask = _bool_mask_to_additive(mask, q.dtype, -math.inf)
        if mask is not None:
            if not _aligned(mask, MEM_EFFICIENT_BIAS_ALIGNMENT):
                mask = _pad_last_dim(mask, MEM_EFFICIENT_BIAS_ALIGNMENT, True)
            mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        out = aten._scaled_dot_product_efficient_attention.default(
            q, k, v, mask, _compute_logsumexp(q, k, v), dropout_p, is_causal, scale=scale
        )
        return out[0]
    if backend == SDPBackend.MATH and dropout_p > 0.0:
        mask = _math_mask(mask, q.dtype)
        return _sdpa_math(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
    return func(*args, **kwargs)
