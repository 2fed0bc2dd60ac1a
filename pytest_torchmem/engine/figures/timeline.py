"""The storage timeline of one step, and the figures read from it.

Both the fake-tensor tracer and the real-run measurement write a
:class:`Timeline`: storages with their sizes and roles, and an ordered list of
events (allocations, frees, resizes, phase changes, module entries and exits).
:func:`analyze` replays it once and returns the phase peaks, the breakdown at
the peak and the per-module peaks, so that estimate and measurement are read
by the same code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final, NamedTuple, Protocol

from pytest_torchmem.engine.figures.report import Category, ModulePeak

__all__ = [
    "CATEGORY_RANK",
    "Allocator",
    "Analysis",
    "Charge",
    "Frame",
    "Phase",
    "StorageInfo",
    "Timeline",
    "analyze",
    "highest",
    "replay",
]


class Phase(IntEnum):
    """Parts of the step; each has its own peak."""

    FORWARD = 0
    BACKWARD = 1
    STEP = 2


# Event kinds. An event is a tuple ``(kind, a, b)``.
ALLOC: Final = 0  # (ALLOC, sid, nbytes)
FREE: Final = 1  # (FREE, sid, 0)
RESIZE: Final = 2  # (RESIZE, sid, new nbytes): a new block, a copy, the old block freed
PHASE: Final = 3  # (PHASE, phase, iteration); phase -1 ends the step
ENTER: Final = 4  # (ENTER, module index, 0)
EXIT: Final = 5  # (EXIT, module index, 0)
NAMED: Final = 6  # (NAMED, index into Timeline.phase_names, 1 begins / 0 ends): tm.phase(name)
MARK: Final = 7  # (MARK, iteration, 0): the end of an iteration of a repeated step (leaks)

_CATEGORY_ORDER: Final = tuple(Category)
#: Each category's rank in that order (breakdowns, roles, the baseline's order).
CATEGORY_RANK: Final = {category: i for i, category in enumerate(_CATEGORY_ORDER)}
#: A storage's category as a number (:meth:`Timeline.digest`; -1: none yet).
_CATEGORY_CODE: Final = {None: -1, **CATEGORY_RANK}


class Frame(NamedTuple):
    """One Python frame of the user's code that led to an allocation."""

    filename: str
    line: int
    name: str


@dataclass(slots=True)
class StorageInfo:
    """One storage: its size when made, its role, and where it was made."""

    nbytes: int
    #: Fixed role (baseline storages, kernel workspace), or None until resolved.
    category: Category | None = None
    #: Phase in which it was allocated; None for storages live before the step.
    phase: Phase | None = None
    #: Index into :attr:`Timeline.module_names` of the innermost module running, or -1.
    module: int = -1
    #: The op that made it (empty for storages live before the step).
    op: str = ""
    #: The user's frames that made it, innermost first (recorded on request only).
    frames: tuple[Frame, ...] = ()
    #: The autograd node that was running when it was made, in backward (``MmBackward0``;
    #: recorded with the frames).
    node: str = ""
    #: The allocator pool it is charged to: 0 the default stream's, else a private pool (a
    #: CUDA graph's) or a side stream's (FSDP2's all-gather and reduce-scatter streams),
    #: whose cached blocks only its own allocations reuse.
    pool: int = 0


