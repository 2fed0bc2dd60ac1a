"""The CUDA routing rules: which op the fake ``cuda`` trace runs, and the bytes it makes.

Each expected figure is worked out by hand from the CUDA kernel's logic in
torch 2.13/2.14 (the docstrings say how); none is read back from the code.
Ops are read from the trace's storage timeline: every allocation with the op
that made it, and whether it was the op's output or kernel scratch.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend as Backend
from torch.nn.attention import sdpa_kernel

import pytest_torchmem as tm
import pytest_torchmem.engine.tracing.trace as trace_module
from pytest_torchmem.engine.figures.report import Category
from pytest_torchmem.engine.figures.timeline import ALLOC, PHASE
from pytest_torchmem.engine.torch_compat.torch_release import installed_release
from pytest_torchmem.engine.tracing.devices.cuda import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.kernels import flash_num_splits
from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.engine.tracing.devices.cuda.router import (
    SDPBackend,
    autocast_policy,
    select_sdp_backend,
)
from pytest_torchmem.engine.tracing.devices.cuda import kernel_choices as cuda_kernel_choices
from pytest_torchmem.engine.tracing.devices.cuda import rnn as cuda_rnn
from pytest_torchmem.engine.tracing.devices.cuda import sdpa as cuda_sdpa
from pytest_torchmem.engine.tracing.rules import Inexact, OpCall, TraceContext
from torch_sources import (
    cuda_library,
    cudnn_header_text,
    disassembly,
    has_function,
    immediates,
    instructions,
    library,
    wheel_requirement,
)

FWD, BWD, STEP = 0, 1, 2
OUT, SCRATCH = "out", "scratch"


def trace(model: nn.Module, inputs: Any, **options: Any) -> tuple[tm.MemoryReport, list[tuple[int, str, int, str]]]:
    """Estimate on cuda; also return ``(phase, op, nbytes, out|scratch)`` of every allocation."""
    captured: dict[str, Any] = {}
    analyze = trace_module.analyze

    def capture(timeline: Any, baseline: Any, allocator: Any = None) -> Any:
        captured["timeline"] = timeline
        return analyze(timeline, baseline, allocator)

    options.setdefault("device", "cuda")
    with mock.patch.object(trace_module, "analyze", capture), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = tm.estimate(model, inputs, **options)
    timeline = captured["timeline"]
    rows, phase = [], -1
    for kind, a, b in timeline.events:
        if kind == PHASE:
            phase = a
        elif kind == ALLOC:
            info = timeline.storages[a]
            rows.append((phase, info.op, b, SCRATCH if info.category == Category.WORKSPACE else OUT))
    return report, rows


def of(rows: list[tuple[int, str, int, str]], op: str, phase: int | None = None) -> list[tuple[int, str]]:
    """``(nbytes, out|scratch)`` of the allocations ``op`` made (in ``phase``)."""
    return [(n, kind) for p, o, n, kind in rows if o == op and (phase is None or p == phase)]


def ops(rows: list[tuple[int, str, int, str]]) -> set[str]:
    return {o for _p, o, _n, _k in rows}


class Fn(nn.Module):
    """A module running ``fn`` on its inputs (after an optional linear layer)."""

    def __init__(self, fn: Any, features: int | None = None) -> None:
        super().__init__()
        self.fn = fn
        self.fc = nn.Linear(features, features) if features else None

    def forward(self, *xs: torch.Tensor) -> Any:
        if self.fc is not None:
            xs = (self.fc(xs[0]), *xs[1:])
        return self.fn(*xs)


def meta(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


@contextlib.contextmanager
def env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


# -- dropout ------------------------------------------------------------------------


def test_dropout_takes_the_fused_kernel_with_a_bool_mask() -> None:
    """Dropout.cpp ``dropout``: training, CUDA, 0 < p < 1 -> ``native_dropout``: the
    output (4 x 16 fp32 = 256 B) and a bool mask (64 B), saved for
    ``native_dropout_backward`` (its output 256 B); no bernoulli noise tensor."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1))
    _, rows = trace(model, torch.randn(4, 16))
    assert of(rows, "aten.native_dropout.default", FWD) == [(256, OUT), (64, OUT)]
    assert of(rows, "aten.native_dropout_backward.default", BWD) == [(256, OUT)]
    assert not {"aten.bernoulli_.float", "aten.empty_like.default"} & ops(rows)


def test_dropout_cases_that_take_the_composite_on_cuda_too() -> None:
    """``dropout_`` (in place), ``feature_dropout`` (dropout2d) and p = 0 do not use the
    fused kernel on CUDA either (Dropout.cpp); eval mode returns the input."""
    for module in (nn.Dropout(0.1, inplace=True), nn.Dropout2d(0.1), nn.Dropout(0.0)):
        _, rows = trace(nn.Sequential(nn.Linear(16, 16), module), torch.randn(4, 16, 1, 1).flatten(1))
        assert "aten.native_dropout.default" not in ops(rows), module
    eval_model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1)).eval()
    _, rows = trace(eval_model, torch.randn(4, 16))
    assert "aten.native_dropout.default" not in ops(rows)


def test_dropout_inside_python_functions_is_routed() -> None:
    """``F.multi_head_attention_forward`` (need_weights=True) calls ``dropout`` on the
    attention weights from Python: routed too (batch 2, 2 heads, 8 x 8 weights:
    2*2*8*8 fp32 = 1024 B and a 256 B mask)."""
    mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    model = Fn(lambda x: mha(x, x, x, need_weights=True)[0])
    model.mha = mha
    _, rows = trace(model, torch.randn(2, 8, 8))
    assert (1024, OUT) in of(rows, "aten.native_dropout.default", FWD)
    assert (256, OUT) in of(rows, "aten.native_dropout.default", FWD)


def test_the_cpu_device_is_not_routed() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1))
    _, rows = trace(model, torch.randn(4, 16), device="cpu")
    assert "aten.native_dropout.default" not in ops(rows)


# -- device placement -------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.tensor([0.5] * 1000, device=x.device),
        lambda x: torch.tensor([0.5] * 1000, device="cuda"),
        lambda x: torch.as_tensor([0.5] * 1000, device=x.device),
        lambda x: torch.asarray([0.5] * 1000, device=x.device),
        lambda x: x.new_tensor([0.5] * 1000),
    ],
    ids=["tensor", "tensor on 'cuda'", "as_tensor", "asarray", "new_tensor"],
)
def test_a_tensor_made_on_the_gpu_from_python_data_is_counted(make: Any) -> None:
    """1000 floats from a Python list onto the GPU: tensor_new.cpp makes them on the
    host and copies them to a new 4000 B device tensor. (On the trace's meta device
    such a tensor reached no dispatcher, and was not counted at all.)"""
    model = Fn(lambda x: x + make(x)[:16], 16)
    _, rows = trace(model, torch.randn(4, 16))
    assert of(rows, "aten._to_copy.default", FWD) == [(4000, OUT)]


def test_a_tensor_made_on_the_gpu_from_a_tensor_is_a_copy_of_it() -> None:
    """``torch.tensor`` of a GPU tensor copies it on the GPU (``to(..., copy=True)``:
    4 x 16 fp32 = 256 B); no host copy."""
    model = Fn(lambda x: x + torch.tensor(x, device=x.device), 16)
    _, rows = trace(model, torch.randn(4, 16))
    assert of(rows, "aten._to_copy.default", FWD) == [(256, OUT)]


