"""The words of a verdict: the failure message of a check, and the lines that say what moved.

The verdicts are :mod:`~pytest_torchmem.plugin.judging`'s; this module only
writes them, for the failing test, the summary, the HTML report and the command line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from pytest_torchmem.engine.figures.report import ROOT_NAME
from pytest_torchmem.engine.figures.units import format_bytes, format_delta
from pytest_torchmem.plugin.judging import (
    Change,
    Mismatch,
    Result,
    Tolerance,
    release_change,
)
from pytest_torchmem.plugin.snapshots import Entry

__all__ = [
    "PER_TORCH_HINT",
    "figure_name",
    "change_line",
    "moved_lines",
    "stale_reason",
    "failure_message",
]

#: What a suite run on several torch releases can do (said where an entry of another
#: release was met).
PER_TORCH_HINT: Final = (
    "a suite run on several torch releases can keep one snapshot directory per release: "
    "torchmem_per_torch = true (--torchmem-per-torch)"
)


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
    if result.stopped is not None:  # no figures: nothing else to say
        return [f"{device}: {result.stopped}"]
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
            lines.append(f"  approximate: the trace went on past ops it could not follow exactly: {ops}")
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
            if result.stopped is not None:
                continue
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
    if any(result.stopped is not None for result in failed):
        lines.append(
            "a trace that stops is no estimate: its figures were not compared with the snapshot, "
            "and --torchmem-update writes no entry for it"
        )
    if any(result.mismatches for result in failed):
        lines.append(
            "estimate and GPU measurement disagree: fix the device model, or widen "
            "--torchmem-measure-rtol"
        )
    return "\n".join(lines)
