"""Twins: the step's own copies of the user's stateful objects, acting on stand-ins.

A step function is given optimizers, LR schedulers and grad scalers; a parameter
hook may look one up in a dict. Stepped as they are, they would change the
user's parameters, learning rates and scale. Each gets a *twin*: an object of
its class, with its hyperparameters, holding the stand-ins of its tensors
(parameters, state) and its own records, so that the step acts on the twin and
the user's object is left as it was. :class:`Twins` makes them for one step,
each once.
"""

from __future__ import annotations

import copy
import types
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Final

import torch

__all__ = ["TwinError", "Twins", "twin"]

Convert = Callable[[torch.Tensor], torch.Tensor]

_SCHEDULERS: Final = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


class Twins:
    """The twins of one step's objects (:meth:`__call__` maps a value to its twin, or
    returns it: the ``others`` of :func:`~pytest_torchmem.engine.containers.map_tensors`).

    ``convert`` gives a tensor of the user's objects its stand-in, ``convert_input`` one
    that joins the inputs (a scaler's scale); parameters of an optimizer that no module
    holds are added to ``parameters``."""

    def __init__(self, convert: Convert, convert_input: Convert, parameters: list[torch.Tensor]) -> None:
        self.convert = convert
        self.convert_input = convert_input
        self.parameters = parameters
        self.made: dict[int, Any] = {}

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, (torch.optim.Optimizer, torch.amp.GradScaler, *_SCHEDULERS)):
            return value
        made = self.made.get(id(value))
        if made is not None:
            return made
        if isinstance(value, torch.optim.Optimizer):
            made = twin(value, self.convert)
            known = {id(p) for p in self.parameters}
            self.parameters.extend(p for group in made.param_groups for p in group["params"] if id(p) not in known)
        elif isinstance(value, torch.amp.GradScaler):
            made = _scaler_twin(value, self.convert_input)
        else:
            made = _scheduler_twin(value, self)
        self.made[id(value)] = made
        return made

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [made for made in self.made.values() if isinstance(made, torch.optim.Optimizer)]


def twin(value: Any, convert: Convert) -> Any:
    """``value`` as the step's stand-ins see it: a tensor's stand-in, an optimizer's twin
    (stepping the stand-ins, with the state's stand-ins), or ``value`` itself."""
    if isinstance(value, torch.Tensor):
        return convert(value)
    if not isinstance(value, torch.optim.Optimizer):
        return value
    made = type(value).__new__(type(value))
    made.__dict__.update(value.__dict__)
    _rebind(made, value)
    made.param_groups = [
        {**group, "params": [convert(p) for p in group["params"]]} for group in value.param_groups
    ]
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for parameter, entries in value.state.items():
        state[convert(parameter)] = {
            key: convert(entry) if isinstance(entry, torch.Tensor) else entry
            for key, entry in entries.items()
        }
    made.state = state
    return made


def _rebind(made: Any, original: Any) -> None:
    """The methods ``original`` holds as instance attributes, acting on ``made`` instead:
    a bound method of ``original`` is bound to ``made``; a function whose closure holds
    ``original`` (or a weak reference to it: an LR scheduler counts ``step`` calls so) is
    made again with ``made`` there. Any other wrapper of a bound method of ``original``
    (``opt.step = torch.compile(opt.step)``) would act on the user's object:
    :class:`TwinError`."""
    for name, attr in list(vars(original).items()):
        if not callable(attr) or not hasattr(type(original), name):
            continue
        if getattr(attr, "__self__", None) is original:
            setattr(made, name, attr.__func__.__get__(made))
            continue
        rebuilt = _closing_over(attr, original, made)
        if rebuilt is not None:
            setattr(made, name, rebuilt)
            continue
        own = getattr(type(original), name, None)
        inner = attr  # unwrapped down to the class's method or a bound method
        while inner is not own and getattr(inner, "__self__", None) is None and hasattr(inner, "__wrapped__"):
            inner = inner.__wrapped__
        if getattr(inner, "__self__", None) is original:
            raise TwinError(
                f"{type(original).__name__}.{name} is replaced by a wrapper of the user's own "
                f"bound method ({getattr(attr, '__qualname__', type(attr).__name__)}), which would "
                "run on the real object, not on the stand-ins; pass an object whose "
                f"{name} is the class's (a compiled optimizer step in a step function is not "
                "followed yet: compile the model, or check the built-in step with optimizer=)"
            )


def _closing_over(function: Any, original: Any, made: Any) -> Any:
    """``function`` made again with ``made`` in place of ``original`` (or of a weak
    reference to it) in its closure; None where its closure holds neither."""
    closure = getattr(function, "__closure__", None)
    if not isinstance(function, types.FunctionType) or not closure:
        return None
    cells = []
    for cell in closure:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        if value is original:
            cells.append(types.CellType(made))
        elif isinstance(value, weakref.ref) and value() is original:
            cells.append(types.CellType(weakref.ref(made)))
        else:
            cells.append(cell)
    if all(new is old for new, old in zip(cells, closure)):
        return None
    made = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__, tuple(cells))
    made.__kwdefaults__ = function.__kwdefaults__
    made.__qualname__ = function.__qualname__
    made.__dict__.update(function.__dict__)
    return made


class TwinError(TypeError):
    """An object of the step cannot be given stand-ins (see :func:`_rebind`)."""


def _scheduler_twin(scheduler: Any, twin_of: Callable[[Any], Any]) -> Any:
    """A copy of a step function's LR scheduler that schedules the twin of its optimizer
    (and the twins of the schedulers it chains): the user's keeps its own state."""
    made = type(scheduler).__new__(type(scheduler))
    made.__dict__.update(vars(scheduler))
    _rebind(made, scheduler)
    for name, value in vars(scheduler).items():
        if isinstance(value, torch.optim.Optimizer):
            setattr(made, name, twin_of(value))
        elif isinstance(value, list) and any(isinstance(v, _SCHEDULERS) for v in value):
            setattr(made, name, [twin_of(v) for v in value])
        elif isinstance(value, (list, dict)):  # its records (base learning rates, ...)
            setattr(made, name, copy.copy(value))
    return made


def _scaler_twin(scaler: torch.amp.GradScaler, convert: Convert) -> torch.amp.GradScaler:
    """A copy of a step function's ``GradScaler`` (its scale and growth tracker as stand-ins,
    its per-optimizer records its own): the function's ``scale``, ``step`` and ``update``
    leave the user's as it was."""
    made = type(scaler).__new__(type(scaler))  # copy.copy would read the scale (__getstate__)
    made.__dict__.update(vars(scaler))
    for name, value in vars(scaler).items():
        if isinstance(value, torch.Tensor):
            setattr(made, name, convert(value))
        elif isinstance(value, dict):  # what step() records per optimizer, until update()
            setattr(made, name, copy.copy(value))
    return made
