"""Two saved results compared: the ``--fail-on`` rules and the verdict of each entry.

Each pair of entries (OLD, NEW) is judged by the plugin's own comparison
(:func:`~pytest_torchmem.plugin.judging.compare` and :func:`~pytest_torchmem.plugin.judging.compared`),
with the allowance of each figure taken from the ``--fail-on`` rules.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Final

from pytest_torchmem.cli.saved import Saved
from pytest_torchmem.engine.figures.units import parse_bytes
from pytest_torchmem.plugin.snapshots import Key
from pytest_torchmem.plugin.judging import (
    FIGURES,
    Change,
    EnvChange,
    Status,
    Tolerance,
    compare,
    compared,
    environment_changes,
)

__all__ = [
    "ADDED",
    "PHASE_ALIASES",
    "REMOVED",
    "FailOn",
    "FailOnError",
    "Gate",
    "Row",
    "diff_rows",
    "diff_totals",
    "parse_fail_on",
]

#: ``--fail-on`` phase names -> the figures they cover.
PHASE_ALIASES: Final[Mapping[str, tuple[str, ...]]] = {
    "fwd": ("forward",),
    "forward": ("forward",),
    "bwd": ("backward",),
    "backward": ("backward",),
    "step": ("step",),
    "first": ("first_step",),
    "first_step": ("first_step",),
    "peak": ("peak",),
    "reserved": ("reserved",),
    "any": FIGURES,
}
#: The status of an entry only in OLD, and of one only in NEW.
REMOVED: Final = "removed"
ADDED: Final = "added"
_FAIL_ON_FORM: Final = (
    "expected PHASE:LIMIT, e.g. bwd:5% or fwd:10MiB, where PHASE is fwd, bwd, step, first "
    "(a training loop's first step), peak, reserved or any (also forward, backward, "
    "first_step) and LIMIT a percentage of the OLD figure "
    "(5%) or a byte size (10MiB, 1.5 GB, 0)"
)
_NUMBER: Final = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_PERCENT: Final = re.compile(rf"^{_NUMBER}\s*%$")
_BARE: Final = re.compile(rf"^{_NUMBER}$")
#: The figures the plugin compares with a snapshot (peak is the largest of the phases).
_PLUGIN_FIGURES: Final = ("forward", "backward", "step", "first_step", "reserved")


# -- --fail-on ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FailOn:
    """One ``--fail-on`` rule: the figures it gates and how far they may move."""

    #: As written on the command line (``bwd:5%``).
    text: str
    figures: tuple[str, ...]
    tolerance: Tolerance

    def __str__(self) -> str:
        return self.text


class FailOnError(ValueError):
    """A malformed ``--fail-on`` value."""


def parse_fail_on(value: str) -> list[FailOn]:
    """The rules of one ``--fail-on`` value: ``PHASE:LIMIT``, several separated by commas.

    LIMIT is a percentage of the OLD figure (``bwd:5%``: backward may grow by
    5 %) or a byte size with its unit (``fwd:10MiB``; ``step:0``: not a byte;
    a bare ``5`` is refused as ambiguous). Raises
    :class:`FailOnError` naming the bad part and the expected form.
    """
    rules: list[FailOn] = []
    for part in value.split(","):
        text = part.strip()
        phase, colon, limit = text.partition(":")
        phase, limit = phase.strip().lower(), limit.strip()
        if not colon or not phase or not limit:
            raise FailOnError(f"{text!r}: {_FAIL_ON_FORM}")
        figures = PHASE_ALIASES.get(phase)
        if figures is None:
            raise FailOnError(f"{text!r}: unknown phase {phase!r}; {_FAIL_ON_FORM}")
        percent = _PERCENT.match(limit)
        if percent is not None:
            tolerance = Tolerance(rtol=float(Decimal(percent.group(1)) / 100))
        elif limit.endswith("%"):
            raise FailOnError(f"{text!r}: cannot read {limit!r}; {_FAIL_ON_FORM}")
        elif _BARE.match(limit) and Decimal(limit) != 0:
            raise FailOnError(
                f"{text!r}: a bare number is ambiguous; write {limit}% (of the OLD figure) or "
                f"{limit}B (bytes)"
            )
        else:
            try:
                tolerance = Tolerance(atol=parse_bytes(limit))
            except ValueError as exc:
                raise FailOnError(f"{text!r}: {exc}; {_FAIL_ON_FORM}") from None
        rules.append(FailOn(f"{phase}:{limit}", figures, tolerance))
    return rules


@dataclass(frozen=True)
class Gate:
    """What ``diff`` fails on."""

    rules: tuple[FailOn, ...] = ()
    missing: bool = False
    improvement: bool = False
    stale: bool = False

    @property
    def active(self) -> bool:
        """Whether anything can fail (else ``diff`` only reports)."""
        return bool(self.rules or self.missing or self.stale)

    def limit(self, figure: str, reference: int) -> tuple[int, FailOn | None] | None:
        """The bytes ``figure`` may move from ``reference``, and the rule that says so.

        Without any ``--fail-on`` rule the figures the plugin compares are
        judged with no tolerance, as the plugin's defaults do (but nothing
        fails); with rules, only the figures they name, each by the strictest.
        """
        if not self.rules:
            return (0, None) if figure in _PLUGIN_FIGURES else None
        limits = [
            (rule.tolerance.allowed(reference), rule)
            for rule in self.rules
            if figure in rule.figures
        ]
        return min(limits, key=lambda limit: limit[0]) if limits else None


# -- diff --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One entry of a diff: its two sides, what moved, the verdict."""

    old: Saved | None
    new: Saved | None
    status: str
    failed: bool
    changes: tuple[Change, ...] = ()
    #: Figure -> the rule its allowance comes from (None: no rule, no tolerance).
    rules: Mapping[str, FailOn | None] = field(default_factory=dict)
    stale: tuple[EnvChange, ...] = ()

    @property
    def saved(self) -> Saved:
        side = self.new or self.old
        assert side is not None
        return side

    @property
    def key(self) -> Key:
        return self.saved.key


def diff_rows(pairs: Sequence[tuple[Saved | None, Saved | None]], gate: Gate) -> list[Row]:
    """The verdict of each pair of entries (OLD, NEW) under ``gate``."""
    rows: list[Row] = []
    for old, new in pairs:
        if old is None or new is None:
            status = REMOVED if new is None else ADDED
            rows.append(Row(old, new, status, gate.missing))
        else:
            rows.append(_judge(old, new, gate))
    return rows


def _judge(old: Saved, new: Saved, gate: Gate) -> Row:
    rules: dict[str, FailOn | None] = {}

    def allowed(figure: str, reference: int) -> int | None:
        limit = gate.limit(figure, reference)
        if limit is None:
            return None
        rules[figure] = limit[1]
        return limit[0]

    changes = compare(new.entry, old.entry, allowed)
    stale = environment_changes(old.entry, new.entry)
    verdict, failed = compared(
        changes, stale, fail_on_improvement=gate.improvement, fail_on_stale=gate.stale
    )
    # Without a rule nothing gates the figures: the verdict is a report.
    failed = failed and (bool(gate.rules) or verdict is Status.STALE)
    return Row(old, new, verdict.value, failed, changes, rules, stale)


def diff_totals(rows: Sequence[Row]) -> dict[str, int]:
    """Entries by status, how many in all, and how many fail."""
    counts = Counter(row.status for row in rows)
    names = ("passed", "regressed", "improved", "stale", REMOVED, ADDED)
    totals = {name: counts.get(name, 0) for name in names}
    totals["entries"] = len(rows)
    totals["failed"] = sum(row.failed for row in rows)
    return totals
