"""Training code as users write it (issue 36): each family a step handed to the plugin as written.

A script that moves its model to the device it finds, a trainer object whose
method uses ``self.model`` and ``self.opt``, a ``functools.partial``, a callable
object, a dataclass of the run's objects, defaults, a helper that reads the
module's globals, an EMA made with ``copy.deepcopy``, a step that changes the
model (a buffer registered, a submodule added), one that casts and reloads it.
:data:`FAMILIES` builds each: ``(function, arguments, the objects it reaches)``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 8))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


# -- a script: the device it finds, the model moved there, a DataLoader ------------------


def script(model: nn.Module, loader: DataLoader, opt: torch.optim.Optimizer) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    model.train()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _script() -> tuple[Any, ...]:
    model = mlp()
    data = TensorDataset(torch.randn(48, 32), torch.randn(48, 8))
    loader = DataLoader(data, batch_size=16, shuffle=False)
    return script, (model, loader, adamw(model)), (model, loader)


# -- a trainer object ------------------------------------------------------------------------


class Trainer:
    def __init__(self) -> None:
        self.model = mlp()
        self.opt = adamw(self.model)
        self.losses: list[float] = []
        self.steps = 0

    def train_step(self, x: torch.Tensor) -> None:
        loss = self.model(x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.detach())  # a device tensor kept, as trainers do
        self.steps += 1


def _trainer() -> tuple[Any, ...]:
    trainer = Trainer()
    return trainer.train_step, (torch.randn(16, 32),), (trainer,)


# -- a partial, a callable object, a dataclass ------------------------------------------------


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _partial() -> tuple[Any, ...]:
    model = mlp()
    bound = functools.partial(step, model, adamw(model))
    return bound, (torch.randn(16, 32),), (bound,)


class Stepper:
    def __init__(self) -> None:
        self.model = mlp()
        self.opt = adamw(self.model)

    def __call__(self, x: torch.Tensor) -> None:
        step(self.model, self.opt, x)


def _callable() -> tuple[Any, ...]:
    stepper = Stepper()
    return stepper, (torch.randn(16, 32),), (stepper,)


@dataclasses.dataclass
class Run:
    model: nn.Module
    opt: torch.optim.Optimizer
    history: list[torch.Tensor] = dataclasses.field(default_factory=list)


def run_step(run: Run, x: torch.Tensor) -> None:
    loss = run.model(x).square().mean()
    loss.backward()
    run.opt.step()
    run.opt.zero_grad()
    run.history.append(loss.detach())


def _dataclass() -> tuple[Any, ...]:
    model = mlp()
    run = Run(model, adamw(model))
    return run_step, (run, torch.randn(16, 32)), (run,)


# -- defaults, globals -------------------------------------------------------------------------

MODEL = mlp()
OPT = adamw(MODEL)


def with_defaults(x: torch.Tensor, model: nn.Module = MODEL, opt: torch.optim.Optimizer = OPT) -> None:
    step(model, opt, x)


def _defaults() -> tuple[Any, ...]:
    return with_defaults, (torch.randn(16, 32),), (with_defaults, MODEL, OPT)


def _loss_of_the_global_model(x: torch.Tensor) -> torch.Tensor:
    return MODEL(x).square().mean()


def with_a_helper(x: torch.Tensor) -> None:
    for _ in range(2):
        _loss_of_the_global_model(x).backward()
        OPT.step()
        OPT.zero_grad()


def _globals() -> tuple[Any, ...]:
    return with_a_helper, (torch.randn(16, 32),), (MODEL, OPT)


# -- what the step does to the model --------------------------------------------------------


def changes_the_model(model: nn.Module, x: torch.Tensor) -> None:
    model.register_buffer("cache", torch.zeros(16, 8, device=x.device))
    model.extra = nn.Linear(8, 8).to(x.device)
    model.train(False)
    out = model.extra(model(x) + model.cache)
    out.sum().backward()
    model.zero_grad(set_to_none=False)


def _changed() -> tuple[Any, ...]:
    model = mlp()
    return changes_the_model, (model, torch.randn(16, 32)), (model,)


def with_an_ema(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    ema = copy.deepcopy(model).requires_grad_(False)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for kept, now in zip(ema.parameters(), model.parameters()):
                kept.lerp_(now, 0.01)
    ema(x)


def _ema() -> tuple[Any, ...]:
    model = mlp()
    opt = adamw(model)
    return with_an_ema, (model, torch.randn(16, 32), opt), (model, opt)


def casts_and_reloads(model: nn.Module, x: torch.Tensor) -> None:
    state = copy.deepcopy(model.state_dict())
    model.half().float()
    model.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None)
    model.load_state_dict(state)
    model.requires_grad_(False)
    model[2].requires_grad_(True)
    averaged = torch.optim.swa_utils.AveragedModel(model)
    model(x).square().mean().backward()
    averaged.update_parameters(model)


def _casts() -> tuple[Any, ...]:
    model = mlp()
    return casts_and_reloads, (model, torch.randn(16, 32)), (model,)


def parametrized(model: nn.Module, x: torch.Tensor) -> None:
    """Weight norm and an orthogonal map registered in the step, then a step through them."""
    torch.nn.utils.parametrizations.weight_norm(model[0])
    torch.nn.utils.parametrize.register_parametrization(model[2], "weight", _Symmetric())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()
    opt.step()


class _Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


def _parametrized() -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
    return parametrized, (model, torch.randn(16, 32)), (model,)


def an_optimizer_that_has_stepped(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    step(model, opt, x)


def _stepped() -> tuple[Any, ...]:
    model = mlp()
    opt = adamw(model)
    x = torch.randn(16, 32)
    step(model, opt, x)  # Adam's state exists, its step count a tensor (3.0 after this)
    step(model, opt, x)
    return an_optimizer_that_has_stepped, (model, x, opt), (model, opt)


#: name -> a builder of (function, arguments, the objects it reaches)
FAMILIES: dict[str, Callable[[], tuple[Any, ...]]] = {
    "script with model.to(device) and a DataLoader": _script,
    "trainer object (self.model, self.opt)": _trainer,
    "functools.partial": _partial,
    "callable object": _callable,
    "dataclass of the run": _dataclass,
    "default argument values": _defaults,
    "helper reading the module's globals": _globals,
    "step that registers a buffer and adds a submodule": _changed,
    "EMA made with copy.deepcopy": _ema,
    "casts, init, load_state_dict, requires_grad_, AveragedModel": _casts,
    "optimizer that has already stepped": _stepped,
    "parametrizations registered in the step": _parametrized,
}