@dataclass
class Timeline:
    """Storages and the ordered events of one step on one device."""

    storages: list[StorageInfo] = field(default_factory=list)
    events: list[tuple[int, int, int]] = field(default_factory=list)
    module_names: list[str] = field(default_factory=list)
    #: Storages that end up as ``.grad`` of a leaf, or in ``optimizer.state``.
    roles: dict[int, Category] = field(default_factory=dict)
    #: The names of the user's own phases (``tm.phase(name)``), in the order first met.
    phase_names: list[str] = field(default_factory=list)
    #: The index of the step's first event. What comes before it sets the step up
    #: (parallel=: ``apply`` shards the model) and is not replayed: the step starts
    #: from the storages then alive, its baseline, as from parameters.
    step_start: int = 0

    def new_storage(self, info: StorageInfo) -> int:
        self.storages.append(info)
        return len(self.storages) - 1

    def new_allocation(self, info: StorageInfo) -> int:
        """A new storage, allocated now (:meth:`new_storage` and :meth:`alloc` in one
        call: the tracker makes one per op output)."""
        sid = len(self.storages)
        self.storages.append(info)
        self.events.append((ALLOC, sid, info.nbytes))
        return sid

    def alloc(self, sid: int) -> None:
        self.events.append((ALLOC, sid, self.storages[sid].nbytes))

    def free(self, sid: int) -> None:
        self.events.append((FREE, sid, 0))

    def resize(self, sid: int, nbytes: int) -> None:
        self.events.append((RESIZE, sid, nbytes))

    def phase(self, phase: Phase | None, iteration: int = 1) -> None:
        """``phase`` of the loop's ``iteration`` (from 1) begins; None: the step ends."""
        self.events.append((PHASE, -1 if phase is None else int(phase), iteration))

    def enter(self, module: int) -> None:
        self.events.append((ENTER, module, 0))

    def exit(self, module: int) -> None:
        self.events.append((EXIT, module, 0))

    def named(self, name: str, begin: bool) -> None:
        """The user's phase ``name`` (``tm.phase(name)``) begins, or ends."""
        if name not in self.phase_names:
            self.phase_names.append(name)
        self.events.append((NAMED, self.phase_names.index(name), int(begin)))

    def mark(self, iteration: int) -> None:
        """The step's ``iteration`` (from 1) of a repeated run has ended (its locals died)."""
        self.events.append((MARK, iteration, 0))

    def digest(self) -> bytes:
        """What the step did, in 16 bytes: every event in its order until the step ended, and
        every storage's size, role, phase, module, op and pool. Two traces of one program on
        the same sizes have the same digest; a byte more or less anywhere, and they differ.
        (What the step leaves is freed after its end as Python lets go of it, in an order
        of Python's: no figure reads those frees, and the digest leaves them out.)"""
        events = self.events
        end = next((i for i in range(len(events) - 1, -1, -1) if events[i][:2] == (PHASE, -1)), len(events) - 1)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(array("q", itertools.chain.from_iterable(events[: end + 1])).tobytes())
        # (as numbers: the storages' reprs, their enums' among them, took two thirds of the time)
        category = _CATEGORY_CODE
        storages = self.storages
        digest.update(
            array(
                "q",
                itertools.chain.from_iterable(
                    (one.nbytes, category[one.category], -1 if one.phase is None else one.phase, one.module, one.pool)
                    for one in storages
                ),
            ).tobytes()
        )
        digest.update("\0".join([one.op for one in storages]).encode())
        roles = sorted((sid, CATEGORY_RANK[role]) for sid, role in self.roles.items())
        digest.update(repr((roles, self.module_names, self.phase_names, self.step_start)).encode())
        return digest.digest()

    def assign_role(self, sid: int, category: Category) -> None:
        """Record the role a storage ends up in (gradient, optimizer state)."""
        current = self.roles.get(sid)
        if current is None or CATEGORY_RANK[category] < CATEGORY_RANK[current]:
            self.roles[sid] = category

    def category_of(self, sid: int) -> Category:
        info = self.storages[sid]
        if info.category is not None:
            return info.category
        role = self.roles.get(sid)
        if role is not None:
            return role
        if info.phase is None or info.phase == Phase.FORWARD:
            return Category.ACTIVATIONS
        return Category.TEMPORARIES


@dataclass(frozen=True)
class Analysis:
    """Figures read from a timeline."""

    #: Forward, backward and step peaks of the loop: its last iteration's (the only one's,
    #: where the step ran once).
    phase_peaks: tuple[int, int, int]
    breakdown: dict[Category, int]
    modules: dict[str, ModulePeak]
    #: Live bytes before the first event (the baseline).
    baseline: int
    #: Index of the event at which the overall peak was first reached (-1: the baseline).
    peak_event: int
    #: The allocator's reserved-bytes peak, when one was simulated.
    reserved_peak: int | None = None
    #: The first iteration's forward, backward and step peaks, where the step ran as a
    #: loop of several (None where it ran once).
    first_step: tuple[int, int, int] | None = None
    #: Every iteration's forward, backward and step peaks, in order.
    iterations: tuple[tuple[int, int, int], ...] = ()
    #: The peak of each of the user's own phases (``tm.phase(name)``): the live bytes
    #: when it begins and at every allocation while it lasts, the highest of its runs.
    named: dict[str, int] = field(default_factory=dict)
    #: ``(iteration, live bytes, reserved bytes)`` at each :data:`MARK` (the end of each
    #: iteration of a repeated step): what is live once the charges before it are taken
    #: and their blocks given back.
    marks: tuple[tuple[int, int, int | None], ...] = ()

    def over_the_call(self) -> Analysis:
        """The figures of a step function: each phase's peak is the highest of its
        iterations (the function's call is one step, whatever it repeats)."""
        peaks = tuple(max((it[phase] for it in self.iterations), default=0) for phase in range(3))
        return dataclasses.replace(self, phase_peaks=peaks, first_step=None)  # type: ignore[arg-type]


