"""What a run reports: the terminal table, its totals line and the JSON report.

Results become lines and dicts here; the plugin only hands the lines to the
terminal reporter and the dict to a file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from tabulate import tabulate

from pytest_torchmem.engine.figures.modelled_device import is_cuda
from pytest_torchmem.engine.figures.units import format_bytes, format_delta
from pytest_torchmem.plugin.snapshots import Key, legacy_cpu
from pytest_torchmem.plugin.judging import Result, Status, release_change
from pytest_torchmem.plugin.messages import PER_TORCH_HINT, stale_reason

__all__ = [
    "Unused",
    "REPORT_SCHEMA",
    "totals",
    "totals_line",
    "table_lines",
    "unused_lines",
    "stale_lines",
    "json_report",
]

#: Version of the JSON report's layout.
REPORT_SCHEMA: Final = 1

#: The counts always shown in the totals line, in this order.
_ALWAYS: Final = ("passed", "regressed", "improved", "missing", "unused")
#: The counts shown only when not zero.
_SOMETIMES: Final = ("stopped", "over budget", "mismatch", "stale", "new", "updated", "not written")
#: What marks an approximate figure in the table (:attr:`Result.approximate`), and the
#: line under the table that says so.
APPROXIMATE: Final = "~"
_APPROXIMATE_LINE: Final = "~ approximate: the trace went on past ops it could not follow exactly"


@dataclass(frozen=True, order=True)
class Unused:
    """A snapshot entry that no test of the run used."""

    file: str
    key: Key

    def to_json(self) -> dict[str, str]:
        return {
            "file": self.file,
            "test": self.key.test,
            "name": self.key.name,
            "device": self.key.device,
        }


def totals(results: Sequence[Result], unused: Sequence[Unused]) -> dict[str, int]:
    """Checks by status (each test, check and device once), and the unused entries."""
    counts = Counter(result.status.value for result in results)
    found = {name: counts.get(name, 0) for name in (*_ALWAYS, *_SOMETIMES)}
    found["unused"] = len(unused)
    found["checks"] = len(results)
    found["failed"] = sum(result.failed for result in results)
    return found


def totals_line(counts: Mapping[str, int]) -> str:
    """``torchmem: 4 checks: 2 passed, 1 regressed, 0 improved, 1 missing, 0 unused``."""
    parts = [f"{counts[name]} {name}" for name in _ALWAYS]
    parts += [f"{counts[name]} {name}" for name in _SOMETIMES if counts.get(name)]
    checks = counts["checks"]
    return f"torchmem: {checks} check{'' if checks == 1 else 's'}: {', '.join(parts)}"


def _test_label(result: Result) -> str:
    name = result.key.name
    return result.nodeid if name == "default" else f"{result.nodeid} [{name}]"


def _change(result: Result) -> str:
    if result.snapshot is None or result.stopped is not None:
        return "-"
    if result.stale:  # the figures are not comparable: say why instead
        return stale_reason(result)
    change = result.largest_change()
    if change is None:
        return "0 B"
    return f"{change.figure} {format_delta(change.estimate, change.reference)}"


def _status(result: Result) -> str:
    if result.failed and result.status in (Status.IMPROVED, Status.STALE):  # asked to fail
        return f"{result.status} (failed)"
    if result.status is Status.NOT_WRITTEN and result.not_written:
        return f"{result.status} ({result.not_written})"
    return str(result.status)


def _device(result: Result, gpu: str | None) -> str:
    """``cuda``, or ``cuda (A100)`` for a check that followed another GPU profile than
    the run's (``gpu``: the header names that one)."""
    device = result.key.device
    followed = result.estimate.environment.get("gpu")
    if is_cuda(device) and followed is not None and followed != gpu:
        return f"{device} ({followed})"
    return device


