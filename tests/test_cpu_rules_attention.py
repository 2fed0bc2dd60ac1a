"""CPU rules for attention (``pytest_torchmem/engine/tracing/devices/cpu/attention.py``).

Two kinds of test: the bytes a rule gives for one call, worked out by hand from
``FlashAttentionKernel.cpp`` and ``attention.cpp``; and attention modules whose
estimate equals the CPU allocator's measurement in every phase, at 1 and 2
intra-op threads.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import intra_op_threads, skip_where_native
from exactness import rule_buffers as scratch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from zoo import CASES

import pytest_torchmem as tm

aten = torch.ops.aten
BF16 = torch.bfloat16
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    or torch.cpu._is_avx512_bf16_supported()
    or torch.cpu._is_amx_tile_supported(),
    reason="the bfloat16 figures follow oneDNN's gemm_bf16_matmul_t (a CPU without native bfloat16)",
)


# -- the bytes of one call, by hand ---------------------------------------------------


def test_flash_forward_blocks(threads: int) -> None:
    """``cpu_flash_attention`` for 32 queries of 16 dims: one block of 32 queries x
    32 keys per thread, with 32 running maxima, 32 sums and 32 x 16 outputs, in
    float; bfloat16 adds the 32 x 32 scores in bfloat16."""
    with FakeTensorMode():
        q = torch.empty(4, 4, 32, 16)
        per_thread = 32 * 32 + 32 + 32 + 32 * 16
        assert scratch(FLASH, (q, q, q), {"is_causal": True}) == {
            "per-thread blocks (accumulate type)": threads * per_thread * 4
        }
        qb = q.to(BF16)
        assert scratch(FLASH, (qb, qb, qb)) == {
            "per-thread blocks (accumulate type)": threads * per_thread * 4,
            "per-thread scores (input type)": threads * 32 * 32 * 2,
        }


def test_flash_forward_splits_long_sequences() -> None:
    """From 192 queries the query block is 64 (from 768, 256); keys come in blocks
    of at most 512."""
    with FakeTensorMode(), intra_op_threads(1):
        q, kv = torch.empty(1, 2, 200, 8), torch.empty(1, 2, 600, 8)
        assert scratch(FLASH, (q, kv, kv)) == {
            "per-thread blocks (accumulate type)": (64 * 512 + 64 + 64 + 64 * 8) * 4
        }


def test_flash_backward_buffers(threads: int) -> None:
    """``cpu_flash_attention_backward``: per thread the probabilities and their
    gradient for a 32 x 32 block, in float; once, the row sums of one query block
    (only the calling thread's allocation reaches the profiler). A ``grad_out``
    laid out as (batch, heads, length, dim) is first copied to (batch, length,
    heads, dim)."""
    with FakeTensorMode():
        q = torch.empty(4, 32, 4, 16).transpose(1, 2)  # what the forward gives
        out, lse = FLASH(q, q, q)
        expected = {
            "per-thread blocks (accumulate type)": threads * 2 * 32 * 32 * 4,
            "row sums of grad_out * out": 32 * 4,
        }
        args = (torch.empty_like(out), q, q, q, out, lse, 0.0, True)
        assert scratch(FLASH_BACKWARD, args) == expected
        contiguous = torch.empty(4, 4, 32, 16)
        args = (contiguous, q, q, q, out, lse, 0.0, True)
        assert scratch(FLASH_BACKWARD, args) == {**expected, "grad_out (contiguous copy)": 4 * 4 * 32 * 16 * 4}


@onednn_bf16
def test_flash_backward_bfloat16_gemms() -> None:
    """bfloat16: each ``cpublas::gemm`` into a gradient goes to oneDNN. 800 queries:
    query blocks of 256, key blocks of 512; the largest is ``grad_k`` of a full
    key block, 512 x 8 floats accumulated on 1 thread (+128 bytes of alignment
    room), scaled by 1/sqrt(8), which ideep passes as a one-float tensor (+4)."""
    with FakeTensorMode(), intra_op_threads(1):
        q = torch.empty(1, 800, 2, 8, dtype=BF16).transpose(1, 2)
        out, lse = FLASH(q, q, q)
        steps = scratch(FLASH_BACKWARD, (torch.empty_like(out), q, q, q, out, lse, 0.0, True))
    assert steps == {
        "per-thread blocks (accumulate type)": 2 * 256 * 512 * 4,
        "per-thread blocks (input type)": 2 * 256 * 512 * 2,
        "row sums of grad_out * out": 256 * 4,
        "oneDNN gemm into a gradient": 512 * 8 * 4 + 128 + 4,
    }


def test_safe_softmax_masks() -> None:
    """``_safe_softmax``: the ``-inf`` mask of the input (bools), its rows' ``all``
    (bools), and a zero of the output's type; with ``dtype``, the converted input."""
    with FakeTensorMode():
        x = torch.empty(2, 3, 5, 7)
        found = scratch(aten._safe_softmax.default, (x, -1))
        assert (found["isneginf(input)"], found["all(isneginf, dim)"], found["zero"]) == (210, 30, 4)
        assert "input converted to dtype" not in found
        found = scratch(aten._safe_softmax.default, (x, 1, torch.float64))
        assert found["input converted to dtype"] == 210 * 8
        assert found["all(isneginf, dim)"] == 70 and found["zero"] == 8


# -- estimate == measure ----------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dtype: torch.dtype, mask: torch.Tensor | None = None,
                 **sdpa: Any) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, dtype=dtype)
        self.sdpa = sdpa
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, **self.sdpa)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize("batch,length,width,heads", [(4, 32, 64, 4), (2, 7, 20, 2), (1, 200, 48, 2)])
def test_flash_attention(threads: int, dtype: torch.dtype, batch: int, length: int, width: int,
                         heads: int) -> None:
    torch.manual_seed(0)
    model = SelfAttention(width, heads, dtype, is_causal=True)
    x = torch.randn(batch, length, width, dtype=dtype)
    estimated = tm.estimate(model, x)
    skip_where_native(estimated)
    assert estimated.phase_peaks() == tm.measure(model, x).phase_peaks()


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize("mask", ["float", "bool", "none-contiguous-grad"])
def test_flash_attention_masks_and_layouts(threads: int, dtype: torch.dtype, mask: str) -> None:
    """Cross attention with a mask (a buffer), and q, k, v given contiguous in
    (batch, heads, length, dim), whose gradient reaches the backward in that
    layout and is copied."""
    torch.manual_seed(0)
    b, h, lq, lk, d = 2, 2, 50, 70, 24
    masks = {"float": torch.randn(lq, lk, dtype=dtype), "bool": torch.rand(lq, lk) > 0.3}
    q = torch.randn(b, h, lq, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, h, lk, d, dtype=dtype, requires_grad=True) for _ in range(2))

    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones((), dtype=dtype))
            self.register_buffer("mask", masks.get(mask))

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q * self.scale, k, v, attn_mask=self.mask, scale=0.2)

    model = Cross()
    estimated = tm.estimate(model, (q, k, v))
    skip_where_native(estimated)
    assert estimated.phase_peaks() == tm.measure(model, (q, k, v)).phase_peaks()


@pytest.mark.parametrize("causal", [False, True])
def test_math_attention_with_dropout(threads: int, causal: bool) -> None:
    """Dropout rules the flash kernel out: the composite math path, ``_safe_softmax``
    included."""
    torch.manual_seed(0)
    model = SelfAttention(64, 4, torch.float32, dropout_p=0.2, is_causal=causal)
    x = torch.randn(2, 32, 64)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


@pytest.mark.parametrize("name", ["attention_sdpa", "transformer_encoder"])
def test_zoo_cases(threads: int, name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    model, inputs = case.make()
    estimated = tm.estimate(model, inputs, **case.options)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, inputs, **case.options).phase_peaks()


def test_eager_attention_matmuls(threads: int) -> None:
    """The matmuls of hand-written attention (scores, weighted values) and the
    stride-0 gradient of ``sum()`` through them; the scale is a tensor, so no
    Python number is wrapped (see the report on wrapped scalars)."""
    torch.manual_seed(0)

    class Eager(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(64, 192)
            self.register_buffer("scale", torch.tensor(1 / math.sqrt(16)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1) @ v

    model, x = Eager(), torch.randn(4, 32, 64)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()