class Allocator(Protocol):
    """What :func:`analyze` needs of an allocator model (the CUDA caching allocator)."""

    def malloc(self, nbytes: int, stream: int = 0) -> Any: ...

    def free(self, block: Any) -> None: ...

    def round_size(self, nbytes: int) -> int: ...

    @property
    def reserved(self) -> int: ...

    @property
    def peak_reserved(self) -> int: ...


def _charge(allocator: Allocator | None, blocks: dict[int, Any], sid: int, nbytes: int, pool: int = 0) -> int:
    """Bytes a new storage of ``nbytes`` is charged: itself, or its allocator block (in
    ``pool``: a side stream, or a private pool modelled as a stream of its own, whose cached blocks no
    other allocation takes, as ``get_free_block`` keys them)."""
    if allocator is None:
        return nbytes
    block = allocator.malloc(nbytes, pool) if pool else allocator.malloc(nbytes)
    if block is None:
        return 0
    blocks[sid] = block
    return block.size


def _baseline_bytes(timeline: Timeline, baseline: list[int]) -> list[tuple[int, int]]:
    """Each storage of ``baseline`` with its bytes when the step starts (after the
    resizes of the events before :attr:`Timeline.step_start`)."""
    nbytes = {sid: timeline.storages[sid].nbytes for sid in baseline}
    for kind, a, b in timeline.events[: timeline.step_start]:
        if kind == RESIZE and a in nbytes:
            nbytes[a] = b
    return list(nbytes.items())


def analyze(timeline: Timeline, baseline: list[int], allocator: Allocator | None = None) -> Analysis:
    """Replay ``timeline`` from the live ``baseline`` storages and read every figure.

    ``baseline``: the storages alive when the step starts (at
    :attr:`Timeline.step_start`; the events before it are not replayed).

    Without ``allocator`` a storage costs its bytes; with one, each storage is
    handed to it in order and costs the block it gets (``allocator`` is then
    also asked for its reserved peak).
    """
    categories = [timeline.category_of(sid) for sid in range(len(timeline.storages))]
    cat_of = [CATEGORY_RANK[category] for category in categories]
    size: dict[int, int] = {}
    blocks: dict[int, Any] = {}
    by_cat = [0] * len(_CATEGORY_ORDER)
    live = 0
    for sid, nbytes in _baseline_bytes(timeline, baseline):
        charged = _charge(allocator, blocks, sid, nbytes)
        size[sid] = charged
        by_cat[cat_of[sid]] += charged
        live += charged
    base = live

    # the phase peaks of each iteration of the loop (one: the step ran once)
    iterations: list[list[int]] = [[0, 0, 0]]
    peaks = iterations[0]
    phase = -1
    best = -1
    best_cat = list(by_cat)
    peak_event = -1
    n_modules = len(timeline.module_names)
    fwd_peak = [0] * n_modules
    bwd_peak = [0] * n_modules
    depth = [0] * n_modules
    active: list[int] = []  # modules with depth > 0, in the current phase
    named_peak = [0] * len(timeline.phase_names)
    named_depth = [0] * len(timeline.phase_names)
    named_open: list[int] = []  # the user's phases under way
    marks: list[tuple[int, int, int | None]] = []

    # (the events before the step's start set it up: the baseline is what they left alive)
    start = timeline.step_start
    for index, (kind, a, b) in enumerate(itertools.islice(timeline.events, start, None), start):
        if kind == ALLOC or kind == RESIZE:
            if kind == ALLOC and a in size:
                continue  # already live: counted once
            old = size.get(a, 0)
            old_block = blocks.pop(a, None)
            charged = _charge(allocator, blocks, a, b, timeline.storages[a].pool)
            # a resize holds the old block until the data is copied into the new one
            live += charged
            by_cat[cat_of[a]] += charged
            if charged > 0:
                if phase >= 0 and live > peaks[phase]:
                    peaks[phase] = live
                # before the step (parallel=: while apply runs) is no phase's peak
                if phase >= 0 and live > best:
                    best = live
                    best_cat = list(by_cat)
                    peak_event = index
                if active:
                    table = bwd_peak if phase == Phase.BACKWARD else fwd_peak
                    for module in active:
                        if live > table[module]:
                            table[module] = live
                for name in named_open:
                    if live > named_peak[name]:
                        named_peak[name] = live
            size[a] = charged
            if old:
                live -= old
                by_cat[cat_of[a]] -= old
            if old_block is not None and allocator is not None:
                allocator.free(old_block)
        elif kind == FREE:
            nbytes = size.pop(a, None)
            if nbytes is not None:
                live -= nbytes
                by_cat[cat_of[a]] -= nbytes
            block = blocks.pop(a, None)
            if block is not None and allocator is not None:
                allocator.free(block)
        elif kind == PHASE:
            for module in active:
                depth[module] = 0
            active.clear()
            phase = a
            while len(iterations) < b:
                iterations.append([0, 0, 0])
            if b > 0:
                peaks = iterations[b - 1]
            if phase >= 0 and live > peaks[phase]:
                peaks[phase] = live
            if phase >= 0 and live > best:
                best = live
                best_cat = list(by_cat)
                peak_event = index
        elif kind == ENTER:
            if depth[a] == 0:
                active.append(a)
                table = bwd_peak if phase == Phase.BACKWARD else fwd_peak
                if live > table[a]:
                    table[a] = live
            depth[a] += 1
        elif kind == EXIT:
            if depth[a] > 0:
                depth[a] -= 1
                if depth[a] == 0:
                    active.remove(a)
        elif kind == NAMED:
            if b:
                if named_depth[a] == 0:
                    named_open.append(a)
                    if live > named_peak[a]:
                        named_peak[a] = live
                named_depth[a] += 1
            elif named_depth[a] > 0:
                named_depth[a] -= 1
                if named_depth[a] == 0:
                    named_open.remove(a)
        elif kind == MARK:
            marks.append((a, live, allocator.reserved if allocator is not None else None))

    if best < 0:  # no phase ever started
        best_cat = list(by_cat)
    modules = {
        name: ModulePeak(fwd_peak[i], bwd_peak[i])
        for i, name in enumerate(timeline.module_names)
        if fwd_peak[i] or bwd_peak[i]
    }
    breakdown = {category: best_cat[i] for i, category in enumerate(_CATEGORY_ORDER)}
    first, last = iterations[0], iterations[-1]
    return Analysis(
        phase_peaks=(last[0], last[1], last[2]),
        breakdown=breakdown,
        modules=modules,
        baseline=base,
        peak_event=peak_event,
        reserved_peak=None if allocator is None else allocator.peak_reserved,
        first_step=(first[0], first[1], first[2]) if len(iterations) > 1 else None,
        iterations=tuple((it[0], it[1], it[2]) for it in iterations),
        named=dict(zip(timeline.phase_names, named_peak)),
        marks=tuple(marks),
    )


