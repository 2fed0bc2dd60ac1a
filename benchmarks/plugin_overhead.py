"""The plugin's own cost per memory check, apart from tracing.

    python benchmarks/plugin_overhead.py [--checks N] [--extra M] [--profile]

Generates a test module of ``N / 2`` tests, each one ``torchmem.check`` of a
tiny model (``nn.Linear(4, 4)``) on both fake devices (cpu and cuda: ``N``
checks), and runs it in this process with ``pytest.main`` in four scenarios:

* ``update``            -- ``--torchmem-update`` into an empty directory: every
  entry new, the snapshot file written at the end;
* ``compare``           -- the same tests against that file: every check passes;
* ``compare, big file`` -- a second module whose snapshot file also holds ``M``
  entries of deselected tests (``-k "not extra"``): the first check reads the
  big file, the end of the session judges unused entries in it;
* ``update, big file``  -- the same under ``--torchmem-update``: the end of the
  session re-reads, merges and re-checks the big file under its lock.

The benchmark wraps, for timing only, the tracing entry point
(``pytest_torchmem.engine.tracing.trace.trace``), ``CheckRunner.check``, the plugin's per-test work
and the end of the session (the ledger's unused entries, the snapshot writer, the reports and
the summary); the product runs unpatched.
Columns, per scenario:

* ``trace ms/check``, ``check ms/check``: time inside tracing and inside
  ``torchmem.check``, per check (one device);
* ``overhead ms/check``: their difference, the plugin's own cost per check
  (target: under 5 ms), in thread CPU time (``time.thread_time``: other
  processes on a busy machine barely disturb it), and beside it in wall time;
* ``hooks ms/test``: the plugin's per-test work outside checks (reading the
  marker at collection, noting collected and passed tests);
* ``session end ms``: the whole end of the run, once (unused entries, snapshot
  writes, the summary table);
* ``pytest ms/test``: what is left of the run's wall time, per test: pytest's
  start, collection and hooks, fixtures, the test bodies.

The first check of a module reads its snapshot file, so a big file shows in
``overhead ms/check`` spread over the module's checks. Exits 1 when the
overhead of a scenario is 5 ms or more.

``--profile`` adds a cProfile of the ``compare`` scenario's checks without
their tracing, by where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tabulate import tabulate
from torch import nn

import pytest_torchmem as tm
import pytest_torchmem.engine.tracing.trace as trace_module
from pytest_torchmem.plugin.checking import CheckRunner
from pytest_torchmem.plugin.ledger import CollectionLedger
from pytest_torchmem.plugin.outcomes import PendingVerdicts
from pytest_torchmem.plugin.reporting import Reporter
from pytest_torchmem.plugin.writing import SnapshotWriter

TARGET_MS = 5.0

MODULE = """
import pytest
import torch
from torch import nn


@pytest.mark.parametrize("i", range({tests}))
def test_linear(torchmem, i):
    torchmem.check(nn.Linear(4, 4), torch.randn(2, 4))


@pytest.mark.parametrize("i", range({extra}))
def test_extra(torchmem, i):
    torchmem.check(nn.Linear(4, 4), torch.randn(2, 4))