# -- batch norm -------------------------------------------------------------------------


def test_batch_norm_takes_cudnn_when_it_may() -> None:
    """``_batch_norm_impl_index``: fp32 4-D input, weight and bias, running stats ->
    ``cudnn_batch_norm``: output 2*3*4*4*4 = 384 B, save_mean and save_var 3 fp32
    (12 B each), an empty reserve (cuDNN needs none for CUDNN_BATCHNORM_OPS_BN);
    backward ``cudnn_batch_norm_backward``: 384 + 12 + 12 B."""
    _, rows = trace(nn.BatchNorm2d(3), torch.randn(2, 3, 4, 4, requires_grad=True))
    assert of(rows, "aten.cudnn_batch_norm.default", FWD) == [(384, OUT), (12, OUT), (12, OUT), (0, OUT)]
    assert of(rows, "aten.cudnn_batch_norm_backward.default", BWD) == [(384, OUT), (12, OUT), (12, OUT)]
    assert "aten.native_batch_norm.default" not in ops(rows)


def test_batch_norm_eval_keeps_no_statistics() -> None:
    """cudnn/BatchNorm.cpp in inference: save_mean and save_var are empty."""
    _, rows = trace(nn.BatchNorm2d(3).eval(), torch.randn(2, 3, 4, 4), train=False)
    assert of(rows, "aten.cudnn_batch_norm.default", FWD) == [(384, OUT), (0, OUT), (0, OUT), (0, OUT)]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: (nn.BatchNorm1d(3), torch.randn(4, 3)), id="2-D input"),
        pytest.param(lambda: (nn.BatchNorm2d(3).bfloat16(), torch.randn(2, 3, 4, 4).bfloat16()), id="bfloat16"),
        pytest.param(lambda: (nn.BatchNorm2d(3).half(), torch.randn(2, 3, 4, 4).half()), id="half weight"),
        pytest.param(lambda: (nn.BatchNorm2d(3, affine=False), torch.randn(2, 3, 4, 4)), id="no weight"),
    ],
)
def test_batch_norm_native_kernel_where_cudnn_may_not(make: Any) -> None:
    model, x = make()
    _, rows = trace(model, x.requires_grad_())
    assert "aten.native_batch_norm.default" in ops(rows)
    assert "aten.cudnn_batch_norm.default" not in ops(rows)


def test_batch_norm_half_input_with_float_weight_takes_cudnn() -> None:
    """An fp16 input with fp32 weight and bias and no running stats (training)."""
    model = nn.BatchNorm2d(3, track_running_stats=False)
    _, rows = trace(model, torch.randn(2, 3, 4, 4).half().requires_grad_())
    assert of(rows, "aten.cudnn_batch_norm.default", FWD)[0] == (2 * 3 * 4 * 4 * 2, OUT)


def test_batch_norm_cudnn_disabled_and_eval_batch_limit() -> None:
    """``cudnn_enabled`` off -> native; in eval cuDNN takes at most 65535 samples."""
    with torch.backends.cudnn.flags(enabled=False):
        _, rows = trace(nn.BatchNorm2d(3), torch.randn(2, 3, 4, 4))
    assert "aten.cudnn_batch_norm.default" not in ops(rows)
    big = torch.empty(65536, 3, 1, 1, device="meta")
    _, rows = trace(nn.BatchNorm2d(3, device="meta").eval(), big, train=False)
    assert "aten.cudnn_batch_norm.default" not in ops(rows)


def test_instance_norm_with_affine_parameters_goes_through_cudnn_batch_norm() -> None:
    """``instance_norm``: the input viewed as (1, b*c, h, w) with repeated weight and
    bias; its ``batch_norm`` takes cuDNN: save_mean / save_var of b*c = 6 fp32 (24 B)."""
    _, rows = trace(nn.InstanceNorm2d(3, affine=True), torch.randn(2, 3, 4, 4, requires_grad=True))
    assert of(rows, "aten.cudnn_batch_norm.default", FWD) == [(384, OUT), (24, OUT), (24, OUT), (0, OUT)]


# -- scaled-dot-product attention: the backend --------------------------------------------


def backend(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
            gpu: str = "H100", mask: Any = None, dropout: float = 0.0, causal: bool = False, gqa: bool = False) -> int:
    k = q if k is None else k
    v = k if v is None else v
    return select_sdp_backend(q, k, v, mask, dropout, causal, gqa, gpu_profile(gpu).compute_capability)


H = torch.float16
aten = torch.ops.aten


#: ``check_prefer_cudnn_attention`` asks for a cuDNN newer than 9.15: 2.10's wheel
#: has cuDNN 9.10, so there cuDNN attention stays last (flash, efficient, math, cuDNN).
CUDNN_FIRST = installed_release()[:2] >= (2, 11)


def test_sdpa_backend_priority_by_architecture() -> None:
    """sdp_utils.cpp: cuDNN attention first on sm90/sm100 (``check_prefer_cudnn_attention``,
    cuDNN > 9.15), else flash, then memory-efficient, then math."""
    q = meta(2, 4, 128, 64, dtype=H)
    first = SDPBackend.CUDNN if CUDNN_FIRST else SDPBackend.FLASH
    assert backend(q, gpu="H100") == first
    assert backend(q, gpu="B200") == first
    assert backend(q, gpu="A100") == SDPBackend.FLASH
    assert backend(q, gpu="L4") == SDPBackend.FLASH
    with env("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1"):
        assert backend(q, gpu="H100") == SDPBackend.FLASH
    assert backend(q, gpu="T4") == SDPBackend.EFFICIENT  # flash and cuDNN need sm80+
    assert backend(meta(2, 4, 128, 64, dtype=torch.bfloat16), gpu="T4") == SDPBackend.MATH


def test_sdpa_backend_by_dtype_head_dim_and_mask() -> None:
    assert backend(meta(2, 4, 32, 16)) == SDPBackend.EFFICIENT  # fp32: flash and cuDNN need 16-bit
    assert backend(meta(2, 4, 32, 16, dtype=torch.float64)) == SDPBackend.MATH
    # head dim 100: flash pads it; the efficient kernel needs a multiple of 8 for fp16
    assert backend(meta(2, 4, 32, 100, dtype=H), gpu="A100") == SDPBackend.FLASH
    assert backend(meta(2, 4, 32, 100, dtype=H), gpu="H100") == SDPBackend.FLASH  # cuDNN: multiple of 8
    q = meta(2, 4, 32, 64, dtype=H)
    float_mask = meta(32, 32, dtype=H)
    assert backend(q, gpu="A100", mask=float_mask) == SDPBackend.EFFICIENT  # flash takes no mask
    masked = SDPBackend.CUDNN if CUDNN_FIRST else SDPBackend.EFFICIENT
    assert backend(q, gpu="H100", mask=float_mask) == masked
    assert backend(q, gpu="H100", mask=meta(3, 32, 32, dtype=H)) == SDPBackend.EFFICIENT  # 3-D mask: not cuDNN
    assert backend(meta(2, 4, 32, 288, dtype=H), gpu="H100") == SDPBackend.EFFICIENT  # > 256: neither


