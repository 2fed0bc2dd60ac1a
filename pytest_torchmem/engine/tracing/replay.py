"""Trace once, replay the rest: a training loop's forward and backward, recorded in its
first iteration and replayed in the later ones.

The built-in step with an optimizer runs as a loop (step/built_in.py): the first iteration
makes the optimizer's state, the second is the steady state every later one
repeats. The forward and backward of each iteration are the same Python program
on the same model and batch, so they dispatch the same ops on the same shapes;
what differs is what is alive around them (the optimizer's state), and that the
timeline's analysis and the allocator model see anyway. So the first iteration's
forward and backward are traced, their events recorded (allocations, frees,
resizes, module entries and exits, phases), and each later iteration's are those
events again, on new storages, while the Python program skips them: the tensors
that leave them alive (the gradients, the loss, an output held) are made as fresh
fake tensors of the same layouts on the replayed storages, so that the rest of the
iteration (the optimizer step, ``zero_grad``, the loss dropped) frees them where
the traced program would.

Replay is proved, not assumed; anything that could make a later iteration differ
from the first is traced instead, and says why (:attr:`LoopReplay.said`: one line per
thing said, consecutive iterations gathered):

* what the forward and backward made must be gone when the iteration ends, or held
  by the gradients, the loss and the held output (a cache the model keeps, a
  tensor a hook appends to a list: a later iteration would not make it, or keep
  more);
* nothing alive before them may be freed or resized by them (a buffer the model
  replaces);
* no op may have read a tensor's values (``.item()``, ``nonzero``, a boolean mask)
  that the next iteration may not give alike: values made only of the step's inputs
  and of what factories make of numbers are the same each time (transformers' masks
  read the positions ``arange`` made), unless the step writes such a tensor in place
  that was there when its first iteration began (its input; a tensor it keeps); those of
  parameters, buffers, gradients, optimizer state and random draws are not
  (:meth:`KnownValues.settled`);
* the model's own state (every module's attributes, parameters, buffers and
  hooks) and torch's global switches (grad mode, autocast, SDPA backends, ...) are
  the same at the start of each iteration's forward as at the first's;
* the model carries no user hooks (module or parameter hooks may count calls);
* the plain globals and global containers of the modules that define the model's
  classes (a counter the forward steps, a flag) hold the values they had
  (:func:`replay_watch.module_globals`).

A library's cached workspace that the first iteration made (cuBLAS's) is not made
again: it is left out of the replayed events, as the cache leaves it out of the
program's.

The optimizer step is replayed too, from the loop's third iteration on, recorded in
its second (optimizer_replay.py).

``TORCHMEM_REPLAY=0`` turns replay off: every iteration is traced (for a check
that doubts it, and for a bug report).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.user.containers import tensors_in
from pytest_torchmem.engine.figures.timeline import Phase
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.optimizer_replay import OptimizerReplay
from pytest_torchmem.engine.tracing.replay_events import (
    Kept,
    Layout,
    Said,
    layout_of,
    made_and_touched,
    replay_events,
    standin,
)
from pytest_torchmem.engine.tracing.replay_state import global_hooks, hooked_modules, model_state, switches
from pytest_torchmem.engine.tracing.replay_watch import module_globals, unchanged

__all__ = ["LoopReplay", "replay_enabled"]

FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")

#: The environment variable that turns replay off (``0``).
ENV: Final = "TORCHMEM_REPLAY"
_STRIDED: Final = torch.strided


def replay_enabled() -> bool:
    """Whether replay is on (``TORCHMEM_REPLAY`` is not ``0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class _Record:
    """The first iteration's forward and backward: where its events are, and what it left."""

    start: int  # its first event
    first_sid: int  # the first storage it made
    state: Any  # the model's state and torch's switches as it began
    #: The tracker's counts, as it began, of the value reads that another iteration may
    #: not give alike and of every value read, and where its known values were
    #: (:meth:`KnownValues.mark`).
    unsettled_reads: int
    value_reads: int
    values_mark: tuple[int, int]
    end: int = -1
    refused: str | None = None
    #: Whether its forward and backward read tensor values.
    read_values: bool = False
    #: The modules running when it ended (innermost last).
    modules: tuple[int, ...] = ()
    grads: list[tuple[int, Layout]] = field(default_factory=list)
    loss: Layout | None = None
    held: list[Layout] = field(default_factory=list)
    #: Storages it made that the iteration's end had to free (those held by tensors).
    held_sids: frozenset[int] = frozenset()
    #: Storages it made that stay to the end of the step (a library's cached workspace).
    kept: Kept = field(default_factory=Kept)
    #: The globals of the modules that define the model's classes, as it began.
    globals: tuple[Any, ...] = ()


class LoopReplay:
    """Records the first iteration's forward and backward, replays them in later ones.

    ``tracker`` is the trace's :class:`~pytest_torchmem.engine.tracing.tracker.Tracker`,
    ``model`` the step's model (its state is compared), ``leaves`` the tensors whose
    ``.grad`` the step reads (the optimizer's parameters, the inputs); ``lines`` gets
    what was replayed, or why not, one line each (the report's ``replayed``: the replay
    itself, which holds the step's model, dies with the step).
    """

    def __init__(self, tracker: Any, model: nn.Module, leaves: Sequence[torch.Tensor], lines: list[str]) -> None:
        self.tracker = tracker
        self.model = model
        self.leaves = list(leaves)
        self.said = Said(lines)
        #: The optimizer step's replay (optimizer_replay.py), which says what it did here too.
        self.step = OptimizerReplay(tracker, self.said)
        self._record: _Record | None = None
        #: The storages the last replay left to the program (its stand-ins'): each must be
        #: gone when the next iteration begins, as the first iteration's were.
        self._replayed_held: tuple[int, ...] = ()

    # -- the step's calls -------------------------------------------------------------

    def begin(self, iteration: int) -> tuple[Any, Any] | None:
        """The forward and backward of ``iteration`` begin (its forward phase just set):
        ``(loss, held output)`` where they were replayed (the leaves' gradients set),
        else None (the step runs them, then calls :meth:`end`)."""
        tracker = self.tracker
        if iteration == 1 or self._record is None:
            self._record = _Record(
                start=len(tracker.timeline.events),
                first_sid=len(tracker.timeline.storages),
                state=self._state(),
                unsettled_reads=tracker.unsettled_reads,
                value_reads=tracker.value_reads,
                values_mark=tracker.values.mark(),
                globals=module_globals(self.model),
            )
            return None
        record = self._record
        why = record.refused or self._differs(record)
        if why is not None:
            self.said(iteration, f"forward and backward traced ({why})")
            return None
        replayed = self._replay(record, iteration)
        self.said(iteration, "forward and backward replayed from iteration 1")
        return replayed

    def end(self, iteration: int, loss: Any, held: Any) -> None:
        """The forward and backward of ``iteration`` ran (traced): ``loss`` and ``held``
        are what the step keeps of them."""
        record = self._record
        if iteration != 1 or record is None or record.end >= 0:
            return
        record.end = len(self.tracker.timeline.events)
        record.read_values = self.tracker.value_reads != record.value_reads
        record.refused = self._left(record, loss, held)

    def begin_step(self, iteration: int, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step of ``iteration`` begins (its phase just set): True where it
        was replayed, else the step runs it, then calls :meth:`end_step`."""
        return self.step.begin(iteration, optimizer)

    def end_step(self, iteration: int, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step of ``iteration`` ran (traced)."""
        self.step.end(iteration, optimizer)

    # -- the proof --------------------------------------------------------------------

    def _state(self) -> tuple[Any, ...]:
        """The model's state and torch's switches, as a value to compare."""
        with _DisableTorchFunction():  # (a device's router would see each tensor query)
            return (model_state(self.model), switches(), tuple(t.grad is None for t in self.leaves))

    def _left(self, record: _Record, loss: Any, held: Any) -> str | None:
        """What the first iteration's forward and backward left (recorded), or why a
        later iteration cannot replay them."""
        tracker = self.tracker
        if tracker.stop is not None:
            return "the trace stopped"
        if tracker.unsettled_reads != record.unsettled_reads:
            return "an op read tensor values, which may differ the next time"
        if _hooked(self.model, self.leaves):
            return "the model has hooks, which may act differently the next time"
        if not tracker.quiet():
            return "autograd's bookkeeping was still pending"
        made, touched = made_and_touched(tracker.timeline, record.start, record.end, record.first_sid)
        if touched:
            return "it freed or resized a storage that was alive before it (the model's own state)"
        ledger = tracker.ledger
        live = {sid for sid in made if ledger.holds(sid)}
        record.kept = Kept(frozenset(sid for sid in made if not ledger.holds(sid)), since=record.end)
        layouts: dict[int, Layout] = {}
        try:
            for index, t in enumerate(self.leaves):
                if t.grad is not None:
                    if record.state[2][index] is False:
                        return "a gradient was there before the backward, and accumulated"
                    record.grads.append((index, _layout(t.grad, ledger, record.first_sid)))
            record.loss = None if loss is None else _layout(loss, ledger, record.first_sid)
            record.held = [_layout(t, ledger, record.first_sid) for t in tensors_in(held)]
        except _NotReplayable as exc:
            return str(exc)
        for layout in (*(g for _, g in record.grads), record.loss, *record.held):
            if layout is not None and layout.key is not None:
                layouts[layout.key] = layout
        unheld = live - layouts.keys()
        if unheld:
            return (
                f"{len(unheld)} storage(s) it made stay alive beside the gradients, the loss and "
                "the output (a cache the model keeps, a graph something holds)"
            )
        if any(tracker.timeline.storages[sid].nbytes != ledger.nbytes_now(sid) for sid in layouts):
            return "a storage it left alive was resized"
        record.held_sids = frozenset(layouts)
        record.modules = tracker.running_modules()
        return None

    def _differs(self, record: _Record) -> str | None:
        """Why this iteration's forward and backward may differ from the first's, or None."""
        if record.end < 0:
            return "the first iteration's did not finish"
        ledger = self.tracker.ledger
        if any(ledger.holds(sid) for sid in (*record.held_sids, *self._replayed_held)):
            return "a tensor an earlier iteration's forward or backward made is still alive"
        if record.kept.freed(self.tracker.timeline.events):
            return "a buffer the first iteration's made to keep was freed"
        if self._state() != record.state:
            return "the model's state or torch's switches changed since the first iteration"
        if record.read_values and self.tracker.values.rewritten_since(record.values_mark):
            return "an op read tensor values, and the step wrote in place what it read them from: they differ the next time"
        changed = unchanged(record.globals)
        if changed is not None:
            return f"the global {changed} of the model's code changed since the first iteration"
        if _hooked(self.model, self.leaves):
            return "the model has hooks, which may act differently the next time"
        if not self.tracker.quiet():
            return "autograd's bookkeeping was still pending"
        return None

    # -- the replay -------------------------------------------------------------------

    def _replay(self, record: _Record, iteration: int) -> tuple[Any, Any]:
        tracker = self.tracker
        sids = replay_events(tracker.timeline, record.start, record.end, record.first_sid, record.kept.sids, iteration)
        # the tensors the program would hold now, on the replayed storages
        made: dict[int | None, Any] = {}

        def remade(layout: Layout) -> torch.Tensor:
            key = layout.key
            storage = made.get(key) if key is not None else None
            t = standin(tracker.fake_mode, layout, storage)
            if key is not None and storage is None:
                made[key] = t.untyped_storage()
                tracker.ledger.bind(t, sids[key])
            return t

        for index, layout in record.grads:
            self.leaves[index].grad = remade(layout)
        loss = None if record.loss is None else remade(record.loss)
        held = [remade(layout) for layout in record.held] if record.held else None
        self._replayed_held = tuple(sids[sid] for sid in record.held_sids)
        tracker.resume(Phase.BACKWARD, record.modules)
        return loss, held


class _NotReplayable(Exception):
    pass


def _layout(t: Any, ledger: Any, first: int) -> Layout:
    if type(t) is not FakeTensor or t.layout is not _STRIDED:
        raise _NotReplayable(f"it left a {type(t).__name__} alive, which replay does not remake")
    sid = ledger.storage_id(t)
    if sid is not None and sid < first:
        raise _NotReplayable("a tensor it left alive views a storage made before it")
    return layout_of(t, sid)


def _hooked(model: nn.Module, leaves: Sequence[torch.Tensor]) -> bool:
    """Whether the model or a leaf carries hooks of the user's."""
    if hooked_modules(model):
        return True
    for t in leaves:
        if getattr(t, "_backward_hooks", None) or getattr(t, "_post_accumulate_grad_hooks", None):
            return True
    return global_hooks()
