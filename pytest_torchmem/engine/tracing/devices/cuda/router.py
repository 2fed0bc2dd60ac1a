"""Routing of the decisions CUDA dispatch makes differently from the trace's meta tensors.

A torch-function mode, active while the fake ``cuda`` step runs: it sees each
``torch.*`` / ``Tensor.*`` / ``torch.nn.functional.*`` call before autograd
and the C++ composites do, so it can send a call to the op a GPU would run.
The trace's tensors live on ``meta``, which stands for the GPU; a handler
calls the CUDA kernel's aten op itself (which has a meta kernel), so autograd
records exactly the node, and the saved tensors, a GPU would. Each routing
rule follows a named function of torch 2.13/2.14:

* **device placement**: on a CPU-only torch, naming ``cuda`` in a factory or
  in ``.to()`` / ``.cuda()`` raises before dispatch ("not linked with support
  for cuda devices"), so those arguments are moved to the trace device;
* **dropout** (``aten/src/ATen/native/Dropout.cpp``, ``dropout``): with
  ``train`` and ``is_fused_kernel_acceptable`` (a CUDA input, ``0 < p < 1``,
  ``numel > 0``) CUDA runs ``native_dropout`` (output and a bool mask, saved
  for ``native_dropout_backward``); on meta the composite takes the
  ``bernoulli_``/``div_``/``mul`` path. ``dropout_`` (in place),
  ``feature_dropout`` (``dropout1d/2d/3d``) and the alpha dropouts take the
  composite path on CUDA too, so they are not routed;
* **batch norm** (``aten/src/ATen/native/Normalization.cpp``,
  ``_batch_norm_impl_index``): ``cudnn_batch_norm`` when its conditions hold,
  else ``native_batch_norm`` as on meta; ``instance_norm``'s composite is
  replayed so that its inner ``batch_norm`` is routed the same way;
* **scaled-dot-product attention** (``aten/src/ATen/native/transformers/
  attention.cpp``, ``scaled_dot_product_attention``, and
  ``transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``): the backend a
  GPU of the trace's profile would pick, by the checks of each backend in
  priority order, and the composite's own pre-processing (the boolean-mask
  conversion, flash's head-dim padding to a multiple of 8, the
  memory-efficient kernel's aligned bias);
* **RNNs** (``aten/src/ATen/native/RNN.cpp``, ``lstm`` / ``gru`` /
  ``rnn_tanh`` / ``rnn_relu`` and ``_cudnn_impl``): ``_cudnn_rnn`` when
  ``cudnn_is_acceptable`` holds; the ``lstm_cell`` / ``gru_cell`` of CUDA
  tensors run the fused ``_thnn_fused_lstm_cell`` / ``_gru_cell`` kernels;
* **softmax** (``aten/src/ATen/native/SoftMax.cpp``, ``softmax`` /
  ``log_softmax``): an fp16 CUDA input asked for fp32 runs the kernel with
  ``half_to_float`` instead of casting first;
* **autocast on cuda** (``aten/src/ATen/autocast_mode.cpp``/``.h``): the
  lower-precision, fp32, fp32-with-dtype, promote and banned lists, with the
  cache of cast leaf weights (see :class:`CudaRouter` for how an active CUDA
  autocast region is recognised on a CPU-only torch); the C++ composites that
  hide listed ops are replayed (``cross_entropy_loss``: ``log_softmax`` in the
  input dtype, ``nll_loss`` in fp32; ``_cudnn_rnn``: AutocastRNN.cpp's fp16 casts).

Not routed (a GPU takes another path than the trace): the inference fast paths
of ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention``
(``_transformer_encoder_layer_fwd`` / ``_native_multi_head_attention``, taken
in eval under ``no_grad`` on cuda), packed-sequence RNNs, and RNNs on CUDA
without cuDNN (their per-step fused cells).

Python-level torch functions (``torch.nn.functional.*``,
``torch.functional.*``) are run with the mode still active inside them
(``torch.overrides.redispatch_function``), so that what they call is routed
too (``F.multi_head_attention_forward`` calls ``dropout`` and
``scaled_dot_product_attention``). Every other call passes straight through
after one dictionary look-up.
"""

from __future__ import annotations

import math
import os
import types
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode
from torch.overrides import TorchFunctionMode

from pytest_torchmem.engine.torch_private import private
from pytest_torchmem.engine.torch_release import torch_minor as _release
from pytest_torchmem.engine.tracing.devices.routing import BodyRouting
from pytest_torchmem.engine.tracing.rules import TraceContext

__all__ = ["CUDNN_VERSION", "CudaRouter", "SDPBackend", "autocast_policy", "select_sdp_backend"]

aten = torch.ops.aten