def test_sdpa_backend_causal_gqa_and_sequence_lengths() -> None:
    q, k = meta(2, 8, 16, 64, dtype=H), meta(2, 8, 32, 64, dtype=H)
    assert backend(q, k, gpu="A100", causal=True) == SDPBackend.EFFICIENT  # flash: causal needs L == S
    assert backend(q, k, gpu="A100") == SDPBackend.FLASH
    kv = meta(2, 2, 16, 64, dtype=H)
    assert backend(q, kv, gpu="A100", gqa=True) == SDPBackend.FLASH
    assert backend(q, kv, gpu="A100", gqa=True, mask=meta(16, 16, dtype=H)) == SDPBackend.MATH
    assert backend(q, meta(2, 8, 1, 64, dtype=H), gpu="H100") == SDPBackend.FLASH  # cuDNN: no s_kv = 1


def test_sdpa_mem_efficient_needs_aligned_storage_offsets_from_2_13() -> None:
    """check_data_ptr_alignment_mem_efficient (torch 2.13+): on sm80+ an fp32 query
    starting 2 elements (8 bytes) into its storage is not 16-byte aligned, and the
    memory-efficient kernel is not taken (flash needs 16-bit types): math. An
    offset of 4 elements is aligned. Before 2.13 the offset is not checked."""
    n = 2 * 4 * 32 * 16
    storage = torch.empty(n + 4, device="meta")
    unaligned, aligned = storage[2 : n + 2].view(2, 4, 32, 16), storage[4:].view(2, 4, 32, 16)
    assert backend(aligned, gpu="A100") == SDPBackend.EFFICIENT
    checked = installed_release()[:2] >= (2, 13)
    assert backend(unaligned, gpu="A100") == (SDPBackend.MATH if checked else SDPBackend.EFFICIENT)
    assert backend(unaligned, gpu="T4") == SDPBackend.EFFICIENT  # sm75: no check


def test_sdpa_cudnn_backward_head_dims_from_2_14() -> None:
    """check_cudnn_d256_bprop_head_dim (torch 2.14+): training on sm90, cuDNN's
    backward takes head dims up to 128, (192, 128) or 256 only: head dim 160 goes
    to flash there, and to cuDNN before 2.14 (where cuDNN is first: 2.11+).
    Without a gradient, cuDNN takes it on every release where it is first."""
    first = SDPBackend.CUDNN if CUDNN_FIRST else SDPBackend.FLASH
    assert backend(meta(2, 4, 32, 160, dtype=H), gpu="H100") == first
    with torch.enable_grad():
        q160 = meta(2, 4, 32, 160, dtype=H, grad=True)
        checked = installed_release()[:2] >= (2, 14)
        assert backend(q160, gpu="H100") == (SDPBackend.FLASH if checked else first)
        assert backend(meta(2, 4, 32, 256, dtype=H, grad=True), gpu="H100") == first


def test_sdpa_backend_gradient_limits_on_sm89() -> None:
    """Flash on sm86-89 cannot train with head dim in (192, 224]."""
    assert backend(meta(2, 4, 32, 208, dtype=H), gpu="RTX4090") == SDPBackend.FLASH
    with torch.enable_grad():
        q = meta(2, 4, 32, 208, dtype=H, grad=True)
        assert backend(q, gpu="RTX4090") == SDPBackend.EFFICIENT
        assert backend(q, gpu="A100") == SDPBackend.FLASH


@pytest.mark.filterwarnings("ignore:`torch.backends.cuda.sdp_kernel\\(\\)` is deprecated:FutureWarning")
def test_sdpa_backend_follows_the_user_settings() -> None:
    """Both the current ``sdpa_kernel`` and the deprecated ``sdp_kernel`` that users
    still call are honoured."""
    q = meta(2, 4, 128, 64, dtype=H)
    with sdpa_kernel(Backend.MATH):
        assert backend(q) == SDPBackend.MATH
    with sdpa_kernel([Backend.EFFICIENT_ATTENTION, Backend.FLASH_ATTENTION]):
        assert backend(q) == SDPBackend.FLASH  # cuDNN off: the default order
    with sdpa_kernel([Backend.EFFICIENT_ATTENTION, Backend.FLASH_ATTENTION], set_priority=True):
        assert backend(q, gpu="A100") == SDPBackend.EFFICIENT
    with torch.backends.cuda.sdp_kernel(enable_flash=False, enable_cudnn=False):
        assert backend(q) == SDPBackend.EFFICIENT


# -- scaled-dot-product attention: ops and bytes ---------------------------------------------


def sdpa(**kw: Any) -> Fn:
    return Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw))


def qkv(b: int, h: int, s: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))


def test_flash_attention_outputs_and_backward_buffers() -> None:
    """A100, fp16 (2, 4, 128, 64), causal. ``mha_fwd``: out 2*4*128*64*2 = 131072 B,
    softmax_lse (2, 4, 128) fp32 = 4096 B, rng_state 2 x uint64 = 16 B and the unused
    offset 8 B, both on the device; no split-KV (b*h*m_blocks = 2*4*2 = 16 fills
    >= 0.8 * 216 SM slots? no, but n_blocks = ceil(128/256) = 1 caps the splits at 1).
    Backward: dq, dk, dv 131072 B each; the inputs are (b, h, s, d)-contiguous, so
    ``out`` and the (expanded) ``dout`` are copied to (b, s, h, d): 131072 B each;
    softmax_d (2, 4, round128(128)) fp32 = 4096 B; dq_accum (2, 128, 4, 64) fp32
    = 262144 B."""
    _, rows = trace(sdpa(is_causal=True), qkv(2, 4, 128, 64, H), gpu="A100")
    fwd = "aten._scaled_dot_product_flash_attention.default"
    assert of(rows, fwd) == [(131072, OUT), (4096, OUT), (16, OUT), (8, OUT), (0, OUT)]
    bwd = "aten._scaled_dot_product_flash_attention_backward.default"
    assert of(rows, bwd) == [
        (131072, SCRATCH), (131072, SCRATCH),
        (131072, OUT), (131072, OUT), (131072, OUT),
        (4096, SCRATCH), (262144, SCRATCH),
    ]


def test_flash_attention_split_kv_buffers() -> None:
    """``set_params_splitkv`` without dropout, A100 (108 SMs -> 216 slots): b*h*m = 1
    (s_q = 64), n_blocks = ceil(2048/256) = 8; the eligible splits 1, 2, 3, 4, 8 have
    efficiencies n/216, the best 8/216, and 8 is the first >= 85% of it: 8 splits.
    softmax_lse_accum (8, 1, 1, 64) fp32 = 2048 B, out_accum (8, 1, 1, 64, 64) fp32
    = 131072 B."""
    assert flash_num_splits(1, 216, 8, 128) == 8
    assert flash_num_splits(200, 216, 8, 128) == 1  # >= 0.8 * 216 blocks: one split
    q = torch.randn(1, 1, 64, 64, dtype=H)
    kv = torch.randn(1, 1, 2048, 64, dtype=H)
    _, rows = trace(sdpa(), (q, kv, kv), gpu="A100", train=False)
    fwd = "aten._scaled_dot_product_flash_attention.default"
    assert of(rows, fwd) == [(8192, OUT), (256, OUT), (16, OUT), (8, OUT), (0, OUT), (2048, SCRATCH), (131072, SCRATCH)]


