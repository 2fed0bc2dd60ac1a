"""Backward formulas that write in place in eager mode but not under a dispatch mode.

Several backward formulas make a zero tensor and scatter the gradient into it
in place, except when a tensor is a subclass or a dispatch mode is active
(``at::areAnyTensorSubclassLike``), where they call the out-of-place op "for
composite compliance". The fake trace always runs under a dispatch mode, so
it would allocate a second buffer of the input's size that the eager step
never makes (``x.max(dim)``'s backward: ``zeros.scatter(...)`` instead of
``zeros.scatter_(...)``). Under the autograd nodes of those formulas the
out-of-place op runs in place on its first argument, as eagerly, on every
device. Formulas (torch 2.13):

* ``value_selecting_reduction_backward_symint`` (``ReduceOps.cpp``): max, min,
  sort, topk, kthvalue, mode, median, nanmedian with a dim: ``scatter_``;
* ``gather_backward`` (``TensorAdvancedIndexing.cpp``) and
  ``cummaxmin_backward`` (``FunctionsManual.cpp``): ``scatter_add_``;
* ``index_select_backward_symint`` (``TensorAdvancedIndexing.cpp``): ``index_add_``;
* ``index_backward`` (``FunctionsManual.cpp``, ``x[idx]``):
  ``at::_index_put_impl_(zeros, indices, grad, accumulate=true, unsafe=true)``;
* ``clamp_backward`` and ``clamp_backward_min_max`` with tensor bounds
  (``FunctionsManual.cpp``): up to torch 2.13, ``logical_and_`` / ``logical_or_`` on a
  comparison's result; from 2.14 (the formula rewritten: ties at a bound halve the
  gradient, ``min > max`` handled) the masks are built out of place and the result of
  ``where`` is zeroed with ``masked_fill_`` (seen in the profiler's op events of 2.10.0,
  2.13.0, 2.14.1 and 2.15.0: ``ge, le, logical_and_, where`` against ``lt, eq, eq,
  logical_or, logical_and, lt, gt, logical_or, div, where, masked_fill_``).
* ``maximum``/``minimum`` backward (``MaximumBackward0``/``MinimumBackward0``, the
  ties-halving ``where(a == b, grad / 2, grad).masked_fill_(...)`` formula): up to 2.13
  a dispatch mode sees ``masked_fill_.Scalar`` itself; from 2.14 it sees
  ``masked_fill.Scalar`` while the eager run still zeroes in place (the measured
  peak is the same on 2.13.0, 2.14.1 and 2.15.0: 81928 B for
  ``test_mixed_dtypes_exact``), so from 2.14 these nodes share clamp's entry;
* ``trace_backward_symint`` (``FunctionsManual.cpp``): ``index_fill_`` of the
  diagonal's flat indices;
* ``take_backward`` (``FunctionsManual.cpp``): ``zeros_like(input).put_(index, grad, true)``;
* ``linalg_eig_backward`` (``FunctionsManual.cpp``; ``linalg.eig``, ``linalg.eigh``):
  ``ret.diagonal(0, -2, -1).copy_(gL)`` where a subclass takes ``diagonal_scatter``;
* ``masked_select_backward`` (``TensorAdvancedIndexing.cpp``): ``masked_scatter_``
  into ``zeros_like`` of the broadcast input;
* ``binary_cross_entropy_target_backward`` (``FunctionsManual.cpp``):
  ``at::logit(self).neg_()`` multiplied by the gradient (and the weight) with ``mul_``.
  ``mul`` is a binary elementwise op whose output a device model may lay out itself
  (the CPU's), so it is in :data:`EAGER_IN_PLACE_BINARY`: such a device's rule asks
  :func:`in_place_twin` first; a device without one registers the table too.

(``evenly_distribute_backward``, ``masked_fill_backward``, ``prod_backward`` and
``cumprod_backward`` take other algorithms eagerly, chosen by values; they are
not followed, and the CPU lists them in ``unsupported``: ``cpu/formulas.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.meta_kernels import laid_out_as_cloned
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["EAGER_IN_PLACE", "EAGER_IN_PLACE_BINARY", "in_place_twin", "register_eager_in_place"]

# torch's private names (engine/torch_compat/torch_private.py)
_current_autograd_node: Final = private("torch._C._current_autograd_node")

aten = torch.ops.aten

_SELECTING: Final = frozenset(
    {
        "MaxBackward0",
        "MinBackward0",
        "SortBackward0",
        "SortBackward1",
        "TopkBackward0",
        "KthvalueBackward0",
        "ModeBackward0",
        "MedianBackward1",
        "NanmedianBackward1",
    }
)


def _diagonal_copy(
    t: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> torch.Tensor:
    t.diagonal(offset, dim1, dim2).copy_(src)
    return t


def _index_put(
    t: torch.Tensor, indices: Any, values: torch.Tensor, accumulate: bool = False
) -> Any:
    return aten._index_put_impl_.default(t, indices, values, accumulate, True)


#: out-of-place op -> (what the eager formula calls instead, the autograd nodes that do).
EAGER_IN_PLACE: Final[dict[Any, tuple[Callable[..., Any], frozenset[str]]]] = {
    aten.scatter.src: (aten.scatter_.src, _SELECTING),
    aten.scatter_add.default: (
        aten.scatter_add_.default,
        frozenset({"GatherBackward0", "CummaxBackward0", "CumminBackward0"}),
    ),
    aten.index_add.default: (aten.index_add_.default, frozenset({"IndexSelectBackward0"})),
    aten.index_put.default: (_index_put, frozenset({"IndexBackward0"})),
    **(
        {
            aten.logical_and.default: (aten.logical_and_.default, frozenset({"ClampBackward0"})),
            aten.logical_or.default: (aten.logical_or_.default, frozenset({"ClampBackward0"})),
        }
        if torch_minor() <= (2, 13)
        else {
            aten.masked_fill.Scalar: (
                aten.masked_fill_.Scalar,
                frozenset(
                    {
                        "ClampBackward0", "ClampMaxBackward1", "ClampMinBackward1",
                        "MaximumBackward0", "MinimumBackward0", "FmaxBackward0", "FminBackward0",
                    }
                ),  # fmt: skip
            )
        }
    ),
    aten.index_fill.int_Tensor: (aten.index_fill_.int_Tensor, frozenset({"TraceBackward0"})),
    aten.put.default: (aten.put_.default, frozenset({"TakeBackward0"})),
    aten.diagonal_scatter.default: (
        _diagonal_copy,
        frozenset({"LinalgEighBackward0", "LinalgEigBackward0"}),
    ),
    aten.masked_scatter.default: (
        aten.masked_scatter_.default,
        frozenset({"MaskedSelectBackward0"}),
    ),
}


#: Binary elementwise ops of the formulas above (see :func:`in_place_twin`).
EAGER_IN_PLACE_BINARY: Final[dict[Any, tuple[Callable[..., Any], frozenset[str]]]] = {
    aten.mul.Tensor: (aten.mul_.Tensor, frozenset({"BinaryCrossEntropyBackward0"})),
}


def in_place_twin(call: OpCall) -> Callable[..., Any] | None:
    """The in-place op the eager formula calls instead of ``call.func``, when the
    running autograd node is one of those formulas; else None."""
    entry = EAGER_IN_PLACE.get(call.func) or EAGER_IN_PLACE_BINARY.get(call.func)
    if entry is None:
        return None
    in_place, nodes = entry
    node = _current_autograd_node()
    return in_place if node is not None and node.name() in nodes else None


def _eager_in_place(call: OpCall) -> Any:
    """The out-of-place op, or its in-place twin inside the formulas above."""
    twin = in_place_twin(call)
    return twin(*call.args, **call.kwargs) if twin is not None else laid_out_as_cloned(call, call.default())


def register_eager_in_place(rules: RuleSet, table: dict[Any, Any] = EAGER_IN_PLACE) -> None:
    """Register :func:`_eager_in_place` for the ops of ``table`` on ``rules``."""
    rules.implementation(*table)(_eager_in_place)
