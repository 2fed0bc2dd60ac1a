"""A compiled program's runs in the warm-up step: the first in full, the others by their outputs.

The warm-up step (trace.py) runs the step once so that dynamo and our backend build
every program the traced step runs; its figures are dropped. A program built there
runs there as often as the step calls it: a model's 32 decoder layers compiled one by
one run one program 32 times forward and 32 times backward, each run a few hundred
allocations and kernels on fake tensors, for nothing but the program's outputs. So in
the warm-up an output module's ``call`` runs in full once, which tells the layouts of
its outputs, and each later run makes fresh outputs of those layouts without running
(:func:`first_run_in_full`); dynamo's guards and AOTAutograd's wrappers still run
around it, so that a block whose guards fail is compiled there as it would be, and the
backward is still built at its first run.

Only a run on inputs of the layouts (and other values) of an earlier run is skipped,
and only where that run's outputs were all fresh tensors (none is an input or a view of
one, none a number). Outside the warm-up (:func:`warming_up`), on this thread, every
run is in full.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["first_run_in_full", "warming_up"]

_STATE = threading.local()


@contextmanager
def warming_up() -> Iterator[None]:
    """While the warm-up step runs, on this thread."""
    before = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = before


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # type: ignore[no-any-return]


def _key(args: list[Any]) -> tuple[Any, ...] | None:
    """The layouts of a run's inputs, and its other inputs by value (None: one that is
    neither a tensor nor a plain number)."""
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.layout))
        elif type(a) in (int, float, bool) or a is None:
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def first_run_in_full(call: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """An output module's ``call`` (which takes its inputs as a list, and empties it):
    in the warm-up, after its first run there on inputs of given layouts, its outputs
    for inputs of those layouts are made anew without running."""
    # (by the inputs' layouts: per output, (size, stride, dtype, device); None: an output
    # is not a fresh tensor, so it runs)
    outputs: dict[tuple[Any, ...], list[tuple[Any, ...]] | None] = {}

    def run(args: list[Any]) -> Any:
        key = _key(args) if getattr(_STATE, "on", False) else None
        if key is not None and outputs.get(key) is not None:
            args.clear()
            return tuple(
                torch.empty_strided(size, stride, dtype=dtype, device=device)
                for size, stride, dtype, device in outputs[key]  # type: ignore[union-attr]
            )
        # (the inputs' storages, to tell an output on one of them: in the warm-up only)
        given = {_storage(a) for a in args if isinstance(a, torch.Tensor)} if key is not None else None
        out = call(args)
        if key is not None and key not in outputs:
            assert given is not None
            if (
                isinstance(out, (tuple, list))
                and all(isinstance(t, torch.Tensor) and t.layout is torch.strided for t in out)
                and not any(_storage(t) in given for t in out)
                and len({_storage(t) for t in out}) == len(out)
            ):
                outputs[key] = [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in out]
            else:
                outputs[key] = None
        return out

    return run
