"""CPU rules: kernels whose buffers the values decide (boolean masks, ``unique``).

Their outputs' sizes depend on tensor values, which the trace knows for small
tensors computed from the step's real inputs (``values.py``): where it does,
the outputs are exact (the common fallbacks, or the op run on the values), and
these rules add what the kernel takes beside them, counted from the values.
Where the values are unknown, the fallback has already listed the op in
``unsupported`` and the rules count the largest case (every element selected).
Kernels in ``aten/src/ATen/native`` (torch 2.13): ``TensorAdvancedIndexing.cpp``
(``masked_select``, ``masked_scatter_``, ``index``/``index_put_`` with masks,
``nonzero_static``),
``Unique.cpp``.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, index_long_copies
from pytest_torchmem.engine.tracing.devices.cpu.reduce import GRAIN_SIZE, sum_steps
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Steps
from pytest_torchmem.engine.tracing.values import count_nonzero

__all__ = ["mask_nonzero_steps"]

aten = torch.ops.aten


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def mask_nonzero_steps(call: OpCall, indices: Any) -> list[Alloc]:
    """``expandTensors`` (``IndexingUtils.h``) turns each boolean mask into long
    indices with ``mask.nonzero()``: an ``(n, mask.dim())`` int64 tensor held while
    the kernel runs; ``n`` counted from the mask's values, or every element where
    they are unknown (the fallback said so)."""
    steps = []
    for number, index in enumerate(indices):
        if _is_mask(index):
            selected = count_nonzero(call.value(index))
            n = index.numel() if selected is None else selected
            steps.append(Alloc(f"nonzero{number}", n * index.dim() * 8))
    return steps


@CPU.scratch(aten.index.Tensor)
def _index_with_masks(call: OpCall) -> Steps:
    """``x[mask]``: each boolean mask's indices (:func:`mask_nonzero_steps`), held
    while the kernel runs; without masks, ``int32`` indices converted to ``int64``
    before the output is made (:func:`~.misc.index_long_copies`, measured)."""
    steps = mask_nonzero_steps(call, call.args[1]) or index_long_copies(call.args[1])
    return [*steps, OUTPUTS]


@CPU.scratch(aten.nonzero_static.default)
def _nonzero_static(call: OpCall) -> Steps:
    """``nonzero_static_out_cpu``: the output (``size`` rows), then ``nonzero(self)``
    whole, an ``(n, self.dim())`` int64 tensor whose first rows are copied in, freed
    at once. ``n`` is counted from the values; where they are unknown, every
    element (listed: the output's size is fixed, so no fallback did)."""
    self = arg(call, 0, "self")
    selected = count_nonzero(call.value(self))
    gap: list[Any] = []
    if selected is None:
        selected = self.numel()
        gap = [Inexact("nonzero_static's scratch, all of nonzero(self), depends on tensor values; every element was taken")]
    return [*gap, OUTPUTS, Alloc("nonzero(self)", selected * self.dim() * 8), Free("nonzero(self)")]


@CPU.scratch(aten.masked_select.default)
def _masked_select(call: OpCall) -> Steps:
    """``masked_select_out_impl_cpu``: ``_mask.sum().item()`` on the mask broadcast to
    the common shape (a 0-dim int64 sum, the bool mask cast to int64 for it), then
    the output; unless the serial kernel runs (fewer than ``GRAIN_SIZE`` elements or
    one thread, both operands contiguous after broadcasting), a long copy of the mask
    and its prefix sums, held to the end."""
    self, mask = arg(call, 0, "self"), arg(call, 1, "mask")
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    numel = shape.numel()
    threads = profile_of(call).threads
    steps: list[Any] = [
        Alloc("mask.sum()", 8),
        *sum_steps(threads, (numel, mask.dtype), 1, torch.long, tag="mask.sum()"),
        Free("mask.sum()"),
        OUTPUTS,
    ]
    serial = (self.numel() < GRAIN_SIZE or threads == 1) and (
        self.shape == shape and mask.shape == shape and self.is_contiguous() and mask.is_contiguous()
    )
    if call.out.numel() and not serial:
        steps += [Alloc("mask as long", numel * 8), Alloc("mask prefix sums", numel * 8)]
    return steps


@CPU.scratch(aten.masked_scatter_.default, aten.masked_scatter.default)
def _masked_scatter(call: OpCall) -> Steps:
    """``masked_scatter__cpu``: ``source.contiguous()`` for the kernel; the
    out-of-place ``masked_scatter`` clones the broadcast ``self`` first (its output;
    in ``masked_select_backward`` it runs in place: ``autograd_paths``)."""
    source = arg(call, 2, "source")
    copy = 0 if source.is_contiguous() else source.numel() * source.element_size()
    if call.func is aten.masked_scatter.default:
        return [OUTPUTS, Alloc("source.contiguous()", copy)]
    return [Alloc("source.contiguous()", copy), OUTPUTS]


@CPU.scratch(aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default)
def _index_put(call: OpCall) -> Steps:
    """``_index_put_impl_``: a single boolean mask covering ``self``'s leading dims
    with a one-element ``value`` goes to ``masked_fill_`` (``canDispatchToMaskedFill``):
    nothing beside; otherwise ``make_info`` turns the masks into indices
    (:func:`mask_nonzero_steps`), held while the kernel runs. The out-of-place
    ``index_put`` clones ``self`` first (its output). Without masks, ``AdvancedIndex``
    converts ``int32`` indices (:func:`~.misc.index_long_copies`) while the kernel runs."""
    self, indices, value = arg(call, 0, "self"), arg(call, 1, "indices"), arg(call, 2, "values")
    accumulate = arg(call, 3, "accumulate", False)
    if not any(_is_mask(i) for i in indices):
        copies = index_long_copies(indices)
        return [OUTPUTS, *copies, *(Free(a.tag) for a in copies)]
    if not accumulate and _to_masked_fill(self, indices, value):
        return [OUTPUTS]
    steps = mask_nonzero_steps(call, indices)
    if call.func is aten.index_put.default:
        return [OUTPUTS, *steps]
    return [*steps, OUTPUTS]


def _to_masked_fill(self: torch.Tensor, indices: Any, value: torch.Tensor) -> bool:
    """``canDispatchToMaskedFill``: a one-element CPU value and one mask (any ``None``
    indices before it) whose dims match ``self``'s."""
    if value.numel() != 1:
        return False
    mask, dims = None, 0
    for index in indices:
        if index is None:
            dims += 1
            continue
        if not _is_mask(index) or mask is not None:
            return False
        mask = index
        dims += index.dim()
    return mask is not None and dims <= self.dim()


@CPU.scratch(aten.repeat_interleave.Tensor)
def _repeat_interleave(call: OpCall) -> Steps:
    """``repeat_interleave_common`` (``Repeat.h``): ``repeats.contiguous()``,
    ``repeats.cumsum(0)`` (int64; an int32 ``repeats`` is cast for it), then, unless
    ``output_size`` is given, ``cumsum[-1].item()`` and ``(repeats >= 0).all().item()``
    (the wrapped 0, cast to int32 for an int32 ``repeats``, the bool comparison, the
    one-element ``all``), then the output (``repeats``' dtype); the cumsum is freed on
    return."""
    repeats = arg(call, 0, "repeats")
    n = repeats.numel()
    if n == 0:
        return [OUTPUTS]
    narrow = repeats.dtype != torch.long
    steps: list[Any] = [
        Alloc("repeats.contiguous()", _contiguous_copy(repeats)),
        Alloc("cumsum", n * 8),
    ]
    if narrow:
        steps += [Alloc("cumsum: repeats as int64", n * 8), Free("cumsum: repeats as int64")]
    if arg(call, 1, "output_size") is None:
        steps += [Alloc("wrapped 0", 8)]
        if narrow:
            steps += [Alloc("0 as int32", repeats.element_size())]
        steps += [Alloc("repeats >= 0", n), Free("wrapped 0")]
        if narrow:
            steps += [Free("0 as int32")]
        steps += [Alloc("all()", 1), Free("all()"), Free("repeats >= 0")]
    return [*steps, OUTPUTS]


# -- unique -----------------------------------------------------------------------------


def _contiguous_copy(t: torch.Tensor) -> int:
    return 0 if t.is_contiguous() else t.numel() * t.element_size()


@CPU.scratch(aten._unique2.default, aten._unique.default)
def _unique(call: OpCall) -> Steps:
    """``_unique2_cpu`` / ``_unique_cpu`` (``unique_cpu_sorted_template``):
    ``self.contiguous()``, then ``input.flatten().sort()`` (its values and indices,
    and the sort's own ``arange`` indices), then the outputs resized to the unique
    count (``inverse_indices`` to ``self``'s shape); ``return_counts`` adds
    ``unique_index`` (unique count + 1 int64), and everything but the outputs is
    freed on return. A ``bool`` input counts its trues instead of sorting
    (``unique_cpu_bool_template``): the outputs alone."""
    self = arg(call, 0, "self")
    return_counts = call.func is aten._unique2.default and bool(arg(call, 3, "return_counts", False))
    numel = self.numel()
    steps: list[Any] = [Alloc("self.contiguous()", _contiguous_copy(self))]
    if numel == 0 or self.dtype == torch.bool:
        return [*steps, OUTPUTS]
    size = self.element_size()
    steps += [
        Alloc("sorted values", numel * size),
        Alloc("sorted indices", numel * 8),
        Alloc("sort: arange indices", numel * 8),
        Free("sort: arange indices"),
        OUTPUTS,
    ]
    if return_counts:
        unique = call.out[0].numel()
        steps.append(Alloc("unique_index", (unique + 1) * 8))
    return steps


@CPU.scratch(aten.unique_consecutive.default)
def _unique_consecutive(call: OpCall) -> Steps:
    """``unique_consecutive_cpu_template``: ``self.contiguous()``, then the outputs
    (the values made at ``self``'s size and resized down, so their storage keeps
    it: the op run on the values says so)."""
    if arg(call, 3, "dim") is not None:
        return [OUTPUTS]
    return [Alloc("self.contiguous()", _contiguous_copy(arg(call, 0, "self"))), OUTPUTS]

