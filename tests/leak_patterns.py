"""Steps that leak, and steps that only make what they make once (issue 38).

Each builder returns ``(step, arguments, what holds the growth)``: a step as a
training or evaluation loop calls it, again and again, on the same objects.
:data:`LEAKS` hold more after every iteration, each in a way users write by
mistake; :data:`NOT_LEAKS` make things in their first iterations (an optimizer's
state, a scaler's scale, a lazy module's parameters, a cache that fills) and then
hold the same after each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(16, 32)


# -- leaks ----------------------------------------------------------------------------------


def evaluate_without_no_grad(model: nn.Module, x: torch.Tensor, running: dict[str, Any]) -> None:
    """An evaluation loop's running total of the loss, no ``torch.no_grad()``: each
    iteration's graph, and the activations it saved, stay reachable from the total."""
    loss = model(x).square().mean()
    running["loss"] = running["loss"] + loss


class Caching(nn.Module):
    """A module that keeps its activations in a list (for a visualisation, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.activations: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net[1](self.net[0](x))
        self.activations.append(hidden)
        return self.net[2](hidden)


def train(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _module_keeps_activations() -> tuple[Any, ...]:
    model = Caching()
    return train, (model, batch(), torch.optim.SGD(model.parameters(), lr=0.1)), "activations"


def _forward_hook_stores_outputs() -> tuple[Any, ...]:
    model = mlp()
    outputs: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda module, args, output: outputs.append(output))
    return train, (model, batch(), torch.optim.SGD(model.parameters(), lr=0.1)), "outputs"


class Trainer:
    """A trainer that keeps each step's loss, as a device tensor, for its metrics."""

    def __init__(self) -> None:
        self.model = mlp()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.losses: list[torch.Tensor] = []

    def step(self, x: torch.Tensor) -> None:
        loss = self.model(x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.detach())


def _metrics_as_tensors() -> tuple[Any, ...]:
    trainer = Trainer()
    return trainer.step, (batch(),), "losses"


class KeepsLoss(Trainer):
    def step(self, x: torch.Tensor) -> None:
        loss = self.model(x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss)  # the loss itself: its graph is freed by backward, its value kept


def _losses_with_their_graphs() -> tuple[Any, ...]:
    trainer = KeepsLoss()
    return trainer.step, (batch(),), "losses"


def cache_by_step(model: nn.Module, x: torch.Tensor, cache: dict[int, torch.Tensor], counter: list[int]) -> None:
    """A cache keyed by the step: a new entry every iteration."""
    counter[0] += 1
    with torch.no_grad():
        cache[counter[0]] = model(x)


def _cache_keyed_by_step() -> tuple[Any, ...]:
    return cache_by_step, (mlp(), batch(), {}, [0]), "cache"


