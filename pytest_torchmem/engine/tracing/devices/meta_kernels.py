"""Outputs of the ops that torch gives no meta (fake) kernel, or one that lays
the output out otherwise than the real kernel, for the trace only.

Fake tensors run an op through its meta or fake kernel; torch 2.13 registers
none for the backwards below, which have CPU and CUDA kernels, so the trace
stopped at them ("fake tensors cannot run it"). Each implementation makes the
outputs the real kernel returns (shapes, dtypes, contiguous layouts, as
``aten/src/ATen/native`` allocates them) from the arguments alone: the outputs
depend on no tensor values. They are implementation rules of the device
models, registered on every model's rule set (:func:`register_meta_kernels`);
nothing is registered in torch itself. The kernels' scratch is the devices'
concern (``cpu/pool.py``, ``cpu/losses.py``). Ops with a CPU kernel alone
(``histogram``, ``histogramdd``'s) get theirs from the CPU rules
(``cpu/histogram.py``): on ``cuda`` the trace stops where the step would fail.
"""

from __future__ import annotations

from typing import Final

import torch

from pytest_torchmem.engine.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.tensor_iterator import non_overlapping_and_dense
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["register_meta_kernels"]

aten = torch.ops.aten


#: Backwards whose input gradient is made like ``self`` (the op's second argument).
_GRAD_INPUT_LIKE_SELF: Final = (
    aten.fractional_max_pool3d_backward.default,
    aten.multi_margin_loss_backward.default,
    aten.multilabel_margin_loss_backward.default,
)


def _grad_input_like_self(call: OpCall) -> torch.Tensor:
    """``fractional_max_pool3d_backward_cpu`` (``FractionalMaxPool3d.cpp``):
    ``gradInput.resize_as_(input)``; ``multi_margin_loss_cpu_backward``
    (``LossMultiMargin.cpp``): ``grad_input.resize_as_(input)``;
    ``multilabel_margin_loss_backward_cpu`` (``LossMultiLabelMargin.cpp``):
    ``at::zeros_like(self, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``: contiguous, with
    ``self``'s shape and dtype."""
    self = call.arg(1, "self")
    return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def _index_fill_like_its_clone(call: OpCall) -> torch.Tensor:
    """``index_fill`` is ``self.clone(preserve_format).index_fill_(...)``: a dense
    ``self`` keeps its strides, a size-1 dim's stride 0 too (the incoming gradient of
    a sum, expanded). The fake kernels of torch 2.10 and 2.11 make such a result
    contiguous, and autograd's accumulation of it would then steal it where the real
    one copies it."""
    out = call.default()
    self = call.args[0]
    if torch_minor() < (2, 12) and out.stride() != self.stride() and non_overlapping_and_dense(self):
        return out.new_empty_strided(self.shape, self.stride())
    return out


def register_meta_kernels(rules: RuleSet) -> None:
    """Register the implementations above on ``rules``."""
    rules.implementation(*_GRAD_INPUT_LIKE_SELF)(_grad_input_like_self)
    rules.implementation(aten.index_fill.int_Scalar)(_index_fill_like_its_clone)