def test_flash_attention_pads_the_head_dim_to_a_multiple_of_8() -> None:
    """attention.cpp pads q, k, v from head dim 60 to 64 (``constant_pad_nd``,
    2*4*16*64*2 = 16384 B each) and slices the output back."""
    _, rows = trace(sdpa(), qkv(2, 4, 16, 60, H), gpu="A100", train=False)
    assert of(rows, "aten.constant_pad_nd.default", FWD) == [(16384, OUT)] * 3
    assert of(rows, "aten._scaled_dot_product_flash_attention.default")[0] == (16384, OUT)


def test_efficient_attention_outputs_and_backward_buffers() -> None:
    """H100, fp32 (2, 4, 32, 16): ``_efficient_attention_forward``: out 16384 B,
    logsumexp (2, 4, ceil(32/32)*32) fp32 = 1024 B, seed and offset on the host (not
    charged). Backward: dout made contiguous in (b, s, h, d) (16384 B), dq, dk, dv
    16384 B each, fp32 ``delta`` through (dout * out) (2*32*4*16*4 = 16384 B), its
    sum (2*32*4*4 = 1024 B) and the transposed copy (1024 B), and the dQ workspace
    (64 x 64 blocks: round64(32) * round64(16) = 4096 fp32 per (b, h): 8 * 16384 B)."""
    report, rows = trace(sdpa(), qkv(2, 4, 32, 16, torch.float32))
    assert of(rows, "aten._scaled_dot_product_efficient_attention.default") == [(16384, OUT), (1024, OUT)]
    bwd = "aten._scaled_dot_product_efficient_attention_backward.default"
    assert of(rows, bwd) == [
        (16384, SCRATCH),
        (16384, OUT), (16384, OUT), (16384, OUT),
        (16384, SCRATCH), (1024, SCRATCH), (1024, SCRATCH),
        (131072, SCRATCH),
    ]
    assert any("memory-efficient attention backward" in u.reason for u in report.unsupported)


