"""CPU rules: the selection kernels of ``aten/src/ATen/native/Sorting.cpp`` and ``isin``
(``TensorCompare.cpp``), torch 2.13.

``kthvalue`` and ``median`` partition a copy of the input in place
(``quick_select_template``, ``std::nth_element``), so the fake trace, which
sees only their outputs, misses the copy.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import (
    arg,
    itemsize,
    promotion_casts,
    wrapped_nbytes,
)
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Steps

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


# -- isin (TensorCompare.cpp) -------------------------------------------------------------


def _isin_steps(
    elements: torch.Tensor | Any, test: torch.Tensor, assume_unique: bool
) -> list[Alloc | Free | Inexact]:
    """``isin_Tensor_Tensor_out`` after its output, for ``elements`` a tensor or (from
    ``isin.Scalar_Tensor``) a wrapped Python number: nothing for no elements; with
    fewer test elements than ``10 * numel ** 0.145`` (numpy's heuristic),
    ``isin_default_kernel_cpu`` (both operands cast to their common dtype); else
    ``isin_sorting``."""
    number = not isinstance(elements, torch.Tensor)
    n = 1 if number else elements.numel()
    m = test.numel()
    if n == 0:
        return []
    if m < int(10.0 * n**0.145):
        return list(promotion_casts([elements, test]))
    if not assume_unique:
        return [
            Inexact(
                "isin's sort-based kernel without assume_unique: the sizes of its unique "
                "copies, and of all that follows, depend on the values; only the output "
                "is counted"
            )
        ]
    dtype = _wrapped_dtype(elements) if number else elements.dtype
    if dtype != test.dtype:
        return [Inexact("isin's sort-based kernel on operands of two dtypes (a cast in cat)")]
    total, size = n + m, itemsize(dtype)
    ravel = [] if number or elements.is_contiguous() else [Alloc("elements.ravel()", n * size)]
    if not test.is_contiguous():
        ravel.append(Alloc("test_elements.ravel()", m * size))
    return [
        *ravel,
        Alloc("all_elements (cat)", total * size),
        *(Free(a.tag) for a in reversed(ravel)),
        Alloc("sorted_elements", total * size),
        Alloc("sorted_order", total * 8),
        Alloc("sort: arange indices", total * 8),
        Free("sort: arange indices"),
        Alloc("duplicate_mask", total),
        Alloc("adjacent eq", total - 1),
        Free("adjacent eq"),
        Alloc("index_put_ value", 1),
        Free("index_put_ value"),
        Alloc("mask", total),
    ]


def _wrapped_dtype(value: Any) -> torch.dtype:
    return {bool: torch.bool, int: torch.int64, float: torch.float64}[type(value)]


@CPU.scratch(aten.isin.Tensor_Tensor)
def _isin(call: OpCall) -> Steps:
    """``isin`` of two tensors (:func:`_isin_steps`). The sort-based kernel with
    ``assume_unique`` ravels both (copies where not contiguous), concatenates them,
    sorts stably (values, int64 order, the sort's ``arange``), marks adjacent
    duplicates (a bool mask, an ``eq`` of the shifted views, ``index_put_``'s value)
    and reorders the mask into a second one; all freed when it returns. Without
    ``assume_unique`` it first takes ``_unique`` of each, whose sizes depend on the
    values: listed."""
    elements, test = arg(call, 0, "elements"), arg(call, 1, "test_elements")
    return [OUTPUTS, *_isin_steps(elements, test, call.kwargs.get("assume_unique", False))]


@CPU.scratch(aten.isin.Scalar_Tensor)
def _isin_scalar_tensor(call: OpCall) -> Steps:
    """``isin_Scalar_Tensor_out``: the number wrapped (before the output, measured), then
    ``isin`` of that 0-dim tensor (:func:`_isin_steps`)."""
    element, test = arg(call, 0, "element"), arg(call, 1, "test_elements")
    if type(element) not in (bool, int, float):
        return [Inexact("isin of a complex number is not modelled"), OUTPUTS]
    steps = _isin_steps(element, test, call.kwargs.get("assume_unique", False))
    return [Alloc("wrapped element", wrapped_nbytes(element)), OUTPUTS, *steps]


@CPU.scratch(aten.isin.Tensor_Scalar)
def _isin_tensor_scalar(call: OpCall) -> Steps:
    """``isin_Tensor_Scalar_out``: ``eq_out`` (``ne_out`` inverted) into the output, which
    wraps the number and casts it to the elements' dtype."""
    elements, test = arg(call, 0, "elements"), arg(call, 1, "test_element")
    casts = promotion_casts([elements, test])
    return [
        OUTPUTS,
        Alloc("wrapped test element", wrapped_nbytes(test)),
        *casts,
        Free("wrapped test element"),
        *(Free(c.tag) for c in casts),
    ]
