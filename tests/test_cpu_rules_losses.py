"""CPU rules for the margin losses (``pytest_torchmem/engine/tracing/devices/cpu/losses.py``);
their backwards have no meta kernel in torch (``devices/meta_kernels.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import Lambda

import pytest_torchmem as tm

F32, I64 = 4, 8


def test_multilabel_margin_loss_bytes_by_hand() -> None:
    """``multilabel_margin_loss(x.t(), target.t())``, x (6, 4) float32, target (6, 4)
    int64, mean, no backward: the loss (4) and ``is_target`` (4 x 6 floats = 96); the
    range checks ``target.min()``/``max()`` (8 B each, with the reduction's 192-byte
    contiguous copy of the transposed target) come and go; then the contiguous input
    (96) and target (192) are held: x + target + 4 + 96 + 96 + 192."""
    x, target = torch.randn(6, 4), torch.tensor([[3, 0, -1, 1]] * 6)
    model = Lambda(lambda x, t: F.multilabel_margin_loss(x.t(), t.t()))
    report = tm.estimate(model, (x, target), train=False)
    assert report.forward_peak == 96 + 192 + 4 + 96 + 96 + 192
    assert report.forward_peak == tm.measure(model, (x, target), train=False).forward_peak


_TARGETS = torch.tensor([[3, 0, -1, 1, 2, 0], [1, 1, 5, -1, 0, 0], [0, -1, 2, 2, 2, 2], [4, 3, 2, 1, 0, -1]])
_CLASSES = torch.tensor([1, 0, 5, 3])

CASES: dict[str, Callable[..., Any]] = {
    "multilabel mean": lambda x: F.multilabel_margin_loss(x, _TARGETS),
    "multilabel none": lambda x: F.multilabel_margin_loss(x, _TARGETS, reduction="none"),
    "multilabel transposed": lambda x: F.multilabel_margin_loss(
        x.t().contiguous().t(), _TARGETS.t().contiguous().t(), reduction="none"
    ),
    "multilabel 1-d": lambda x: F.multilabel_margin_loss(x[0], _TARGETS[0]),
    "multi mean": lambda x: F.multi_margin_loss(x, _CLASSES),
    "multi none p=2 weight": lambda x: F.multi_margin_loss(
        x, _CLASSES, p=2, weight=torch.rand(12)[::2], reduction="none"
    ),
    "multi transposed sum": lambda x: F.multi_margin_loss(x.t().contiguous().t(), _CLASSES, reduction="sum"),
    "multi 1-d": lambda x: F.multi_margin_loss(x[1], _CLASSES[1]),
}


@pytest.mark.parametrize("name", CASES)
def test_margin_loss_step_equals_measure(name: str, threads: int) -> None:
    """The forwards' and backwards' contiguous copies and range checks, in the
    layouts that take them (a transposed input, target and weight, a broadcast
    gradient from ``sum()``)."""
    x = torch.randn(4, 6, requires_grad=True)
    model = Lambda(CASES[name])
    estimated = tm.estimate(model, x)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x).phase_peaks()
