"""Outputs of the ops that torch gives no meta (fake) kernel, for the trace only.

Fake tensors run an op through its meta or fake kernel; torch 2.13 registers
none for the ops below, so the trace stopped at them ("fake tensors cannot run
it"). Each implementation makes the outputs the real kernel returns (shapes,
dtypes, contiguous layouts, as ``aten/src/ATen/native`` allocates them) from
the arguments alone: the outputs depend on no tensor values. They are
implementation rules of the device models, registered on every model's rule
set (:func:`register_meta_kernels`); nothing is registered in torch itself.
The kernels' scratch is the devices' concern (``cpu/pool.py``,
``cpu/losses.py``, ``cpu/histogram.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["register_meta_kernels"]

aten = torch.ops.aten


def _like(t: torch.Tensor) -> torch.Tensor:
    """``at::empty({0}).resize_as_(t)`` / ``zeros_like(t, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _grad_input_like_self(call: OpCall) -> torch.Tensor:
    """``fractional_max_pool3d_backward_cpu`` (``FractionalMaxPool3d.cpp``):
    ``gradInput.resize_as_(input)``; ``multi_margin_loss_cpu_backward``
    (``LossMultiMargin.cpp``): ``grad_input.resize_as_(input)``;
    ``multilabel_margin_loss_backward_cpu`` (``LossMultiLabelMargin.cpp``):
    ``at::zeros_like(self, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``: contiguous, ``self``'s
    shape and dtype (``self`` is the op's second argument)."""
    return _like(call.arg(1, "self"))


def _edges(self: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    return [torch.empty((int(n) + 1,), dtype=self.dtype, device=self.device) for n in counts]


def _histogram_bin_ct(call: OpCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``histogram_cpu`` (``Histogram.cpp``) with a bin count: ``(hist, bin_edges)``
    of ``bins`` and ``bins + 1`` elements of ``self``'s dtype."""
    self, bins = call.args[0], int(call.arg(1, "bins", 100))
    (edges,) = _edges(self, [bins])
    return torch.empty((bins,), dtype=self.dtype, device=self.device), edges


def _histogram_bins_tensor(call: OpCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``histogram_cpu`` with bin edges: ``hist`` of one element fewer than ``bins``,
    and a copy of ``bins`` as ``bin_edges``."""
    self, bins = call.args[0], call.arg(1, "bins")
    (edges,) = _edges(self, [bins.numel() - 1])
    return torch.empty((bins.numel() - 1,), dtype=self.dtype, device=self.device), edges


def _histogramdd_bin_edges(call: OpCall) -> list[torch.Tensor]:
    """``histogramdd_bin_edges_cpu`` (``Histogram.cpp``): one edge tensor of
    ``bins[d] + 1`` elements per dimension ``d`` of the innermost size."""
    return _edges(call.args[0], call.arg(1, "bins"))


def _histogramdd_from_bin_cts(call: OpCall) -> torch.Tensor:
    """``_histogramdd`` with bin counts: ``hist`` of shape ``bins``."""
    self, bins = call.args[0], call.arg(1, "bins")
    return torch.empty(tuple(int(n) for n in bins), dtype=self.dtype, device=self.device)


def _histogramdd_from_bin_tensors(call: OpCall) -> torch.Tensor:
    """``_histogramdd`` with bin edges: one fewer bin than edges per dimension."""
    self, bins = call.args[0], call.arg(1, "bins")
    return torch.empty(tuple(b.numel() - 1 for b in bins), dtype=self.dtype, device=self.device)


_META: dict[Any, Any] = {
    aten.fractional_max_pool3d_backward.default: _grad_input_like_self,
    aten.multi_margin_loss_backward.default: _grad_input_like_self,
    aten.multilabel_margin_loss_backward.default: _grad_input_like_self,
    aten.histogram.bin_ct: _histogram_bin_ct,
    aten.histogram.bins_tensor: _histogram_bins_tensor,
    aten._histogramdd_bin_edges.default: _histogramdd_bin_edges,
    aten._histogramdd_from_bin_cts.default: _histogramdd_from_bin_cts,
    aten._histogramdd_from_bin_tensors.default: _histogramdd_from_bin_tensors,
}


def register_meta_kernels(rules: RuleSet) -> None:
    """Register the implementations above on ``rules``."""
    for op, implementation in _META.items():
        rules.implementation(op)(implementation)
