"""Trace once, replay the rest: a training loop's optimizer step, recorded once and
replayed in the later iterations.

The first iteration's step makes the optimizer's state; from the second on, each step
updates that state and the parameters in place, over gradients of the same layouts:
the same ops on the same shapes, whose scratch (a foreach op's outputs, a step count's
increment) is made and freed again each time. So the second iteration's step is traced,
its events recorded, and each later one is those events again on new storages, while
``optimizer.step()`` is not called (the optimizer is the trace's own, made by the
``optimizer=`` factory on the stand-ins, and dropped with the step).

For the optimizers of :data:`FIRST_STEP_REPEATS` the first step is recorded instead: it
is a later step with the state made first (their state starts as zeros, or is made by
the constructor, and no branch of their update depends on whether it is new), so the
second iteration's step is the first's events but for the allocations of the state it
made, and the loop traces one step, not two.

Proved, not assumed; a step that may differ is traced and says why:

* what the recorded step made must be freed by its end (state it adds each step would
  grow: a later step would make it again), and it must free or resize nothing alive
  before it;
* the optimizer's state (its attributes, its groups' options, each parameter's state
  by value or by tensor identity and layout), the gradients' layouts and torch's
  switches are as they were when the recorded step began;
* no step hooks (the optimizer's own, or torch's global ones);
* no op read tensor values, unless the optimizer is one of :data:`STEP_COUNTS_ONLY`:
  torch's optimizers whose steps read only their step counts (``_get_value(step)``)
  and use them as numbers, never to choose what to run (checked in the sources of
  every torch release the engine supports). A step that reads values to choose
  (RAdam's rectification from its sixth step, ASGD's averaging, Adafactor's norms)
  is traced each time.

``TORCHMEM_REPLAY=0`` turns this replay off too (replay.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.replay_events import Kept, Said, made_and_touched, replay_events
from pytest_torchmem.engine.tracing.replay_state import switches, tensor_state, value_state

__all__ = ["STEP_COUNTS_ONLY", "OptimizerReplay"]

#: torch's optimizers whose steps read tensor values only to use them as numbers (step
#: counts, NAdam's momentum product): whatever the values, the same ops run. Exact
#: classes (a subclass may read more).
STEP_COUNTS_ONLY: Final = frozenset(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RMSprop", "Adadelta")
)

#: torch's optimizers whose first step is a later step with its state made first (zeros,
#: ones, or made by the constructor: Adagrad's), every branch of their update the same
#: whether the state is new or not (read in the sources of every torch release the engine
#: supports). Not SGD: its first step with momentum copies the gradient into the new
#: buffer, where a later step scales and adds. Exact classes.
FIRST_STEP_REPEATS: Final = frozenset(
    getattr(torch.optim, name) for name in ("Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RMSprop", "Adadelta")
)

#: Where torch keeps the hooks every optimizer's step runs (entries of engine/torch_compat/torch_private.py).
_GLOBAL_HOOKS: Final = "torch.optim.optimizer."

_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")

#: The iteration whose step is recorded: the loop's steady state (the first makes the state),
#: or the first (:data:`FIRST_STEP_REPEATS`).
RECORDED: Final = 2


@dataclass
class _Record:
    start: int  # its first event
    first_sid: int  # the first storage it made
    state: Any  # the optimizer's state, its gradients' layouts and torch's switches as it began
    value_reads: int  # the tracker's count of value-dependent ops as it began
    iteration: int = RECORDED  # the iteration it was recorded in
    end: int = -1
    refused: str | None = None
    #: Storages it made that stay to the end of the step (a library's cached workspace).
    kept: Kept = field(default_factory=Kept)
    #: The state it made (the first step's): left out of its replays.
    made_state: frozenset[int] = frozenset()


class OptimizerReplay:
    """Records the loop's steady-state optimizer step (:data:`RECORDED`), replays it in
    later iterations; ``said(iteration, what)`` is told what it did, or why not."""

    def __init__(self, tracker: Any, said: Said) -> None:
        self.tracker = tracker
        self.said = said
        self._record: _Record | None = None

    def begin(self, iteration: int, optimizer: torch.optim.Optimizer) -> bool:
        """The step of ``iteration`` begins (its phase just set): True where it was
        replayed, else the caller runs ``optimizer.step()`` and then calls :meth:`end`."""
        first = type(optimizer) in FIRST_STEP_REPEATS
        if iteration < RECORDED and not first:
            return False
        tracker = self.tracker
        record = self._record
        if record is None:
            self._record = _Record(
                start=len(tracker.timeline.events),
                first_sid=len(tracker.timeline.storages),
                state=_state(optimizer),
                value_reads=tracker.value_reads,
                iteration=iteration,
            )
            return False
        why = record.refused or self._differs(record, optimizer)
        if why is not None:
            self.said(iteration, f"optimizer step traced ({why})")
            return False
        skipped = record.kept.sids | record.made_state
        replay_events(tracker.timeline, record.start, record.end, record.first_sid, skipped, iteration)
        made = " (without the state it made)" if record.made_state else ""
        self.said(iteration, f"optimizer step replayed from iteration {record.iteration}{made}")
        return True

    def end(self, iteration: int, optimizer: torch.optim.Optimizer) -> None:
        """The step of ``iteration`` ran (traced)."""
        record = self._record
        if record is None or record.end >= 0:
            return
        record.end = len(self.tracker.timeline.events)
        record.refused = self._left(record, optimizer)

    def _left(self, record: _Record, optimizer: torch.optim.Optimizer) -> str | None:
        """Why a later step cannot replay the recorded one, or None (recorded)."""
        tracker = self.tracker
        if tracker.stop is not None:
            return "the trace stopped"
        if tracker.value_reads != record.value_reads and type(optimizer) not in STEP_COUNTS_ONLY:
            return (
                f"{type(optimizer).__name__}'s step read tensor values, which may change what "
                "its next step runs"
            )
        if _hooked(optimizer):
            return "the optimizer has step hooks, which may act differently the next time"
        if not tracker.quiet():
            return "autograd's bookkeeping was still pending"
        made, touched = made_and_touched(tracker.timeline, record.start, record.end, record.first_sid)
        if touched:
            return "it freed or resized a storage that was alive before it"
        ledger = tracker.ledger
        held = {sid for sid in made if ledger.holds(sid)}
        if record.iteration < RECORDED:
            # the first step: what it made and left alive must be the state it made
            state = _state_storages(optimizer, ledger)
            if not held <= state:
                return f"{len(held - state)} storage(s) it made stay alive beside its state"
            record.made_state = frozenset(held)
            record.state = _state(optimizer)  # (a later step starts from the state it made)
            held = set()
        if held:
            return f"{len(held)} storage(s) it made stay alive (state the optimizer adds each step)"
        record.kept = Kept(frozenset(made - record.made_state), since=record.end)
        return None

    def _differs(self, record: _Record, optimizer: torch.optim.Optimizer) -> str | None:
        """Why this iteration's step may differ from the recorded one, or None."""
        if record.end < 0:
            return f"iteration {record.iteration}'s step did not finish"
        tracker = self.tracker
        if record.kept.freed(tracker.timeline.events):
            return f"a buffer iteration {record.iteration}'s step made to keep was freed"
        if _state(optimizer) != record.state:
            return (
                "the optimizer's state, its gradients or torch's switches changed since iteration "
                f"{record.iteration}"
            )
        if _hooked(optimizer):
            return "the optimizer has step hooks, which may act differently the next time"
        if not tracker.quiet():
            return "autograd's bookkeeping was still pending"
        return None