def table_lines(
    results: Sequence[Result],
    *,
    verbosity: int = 0,
    gpu: str | None = None,
    leaks: Mapping[tuple[str, str, str], Any] | None = None,
) -> list[str]:
    """A row per test, check and device: the peaks, the largest change, the status.

    A ``first step`` column (the first step's peak, beside a training loop's phases)
    appears when a check of a training loop is among the rows, a ``reserved`` column
    (the caching allocator's segments) and a ``headroom`` column (the GPU's usable
    memory less the reserved peak: negative where the step does not fit) when a
    ``cuda`` check is. A ``cuda`` row of a
    check that followed another GPU profile than the run's (``gpu``, the name the
    header gives) names it: ``cuda (A100)``. Under ``-q`` (``verbosity < 0``) only
    the rows that are not plain passes. A ``leak / iter`` column (what more is held after
    every iteration) appears when a leak check was made (``leaks``: its
    :class:`~pytest_torchmem.plugin.leaking.LeakRecord` by node id, entry name and
    device). A check whose trace stopped has no figures
    (``-``); an approximate one's are marked ``~``, and a line under the table says
    what that means.
    """
    shown = [result for result in results if not (verbosity < 0 and result.status is Status.PASSED)]
    if not shown:
        return []
    figured = [result for result in shown if result.stopped is None]
    reserved = any(result.estimate.reserved_peak is not None for result in figured)
    looped = any(result.estimate.first_step is not None for result in figured)
    leaks = leaks or {}
    leaked = any((result.nodeid, result.key.name, result.key.device) in leaks for result in shown)
    rows = []
    for result in shown:
        estimate = result.estimate
        mark = APPROXIMATE if result.approximate else ""

        def nbytes(value: int | None) -> str:
            return "-" if value is None or result.stopped is not None else mark + format_bytes(value)

        row = [
            _test_label(result),
            _device(result, gpu),
            nbytes(estimate.forward_peak),
            nbytes(estimate.backward_peak),
            nbytes(estimate.step_peak),
        ]
        if looped:
            first = estimate.first_step
            row.append(nbytes(None if first is None else max(first)))
        row.append(nbytes(estimate.peak))
        if reserved:
            row.append(nbytes(estimate.reserved_peak))
            row.append(nbytes(result.rooms[0].headroom if result.rooms else None))
        if leaked:
            record = leaks.get((result.nodeid, result.key.name, result.key.device))
            row.append("-" if record is None else format_bytes(record.per_iteration))
        rows.append((*row, _change(result), _status(result)))
    headers = ["test", "device", "forward", "backward", "step"]
    headers += ["first step"] if looped else []
    headers += ["peak"]
    headers += ["reserved", "headroom"] if reserved else []
    headers += ["leak / iter"] if leaked else []
    headers += ["change", "status"]
    lines = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True).splitlines()
    if any(result.approximate for result in shown):
        lines.append(_APPROXIMATE_LINE)
    return lines


#: Why an unused entry was not removed, by why its file was not written.
_NOT_REMOVED: Final = {
    "interrupted": "the run was interrupted",
    "interrupted while writing": "the run was interrupted while writing",
    "could not write": "its file could not be written",
}


def _entries(count: int) -> str:
    return f"{count} unused snapshot entr{'y' if count == 1 else 'ies'}"


def unused_lines(
    unused: Sequence[Unused],
    *,
    mode: str,
    update: bool,
    not_written: Mapping[str, str] | None = None,
) -> list[str]:
    """The unused entries, and what happens to them; ``not_written``: the files an update
    did not write (as shown), and why (``Result.not_written``): their entries stay."""
    if not unused:
        return []
    lines = [f"unused: {entry.file}: {entry.key}" for entry in unused]
    if update:
        not_written = not_written or {}
        removed = sum(entry.file not in not_written for entry in unused)
        if removed:
            lines.append(f"removed {_entries(removed)}")
        kept = Counter(not_written[entry.file] for entry in unused if entry.file in not_written)
        lines += [
            f"{_entries(count)} not removed: {_NOT_REMOVED.get(why, why)}"
            for why, count in sorted(kept.items())
        ]
    else:
        verdict = "fail this run" if mode == "fail" else "are reported (--torchmem-unused=warn)"
        lines.append(
            f"{len(unused)} unused snapshot entr{'y' if len(unused) == 1 else 'ies'} {verdict}: "
            "remove them by rerunning these tests with --torchmem-update"
        )
    return lines