def test_efficient_attention_half_head_dim_over_128_accumulates_in_fp32() -> None:
    """A100, fp16 head dim 256 with a boolean mask (flash takes no mask; the efficient
    kernel is first on sm80): out (2, 8, 2, 256) fp16 = 16384 B, no logsumexp
    without a gradient, and the ``k65536`` forward kernel's fp32 ``output_accum``
    (2, 8, 2, 256) = 32768 B. The mask becomes an additive fp16 bias (8 x 8: its
    row stride 8 is aligned, so ``preprocess_mask`` does not pad it) and is expanded."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(8, 8, dtype=torch.bool).tril())

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, attn_mask=self.mask)

    _, rows = trace(Masked(), torch.randn(2, 2, 8, 256, dtype=H), gpu="A100", train=False)
    fwd = "aten._scaled_dot_product_efficient_attention.default"
    assert of(rows, fwd) == [(2 * 8 * 2 * 256 * 2, OUT), (0, OUT), (2 * 8 * 2 * 256 * 4, SCRATCH)]


def test_cudnn_attention_outputs_and_backward_workspace() -> None:
    """H100, fp16 (2, 4, 128, 64): out 131072 B, softmax stats (2, 4, 128, 1) fp32 =
    4096 B (only when a gradient is needed), seed and offset int64 on the device.
    Backward: dq, dk, dv 131072 B each and the frontend workspace: softmax_sum
    2*4*128*4 = 4096 B + dQ_accum 2*4*128*64*4 = 262144 B. (cuDNN alone is
    enabled: on 2.10 it is not first, see :data:`CUDNN_FIRST`.)"""
    with sdpa_kernel(Backend.CUDNN_ATTENTION):
        report, rows = trace(sdpa(), qkv(2, 4, 128, 64, H))
    fwd = "aten._scaled_dot_product_cudnn_attention.default"
    assert of(rows, fwd) == [(131072, OUT), (4096, OUT), (8, OUT), (8, OUT)]
    bwd = "aten._scaled_dot_product_cudnn_attention_backward.default"
    assert of(rows, bwd) == [(131072, OUT), (131072, OUT), (131072, OUT), (266240, SCRATCH)]
    assert any("cuDNN attention backward" in u.reason for u in report.unsupported)
    with sdpa_kernel(Backend.CUDNN_ATTENTION):
        _, rows = trace(sdpa(), qkv(2, 4, 128, 64, H), train=False)
    assert of(rows, fwd) == [(131072, OUT), (0, OUT), (8, OUT), (8, OUT)]


def test_cudnn_attention_decode_on_sm100_is_listed_on_2_14() -> None:
    """Torch 2.14 (cuDNN 9.24.0) may disable cuDNN decode on compute capability 10.x
    (is_cudnn_attention_decode_disabled): a query of length 1 on B200 is listed
    in ``unsupported`` there; a longer query, an H100 or another release is not."""
    rule = CUDA.scratch_rule(aten._scaled_dot_product_cudnn_attention.default)
    assert rule is not None
    kv = meta(1, 4, 16, 64, dtype=H)

    def steps(q: torch.Tensor, gpu: str) -> list[Any]:
        args = (q, kv, kv, None, False, 0.0, False, False)
        return list(rule(OpCall(aten._scaled_dot_product_cudnn_attention.default, args, {}, None,
                                TraceContext("cuda", gpu=gpu_profile(gpu)))))

    decode = steps(meta(1, 4, 1, 64, dtype=H), "B200")
    listed = installed_release()[:2] == (2, 14)
    assert any(isinstance(s, Inexact) and "decode" in s.reason for s in decode) == listed
    assert steps(meta(1, 4, 1, 64, dtype=H), "H100") == []
    assert steps(meta(1, 4, 2, 64, dtype=H), "B200") == []


def test_math_attention_with_dropout_uses_the_fused_dropout() -> None:
    """The math path calls ``at::dropout`` on the (2, 4, 16, 16) fp32 weights: on CUDA
    ``native_dropout`` (8192 B and an 2048 B mask), not bernoulli."""
    with sdpa_kernel(Backend.MATH):
        _, rows = trace(sdpa(dropout_p=0.1), qkv(2, 4, 16, 8, torch.float32))
    assert of(rows, "aten.native_dropout.default", FWD) == [(8192, OUT), (2048, OUT)]
    assert "aten.bernoulli_.float" not in ops(rows)


def test_math_attention_with_dropout_masks_and_scales_as_the_composite_does() -> None:
    """Causal math attention with dropout on (2, 4, 16, 8) fp32 runs the ops torch's own
    composite runs on fake cuda tensors in 2.10 to 2.15 (the device audit's reference):
    q and k scaled by a number (``mul.Scalar``), the (16, 16) causal mask made additive by
    ``where`` of the mask itself (1024 B, a 1024 B block; no ``logical_not``, 256 B) and
    added out of place into a new (2, 4, 16, 16) fp32 score (8192 B), not into the score."""
    with sdpa_kernel(Backend.MATH):
        _, rows = trace(sdpa(dropout_p=0.1, is_causal=True), qkv(2, 4, 16, 8, torch.float32))
    assert "aten.logical_not.default" not in ops(rows)
    assert of(rows, "aten.where.self", FWD) == [(1024, OUT)]
    assert of(rows, "aten.add.Tensor", FWD) == [(8192, OUT)]
    assert [n for n, _ in of(rows, "aten.mul.Scalar", FWD)] == [4096, 4096]
    assert "aten.mul.Tensor" not in {op for p, op, _n, _k in rows if p == FWD}


def test_multi_head_attention_module_reaches_the_fused_backend() -> None:
    """``nn.MultiheadAttention`` (need_weights=False) calls SDPA from Python code."""
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    model = Fn(lambda x: mha(x, x, x, need_weights=False)[0])
    model.mha = mha
    _, rows = trace(model, torch.randn(2, 8, 16))
    assert "aten._scaled_dot_product_efficient_attention.default" in ops(rows)


# -- RNN --------------------------------------------------------------------------------------


def test_lstm_runs_cudnn_rnn() -> None:
    """LSTM(8, 16), batch_first (4, 5, 8) fp32, T=5, N=4, H=16. ``_cudnn_rnn``: the
    transposed input made contiguous (5*4*8*4 = 640 B), output (5, 4, 16) 1280 B,
    hy and cy 256 B each, the reserve (model: 6 vectors of H per step: 5*4*16*6*4 =
    7680 B); the weight buffer is the module's flat one (no copy); workspace (model:
    4 gates * H per step: 5*4*4*16*4 = 5120 B). Backward ``_cudnn_rnn_backward``:
    zeros for the missing dhy and dcy (256 B each), x and dy made contiguous (640,
    1280 B), dx/dhx/dcx (160+64+64 fp32 = 1152 B, recorded as one until the weight
    half), workspace 5120 B, x again (640 B), then dx 640, dhx 256, dcx 256 B and dw
    as views of one flat buffer of 4*16*(8+16+2) fp32 = 6656 B, workspace 5120 B."""
    report, rows = trace(nn.LSTM(8, 16, batch_first=True), torch.randn(4, 5, 8), loss_fn=lambda out: out[0].sum())
    assert of(rows, "aten._cudnn_rnn.default") == [
        (640, SCRATCH), (1280, OUT), (256, OUT), (256, OUT), (7680, OUT), (5120, SCRATCH),
    ]
    assert of(rows, "aten._cudnn_rnn_backward.default") == [
        (256, SCRATCH), (256, SCRATCH), (640, SCRATCH), (1280, SCRATCH), (1152, SCRATCH), (5120, SCRATCH),
        (640, SCRATCH), (640, OUT), (256, OUT), (256, OUT), (6656, OUT), (5120, SCRATCH),
    ]
    assert any("cuDNN RNN" in u.reason for u in report.unsupported)


def test_gru_and_eval_rnn() -> None:
    """GRU, seq-major (5, 4, 8) (no contiguous copy), H=16: output 1280 B, hy 256 B,
    an empty cy; in eval an empty reserve, in training the reserve model's 5
    vectors of H per step (5*4*16*5*4 = 6400 B); workspace model 3 gates:
    5*4*3*16*4 = 3840 B."""
    gru = nn.GRU(8, 16).eval()
    _, rows = trace(gru, torch.randn(5, 4, 8), train=False)
    assert of(rows, "aten._cudnn_rnn.default") == [(1280, OUT), (256, OUT), (0, OUT), (0, OUT), (3840, SCRATCH)]
    _, rows = trace(gru.train(), torch.randn(5, 4, 8), loss_fn=lambda out: out[0].sum())
    assert of(rows, "aten._cudnn_rnn.default")[3] == (6400, OUT)


def test_rnn_cells_use_the_fused_cuda_kernels() -> None:
    """RNN.cpp ``LSTMCell``/``GRUCell`` on CUDA: two matmuls, then
    ``_thnn_fused_lstm_cell`` (hy, cy (4, 16) fp32 = 256 B each, workspace (4, 64)
    = 1024 B) or ``_thnn_fused_gru_cell`` (hy 256 B, workspace (4, 5*16) = 1280 B);
    the GRU backward makes gate gradients (4, 48) (768 B each), grad_hx 256 B and
    the bias sums (48 fp32 = 192 B each)."""
    _, rows = trace(nn.LSTMCell(8, 16), torch.randn(4, 8), loss_fn=lambda out: out[0].sum())
    assert of(rows, "aten._thnn_fused_lstm_cell.default") == [(256, OUT), (256, OUT), (1024, OUT)]
    _, rows = trace(nn.GRUCell(8, 16), torch.randn(4, 8))
    assert of(rows, "aten._thnn_fused_gru_cell.default") == [(256, OUT), (1280, OUT)]
    assert of(rows, "aten._thnn_fused_gru_cell_backward.default") == [
        (768, OUT), (768, OUT), (256, OUT), (192, OUT), (192, OUT),
    ]


def test_rnn_without_cudnn_takes_the_composite() -> None:
    with torch.backends.cudnn.flags(enabled=False):
        _, rows = trace(nn.LSTM(8, 16), torch.randn(5, 4, 8), loss_fn=lambda out: out[0].sum())
    assert "aten._cudnn_rnn.default" not in ops(rows)


# -- autocast ----------------------------------------------------------------------------------


class Autocast(nn.Module):
    def __init__(self, body: nn.Module, dtype: torch.dtype = torch.float16, calls: int = 1) -> None:
        super().__init__()
        self.body, self.dtype, self.calls = body, dtype, calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=self.dtype):
            for _ in range(self.calls):
                x = self.body(x)
        return x.float()


def test_autocast_casts_the_lower_precision_ops() -> None:
    """``linear`` is on the lower-precision list: the bias (32), the weight (32 x 16)
    and x (4 x 16) are cast to fp16 (64, 1024, 128 B), last argument first as a
    CUDA build's autocast wrapper does (seen by benchmarks/cuda_routing.py), and
    addmm makes 4 x 32 fp16 = 256 B; the casts are recorded by autograd (their
    backward casts the gradients back to fp32)."""
    _, rows = trace(Autocast(nn.Linear(16, 16 * 2)), torch.randn(4, 16))
    casts = of(rows, "aten._to_copy.default", FWD)
    assert casts[:3] == [(64, OUT), (1024, OUT), (128, OUT)]
    assert of(rows, "aten.addmm.default", FWD)[0] == (256, OUT)


class FloatIsland(nn.Module):
    """An fp16 autocast region with a region inside that disables it (as transformers'
    rotary embeddings force float32)."""

    def __init__(self, body: nn.Module, island: bool = True) -> None:
        super().__init__()
        self.body, self.island = body, island

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.float16):
            with torch.autocast("cuda", enabled=not self.island):
                return self.body(x).float()


def test_autocast_disabled_inside_a_region_casts_nothing() -> None:
    """Inside ``autocast("cuda", enabled=False)`` linear runs in fp32: no cast, and
    addmm makes 4 x 32 fp32 = 512 B (with the island enabled: the three casts and
    4 x 32 fp16 = 256 B). On a CPU-only torch every cuda region entered disabled, so
    the island could not be told from the region around it."""
    _, rows = trace(FloatIsland(nn.Linear(16, 32)), torch.randn(4, 16))
    assert of(rows, "aten._to_copy.default", FWD) == []
    assert of(rows, "aten.addmm.default", FWD)[0] == (512, OUT)
    _, rows = trace(FloatIsland(nn.Linear(16, 32), island=False), torch.randn(4, 16))
    assert of(rows, "aten._to_copy.default", FWD)[:3] == [(64, OUT), (1024, OUT), (128, OUT)]
    assert of(rows, "aten.addmm.default", FWD)[0] == (256, OUT)


def test_bfloat16_autocast_on_a_gpu_without_it_is_refused_as_torch_refuses_it() -> None:
    """A T4 (sm75) has no bfloat16: ``torch.autocast("cuda", dtype=torch.bfloat16)``
    raises there, as on the GPU."""
    with pytest.raises(RuntimeError, match="does not support bfloat16"):
        trace(Autocast(nn.Linear(16, 16), dtype=torch.bfloat16), torch.randn(4, 16), gpu="T4")


def test_autocast_caches_cast_weights_until_the_region_ends() -> None:
    """cached_cast: a leaf fp32 weight that requires grad is cast once per outermost
    region; using the layer twice casts the weight (16*16*2 = 512 B) once and the
    bias (32 B) once, the activations each time."""
    layer = nn.Linear(16, 16)
    _, rows = trace(Autocast(layer, calls=2), torch.randn(4, 16))
    casts = [n for n, _ in of(rows, "aten._to_copy.default", FWD)]
    assert casts.count(512) == 1 and casts.count(32) == 1


def test_autocast_policies() -> None:
    """autocast_mode.h lists: matmul-like ops lower precision, ``layer_norm``/losses fp32,
    ``softmax``/``sum`` fp32 with a dtype, ``addcmul`` promote, BCE banned."""
    assert autocast_policy(torch.matmul) == "lower_precision"
    assert autocast_policy(F.linear) == "lower_precision"
    assert autocast_policy(torch.Tensor.__matmul__) == "lower_precision"
    assert autocast_policy(F.scaled_dot_product_attention) == "lower_precision"
    assert autocast_policy(torch.layer_norm) == "fp32"
    assert autocast_policy(torch.Tensor.exp) == "fp32"
    assert autocast_policy(torch.softmax) == "fp32_set_opt_dtype"
    assert autocast_policy(torch.Tensor.sum) == "fp32_set_opt_dtype"
    assert autocast_policy(torch.addcmul) == "promote"
    assert autocast_policy(torch._C._nn.binary_cross_entropy) == "banned"
    assert autocast_policy(torch.relu) is None


def test_autocast_fp32_list_of_the_release() -> None:
    """``rms_norm`` has an AutocastCUDA kernel (fp32) from torch 2.12, the new
    ``linalg_matrix_sqrth`` from 2.14; before, ``rms_norm`` is not on any list."""
    release = installed_release()[:2]
    assert autocast_policy(torch.rms_norm) == ("fp32" if release >= (2, 12) else None)
    sqrth = getattr(torch._C._linalg, "linalg_matrix_sqrth", None)
    assert (sqrth is not None) == (release >= (2, 14))
    if sqrth is not None:
        assert autocast_policy(sqrth) == "fp32"


def test_autocast_fp32_ops_and_softmax_dtype() -> None:
    """In fp16 autocast, ``layer_norm`` runs in fp32: its fp16 input (4 x 16) is cast
    back (256 B) and it makes a 256 B fp32 output; ``softmax`` of an fp16 tensor is
    asked for an fp32 result, which ``_softmax(half_to_float)`` makes directly
    (256 B, no cast)."""
    _, rows = trace(Autocast(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))), torch.randn(4, 16))
    assert (256, OUT) in of(rows, "aten._to_copy.default", FWD)
    assert of(rows, "aten.native_layer_norm.default", FWD)[0] == (256, OUT)
    _, rows = trace(Autocast(nn.Sequential(nn.Linear(16, 16), nn.Softmax(-1))), torch.randn(4, 16))
    assert of(rows, "aten._softmax.default", FWD) == [(256, OUT)]
    assert (256, OUT) not in of(rows, "aten._to_copy.default", FWD)


def test_autocast_cross_entropy_computes_log_softmax_in_half() -> None:
    """``cross_entropy_loss`` calls ``log_softmax(x, 1, x.dtype)`` (fp16: 4*10*2 = 80 B),
    then ``nll_loss`` (fp32 list) casts it to fp32 (160 B)."""

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda"):
                return F.cross_entropy(self.fc(x), torch.zeros(4, dtype=torch.long, device=x.device))

    _, rows = trace(Loss(), torch.randn(4, 16))
    assert of(rows, "aten._log_softmax.default", FWD) == [(80, OUT)]
    assert (160, OUT) in of(rows, "aten._to_copy.default", FWD)


def test_cpu_autocast_and_checkpoint_regions_leave_cuda_ops_alone() -> None:
    """CPU autocast does not apply to CUDA tensors; ``torch.utils.checkpoint``
    recomputes inside ``autocast("cpu", enabled=False)``: nothing is cast."""

    class CpuRegion(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = self.fc(x)
            return torch.utils.checkpoint.checkpoint(self.fc, y, use_reentrant=False)

    _, rows = trace(CpuRegion(), torch.randn(4, 16))
    assert "aten._to_copy.default" not in ops(rows)


def test_autocast_lstm_reflattens_the_weights_in_half() -> None:
    """AutocastRNN.cpp: input and states cast to fp16, the fp32 weights copied to fp16
    (modelled as one cast each: 64*8, 64*16, 64, 64 fp16 = 1024, 2048, 128, 128 B);
    ``_cudnn_rnn`` runs in fp16 (output (5, 4, 16) = 640 B)."""

    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda"):
                return self.lstm(x)[0].float()

    _, rows = trace(Half(), torch.randn(5, 4, 8))
    casts = of(rows, "aten._to_copy.default", FWD)
    assert all((n, OUT) in casts for n in (320, 1024, 2048, 128))
    assert of(rows, "aten._cudnn_rnn.default", FWD)[0] == (640, OUT)


# -- optimizers --------------------------------------------------------------------------------


# (torch's own foreach and fused choices on the fake cuda device: test_fused_optimizers.py)


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        # SGD momentum: one buffer per parameter, a clone of its gradient
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 16384 + 512),
        # Adam/AdamW: exp_avg and exp_avg_sq; step counters on the host
        (lambda p: torch.optim.Adam(p), 2 * (16384 + 512)),
        (lambda p: torch.optim.AdamW(p), 2 * (16384 + 512)),
    ],
    ids=["sgd-momentum", "adam", "adamw"],
)
def test_optimizer_state_bytes(factory: Any, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear(64, 64): weight 64*64*4 = 16384 B (a multiple of 512), bias 256 B (a
    512 B block). (Cached cuBLAS workspaces, as torch 2.15 keeps them only when
    asked: the peak is then the optimizer step's, where the state is.)"""
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "1")
    report = tm.estimate(nn.Linear(64, 64), torch.randn(8, 64), device="cuda", optimizer=factory)
    assert report.breakdown[Category.OPTIMIZER_STATE] == expected


