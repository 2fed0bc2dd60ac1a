"""Budgets and tolerances: the ``memory_budget`` marker, the verdict of a check, its message.

Everything here works on :class:`~pytest_torchmem.plugin.snapshots.Entry` figures in
bytes; nothing traces or reads files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from enum import Enum
from typing import Any, Final, Literal

from pytest_torchmem.engine.compiling import CompileOptions, compile_options
from pytest_torchmem.engine.gpu_profiles import PROFILES, GpuProfile, gpu_profile
from pytest_torchmem.engine.report import ROOT_NAME
from pytest_torchmem.engine.units import format_bytes, format_delta, parse_bytes
from pytest_torchmem.plugin.headroom import Room
from pytest_torchmem.plugin.releases import Release
from pytest_torchmem.plugin.snapshots import Entry, Key

__all__ = [
    "BUDGETS",
    "MarkerError",
    "MarkerSpec",
    "parse_marker",
    "parse_gpu",
    "parse_cpu",
    "parse_compile",
    "CPU_ISA_LEVELS",
    "Tolerance",
    "Status",
    "Change",
    "Breach",
    "Mismatch",
    "EnvChange",
    "STEP_SETTINGS",
    "environment_changes",
    "stale_reason",
    "release_change",
    "PER_TORCH_HINT",
    "FIGURES",
    "figures_of",
    "compare",
    "compared",
    "Result",
    "judge",
    "figure_name",
    "change_line",
    "moved_lines",
    "failure_message",
]

#: The figures a ``memory_budget`` marker can cap.
BUDGETS: Final = ("forward", "backward", "step", "peak")
_MARKER_KEYS: Final = (
    *BUDGETS, "devices", "rtol", "atol", "gpu", "cpu", "keep_output", "compile", "mesh", "rank", "fits"
)
#: The ISA levels of CPU profiles: ``tracing.devices.cpu.profiles.ISA_LEVELS``, spelled
#: out so that reading options and markers needs no torch (a test checks that the two agree).
CPU_ISA_LEVELS: Final = ("default", "avx2", "avx512", "avx512_bf16", "amx")
#: The marker of budgets and per-test settings.
MARKER: Final = "memory_budget"
#: The name ``step.ModuleTracker`` gives the model itself (not imported: it needs torch).


class MarkerError(ValueError):
    """A malformed ``memory_budget`` marker."""


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


@dataclass(frozen=True)
class MarkerSpec:
    """What the ``memory_budget`` markers of a test say (None: not said)."""

    budgets: Mapping[str, int] = field(default_factory=dict)
    devices: tuple[str, ...] | None = None
    rtol: float | None = None
    atol: int | None = None
    #: The GPU profile the ``cuda`` estimate follows.
    gpu: GpuProfile | None = None
    #: The CPU profile the ``cpu`` estimate follows (``"avx2:4"``, or ``"host"``).
    cpu: str | None = None
    #: Whether the model's output is held through backward (``keep_output``).
    keep_output: bool | None = None
    #: ``compile=``: the options to check the model compiled with, or False (eager).
    compile: CompileOptions | Literal[False] | None = None
    #: The mesh of ``torchmem.check(parallel=...)``, in place of the Parallel's own.
    mesh: Mapping[str, int] | None = None
    #: The rank of ``torchmem.check(parallel=...)`` (an int or ``"max"``), in place of its own.
    rank: int | str | None = None
    #: ``fits=``: the GPUs the cuda step must fit (``True``: the one it follows); None: not asked.
    fits: tuple[GpuProfile, ...] | Literal[True] | None = None

    def tolerance(self, default: Tolerance) -> Tolerance:
        return Tolerance(
            default.rtol if self.rtol is None else self.rtol,
            default.atol if self.atol is None else self.atol,
        )


def parse_rtol(value: Any, where: str) -> float:
    """A relative tolerance: a number >= 0 (``0.02`` is 2 %)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise MarkerError(
                f"{where}: cannot read {value!r} as a relative tolerance; write e.g. 0.02"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MarkerError(
            f"{where}: a relative tolerance must be a number such as 0.02, got {value!r}"
        )
    if value < 0:
        raise MarkerError(f"{where}: a relative tolerance cannot be negative, got {value!r}")
    return float(value)


def parse_size(value: Any, where: str) -> int:
    """A byte size (``parse_bytes``), with ``where`` in the error."""
    try:
        return parse_bytes(value)
    except (TypeError, ValueError) as exc:
        raise MarkerError(f"{where}: {exc}") from None


def parse_devices(value: Any, valid: Iterable[str], where: str) -> tuple[str, ...]:
    """Device names: a string (``"cpu"`` or ``"cpu,cuda"``) or a sequence of strings."""
    valid = tuple(valid)
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(part, str) for part in value):
        names = [part.strip() for part in value]
    else:
        raise MarkerError(
            f"{where}: devices must be a name or a tuple of names such as ('cpu',), got {value!r}"
        )
    if not names or any(not name for name in names):
        raise MarkerError(f"{where}: devices must name at least one device, got {value!r}")
    for name in names:
        if name not in valid:
            raise MarkerError(
                f"{where}: device {name!r} is not modelled; use one of: {', '.join(valid)}"
            )
    return tuple(dict.fromkeys(names))


