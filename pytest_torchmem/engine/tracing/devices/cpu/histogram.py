"""CPU rules: histograms (``histc``, ``histogram``, ``histogramdd``: ``Histogram.cpp``
and ``native/cpu/HistogramKernel.cpp``, torch 2.13; measured).

Every kernel reads ``self.reshape({M, D})`` (``histc`` and ``histogram``:
``{numel, 1}``), a copy where that cannot be a view; takes the outer bin edges
from ``aminmax(input, 0)`` when no range is given (``min == max`` for
``histc``) and the input is not empty; fills the edges with ``linspace``; and
counts into ``thread_histograms = at::zeros({get_num_threads(), bins...})``,
summed into the histogram. With ``density`` it divides by ``hist.sum()`` (a
wrapped number) and by each dimension's ``bin_edges.diff()``. Torch has no
meta kernel for ``histogram`` and ``histogramdd``'s ops, which have a CPU
kernel alone: their outputs are made here, for the trace only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, view_strides
from pytest_torchmem.engine.tracing.devices.cpu.reduce import sum_steps
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Step, Steps

aten = torch.ops.aten

#: ``copy_same_type_transpose_`` (``Copy.cpp``): the block buffer of a 2-d transposed copy.
_BLOCK: Final = 60
_DOUBLE: Final = 8


def _transpose_buffer(t: torch.Tensor) -> int:
    """Bytes of the ``{BLOCK_SZ, BLOCK_SZ}`` buffer ``copy_`` takes to copy the
    transposed 2-d ``t`` into a contiguous tensor (``copy_transpose_valid``)."""
    if t.dim() != 2 or t.numel() < _BLOCK * _BLOCK or t.stride(0) != 1 or t.stride(1) != t.shape[0]:
        return 0
    block = 2 * _BLOCK if t.dtype == torch.uint8 else _BLOCK
    return block * block * t.element_size()


def _reshaped(name: str, t: Any, shape: Sequence[int]) -> list[Step]:
    """``t.reshape(shape)``: a contiguous copy named ``{name} reshaped`` (``clone``,
    whose ``copy_`` may take a transpose buffer) where no view has that shape;
    nothing otherwise."""
    if not isinstance(t, torch.Tensor) or view_strides(t.shape, t.stride(), shape) is not None:
        return []
    buffer = f"{name} copy: transpose buffer"
    return [
        Alloc(f"{name} reshaped", t.numel() * t.element_size()),
        Alloc(buffer, _transpose_buffer(t)),
        Free(buffer),
    ]


def _given_back(steps: list[Step]) -> list[Step]:
    """The frees of the copies :func:`_reshaped` made in ``steps``."""
    return [Free(s.tag) for s in steps if isinstance(s, Alloc) and s.tag.endswith(" reshaped")]


def _aminmax(self: torch.Tensor, d: int, *, whole: bool = False) -> list[Step]:
    """``aminmax(input, 0)`` of the ``(M, d)`` input: two results of ``d`` elements;
    for ``whole`` (``histc``: ``aminmax(self)`` of the input as given) the results,
    then the reduction's ``self.contiguous()`` (a copy of a strided input)."""
    nbytes = d * self.element_size()
    copy: list[Step] = []
    if whole and not self.is_contiguous():
        copy = _reshaped("aminmax: self", self, (self.numel(),))
        copy += _given_back(copy)
    return [
        Alloc("aminmax: min", nbytes), Alloc("aminmax: max", nbytes), *copy,
        Free("aminmax: min"), Free("aminmax: max"),
    ]  # fmt: skip


def _count(call: OpCall, self: torch.Tensor, bins: int) -> list[Step]:
    """``histogramdd_cpu_contiguous``'s per-thread histograms of ``bins`` bins in all."""
    nbytes = profile_of(call).threads * bins * self.element_size()
    return [Alloc("thread_histograms", nbytes), Free("thread_histograms")]