"""

ARGS = (
    "-q",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:randomly",
    "-p",
    "no:hypothesispytest",
    "-p",
    "no:xdist",
    "--import-mode=importlib",
)


@dataclass
class Clock:
    """Thread CPU and wall seconds spent in one wrapped function (outermost calls only)."""

    calls: int = 0
    cpu: float = 0.0
    wall: float = 0.0
    depth: int = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.thread_time() - cpu
                self.wall += time.perf_counter() - wall
                self.calls += 1
                self.depth -= 1

        return timed


@contextlib.contextmanager
def instrumented() -> Iterator[dict[str, Clock]]:
    """Time tracing, checks and the end of the session while the block runs."""
    clocks = {"trace": Clock(), "check": Clock(), "end": Clock(), "hooks": Clock()}
    originals: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, clock: Clock) -> None:
        original = getattr(owner, name)
        originals.append((owner, name, original))
        setattr(owner, name, clock.wrap(original))

    # The session imports its tracing function at each check: patching the module works.
    patch(trace_module, "trace", clocks["trace"])
    # Only methods the hooks call: a hook implementation itself is read by pluggy.
    patch(CheckRunner, "check", clocks["check"])
    patch(CollectionLedger, "judge_unused", clocks["end"])
    patch(SnapshotWriter, "write_snapshots", clocks["end"])
    patch(Reporter, "write_reports", clocks["end"])
    patch(Reporter, "write_summary", clocks["end"])
    patch(CollectionLedger, "note_collected", clocks["hooks"])
    patch(CollectionLedger, "note_ran", clocks["hooks"])
    patch(CheckRunner, "read_markers", clocks["hooks"])
    patch(PendingVerdicts, "settle", clocks["hooks"])
    try:
        yield clocks
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


@dataclass
class Run:
    scenario: str
    tests: int
    wall: float
    clocks: dict[str, Clock]


def run(scenario: str, folder: Path, tests: int, *args: str) -> Run:
    """``pytest`` on ``folder`` in this process, quietly; fails loudly if the run fails."""
    with instrumented() as clocks:
        out = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(out):
            code = pytest.main([str(folder), *ARGS, *args])
        wall = time.perf_counter() - start
    if code != 0:
        sys.stderr.write(out.getvalue()[-4000:])
        raise SystemExit(f"{scenario}: pytest exited with {code}")
    if clocks["check"].calls != tests:
        raise SystemExit(f"{scenario}: {clocks['check'].calls} checks ran, expected {tests}")
    return Run(scenario, tests, wall, clocks)


def add_extra_entries(path: Path, extra: int) -> None:
    """Copy one real entry to ``extra`` deselected tests: a snapshot file with many entries."""
    data = json.loads(path.read_text())
    sample = data["tests"]["test_linear[0]"]
    for index in range(extra):
        data["tests"][f"test_extra[{index}]"] = sample
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def row(result: Run) -> list[Any]:
    clocks = result.clocks
    checks = clocks["trace"].calls  # one trace per device: cpu and cuda
    trace = clocks["trace"]
    check = clocks["check"]
    overhead_cpu = (check.cpu - trace.cpu) / checks * 1e3
    overhead_wall = (check.wall - trace.wall) / checks * 1e3
    hooks = clocks["hooks"]
    pytest_wall = result.wall - check.wall - clocks["end"].wall - hooks.wall
    return [
        result.scenario,
        checks,
        f"{trace.cpu / checks * 1e3:.2f}",
        f"{check.cpu / checks * 1e3:.2f}",
        f"{overhead_cpu:.2f}",
        f"{overhead_wall:.2f}",
        f"{hooks.cpu / result.tests * 1e3:.2f}",
        f"{clocks['end'].wall * 1e3:.0f}",
        f"{pytest_wall / result.tests * 1e3:.2f}",
        "yes" if overhead_cpu < TARGET_MS else "NO",
    ]


def profile_checks(folder: Path, tests: int) -> None:
    """cProfile of the checks of a compare run, tracing excluded."""
    profile = cProfile.Profile()
    original_check = CheckRunner.check
    trace_names = ["trace"]
    originals = {name: getattr(trace_module, name) for name in trace_names}

    def check(*args: Any, **kwargs: Any) -> Any:
        profile.enable()
        try:
            return original_check(*args, **kwargs)
        finally:
            profile.disable()

    def untraced(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            profile.disable()
            try:
                return fn(*args, **kwargs)
            finally:
                profile.enable()

        return call

    CheckRunner.check = check  # type: ignore[method-assign]
    for name, fn in originals.items():
        setattr(trace_module, name, untraced(fn))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            pytest.main([str(folder), *ARGS])
    finally:
        CheckRunner.check = original_check  # type: ignore[method-assign]
        for name, fn in originals.items():
            setattr(trace_module, name, fn)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(f"\ncProfile of {tests} checks (x2 devices), tracing excluded, by own time:")
    print(text.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checks", type=int, default=400, help="checks per scenario (two per test; default 400)"
    )
    parser.add_argument(
        "--extra",
        type=int,
        default=5000,
        help="entries of deselected tests in the big snapshot file (default 5000)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the compare scenario")
    options = parser.parse_args()
    tests = max(1, options.checks // 2)

    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))  # import what the first trace imports
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        warm, small, big = root / "warm", root / "small", root / "big"
        for folder, extra in ((warm, 0), (small, 0), (big, options.extra)):
            folder.mkdir()
            # One module name per folder: this process imports each module once.
            (folder / f"test_{folder.name}.py").write_text(
                MODULE.format(tests=tests if folder != warm else 5, extra=extra)
            )
        run("warm-up", warm, 5, "--torchmem-update")
        results = [
            run("update", small, tests, "--torchmem-update"),
            run("compare", small, tests),
        ]
        run("big file: record", big, tests, "--torchmem-update", "-k", "not extra")
        add_extra_entries(big / "__torchmem__" / "test_big.json", options.extra)
        results += [
            run(f"compare, big file (+{options.extra} entries)", big, tests, "-k", "not extra"),
            run(
                f"update, big file (+{options.extra} entries)",
                big,
                tests,
                "--torchmem-update",
                "-k",
                "not extra",
            ),
        ]
        headers = [
            "scenario",
            "checks",
            "trace ms/check",
            "check ms/check",
            "overhead ms/check",
            "(wall)",
            "hooks ms/test",
            "session end ms",
            "pytest ms/test",
            f"< {TARGET_MS:g} ms",
        ]
        print(
            f"torch {torch.__version__}, pytest {pytest.__version__}, threads "
            f"{torch.get_num_threads()}; CPU times except where marked (wall)"
        )
        print(tabulate([row(result) for result in results], headers=headers))
        if options.profile:
            profile_checks(small, tests)
        worst = max(
            (r.clocks["check"].cpu - r.clocks["trace"].cpu) / r.clocks["trace"].calls
            for r in results
        )
    return 0 if worst * 1e3 < TARGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