def parse_gpu(value: Any, custom: Mapping[str, GpuProfile], where: str) -> GpuProfile:
    """The GPU profile ``value`` names: a name among the named profiles or ``custom``
    (the ``torchmem_gpus`` ini table; case-insensitive), ``"current"`` (this machine's
    GPU), a profile line (``"RTX4070TiS: memory=16GiB cc=8.9 sms=66"``) or a
    :class:`~pytest_torchmem.GpuProfile`."""
    known = ", ".join([*PROFILES, *custom])
    fix = (
        "describe another in the ini option torchmem_gpus (NAME: memory=16GiB cc=8.9 sms=66), "
        "or use 'current' for this machine's GPU"
    )
    if not isinstance(value, (str, GpuProfile)):
        raise MarkerError(
            f"{where}: a GPU profile is a name such as 'A100' or a tm.GpuProfile, got {value!r}; "
            f"known profiles: {known}"
        )
    try:
        return gpu_profile(value, custom)
    except ValueError as exc:
        if isinstance(value, str) and ":" not in value and value.strip().lower() != "current":
            raise MarkerError(
                f"{where}: unknown GPU profile {value!r}; known profiles: {known}; {fix}"
            ) from None
        raise MarkerError(f"{where}: {exc}") from None


def parse_cpu(value: Any, where: str) -> str:
    """A CPU profile: ``"<ISA level>:<intra-op threads>"`` (``"avx2:4"``) or ``"host"``,
    normalised (lower case, no spaces)."""
    fix = (
        f"write '<level>:<threads>' such as 'avx2:4' (levels: {', '.join(CPU_ISA_LEVELS)}), "
        "or 'host' for this machine"
    )
    if not isinstance(value, str):
        raise MarkerError(f"{where}: a CPU profile is a string; {fix}, got {value!r}")
    text = value.strip().lower()
    if text == "host":
        return text
    level, sep, threads = text.partition(":")
    level, threads = level.strip(), threads.strip()
    if not sep or level not in CPU_ISA_LEVELS or not threads.isdecimal() or int(threads) < 1:
        raise MarkerError(f"{where}: cannot read {value!r} as a CPU profile; {fix}")
    return f"{level}:{int(threads)}"