_TRACE_DEVICE: Final = torch.device("meta")
# torch's private names (engine/torch_private.py): the C bindings the router's keys are,
# autocast's entry points, the torch-function mode stack, the SDPA backends' order
_VariableFunctions: Final = private("torch._C._VariableFunctions")
_nn: Final = private("torch._C._nn")
_linalg: Final = private("torch._C._linalg")
TensorBase: Final = private("torch._C.TensorBase")
_ENTER_AUTOCAST: Final = private("torch.amp.autocast_mode._enter_autocast")
_EXIT_AUTOCAST: Final = private("torch.amp.autocast_mode._exit_autocast")
_get_current_function_mode_stack: Final = private("torch.overrides._get_current_function_mode_stack")
_get_sdp_priority_order: Final = private("torch._C._get_sdp_priority_order")

_FLOATS: Final = (torch.float16, torch.bfloat16, torch.float32)
_HALVES: Final = (torch.float16, torch.bfloat16)

#: The cuDNN each torch release's PyPI CUDA wheel installs (``cudnnGetVersion()``,
#: read as ``torch.backends.cudnn.version()`` in each: nvidia-cudnn 9.10.2 for
#: 2.10.0+cu128, 9.19 for 2.11.0+cu130, 9.20 for 2.12.1 and 2.13.0, 9.24 for
#: 2.14.1, 9.26 for 2.15.0+cu132); a CPU build models the CUDA wheel of its release.
_CUDNN_OF_RELEASE: Final = {
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
    release = _release() if release is None else release
    known = sorted(_CUDNN_OF_RELEASE)
    release = min(max(release, known[0]), known[-1])
    return _CUDNN_OF_RELEASE[release]


#: The cuDNN version modelled for the installed torch (see :func:`cudnn_version`).
CUDNN_VERSION: Final = cudnn_version()
#: ``CUDNN_BN_MIN_EPSILON`` of cuDNN >= 7.5 (``cudnn.h``).
_CUDNN_BN_MIN_EPSILON: Final = 0.0


Handler = Callable[["CudaRouter", Any, Any, tuple[Any, ...], dict[str, Any]], Any]
_ROUTES: dict[Any, Handler] = {}


def _route(*funcs: Any) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for func in funcs:
            if func in _ROUTES:
                raise ValueError(f"{func} is routed twice")
            _ROUTES[func] = handler
        return handler

    return register


# -- device placement -----------------------------------------------------------


def _names_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":", 1)[0] == "cuda"
    return False


def _place(value: Any) -> Any:
    return _TRACE_DEVICE if _names_cuda(value) else value


def _on_gpu(t: Any) -> bool:
    """Whether ``t`` is a tensor of the modelled GPU (the trace keeps those on meta)."""
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...], defaults: tuple[Any, ...]) -> list[Any]:
    """Positional-or-keyword arguments ``names`` of a call, with ``defaults`` for the
    trailing ones (as many as given)."""
    out = []
    first_default = len(names) - len(defaults)
    for i, name in enumerate(names):
        if i < len(args):
            out.append(args[i])
        elif name in kwargs:
            out.append(kwargs[name])
        else:
            out.append(defaults[i - first_default])
    return out


def _autocast_nesting() -> int:
    """The autocast nesting level (``at::autocast::nesting``), read without changing it."""
    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level


# -- the mode -------------------------------------------------------------------


