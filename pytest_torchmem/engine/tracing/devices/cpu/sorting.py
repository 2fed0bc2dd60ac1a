"""CPU rules: the selection kernels of ``aten/src/ATen/native/Sorting.cpp`` (torch 2.13).

``kthvalue`` and ``median`` partition a copy of the input in place
(``quick_select_template``, ``std::nth_element``), so the fake trace, which
sees only their outputs, misses the copy.
"""

from __future__ import annotations

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, itemsize
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, OpCall, Steps

aten = torch.ops.aten


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes of a dense tensor of ``t``'s size, in ``dtype`` (default ``t``'s)."""
    return t.numel() * itemsize(dtype or t.dtype)


@CPU.scratch(aten.kthvalue.default, aten.kthvalue.values)
def _kthvalue(call: OpCall) -> Steps:
    """``kthvalue_out_impl_cpu``: the outputs, then ``tmp_values = self.clone()``
    and ``tmp_indices``, an int64 tensor of ``self``'s size, which the
    quick-select permutes (none for a one-element 0-dim ``self``)."""
    self = arg(call, 0, "self")
    if self.dim() == 0 and self.numel() == 1:
        return [OUTPUTS]
    return [
        OUTPUTS,
        Alloc("tmp_values (self.clone())", _nbytes(self)),
        Alloc("tmp_indices", _nbytes(self, torch.long)),
    ]


@CPU.scratch(aten.median.dim, aten.median.dim_values, aten.nanmedian.dim, aten.nanmedian.dim_values)
def _median_dim(call: OpCall) -> Steps:
    """``median_with_indices_impl``: the outputs, then, when the reduced dim is not
    the innermost (``in.stride(dim) > 1``), a contiguous copy of the input with
    that dim moved last."""
    self = arg(call, 0, "self")
    if self.dim() == 0:  # viewed as (1,): stride 1
        return [OUTPUTS]
    dim = arg(call, 1, "dim") % self.dim()
    if self.stride(dim) <= 1:
        return [OUTPUTS]
    return [OUTPUTS, Alloc("input, reduced dim last (contiguous)", _nbytes(self))]


@CPU.scratch(aten.median.default, aten.nanmedian.default)
def _median(call: OpCall) -> Steps:
    """``median_impl``: ``in = self.clone()`` (partitioned in place), then the 0-dim output."""
    return [Alloc("self.clone()", _nbytes(arg(call, 0, "self"))), OUTPUTS]
