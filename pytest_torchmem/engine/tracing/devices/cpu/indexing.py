"""CPU rules: indexing and data-movement kernels (``Embedding.cpp``, ``PixelShuffle.cpp``,
``ChanelShuffle.cpp``, ``UnfoldBackward.cpp``, ``TensorShape.cpp``,
``TensorAdvancedIndexing.cpp`` in ``aten/src/ATen/native``), torch 2.13."""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Steps

aten = torch.ops.aten


def _copy(t: torch.Tensor) -> int:
    """Bytes ``t.contiguous()`` allocates (0 when ``t`` already is)."""
    return 0 if t.is_contiguous() else t.numel() * t.element_size()


@CPU.scratch(aten.embedding_dense_backward.default)
def _embedding_backward(call: OpCall) -> Steps:
    """``embedding_dense_backward_cpu``: ``grad_weight = at::zeros(...)`` (the output),
    then ``indices.contiguous()`` and ``grad_.contiguous()`` (a broadcast or
    transposed gradient is copied)."""
    grad, indices = arg(call, 0, "grad_output"), arg(call, 1, "indices")
    return [
        OUTPUTS,
        Alloc("indices.contiguous()", _copy(indices)),
        Alloc("grad.contiguous()", _copy(grad)),
    ]


@CPU.scratch(aten.pixel_shuffle.default, aten.pixel_unshuffle.default, aten.channel_shuffle.default)
def _shuffle(call: OpCall) -> Steps:
    """``pixel_shuffle_cpu`` / ``pixel_unshuffle_cpu`` / ``channel_shuffle_cpu``: the
    output, made in ``self.suggest_memory_format()``, then ``self.contiguous()`` in that
    format for the kernel (nothing for an empty tensor)."""
    self = arg(call, 0, "self")
    if self.numel() == 0 or call.out.numel() == 0:
        return [OUTPUTS]
    fmt = suggest_memory_format(self)
    copy = 0 if self.is_contiguous(memory_format=fmt) else self.numel() * self.element_size()
    return [OUTPUTS, Alloc("self.contiguous(suggested format)", copy)]


@CPU.scratch(aten.roll.default)
def _roll(call: OpCall) -> Steps:
    """``roll`` on the CPU (``TensorTransformations.cpp``, ``roll_common`` in
    ``TensorTransformations.h``): one dim is ``at::cat`` of two narrowed views (the
    output alone); ``k`` dims roll the first dim, then the rest of the result,
    recursively, each intermediate (``first_dim_rolled``) held until the end; no
    dims flattens ``self.contiguous()`` first."""
    self, dims = arg(call, 0, "self"), arg(call, 2, "dims", ())
    nbytes = self.numel() * self.element_size()
    if self.numel() == 0:
        return [OUTPUTS]
    if len(dims) == 0:
        return [Alloc("self.contiguous()", _copy(self)), OUTPUTS]
    return [*(Alloc(f"rolled over dims[:{i + 1}]", nbytes) for i in range(len(dims) - 1)), OUTPUTS]


@CPU.scratch(aten.unfold_backward.default)
def _unfold_backward(call: OpCall) -> Steps:
    """``unfold_backward`` (``UnfoldBackward.cpp``): ``grad_input = at::zeros(...)`` (the
    output); with ``step >= size`` the windows do not overlap and the gradient is
    copied into ``grad_input.unfold(...)``; otherwise ``unfold_backward_stub`` builds
    ``_make_unfold_backward_iter_over_grad_out`` (``UnfoldBackward.h``), which indexes
    with ``at::arange(0, grad_in.size(dim), kLong)`` (8 bytes per input element along
    ``dim``)."""
    sizes, dim = arg(call, 1, "input_sizes"), arg(call, 2, "dim")
    size, step = arg(call, 3, "size"), arg(call, 4, "step")
    if step >= size or call.out.numel() == 0:
        return [OUTPUTS]
    length = int(sizes[dim]) if len(sizes) else 1
    return [OUTPUTS, Alloc("idx_dim", length * 8)]


