"""What ``python -m pytest_torchmem`` prints: saved entries and their diff as tables,
Markdown (for a pull request comment) or JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from tabulate import tabulate

from pytest_torchmem.cli.diffing import ADDED, REMOVED, FailOn, Gate, Row, diff_totals
from pytest_torchmem.cli.saved import Loaded, Saved
from pytest_torchmem.engine.figures.units import format_bytes, format_delta
from pytest_torchmem.plugin.snapshots import Entry
from pytest_torchmem.plugin.judging import FIGURES, Status, figures_of
from pytest_torchmem.plugin.messages import change_line, moved_lines

__all__ = [
    "OUTPUT_SCHEMA",
    "SORT_KEYS",
    "Style",
    "diff_json",
    "diff_text",
    "environment_summary",
    "show_json",
    "show_text",
    "sort_entries",
]

#: Version of the ``--format json`` output of ``show`` and ``diff``.
OUTPUT_SCHEMA: Final = 1
#: What ``show --sort`` takes: the test, or a figure (largest first).
SORT_KEYS: Final = ("test", *FIGURES)
#: Environment facts, in the order ``show`` summarises them.
_ENV_ORDER: Final = (
    "torch",
    "gpu",
    "gpu_memory",
    "gpu_cc",
    "gpu_sms",
    "gpu_threads_per_sm",
    "gpu_shared_per_block",
    "cpu",
    "cpu_threads",
    "cpu_isa",
    "cuda_alloc_conf",
)
#: The properties an entry made with a GPU profile of the user's own records.
_GPU_PROPERTIES: Final = frozenset(name for name in _ENV_ORDER if name.startswith("gpu_"))
#: ``diff`` exits with this when an entry fails (the command line's ``EXIT_FAILED``).
_EXIT_FAILED: Final = 1


# -- formatting --------------------------------------------------------------------------


@dataclass(frozen=True)
class Style:
    """How text output is marked up: a terminal table, or Markdown for a pull request."""

    markdown: bool
    exact: bool

    @property
    def tablefmt(self) -> str:
        return "pipe" if self.markdown else "simple"

    def size(self, nbytes: int | None) -> str:
        if nbytes is None:
            return "-"
        return str(nbytes) if self.exact else format_bytes(nbytes)

    def delta(self, new: int, old: int) -> str:
        return format_delta(new, old, exact=self.exact)

    def cell(self, text: str) -> str:
        return text.replace("|", "\\|") if self.markdown else text

    def code(self, text: str) -> str:
        return f"`{text}`" if self.markdown else text

    def heading(self, text: str) -> str:
        return f"#### {text}" if self.markdown else text

    def item(self, text: str) -> str:
        return f"- {text}" if self.markdown else text

    def table(self, headers: Sequence[str], rows: list[list[str]], right: Sequence[int]) -> str:
        align = ["right" if index in right else "left" for index in range(len(headers))]
        cells = [[self.cell(cell) for cell in row] for row in rows]
        return tabulate(
            cells,
            headers=list(headers),
            tablefmt=self.tablefmt,
            disable_numparse=True,
            colalign=align,
        )


def environment_summary(environment: Mapping[str, Any]) -> str:
    """``torch 2.13.0+cpu, cpu avx2:4`` or ``torch 2.13.0+cpu, H100`` (a GPU profile of the
    ini table: ``RTX4070TiS (memory=16GiB cc=8.9 sms=66 ...)``; files of version 0.1:
    ``torch 2.13.0+cpu, 2 threads, AVX512``)."""
    names = sorted(environment, key=lambda n: (_ENV_ORDER.index(n) if n in _ENV_ORDER else 99, n))
    # a GPU profile of the user's own: its properties beside its name
    properties = [f"{name[4:]}={environment[name]}" for name in names if name in _GPU_PROPERTIES]
    parts = []
    for name in names:
        value = environment[name]
        if name == "torch":
            parts.append(f"torch {value}")
        elif name == "gpu" and properties:
            parts.append(f"{value} ({' '.join(properties)})")
        elif name in _GPU_PROPERTIES:
            continue
        elif name in ("gpu", "cpu_isa", "figures"):
            parts.append(str(value))
        elif name == "cpu_threads":
            parts.append(f"{value} thread{'' if value == 1 else 's'}")
        elif name == "cuda_alloc_conf":
            parts.append(f"PYTORCH_CUDA_ALLOC_CONF={value}")
        else:
            parts.append(f"{name} {value}")
    return ", ".join(parts) or "-"


def _figures_json(entry: Entry) -> dict[str, int | None]:
    figures: dict[str, int | None] = {"first_step": None, "reserved": None}
    figures.update(figures_of(entry))
    return {name: figures[name] for name in FIGURES}


def _saved_json(saved: Saved) -> dict[str, Any]:
    entry = saved.entry
    return {
        "module": saved.module,
        "test": saved.key.test,
        "name": saved.key.name,
        "device": saved.key.device,
        "release": saved.release or None,
        "file": saved.file,
        "status": saved.status,
        "figures": _figures_json(entry),
        "breakdown": dict(entry.breakdown),
        "modules": {n: {"forward": f, "backward": b} for n, (f, b) in entry.modules.items()},
        "environment": dict(entry.environment),
        "unsupported": list(entry.unsupported),
        "measured": None if entry.measured is None else dict(entry.measured),
    }


def _where(saved: Saved, style: Style) -> str:
    """``tests/test_m.py::test_a [default] on cpu`` (``(torch 2.13)`` after the test where
    the entry is in a per-release directory)."""
    release = f" (torch {saved.release})" if saved.release else ""
    return f"{style.code(saved.label)}{release} [{saved.key.name}] on {saved.key.device}"


def _input_json(loaded: Loaded) -> dict[str, Any]:
    return {"path": loaded.path, "kind": loaded.kind, "files": list(loaded.files)}


# -- show --------------------------------------------------------------------------------


def sort_entries(entries: list[Saved], by: str) -> list[Saved]:
    """By test (module, test, name, device), or by the figure ``by``, largest first."""
    if by == "test":
        return sorted(entries)
    # Largest first; an entry without the figure (reserved on cpu) last.
    return sorted(entries, key=lambda s: (-figures_of(s.entry).get(by, -1), s))


def show_text(loaded: Sequence[Loaded], entries: Sequence[Sequence[Saved]], style: Style) -> str:
    """A table per input: its ``entries`` (those that pass the filters), a row each."""
    blocks: list[str] = []
    for one, shown in zip(loaded, entries, strict=True):
        lines = [style.heading(one.describe(len(shown)))]
        if not shown:
            lines.append("no entries")
            blocks.append("\n".join(lines))
            continue
        reserved = any(s.entry.reserved_peak is not None for s in shown)
        looped = any(s.entry.first_step is not None for s in shown)
        status = any(s.status is not None for s in shown)
        headers = ["test", "name", "device", "forward", "backward", "step"]
        headers += ["first step"] * looped + ["peak"]
        headers += ["reserved"] * reserved + ["status"] * status + ["environment"]
        rows = []
        for saved in shown:
            entry = saved.entry
            row = [saved.title, saved.key.name, saved.key.device]
            row += [style.size(entry.forward_peak), style.size(entry.backward_peak)]
            row += [style.size(entry.step_peak)]
            first = None if entry.first_step is None else max(entry.first_step)
            row += [style.size(first)] * looped
            row += [style.size(entry.peak)]
            row += [style.size(entry.reserved_peak)] * reserved
            row += [saved.status or "-"] * status
            rows.append([*row, environment_summary(entry.environment)])
        lines += ["", style.table(headers, rows, right=range(3, 7 + looped + reserved))]
        incomplete = [s for s in shown if s.entry.unsupported]
        if incomplete:
            lines.append("")
        for saved in incomplete:
            ops = ", ".join(style.code(op) for op in saved.entry.unsupported)
            lines.append(
                style.item(
                    f"incomplete estimate: {_where(saved, style)}: these ops were not traced "
                    f"faithfully: {ops}"
                )
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def show_json(loaded: Sequence[Loaded], entries: Sequence[Sequence[Saved]]) -> dict[str, Any]:
    """Every input with its entries: figures, breakdown, modules, environment."""
    return {
        "schema": OUTPUT_SCHEMA,
        "inputs": [
            {**_input_json(one), "entries": [_saved_json(saved) for saved in shown]}
            for one, shown in zip(loaded, entries, strict=True)
        ],
    }


# -- diff output -------------------------------------------------------------------------


def _row_verdict(row: Row, figure: str) -> str:
    if row.status == Status.STALE.value:
        return "stale: not compared"
    change = next((c for c in row.changes if c.figure == figure), None)
    if change is None:
        return "not gated"
    if change.moved == "grew":
        return "regressed"
    if change.moved == "shrank":
        return "improved"
    return "within limit"


def _change_table(rows: Sequence[Row], style: Style) -> str | None:
    table: list[list[str]] = []
    for row in rows:
        if row.old is None or row.new is None:
            continue
        before, after = figures_of(row.old.entry), figures_of(row.new.entry)
        allowed = {change.figure: change.allowed for change in row.changes}
        for figure, value in after.items():
            if figure not in before or value == before[figure]:
                continue
            if figure == "peak" and figure not in allowed:
                continue  # the largest of the phases above, unless a rule gates it
            limit = None if row.stale else allowed.get(figure)
            table.append(
                [
                    row.saved.title,
                    row.key.name,
                    row.key.device,
                    figure.replace("_", " "),
                    style.size(before[figure]),
                    style.size(value),
                    style.delta(value, before[figure]),
                    "-" if limit is None else f"\u00b1{style.size(limit)}",
                    _row_verdict(row, figure),
                ]
            )
    if not table:
        return None
    headers = ["test", "name", "device", "phase", "old", "new", "change", "limit", "verdict"]
    return style.table(headers, table, right=(4, 5, 6, 7))


def _allowance(rule: FailOn | None) -> str:
    return "no --fail-on: no tolerance" if rule is None else f"--fail-on {rule}"


def _details(row: Row, style: Style) -> list[str]:
    """Why an entry moved: the plugin's change lines, categories and modules."""
    assert row.old is not None and row.new is not None
    moved = [change for change in row.changes if change.moved]
    lines = [
        change_line(change, row.key.device, _allowance(row.rules[change.figure]), ("new", "old"))
        for change in moved
    ]
    phases = [c.figure for c in moved if c.figure in ("forward", "backward")][:1]
    if not row.old.entry.modules or not row.new.entry.modules:
        phases = []  # a report written before reports held module figures
    lines += [line.strip() for line in moved_lines(row.old.entry, row.new.entry, phases)]
    header = f"{_where(row.saved, style)}: {row.status}"
    if row.failed:
        header += " (fails)"
    if style.markdown:
        return [f"- {header}", *(f"  - {line}" for line in lines)]
    return [header, *(f"  {line}" for line in lines)]


