"""A step written by the user: a function and its arguments, run as the engine runs a model.

``tm.estimate(train_step, (model, batch, opt))`` checks the user's own step
rather than the built-in one. :func:`step_function` walks what the function
reaches (:mod:`~pytest_torchmem.engine.user`: its arguments at any depth, the
bound ``self``, partials and callable objects, defaults, closures, the globals
its code reads) and wraps it in a :class:`StepFunction`: an ``nn.Module`` that
holds, as named children, the modules reached (so that the engine names their
figures and finds their compiled regions as it does a model's), and the
:class:`~pytest_torchmem.engine.user.reaching.World` itself, whose tensors the
step's stand-ins take the place of for the call (the user's objects, the same
objects, hold them meanwhile, and are as they were after).
:func:`run_function` calls it, its phases told to the probe by
:class:`~pytest_torchmem.engine.step.phases.PhaseWatch`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pytest_torchmem.engine.step.phases import PhaseWatch
from pytest_torchmem.engine.user.journal import checkpoint
from pytest_torchmem.engine.user.reaching import World, reach

__all__ = ["StepFunction", "run_function", "step_function"]


class StepFunction(nn.Module):
    """A step function, the world it reaches, and the modules of that world by the path
    that reaches each."""

    def __init__(self, function: Callable[..., Any], world: World, names: list[str]) -> None:
        super().__init__()
        self.__dict__["function"] = function  # a bound method of a module is no child
        #: the names the function gives its positional arguments
        self.__dict__["names"] = names
        #: the walk made with the function (the first run takes it, later ones walk again)
        self.__dict__["walked"] = world
        taken: dict[str, nn.Module] = {}
        for path, module in world.modules.items():
            name = _module_name(path, taken)
            taken[name] = module
            self.add_module(name, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # the engine calls run_function
        return self.function(*args, **kwargs)

    def reach(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> World:
        """The world the function reaches now, called on ``args`` and ``kwargs`` (the walk
        made with the function for the first run, walked afresh for each later one: a run
        lends it stand-ins, then lets go of it)."""
        walked, self.__dict__["walked"] = self.__dict__["walked"], None
        return walked if walked is not None else reach(self.function, args, kwargs, self.names)


def step_function(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepFunction:
    """``function`` with the world it reaches (see the module)."""
    _check_callable(function)
    names = _argument_names(function, len(args))
    return StepFunction(function, reach(function, args, kwargs, names), names)


def _check_callable(function: Callable[..., Any]) -> None:
    """A generator or coroutine function runs nothing until it is iterated or awaited."""
    target = inspect.unwrap(getattr(function, "func", function))
    target = getattr(target, "__func__", target)
    call = getattr(type(target), "__call__", None) if not inspect.isroutine(target) else None
    for candidate in (target, call):
        if candidate is None:
            continue
        name = getattr(target, "__qualname__", type(target).__name__)
        if inspect.isgeneratorfunction(candidate) or inspect.isasyncgenfunction(candidate):
            raise TypeError(
                f"the step function {name!r} is a generator function: calling it runs none of its "
                "body (it would run as it is iterated); write the step as a plain function, or "
                f"pass one that consumes it, e.g. tm.estimate(lambda *a: list({name}(*a)), ...)"
            )
        if inspect.iscoroutinefunction(candidate):
            raise TypeError(
                f"the step function {name!r} is a coroutine function (async def): calling it runs "
                "none of its body; pass a plain function, e.g. "
                f"tm.estimate(lambda *a: asyncio.run({name}(*a)), ...)"
            )


def _module_name(path: str, taken: Mapping[str, Any]) -> str:
    base = path.replace(".", "_") or "module"
    name, n = base, 1
    while name in taken or hasattr(StepFunction, name) or name in ("function", "names", "walked"):
        n += 1
        name = f"{base}_{n}"
    return name


def _argument_names(function: Callable[..., Any], count: int) -> list[str]:
    """The names the function gives its first ``count`` positional arguments (``args[i]``
    where it has none)."""
    names = [f"args[{i}]" for i in range(count)]
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return names
    for i, parameter in enumerate(parameters[:count]):
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names[i:] = [f"{parameter.name}[{j}]" for j in range(count - i)]
            break
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names[i] = parameter.name
    return names


def run_function(
    step: StepFunction,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    leaves: Sequence[torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
    probe: Any,
    repeat: int | None = None,
) -> None:
    """Call the step function on the stand-ins, its phases told to ``probe``; what it
    returns is dropped as the call ends. ``repeat``: it is called that many times (a leak
    check), ``probe.iteration_done(i)`` told after each call."""
    with PhaseWatch(probe, list(step.children()), leaves, optimizers).watching():
        for call in range(1, (repeat or 1) + 1):
            returned = step.function(*args, **kwargs)
            if inspect.isgenerator(returned) or inspect.iscoroutine(returned) or inspect.isasyncgen(returned):
                if inspect.iscoroutine(returned):
                    returned.close()
                raise TypeError(
                    f"the step function returned a {type(returned).__name__}: its body had not run "
                    "(a generator or coroutine runs as it is iterated or awaited); pass a function "
                    "that runs the step"
                )
            del returned
            if repeat is not None:
                checkpoint()  # (what the call let go of, the journal lets go of too)
                probe.iteration_done(call)