class CudaRouter(BodyRouting, PreDispatchTorchFunctionMode):
    """Sends calls that CUDA dispatch resolves differently to the CUDA kernels' ops.

    **Autocast on cuda.** On a CPU-only torch, ``torch.autocast("cuda", ...)``
    finds ``amp_definitely_not_available()``, warns and enters *disabled*;
    within the trace it enters enabled instead, as on a GPU
    (:func:`~pytest_torchmem.engine.tracing.devices.cuda.gpu_view.autocast_opens_cuda_regions`).
    The regions are also followed as they open and close, for a region entered
    disabled where that is not in force: ``torch.autocast.__enter__`` /
    ``__exit__`` report ``(device_type, dtype, enabled, cache_enabled)`` to
    every ``PreDispatchTorchFunctionMode`` on the torch-function mode stack (the
    hook ``torch.export`` uses to keep autocast in pre-dispatch graphs), which
    this mode is. CUDA autocast is then active with the dtype of the innermost
    open ``cuda`` region, none where that region is disabled
    (``autocast("cuda", enabled=False)``, as transformers' rotary embeddings
    force float32); CPU regions leave it alone, as they leave CUDA tensors
    alone. Limit: a region entered before the trace starts is inferred from
    the nesting level (above 0 with CPU autocast off).
    The cache of cast leaf weights is dropped when the nesting level is back
    at 0, as ``torch.autocast.__exit__`` does with ``clear_autocast_cache``.
    """

    def __init__(self, context: TraceContext) -> None:
        TorchFunctionMode.__init__(self)
        # PreDispatchTorchFunctionMode's own state, unused: this mode records no graph.
        self.tracer = None
        self.enter_autocast_nodes = []
        self.context = context
        # id(leaf weight) -> (weak reference to it, its cast), as at::autocast's cached_casts
        self._cast_cache: dict[int, tuple[weakref.ref[Any], torch.Tensor]] = {}
        # Python-level functions whose body runs now with the mode active
        self._running: set[Any] = set()
        # Open autocast regions: (device type, dtype)
        self._regions: list[tuple[str, torch.dtype]] = []
        self._outer_cuda: torch.dtype | None = None
        if torch.is_autocast_enabled("cuda") or (
            _autocast_nesting() > 0 and not torch.is_autocast_enabled("cpu")
        ):
            self._outer_cuda = torch.get_autocast_dtype("cuda")

    def __torch_function__(self, func, types_, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _ENTER_AUTOCAST or func is _EXIT_AUTOCAST:
            return self._autocast_event(func, args, kwargs)
        policy = _AUTOCAST.get(func)
        if policy is not None:
            dtype = self.autocast_dtype()
            if dtype is not None:
                args, kwargs = policy(self, dtype, args, kwargs)
        handler = _ROUTES.get(func)
        if handler is not None:
            return handler(self, func, types_, args, kwargs)
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _TRACE_DEVICE}
        if self.runs_body(func):
            return self.run_body(func, types_, args, kwargs)
        return func(*args, **kwargs)

    # -- autocast ---------------------------------------------------------------

    def _autocast_event(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An autocast region opens or closes.

        From ``autocast.__enter__``/``__exit__`` the region is already entered or
        left (this mode is still on the stack): only record it. Called through
        ``torch.amp._enter_autocast``/``_exit_autocast`` (this mode popped), enter
        or leave it too.
        """
        notified = self in _get_current_function_mode_stack()
        result = None if notified else func(*args, **kwargs)
        if func is _ENTER_AUTOCAST:
            device = args[0] if args else kwargs.get("device_type")
            dtype = args[1] if len(args) > 1 and args[1] is not None else torch.get_autocast_dtype(device)
            enabled = args[2] if len(args) > 2 else kwargs.get("enabled", True)
            self._regions.append((device, dtype if enabled else None))
        elif self._regions:
            self._regions.pop()
            if _autocast_nesting() == 0:
                self._cast_cache.clear()
        return result

    def autocast_dtype(self) -> torch.dtype | None:
        """The lower-precision dtype of the active CUDA autocast region, or None (none
        open, or the innermost one disabled)."""
        if torch.is_autocast_enabled("cuda"):
            return torch.get_autocast_dtype("cuda")
        for device, dtype in reversed(self._regions):
            if device == "cuda":
                return dtype
        return self._outer_cuda

    def cast(self, t: Any, dtype: torch.dtype, lower: torch.dtype) -> Any:
        """``cached_cast`` (``autocast_mode.h``): ``t`` in ``dtype`` if eligible."""
        if isinstance(t, (list, tuple)):
            return type(t)(self.cast(v, dtype, lower) for v in t)
        if not _eligible(t) or t.dtype == dtype:
            return t
        cacheable = (
            dtype == lower
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return t.to(dtype)
        hit = self._cast_cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        cast = t.to(dtype)
        self._cast_cache[id(t)] = (weakref.ref(t), cast)
        return cast


def _eligible(t: Any) -> bool:
    """``is_eligible`` for CUDA: a defined floating tensor on the GPU, not float64."""
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "meta"
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


# -- dropout --------------------------------------------------------------------


@_route(_VariableFunctions.dropout)
def _dropout(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::native::dropout``: the fused ``native_dropout`` when
    ``is_fused_kernel_acceptable(input, p)`` and ``train``."""
    input, p, train = _bind(args, kwargs, ("input", "p", "train"), ())
    if (
        train
        and _on_gpu(input)
        and not input.is_nested
        and 0 < p < 1
        and input.numel() > 0
    ):
        return aten.native_dropout.default(input, p, True)[0]
    return func(*args, **kwargs)


# -- batch norm -----------------------------------------------------------------


def _suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``TensorBase::suggest_memory_format``: channels-last when the strides are."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def use_cudnn_batch_norm(
    input: torch.Tensor,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    training: bool,
    eps: float,
    cudnn_enabled: bool,
) -> bool:
    """The ``use_cudnn`` condition of ``_batch_norm_impl_index`` (Normalization.cpp)."""
    return (
        _on_gpu(input)
        and isinstance(weight, torch.Tensor)
        and isinstance(bias, torch.Tensor)
        and input.dtype != torch.bfloat16
        and weight.dtype != torch.bfloat16
        and (input.dtype != torch.float16 or weight.dtype == torch.float32)
        and input.dtype in (torch.float16, torch.float32, torch.float64)
        and (
            (isinstance(running_mean, torch.Tensor) and isinstance(running_var, torch.Tensor))
            or (running_mean is None and running_var is None and training)
        )
        and input.dim() >= 3
        and ((input.size(0) <= 880801 and training) or (input.size(0) <= 65535 and not training))
        and eps >= _CUDNN_BN_MIN_EPSILON
        and bool(cudnn_enabled)
    )