def _density(call: OpCall, self: torch.Tensor, bins: Sequence[int]) -> list[Step]:
    """``hist.div_(hist.sum().item())`` (a ``double`` wrapped and cast), then per
    dimension ``hist.div_(bin_edges[d].diff().reshape(...))``."""
    if not call.kwargs.get("density", False):
        return []
    dtype, size = self.dtype, self.element_size()
    total = math.prod(bins)
    steps: list[Step] = [
        Alloc("hist.sum()", size),
        *sum_steps(profile_of(call).threads, (total, dtype), 1, dtype, "hist.sum()"),
        Free("hist.sum()"),
        Alloc("div_: wrapped sum", _DOUBLE),
        Alloc("div_: sum as hist dtype", 0 if dtype == torch.float64 else size),
        Free("div_: sum as hist dtype"),
        Free("div_: wrapped sum"),
    ]
    for d, n in enumerate(bins):
        steps += [Alloc(f"bin lengths {d}", n * size), Free(f"bin lengths {d}")]
    return steps


def _range_from_input(call: OpCall, self: torch.Tensor) -> bool:
    return call.kwargs.get("range") is None and self.numel() > 0


# -- outputs (no meta kernel in torch) ------------------------------------------------------


def _empty(self: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(int(n) for n in shape), dtype=self.dtype, device=self.device)


