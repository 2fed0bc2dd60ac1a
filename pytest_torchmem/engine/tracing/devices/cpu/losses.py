"""CPU rules: the margin losses (``LossMultiMargin.cpp``, ``LossMultiLabelMargin.cpp``
in ``aten/src/ATen/native``, torch 2.13).

Their kernels read raw pointers of ``.contiguous()`` copies of their operands,
held to the end, and check the targets' range with full ``min()``/``max()``
reductions, whose 0-dim results (and the reduction's own ``contiguous()`` copy
of a strided operand, ``ReduceAllOps.cpp``) are given back at once. The
backwards have no meta kernel in torch; their outputs come from
:mod:`~pytest_torchmem.engine.tracing.devices.meta_kernels`.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Step, Steps

aten = torch.ops.aten


def _copy(t: Any) -> int:
    """Bytes ``t.contiguous()`` allocates (0 for a contiguous tensor or none)."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return 0
    return t.numel() * t.element_size()


def _contiguous(operands: list[tuple[str, Any]]) -> list[Step]:
    return [Alloc(f"{name}.contiguous()", _copy(t)) for name, t in operands]


def _extremes(name: str, t: torch.Tensor, *, strided: bool = True) -> list[Step]:
    """``t.min()`` then ``t.max()`` (``min_all``/``max_all``): a 0-dim result, then
    ``t.contiguous()`` for the kernel (where ``t`` may be ``strided``); both given
    back as the check reads the value."""
    copy_bytes = _copy(t) if strided else 0
    steps: list[Step] = []
    for which in ("min", "max"):
        result, copy = f"{name}.{which}()", f"{name}.{which}(): contiguous"
        steps += [Alloc(result, t.element_size()), Alloc(copy, copy_bytes), Free(copy), Free(result)]
    return steps


@CPU.scratch(aten.multi_margin_loss.default)
def _multi_margin_loss(call: OpCall) -> Steps:
    """``multi_margin_loss_cpu_out``: the loss (``resize_``), then ``input``,
    ``target`` and ``weight`` made contiguous."""
    operands = [("input", arg(call, 0, "self")), ("target", arg(call, 1, "target"))]
    return [OUTPUTS, *_contiguous([*operands, ("weight", arg(call, 4, "weight"))])]


@CPU.scratch(aten.multi_margin_loss_backward.default)
def _multi_margin_loss_backward(call: OpCall) -> Steps:
    """``multi_margin_loss_cpu_backward_out``: ``grad_input.resize_as_(input)``, then
    ``input``, ``target`` and ``weight`` made contiguous (the output gradient is
    read through its strides)."""
    operands = [("input", arg(call, 1, "self")), ("target", arg(call, 2, "target"))]
    return [OUTPUTS, *_contiguous([*operands, ("weight", arg(call, 5, "weight"))])]


@CPU.scratch(aten.multilabel_margin_loss_forward.default)
def _multilabel_margin_loss(call: OpCall) -> Steps:
    """``multilabel_margin_loss_forward_out_cpu_template``: the loss and
    ``is_target.resize_as_(target)``; for a non-empty input the range checks of
    ``target`` and the contiguous ``input`` and ``target``."""
    self, target = arg(call, 0, "self"), arg(call, 1, "target")
    if self.numel() == 0:
        return [OUTPUTS]
    return [OUTPUTS, *_extremes("target", target), *_contiguous([("input", self), ("target", target)])]


@CPU.scratch(aten.multilabel_margin_loss_backward.default)
def _multilabel_margin_loss_backward(call: OpCall) -> Steps:
    """``multilabel_margin_loss_backward_cpu``: ``zeros_like(self)``; for a non-empty
    input the range checks of ``target``, the contiguous ``input``, ``target`` and
    ``is_target``, then the range checks of ``is_target`` (on its contiguous copy)."""
    self, target, is_target = arg(call, 1, "self"), arg(call, 2, "target"), arg(call, 4, "is_target")
    if self.numel() == 0:
        return [OUTPUTS]
    copies = _contiguous([("input", self), ("target", target), ("is_target", is_target)])
    checked = _extremes("is_target", is_target, strided=False)
    return [OUTPUTS, *_extremes("target", target), *copies, *checked]