@CPU.scratch(aten.repeat.default)
def _repeat(call: OpCall) -> Steps:
    """``repeat`` (``TensorShape.cpp``): the result, copied into through ``unfold``
    views of it; then, for ``n`` repeat dims, an ``int64`` permutation of ``2n``
    dims (``cat`` of ``arange(n)`` and ``arange(n).add(n)``, whose ``add.Scalar``
    wraps ``n`` in an 8-byte tensor), given back before it returns (measured). A
    zero repeat returns the empty result at once."""
    repeats = arg(call, 1, "repeats")
    n = len(repeats)
    if any(r == 0 for r in repeats):
        return [OUTPUTS]
    return [
        OUTPUTS,
        Alloc("arange(n)", 8 * n),
        Alloc("add: wrapped n", 8),
        Alloc("arange(n) + n", 8 * n),
        Free("add: wrapped n"),
        Alloc("permutation (cat)", 16 * n),
        Free("arange(n)"),
        Free("arange(n) + n"),
        Free("permutation (cat)"),
    ]


@CPU.scratch(aten.index_select.default)
def _index_select(call: OpCall) -> Steps:
    """``index_select_out_cpu_`` (``TensorAdvancedIndexing.cpp``): along dim 1 of a
    tensor of two or more dims, ``index_select_out_cpu_dim1_`` reads
    ``self.contiguous()``, a copy of a broadcast or permuted ``self`` (an expanded
    gradient in ``index_copy``'s backward), after the result is made."""
    self, dim, index = arg(call, 0, "self"), arg(call, 1, "dim"), arg(call, 2, "index")
    if self.dim() < 2 or dim % self.dim() != 1 or index.numel() == 0 or self.numel() == 0:
        return [OUTPUTS]
    return [OUTPUTS, Alloc("self.contiguous()", _copy(self))]


_SCATTER_GATHER = (
    aten.gather.default, aten.gather.out,
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
    aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce,
    aten.scatter_add.default, aten.scatter_add_.default,
    aten.scatter_reduce.two, aten.scatter_reduce_.two,
)  # fmt: skip


@CPU.scratch(*_SCATTER_GATHER)
def _scatter_gather(call: OpCall) -> Steps:
    """``gather`` / ``scatter*`` on the CPU (``TensorAdvancedIndexing.cpp``,
    ``ScatterGatherKernel.cpp``) index with ``int64``: an ``int32`` index is converted
    (``index.to(kLong)``, 8 bytes an element) after the output is made (measured:
    ``gather`` of a (5, 5) int32 index takes 200 B beside its 100 B output, and
    ``gather``'s backward ``scatter_add_`` the same). ``scatter_reduce``'s mean keeps
    counts and copies (``scatter_reduce_two``) that are not modelled: listed."""
    index = arg(call, 2, "index")
    steps: Steps = [OUTPUTS]
    if call.func in _SCATTER_REDUCE and arg(call, 4, "reduce") == "mean":
        steps.insert(0, Inexact("scatter_reduce's mean counts and copies are not modelled"))
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int32 or index.numel() == 0:
        return steps
    return [*steps, Alloc("index as int64", index.numel() * 8)]


_SCATTER_REDUCE = (aten.scatter_reduce.two, aten.scatter_reduce_.two)


@CPU.scratch(aten._chunk_cat.default)
def _chunk_cat(call: OpCall) -> Steps:
    """``_chunk_cat`` (``TensorShape.cpp``): ``at::cat(_pad_chunk(tensors, dim, num_chunks),
    dim + 1)``; ``_pad_chunk`` gives each tensor whose size along ``dim`` is not a
    multiple of ``num_chunks`` a zero-padded copy (``new_zeros`` of the rounded-up
    size), held until the op returns; the others are viewed."""
    tensors, dim, chunks = arg(call, 0, "tensors"), arg(call, 1, "dim"), arg(call, 2, "num_chunks")
    steps: Steps = []
    for i, t in enumerate(tensors):
        d = dim % t.dim()
        size = t.shape[d]
        if size % chunks:
            padded = t.numel() // size * ((size + chunks - 1) // chunks * chunks) if size else 0
            steps.append(Alloc(f"tensor {i} padded", padded * t.element_size()))
    return [*steps, OUTPUTS]