def parse_marker(
    marks: Sequence[Any], valid_devices: Iterable[str], gpus: Mapping[str, GpuProfile] | None = None
) -> MarkerSpec:
    """Read the ``memory_budget`` marks of a test, closest first (as ``iter_markers`` gives).

    A closer mark (the function's) overrides a farther one (its class's or
    module's) key by key. ``gpus`` are the GPU profiles of the ini table, by name
    (the named profiles are always known). Raises
    :class:`MarkerError` naming the bad value.
    """
    merged: dict[str, Any] = {}
    for mark in reversed(list(marks)):
        if mark.args:
            raise MarkerError(
                f"@pytest.mark.{MARKER} takes keyword arguments only "
                f"({', '.join(_MARKER_KEYS)}), got positional {mark.args!r}"
            )
        unknown = sorted(set(mark.kwargs) - set(_MARKER_KEYS))
        if unknown:
            raise MarkerError(
                f"@pytest.mark.{MARKER} does not know {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(_MARKER_KEYS)}"
            )
        merged.update(mark.kwargs)
    budgets = {
        phase: parse_size(merged[phase], f"{MARKER}({phase}={merged[phase]!r})")
        for phase in BUDGETS
        if merged.get(phase) is not None
    }
    devices = None
    if merged.get("devices") is not None:
        devices = parse_devices(
            merged["devices"], valid_devices, f"{MARKER}(devices={merged['devices']!r})"
        )
    rtol = None
    if merged.get("rtol") is not None:
        rtol = parse_rtol(merged["rtol"], f"{MARKER}(rtol={merged['rtol']!r})")
    atol = None
    if merged.get("atol") is not None:
        atol = parse_size(merged["atol"], f"{MARKER}(atol={merged['atol']!r})")
    gpu = None
    if merged.get("gpu") is not None:
        gpu = parse_gpu(merged["gpu"], gpus or {}, f"{MARKER}(gpu={merged['gpu']!r})")
    cpu = None
    if merged.get("cpu") is not None:
        cpu = parse_cpu(merged["cpu"], f"{MARKER}(cpu={merged['cpu']!r})")
    keep_output = merged.get("keep_output")
    if keep_output is not None and not isinstance(keep_output, bool):
        raise MarkerError(
            f"{MARKER}(keep_output={keep_output!r}): keep_output must be True or False"
        )
    compile = merged.get("compile")
    if compile is not None:
        compile = parse_compile(compile, f"{MARKER}(compile={compile!r})") or False
    mesh = merged.get("mesh")
    if mesh is not None:
        mesh = parse_mesh(mesh, f"{MARKER}(mesh={mesh!r})")
    rank = merged.get("rank")
    if rank is not None and rank != "max" and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise MarkerError(f"{MARKER}(rank={rank!r}): rank must be a rank number (0, 1, ...) or 'max'")
    fits = None
    if merged.get("fits") is not None:
        fits = parse_fits(merged["fits"], gpus or {}, f"{MARKER}(fits={merged['fits']!r})")
    return MarkerSpec(
        budgets=budgets,
        devices=devices,
        rtol=rtol,
        atol=atol,
        gpu=gpu,
        cpu=cpu,
        keep_output=keep_output,
        compile=compile,
        mesh=mesh,
        rank=rank,
        fits=fits,
    )


def parse_fits(
    value: Any, custom: Mapping[str, GpuProfile], where: str
) -> tuple[GpuProfile, ...] | Literal[True] | None:
    """``fits=``: ``True`` (the GPU the check follows), ``False`` (not asked: None), a GPU
    (as ``gpu=`` takes one) or a list or tuple of them."""
    if value is True:
        return True
    if value is False:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise MarkerError(f"{where}: fits= names at least one GPU, or is True (the check's GPU)")
    profiles = tuple(parse_gpu(one, custom, where) for one in values)
    return tuple(dict.fromkeys(profiles))


def parse_compile(value: Any, where: str) -> CompileOptions | None:
    """``compile=`` (:func:`~pytest_torchmem.engine.compiling.compile_options`): None for
    an eager check."""
    try:
        return compile_options(value, where)
    except (TypeError, ValueError) as exc:
        raise MarkerError(str(exc)) from None


