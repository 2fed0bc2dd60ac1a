"""The warm-up step's shortcuts: a compiled program's later runs make its outputs; optimizer steps update nothing.

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
and only where each output of that run was a fresh tensor, one of its inputs itself (a
training graph's forward returns the weights it saves for backward), a number (a
program with dynamic shapes returns the sizes its backward needs, which the inputs'
layouts and numbers decide), or None (its backward's gradient of an input that needs
none); none a view of an input or of another output. The skipped run returns the
inputs, numbers and Nones where that run did. Outside the warm-up (:func:`warming_up`),
on this thread, every run is in full.

An optimizer's step in the warm-up finds no gradient (:func:`warmed_up`): it builds no
program the traced step runs (a compiled optimizer step guards on the warm-up's
tensors, and dynamo compiles it again in the traced step), and its update of every
parameter was most of the warm-up's eager work (AdamW over an 8B model's 291
parameters: about 3,800 ops, four fifths of the warm-up's time in ops outside the
compiled programs). Where the step's program then fails (it read the state that step
makes), the warm-up runs again with its optimizers' steps in full.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

__all__ = ["first_run_in_full", "warmed_up", "warming_up"]

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


def warmed_up(warm_up: Callable[[], None]) -> None:
    """Run ``warm_up`` (the warm-up step) :func:`warming_up`, its optimizers' steps
    finding no gradient (:func:`_steps_without_gradients`); where it raises once such a
    step ran, run it again with them in full (and raise what that run raises)."""
    skipped: list[torch.optim.Optimizer] = []
    try:
        with warming_up(), _steps_without_gradients(skipped):
            warm_up()
    except Exception:
        if not skipped:
            raise
        with warming_up():
            warm_up()


@contextmanager
def _steps_without_gradients(skipped: list[torch.optim.Optimizer]) -> Iterator[None]:
    """In the block, an optimizer step on this thread while :func:`warming_up` finds its
    parameters' gradients None, so it updates nothing and makes no state; they are
    back once it returns (where the step made one, by a closure's backward, that one
    stays). Each optimizer stepped so is added to ``skipped``."""
    hidden: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def stepping(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not getattr(_STATE, "on", False):
            return
        grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for p, _ in grads:
            p.grad = None
        hidden[id(optimizer)] = grads
        skipped.append(optimizer)

    def stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p, grad in hidden.pop(id(optimizer), ()):
            if p.grad is None:
                p.grad = grad

    # (dynamo traces global hooks into a compiled optimizer step: these run as they are)
    handles = [
        register_optimizer_step_pre_hook(torch.compiler.disable(stepping)),
        register_optimizer_step_post_hook(torch.compiler.disable(stepped)),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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


#: How a run's outputs are made again, per output: ``("fresh", size, stride, dtype,
#: device)`` a fresh tensor of that layout, ``("input", i)`` the ``i``-th input itself,
#: ``("value", v)`` the number ``v`` (a dynamic program's sizes, kept for its backward),
#: or None for None.
_Made = list[tuple[Any, ...] | None]


def _how_made(out: Any, inputs: list[Any]) -> _Made | None:
    """How a run's outputs ``out`` are made again from its ``inputs`` (None: they cannot
    be: a view of an input or of another output, a sparse tensor, another object)."""
    if not isinstance(out, (tuple, list)):
        return None
    given = {_storage(a): i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)}
    made: _Made = []
    fresh: set[int] = set()
    for t in out:
        if t is None:
            made.append(None)
            continue
        if type(t) in (int, float, bool):
            made.append(("value", t))  # (a function of the inputs' layouts and numbers: the key)
            continue
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
            return None
        storage = _storage(t)
        if storage in given:
            if inputs[given[storage]] is not t:
                return None  # (a view of an input)
            made.append(("input", given[storage]))
            continue
        if storage in fresh:
            return None  # (two outputs on one storage)
        fresh.add(storage)
        made.append(("fresh", tuple(t.shape), tuple(t.stride()), t.dtype, t.device))
    return made


def _made_again(how: tuple[Any, ...] | None, inputs: list[Any]) -> Any:
    if how is None:
        return None
    if how[0] == "fresh":
        _, size, stride, dtype, device = how
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    return inputs[how[1]] if how[0] == "input" else how[1]


def first_run_in_full(call: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """An output module's ``call`` (which takes its inputs as a list, and empties it):
    in the warm-up, after its first run there on inputs of given layouts, its outputs
    for inputs of those layouts are made anew without running (see the module's
    docstring)."""
    # (by the inputs' layouts; None: the outputs cannot be made without running)
    outputs: dict[tuple[Any, ...], _Made | None] = {}

    def run(args: list[Any]) -> Any:
        key = _key(args) if getattr(_STATE, "on", False) else None
        if key is None:
            return call(args)
        made = outputs.get(key)
        inputs = list(args)
        if made is not None:
            args.clear()
            return tuple(_made_again(how, inputs) for how in made)
        out = call(args)
        if key not in outputs:
            outputs[key] = _how_made(out, inputs)
        return out

    return run