def _cudnn_batch_norm(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, running_mean: Any, running_var: Any,
    training: bool, momentum: float, eps: float,
) -> torch.Tensor:
    """The cuDNN branch of ``_batch_norm_impl_index``: contiguous operands, then
    ``cudnn_batch_norm`` (output, save_mean, save_var, reserve)."""
    input_c = input.contiguous(memory_format=_suggest_memory_format(input))
    rmean = running_mean.contiguous() if running_mean is not None else None
    rvar = running_var.contiguous() if running_var is not None else None
    out = aten.cudnn_batch_norm.default(
        input_c, weight.contiguous(), bias.contiguous(), rmean, rvar, bool(training), momentum, eps
    )
    return out[0]


@_route(_VariableFunctions.batch_norm)
def _batch_norm(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::batch_norm`` -> ``_batch_norm_impl_index``: cuDNN when it may, else the
    native kernel (the same ops as on meta)."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn_enabled")
    input, weight, bias, rmean, rvar, training, momentum, eps, cudnn_enabled = _bind(args, kwargs, names, ())
    if use_cudnn_batch_norm(input, weight, bias, rmean, rvar, training, eps, cudnn_enabled):
        return _cudnn_batch_norm(input, weight, bias, rmean, rvar, training, momentum, eps)
    return func(*args, **kwargs)


@_route(_VariableFunctions.instance_norm)
def _instance_norm(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::instance_norm`` (Normalization.cpp): the input viewed as ``(1, b*c, ...)``
    through ``batch_norm`` with repeated affine parameters and running stats,
    replayed here so that the inner ``batch_norm`` takes cuDNN when it may."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "use_input_stats", "momentum", "eps", "cudnn_enabled")
    input, weight, bias, rmean, rvar, use_input_stats, momentum, eps, cudnn_enabled = _bind(args, kwargs, names, ())
    if not _on_gpu(input) or input.dim() < 2:
        return func(*args, **kwargs)
    b, c = input.size(0), input.size(1)
    shape = (1, b * c, *input.shape[2:])
    input_r = input.contiguous().view(shape)
    weight_ = weight.repeat(b) if weight is not None else None
    bias_ = bias.repeat(b) if bias is not None else None
    rmean_ = rmean.repeat(b) if rmean is not None else None
    rvar_ = rvar.repeat(b) if rvar is not None else None
    if not use_cudnn_batch_norm(input_r, weight_, bias_, rmean_, rvar_, use_input_stats, eps, cudnn_enabled):
        return func(*args, **kwargs)
    out = _cudnn_batch_norm(input_r, weight_, bias_, rmean_, rvar_, use_input_stats, momentum, eps)
    with torch.no_grad():
        if rmean is not None:
            torch.ops.aten.alias(rmean).copy_(rmean_.view(b, c).mean(0, keepdim=False))
        if rvar is not None:
            torch.ops.aten.alias(rvar).copy_(rvar_.view(b, c).mean(0, keepdim=False))
    return out.view(input.shape)


# -- scaled-dot-product attention ----------------------------------------------


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
    if CUDNN_VERSION <= 91500 or cc[0] not in (9, 10):
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
    allowed = _HALVES if cc[0] >= 8 else (torch.float16,)
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
    if not (d == k.size(-1) == v.size(-1) and d <= 256):
        return False
    if not _sm_in(cc, (8, 0), (12, 1)):
        return False
    sm86_89 = _sm_in(cc, (8, 6), (8, 9)) or _sm_in(cc, (12, 0), (12, 1))
    if _requires_grad(q, k, v) and sm86_89 and ((192 < d <= 224) or (d > 224 and dropout_p > 0)):
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
    if not _sm_in(cc, (5, 0), (12, 1)):
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    is_half = q.dtype in _HALVES
    align = 4 if cc[0] >= 8 else 1
    if cc[0] >= 8 or (cc[0] >= 7 and is_half):  # use_tensor_cores
        align = max(align, 128 // (16 if is_half else 32))
    dq, dv = q.size(-1), v.size(-1)
    if not (dq == k.size(-1) and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    if not _dense_checks(q, k, v, mask, False, enable_gqa, False):
        return False
    allowed = _FLOATS if cc[0] >= 8 else (torch.float16, torch.float32)
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
    per = 8 if q.dtype in _HALVES else 4
    return all(t.storage_offset() % per == 0 for t in (q, k, v))


def _can_use_cudnn(q, k, v, mask, dropout_p, is_causal, enable_gqa, cc) -> bool:  # type: ignore[no-untyped-def]
    """``can_use_cudnn_attention`` (sdp_utils.cpp), for the cuDNN of :data:`CUDNN_VERSION`."""
    if dropout_p > 0.0 and 91100 < CUDNN_VERSION < 91400:
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not _low_precision_ok(q, cc) or not _attn_mask_shape_ok(q, k, mask):
        return False
    if not _sm_in(cc, (8, 0), (12, 1)):
        return False
    if not _dense_checks(q, k, v, mask, True, True, True):
        return False
    # check_cudnn_tensor_shapes
    s_q, s_k, d_qk, d_v = q.size(2), k.size(2), q.size(3), v.size(3)
    head_limit = 256 if (CUDNN_VERSION >= 91000 and cc == (9, 0)) else 128
    if d_qk > head_limit or d_v > head_limit or d_qk % 8 or d_v % 8:
        return False
    # cuDNN takes no key/value of length 1, nor a query of length 1 with dropout
    if s_k == 1 or (s_q == 1 and dropout_p != 0.0):
        return False
    return _cudnn_bprop_head_dims_ok(q, k, v, cc)


def _cudnn_bprop_head_dims_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cc: tuple[int, int]) -> bool:
    """``check_cudnn_d256_bprop_head_dim`` (sdp_utils.cpp from torch 2.14, read from its
    ``libtorch_cuda.so``): when a gradient is needed, on sm90 (compute capability
    (9, 0)) or 10.x (but (10, 7) with a cuDNN up to 9.25) with a cuDNN newer than
    9.22, cuDNN's backward takes head dims (d_qk, d_v) of at most (128, 128),
    (192, 128) or (256, 256) only."""
    if _release() < (2, 14) or not _requires_grad(q, k, v) or CUDNN_VERSION <= 92200:
        return True
    if not (cc == (9, 0) or (cc[0] == 10 and (CUDNN_VERSION > 92500 or cc != (10, 7)))):
        return True
    d_qk, d_v = q.size(3), v.size(3)
    return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))


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