def _one_sided(row: Row, style: Style) -> str:
    saved = row.saved
    text = f"{_where(saved, style)}: peak {style.size(saved.entry.peak)} ({saved.file})"
    return style.item(text + (" (fails: --fail-on-missing)" if row.failed else ""))


def _totals_line(totals: Mapping[str, int]) -> str:
    parts = ", ".join(
        f"{totals[name]} {name}" for name in totals if name not in ("entries", "failed")
    )
    count = totals["entries"]
    return f"torchmem diff: {count} entr{'y' if count == 1 else 'ies'}: {parts}"


def _outcome(rows: Sequence[Row], gate: Gate) -> str:
    if not gate.active:
        return "report only: no --fail-on given, exit 0 (gate with e.g. --fail-on any:0)"
    failed = sum(row.failed for row in rows)
    said = [str(rule) for rule in gate.rules]
    said += ["--fail-on-missing"] * gate.missing + ["--fail-on-improvement"] * gate.improvement
    said += ["--fail-on-stale"] * gate.stale
    if not failed:
        return f"passed: no entry fails {', '.join(said)}"
    return (
        f"failed: {failed} entr{'y fails' if failed == 1 else 'ies fail'} {', '.join(said)} "
        f"(exit {_EXIT_FAILED})"
    )


def diff_text(old: Loaded, new: Loaded, rows: Sequence[Row], gate: Gate, style: Style) -> str:
    """The changed figures, why each entry moved, the one-sided and stale entries, totals."""
    lines = [style.heading(f"OLD {old.describe()} -> NEW {new.describe()}")]
    table = _change_table(rows, style)
    lines += ["", table if table is not None else "no figure changed"]
    moved = [r for r in rows if r.status in (Status.REGRESSED.value, Status.IMPROVED.value)]
    if moved:
        lines.append("")
        for row in moved:
            lines += _details(row, style)
    for status, title in ((REMOVED, "only in OLD"), (ADDED, "only in NEW")):
        alone = [row for row in rows if row.status == status]
        if alone:
            lines += ["", f"{title} ({status}):", *(_one_sided(row, style) for row in alone)]
    stale = [row for row in rows if row.stale]
    if stale:
        lines += ["", "stale (recorded in another environment: figures not compared):"]
        for row in stale:
            reason = ", ".join(map(str, row.stale))
            fails = " (fails: --fail-on-stale)" if row.failed else ""
            lines.append(style.item(f"{_where(row.saved, style)}: {reason}{fails}"))
    totals = _totals_line(diff_totals(rows))
    outcome = _outcome(rows, gate)
    if style.markdown:
        totals, outcome = f"**{totals}**", f"**{outcome}**"
    lines += ["", totals, outcome]
    return "\n".join(lines)