# -- the zoo ------------------------------------------------------------------------------------


def test_the_zoo_traces_on_cuda() -> None:
    import zoo

    for case in zoo.CASES:
        model, inputs = case.make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = tm.estimate(model, inputs, device="cuda", **case.options)
        assert report.peak > 0, case.name
        assert not any("stopped" in u.reason for u in report.unsupported), (case.name, report.unsupported)


# -- the C++ constants, read again from the installed torch -------------------------------
# (each release venv of the release suite pins them for its release; tests/torch_sources.py)


def test_cudnn_of_each_release_is_pinned_by_the_installed_wheel() -> None:
    """The cuDNN a release's CUDA wheel pins (``nvidia-cudnn-cu1x==9.10.2.21``, ...) is
    the version ``CUDNN_OF_RELEASE`` models for it (``cudnnGetVersion()``: major *
    10000 + minor * 100 + patch)."""
    if torch.version.cuda is None:
        pytest.skip("a CPU wheel pins no cuDNN: the CUDA builds of each release check it")
    pinned = wheel_requirement(r"nvidia-cudnn-cu\d+")
    assert pinned is not None, "the CUDA wheel of torch pins no nvidia-cudnn"
    major, minor, patch = (int(part) for part in pinned.split(".")[:3])
    assert cuda_sdpa.cudnn_version(installed_release()[:2]) == major * 10000 + minor * 100 + patch


