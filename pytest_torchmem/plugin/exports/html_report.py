"""``--torchmem-html``: what the HTML report shows of each check, and the file itself.

:func:`check_view` reduces the trace of one check on one device to a small
JSON-ready dict (pytest-xdist workers send these to the controller);
:func:`write_report` turns the views of a run into one self-contained page
(:mod:`pytest_torchmem.plugin.exports.html_page`) and writes it atomically.

This module does not import torch: the controller of an xdist run writes the
page without tracing anything.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pytest_torchmem.engine.figures.report import ROOT_NAME, Category
from pytest_torchmem.engine.figures.timeline import PHASE, StorageInfo, Timeline, replay
from pytest_torchmem.engine.figures.units import format_bytes, format_delta
from pytest_torchmem.plugin.snapshots import atomic_write
from pytest_torchmem.plugin.judging import Result, figures_of
from pytest_torchmem.plugin.messages import failure_message, stale_reason

if TYPE_CHECKING:
    from pytest_torchmem.engine.tracing.trace import Trace

__all__ = ["VIEW_SCHEMA", "Downsampler", "check_view", "display_path", "order", "write_report"]

#: Version of the dict :func:`check_view` returns.
VIEW_SCHEMA: Final = 1
#: Slices of the step's events; the chart keeps at most three states of each.
BUCKETS: Final = 500
#: Tensors listed as alive at the peak.
TOP_TENSORS: Final = 15
#: Modules listed per phase as the ones that moved most.
TOP_MODULES: Final = 8
#: Frames of each listed tensor shown on hover (innermost first).
STACK_DEPTH: Final = 4
#: The name ``step.ModuleTracker`` gives the model itself (not imported: it needs torch).
_CATEGORIES: Final = tuple(Category)
_PHASE_NAMES: Final = {-1: "after", 0: "forward", 1: "backward", 2: "step"}


class Downsampler:
    """Reduce a stream of states to at most three per bucket of ``x``.

    The range ``[0, span)`` of ``x`` is cut into ``buckets`` equal buckets;
    of the states that fall in one bucket, those at the largest and the
    smallest ``total`` (the first of equals) and the last one are kept, in
    their order, as are states added with ``keep=True``. So every local
    maximum and minimum that a bucket's width can show survives, the overall
    peak (the first state at the largest total) always does, and the level
    carried into the next bucket is exact. When ``span <= buckets`` each ``x``
    has a bucket of its own: a stream with at most three states per ``x`` comes
    out whole.
    """

    def __init__(self, span: int, buckets: int = BUCKETS) -> None:
        if buckets < 1:
            raise ValueError(f"buckets must be at least 1, got {buckets}")
        self.span: Final = max(span, 1)
        self.buckets: Final = buckets
        self._kept: list[tuple[int, int, Any]] = []
        self._bucket = -1
        self._count = 0
        self._max: tuple[int, int, int, Any] | None = None
        self._min: tuple[int, int, int, Any] | None = None
        self._last: tuple[int, int, int, Any] | None = None
        self._forced: list[tuple[int, int, int, Any]] = []

    def add(self, x: int, total: int, state: Any, *, keep: bool = False) -> None:
        """One state at ``x`` (non-decreasing) whose chart height is ``total``."""
        bucket = min(x, self.span - 1) * self.buckets // self.span
        if bucket != self._bucket:
            self._flush()
            self._bucket = bucket
        item = (self._count, x, total, state)
        self._count += 1
        if self._max is None or total > self._max[2]:
            self._max = item
        if self._min is None or total < self._min[2]:
            self._min = item
        self._last = item
        if keep:
            self._forced.append(item)

    def _flush(self) -> None:
        chosen = {
            item[0]: item
            for item in (self._max, self._min, self._last, *self._forced)
            if item is not None
        }
        self._kept.extend((chosen[n][1], chosen[n][2], chosen[n][3]) for n in sorted(chosen))
        self._max = self._min = self._last = None
        self._forced = []

    def points(self) -> list[tuple[int, int, Any]]:
        """The kept states as ``(x, total, state)``, in the order they were added."""
        self._flush()
        return list(self._kept)


def display_path(filename: str, root: str | os.PathLike[str] | None = None) -> str:
    """``filename`` as a reader finds it: relative to the ``site-packages`` folder that
    holds it (``transformers/models/...``), else relative to ``root`` (default: the
    current directory) when inside it, else as given."""
    path = os.path.abspath(filename)
    folders = [
        os.path.abspath(entry)
        for entry in sys.path
        if entry and os.path.basename(entry.rstrip("/\\")) in ("site-packages", "dist-packages")
    ]
    for folder in sorted(folders, key=len, reverse=True):
        if _inside(path, folder):
            return Path(os.path.relpath(path, folder)).as_posix()
    base = os.path.abspath(root if root is not None else os.getcwd())
    if _inside(path, base):
        return Path(os.path.relpath(path, base)).as_posix()
    return filename


def _inside(path: str, folder: str) -> bool:
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # another drive on Windows
        return False


def _location(location: str, root: str | os.PathLike[str] | None) -> str:
    """``file:line`` with the file as :func:`display_path` shows it."""
    filename, _, line = location.rpartition(":")
    if not filename or not line.isdecimal():
        return location
    return f"{display_path(filename, root)}:{line}"


def _where(info: StorageInfo, root: str | os.PathLike[str] | None) -> list[str]:
    return [
        f"{display_path(frame.filename, root)}:{frame.line} in {frame.name}"
        for frame in info.frames[:STACK_DEPTH]
    ]


def _series(
    traced: Trace, buckets: int
) -> tuple[dict[str, Any], dict[int, int], list[tuple[int, int]]]:
    """The chart's points, the storages live at the peak (sid -> bytes charged) and the
    phase boundaries ``(x, phase)``. ``x`` is the event index plus one (0: before the step)."""
    timeline: Timeline = traced.timeline
    allocator = traced.device.allocator(traced.context) if traced.device.allocator else None
    cat_index = {category: i for i, category in enumerate(_CATEGORIES)}
    cat_of = [cat_index[timeline.category_of(sid)] for sid in range(len(timeline.storages))]
    span = len(timeline.events) + 1
    sampler = Downsampler(span, buckets)
    peak_event = traced.analysis.peak_event
    by_cat = [0] * len(_CATEGORIES)
    total = 0
    live: dict[int, int] = {}
    at_peak: dict[int, int] | None = None
    changes = 0
    started = False

    def mark_peak(x: int) -> None:
        # The peak is a state with nothing new: the baseline, or a phase change.
        nonlocal at_peak
        at_peak = dict(live)
        sampler.add(x, total, (tuple(by_cat), -1, False), keep=True)

    for charge in replay(timeline, traced.baseline, allocator):
        if charge.index >= 0 and not started:
            started = True
            if peak_event < 0:
                mark_peak(0)
            else:
                sampler.add(0, total, (tuple(by_cat), -1, False))
        if at_peak is None and 0 <= peak_event < charge.index:
            mark_peak(peak_event + 1)
        by_cat[cat_of[charge.sid]] += charge.nbytes
        total += charge.nbytes
        if charge.nbytes > 0:
            live[charge.sid] = charge.nbytes
        elif live.get(charge.sid) == -charge.nbytes:
            del live[charge.sid]
        if charge.index < 0:  # the baseline is one state, before the first event
            continue
        changes += 1
        peak = at_peak is None and charge.nbytes > 0 and charge.index == peak_event
        if peak:
            at_peak = dict(live)
        # each state: bytes by category, and the storage whose change made it
        state = (tuple(by_cat), charge.sid, charge.nbytes > 0)
        sampler.add(charge.index + 1, total, state, keep=peak)
    if not started:  # nothing changed during the step
        mark_peak(0)
    elif at_peak is None:
        mark_peak(peak_event + 1)
    points = sampler.points()
    present = [i for i in range(len(_CATEGORIES)) if any(state[0][i] for _, _, state in points)]
    values: dict[str, list[list[int]]] = {}
    for i in present:
        column: list[list[int]] = []
        previous = None
        for n, (_, _, (state, _, _)) in enumerate(points):
            if state[i] != previous:
                column.append([n, state[i]])
                previous = state[i]
        values[_CATEGORIES[i].value] = column
    # what made each state, as text; each distinct text stored once
    names = timeline.module_names
    texts: dict[str, int] = {}
    label: list[int] = []
    for _, _, (_, sid, made) in points:
        if sid < 0:
            text = "before the step: parameters, buffers, inputs, gradients"
        else:
            info = timeline.storages[sid]
            what = info.op or f"{_CATEGORIES[cat_of[sid]].value} (live before the step)"
            module = names[info.module] if 0 <= info.module < len(names) else ""
            text = f"{'alloc' if made else 'free'} {what}"
            if info.node:
                text += f" ({info.node})"
            if module:
                text += f" in {module}"
        label.append(texts.setdefault(text, len(texts)))
    boundaries = [
        (index + 1, phase, iteration)
        for index, (kind, phase, iteration) in enumerate(timeline.events)
        if kind == PHASE
    ]
    series = {
        "span": span,
        "x": [x for x, _, _ in points],
        "values": values,
        "labels": list(texts),
        "label": label,
        "events": len(timeline.events),
        "changes": changes,
        "kept": len(points),
        "buckets": buckets,
    }
    return series, at_peak, boundaries


def _phase_at(boundaries: list[tuple[int, int, int]], x: int) -> tuple[int, int]:
    """The phase at event ``x`` and its iteration of the loop."""
    phase, iteration = -1, 1
    for start, value, number in boundaries:
        if start > x:
            break
        phase, iteration = value, number
    return phase, iteration


def _tensors(
    traced: Trace,
    at_peak: Mapping[int, int],
    top: int,
    root: str | os.PathLike[str] | None,
) -> list[dict[str, Any]]:
    timeline = traced.timeline
    names = timeline.module_names
    largest = sorted(at_peak.items(), key=lambda item: (-item[1], item[0]))[:top]
    rows = []
    for sid, nbytes in largest:
        info = timeline.storages[sid]
        stack = _where(info, root)
        rows.append(
            {
                "bytes": nbytes,
                "requested": info.nbytes,
                "category": timeline.category_of(sid).value,
                "op": info.op,
                "node": info.node,
                "module": names[info.module] if 0 <= info.module < len(names) else "",
                "phase": "" if info.phase is None else _PHASE_NAMES[int(info.phase)],
                "where": stack[0] if stack else "",
                "stack": stack,
            }
        )
    return rows


def _moved(
    before: Mapping[str, int], after: Mapping[str, int], limit: int | None
) -> list[dict[str, Any]]:
    """``{"name", "estimate", "snapshot"}`` of the names that moved, largest move first."""
    names = sorted(set(before) | set(after))
    rows = [
        {"name": name, "estimate": after.get(name, 0), "snapshot": before.get(name, 0)}
        for name in names
        if after.get(name, 0) != before.get(name, 0)
    ]
    rows.sort(key=lambda row: (-abs(row["estimate"] - row["snapshot"]), row["name"]))
    return rows if limit is None else rows[:limit]


def _figures(result: Result) -> list[dict[str, Any]]:
    estimate, snapshot = result.estimate, result.snapshot
    now = figures_of(estimate)
    then = {} if snapshot is None else figures_of(snapshot)
    changes = {change.figure: change for change in result.changes}
    measured: dict[str, int] = {}
    if estimate.measured is not None:
        measured = {
            name: estimate.measured.get(f"{name}_peak", 0)
            for name in ("forward", "backward", "step")
        }
        if estimate.measured.get("first_step_peak") is not None:
            measured["first_step"] = estimate.measured["first_step_peak"]
        measured["peak"] = max(measured.values())
        if estimate.measured.get("reserved_peak") is not None:
            measured["reserved"] = estimate.measured["reserved_peak"]
    over = {(breach.figure, breach.source) for breach in result.breaches}
    rows = []
    for name, value in now.items():
        change = changes.get(name)
        rows.append(
            {
                "figure": name,
                "estimate": value,
                "snapshot": then.get(name),
                "allowed": None if change is None or result.stale else change.allowed,
                "moved": None if change is None or result.stale else change.moved,
                "budget": result.budgets.get(name),
                "over": (name, "estimate") in over,
                "measured": measured.get(name),
                "measured_over": (name, "measured") in over,
            }
        )
    return rows


def _change_text(result: Result) -> str:
    """The largest change against the snapshot, as the terminal table words it."""
    if result.breaches:
        breach = max(result.breaches, key=lambda b: b.value - b.limit)
        return f"{breach.figure} over budget by {format_bytes(breach.value - breach.limit)}"
    if result.snapshot is None:
        return "-"
    if result.stale:
        return f"stale: {stale_reason(result)}"
    change = result.largest_change()
    if change is None:
        return "0 B"
    return f"{change.figure} {format_delta(change.estimate, change.reference)}"


def check_view(
    result: Result,
    traced: Trace,
    *,
    root: str | os.PathLike[str] | None = None,
    buckets: int = BUCKETS,
    top: int = TOP_TENSORS,
) -> dict[str, Any]:
    """What the HTML report shows of one check on one device, as a JSON-ready dict.

    The chart's series: live bytes by category after each change of the
    trace's timeline (the baseline first, at ``x`` 0; then ``x`` is the event
    index plus one), replayed through the device's allocator so that each
    storage costs what the report's figures charge it. Deep models have
    millions of events: of the states in each of ``buckets`` equal slices of
    the events, the one at the highest total, the one at the lowest and the
    last are kept (:class:`Downsampler`), and the state at the overall peak
    always is, so a chart has at most ``3 * buckets + 1`` points. Each
    category is stored as its changes ``[point, bytes]`` only.

    Also: the ``top`` largest storages live at the peak (bytes charged, op,
    module, phase made, the user's frames with paths relative to ``root``,
    default the current directory), the figures against the snapshot and the
    budgets, the categories and modules that moved most, the ops not traced
    faithfully, and pytest's failure message when the check failed. Read from the
    trace: whether it stopped (``stopped``: the chart and figures are of the part of
    the step that ran) or went on past the ops it lists (``approximate``).
    """
    series, at_peak, boundaries = _series(traced, buckets)
    analysis = traced.analysis
    first = analysis.first_step
    peak_bytes = max(*analysis.phase_peaks, *(first or ()))
    peak_x = analysis.peak_event + 1
    peak_phase, peak_iteration = _phase_at(boundaries, peak_x)
    phases = []
    for n, (start, phase, iteration) in enumerate(boundaries):
        end = boundaries[n + 1][0] if n + 1 < len(boundaries) else series["span"]
        if end > start or phase >= 0:
            phases.append(
                {
                    "phase": _PHASE_NAMES.get(phase, str(phase)),
                    "start": start,
                    "end": end,
                    # a phase of a training loop's first step (the loop's figures are
                    # its later steps')
                    "first_step": first is not None and phase >= 0 and iteration == 1,
                }
            )
    estimate, snapshot = result.estimate, result.snapshot
    breakdown = [
        {
            "category": category.value,
            "estimate": estimate.breakdown.get(category.value, 0),
            "snapshot": None if snapshot is None else snapshot.breakdown.get(category.value, 0),
        }
        for category in _CATEGORIES
    ]
    modules: dict[str, list[dict[str, Any]]] = {}
    if snapshot is not None:
        for index, phase in enumerate(("forward", "backward")):
            modules[phase] = _moved(
                {n: p[index] for n, p in snapshot.modules.items() if n != ROOT_NAME},
                {n: p[index] for n, p in estimate.modules.items() if n != ROOT_NAME},
                TOP_MODULES,
            )
    unsupported = [
        {"op": entry.op, "reason": entry.reason, "location": _location(entry.location, root)}
        for entry in traced.report.unsupported
    ] or [{"op": op, "reason": "", "location": ""} for op in estimate.unsupported]
    # the engine's word: a trace that stopped has no figures; one that went on past
    # listed ops has approximate ones
    stopped = traced.stop is not None
    return {
        "schema": VIEW_SCHEMA,
        "nodeid": result.nodeid,
        "test": result.key.test,
        "name": result.key.name,
        "device": result.key.device,
        "status": result.status.value,
        "failed": result.failed,
        "acceptable": result.acceptable,
        "file": result.file,
        "accept": result.accept,
        "tolerance": str(result.tolerance),
        "change": _change_text(result),
        "message": failure_message([result]) if result.failed else "",
        "stale": [str(change) for change in result.stale],
        "environment": dict(estimate.environment),
        "figures": _figures(result),
        # a cuda check's room on the GPU it follows, then on each other GPU fits= names
        "rooms": [room.to_json() for room in result.rooms],
        "breakdown": breakdown,
        "modules": modules,
        "unsupported": unsupported,
        "stopped": stopped,
        "approximate": not stopped and not traced.report.complete,
        # The chart is read off the trace; a pytest_torchmem_adjust_report hook may
        # have changed the figures the check compared.
        "adjusted": peak_bytes != estimate.peak,
        "series": series,
        "phases": phases,
        "peak": {
            "x": peak_x,
            "bytes": peak_bytes,
            "phase": _PHASE_NAMES.get(peak_phase, ""),
            "first_step": first is not None and peak_phase >= 0 and peak_iteration == 1,
        },
        "phase_peaks": dict(zip(("forward", "backward", "step"), analysis.phase_peaks)),
        "first_step": None if first is None else dict(zip(("forward", "backward", "step"), first)),
        "tensors": _tensors(traced, at_peak, top, root),
        "alive": {"count": len(at_peak), "bytes": sum(at_peak.values())},
    }


def order(views: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Failing checks first, then by test, check name and device."""
    return sorted(views, key=lambda v: (not v["failed"], v["nodeid"], v["name"], v["device"]))


def write_report(
    path: str | os.PathLike[str],
    views: Sequence[Mapping[str, Any]],
    *,
    environment: Mapping[str, Any],
) -> None:
    """Write the page of ``views`` to ``path``: a temporary file beside it, then a rename,
    so that a reader never sees half a page. ``environment`` is shown in the header."""
    from pytest_torchmem.plugin.exports.html_page import render

    text = render(order(views), environment)
    # The snapshot files' writer: temporary file in the same folder, fsync, rename.
    atomic_write(Path(path), text)
