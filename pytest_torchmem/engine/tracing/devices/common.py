"""Rules every device model starts from: stand-ins for value-dependent ops.

Fake tensors have no values, so ``nonzero``, ``masked_select``, ``unique`` or
``.item()`` cannot be run. To let the trace go on, each gets the largest
output it could have (every element selected) or a neutral scalar, and the
estimate lists the op in ``unsupported``: for that op the figure is an upper
bound, not exact.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.autograd_paths import register_eager_in_place
from pytest_torchmem.engine.tracing.devices.collectives import register_collectives
from pytest_torchmem.engine.tracing.devices.eager_checks import register_checks
from pytest_torchmem.engine.tracing.devices.meta_kernels import register_meta_kernels
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["COMMON"]

aten = torch.ops.aten

#: Rules shared by every device model; device models copy it and add their own.
COMMON: Final = RuleSet("common")
register_checks(COMMON)
register_collectives(COMMON)
register_eager_in_place(COMMON)  # backward formulas that write in place eagerly
register_meta_kernels(COMMON)  # the outputs of ops torch gives no meta kernel

_UPPER: Final = "output size depends on tensor values; the largest possible output was assumed"



@COMMON.fallback(aten._local_scalar_dense.default)
def _item(call: OpCall) -> tuple[Any, str]:
    t = call.args[0]
    value: Any
    if t.dtype == torch.bool:
        value = False
    elif t.dtype.is_floating_point:
        value = 0.0
    elif t.dtype.is_complex:
        value = 0j
    else:
        value = 0
    return value, f"the Python value of a tensor is not known; {value!r} was used"


@COMMON.fallback(aten.nonzero.default)
def _nonzero(call: OpCall) -> tuple[Any, str]:
    t = call.args[0]
    return t.new_empty((t.numel(), t.dim()), dtype=torch.long), _UPPER


@COMMON.fallback(aten.masked_select.default)
def _masked_select(call: OpCall) -> tuple[Any, str]:
    t, mask = call.args[0], call.args[1]
    shape = torch.broadcast_shapes(t.shape, mask.shape)
    return t.new_empty((shape.numel(),)), _UPPER


@COMMON.fallback(aten.index.Tensor)
def _index_with_masks(call: OpCall) -> tuple[Any, str]:
    """``x[mask]``: every element of a boolean mask is assumed selected."""
    t, indices = call.args[0], call.args[1]
    expanded: list[Any] = []
    for index in indices:
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            everything = index.new_empty((index.numel(),), dtype=torch.long)
            expanded.extend([everything] * index.dim())
        else:
            expanded.append(index)
    return aten.index.Tensor(t, expanded), _UPPER


@COMMON.fallback(aten._unique2.default)
def _unique2(call: OpCall) -> tuple[Any, str]:
    t = call.args[0]
    return_inverse = call.arg(2, "return_inverse", False)
    return_counts = call.arg(3, "return_counts", False)
    out = t.new_empty((t.numel(),))
    inverse = t.new_empty(t.shape if return_inverse else (0,), dtype=torch.long)
    counts = t.new_empty((t.numel(),) if return_counts else (0,), dtype=torch.long)
    return (out, inverse, counts), _UPPER
