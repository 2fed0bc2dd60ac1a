"""CPU rules: indexing and data-movement kernels (``Embedding.cpp``, ``PixelShuffle.cpp``,
``ChanelShuffle.cpp``, ``UnfoldBackward.cpp`` in ``aten/src/ATen/native``), torch 2.13."""

from __future__ import annotations

import math
from typing import Any, Final, NamedTuple

import torch
from torch._prims_common import (
    is_non_overlapping_and_dense_or_false,
    make_contiguous_strides_for,
    suggest_memory_format,
)

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
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


_GATHER = (aten.gather.default, aten.gather.out)
_SCATTER_ADD = (aten.scatter_add.default, aten.scatter_add_.default)
_SCATTER_REDUCE = (aten.scatter_reduce.two, aten.scatter_reduce_.two)
_SCATTER_GATHER = (
    *_GATHER, *_SCATTER_ADD, *_SCATTER_REDUCE,
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
    aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce,
)  # fmt: skip

#: ``isReducedFloatingType``: the dtypes ``cpu_scatter_gather_base_kernel`` accumulates in float.
_REDUCED: Final = (torch.bfloat16, torch.float16)


class _Index(NamedTuple):
    """The int64 index a scatter/gather kernel reads: sizes and strides."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @classmethod
    def of(cls, index: torch.Tensor) -> _Index:
        """``index``, or an int32 one's ``to(kLong)`` copy (its strides where dense,
        else contiguous)."""
        if index.dtype == torch.int64 or is_non_overlapping_and_dense_or_false(index):
            return cls(tuple(index.shape), tuple(index.stride()))
        return cls(tuple(index.shape), tuple(make_contiguous_strides_for(index.shape)))


def _expanded_index(self: torch.Tensor, dim: int, index: _Index, src: Any, *, scatter: bool) -> bool:
    """``can_use_expanded_index_path`` (``TensorAdvancedIndexing.cpp``; x86 builds have
    FBGEMM's OpenMP radix sort): the GNN fast path of ``gather``, ``scatter_add`` and
    ``scatter_reduce.two``, taken for an index expanded along ``dim == 0`` (stride 1
    there, 0 elsewhere), contiguous ``self`` (the written tensor) and ``src``, and,
    for a scatter, at least 16 columns."""
    if not isinstance(src, torch.Tensor) or not self.is_floating_point():
        return False
    if 0 in (self.numel(), index.numel, src.numel(), self.dim(), len(index.sizes), src.dim()):
        return False
    sizes, strides = index
    if any(src.shape[d] != sizes[d] for d in range(1, len(sizes))):
        return False
    if scatter and index.numel // sizes[0] < 16:
        return False
    expanded = strides[0] == 1 and not any(
        strides[d] > 1 or (strides[d] == 1 and sizes[d] > 1) for d in range(1, len(sizes))
    )
    return dim % self.dim() == 0 and expanded and src.is_contiguous() and self.is_contiguous()


def _accumulation(
    call: OpCall, func: Any, written: torch.Tensor, index: _Index, src: Any, dim: int
) -> Steps:
    """The float buffer a bfloat16/float16 ``gather``/``scatter*`` (``func``)
    accumulates in (``ScatterGatherKernel.cpp``): ``create_acc_buffer`` gives the base
    kernel ``at::empty(self.sizes(), kFloat)``, copied in and back (``self`` is the
    written tensor); the expanded-index path of a scatter sums each row in one
    ``at::zeros({num_threads, K}, kFloat)`` (``cpu_scatter_reduce_expanded_index``,
    ``K = index.numel() / index.size(0)``), and that of ``gather`` copies rows
    directly. ``scatter_reduce.two`` without ``include_self`` first fills the indexed
    places (``scatter_``: a buffer of its own, freed before the reduction's)."""
    if written.dtype not in _REDUCED or index.numel == 0:
        return []
    if func in _GATHER or func in _SCATTER_ADD or func in _SCATTER_REDUCE:
        if _expanded_index(written, dim, index, src, scatter=func not in _GATHER):
            if func in _GATHER:
                return []
            columns = index.numel // index.sizes[0]
            return [Alloc("float rows per thread", profile_of(call).threads * columns * 4)]
    steps: list[Any] = []
    if func in _SCATTER_REDUCE and not arg(call, 5, "include_self", True):
        fill = "float buffer of the exclude-self fill"
        steps += [Alloc(fill, written.numel() * 4), Free(fill)]
    return [*steps, Alloc("float buffer", written.numel() * 4)]


@CPU.scratch(*_SCATTER_GATHER)
def _scatter_gather(call: OpCall) -> Steps:
    """``gather`` / ``scatter*`` on the CPU (``TensorAdvancedIndexing.cpp``,
    ``ScatterGatherKernel.cpp``) index with ``int64``: an ``int32`` index is converted
    (``index.to(kLong)``, 8 bytes an element) after the output is made (measured:
    ``gather`` of a (5, 5) int32 index takes 200 B beside its 100 B output, and
    ``gather``'s backward ``scatter_add_`` the same); in bfloat16 and float16 the
    kernel then accumulates in float (:func:`_accumulation`). ``scatter_reduce``'s
    mean keeps counts and copies (``scatter_reduce_two``) that are not modelled: listed."""
    index = arg(call, 2, "index")
    steps: Steps = [OUTPUTS]
    if call.func in _SCATTER_REDUCE and arg(call, 4, "reduce") == "mean":
        steps.insert(0, Inexact("scatter_reduce's mean counts and copies are not modelled"))
    if not isinstance(index, torch.Tensor):
        return steps
    gather = call.func in _GATHER
    written = call.out if gather else _written(call)
    source = arg(call, 0, "self") if gather else arg(call, 3, "src", arg(call, 3, "value"))
    buffer = _accumulation(call, call.func, written, _Index.of(index), source, arg(call, 1, "dim"))
    if index.dtype != torch.int32 or index.numel() == 0:
        return [*steps, *buffer]
    return [*steps, Alloc("index as int64", index.numel() * 8), *buffer]


def _written(call: OpCall) -> torch.Tensor:
    """The tensor an op writes: ``self`` of an in-place op, else its output."""
    out = call.out[0] if isinstance(call.out, (tuple, list)) else call.out
    return arg(call, 0, "self") if call.func._schema.name.endswith("_") else out


_INDEX_ADD = (aten.index_add.default, aten.index_add_.default, aten.index_add.out)


@CPU.scratch(*_INDEX_ADD)
def _index_add(call: OpCall) -> Steps:
    """``index_add_cpu_out`` (``TensorAdvancedIndexing.cpp``): ``index.contiguous()``;
    then, for a result of two or more dims added along its first or last dim with
    ``alpha == 1``, an int64 index and ``source`` of the result's sizes apart from
    ``dim``, ``result.scatter_add_(dim, index.as_strided(...))`` with the index
    expanded over the other dims: in bfloat16 and float16 that kernel's float
    buffer (:func:`_accumulation`; the expanded-index path along dim 0)."""
    self, dim, index = arg(call, 0, "self"), arg(call, 1, "dim"), arg(call, 2, "index")
    source, alpha = arg(call, 3, "source"), arg(call, 4, "alpha", 1)
    steps: list[Any] = [OUTPUTS, Alloc("index.contiguous()", _copy(index))]
    result = _written(call)
    if result.dim() <= 1 or index.numel() == 0 or self.numel() == 0:
        return steps
    dim %= result.dim()
    if dim not in (0, result.dim() - 1) or alpha != 1 or index.dtype != torch.int64:
        return steps
    if any(result.shape[d] != source.shape[d] for d in range(result.dim()) if d != dim):
        return steps
    expanded = _Index(
        tuple(index.numel() if d == dim else result.shape[d] for d in range(result.dim())),
        tuple(1 if d == dim else 0 for d in range(result.dim())),
    )
    return [*steps, *_accumulation(call, aten.scatter_add_.default, result, expanded, source, dim)]


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