class Charge(NamedTuple):
    """One change of the live bytes, as :func:`replay` reads it off a timeline."""

    #: Index of the event in :attr:`Timeline.events` (-1: a storage of the baseline).
    index: int
    sid: int
    #: Bytes charged (positive) or given back (negative).
    nbytes: int
    #: The allocator's block, when an allocator is replayed (None otherwise).
    block: Any


def highest(timeline: Timeline) -> int:
    """The most bytes the storages of ``timeline`` (all made in it: no baseline) held at once."""
    live = best = 0
    for charge in replay(timeline, []):
        live += charge.nbytes
        best = max(best, live)
    return best


def replay(timeline: Timeline, baseline: list[int], allocator: Allocator | None = None) -> Iterator[Charge]:
    """Every change of the live bytes of ``timeline``, in order, as :func:`analyze` counts them.

    The baseline storages (alive at :attr:`Timeline.step_start`) come first
    (``index`` -1); the events before the step's start are skipped. A storage allocated while
    live is not counted again; a resize charges the new block before giving
    back the old one. With ``allocator`` each storage costs its block, and the
    allocator is driven as it would be on the device.
    """
    size: dict[int, int] = {}
    blocks: dict[int, Any] = {}
    for sid, nbytes in _baseline_bytes(timeline, baseline):
        size[sid] = _charge(allocator, blocks, sid, nbytes)
        yield Charge(-1, sid, size[sid], blocks.get(sid))
    start = timeline.step_start
    for index, (kind, a, b) in enumerate(itertools.islice(timeline.events, start, None), start):
        if kind == ALLOC or kind == RESIZE:
            if kind == ALLOC and a in size:
                continue
            old = size.get(a, 0)
            old_block = blocks.pop(a, None)
            charged = _charge(allocator, blocks, a, b, timeline.storages[a].pool)
            size[a] = charged
            yield Charge(index, a, charged, blocks.get(a))
            if old:
                yield Charge(index, a, -old, old_block)
            if old_block is not None and allocator is not None:
                allocator.free(old_block)
        elif kind == FREE:
            nbytes = size.pop(a, None)
            block = blocks.pop(a, None)
            if nbytes is not None:
                yield Charge(index, a, -nbytes, block)
            if block is not None and allocator is not None:
                allocator.free(block)