def test_rnn_modes_are_pinned_by_the_installed_cudnn_header() -> None:
    """``cudnnRNNMode_t``: ``CUDNN_RNN_RELU = 0``, ``CUDNN_RNN_TANH = 1``, ``CUDNN_LSTM = 2``,
    ``CUDNN_GRU = 3``, the ``mode`` the router passes to ``_cudnn_rnn``."""
    text = cudnn_header_text()
    for name, value in (("CUDNN_RNN_RELU", cuda_rnn.RNN_RELU), ("CUDNN_RNN_TANH", cuda_rnn.RNN_TANH),
                        ("CUDNN_LSTM", cuda_rnn.LSTM), ("CUDNN_GRU", cuda_rnn.GRU)):
        assert {int(v) for v in re.findall(rf"\b{name}\s*=\s*(\d+)", text)} == {value}, name


def test_cudnn_batch_norm_limits_are_pinned_by_the_installed_libtorch_cpu() -> None:
    """``_select_batch_norm_backend`` (Normalization.cpp, ``libtorch_cpu.so`` of CPU and
    CUDA builds) takes cuDNN up to a batch of 880801 in training and 65535 in inference."""
    code = disassembly(library("libtorch_cpu.so"), r"_select_batch_norm_backend")
    found = immediates(code)
    assert cuda_kernel_choices.CUDNN_BN_MAX_TRAINING_BATCH in found
    assert cuda_kernel_choices.CUDNN_BN_MAX_INFERENCE_BATCH in found


def test_cudnn_batch_norm_epsilon_is_pinned_by_the_installed_libtorch_cuda() -> None:
    """``CUDAHooks::batchnormMinEpsilonCuDNN`` returns ``CUDNN_BN_MIN_EPSILON``: 0.0
    (``pxor %xmm0,%xmm0; ret``)."""
    code = instructions(disassembly(cuda_library("libtorch_cuda.so"), r"CUDAHooks24batchnormMinEpsilonCuDNN"))
    assert code == "pxor %xmm0,%xmm0; ret"
    assert cuda_kernel_choices.CUDNN_BN_MIN_EPSILON == 0.0


SDP = r"^_ZN3sdp"


@pytest.mark.parametrize(
    ("function", "values"),
    [
        pytest.param(r"18select_sdp_backend", lambda: {cuda_sdpa.CUDNN_PREFERRED_AFTER}, id="cudnn-preferred-after"),
        pytest.param(r"check_head_dim_size_flashILb0E", lambda: {cuda_sdpa.FLASH_MAX_HEAD_DIM}, id="flash-head-dim"),
        pytest.param(
            r"check_flash_attention_hardware_support",
            lambda: {cuda_sdpa.FLASH_SM[0][0], cuda_sdpa.FLASH_SM[1][0]},
            id="flash-sm",
        ),
        pytest.param(
            r"check_mem_efficient_hardware_support",
            lambda: {cuda_sdpa.MEM_EFFICIENT_SM[0][0], cuda_sdpa.MEM_EFFICIENT_SM[1][0]},
            id="mem-efficient-sm",
        ),
        pytest.param(
            r"check_cudnn_hardware_support", lambda: {cuda_sdpa.CUDNN_SM[0][0], cuda_sdpa.CUDNN_SM[1][0]}, id="cudnn-sm"
        ),
        pytest.param(
            r"check_requires_grad_and_head_dim_gt192",
            lambda: set(cuda_sdpa.FLASH_BACKWARD_HEAD_DIM_LIMITS),
            id="flash-backward-head-dims",
        ),
        pytest.param(
            r"check_cudnn_tensor_shapes",
            lambda: {cuda_sdpa.CUDNN_MAX_HEAD_DIM, cuda_sdpa.CUDNN_SM90_MAX_HEAD_DIM, cuda_sdpa.CUDNN_HEAD_DIM_MULTIPLE},
            id="cudnn-head-dims",
        ),
    ],
)
def test_sdpa_threshold_is_pinned_by_the_installed_libtorch_cuda(function: str, values: Any) -> None:
    """Each threshold of ``sdp_utils.cpp`` the backend choice follows is an immediate of the
    named check in the installed CUDA build (``$0x1656c`` for cuDNN 9.15.0, ``$0x100`` for
    flash's 256, the majors 8, 5 and 12 of ``check_sm_version<sm80/sm50, sm121>``, ...)."""
    found = immediates(disassembly(cuda_library("libtorch_cuda.so"), SDP + r".*" + function))
    assert values() <= found, sorted(values() - found)


def test_cudnn_dropout_window_start_is_pinned_by_the_installed_libtorch_cuda() -> None:
    """No cuDNN attention with dropout from cuDNN 9.11.0 (``cudnn_version > 91100``:
    ``$0x163dc`` or ``$0x163dd``) in ``check_cudnn_dropout`` (``can_use_cudnn_attention``
    before it). The end of the window (9.14.0) is compiled against the build's own cuDNN
    and is not read here."""
    code = disassembly(cuda_library("libtorch_cuda.so"), SDP + r".*(check_cudnn_dropout|can_use_cudnn_attention)")
    found = immediates(code)
    start = cuda_sdpa.CUDNN_DROPOUT_BUG[0]
    assert start in found or start + 1 in found


