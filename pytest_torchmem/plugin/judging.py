"""The verdict of one check on one device: its figures against the snapshot entry and the limits.

Everything here works on :class:`~pytest_torchmem.plugin.snapshots.Entry` figures in
bytes; nothing traces, reads files or writes messages (:mod:`~pytest_torchmem.plugin.messages`
does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from enum import Enum
from typing import Any, Final

from pytest_torchmem.engine.figures.units import format_bytes
from pytest_torchmem.plugin.headroom import Room
from pytest_torchmem.plugin.releases import Release
from pytest_torchmem.plugin.snapshots import Entry, Key

__all__ = [
    "Tolerance",
    "Status",
    "Change",
    "Breach",
    "Mismatch",
    "EnvChange",
    "STEP_SETTINGS",
    "environment_changes",
    "release_change",
    "FIGURES",
    "figures_of",
    "compare",
    "compared",
    "Result",
    "judge",
    "stopped",
]


@dataclass(frozen=True)
class Tolerance:
    """Allowed drift from a reference figure: ``atol + rtol * reference`` bytes."""

    rtol: float = 0.0
    atol: int = 0

    def allowed(self, reference: int) -> int:
        # In decimal, as written: 0.29 * 100 is 28.999999999999996 in binary floating point.
        return math.floor(self.atol + Decimal(repr(float(self.rtol))) * reference)

    def __str__(self) -> str:
        return f"rtol {self.rtol:g}, atol {format_bytes(self.atol)}"



class Status(str, Enum):
    """The verdict of one check on one device."""

    PASSED = "passed"
    REGRESSED = "regressed"
    IMPROVED = "improved"
    MISSING = "missing"
    OVER_BUDGET = "over budget"
    #: The real GPU measurement and the estimate disagree.
    MISMATCH = "mismatch"
    #: The snapshot entry was recorded in another environment: its bytes are not compared.
    STALE = "stale"
    #: ``--torchmem-update``: the entry was missing and is written.
    NEW = "new"
    #: ``--torchmem-update``: the entry changed and is rewritten.
    UPDATED = "updated"
    #: ``--torchmem-update``: the entry was to be written, and was not (the run was
    #: interrupted, or its file could not be written: ``Result.not_written`` says which).
    NOT_WRITTEN = "not written"
    #: The trace stopped before the end of the step: there is no estimate to judge
    #: (``Result.stopped`` says where and why). It fails, and writes no entry.
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Change:
    """One figure of the estimate against the snapshot."""

    figure: str
    estimate: int
    reference: int
    allowed: int

    @property
    def delta(self) -> int:
        return self.estimate - self.reference

    @property
    def moved(self) -> str | None:
        """``"grew"`` or ``"shrank"`` beyond the tolerance, else None."""
        if self.delta > self.allowed:
            return "grew"
        if -self.delta > self.allowed:
            return "shrank"
        return None


@dataclass(frozen=True)
class Breach:
    """A figure above its ``memory_budget``."""

    figure: str
    value: int
    limit: int
    source: str = "estimate"


@dataclass(frozen=True)
class Mismatch:
    """A real GPU measurement that disagrees with the estimate beyond its tolerance."""

    figure: str
    estimate: int
    measured: int
    allowed: int
    #: Change of the estimate since the snapshot (None: no snapshot).
    estimate_moved: int | None
    #: Change of the measurement since the snapshot's (None: none recorded).
    measured_moved: int | None


@dataclass(frozen=True)
class EnvChange:
    """One fact of the environment that differs between the snapshot entry and this run."""

    name: str
    #: As the snapshot recorded it (None: not recorded).
    snapshot: Any
    #: As this run has it (None: not part of this run's environment).
    current: Any

    def __str__(self) -> str:
        def shown(value: Any) -> str:
            return "-" if value is None else str(value)

        return f"{self.name} {shown(self.snapshot)} -> {shown(self.current)}"


#: Settings of the step itself that an entry's ``environment`` records, with the value
#: an entry that does not record one was made with. They come from the test, not the
#: machine: a check whose entry was made with another value is never compared with
#: it, and fails (``judge``); ``diff`` of two snapshot files reports it as stale.
#: ``figures``: what the figures are of, recorded for a training loop only (the step ran
#: with an optimizer: its figures are the loop's, the first step beside them); an entry
#: that does not record it holds one step's figures (made before the loop, or a step
#: without an optimizer).
STEP_SETTINGS: Final[Mapping[str, Any]] = {"keep_output": False, "figures": "one step"}


def environment_changes(snapshot: Entry, current: Entry) -> tuple[EnvChange, ...]:
    """What differs between the environments the two entries were made in."""
    then, now = snapshot.environment, current.environment

    def value(environment: Mapping[str, Any], name: str) -> Any:
        return environment.get(name, STEP_SETTINGS.get(name))

    def differs(name: str) -> bool:
        if name == "torch":  # figures are a minor release's: 2.13.0+cpu compares with 2.13.1+cu130
            releases = Release.of_version(value(then, name)), Release.of_version(value(now, name))
            if None not in releases:
                return releases[0] != releases[1]
        return bool(value(then, name) != value(now, name))

    changed = [name for name in sorted(set(then) | set(now)) if differs(name)]
    if "gpu" in changed:  # another GPU: its properties (a profile of the ini table's) go without saying
        changed = [name for name in changed if not name.startswith("gpu_")]
    return tuple(EnvChange(name, value(then, name), value(now, name)) for name in changed)



def release_change(stale: Iterable[EnvChange]) -> tuple[Release, Release] | None:
    """The torch release an entry was made on and this run's, where ``stale`` says they
    differ (another minor release, not only another patch or build); else None."""
    for change in stale:
        if change.name == "torch":
            then, now = Release.of_version(change.snapshot), Release.of_version(change.current)
            if then is not None and now is not None and then != now:
                return then, now
    return None


#: Every figure of an entry that can be compared, in the order they are shown.
FIGURES: Final = ("forward", "backward", "step", "first_step", "peak", "reserved")
#: The figures the plugin compares with the snapshot (``peak`` is the largest of the
#: others; ``first_step``: the first step's peak, where the step ran as a training loop).
_SNAPSHOT_FIGURES: Final = ("forward", "backward", "step", "first_step", "reserved")


def figures_of(entry: Entry) -> dict[str, int]:
    """The figures of ``entry`` in bytes, in :data:`FIGURES` order (``reserved`` when known)."""
    figures = {**entry.figures(), "peak": entry.peak}
    return {name: figures[name] for name in FIGURES if name in figures}


def compare(
    estimate: Entry, reference: Entry, allowed: Callable[[str, int], int | None]
) -> tuple[Change, ...]:
    """A :class:`Change` for each figure both entries have and ``allowed`` gates.

    ``allowed(figure, reference_value)`` is the number of bytes the figure may
    move either way, or None when the figure is not compared.
    """
    before, after = figures_of(reference), figures_of(estimate)
    changes = []
    for figure, value in after.items():
        if figure in before:
            limit = allowed(figure, before[figure])
            if limit is not None:
                changes.append(Change(figure, value, before[figure], limit))
    return tuple(changes)


def compared(
    changes: Sequence[Change],
    stale: Sequence[EnvChange],
    *,
    fail_on_improvement: bool = False,
    fail_on_stale: bool = False,
) -> tuple[Status, bool]:
    """The status of an entry compared with its reference, and whether that fails.

    Entries made in different environments (``stale``) are not compared. Else
    a figure grown beyond its allowance is a regression, which fails; one shrunk
    beyond it (and none grown) an improvement, which fails when asked to.
    """
    if stale:
        return Status.STALE, fail_on_stale
    if any(change.moved == "grew" for change in changes):
        return Status.REGRESSED, True
    if any(change.moved == "shrank" for change in changes):
        return Status.IMPROVED, fail_on_improvement
    return Status.PASSED, False


@dataclass(frozen=True)
class Result:
    """The verdict of one check of one test on one device."""

    nodeid: str
    key: Key
    #: The snapshot file, as shown to the user.
    file: str
    #: The command that accepts the change.
    accept: str
    status: Status
    failed: bool
    estimate: Entry
    snapshot: Entry | None
    tolerance: Tolerance
    budgets: Mapping[str, int] = field(default_factory=dict)
    changes: tuple[Change, ...] = ()
    breaches: tuple[Breach, ...] = ()
    mismatches: tuple[Mismatch, ...] = ()
    #: How the snapshot's environment differs from this run's (empty: comparable).
    stale: tuple[EnvChange, ...] = ()
    #: True when an improvement beyond the tolerance fails the test.
    strict: bool = False
    #: True under ``--torchmem-update``: the estimate is written as the new entry.
    update: bool = False
    #: The torch release whose snapshot directory holds the entry (``torchmem_per_torch``:
    #: ``"2.15"``); None where one file serves every release.
    release: str | None = None
    #: Why an entry to be written (``new``, ``updated``) was not: ``"interrupted"``,
    #: ``"interrupted while writing"``, ``"could not write"``; its status is then
    #: :attr:`Status.NOT_WRITTEN`.
    not_written: str | None = None
    #: A cuda check's room on the GPU it follows, then on each other GPU ``fits=`` names.
    rooms: tuple[Room, ...] = ()
    #: ``--torchmem-advise``: what would bring a check over its budget or GPU down, a line
    #: per change estimated.
    advice: tuple[str, ...] = ()
    #: Where and why the trace stopped, one line (:attr:`Status.STOPPED`); None: it did
    #: not. ``estimate`` then holds the figures of the part of the step that ran.
    stopped: str | None = None

    @property
    def approximate(self) -> bool:
        """Whether the figures are approximate: the trace went on past ops it listed in
        ``unsupported`` (a stopped trace has no figures at all)."""
        return self.stopped is None and bool(self.estimate.unsupported)

    @property
    def acceptable(self) -> bool:
        """True when ``--torchmem-update`` would make this check pass its snapshot."""
        if self.update or self.stopped is not None:
            return False
        if self.stale:
            return True
        return (
            self.snapshot is None
            or bool(self.moved("grew"))
            or (self.strict and bool(self.moved("shrank")))
        )

    @property
    def step_changed(self) -> bool:
        """True when the snapshot entry was made with other step settings (``keep_output``,
        one step's figures where the step is now a training loop's)."""
        return any(change.name in STEP_SETTINGS for change in self.stale)

    def moved(self, how: str) -> list[Change]:
        """The changes that moved ``how`` beyond the tolerance (none when stale: not compared)."""
        if self.stale:
            return []
        return [change for change in self.changes if change.moved == how]

    def largest_change(self) -> Change | None:
        """The change with the largest relative size (absolute for a zero reference)."""
        moving = [change for change in self.changes if change.delta]
        if not moving:
            return None
        return max(
            moving,
            key=lambda c: (abs(c.delta) / c.reference if c.reference else math.inf, abs(c.delta)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "nodeid": self.nodeid,
            "key": list(self.key),
            "file": self.file,
            "accept": self.accept,
            "status": self.status.value,
            "failed": self.failed,
            "estimate": self.estimate.to_json(),
            "snapshot": None if self.snapshot is None else self.snapshot.to_json(),
            "tolerance": {"rtol": self.tolerance.rtol, "atol": self.tolerance.atol},
            "budgets": dict(self.budgets),
            "changes": [vars(change) for change in self.changes],
            "breaches": [vars(breach) for breach in self.breaches],
            "mismatches": [vars(mismatch) for mismatch in self.mismatches],
            "stale": [vars(change) for change in self.stale],
            "strict": self.strict,
            "update": self.update,
            "release": self.release,
            "not_written": self.not_written,
            "rooms": [room.to_json() for room in self.rooms],
            "advice": list(self.advice),
            "stopped": self.stopped,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Result:
        snapshot = data["snapshot"]
        return cls(
            nodeid=data["nodeid"],
            key=Key(*data["key"]),
            file=data["file"],
            accept=data["accept"],
            status=Status(data["status"]),
            failed=data["failed"],
            estimate=Entry.from_json(data["estimate"]),
            snapshot=None if snapshot is None else Entry.from_json(snapshot),
            tolerance=Tolerance(**data["tolerance"]),
            budgets=data["budgets"],
            changes=tuple(Change(**change) for change in data["changes"]),
            breaches=tuple(Breach(**breach) for breach in data["breaches"]),
            mismatches=tuple(Mismatch(**mismatch) for mismatch in data["mismatches"]),
            stale=tuple(EnvChange(**change) for change in data.get("stale", ())),
            strict=data["strict"],
            update=data["update"],
            release=data.get("release"),
            not_written=data.get("not_written"),
            rooms=tuple(Room.from_json(room) for room in data.get("rooms", ())),
            advice=tuple(data.get("advice", ())),
            stopped=data.get("stopped"),
        )


def _budget_breaches(
    figures: Mapping[str, int], budgets: Mapping[str, int], source: str
) -> list[Breach]:
    return [
        Breach(phase, figures[phase], limit, source)
        for phase, limit in budgets.items()
        if phase in figures and figures[phase] > limit
    ]


def _peaks(entry: Entry) -> dict[str, int]:
    return {
        "forward": entry.forward_peak,
        "backward": entry.backward_peak,
        "step": entry.step_peak,
        "peak": entry.peak,
    }


def _measured_figures(measured: Mapping[str, int]) -> dict[str, int]:
    figures = {
        "forward": measured.get("forward_peak", 0),
        "backward": measured.get("backward_peak", 0),
        "step": measured.get("step_peak", 0),
    }
    if measured.get("first_step_peak") is not None:
        figures["first_step"] = measured["first_step_peak"]
    figures["peak"] = max(figures.values())
    if measured.get("reserved_peak") is not None:
        figures["reserved"] = measured["reserved_peak"]
    return figures


def judge(
    *,
    nodeid: str,
    key: Key,
    file: str,
    accept: str,
    estimate: Entry,
    snapshot: Entry | None,
    tolerance: Tolerance,
    budgets: Mapping[str, int],
    update: bool,
    fail_on_improvement: bool,
    measure_rtol: float = 0.05,
    fail_on_stale: bool = False,
    release: Release | None = None,
    rooms: tuple[Room, ...] = (),
) -> Result:
    """The verdict of one check on one device.

    Budgets fail even under ``update``; without ``update`` a missing entry and
    a figure grown beyond the tolerance fail, and one shrunk beyond it fails
    when ``fail_on_improvement``. An entry recorded in another environment
    (torch version, CPU threads or ISA, GPU profile: the entries'
    ``environment``) is stale: its bytes are not compared, and it fails only
    when ``fail_on_stale``; budgets still apply. An entry made with other step
    settings (``keep_output``; one step's figures where the step is now a training
    loop's) is stale too, and always fails: the test changed what it measures. Where
    the entry holds a real measurement, each phase must agree with the estimate within
    ``measure_rtol``.
    ``release``: the torch release whose snapshot directory ``snapshot`` was looked
    up in (``torchmem_per_torch``), named by the message of a missing entry.
    ``rooms``: a cuda check's room on its GPUs (:mod:`~pytest_torchmem.plugin.headroom`);
    one that ``fits=`` requires and the step does not fit fails, as a budget does.
    """
    stale: tuple[EnvChange, ...] = ()
    if snapshot is not None and not update:
        stale = environment_changes(snapshot, estimate)
    changes: tuple[Change, ...] = ()
    if snapshot is not None:
        changes = compare(
            estimate,
            snapshot,
            lambda figure, ref: tolerance.allowed(ref) if figure in _SNAPSHOT_FIGURES else None,
        )
    breaches = _budget_breaches(_peaks(estimate), budgets, "estimate")
    mismatches: list[Mismatch] = []
    if estimate.measured is not None:
        measured = _measured_figures(estimate.measured)
        breaches += _budget_breaches(measured, budgets, "measured")
        recorded = None
        if snapshot is not None and snapshot.measured is not None and not stale:
            recorded = _measured_figures(snapshot.measured)
        before = None if snapshot is None or stale else snapshot.figures()
        for figure, value in estimate.figures().items():
            if figure not in measured:
                continue
            allowed = math.floor(measure_rtol * max(value, measured[figure]))
            if abs(measured[figure] - value) > allowed:
                mismatches.append(
                    Mismatch(
                        figure,
                        value,
                        measured[figure],
                        allowed,
                        None if before is None or figure not in before else value - before[figure],
                        None
                        if recorded is None or figure not in recorded
                        else measured[figure] - recorded[figure],
                    )
                )
    if update:
        if snapshot is None:
            status = Status.NEW
        elif snapshot.to_json() != estimate.to_json():
            status = Status.UPDATED
        else:
            status = Status.PASSED
        failed = bool(breaches or mismatches)
    else:
        if snapshot is None:
            status, failed = Status.MISSING, True
        else:
            # A stale entry's figures were made by other kernels: a difference says nothing.
            status, failed = compared(
                changes,
                stale,
                fail_on_improvement=fail_on_improvement,
                # Other step settings: the test changed what it measures; re-record.
                fail_on_stale=fail_on_stale or any(c.name in STEP_SETTINGS for c in stale),
            )
        failed = failed or bool(breaches or mismatches)
    unfit = any(room.unfit for room in rooms)
    failed = failed or unfit
    if breaches or unfit:
        status = Status.OVER_BUDGET
    elif mismatches:
        status = status if status in (Status.REGRESSED, Status.MISSING) else Status.MISMATCH
    return Result(
        nodeid=nodeid,
        key=key,
        file=file,
        accept=accept,
        status=status,
        failed=failed,
        estimate=estimate,
        snapshot=snapshot,
        tolerance=tolerance,
        budgets=dict(budgets),
        changes=changes,
        breaches=tuple(breaches),
        mismatches=tuple(mismatches),
        stale=stale,
        strict=fail_on_improvement,
        update=update,
        release=None if release is None else str(release),
        rooms=rooms,
    )


def stopped(
    *,
    nodeid: str,
    key: Key,
    file: str,
    accept: str,
    partial: Entry,
    snapshot: Entry | None,
    tolerance: Tolerance,
    budgets: Mapping[str, int],
    update: bool,
    why: str,
    release: Release | None = None,
) -> Result:
    """The verdict of a check whose trace stopped (``why``: where and why, one line): it
    fails, and is neither compared with ``snapshot`` nor written under ``update``; its
    ``partial`` figures are of the part of the step that ran."""
    return Result(
        nodeid=nodeid,
        key=key,
        file=file,
        accept=accept,
        status=Status.STOPPED,
        failed=True,
        estimate=partial,
        snapshot=snapshot,
        tolerance=tolerance,
        budgets=dict(budgets),
        update=update,
        release=None if release is None else str(release),
        stopped=why,
    )
