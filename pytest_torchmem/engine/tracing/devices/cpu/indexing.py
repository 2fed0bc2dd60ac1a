"""CPU rules: indexing and data-movement kernels (``Embedding.cpp``, ``PixelShuffle.cpp``,
``ChanelShuffle.cpp``, ``UnfoldBackward.cpp``, ``TensorShape.cpp``,
``TensorAdvancedIndexing.cpp`` and ``cpu/ScatterGatherKernel.cpp`` in
``aten/src/ATen/native``), torch 2.13."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import (
    arg,
    broadcast_shape,
    index_long_copies,
    scalar_comparison,
)
from pytest_torchmem.engine.tracing.devices.cpu.reduce import GRAIN_SIZE, sum_steps
from pytest_torchmem.engine.tracing.devices.tensor_iterator import non_overlapping_and_dense
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    OpCall,
    Steps,
    nbytes_of,
)

# torch's private names (engine/torch_compat/torch_private.py)
suggest_memory_format: Final = private("torch._prims_common.suggest_memory_format")

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


# -- gather, scatter, index_reduce (TensorAdvancedIndexing.cpp, ScatterGatherKernel.cpp) --


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _scatter_kernel(out: torch.Tensor, index: torch.Tensor, tag: str) -> list[Alloc | Free]:
    """``cpu_scatter_gather_base_kernel`` (``ScatterGatherKernel.cpp``), which every gather
    and scatter kernel runs on ``out`` (the tensor written): ``index.to(kLong)`` of an
    ``int32`` index, then, for a ``bfloat16``/``half`` ``out``, ``create_acc_buffer``: a
    ``float`` copy of ``out`` to accumulate in, copied back; both freed when it returns
    (the index first, measured). No kernel runs for an empty index."""
    if index.numel() == 0:
        return []
    steps: list[Alloc | Free] = []
    if index.dtype == torch.int32:
        steps.append(Alloc(f"{tag}: index as int64", index.numel() * 8))
    if out.dtype in (torch.bfloat16, torch.float16):
        steps.append(Alloc(f"{tag}: float accumulator", out.numel() * 4))
    return [*steps, *(Free(s.tag) for s in steps)]


_SCATTER_GATHER = (
    aten.gather.default, aten.gather.out,
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
    aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce,
)  # fmt: skip


@CPU.scratch(*_SCATTER_GATHER)
def _scatter_gather(call: OpCall) -> Steps:
    """``gather`` / ``scatter`` (``TORCH_IMPL_FUNC(gather_out)``, ``scatter_impl``): the
    output (a copy of ``self`` for a scatter), then the kernel (:func:`_scatter_kernel`;
    measured: ``gather`` of a (5, 5) int32 index takes 200 B beside its 100 B
    output, a ``bfloat16`` (10, 5) scatter a 200 B float copy); a gather on the
    expanded-index path (:func:`expanded_index_path`) takes nothing."""
    out, index = _first(call.out), arg(call, 2, "index")
    if call.func in _GATHER:
        self, dim = arg(call, 0, "self"), arg(call, 1, "dim")
        if index.numel() == 0 or expanded_index_path(out, dim, index, self, scatter=False):
            return [OUTPUTS]
    return [OUTPUTS, *_scatter_kernel(out, index, "kernel")]


_GATHER = (aten.gather.default, aten.gather.out)


def expanded_index_path(
    out: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, *, scatter: bool = True
) -> bool:
    """``can_use_expanded_index_path`` (``TensorAdvancedIndexing.cpp``, the GNN fast path,
    with fbgemm's OpenMP radix sort as torch's x86 wheels build it): a floating
    output, dim 0, an index expanded from a column (stride 1 on dim 0, none of size
    > 1 elsewhere; for a scatter, of at least 16 elements a row), and contiguous
    ``src`` (a gather's ``self``) and output."""
    if not out.dtype.is_floating_point or 0 in (out.numel(), index.numel(), src.numel()):
        return False
    if 0 in (out.dim(), index.dim(), src.dim()) or dim % out.dim() != 0:
        return False
    if any(src.shape[d] != index.shape[d] for d in range(1, index.dim())):
        return False
    if (scatter and index.numel() // index.shape[0] < 16) or index.stride(0) != 1:
        return False
    for size, stride in zip(index.shape[1:], index.stride()[1:]):
        if stride > 1 or (stride == 1 and size > 1):
            return False
    return src.is_contiguous() and out.is_contiguous()


def _expanded_kernel(call: OpCall, dtype: torch.dtype, row: int, tag: str) -> list[Alloc | Free]:
    """The expanded-index kernel (``cpu_scatter_reduce_expanded_index``): nothing for a
    ``float``/``double`` output; a ``bfloat16``/``half`` one is accumulated in a
    ``float`` row per thread (measured: ``threads * row * 4`` bytes, ``row`` the
    index's elements per row)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return []
    return [Alloc(tag, profile_of(call).threads * row * 4), Free(tag)]


def _row(index: torch.Tensor) -> int:
    return index.numel() // index.shape[0]


_ARGS = ("self", "dim", "index", "src")


@CPU.scratch(aten.scatter_add.default, aten.scatter_add_.default)
def _scatter_add(call: OpCall) -> Steps:
    """``TORCH_IMPL_FUNC(scatter_add)``: the expanded-index path
    (:func:`expanded_index_path`), else ``scatter_add_stub`` (:func:`_scatter_kernel`)."""
    self, dim, index, src = (arg(call, i, n) for i, n in enumerate(_ARGS))
    out = _first(call.out)
    if expanded_index_path(out, dim, index, src):
        return [OUTPUTS, *_expanded_kernel(call, out.dtype, _row(index), "expanded-index rows")]
    return [OUTPUTS, *_scatter_kernel(out, index, "kernel")]


@CPU.scratch(aten.scatter_reduce.two, aten.scatter_reduce_.two)
def _scatter_reduce(call: OpCall) -> Steps:
    """``TORCH_IMPL_FUNC(scatter_reduce_two)``: the output (a copy of ``self``), then the
    expanded-index path, or ``scatter_impl``: an excluded ``self`` is first overwritten
    by ``scatter_`` (a kernel), then the reduction (a kernel). ``mean`` then divides by
    counts: ``ones_like(src)``, ``count`` (ones or zeros like the output),
    ``count.scatter_add_(dim, index, ones)`` (a kernel on ``count``) and
    ``count.masked_fill_(count == 0, 1)`` (the mask freed after it); ``count`` and the
    ones are freed when the op returns."""
    self, dim, index, src = (arg(call, i, n) for i, n in enumerate(_ARGS))
    out = _first(call.out)
    if expanded_index_path(out, dim, index, src):
        return [OUTPUTS, *_expanded_kernel(call, out.dtype, _row(index), "expanded-index rows")]
    steps: list[Any] = [OUTPUTS]
    if not call.kwargs.get("include_self", True):
        steps += _scatter_kernel(out, index, "scatter_ (exclude self)")
    steps += _scatter_kernel(out, index, "kernel")
    if arg(call, 4, "reduce") != "mean":
        return steps
    return [
        *steps,
        Alloc("ones_like(src)", nbytes_of(src)),
        Alloc("count", nbytes_of(out)),
        *_scatter_kernel(out, index, "count.scatter_add_"),
        *scalar_comparison(out, 0, "count == 0"),
        Free("count == 0"),
    ]


_INDEX_ARGS = ("self", "dim", "index", "source")


@CPU.scratch(aten.index_reduce.default, aten.index_reduce_.default)
def _index_reduce(call: OpCall) -> Steps:
    """``index_reduce_func_impl`` (``TensorAdvancedIndexing.cpp``): the output, an
    excluded ``self`` filled through ``index.to(kLong)``, ``index.contiguous()`` (held);
    then, for a result of one dim or none, ``counts`` (ones or zeros like the result,
    whatever the reduction) and, for ``mean``, the ``counts == 0`` mask. A result of
    more dims takes counts for ``mean`` alone, with ``ones_like(source)`` added by
    ``index_add_`` (:func:`_index_add`) and freed before the mask."""
    self, dim, index, source = (arg(call, i, n) for i, n in enumerate(_INDEX_ARGS))
    out = _first(call.out)
    mean = arg(call, 4, "reduce") == "mean"
    steps: list[Any] = [OUTPUTS]
    if not call.kwargs.get("include_self", True) and index.dtype != torch.int64:
        steps += [Alloc("index as int64", index.numel() * 8), Free("index as int64")]
    if not index.is_contiguous():
        steps.append(Alloc("index.contiguous()", nbytes_of(index)))
    if out.dim() <= 1:
        steps.append(Alloc("counts", nbytes_of(out)))
        return [*steps, *scalar_comparison(out, 0, "counts == 0")] if mean else steps
    if not mean or index.numel() == 0:
        return steps
    like = (_like_is_contiguous(out), _like_is_contiguous(source))
    return [
        *steps,
        Alloc("counts", nbytes_of(out)),
        Alloc("ones_like(source)", nbytes_of(source)),
        *_index_add(call, out, dim, index, source, like),
        Free("ones_like(source)"),
        *scalar_comparison(out, 0, "counts == 0"),
        Free("counts == 0"),
        Free("counts"),
    ]


def _index_add(
    call: OpCall,
    result: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    source: torch.Tensor,
    contiguous: tuple[bool, bool],
    alpha: Any = 1,
) -> list[Alloc | Free]:
    """``index_add_cpu_out`` into ``result`` (``contiguous``: whether ``result`` and
    ``source`` are): ``index.contiguous()``; for a result of more than one dim, over
    the first or last dim, with an ``int64`` index, ``alpha == 1`` and sizes that
    match, a ``scatter_add_`` of the index viewed as a column expanded over the
    other dims (over dim 0 with rows of 16 elements or more and contiguous
    operands, the expanded-index path), else a loop of ``add``s (no scratch)."""
    steps: list[Alloc | Free] = []
    if not index.is_contiguous():
        steps.append(Alloc("index_add_: index.contiguous()", nbytes_of(index)))
    ndim = result.dim()
    dim = dim % max(ndim, 1)
    others = [d for d in range(ndim) if d != dim]
    if (
        ndim > 1
        and index.numel() > 0
        and result.numel() > 0
        and dim in (0, ndim - 1)
        and alpha == 1
        and index.dtype == torch.int64
        and all(result.shape[d] == source.shape[d] for d in others)
    ):
        row = math.prod(result.shape[d] for d in others)
        if dim == 0 and row >= 16 and all(contiguous) and result.dtype.is_floating_point:
            steps += _expanded_kernel(call, result.dtype, row, "index_add_: expanded-index rows")
        else:
            steps += _scatter_kernel(result, index, "index_add_: scatter_add_")
    return [*steps, *(Free(s.tag) for s in steps if isinstance(s, Alloc))]


@CPU.scratch(aten.index_add.default, aten.index_add_.default)
def _index_add_rule(call: OpCall) -> Steps:
    """``index_add`` (:func:`_index_add`), after its output."""
    self, dim, index, source = (arg(call, i, n) for i, n in enumerate(_INDEX_ARGS))
    out = _first(call.out)
    contiguous = (out.is_contiguous(), source.is_contiguous())
    alpha = arg(call, 4, "alpha", 1)
    return [OUTPUTS, *_index_add(call, out, dim, index, source, contiguous, alpha)]


@CPU.scratch(aten.index_select.default)
def _index_select(call: OpCall) -> Steps:
    """``index_select_out_cpu_``: the output, ``index.contiguous()``, and on the fast path
    over dim 1 (``index_select_out_cpu_dim1_``: a tensor of more dims, a contiguous
    result) ``self.contiguous()``."""
    self, dim, index = arg(call, 0, "self"), arg(call, 1, "dim"), arg(call, 2, "index")
    steps: list[Any] = [OUTPUTS, Alloc("index.contiguous()", _copy(index))]
    if self.dim() > 1 and index.numel() > 0 and dim % self.dim() == 1 and call.out.is_contiguous():
        steps.append(Alloc("self.contiguous()", _copy(self)))
    return steps


def _like_is_contiguous(t: torch.Tensor) -> bool:
    """Whether ``ones_like(t)`` (``MemoryFormat::Preserve``: ``t``'s strides when it is
    dense and non-overlapping, contiguous otherwise) is contiguous."""
    return t.is_contiguous() or not non_overlapping_and_dense(t)


# -- the masked index of inductor's decompositions (TensorAdvancedIndexing.cpp) ---------------


def _advanced_index_shape(shape: Sequence[int], indices: Sequence[Any]) -> tuple[int, ...]:
    """The shape ``self[indices]`` has (advanced indexing): the indices broadcast
    together replace the dims they index, in place when those dims are adjacent,
    first otherwise."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    if not dims:
        return tuple(shape)
    middle = broadcast_shape(*(indices[d].shape for d in dims))
    rest = [shape[d] for d in range(len(shape)) if d not in dims]
    if dims == list(range(dims[0], dims[-1] + 1)):
        return (*shape[: dims[0]], *middle, *shape[dims[-1] + 1 :])
    return (*middle, *rest)


def _clamps(indices: Sequence[Any]) -> list[Alloc]:
    """``at::clamp(index, -size, size - 1)`` of each index (its dtype and shape)."""
    return [
        Alloc(f"index {k} clamped", nbytes_of(i)) for k, i in enumerate(indices) if i is not None
    ]


@CPU.scratch(aten._unsafe_masked_index.default)
def _unsafe_masked_index(call: OpCall) -> Steps:
    """``_unsafe_masked_index``: each index clamped; then ``_unsafe_index(self, clamped)``
    (its ``int32`` indices converted first, :func:`~.misc.index_long_copies`) and
    ``result.masked_fill(logical_not(mask), fill)`` (the not-mask, then the output);
    all freed when it returns. An empty ``self`` is indexed as a ``new_full`` of its
    sizes (1 where an index meets an empty dim)."""
    self, mask, indices = arg(call, 0, "self"), arg(call, 1, "mask"), list(arg(call, 2, "indices"))
    steps: list[Any] = _clamps(indices)
    if self.numel() == 0:
        sizes = [
            1 if d < len(indices) and indices[d] is not None and size == 0 else size
            for d, size in enumerate(self.shape)
        ]
        full = math.prod(sizes) * self.element_size()
        return [*steps, Alloc("new_full", full), *index_long_copies(indices), OUTPUTS]
    result = math.prod(_advanced_index_shape(self.shape, indices)) * self.element_size()
    return [
        *steps,
        *index_long_copies(indices),
        Alloc("_unsafe_index(self, indices)", result),
        *(Free(a.tag) for a in index_long_copies(indices)),
        Alloc("logical_not(mask)", mask.numel()),
        OUTPUTS,
    ]


@CPU.scratch(aten._unsafe_masked_index_put_accumulate.default)
def _unsafe_masked_index_put_accumulate(call: OpCall) -> Steps:
    """``_unsafe_masked_index_put_accumulate`` (the backward of the above): a clone of an
    empty ``self``; else each index clamped, ``values.masked_fill(logical_not(mask), 0)``
    (the not-mask freed after it), then ``_unsafe_index_put(self, clamped, masked,
    true)``: the output (a clone of ``self``) and, in ``index_put_``, ``int32`` indices
    converted (:func:`~.misc.index_long_copies`)."""
    self, mask = arg(call, 0, "self"), arg(call, 1, "mask")
    indices, values = list(arg(call, 2, "indices")), arg(call, 3, "values")
    if self.numel() == 0:
        return [OUTPUTS]
    masked = math.prod(broadcast_shape(values.shape, mask.shape)) * values.element_size()
    copies = index_long_copies(indices)
    return [
        *_clamps(indices),
        Alloc("logical_not(mask)", mask.numel()),
        Alloc("values.masked_fill(...)", masked),
        Free("logical_not(mask)"),
        OUTPUTS,
        *copies,
        *(Free(a.tag) for a in copies),
    ]


@CPU.scratch(aten.masked_scatter_backward.default)
def _masked_scatter_backward(call: OpCall) -> Steps:
    """``masked_scatter_backward_symint`` (``TensorAdvancedIndexing.cpp``):
    ``grad.masked_select(mask)`` then, when fewer than all are selected, ``zeros`` of the
    rest and ``cat`` of the two (the output). ``masked_select_out_impl_cpu`` counts the
    selection with ``mask.sum().item()`` (the mask as ``int64``), and off its serial
    kernel (many elements on several threads, or broadcast operands) takes an
    ``int64`` copy of the mask and its prefix sum. The number selected depends on the
    values: the selection and the zeros together take one output's bytes, and the
    prefix-sum path is taken as run (an upper bound, listed)."""
    grad, mask = arg(call, 0, "grad"), arg(call, 1, "mask")
    n = math.prod(broadcast_shape(grad.shape, mask.shape))
    threads = profile_of(call).threads
    steps: list[Any] = [
        Inexact(
            "masked_scatter_backward: how many elements its masked_select takes depends on "
            "the values; its buffers were taken at their largest (an upper bound)"
        ),
        Alloc("mask.sum()", 8),
        *sum_steps(threads, (n, torch.bool), 1, torch.int64, "mask.sum()"),
        Free("mask.sum()"),
        Alloc("masked_select and zeros", n * grad.element_size()),
    ]
    serial = (
        (n < GRAIN_SIZE or threads == 1)
        and grad.is_contiguous()
        and mask.is_contiguous()
        and tuple(grad.shape) == tuple(mask.shape)
    )
    if not serial and n:
        steps += [Alloc("mask as int64", n * 8), Alloc("mask prefix sum", n * 8)]
        steps += [Free("mask as int64"), Free("mask prefix sum")]
    return [*steps, OUTPUTS]


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