def add_a_group(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    """A parameter group added every iteration (a new head each epoch, say)."""
    head = nn.Parameter(torch.randn(8, 8, device=x.device))
    opt.add_param_group({"params": [head]})
    (model(x) @ head).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _parameter_group_per_iteration() -> tuple[Any, ...]:
    model = mlp()
    return add_a_group, (model, batch(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)), "param_groups"


def evaluate_in_closure(model: nn.Module, x: torch.Tensor) -> None:
    scores.append(model(x).softmax(-1))  # a global list: each iteration's scores and graph


scores: list[torch.Tensor] = []


def _global_list() -> tuple[Any, ...]:
    return evaluate_in_closure, (mlp(), batch()), "scores"


class Decoder(nn.Module):
    """A key-value cache kept across calls (``generate`` called again without a new cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.keys: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.keys.append(self.proj(x))
        return torch.cat(self.keys).sum(0)


def decode(model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model(x)


def _cache_across_calls() -> tuple[Any, ...]:
    return decode, (Decoder(), batch()), "keys"


#: name -> a builder of (step, arguments, what holds the growth)
LEAKS: dict[str, Callable[[], tuple[Any, ...]]] = {
    "running total of the loss without no_grad": lambda: (
        evaluate_without_no_grad,
        (mlp(), batch(), {"loss": torch.zeros(())}),
        "loss",
    ),
    "a module appends its activations": _module_keeps_activations,
    "a forward hook stores outputs": _forward_hook_stores_outputs,
    "metrics kept as device tensors": _metrics_as_tensors,
    "losses kept with their values": _losses_with_their_graphs,
    "a cache keyed by the step": _cache_keyed_by_step,
    "a parameter group added every iteration": _parameter_group_per_iteration,
    "outputs appended to a global list": _global_list,
    "a key-value cache kept across calls": _cache_across_calls,
}


#: name -> the storages (bytes each) one iteration of it leaves behind, by hand: the
#: model is Linear(32, 64), GELU, Linear(64, 8) in float32 on a batch of 16.
HIDDEN, OUT = 16 * 64 * 4, 16 * 8 * 4
GROWTH: dict[str, tuple[int, ...]] = {
    # the total's graph: Linear(32, 64)'s output (GELU saved it), GELU's (the second
    # Linear's mm saved it) and the second Linear's (square saved it)
    "running total of the loss without no_grad": (HIDDEN, HIDDEN, OUT),
    "a module appends its activations": (HIDDEN,),  # GELU's output, its graph freed by backward
    "a forward hook stores outputs": (HIDDEN,),
    "metrics kept as device tensors": (4,),  # a float32 scalar
    "losses kept with their values": (4,),
    "a cache keyed by the step": (OUT,),
    "a parameter group added every iteration": (8 * 8 * 4, 8 * 8 * 4),  # the head, its momentum
    # softmax's output (kept, and saved by softmax), and what the graph behind it saved
    "outputs appended to a global list": (HIDDEN, HIDDEN, OUT),
    "a key-value cache kept across calls": (16 * 32 * 4,),
}


# -- not leaks: what the first iterations make once ----------------------------------------------


def adamw() -> tuple[Any, ...]:
    model = mlp()
    return train, (model, batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))


def scaled(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _grad_scaler() -> tuple[Any, ...]:
    model = mlp()
    return scaled, (model, batch(), torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu"))


def _lazy_module() -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(64), nn.GELU(), nn.LazyLinear(8))

    def step(model: nn.Module, x: torch.Tensor) -> None:
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return step, (model, batch())


def kept_gradients(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def _scheduled() -> tuple[Any, ...]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)

    def step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, schedule: Any) -> None:
        train(model, x, opt)
        schedule.step()

    return step, (model, batch(), opt, schedule)


def growing_batches(x: torch.Tensor, lengths: list[int]) -> None:
    """Batches that grow every iteration (sequences of rising length): each needs a block
    larger than any the caching allocator keeps, so on cuda its segments grow while the
    memory allocated after each iteration does not (fragmentation, not a leak)."""
    lengths[0] += 1
    torch.empty(lengths[0] * 2**23, device=x.device).fill_(1.0)  # 32 MiB more each time


def cache_by_shape(model: nn.Module, x: torch.Tensor, masks: dict[tuple[int, ...], torch.Tensor]) -> None:
    """A cache keyed by what repeats (the batch's shape): it fills once."""
    mask = masks.get(tuple(x.shape))
    if mask is None:
        mask = masks[tuple(x.shape)] = torch.ones_like(x)
    model(x * mask).square().mean().backward()
    model.zero_grad(set_to_none=True)


NOT_LEAKS: dict[str, Callable[[], tuple[Any, ...]]] = {
    "AdamW's state": adamw,
    "a GradScaler": _grad_scaler,
    "lazy modules": _lazy_module,
    "zero_grad(set_to_none=False)": lambda: (kept_gradients, adamw()[1]),
    "an LR scheduler": _scheduled,
    "a cache that fills once": lambda: (cache_by_shape, (mlp(), batch(), {})),
}
