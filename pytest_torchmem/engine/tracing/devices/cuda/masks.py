"""CUDA rules: value-dependent kernels, whose scratch is not modelled.

Where the trace knows the values (``values.py``) the outputs of ``nonzero``,
``masked_select``, ``unique`` and boolean-mask indexing are exact; on the GPU
these kernels also take ``cub`` temporary storage (``nonzero``'s count and
select, ``unique_dim``'s sort, ``equal``'s comparison and reduction) from the
caching allocator, which no rule follows yet: each call is listed in
``unsupported``, never silently short. ``unique`` without ``dim`` is modelled in :mod:`.unique`.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Inexact, OpCall, Steps

aten = torch.ops.aten

_GAP: Final = "its CUDA kernel's temporary storage ({}) is not modelled"

#: op -> what the CUDA kernel takes beside its outputs.
_UNMODELLED: Final = {
    aten.nonzero.default: "cub's count and select",
    aten.masked_select.default: "the mask's prefix sums",
    aten.unique_dim.default: "the sorted index",
    aten.unique_dim_consecutive.default: "the sorted index",
    aten.equal.default: "the comparison and its reduction",
}


@CUDA.scratch(*_UNMODELLED)
def _value_dependent(call: OpCall) -> Steps:
    return [Inexact(_GAP.format(_UNMODELLED[call.func])), OUTPUTS]


def _has_mask(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


@CUDA.scratch(
    aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default
)
def _mask_indexing(call: OpCall) -> Steps:
    """A boolean mask is turned into indices by ``nonzero`` inside the kernel."""
    if _has_mask(call.arg(1, "indices", ())):
        return [Inexact(_GAP.format("a boolean mask's nonzero")), OUTPUTS]
    return [OUTPUTS]
