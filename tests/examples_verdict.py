"""The verdict on a run of the example suites (``pytest examples``), read from its JUnit XML.

A run of the README's main job passes only where every suite in ``examples/`` passed,
or skipped itself because a package it needs is missing, its reason naming the package
and the ``pip install`` that enables it (``needs Lightning: pip install lightning``).
Anything else fails the verdict: a suite that errored, failed or did not run, a skip
for any other reason, a skip naming a package that is installed.

``.ci/run`` reads the main job's run with it (``python tests/examples_verdict.py
RUN.xml``); ``tests/test_plugin_examples.py`` reads its own runs with the optional
packages hidden.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["installed", "suites", "verdict"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

#: A skip for a missing package: ``needs <what>: pip install <distribution> [<distribution>...]``.
_NEEDS = re.compile(r"needs (?P<what>.+?): pip install (?P<names>[\w.\- ]+)$")


def suites(examples: Path = EXAMPLES) -> list[str]:
    """The example suites: each folder of ``examples/`` with a test module."""
    return sorted({path.parent.name for path in examples.glob("*/test_*.py")})


def installed(distribution: str) -> bool:
    """Whether ``distribution`` is installed in this environment."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def verdict(
    junit: Path, expected: Iterable[str], is_installed: Callable[[str], bool] = installed
) -> tuple[list[str], list[str]]:
    """``(lines, problems)``: a line per suite saying how it ended, and what breaks the rule."""
    cases: dict[str, list[tuple[str, str]]] = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        # a test's classname is examples.<suite>.test_module[.Class]; a module that skipped
        # itself as it was collected has no classname, and is named so
        dotted = case.get("classname") or case.get("name") or ""
        parts = dotted.split(".")
        suite = parts[1] if len(parts) > 2 and parts[0] == "examples" else dotted
        child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if child is None else child.tag
        cases.setdefault(suite, []).append((outcome, "" if child is None else _reason(child)))
    lines: list[str] = []
    problems: list[str] = []
    for suite in sorted(set(expected) | set(cases)):
        ended = cases.get(suite, [])
        if not ended:
            problems.append(f"examples/{suite}/: did not run")
            continue
        outcomes = sorted({outcome for outcome, _ in ended})
        if outcomes == ["passed"]:
            lines.append(f"examples/{suite}/: {len(ended)} passed")
            continue
        reasons = sorted({message for outcome, message in ended if outcome == "skipped"})
        if outcomes == ["skipped"] and len(reasons) == 1 and (needs := _NEEDS.search(reasons[0])):
            present = [name for name in needs["names"].split() if is_installed(name)]
            if present == needs["names"].split():
                problems.append(f"examples/{suite}/: skipped for {needs['what']}, which is installed")
            else:
                lines.append(f"examples/{suite}/: skipped: {reasons[0]}")
            continue
        for outcome, message in ended:
            if outcome != "passed":
                problems.append(f"examples/{suite}/: {outcome}: {message.splitlines()[0] if message else ''}")
    return lines, problems


def _reason(element: ElementTree.Element) -> str:
    message = element.get("message") or ""
    if message == "collection skipped":  # the text is the skip's (path, line, reason)
        try:
            message = str(ast.literal_eval(element.text or "")[2])
        except (ValueError, SyntaxError, IndexError, TypeError):
            message = element.text or message
    return message.removeprefix("Skipped: ")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/examples_verdict.py RUN.xml", file=sys.stderr)
        return 2
    lines, problems = verdict(Path(argv[0]), suites())
    print("\n".join(lines))
    if problems:
        print("the example suites must pass, or skip naming a missing package:", *problems, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
