"""``python -m pytest_torchmem``: show saved results, diff two of them for CI, and
find what fits.

``show`` prints snapshot files, directories of them or ``--torchmem-json``
reports as tables; ``diff`` compares two of them entry by entry with the
plugin's own comparison, and exits 1 when a change goes beyond a
``--fail-on`` limit. Nothing of these imports torch or pytest: they start fast.
``fit``, ``rank`` and ``ranks`` (:mod:`pytest_torchmem.cli.fitting`) estimate steps, and
import torch when they run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Final, TextIO

from pytest_torchmem import __version__
from pytest_torchmem.cli.diffing import FailOn, FailOnError, Gate, diff_rows, parse_fail_on
from pytest_torchmem.cli.fitting import FactoryError, add_commands, fit_command, rank_command, ranks_command
from pytest_torchmem.cli.listing import (
    SORT_KEYS,
    Style,
    diff_json,
    diff_text,
    show_json,
    show_text,
    sort_entries,
)
from pytest_torchmem.cli.saved import InputError, Saved, load, match

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "PROG", "build_parser", "main"]

#: Nothing failed.
EXIT_OK: Final = 0
#: ``diff``: a change beyond a ``--fail-on`` limit (or an ``--fail-on-*`` opt-in).
EXIT_FAILED: Final = 1
#: A malformed command line, or an input that cannot be read (argparse's own code).
EXIT_USAGE: Final = 2

PROG: Final = "python -m pytest_torchmem"


class UsageError(Exception):
    """Options that do not go together."""


def _fail_on_argument(value: str) -> list[FailOn]:
    try:
        return parse_fail_on(value)
    except FailOnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- the command line --------------------------------------------------------------------

_EXIT_CODES: Final = f"""\
exit codes:
  {EXIT_OK}  success; for diff: no entry fails (always so without --fail-on and --fail-on-*)
  {EXIT_FAILED}  diff: an entry fails a --fail-on limit, --fail-on-missing, -improvement or -stale
  {EXIT_USAGE}  a malformed command line, or an input that cannot be read"""

_MAIN_HELP: Final = f"""\
Show saved pytest-torchmem results, or compare two of them and gate CI on the change;
find the largest size whose step fits a GPU, rank GPUs by the room a step leaves,
and list every distinct rank of a parallel run, the worst first.

An input is a snapshot file (tests/__torchmem__/test_x.json), a directory (all
the snapshot files under it, those of per-release directories such as
__torchmem__/torch-2.13/ too: tests/, or a __torchmem__ directory), or a JSON
report written by `pytest --torchmem-json PATH`. Files are told apart by their
content. An entry of a per-release directory is shown with its release, and
pairs with the same release's entry where an input holds several releases.
show and diff do not import torch.

examples:
  {PROG} show tests/
  {PROG} diff base-report.json report.json --fail-on bwd:5%
  {PROG} fit train.py:factory --gpu A100-40GB --name batch
  {PROG} ranks train.py:factory --size 8 --gpu H100

{_EXIT_CODES}"""

_SHOW_HELP: Final = f"""\
Print the entries of each input as a table: a row per test, check name and
device, with its forward, backward and step peaks, the peak, the cuda caching
allocator's reserved peak, and the environment that produced the figures (and,
for a JSON report, the status the run gave each check).

examples:
  {PROG} show tests/__torchmem__/test_model.json
  {PROG} show tests/ --device cuda --sort peak
  {PROG} show report.json -k test_vit --bytes
  {PROG} show tests/ --format markdown >> comment.md

{_EXIT_CODES}"""

_DIFF_HELP: Final = f"""\
Compare OLD with NEW entry by entry (matched by test module, test, check name
and device) with the plugin's comparison: a table of the figures that changed,
with absolute and relative deltas; for each entry that moved, the categories
and modules that moved most; the entries only in OLD or only in NEW; and the
entries recorded in another environment (torch version, CPU threads or ISA,
GPU profile), which are stale and not compared.

Without --fail-on, diff judges the forward, backward and step peaks, a training
loop's first-step peak and the reserved peak with no tolerance (as the plugin
does by default), reports, and exits 0.