def diff_json(old: Loaded, new: Loaded, rows: Sequence[Row], gate: Gate) -> dict[str, Any]:
    """Every entry (changed or not) with its figures, changes and verdict; totals; exit code."""
    entries = []
    for row in rows:
        before = None if row.old is None else row.old.entry
        after = None if row.new is None else row.new.entry
        changes: dict[str, Any] = {}
        if before is not None and after is not None:
            gated = {change.figure: change for change in row.changes}
            old_figures = figures_of(before)
            for figure, value in figures_of(after).items():
                if figure not in old_figures:
                    continue
                reference, change = old_figures[figure], gated.get(figure)
                changes[figure] = {
                    "old": reference,
                    "new": value,
                    "delta": value - reference,
                    "ratio": None if not reference else (value - reference) / reference,
                    "allowed": None if change is None else change.allowed,
                    "rule": None if row.rules.get(figure) is None else str(row.rules[figure]),
                    "moved": None if change is None or row.stale else change.moved,
                }
        entries.append(
            {
                "module": row.saved.module,
                "release": row.saved.release or None,
                "test": row.key.test,
                "name": row.key.name,
                "device": row.key.device,
                "status": row.status,
                "failed": row.failed,
                "old_file": None if row.old is None else row.old.file,
                "new_file": None if row.new is None else row.new.file,
                "old": None if before is None else _figures_json(before),
                "new": None if after is None else _figures_json(after),
                "changes": changes,
                "categories": {} if before is None or after is None else _moved(before, after),
                "stale": {change.name: [change.snapshot, change.current] for change in row.stale},
            }
        )
    failed = any(row.failed for row in rows)
    return {
        "schema": OUTPUT_SCHEMA,
        "old": _input_json(old),
        "new": _input_json(new),
        "fail_on": [str(rule) for rule in gate.rules],
        "fail_on_missing": gate.missing,
        "fail_on_improvement": gate.improvement,
        "fail_on_stale": gate.stale,
        "entries": entries,
        "totals": diff_totals(rows),
        "failed": failed,
        "exit_code": _EXIT_FAILED if failed else 0,
    }


def _moved(before: Entry, after: Entry) -> dict[str, int]:
    """Category -> bytes moved at the peak (those that moved)."""
    names = sorted(set(before.breakdown) | set(after.breakdown))
    deltas = {name: after.breakdown.get(name, 0) - before.breakdown.get(name, 0) for name in names}
    return {name: delta for name, delta in deltas.items() if delta}
