"""The example suites' setup: torchvision beside a CPU build of torch, and one line
per suite that skips itself, saying what it needs.

torchvision's wheels on PyPI are built for the CUDA build of torch; beside the
CPU wheel this repository installs (``torch==2.13.0``), their C++ extension does
not load and ``import torchvision`` fails (pytorch/vision#9085), and with it
every library that imports it: transformers' models, Lightning (through
torchmetrics). The suites here need none of torchvision's operators, so
``tests/torchvision_import.py`` imports it without them, as the project's own
tests do. With a torchvision built for your torch this does nothing.

A suite whose framework is not installed (Accelerate, transformers, Lightning)
skips itself; the summary names the package and the ``pip install`` that
enables it. (No folder here is named as a package a suite imports: pytest puts
this folder on ``sys.path``, and ``importorskip("lightning")`` would import a
folder ``lightning/`` instead of skipping; ``tests/test_plugin_examples.py``
checks the names.)
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from torchvision_import import import_torchvision  # noqa: E402

import_torchvision()
sys.path.pop(0)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reasons: dict[str, str] = {}
    for report in terminalreporter.stats.get("skipped", ()):
        path, _, reason = report.longrepr
        reasons.setdefault(Path(path).parent.name, reason.removeprefix("Skipped: "))
    if reasons:
        terminalreporter.section("example suites skipped")
        for suite, reason in sorted(reasons.items()):
            terminalreporter.line(f"examples/{suite}/: {reason}")