def _state(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """The optimizer's state, its parameters' gradients' layouts and torch's switches, as a
    value: what its next step's ops follow."""
    with _DisableTorchFunction():  # (a device's router would see each tensor query)
        return _state_of(optimizer)


def _state_of(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    attributes = tuple(
        (name, value_state(value))
        for name, value in optimizer.__dict__.items()
        if name not in ("state", "param_groups")
    )
    groups = tuple(
        tuple(
            (key, tuple(tensor_state(p) for p in value) if key == "params" else value_state(value))
            for key, value in group.items()
        )
        for group in optimizer.param_groups
    )
    state = tuple(
        (id(p), tuple((key, value_state(value)) for key, value in per.items()))
        for p, per in optimizer.state.items()
    )
    grads = tuple(_grad_layout(p.grad) for group in optimizer.param_groups for p in group["params"])
    return attributes, groups, state, grads, switches()


def _state_storages(optimizer: torch.optim.Optimizer, ledger: Any) -> set[int]:
    """The storages of the tensors in the optimizer's state."""
    found = set()
    for per in optimizer.state.values():
        for value in per.values():
            if isinstance(value, torch.Tensor):
                sid = ledger.storage_id(value)
                if sid is not None:
                    found.add(sid)
    return found


def _grad_layout(grad: torch.Tensor | None) -> Any:
    if grad is None:
        return None
    return (
        type(grad),
        grad.layout,
        grad.dtype,
        tuple(grad.shape),
        tuple(grad.stride()) if grad.layout is torch.strided else (),
        grad.storage_offset() if grad.layout is torch.strided else 0,
        grad.device,
    )


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer, or every optimizer, has step hooks."""
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or private(f"{_GLOBAL_HOOKS}_global_optimizer_pre_hooks")
        or private(f"{_GLOBAL_HOOKS}_global_optimizer_post_hooks")
    )
