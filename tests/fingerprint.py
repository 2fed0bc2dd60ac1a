"""A fingerprint of everything reachable from the user's objects, to prove a check left them as they were.

:func:`fingerprint` walks what Python references reach from the given roots
(containers, objects' attributes and ``__slots__``, closures, defaults,
partials, bound methods, modules' parameters, buffers and hooks, optimizers'
state and groups, tensors' gradients), independently of the engine's own
walk, and writes each thing down by the path that reached it: a tensor as its
type (exactly ``torch.Tensor`` or ``nn.Parameter``: no fake or other subclass
left), dtype, device, shape, strides, ``requires_grad`` and its bytes; a
container as its type and its keys; an object as its type and attribute names;
a module as its training flag and hooks. Two fingerprints are equal when the
objects hold the same values, in the same structure, of the same types.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from typing import Any

import torch
from torch import nn

__all__ = ["fingerprint"]

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, range)


def fingerprint(*roots: Any) -> list[tuple[str, Any]]:
    """What the roots reach (see the module), as a list of ``(path, description)``."""
    found: list[tuple[str, Any]] = []
    seen: dict[int, str] = {}
    keep: list[Any] = []

    def tensor(path: str, t: torch.Tensor) -> Any:
        if nn.parameter.is_lazy(t):  # a lazy module's, not made yet: no shape, no data
            return (type(t).__name__, t.dtype, str(t.device), t.requires_grad, t.grad is None)
        exact = type(t) in (torch.Tensor, nn.Parameter)
        data = None
        if t.device.type != "meta" and exact and t.layout is torch.strided:
            data = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).tolist() if t.numel() else []
        grad = t.grad if t.is_leaf else None
        return (
            type(t).__name__,
            t.dtype,
            str(t.device),
            tuple(t.shape),
            tuple(t.stride()) if t.layout is torch.strided else None,
            t.requires_grad,
            data,
            None if grad is None else walk(f"{path}.grad", grad),
            len(getattr(t, "_backward_hooks", None) or {}),
            sorted(k for k in vars(t) if not k.startswith("_")),
        )

    def walk(path: str, value: Any, depth: int = 0) -> Any:
        if isinstance(value, _ATOMS) or isinstance(value, (types.ModuleType, type)) or depth > 60:
            return repr(value) if isinstance(value, (float, complex)) else value if isinstance(value, _ATOMS) else getattr(value, "__qualname__", repr(value))
        if id(value) in seen:
            return ("same as", seen[id(value)])
        seen[id(value)] = path
        keep.append(value)
        if isinstance(value, torch.Tensor):
            description: Any = tensor(path, value)
        elif isinstance(value, nn.Module):
            description = (
                type(value).__qualname__,
                value.training,
                {name: walk(f"{path}.{name}", p, depth + 1) for name, p in value._parameters.items()},
                {name: walk(f"{path}.{name}", b, depth + 1) for name, b in value._buffers.items()},
                sorted(value._non_persistent_buffers_set),
                {name: walk(f"{path}.{name}", m, depth + 1) for name, m in value._modules.items()},
                [len(getattr(value, hooks)) for hooks in sorted(vars(value)) if hooks.endswith("hooks")],
                {
                    name: walk(f"{path}.{name}", v, depth + 1)
                    for name, v in sorted(vars(value).items())
                    if not name.startswith("_") and name != "training"
                },
            )
        elif isinstance(value, torch.optim.Optimizer):
            description = (
                type(value).__qualname__,
                walk(f"{path}.param_groups", value.param_groups, depth + 1),
                [(walk(f"{path}.state key", key, depth + 1), walk(f"{path}.state", entries, depth + 1)) for key, entries in value.state.items()],
                sorted(k for k in vars(value)),
            )
        elif isinstance(value, dict):
            description = (type(value).__name__, [(walk(f"{path} key", k, depth + 1), walk(f"{path}[{k!r}]", v, depth + 1)) for k, v in value.items()])
        elif isinstance(value, (list, tuple, collections.deque)):
            description = (type(value).__name__, [walk(f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value)])
        elif isinstance(value, (set, frozenset)):
            description = (type(value).__name__, sorted(repr(walk(f"{path} item", v, depth + 1)) for v in value))
        elif isinstance(value, functools.partial):
            description = ("partial", walk(f"{path}.func", value.func, depth + 1), walk(f"{path}.args", value.args, depth + 1), walk(f"{path}.keywords", value.keywords, depth + 1))
        elif isinstance(value, types.MethodType):
            description = ("method", value.__func__.__qualname__, walk(f"{path}.__self__", value.__self__, depth + 1))
        elif isinstance(value, types.FunctionType):
            cells = []
            for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
                try:
                    cells.append((name, walk(f"{path}.<{name}>", cell.cell_contents, depth + 1)))
                except ValueError:
                    cells.append((name, "<empty>"))
            description = ("function", value.__qualname__, cells, walk(f"{path}.__defaults__", value.__defaults__, depth + 1))
        elif dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
            description = (
                type(value).__qualname__,
                {name: walk(f"{path}.{name}", v, depth + 1) for name, v in sorted(vars(value).items())} if hasattr(value, "__dict__") else None,
            )
        else:
            description = type(value).__qualname__
        found.append((path, description))
        return ("at", path)

    for i, root in enumerate(roots):
        walk(f"root{i}", root)
    return found
