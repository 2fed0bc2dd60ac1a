"""A step written by the user: a function and its arguments, run as the engine runs a model.

``tm.estimate(train_step, (model, batch, opt))`` checks the user's own step
rather than the built-in one. :func:`step_function` wraps the function in a
:class:`StepFunction`: an ``nn.Module`` that holds, as named children, the
modules the function is given (among its arguments, nested in lists, tuples
and dicts, as ``self`` of a bound method, or read from its closure and the
globals it names), so that the engine finds their tensors and swaps them for
stand-ins as it does a model's, and puts them back after. The tensors among
the arguments become stand-ins as inputs do, and each optimizer, LR scheduler
and grad scaler among them a twin that acts on the stand-ins
(:mod:`~pytest_torchmem.engine.twins`): what the function is given is left as
it was.
:func:`run_function` calls it, its phases told to the probe by
:class:`~pytest_torchmem.engine.phases.PhaseWatch`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pytest_torchmem.engine.phases import PhaseWatch

__all__ = ["StepFunction", "run_function", "step_function"]


class StepFunction(nn.Module):
    """A step function and the modules it reaches, by the name it reaches each by."""

    def __init__(self, function: Callable[..., Any], modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.__dict__["function"] = function  # a bound method of a module is no child
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # the engine calls run_function
        return self.function(*args, **kwargs)


def step_function(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepFunction:
    """``function`` with the modules it reaches (see the module); an optimizer it reads
    from its closure or globals is refused, as it could not be twinned."""
    found: dict[str, nn.Module] = {}
    seen: set[int] = set()

    def add(name: str, value: Any, depth: int = 0) -> None:
        if isinstance(value, nn.Module):
            if id(value) not in seen:
                seen.add(id(value))
                found[_module_name(name, found)] = value
        elif depth < 4 and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                add(f"{name}[{i}]", item, depth + 1)
        elif depth < 4 and isinstance(value, dict):
            for key, item in value.items():
                add(f"{name}[{key!r}]", item, depth + 1)

    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        add("self", owner)
    for name, value in _named_arguments(function, args, kwargs):
        add(name, value)
    for name, value in _reached(function):
        if isinstance(value, torch.optim.Optimizer):
            raise TypeError(
                f"the step function {getattr(function, '__qualname__', function)!r} reads the "
                f"optimizer {name!r} from outside its arguments; it would step the real "
                f"parameters: pass it as an argument, e.g. "
                f"tm.estimate(train_step, (model, batch, {name}))"
            )
        add(name, value)
    return StepFunction(function, found)


def _module_name(name: str, taken: Mapping[str, Any]) -> str:
    base = name.replace(".", "_") or "module"
    name, n = base, 1
    while name in taken or hasattr(StepFunction, name) or name == "function":
        n += 1
        name = f"{base}_{n}"
    return name


def _named_arguments(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, Any]]:
    """The arguments by the names the function gives them (``args[i]`` where it has none)."""
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]
    named: list[tuple[str, Any]] = []
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            named += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named += list(value.items())
        else:
            named.append((name, value))
    return named


def _reached(function: Callable[..., Any]) -> list[tuple[str, Any]]:
    """The values ``function`` reads from its closure and by name from its globals."""
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None:
        return []
    reached: list[tuple[str, Any]] = []
    for name, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or ()):
        try:
            reached.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    names = getattr(function, "__globals__", {})
    reached += [(name, names[name]) for name in code.co_names if name in names]
    return reached


def run_function(
    step: StepFunction,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    leaves: Sequence[torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
    probe: Any,
) -> None:
    """Call the step function on the stand-ins, its phases told to ``probe``; what it
    returns is dropped as the call ends."""
    with PhaseWatch(probe, list(step.children()), leaves, optimizers).watching():
        step.function(*args, **kwargs)