def test_cudnn_head_dim_rule_is_pinned_by_the_installed_libtorch_cuda() -> None:
    """``check_cudnn_tensor_shapes``, as each release compiles it (see
    :data:`sdpa.CUDNN_MAX_HEAD_DIM`): 2.10 compares the cuDNN with 9.1.0 (``$0x16377``)
    and (major, minor) with (9, 0) only; 2.11 to 2.13 also major with 10 and the head
    dims with 192 and 128 for a cuDNN newer than 9.10 (``$0x163db``); from 2.14 the
    cuDNN with 9.22 and 9.25 (``$0x16828``, ``$0x16954``) and (major, minor) with (10, 7)."""
    code = instructions(disassembly(cuda_library("libtorch_cuda.so"), SDP + r".*check_cudnn_tensor_shapes"))
    found, release = immediates(code), installed_release()[:2]
    assert re.search(r"cmpq? +\$0x9,(0x168\(%\w+\)|%\w+)", code)
    major_10 = bool(re.search(r"cmpl +\$0xa,0x168\(%\w+\)", code))
    assert major_10 == (release >= (2, 11))
    if release < (2, 14):
        assert cuda_sdpa.CUDNN_SM90_D256_SINCE - 1 in found
        assert cuda_sdpa.CUDNN_D256_AFTER not in found
    else:
        assert {cuda_sdpa.CUDNN_D256_AFTER, cuda_sdpa.CUDNN_SM107_D256_AFTER} <= found
        assert re.search(r"movabs +\$0x70000000a,", code)
    if release >= (2, 11):
        assert {cuda_sdpa.CUDNN_192_128_AFTER, *cuda_sdpa.CUDNN_192_128} <= found


@pytest.mark.parametrize(
    ("release", "cc", "dims", "limit"),
    [
        ((2, 10), (9, 0), (256, 256), 256),
        ((2, 10), (10, 0), (192, 128), 128),  # 2.10: no (192, 128) case
        ((2, 13), (10, 0), (192, 128), 192),
        ((2, 13), (10, 0), (256, 256), 128),
        ((2, 13), (9, 0), (256, 256), 256),
        ((2, 14), (10, 0), (256, 256), 256),  # cuDNN 9.24 > 9.22
        ((2, 14), (10, 7), (256, 256), 128),  # (10, 7) needs a cuDNN newer than 9.25
        ((2, 14), (10, 7), (192, 128), 192),
        ((2, 15), (10, 7), (256, 256), 256),  # cuDNN 9.26
        ((2, 15), (8, 0), (256, 256), 128),
    ],
)
def test_cudnn_max_head_dim_by_release(release: tuple[int, int], cc: tuple[int, int], dims: tuple[int, int], limit: int) -> None:
    """The rule of each release with its own wheel's cuDNN (the table of sdpa.py)."""
    assert cuda_sdpa.cudnn_max_head_dim(*dims, cc, release) == limit


def test_a_b200_attention_with_head_dim_256_takes_cudnn_from_2_14() -> None:
    """On a B200 (compute capability 10.0), inference of head dim 256 in fp16: cuDNN from
    2.14 (where it is first), flash before; head dims (192, 128) take cuDNN from 2.11.
    (A backend changes the figures: cuDNN saves its softmax statistics, flash its LSE.)"""
    first = SDPBackend.CUDNN if CUDNN_FIRST else SDPBackend.FLASH
    release = installed_release()[:2]
    assert backend(meta(2, 4, 32, 256, dtype=H), gpu="B200") == (first if release >= (2, 14) else SDPBackend.FLASH)
    q, v = meta(2, 4, 32, 192, dtype=H), meta(2, 4, 32, 128, dtype=H)
    # 2.10: cuDNN is last, and flash takes no d_qk != d_v: the memory-efficient kernel
    assert backend(q, q, v, gpu="B200") == (first if release >= (2, 11) else SDPBackend.EFFICIENT)


def test_release_gated_sdpa_checks_are_pinned_by_the_installed_libtorch_cuda() -> None:
    """``check_data_ptr_alignment_mem_efficient`` exists from 2.13 and compares offsets
    with 8 and 4 elements; ``check_cudnn_d256_bprop_head_dim`` exists from 2.14 and
    compares cuDNN with 9.22.0 and 9.25.0 and head dims with 128, 192 and 256: the
    releases ``sdpa`` applies them from."""
    library_ = cuda_library("libtorch_cuda.so")
    release = installed_release()[:2]
    alignment = has_function(library_, r"check_data_ptr_alignment_mem_efficient")
    assert alignment == (release >= (2, 13))
    if alignment:
        found = immediates(disassembly(library_, r"check_data_ptr_alignment_mem_efficient"))
        assert set(cuda_sdpa.MEM_EFFICIENT_OFFSET_ALIGNMENT.values()) <= found
    bprop = has_function(library_, r"check_cudnn_d256_bprop_head_dim")
    assert bprop == (release >= (2, 14))
    if bprop:
        found = immediates(disassembly(library_, r"check_cudnn_d256_bprop_head_dim"))
        expected = {cuda_sdpa.CUDNN_BPROP_HEAD_DIMS_AFTER, cuda_sdpa.CUDNN_SM107_BPROP_FIXED_AFTER, cuda_sdpa.CUDNN_BPROP_SMALL_HEAD_DIM}
        expected |= {d for pair in cuda_sdpa.CUDNN_BPROP_LARGE_HEAD_DIMS for d in pair}
        assert expected <= found, sorted(expected - found)


def test_a_boolean_mask_for_cudnn_attention_is_converted_as_the_release_converts_it() -> None:
    """H100, fp16 (1, 2, 8, 64) with a boolean (8, 8) mask, cuDNN alone enabled: the mask
    becomes an additive fp16 bias (8 x 8 x 2 = 128 B, a 512 B block) by ``where`` of its
    ``logical_not`` (64 B, a block) and a zero: on 2.10 and 2.11 a host scalar with the
    -65504 fill (no GPU block), from 2.12 a 0-d fp16 tensor on the GPU with -inf, which
    ``where``'s scalar overload also makes of the fill, on its other operand's device
    (``at::scalar_tensor(self, other.options())``): two 512 B blocks."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(8, 8, dtype=torch.bool).tril())

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, attn_mask=self.mask)

    with sdpa_kernel(Backend.CUDNN_ATTENTION):
        _, rows = trace(Masked(), torch.randn(1, 2, 8, 64, dtype=H), train=False)
    on_gpu = installed_release()[:2] >= (2, 12)
    assert of(rows, "aten.scalar_tensor.default") == ([(2, OUT), (2, OUT)] if on_gpu else [])
    assert of(rows, "aten.logical_not.default") == [(64, OUT)]
    assert of(rows, "aten.where.self") == [(128, OUT)]


def test_cudnn_mask_conversion_is_pinned_by_the_installed_libtorch_cpu() -> None:
    """``attention.cpp``'s ``convert_boolean_attn_mask_cudnn`` (the -65504 fill with a host
    scalar, :data:`sdpa.CUDNN_MASK_FILL`) exists in 2.10 and 2.11 only: from 2.12
    (pytorch#177868) the cuDNN branch converts like the others (-inf, a scalar on the
    mask's device): the router follows it (the fill changes no bytes; the 0-d scalar
    on the GPU is a 512 B block, briefly)."""
    exists = has_function(library("libtorch_cpu.so"), r"convert_boolean_attn_mask_cudnn")
    assert exists == (installed_release()[:2] < (2, 12))
    assert cuda_sdpa.CUDNN_MASK_FILL == -65504.0