def parse_mesh(value: Any, where: str) -> dict[str, int]:
    """A mesh as the marker takes it: dimension names to positive sizes, ``{"dp": 8}``."""
    if not isinstance(value, Mapping) or not value:
        raise MarkerError(f"{where}: mesh must be a dict of dimension names to sizes, e.g. mesh={{'dp': 8}}")
    for name, size in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise MarkerError(f"{where}: dimension names must be identifiers such as 'dp', got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MarkerError(f"{where}: the size of dimension {name!r} must be a positive int, got {size!r}")
    return dict(value)


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


#: What a suite run on several torch releases can do (said where an entry of another
#: release was met).
PER_TORCH_HINT: Final = (
    "a suite run on several torch releases can keep one snapshot directory per release: "
    "torchmem_per_torch = true (--torchmem-per-torch)"
)


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

    @property
    def acceptable(self) -> bool:
        """True when ``--torchmem-update`` would make this check pass its snapshot."""
        if self.update:
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


# -- the failure message ------------------------------------------------------------

_TOP: Final = {-1: 0, 0: 3, 1: 5}
_MODULE_PHASE: Final = {"forward": 0, "backward": 1}


def figure_name(figure: str) -> str:
    """``"backward peak"``, ``"reserved peak"``, ``"first-step peak"``, ``"peak"``: a
    figure as messages name it."""
    if figure == "peak":
        return "peak"
    if figure == "first_step":
        return "first-step peak"
    return "reserved peak" if figure == "reserved" else f"{figure} peak"


def _percent(delta: int, reference: int) -> str:
    return f"{delta / reference:+.1%}" if reference else "new"


def _moves(before: Mapping[str, int], after: Mapping[str, int], limit: int | None) -> list[str]:
    names = sorted(set(before) | set(after))
    deltas = [(name, after.get(name, 0) - before.get(name, 0)) for name in names]
    deltas = [(name, delta) for name, delta in deltas if delta]
    deltas.sort(key=lambda item: (-abs(item[1]), item[0]))
    if limit is not None:
        deltas = deltas[:limit]
    return [
        f"{name} {format_delta(after.get(name, 0), before.get(name, 0))}" for name, delta in deltas
    ]


def change_line(
    change: Change, device: str, allowance: str, names: tuple[str, str] = ("estimate", "snapshot")
) -> str:
    """``cpu forward peak grew: estimate ..., snapshot ...: +d (+p%), allowed ±a (allowance)``.

    ``names`` name the new and the reference figure; ``allowance`` says where
    the allowed drift comes from.
    """
    new, old = names
    return (
        f"{device} {figure_name(change.figure)} {change.moved}: "
        f"{new} {format_bytes(change.estimate)}, {old} {format_bytes(change.reference)}: "
        f"{format_delta(change.estimate, change.reference)}, "
        f"allowed \u00b1{format_bytes(change.allowed)} ({allowance})"
    )


def _change_line(change: Change, tolerance: Tolerance, device: str) -> str:
    return change_line(change, device, str(tolerance))


def moved_lines(
    before: Entry, after: Entry, phases: Iterable[str], limit: int | None = 3
) -> list[str]:
    """Which categories (at the peak) and modules (in each of ``phases``) moved most.

    ``limit``: at most this many categories per line, and at least 3 modules
    (None: all).
    """
    lines: list[str] = []
    categories = _moves(before.breakdown, after.breakdown, limit)
    if categories:
        lines.append(f"  categories that moved most (at the peak): {', '.join(categories)}")
    for phase in phases:
        index = _MODULE_PHASE[phase]
        # The model itself always moves with the device's peak: it says nothing.
        old = {n: p[index] for n, p in before.modules.items() if n != ROOT_NAME}
        new = {n: p[index] for n, p in after.modules.items() if n != ROOT_NAME}
        modules = _moves(old, new, limit if limit is None else max(limit, 3))
        if modules:
            lines.append(f"  modules that moved most ({phase} peak): {', '.join(modules)}")
    return lines


def _detail_lines(result: Result, verbosity: int) -> list[str]:
    """Which categories and modules moved, for a result that changed against its snapshot."""
    snapshot = result.snapshot
    if snapshot is None:
        return []
    limit = None if verbosity >= 2 else _TOP.get(verbosity, 3)
    if limit == 0:
        return []
    moved = [c.figure for c in result.changes if c.moved and c.figure in _MODULE_PHASE]
    return moved_lines(snapshot, result.estimate, moved[:1] if verbosity < 2 else moved, limit)


def _table(result: Result) -> list[str]:
    """Every figure of the estimate beside the snapshot (for ``-vv``)."""
    rows = ["  figure          estimate        snapshot        change"]
    reference = {} if result.snapshot is None else result.snapshot.figures()
    figures = result.estimate.figures()
    if result.snapshot is not None:
        figures["peak"] = result.estimate.peak
        reference["peak"] = result.snapshot.peak
    for figure, value in figures.items():
        ref = reference.get(figure)
        change = "" if ref is None else format_delta(value, ref)
        before = "-" if ref is None else format_bytes(ref)
        rows.append(f"  {figure:<15} {format_bytes(value):<15} {before:<15} {change}")
    return rows


def stale_reason(result: Result) -> str:
    """``cpu avx512:8 -> avx2:4, torch 2.12.0 -> 2.13.0``: what differs, snapshot -> this run."""
    return ", ".join(map(str, result.stale))


def _stale_line(result: Result) -> str:
    assert result.snapshot is not None
    where = "with other step settings" if result.step_changed else "in another environment"
    return (
        f"{result.key.device}: the snapshot entry was recorded {where} "
        f"({stale_reason(result)}): its figures are not compared with this run's "
        f"(estimate: peak {format_bytes(result.estimate.peak)}, snapshot: peak "
        f"{format_bytes(result.snapshot.peak)})"
    )


def _mismatch_line(mismatch: Mismatch, device: str) -> str:
    def moved(delta: int | None, what: str) -> str:
        if delta is None:
            return f"no {what} in the snapshot"
        if delta == 0:
            return f"the {what} did not move"
        return f"the {what} moved {'+' if delta > 0 else '-'}{format_bytes(abs(delta))}"

    return (
        f"{device} {figure_name(mismatch.figure)}: measured {format_bytes(mismatch.measured)} "
        f"on the GPU, estimated {format_bytes(mismatch.estimate)}: "
        f"{format_delta(mismatch.measured, mismatch.estimate)}, "
        f"allowed \u00b1{format_bytes(mismatch.allowed)}; "
        f"{moved(mismatch.estimate_moved, 'estimate')} since the snapshot, "
        f"{moved(mismatch.measured_moved, 'measurement')}"
    )


def _problems(result: Result, verbosity: int) -> list[str]:
    device = result.key.device
    lines: list[str] = [room.problem(device) for room in result.rooms if room.unfit]
    for breach in result.breaches:
        lines.append(
            f"{device} {figure_name(breach.figure)} over budget: {breach.source} "
            f"{format_bytes(breach.value)}, budget {format_bytes(breach.limit)} "
            f"(memory_budget({breach.figure}=...)): "
            f"{format_bytes(breach.value - breach.limit)} over"
        )
    if result.snapshot is None and not result.update:
        estimate = f"estimate: peak {format_bytes(result.estimate.peak)}"
        if result.release is None:
            lines.append(f"{device}: no snapshot entry ({estimate})")
        else:
            lines.append(
                f"{device}: no snapshot entry for torch {result.release} in {result.file} "
                f"(one snapshot directory per torch release: torchmem_per_torch; {estimate})"
            )
    if result.stale:
        lines.append(_stale_line(result))
    grew = shrank = []
    if not result.update:
        grew = result.moved("grew")
        shrank = result.moved("shrank") if (result.strict or grew) else []
    for change in grew + shrank:
        lines.append(_change_line(change, result.tolerance, device))
    for mismatch in result.mismatches:
        lines.append(_mismatch_line(mismatch, device))
    lines.extend(result.advice)
    if verbosity >= 0 and (grew or shrank):
        lines.extend(_detail_lines(result, verbosity))
    if verbosity >= 2:
        lines.extend(_table(result))
        if result.estimate.unsupported:
            ops = ", ".join(result.estimate.unsupported)
            lines.append(f"  incomplete estimate: these ops were not traced faithfully: {ops}")
    return lines


def failure_message(results: Sequence[Result], verbosity: int = 0) -> str:
    """The message of a check that failed on one or more devices.

    ``verbosity`` is pytest's: below 0 (``-q``) the problems and the command;
    0 adds the categories and modules that moved most and where the snapshot
    lives; 2 (``-vv``) every figure, every moved category and module, and the
    environment.
    """
    failed = [result for result in results if result.failed]
    if not failed:
        return ""
    first = failed[0]
    statuses = ", ".join(f"{result.status} on {result.key.device}" for result in failed)
    lines = [f"torchmem: {statuses}: {first.nodeid} [{first.key.name}]"]
    for result in failed:
        lines.extend(_problems(result, verbosity))
    # An entry of one file for every release, made on another: say what a matrix can do.
    changes = (release_change(result.stale) for result in failed if result.release is None)
    change = next((change for change in changes if change is not None), None)
    if change is not None:
        then, now = change
        lines.append(
            f"the snapshot entry was made on torch {then}, and this is torch {now}; "
            f"{PER_TORCH_HINT}"
        )
    if verbosity >= 0:
        for result in failed:
            if result.update:
                state = "written at the end of this run"
            else:
                state = "no such entry" if result.snapshot is None else "entry"
            lines.append(f"snapshot: {result.file}, key {result.key} ({state})")
    acceptable = [result for result in failed if result.acceptable]
    if acceptable:
        if all(r.snapshot is None for r in acceptable):
            verb = "create the entry"
            if first.release is not None:
                verb += f" for torch {first.release}"
        elif all(r.step_changed for r in acceptable):
            verb = "re-record the entry with its new settings"
        elif all(r.stale for r in acceptable):
            verb = "re-record the entry on this machine"
        else:
            verb = "accept the change"
        lines.append(f"{verb} with: {first.accept}")
    if any(result.breaches for result in failed):
        lines.append(
            "a budget is a hard limit: --torchmem-update does not lift it; reduce the memory "
            "or raise the limit in @pytest.mark.memory_budget"
        )
    if any(room.unfit for result in failed for room in result.rooms):
        lines.append(
            "a GPU named by fits= must hold the step: --torchmem-update does not lift it; reduce "
            "the memory (--torchmem-advise estimates what would) or name another GPU"
        )
    if any(result.mismatches for result in failed):
        lines.append(
            "estimate and GPU measurement disagree: fix the device model, or widen "
            "--torchmem-measure-rtol"
        )
    return "\n".join(lines)