@CPU.implementation(aten.histogram.bin_ct, aten.histogram.bins_tensor)
def _histogram_outputs(call: OpCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``histogram_cpu``: ``(hist, bin_edges)`` of ``bins`` and ``bins + 1`` elements
    (with bin edges given: one bin fewer than edges) of ``self``'s dtype."""
    self, bins = call.args[0], call.arg(1, "bins", 100)
    count = bins.numel() - 1 if isinstance(bins, torch.Tensor) else int(bins)
    return _empty(self, (count,)), _empty(self, (count + 1,))


@CPU.implementation(aten._histogramdd_bin_edges.default)
def _histogramdd_edges_outputs(call: OpCall) -> list[torch.Tensor]:
    """``histogramdd_bin_edges_cpu``: ``bins[d] + 1`` edges per dimension ``d``."""
    return [_empty(call.args[0], (int(n) + 1,)) for n in call.arg(1, "bins")]


@CPU.implementation(aten._histogramdd_from_bin_cts.default, aten._histogramdd_from_bin_tensors.default)
def _histogramdd_output(call: OpCall) -> torch.Tensor:
    """``_histogramdd``: the histogram of shape ``bins`` (with bin edges given: one
    bin fewer than edges per dimension)."""
    bins = call.arg(1, "bins")
    return _empty(call.args[0], [b.numel() - 1 if isinstance(b, torch.Tensor) else b for b in bins])


# -- scratch ------------------------------------------------------------------------------


@CPU.scratch(aten.histc.default)
def _histc(call: OpCall) -> Steps:
    """``histogram_histc_out``: ``self.reshape({numel, 1})``, the bin edges (not
    returned), the histogram, ``aminmax(self)`` where ``min == max``, the counts."""
    self, bins = arg(call, 0, "self"), int(arg(call, 1, "bins", 100))
    low, high = float(arg(call, 2, "min", 0)), float(arg(call, 3, "max", 0))
    steps = [*_reshaped("self", self, (self.numel(), 1)), Alloc("bin_edges", (bins + 1) * self.element_size())]
    steps.append(OUTPUTS)
    if low == high and self.numel() > 0:
        steps += _aminmax(self, 1, whole=True)
    return [*steps, *_count(call, self, bins)]


@CPU.scratch(aten.histogram.bin_ct, aten.histogram.bins_tensor)
def _histogram(call: OpCall) -> Steps:
    """``histogram_cpu``: ``self`` and ``weight`` reshaped to one column, the outputs
    (``bin_edges`` by ``linspace``, or a copy of ``bins``), ``aminmax`` for a bin
    count without a range, the counts, the density."""
    self, weight = arg(call, 0, "self"), call.kwargs.get("weight")
    bins = int(call.out[0].numel())
    steps = [*_reshaped("self", self, (self.numel(), 1))]
    if isinstance(weight, torch.Tensor):
        steps += _reshaped("weight", weight, (weight.numel(),))
    steps.append(OUTPUTS)
    if call.func is aten.histogram.bin_ct and _range_from_input(call, self):
        steps += _aminmax(self, 1)
    return [*steps, *_count(call, self, bins), *_density(call, self, [bins])]


def _flat(self: torch.Tensor) -> tuple[int, int]:
    d = self.shape[-1] if self.dim() else 1
    return (self.numel() // d if d else 0), d


@CPU.scratch(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(call: OpCall) -> Steps:
    """``histogramdd_bin_edges_cpu``: ``self.reshape({M, D})``, ``aminmax`` without
    a range, then the edges (the outputs)."""
    self = arg(call, 0, "self")
    m, d = _flat(self)
    steps = _reshaped("self", self, (m, d))
    if _range_from_input(call, self):
        steps += _aminmax(self, d)
    return [*steps, OUTPUTS]


@CPU.scratch(aten._histogramdd_from_bin_cts.default, aten._histogramdd_from_bin_tensors.default)
def _histogramdd(call: OpCall) -> Steps:
    """``_histogramdd`` (``histogramdd_out``): with bin counts, the edges as in
    :func:`_histogramdd_bin_edges` (its reshaped input given back after them); the
    edges the out variant returns (copies, not returned); the histogram; then
    ``histogramdd_out_cpu_template`` reshapes ``self`` and ``weight`` again for
    the counts, and the density."""
    self, weight = arg(call, 0, "self"), call.kwargs.get("weight")
    m, d = _flat(self)
    bins = list(call.out.shape)
    size = self.element_size()
    steps: list[Step] = []
    if call.func is aten._histogramdd_from_bin_cts.default:
        reshaped = _reshaped("self (edges)", self, (m, d))
        steps += reshaped
        if _range_from_input(call, self):
            steps += _aminmax(self, d)
        steps += [Alloc(f"bin edges {i}", (n + 1) * size) for i, n in enumerate(bins)]
        steps += _given_back(reshaped)
    steps += [Alloc(f"bin_edges out {i}", (n + 1) * size) for i, n in enumerate(bins)]
    steps.append(OUTPUTS)
    copies = _reshaped("self", self, (m, d))
    if isinstance(weight, torch.Tensor):
        copies += _reshaped("weight", weight, (m,))
    steps += [*copies, *_count(call, self, math.prod(bins)), *_given_back(copies)]
    return [*steps, *_density(call, self, bins)]


@CPU.scratch(aten.bincount.default)
def _bincount(call: OpCall) -> Steps:
    """``_bincount_cpu`` (``SummaryOps.cpp``): ``self.contiguous()`` and
    ``weights.contiguous()`` (weights neither float nor double: then ``.to(kDouble)``,
    the contiguous copy a temporary) for the call; in ``_bincount_cpu_template``,
    ``self.min()`` and ``self.max()`` (0-dim, each freed as its value is read), then
    the counts. A 1-d empty input: the counts (``zeros(minlength)``) alone. Its outputs
    are made from the values (fake tensors cannot run it): known where they are."""
    self, weights = arg(call, 0, "self"), arg(call, 1, "weights")
    steps: list[Step] = []
    held: list[str] = []
    if not self.is_contiguous():
        steps.append(Alloc("self.contiguous()", self.numel() * self.element_size()))
        held.append("self.contiguous()")
    if isinstance(weights, torch.Tensor):
        copy = not weights.is_contiguous()
        if copy:
            steps.append(Alloc("weights.contiguous()", weights.numel() * weights.element_size()))
        if weights.dtype != torch.float32 and weights.dtype != torch.float64:
            steps.append(Alloc("weights.to(kDouble)", weights.numel() * _DOUBLE))
            held.append("weights.to(kDouble)")
            if copy:
                steps.append(Free("weights.contiguous()"))
        elif copy:
            held.append("weights.contiguous()")
    if self.numel() > 0:
        size = self.element_size()
        steps += [Alloc("self.min()", size), Free("self.min()"), Alloc("self.max()", size), Free("self.max()")]
    return [*steps, OUTPUTS, *(Free(tag) for tag in held)]
