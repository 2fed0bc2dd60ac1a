"""CPU rules: backward formulas whose eager CPU algorithm the fake trace cannot take.

Some backward formulas (torch 2.13) pick their algorithm by
``areAnyTensorSubclassLike(...)`` and by tensor values (``.item()``,
``nonzero()``). Fake tensors count as tensor subclasses, so the trace always
runs the composite-compliant algorithm, which the eager CPU step does not, and
the eager one depends on values the trace does not know. These are not
followed; an op found only in the composite-compliant algorithm, run under the
formula's autograd node, lists the call in ``unsupported`` (never a silent
miss):

* ``evenly_distribute_backward`` (``FunctionsManual.cpp``; ``max()``, ``min()``,
  ``median()``, ``nanmedian()`` without a dim): eagerly on the CPU
  ``grad.new_zeros(...).masked_fill_(mask, grad / mask.sum())`` with ``mask``
  chosen by ``value.isnan().item()``; traced: ``input.isnan()``,
  ``logical_and``, ``logical_or_`` and ``mask * (grad / mask.sum())`` (on CUDA
  the eager step takes this one too: the rule is the CPU's);
* ``cumprod_backward`` (``FunctionsManual.cpp``): eagerly, when
  ``(input == 0).any().item()`` is false, ``reversed_cumsum(output * grad).div(input)``;
  traced: the masked O(n) algorithm for inputs with zeros (``bitwise_not``);
* ``prod_backward`` (``FunctionsManual.cpp``): eagerly by ``(input == 0).nonzero()``
  (``grad * (result / input)`` without zeros); traced: ``prod_safe_zeros_backward``
  (exclusive cumulative products joined with ``cat``);
* ``masked_fill_backward`` (``FunctionsManual.cpp``, the gradient of a tensor
  ``value``): eagerly ``grad.masked_select(mask).sum()`` (a value-sized
  selection); traced: ``at::where(mask, grad, 0).sum()`` (``scalar_tensor``).

One more formula takes its composite-compliant algorithm for any subclass, not
by values, but keeps its pieces alive across a loop, so that no later rule can
give back what it holds:

* ``householder_product_backward`` (``FunctionsManual.cpp``;
  ``linalg.householder_product``, ``ormqr``): eagerly each column's gradient is
  copied into ``zeros_like(input)`` and freed; traced: all columns are kept
  and joined with ``cat``.
"""

from __future__ import annotations

from typing import Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Inexact, OpCall, Steps

aten = torch.ops.aten

_EVENLY: Final = frozenset({"MaxBackward1", "MinBackward1", "MedianBackward0", "NanmedianBackward0"})

_HOUSEHOLDER: Final = "householder_product_backward"

#: op -> {autograd node whose formula runs it only on its traced path: the formula}.
_TRACED_ONLY: Final = {
    aten.isnan.default: dict.fromkeys(_EVENLY, "evenly_distribute_backward"),
    aten.bitwise_not.default: {"CumprodBackward0": "cumprod_backward"},
    aten.cat.default: {
        "ProdBackward0": "prod_backward",
        "ProdBackward1": "prod_backward",
        "LinalgHouseholderProductBackward0": _HOUSEHOLDER,
        "OrmqrBackward0": _HOUSEHOLDER,
    },
    aten.scalar_tensor.default: {"MaskedFillBackward1": "masked_fill_backward"},
}


@CPU.scratch(*_TRACED_ONLY)
def _traced_only(call: OpCall) -> Steps:
    node = torch._C._current_autograd_node()
    formula = _TRACED_ONLY[call.func].get(node.name()) if node is not None else None
    if formula is None:
        return [OUTPUTS]
    why = (
        "keeps every column's gradient for a cat where the eager CPU step writes them into "
        "zeros_like(input) one by one"
        if formula == _HOUSEHOLDER
        else "takes another algorithm eagerly on the CPU, chosen by tensor values"
    )
    return [
        Inexact(f"{formula} (under {node.name()}) {why}; the traced composite-compliant one is counted"),
        OUTPUTS,
    ]
