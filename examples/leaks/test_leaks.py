"""Leak checks: a training step and an evaluation step, each run again and again as its loop runs it.

``memory_budget(leak=0)``: after the first iterations (which make the optimizer's
state once), each iteration must leave exactly as much held as the one before.
The trainer keeps its losses as numbers (``loss.item()``) and the evaluation runs
under ``torch.no_grad()``: keep the tensors instead, or drop ``no_grad``, and the
test fails naming what grows, where it was made, what holds it and the fix
(``docs/howto/leaks.md``).

    pytest examples/leaks
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(32, 64), torch.randint(0, 10, (32,))


class Trainer:
    """A trainer as many projects write one: its model, optimizer and the losses it logs."""

    def __init__(self) -> None:
        self.model = classifier()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.losses: list[float] = []

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.item())


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, totals: dict[str, float]) -> None:
    with torch.no_grad():
        totals["loss"] += F.cross_entropy(model(x), y).item()


@pytest.mark.memory_budget(leak=0)
def test_the_training_step_does_not_leak(torchmem):
    trainer = Trainer()
    torchmem.check(trainer.train_step, batch())


@pytest.mark.memory_budget(leak=0)
def test_the_evaluation_does_not_leak(torchmem):
    torchmem.check(evaluate, (classifier(), *batch(), {"loss": 0.0}))
