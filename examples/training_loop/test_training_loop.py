"""A training loop as a project writes it, checked as written.

``train_step`` is the project's own step: gradient accumulation over four
micro-batches, gradient clipping, an AdamW step and a learning-rate
schedule. ``torchmem.check`` runs it with the model, the batch, the optimizer
and the scheduler as stand-ins (every one of them left as it was), and
recognises its phases as it runs them: the forward and backward of each
micro-batch, the optimizer step. The loop runs two steps, so the second one's
forward and backward hold AdamW's state, as every step of a real loop after
the first does.

Run it with ``pytest examples/training_loop``; accept a change with
``pytest --torchmem-update examples/training_loop``.
"""

import pytest
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def make_model(width: int = 128, depth: int = 4, classes: int = 10) -> nn.Module:
    return nn.Sequential(*(Block(width) for _ in range(depth)), nn.Linear(width, classes))


def train_step(model, batch, labels, opt, schedule, micro_batches=4):
    """One optimizer step over ``micro_batches`` micro-batches."""
    for x, y in zip(batch.chunk(micro_batches), labels.chunk(micro_batches)):
        loss = nn.functional.cross_entropy(model(x), y) / micro_batches
        loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    schedule.step()
    opt.zero_grad(set_to_none=True)


def train(model, batch, labels, opt, schedule, steps=2):
    for _ in range(steps):
        train_step(model, batch, labels, opt, schedule)


# The budget holds on both devices; on the fake cuda device (an H100) most of it
# is cuBLAS workspace, one for the forward's thread and one for autograd's.
@pytest.mark.memory_budget(peak="96 MiB")
def test_training_loop(torchmem):
    torch.manual_seed(0)
    model = make_model()
    batch, labels = torch.randn(64, 128), torch.randint(0, 10, (64,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    torchmem.check(train, (model, batch, labels, opt, schedule))


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_accumulated_gradients_are_held_through_later_forwards(torchmem, micro_batches):
    torch.manual_seed(0)
    model = make_model()
    batch, labels = torch.randn(64, 128), torch.randint(0, 10, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    torchmem.check(train_step, (model, batch, labels, opt, schedule, micro_batches))