def stale_lines(results: Sequence[Result], *, mode: str) -> list[str]:
    """The checks whose snapshot entry was recorded in another environment or with other
    step settings (``keep_output``), and how to fix it."""
    lines = [
        f"stale: {_test_label(result)} on {result.key.device}: snapshot step settings differ "
        f"({stale_reason(result)}); re-record with: {result.accept}"
        for result in results
        if result.step_changed
    ]
    if lines:
        one = len(lines) == 1
        lines.append(
            f"{len(lines)} check{'' if one else 's'} failed: {'its' if one else 'their'} "
            f"snapshot entr{'y was' if one else 'ies were'} recorded with other step settings"
        )
    stale = [result for result in results if result.stale and not result.step_changed]
    if not stale:
        return lines
    lines += [
        f"stale: {_test_label(result)} on {result.key.device}: snapshot environment differs "
        f"({stale_reason(result)}); re-record on this machine with: {result.accept}"
        for result in stale
    ]
    one = len(stale) == 1
    count = f"{len(stale)} stale check{'' if one else 's'}"
    whose = "its snapshot entry was" if one else "their snapshot entries were"
    if mode == "fail":
        verdict = f"failed: {whose} recorded in another environment (--torchmem-stale=fail)"
    else:
        verdict = (
            f"{'was' if one else 'were'} not compared: {whose} recorded in another environment "
            "(--torchmem-stale=warn; budgets still apply)"
        )
    lines.append(f"{count} {verdict}")
    releases = [
        change
        for change in (release_change(result.stale) for result in stale if result.release is None)
        if change is not None
    ]
    if releases:
        made = ", ".join(str(then) for then in sorted({then for then, _ in releases}))
        one = len(releases) == 1
        lines.append(
            f"{len(releases)} stale snapshot entr{'y was' if one else 'ies were'} made on torch "
            f"{made}, and this is torch {releases[0][1]}; {PER_TORCH_HINT}"
        )
    legacy = sum(
        any(change.name == "cpu" and legacy_cpu(change.snapshot) for change in result.stale)
        for result in stale
    )
    if legacy:
        lines.append(
            f"{legacy} cpu snapshot entr{'y was' if legacy == 1 else 'ies were'} recorded by "
            "pytest-torchmem 0.1 for the CPU of the machine that recorded them; cpu entries are "
            "now estimated for a CPU profile (--torchmem-cpu, default avx2:4) and then compare on "
            "any machine: re-record them once with pytest --torchmem-update"
        )
    return lines


def _figures(entry: Any) -> dict[str, int | None]:
    return {
        "forward": entry.forward_peak,
        "backward": entry.backward_peak,
        "step": entry.step_peak,
        "first_step": None if entry.first_step is None else max(entry.first_step),
        "peak": entry.peak,
        "reserved": entry.reserved_peak,
    }


def _result_json(result: Result) -> dict[str, Any]:
    # a stopped trace has no figures (its partial ones are not an estimate)
    estimate = None if result.stopped is not None else _figures(result.estimate)
    snapshot = None if result.snapshot is None else _figures(result.snapshot)
    delta = None
    if snapshot is not None and estimate is not None:
        delta = {
            name: value - snapshot[name]
            for name, value in estimate.items()
            if value is not None and snapshot.get(name) is not None
        }
    return {
        "nodeid": result.nodeid,
        "test": result.key.test,
        "name": result.key.name,
        "device": result.key.device,
        "status": result.status.value,
        "failed": result.failed,
        # the figures are approximate: the trace went on past the ops in "unsupported"
        "approximate": result.approximate,
        # where and why the trace stopped (status "stopped": "estimate" is null), else null
        "stopped": result.stopped,
        "snapshot_file": result.file,
        # The torch release whose snapshot directory holds the entry (torchmem_per_torch).
        "torch_release": result.release,
        "estimate": estimate,
        "snapshot": snapshot,
        "delta": delta,
        "stale": {change.name: [change.snapshot, change.current] for change in result.stale},
        "tolerance": {"rtol": result.tolerance.rtol, "atol": result.tolerance.atol},
        "allowed": {change.figure: change.allowed for change in result.changes},
        "budgets": dict(result.budgets),
        # the first step's three phases, where the check is of a training loop
        "first_step": None if estimate is None else result.estimate.to_json().get("first_step"),
        "breakdown": {} if estimate is None else dict(result.estimate.breakdown),
        "modules": {
            name: {"forward": fwd, "backward": bwd}
            for name, (fwd, bwd) in (() if estimate is None else result.estimate.modules.items())
        },
        "measured": None if result.estimate.measured is None else dict(result.estimate.measured),
        "unsupported": list(result.estimate.unsupported),
        "environment": dict(result.estimate.environment),
        "accept": result.accept,
        # why an entry to be written was not (status "not written"), else None
        "not_written": result.not_written,
        # a cuda check's room on the GPU it follows, then on each other GPU fits= names
        "rooms": [room.to_json() for room in result.rooms],
    }


def json_report(
    results: Sequence[Result],
    unused: Sequence[Unused],
    *,
    environment: Mapping[str, Any],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """The run as one JSON-ready dict: environment, settings, results, unused, totals."""
    return {
        "schema": REPORT_SCHEMA,
        "environment": dict(environment),
        "settings": dict(settings),
        "results": [_result_json(result) for result in results],
        "unused": [entry.to_json() for entry in unused],
        "totals": totals(results, unused),
    }
