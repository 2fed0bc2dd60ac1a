"""Twins: the built-in step's own copies of optimizers a parameter hook steps, acting on stand-ins.

A parameter hook may look an optimizer up in a dict keyed by the parameter (an
optimizer step fused into backward); the built-in step gives the hook the
parameter's stand-in. Stepped as it is, the user's optimizer would change the
user's parameters: the hook gets a *twin*, an object of its class, with its
hyperparameters, holding the stand-ins of its tensors (parameters, state), so
that the step acts on the twin and the user's optimizer is left as it was. (A
step function's optimizers are the user's own, lent stand-ins for the call:
:mod:`~pytest_torchmem.engine.user`.)
"""

from __future__ import annotations

import types
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TwinError", "twin"]

Convert = Callable[[torch.Tensor], torch.Tensor]



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