Each --fail-on PHASE:LIMIT gates the figures of PHASE: an entry fails when one
grew by more than LIMIT from OLD to NEW (a figure may move exactly LIMIT), and
the other figures are shown but not gated. PHASE is fwd (forward), bwd
(backward), step, first (a training loop's first step), peak, reserved, or any
(all of them); LIMIT is a percentage of
the OLD figure (5%) or a byte size with its unit (10MiB, 1.5GB; 0 for none).
Give several rules comma-separated or in several --fail-on options; where two
name the same figure, the stricter limit holds.

examples:
  {PROG} diff base/tests tests --fail-on bwd:5%
  {PROG} diff base.json report.json --fail-on fwd:10MiB,bwd:5% --fail-on step:0
  {PROG} diff base.json report.json --fail-on any:1% --fail-on-missing --format json
  {PROG} diff base.json report.json --format markdown > comment.md

{_EXIT_CODES}"""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=("table", "json", "markdown"),
        default="table",
        help="table (default), json (machine-readable), or markdown (e.g. for a pull request "
        "comment)",
    )
    parser.add_argument(
        "--bytes",
        action="store_true",
        help="exact byte counts instead of sizes such as 1.50 MiB",
    )
    parser.add_argument(
        "-k",
        dest="keywords",
        action="append",
        default=[],
        metavar="SUBSTRING",
        help="only the entries whose test (tests/test_m.py::test_a[1]) or check name holds "
        "SUBSTRING; repeat for any of several",
    )
    parser.add_argument(
        "--device",
        dest="devices",
        action="append",
        default=[],
        metavar="NAME",
        help="only the entries of device NAME (cpu, cuda); repeat or separate with commas",
    )


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=PROG, description=_MAIN_HELP, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"pytest-torchmem {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    show = commands.add_parser(
        "show",
        help="print snapshot files, directories of them or JSON reports as tables",
        description=_SHOW_HELP,
        formatter_class=formatter,
    )
    show.add_argument(
        "inputs", nargs="+", metavar="FILE", help="snapshot file, directory or report"
    )
    _common(show)
    show.add_argument(
        "--sort",
        choices=SORT_KEYS,
        default="test",
        help="order of the rows: by test (default), or by a figure, largest first",
    )
    diff = commands.add_parser(
        "diff",
        help="compare two snapshot files, directories or JSON reports; exit 1 on a regression",
        description=_DIFF_HELP,
        formatter_class=formatter,
    )
    diff.add_argument(
        "old", metavar="OLD", help="the reference: snapshot file, directory or report"
    )
    diff.add_argument("new", metavar="NEW", help="the new results, in any of the same forms")
    diff.add_argument(
        "--fail-on",
        dest="fail_on",
        action="append",
        default=[],
        type=_fail_on_argument,
        metavar="PHASE:LIMIT",
        help="fail (exit 1) when a figure of PHASE grew by more than LIMIT: bwd:5%%, "
        "fwd:10MiB, peak:2%%, step:0, any:1%%",
    )
    diff.add_argument(
        "--fail-on-missing",
        action="store_true",
        help="also fail when an entry is only in OLD (gone) or only in NEW (added)",
    )
    diff.add_argument(
        "--fail-on-improvement",
        action="store_true",
        help="also fail when a gated figure shrank by more than its limit, so that the "
        "reference gets tightened (needs --fail-on)",
    )
    diff.add_argument(
        "--fail-on-stale",
        action="store_true",
        help="also fail when an entry was recorded in another environment (not compared)",
    )
    _common(diff)
    add_commands(commands, formatter, _EXIT_CODES, PROG)
    return parser


def _select(entries: Sequence[Saved], keywords: Sequence[str], devices: set[str]) -> list[Saved]:
    return [
        saved
        for saved in entries
        if (not devices or saved.key.device in devices)
        and (not keywords or any(k in saved.label or k in saved.key.name for k in keywords))
    ]


def _devices(values: Sequence[str]) -> set[str]:
    return {name.strip() for value in values for name in value.split(",") if name.strip()}


def _nothing_matched(
    everything: Sequence[Saved], keywords: Sequence[str], devices: set[str]
) -> str:
    said = [f"-k {k!r}" for k in keywords] + [f"--device {d}" for d in sorted(devices)]
    present = ", ".join(sorted({saved.key.device for saved in everything})) or "none"
    return f"no entry matches {' '.join(said)} (devices in the inputs: {present})"


def _show(args: argparse.Namespace) -> tuple[str, int]:
    loaded = [load(path) for path in args.inputs]
    devices = _devices(args.devices)
    shown = [
        sort_entries(_select(one.entries, args.keywords, devices), args.sort) for one in loaded
    ]
    if (args.keywords or devices) and not any(shown):
        everything = [saved for one in loaded for saved in one.entries]
        raise InputError(_nothing_matched(everything, args.keywords, devices))
    if args.format == "json":
        return json.dumps(show_json(loaded, shown), indent=2, sort_keys=True), EXIT_OK
    return show_text(loaded, shown, Style(args.format == "markdown", args.bytes)), EXIT_OK


def _diff(args: argparse.Namespace) -> tuple[str, int]:
    rules = tuple(rule for rules in args.fail_on for rule in rules)
    if args.fail_on_improvement and not rules:
        raise UsageError(
            "--fail-on-improvement needs --fail-on: it fails on figures that shrank by more "
            "than their --fail-on limit, e.g. --fail-on any:1% --fail-on-improvement"
        )
    gate = Gate(rules, args.fail_on_missing, args.fail_on_improvement, args.fail_on_stale)
    old, new = load(args.old), load(args.new)
    devices = _devices(args.devices)
    before = _select(old.entries, args.keywords, devices)
    after = _select(new.entries, args.keywords, devices)
    if (args.keywords or devices) and not before and not after:
        everything = [*old.entries, *new.entries]
        raise InputError(_nothing_matched(everything, args.keywords, devices))
    rows = diff_rows(match(before, after), gate)
    code = EXIT_FAILED if any(row.failed for row in rows) else EXIT_OK
    if args.format == "json":
        return json.dumps(diff_json(old, new, rows, gate), indent=2, sort_keys=True), code
    return diff_text(old, new, rows, gate, Style(args.format == "markdown", args.bytes)), code


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a malformed command line
    try:
        if args.command == "fit":
            text, code = fit_command(args, sys.stderr)
        elif args.command == "rank":
            text, code = rank_command(args)
        elif args.command == "ranks":
            text, code = ranks_command(args)
        else:
            text, code = _show(args) if args.command == "show" else _diff(args)
    except (InputError, UsageError, FactoryError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = sys.stdout if out is None else out
    try:
        out.write(text.rstrip("\n") + "\n")
        out.flush()
    except BrokenPipeError:  # `... | head`: the reader left; the verdict still stands
        if out is sys.stdout:
            # Python would report the failed flush at exit: point stdout at nothing.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code