def _sdpa_math(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):  # type: ignore[no-untyped-def]
    """``_scaled_dot_product_attention_math`` with CUDA's ``at::dropout``
    (``native_dropout``); used when dropout is on, where meta's composite
    would take the bernoulli path."""
    origin = q.dtype
    reduce_low = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()

    def acc(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32) if (not reduce_low and t.dtype in _HALVES and not t.is_nested) else t

    q_acc, k_acc, v_acc = acc(q), acc(k), acc(v)
    negative = scale is not None and scale < 0
    factor = math.sqrt(_scale(q_acc, abs(scale) if negative else scale))
    query = q_acc * (-factor if negative else factor)
    if is_causal:
        causal = torch.ones(query.size(-2), k_acc.size(-2), dtype=torch.bool, device=query.device).tril()
        mask = _bool_mask_to_additive(causal, query.dtype, -math.inf)
    if enable_gqa and not (q.size(-3) == k.size(-3) == v.size(-3)):
        k_acc = k_acc.repeat_interleave(query.size(-3) // k_acc.size(-3), -3)
        v_acc = v_acc.repeat_interleave(query.size(-3) // v_acc.size(-3), -3)
    attn = torch.matmul(query, k_acc.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)
    attn = aten._safe_softmax.default(attn, -1)
    if dropout_p > 0.0:
        if dropout_p < 1.0 and attn.numel() > 0:
            attn = aten.native_dropout.default(attn, dropout_p, True)[0]
        else:
            attn = torch.dropout(attn, dropout_p, True)
    out = torch.matmul(attn, v_acc).to(origin)
    attn.to(origin)  # the second output of the op: made, then dropped by the caller
    return out


@_route(_nn.scaled_dot_product_attention)
def _sdpa(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::native::scaled_dot_product_attention``: the backend
    :func:`select_sdp_backend` picks for the trace's GPU, called as the composite does."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _bind(
        args, kwargs, names, (None, 0.0, False, None, False)
    )
    gpu = router.context.gpu
    if (
        gpu is None
        or not (_on_gpu(q) and _on_gpu(k) and _on_gpu(v))
        or q.is_nested or k.is_nested or v.is_nested
        or not (q.dtype == k.dtype == v.dtype)
    ):
        return func(*args, **kwargs)
    backend = select_sdp_backend(q, k, v, mask, dropout_p, is_causal, enable_gqa, gpu.compute_capability)
    if backend == SDPBackend.CUDNN:
        mask = _bool_mask_to_additive(mask, q.dtype, -65504.0)
        out = aten._scaled_dot_product_cudnn_attention.default(
            q, k, v, mask, _compute_logsumexp(q, k, v), dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if backend == SDPBackend.FLASH:
        head = q.size(-1)
        og_scale = _scale(q, scale)
        qp, kp, vp = (_pad_last_dim(t, 8, False) for t in (q, k, v))
        out = aten._scaled_dot_product_flash_attention.default(
            qp, kp, vp, dropout_p, is_causal, False, scale=og_scale
        )[0]
        return out[..., :head] if out.size(-1) != head else out
    if backend == SDPBackend.EFFICIENT:
        mask = _bool_mask_to_additive(mask, q.dtype, -math.inf)
        if mask is not None:
            if not _aligned(mask, 8):
                mask = _pad_last_dim(mask, 8, True)
            mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        out = aten._scaled_dot_product_efficient_attention.default(
            q, k, v, mask, _compute_logsumexp(q, k, v), dropout_p, is_causal, scale=scale
        )
        return out[0]
    if backend == SDPBackend.MATH and dropout_p > 0.0:
        mask = _bool_mask_to_additive(mask, q.dtype, -math.inf)
        return _sdpa_math(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
    return func(*args, **kwargs)


# -- softmax ----------------------------------------------------------------------


def _softmax_handler(op: Any) -> Handler:
    def handler(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``softmax`` / ``log_softmax`` (SoftMax.cpp): a CUDA fp16 input asked for an
        fp32 result runs ``_softmax(input, dim, half_to_float=True)``, with no
        cast copy (elsewhere, and on meta, the input is converted first)."""
        if len(args) >= 2 and isinstance(args[0], torch.Tensor) and isinstance(args[1], int):
            input, dim = args[0], args[1]
            dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
            if (
                _on_gpu(input)
                and input.dtype == torch.float16
                and dtype == torch.float32
                and len(args) <= 3
                and set(kwargs) <= {"dtype"}
            ):
                return op(input, dim, True)
        return func(*args, **kwargs)

    return handler


_route(_VariableFunctions.softmax, TensorBase.softmax)(_softmax_handler(aten._softmax.default))
_route(_VariableFunctions.log_softmax, TensorBase.log_softmax)(
    _softmax_handler(aten._log_softmax.default)
)


# -- RNN ------------------------------------------------------------------------

#: ``cudnnRNNMode_t``.
RNN_RELU, RNN_TANH, LSTM, GRU = 0, 1, 2, 3


def cudnn_is_acceptable(t: Any) -> bool:
    """``at::native::cudnn_is_acceptable`` (``aten/src/ATen/native/TensorProperties.cpp``),
    with bfloat16 on sm80+ (``supportsBFloat16RNNWithCuDNN``, used by ``use_cudnn``)."""
    return (
        _on_gpu(t)
        and torch.backends.cudnn.enabled
        and t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        and t.numel() > 0
    )


def _rnn_handler(mode: int) -> Handler:
    def handler(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (RNN.cpp) with a padded input:
        ``_cudnn_impl`` -> ``_cudnn_rnn`` when ``cudnn_is_acceptable``."""
        if kwargs or len(args) != 9 or not isinstance(args[2], (list, tuple)):
            return func(*args, **kwargs)  # the packed-sequence overloads
        input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
        if not cudnn_is_acceptable(input) or input.dim() != 3:
            return func(*args, **kwargs)
        if mode == LSTM:
            h, c = hx
        else:
            h, c = hx, None
        hidden_size, proj_size = h.size(2), 0
        if c is not None and c.size(2) != h.size(2):
            hidden_size, proj_size = c.size(2), h.size(2)
        weight_stride0 = (4 if has_biases else 2) + (1 if proj_size else 0)
        weights = list(params)
        if router.autocast_dtype() is not None and _eligible(weights[0]) and weights[0].dtype != torch.float16:
            # AutocastRNN.cpp, _cudnn_rnn_cast_reflatten: input and states through
            # cached_cast(kHalf) (fp16 whatever the autocast dtype), the weights
            # copied, autograd-exposed, into fp16 (cuDNN's flat fp16 buffer is
            # modelled as one cast per weight: the same bytes).
            half = torch.float16
            input, h = router.cast(input, half, half), router.cast(h, half, half)
            c = router.cast(c, half, half) if c is not None else None
            weights = [w.to(half) for w in weights]
        out = aten._cudnn_rnn.default(
            input, weights, weight_stride0, None, h, c, mode, hidden_size, proj_size,
            num_layers, batch_first, float(dropout), bool(train), bool(bidirectional), [], None,
        )
        output, hy, cy = out[0], out[1], out[2]
        return (output, hy, cy) if mode == LSTM else (output, hy)

    return handler


for _mode, _funcs in (
    (LSTM, (_VariableFunctions.lstm,)),
    (GRU, (_VariableFunctions.gru,)),
    (RNN_TANH, (_VariableFunctions.rnn_tanh,)),
    (RNN_RELU, (_VariableFunctions.rnn_relu,)),
):
    _route(*_funcs)(_rnn_handler(_mode))


@_route(_VariableFunctions.lstm_cell)
def _lstm_cell(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``lstm_cell`` -> ``LSTMCell<CellParams>`` (RNN.cpp): on CUDA the gates are two
    matmuls and ``_thnn_fused_lstm_cell`` (hy, cy and a (n, 4h) workspace saved for
    backward); on meta the composite cell runs elementwise ops."""
    input, hx, w_ih, w_hh, b_ih, b_hh = _bind(args, kwargs, ("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), (None, None))
    if not _on_gpu(input):
        return func(*args, **kwargs)
    igates = torch.matmul(input, w_ih.t())
    hgates = torch.matmul(hx[0], w_hh.t())
    hy, cy, _workspace = aten._thnn_fused_lstm_cell.default(igates, hgates, hx[1], b_ih, b_hh)
    return hy, cy


@_route(_VariableFunctions.gru_cell)
def _gru_cell(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``gru_cell`` -> ``GRUCell<CellParams>`` (RNN.cpp): on CUDA two matmuls and
    ``_thnn_fused_gru_cell`` (hy and a (n, 5h) workspace saved for backward)."""
    input, hx, w_ih, w_hh, b_ih, b_hh = _bind(args, kwargs, ("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), (None, None))
    if not _on_gpu(input):
        return func(*args, **kwargs)
    igates = torch.matmul(input, w_ih.t())
    hgates = torch.matmul(hx, w_hh.t())
    return aten._thnn_fused_gru_cell.default(igates, hgates, hx, b_ih, b_hh)[0]


# -- autocast on cuda ------------------------------------------------------------

Policy = Callable[[CudaRouter, torch.dtype, tuple[Any, ...], dict[str, Any]], "tuple[tuple[Any, ...], dict[str, Any]]"]


def _cast_all(router: CudaRouter, to: torch.dtype, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast every eligible argument, last argument first: autocast's wrapper casts
    them in a C++ pack expansion, which GCC evaluates right to left (a CUDA build
    casts ``linear``'s bias, then weight, then input; ``benchmarks/cuda_routing.py``)."""
    values = [*args, *kwargs.values()]
    cast = [router.cast(value, to, lower) for value in reversed(values)][::-1]
    return tuple(cast[: len(args)]), dict(zip(kwargs, cast[len(args) :]))


def _lower_precision(router: CudaRouter, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy::lower_precision_fp``: every eligible tensor to the autocast dtype."""
    return _cast_all(router, lower, lower, args, kwargs)


def _fp32(router: CudaRouter, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy::fp32``: every eligible tensor to float32."""
    return _cast_all(router, torch.float32, lower, args, kwargs)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def _fp32_set_opt_dtype(router: CudaRouter, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy::fp32_set_opt_dtype``: when the first argument is eligible and no
    dtype was given, the op is asked for a float32 result."""
    if not _eligible(_first_tensor(args, kwargs)):
        return args, kwargs
    if kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args):
        return args, kwargs
    return args, {**kwargs, "dtype": torch.float32}


def _promote(router: CudaRouter, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy::promote``: the widest eligible type (float32 if any eligible
    argument is float32, else the autocast dtype) for every eligible tensor."""
    to = lower
    for a in (*args, *kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        if any(_eligible(t) and t.dtype == torch.float32 for t in items):
            to = torch.float32
    return _cast_all(router, to, lower, args, kwargs)


def _banned(router: CudaRouter, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy`` ``banned`` (binary_cross_entropy): autocast refuses it."""
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast."
    )


_LOWER_PRECISION_OPS: Final = (
    "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d "
    "convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm "
    "chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
    "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention "
    "cudnn_convolution cudnn_convolution_transpose __matmul__ __rmatmul__"
)
_FP32_OPS: Final = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__ __rpow__ "
    "softplus layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity "
    "poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d nll_loss_nd hinge_embedding_loss kl_div "
    "l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss "
    "triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist _cdist_forward "
    "renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d "
    "_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d "
    "upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
)
#: fp32-list entries of some releases only (each release's AutocastCUDA kernels, as
#: ``torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA")`` lists them):
#: ``rms_norm`` from 2.12 (beside ``native_layer_norm`` in ``AT_FORALL_FP32``),
#: ``linalg_matrix_sqrth`` from 2.14 (new then; it refuses half types).
_FP32_OPS_SINCE: Final = {"rms_norm": (2, 12), "linalg_matrix_sqrth": (2, 14)}
_FP32_SET_OPT_DTYPE_OPS: Final = (
    "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm"
)
_PROMOTE_OPS: Final = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"


def _bindings(name: str) -> list[Any]:
    """The C-level callables that are bindings of the aten op ``name``."""
    found = []
    homes: list[tuple[Any, str]] = [
        (_VariableFunctions, name),
        (_nn, name),
        (TensorBase, name),
    ]
    if name.startswith("linalg_"):
        homes.append((_linalg, name))
    for home, attr in homes:
        func = getattr(home, attr, None)
        if func is not None and type(func) is not types.FunctionType and func not in found:
            found.append(func)
    return found


def _table() -> dict[Any, Policy]:
    table: dict[Any, Policy] = {}
    for names, policy in (
        (_LOWER_PRECISION_OPS, _lower_precision),
        (_FP32_OPS, _fp32),
        (" ".join(n for n, since in _FP32_OPS_SINCE.items() if _release() >= since), _fp32),
        (_FP32_SET_OPT_DTYPE_OPS, _fp32_set_opt_dtype),
        (_PROMOTE_OPS, _promote),
        ("binary_cross_entropy", _banned),
    ):
        for name in names.split():
            for func in _bindings(name):
                table.setdefault(func, policy)
    return table


#: Torch-function entry point -> autocast policy, for the ops autocast_mode.cpp lists for CUDA.
_AUTOCAST: Final[dict[Any, Policy]] = _table()


def autocast_policy(func: Any) -> str | None:
    """The name of the autocast policy applied to ``func`` on cuda (for tests and docs)."""
    policy = _AUTOCAST.get(func)
    return None if policy is None else policy.__name__.lstrip("_")


@_route(_nn.cross_entropy_loss)
def _cross_entropy(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cross_entropy_loss`` (LossNLL.cpp) under CUDA autocast: the composite calls
    ``log_softmax(self, 1, self.scalar_type())`` (its dtype given, so it stays in
    the input dtype) and ``nll_loss_nd`` -> ``nll_loss`` (fp32 list: the log
    probabilities are cast to float32). Other targets and label smoothing run as traced."""
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    input, target, weight, reduction, ignore_index, smoothing = _bind(
        args, kwargs, names, (None, 1, -100, 0.0)
    )
    if (
        router.autocast_dtype() is None
        or not _eligible(input)
        or input.dim() < 1
        or target.is_floating_point()
        or smoothing > 0.0
    ):
        return func(*args, **kwargs)
    lower = router.autocast_dtype()
    assert lower is not None
    class_dim = 0 if input.dim() == 1 else 1
    logp = torch.log_softmax(input, class_dim, dtype=input.dtype)
    logp = router.cast(logp, torch.float32, lower)
    weight = router.cast(weight, torch.float32, lower)
    return _nn.nll_loss_nd(logp, target, weight, reduction, ignore_index)


# -- device placement handlers ----------------------------------------------------


@_route(torch.Tensor.cuda)
def _tensor_cuda(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0].to(_TRACE_DEVICE, non_blocking=kwargs.get("non_blocking", False))


@_route(torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)
def _from_data(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A tensor made on the GPU from Python data (a list, numbers, an array): made on
    the host and copied, as CUDA does. Made on the trace's ``meta`` device it would
    reach no dispatcher (``torch.tensor(data, device="meta")`` makes a plain meta
    tensor): the fake mode and the tracker would never see it, its memory uncounted."""
    method = func is torch.Tensor.new_tensor
    data = args[1] if method else (args[0] if args else kwargs.get("obj", kwargs.get("data")))
    device = kwargs.get("device", args[0].device if method else None)
    on_gpu = _names_cuda(device) or (isinstance(device, torch.device) and device == _TRACE_DEVICE)
    if not on_gpu or isinstance(data, torch.Tensor):
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _place(device)}
        return func(*args, **kwargs)
    host = {key: value for key, value in kwargs.items() if key not in ("device", "requires_grad", "pin_memory")}
    if method:
        host.setdefault("dtype", args[0].dtype)
        made = torch.tensor(data, **host)
    else:
        made = func(*args, **host)
    placed = made.to(_TRACE_DEVICE)
    return placed.requires_grad_() if kwargs.get("requires_grad") else placed


@_route(torch.Tensor.to, torch.Tensor.new_empty)
def _tensor_to(router: CudaRouter, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "device" in kwargs and _names_cuda(kwargs["device"]):
        kwargs = {**kwargs, "device": _TRACE_DEVICE}
    return func(*(_place(a) for a in args), **kwargs)
