"""CPU rules: scaled-dot-product attention.

On CPU ``F.scaled_dot_product_attention`` (``aten/src/ATen/native/transformers/
attention.cpp``) runs ``_scaled_dot_product_flash_attention_for_cpu`` whenever
``use_flash_attention_cpp`` allows it (no dropout, 4-D dense inputs...; that
choice reads only metadata, so the fake trace takes the same branch) and the
composite math path otherwise, whose ops the trace sees one by one. The flash
kernels (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``) take
per-thread blocks of the attention matrix from the allocator.

Allocations made on the intra-op worker threads are not reported to the
profiler; only the calling thread's are, and it always takes the first chunk
of a ``parallel_for``. The rules model what the profiler sees: buffers that
the kernel allocates before its parallel region, for every thread, and those
allocated inside it, once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, native_kernel_gap, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.blas import onednn_gemm_bytes
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Steps

__all__: list[str] = []

aten = torch.ops.aten

#: ``kv_split_size`` of every ``cpu_flash_attention`` instantiation.
_KV_SPLIT: Final = 512
_FLASH_KERNELS: Final = "ATen's flash-attention blocks"



def _q_split(q_len: int) -> int:
    """``q_split_size`` chosen by ``flash_attention_kernel_impl`` (and its backward)."""
    if q_len >= 768:
        return 256
    if q_len >= 192:
        return 64
    return 32


def _accumulate_size(dtype: torch.dtype) -> int:
    """Bytes of ``at::opmath_type`` (float for reduced floating types)."""
    return 8 if dtype == torch.float64 else 4


def _is_reduced(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def _transposed_is_contiguous(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """``t.transpose(1, 2).is_contiguous()`` for a 4-D ``t``, from its sizes and strides."""
    order = (0, 2, 1, 3)
    expected = 1
    for dim in reversed(order):
        if sizes[dim] != 1 and strides[dim] != expected:
            return False
        expected *= sizes[dim]
    return True


@CPU.scratch(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _flash_attention(call: OpCall) -> Steps:
    """``cpu_flash_attention``: per thread, in the accumulate type, a query block's
    scores against a key block, its running max and sum, and its output rows;
    for bfloat16/float16 also the scores rounded to the input type.

    Not modelled, and listed in ``unsupported``: the brgemm variants of CPUs
    that compute bfloat16/float16 natively (the ``avx512_bf16`` and ``amx``
    levels), which block and pack otherwise.
    """
    query = call.args[0]
    value = call.args[2]
    _batch, _heads, q_len, head = query.shape
    kv_len = value.shape[2]
    q_split = min(_q_split(q_len), q_len)
    kv_split = min(_KV_SPLIT, kv_len)
    threads = profile_of(call).threads
    per_thread = q_split * kv_split + 2 * q_split + q_split * head
    reduced = q_split * kv_split if _is_reduced(query.dtype) else 0
    return [
        *native_kernel_gap(call, query.dtype, _FLASH_KERNELS),
        OUTPUTS,
        Alloc("per-thread blocks (accumulate type)", threads * per_thread * _accumulate_size(query.dtype)),
        Alloc("per-thread scores (input type)", threads * reduced * query.element_size()),
    ]


def _backward_gemms(
    q_len: int, kv_len: int, head: int, q_split: int, kv_split: int, is_causal: bool, alpha: float
) -> Iterator[tuple[int, int, int, float]]:
    """The ``cpublas::gemm`` calls of ``cpu_flash_attention_backward`` that write
    the input type (``grad_v``, ``grad_q``, ``grad_k``), for one head, as
    column-major ``(m, n, k, alpha)``."""
    for m in range(0, q_len, q_split):
        q_block = min(q_split, q_len - m)
        num_keys = min(m + q_block, kv_len) if is_causal else kv_len
        for n in range(0, num_keys, kv_split):
            kv_block = min(kv_split, kv_len - n)
            yield head, kv_block, q_block, 1.0  # grad_v += attn.T @ grad_out
            yield head, q_block, kv_block, alpha  # grad_q += scale * grad_attn @ k
            yield head, kv_block, q_block, alpha  # grad_k += scale * grad_attn.T @ q


@CPU.scratch(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _flash_attention_backward(call: OpCall) -> Steps:
    """``_scaled_dot_product_flash_attention_cpu_backward`` and
    ``cpu_flash_attention_backward``: the gradients (outputs), a contiguous copy
    of ``grad_out`` transposed to (batch, length, heads, dim) when it is not
    already so, per thread the probabilities and their gradient for one block
    (accumulate type, and the input type for bfloat16/float16), then inside the
    parallel region a row-sum vector per thread (the calling thread's is the one
    the profiler sees); for bfloat16/float16 each ``cpublas::gemm`` into a
    gradient goes to oneDNN (``mkldnn_bf16_gemm``), whose scratchpad (and scales,
    for ``alpha`` != 1) the calling thread takes and gives back gemm by gemm: the
    largest counts.
    """
    grad_out, query, value = call.args[0], call.args[1], call.args[3]
    is_causal = bool(call.arg(7, "is_causal", False))
    scale = call.arg(9, "scale", None)
    _batch, _heads, q_len, head = query.shape
    kv_len = value.shape[2]
    dtype = query.dtype
    q_split = min(_q_split(q_len), q_len)
    kv_split = min(_KV_SPLIT, kv_len)
    threads = profile_of(call).threads
    accumulate = _accumulate_size(dtype)
    transposed = _transposed_is_contiguous(tuple(grad_out.shape), tuple(grad_out.stride()))
    grad_out_copy = 0 if transposed else grad_out.numel() * grad_out.element_size()
    blocks = 2 * q_split * kv_split
    # sdp::calculate_scale: the given scale, else 1 / sqrt(head dim).
    alpha = scale if scale is not None else 1.0 / math.sqrt(head)
    gemm = 0
    if _is_reduced(dtype) and q_len and kv_len:
        shapes = set(_backward_gemms(q_len, kv_len, head, q_split, kv_split, is_causal, alpha))
        gemm = max(onednn_gemm_bytes(profile_of(call), dtype, False, False, m, n, k, a) for m, n, k, a in shapes)
    return [
        *native_kernel_gap(call, dtype, _FLASH_KERNELS),
        OUTPUTS,
        Alloc("grad_out (contiguous copy)", grad_out_copy),
        Alloc("per-thread blocks (accumulate type)", threads * blocks * accumulate),
        Alloc("per-thread blocks (input type)", threads * blocks * query.element_size() * _is_reduced(dtype)),
        Alloc("row sums of grad_out * out", q_split * accumulate),
        Alloc("oneDNN gemm into a gradient", gemm),
    ]


@CPU.scratch(aten._safe_softmax.default)
def _safe_softmax(call: OpCall) -> Steps:
    """``_safe_softmax`` (attention.cpp; the math path's softmax, which gives 0, not
    NaN, on fully masked rows): ``softmax`` (the input converted first when a
    ``dtype`` is given, and whatever scratch the CPU ``_softmax`` rule has), then
    the ``-inf`` mask of the input, its rows' ``all``, and a 0-dim zero of the
    output's type for ``where``, which writes into the softmax output."""
    self, dim = call.args[0], call.args[1]
    dtype = call.arg(2, "dtype", None)
    out = call.out
    converted = 0
    if dtype is not None and dtype != self.dtype:
        converted = self.numel() * out.element_size()
    softmax = CPU.scratch_rule(aten._softmax.default)
    softmax_steps: list[Any] = []
    if softmax is not None:
        softmax_steps = list(softmax(OpCall(aten._softmax.default, (self, dim, False), {}, out)) or ())
    if OUTPUTS not in softmax_steps:
        softmax_steps.append(OUTPUTS)
    # the inner softmax gives its scratch back when it returns
    softmax_steps += [Free(s.tag) for s in reversed(softmax_steps) if isinstance(s, Alloc)]
    rows = self.numel() // self.shape[dim] if self.dim() and self.shape[dim] else self.numel()
    return [
        Alloc("input converted to dtype", converted),
        *softmax_steps,
        Free("input converted to dtype"),
        Alloc("isneginf(input)", self.numel()),
        Alloc("all(isneginf, dim)", rows),
        Alloc("zero", out.element_size()),
    ]
