"""The ATen ops a program dispatches, in order, recorded the same way in a real run and in a trace.

:class:`OpRecorder` is a ``TorchDispatchMode`` the step itself enters (user code, as a
profiler would be): in a real run it sees every op the program dispatches; inside an
estimate it sits above the trace's own modes and sees every op the traced program
dispatches, before the trace does. Each op is recorded as its overload's name and the
shapes and dtypes of its tensor arguments, with the innermost frame of the user's code
that dispatched it. :func:`first_difference` says where two recordings part: the op, its
arguments and the lines of code that chose each.

``Recorded`` is kept in a ``threading.local`` of this module: an estimate puts back
everything the step reaches (its globals, closures and arguments), and the recording
must outlive it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.abspath(__file__)
_PACKAGE = os.path.dirname(os.path.abspath(__import__("pytest_torchmem").__file__))
_RECORDINGS = threading.local()


@dataclass(frozen=True)
class Op:
    """One dispatched op: the overload, its tensor arguments' shapes and dtypes; where from."""

    name: str
    tensors: tuple[tuple[tuple[int, ...], str], ...]
    where: str = ""

    def key(self) -> tuple[str, tuple[tuple[tuple[int, ...], str], ...]]:
        return self.name, self.tensors

    def __str__(self) -> str:
        arguments = ", ".join(f"{dtype.removeprefix('torch.')}{list(shape)}" for shape, dtype in self.tensors)
        return f"{self.name}({arguments}) at {self.where}"


#: Ops that say nothing of the program's branch and that a fake run adds or drops (and
#: the profiler's ``record_function`` ranges, which ``measure`` adds: ``profiler.*``).
IGNORED = frozenset({"prim.device.default", "aten._local_scalar_dense.default", "aten.lift_fresh.default"})


def _where() -> str:
    frame: Any = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith((_TORCH, _PACKAGE)) and name != _HERE and not name.startswith("<"):
            return f"{os.path.relpath(name) if not name.startswith('/usr') else name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class OpRecorder(TorchDispatchMode):
    """Records each op dispatched under it into ``ops``."""

    def __init__(self, ops: list[Op]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name not in IGNORED and not name.startswith("profiler."):
            flat, _ = tree_flatten((args, kwargs or {}))
            tensors = tuple((tuple(t.shape), str(t.dtype)) for t in flat if isinstance(t, torch.Tensor))
            self.ops.append(Op(name, tensors, _where()))
        return func(*args, **(kwargs or {}))


@contextmanager
def recording(label: str) -> Iterator[list[Op]]:
    """Record the ops of the block under ``label`` (:func:`recorded` reads them afterwards)."""
    ops: list[Op] = []
    with OpRecorder(ops):
        yield ops
    _RECORDINGS.__dict__.setdefault("by_label", {})[label] = ops


def recorded(label: str) -> list[Op]:
    """What the last :func:`recording` under ``label`` recorded (on this thread)."""
    return _RECORDINGS.__dict__.get("by_label", {}).pop(label)


def first_difference(real: Sequence[Op], traced: Sequence[Op]) -> str | None:
    """None where both dispatched the same ops in the same order; else where they part."""
    for index, (one, other) in enumerate(zip(real, traced)):
        if one.key() != other.key():
            return (
                f"op {index} of {len(real)} differs:\n  real run: {one}\n  traced:   {other}\n"
                f"  before it: {real[index - 1] if index else '(the first op)'}"
            )
    if len(real) != len(traced):
        shorter, longer, which = (real, traced, "traced") if len(real) < len(traced) else (traced, real, "real run")
        return f"the {which} dispatched {len(longer) - len(shorter)} more ops, from op {len(shorter)}: {longer[len(shorter)]}"
    return None
