"""A recorded region's events, replayed at the timeline's end (the trace-once, replay-the-
rest of replay.py, optimizer_replay.py and block_replay.py), the tensors a replay leaves
(their layouts, and fake tensors of them on the replayed storages), and what the replays
say."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Final

import torch

from pytest_torchmem.engine.figures.timeline import ALLOC, FREE, PHASE, RESIZE
from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = ["Kept", "Layout", "Said", "layout_of", "made_and_touched", "replay_events", "standin"]

FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
no_dispatch: Final = private("torch.utils._mode_utils.no_dispatch")


@dataclass(frozen=True, slots=True)
class Layout:
    """A tensor a recorded region left: its storage (``key``: its sid, or its rank among the
    storages of a block's window; None: not on the trace device) and its view of it."""

    key: int | None
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    device: torch.device


def layout_of(t: Any, key: int | None) -> Layout:
    """The layout of ``t``, a strided fake tensor, its storage named ``key``."""
    return Layout(
        key, t.untyped_storage().nbytes(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.fake_device
    )


def standin(fake_mode: Any, layout: Layout, storage: Any = None) -> torch.Tensor:
    """A fake tensor of ``layout`` on a new fake storage (or on ``storage``), made below
    every dispatch mode, as the fake mode makes a factory's output."""
    with no_dispatch():
        if storage is None:
            storage = torch.empty(layout.nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        meta = torch.empty(0, dtype=layout.dtype, device="meta")
        meta.set_(storage, layout.offset, layout.size, layout.stride)
    return FakeTensor(fake_mode, meta, layout.device)  # type: ignore[no-any-return]


def replay_events(
    timeline: Any, start: int, end: int, first: int, kept: frozenset[int], iteration: int
) -> dict[int, int]:
    """The events ``start:end`` again, at the timeline's end: the storages they made
    (sid ``first`` on) made anew but for ``kept`` (a cached workspace, made once), their
    phases set to ``iteration``; the new sid of each storage they made."""
    storages = timeline.storages
    events = timeline.events
    sids: dict[int, int] = {}
    for kind, a, b in events[start:end]:
        if kind == ALLOC or kind == RESIZE:
            if a in kept:
                continue
        if kind == ALLOC:
            if a >= first:
                new = sids.get(a)
                if new is None:
                    new = sids[a] = len(storages)
                    # (the recorded storage's info, shared: a storage's info is written only
                    # as it is made, and the replayed one is the same in every field)
                    storages.append(storages[a])
                a = new
        elif kind == FREE or kind == RESIZE:
            if a >= first:
                a = sids[a]
        elif kind == PHASE:
            b = iteration
        events.append((kind, a, b))
    return sids




def made_and_touched(timeline: Any, start: int, end: int, first: int) -> tuple[set[int], bool]:
    """The storages the events ``start:end`` made and did not free, and whether they
    freed or resized one made before them."""
    made: set[int] = set()
    for kind, a, _ in timeline.events[start:end]:
        if kind == ALLOC:
            if a < first:
                return made, True
            made.add(a)
        elif kind == FREE:
            if a < first:
                return made, True
            made.discard(a)
        elif kind == RESIZE and a < first:
            return made, True
    return made, False




class Kept:
    """The storages a recorded region made and left to the end of the step (a library's
    cached workspace: its replays make them no more), and whether the program has freed
    one since the region ended (each event looked at once)."""

    def __init__(self, sids: frozenset[int] = frozenset(), since: int = 0) -> None:
        self.sids = sids
        self._seen = since
        self._freed = False

    def freed(self, events: list[tuple[int, int, int]]) -> bool:
        if self.sids and not self._freed:
            sids = self.sids
            self._freed = any(kind == FREE and a in sids for kind, a, _ in itertools.islice(events, self._seen, None))
            self._seen = len(events)
        return self._freed


class Said:
    """What a loop's replays said, into ``lines``: one line per thing said, the consecutive
    iterations it was said of gathered (``iteration 2: ...``, ``iterations 3 to 8: ...``)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self._said: list[list[Any]] = []  # [first iteration, last iteration, what]

    def __call__(self, iteration: int, what: str) -> None:
        for entry in self._said:
            if entry[2] == what and entry[1] in (iteration - 1, iteration):
                entry[1] = iteration
                break
        else:
            self._said.append([iteration, iteration, what])
        self.lines[:] = [
            f"iteration {first}: {what}" if first == last else f"iterations {first} to {last}: {what}"
            for first, last, what in self._said
        ]
