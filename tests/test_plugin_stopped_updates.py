"""An update run that stops early never says ``updated`` for what it did not write.

Ctrl-C (or ``pytest.exit``) can land anywhere: the run writes nothing, and each
check it made says ``not written (interrupted)``, in the table, the totals and the
JSON report. Ctrl-C while the files are written leaves the files not yet written as
they were, and their checks say so. A stop that pytest makes between two tests
(``-x``, ``--maxfail``, ``--sw``) writes the entries of the tests that ran, so the
stepwise flow (stop at a failure, fix it, go on from there) ends with every entry
written. An update whose entries were not written is remembered (pytest's cache):
a later run that skips its test (``--sw``, ``--lf``, ``-k``) fails until it runs
again. Real pytest runs (pytester), real snapshot files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))  # see test_plugin_e2e


@pytest.fixture(autouse=True)
def _quiet_plugins(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # (after pytester, which clears PYTEST_ADDOPTS) see test_plugin_e2e; pytest's cache
    # stays: --sw and the record of unwritten updates live there.
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:randomly")
    monkeypatch.delenv("FAIL", raising=False)
    monkeypatch.delenv("FAULT", raising=False)
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")


def module(out: int, *, eval_check: bool = False, interrupt: bool = False) -> str:
    """test_a, test_b (fails after its check when FAIL is set), test_c: one check each of
    Linear(8, out); ``eval_check``: test_a checks an eval step too; ``interrupt``: test_c
    presses Ctrl-C after its check (pytester's in-process runs then need
    ``no_reraise_ctrlc=True``: else they pass the Ctrl-C on to this run)."""
    check = f"    torchmem.check(nn.Linear(8, {out}), torch.randn(2, 8))\n"
    body = "import os\nimport pytest\nimport torch\nfrom torch import nn\n"
    body += "\n\ndef test_a(torchmem):\n" + check
    if eval_check:
        body += f"    torchmem.check(nn.Linear(8, {out}), torch.randn(2, 8), train=False, name='eval')\n"
    body += "\n\ndef test_b(torchmem):\n" + check + "    assert not os.environ.get('FAIL')\n"
    body += "\n\ndef test_c(torchmem):\n" + check
    if interrupt:
        body += "    raise KeyboardInterrupt\n"
    return body


def stored(pytester: pytest.Pytester, name: str = "test_m") -> dict[str, Any]:
    return json.loads((pytester.path / "__torchmem__" / f"{name}.json").read_text())["tests"]


def peaks(pytester: pytest.Pytester, name: str = "test_m") -> dict[str, int]:
    """test id -> the backward peak of its default check's cpu entry."""
    tests = stored(pytester, name)
    return {test: checks["default"]["cpu"]["backward_peak"] for test, checks in tests.items()}


def rows(result: pytest.RunResult) -> dict[str, str]:
    """The status of each row of the torchmem table (test label -> status column)."""
    found = {}
    for line in result.stdout.lines:
        if line.startswith("test_m.py::"):
            label, _, rest = line.partition("  ")
            found[label.strip()] = rest.split("  ")[-1].strip()
    return found


def totals(result: pytest.RunResult) -> str:
    return [line for line in result.stdout.lines if line.startswith("torchmem: ")][-1]


#: Linear(8, 4)'s and Linear(8, 6)'s backward peaks on cpu, batch 2, float32 (in floats,
#: x 4 B): the parameters (8 out + out), the weight's gradient (8 out; the bias's comes
#: later), the input (2 x 8), the loss and its gradient (2), and the loss's gradient
#: expanded to the output's shape and made contiguous for the matmul (2 out).
PEAK_4 = 4 * ((8 * 4 + 4) + 8 * 4 + 2 * 8 + 2 + 2 * 4)
PEAK_6 = 4 * ((8 * 6 + 6) + 8 * 6 + 2 * 8 + 2 + 2 * 6)


def test_the_backward_peaks_counted_by_hand() -> None:
    assert (PEAK_4, PEAK_6) == (376, 528)
    for out, peak in ((4, PEAK_4), (6, PEAK_6)):
        measured = tm.measure(nn.Linear(8, out), torch.randn(2, 8))
        assert measured.backward_peak == peak


def test_ctrl_c_during_the_tests_writes_nothing_and_says_not_written(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard (issue 27, 4): an interrupted update wrote nothing, but the table, the
    totals and the JSON report said "updated" (and "removed" for the unused entry)."""
    pytester.makepyfile(test_m=module(4, eval_check=True))
    assert pytester.runpytest("--torchmem-update").ret == 0
    before = (pytester.path / "__torchmem__" / "test_m.json").read_bytes()

    pytester.makepyfile(test_m=module(6, interrupt=True))
    result = pytester.runpytest(
        "--torchmem-update",
        "--torchmem-json",
        "report.json",
        "--torchmem-html",
        "report.html",
        no_reraise_ctrlc=True,
    )
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert (pytester.path / "__torchmem__" / "test_m.json").read_bytes() == before
    assert rows(result) == {
        f"test_m.py::{test}": "not written (interrupted)" for test in ("test_a", "test_b", "test_c")
    }
    assert totals(result) == (
        "torchmem: 3 checks: 0 passed, 0 regressed, 0 improved, 0 missing, 1 unused, "
        "3 not written"
    )
    result.stdout.fnmatch_lines(
        [
            'unused: __torchmem__/test_m.json: "test_a" > "eval" > "cpu"',
            "1 unused snapshot entry not removed: the run was interrupted",
            "torchmem: the run was interrupted: no snapshot file was written; "
            "rerun with --torchmem-update",
        ]
    )
    assert "updated" not in result.stdout.str().split("-- torchmem --")[-1]
    report = json.loads((pytester.path / "report.json").read_text())
    assert [(r["test"], r["status"], r["not_written"]) for r in report["results"]] == [
        (test, "not written", "interrupted") for test in ("test_a", "test_b", "test_c")
    ]
    assert (report["totals"]["updated"], report["totals"]["not written"]) == (0, 3)
    html = (pytester.path / "report.html").read_text()
    assert html.count('data-status="not written"') == 3
    assert 'data-status="updated"' not in html


def test_ctrl_c_while_writing_says_which_files_were_written(pytester: pytest.Pytester) -> None:
    """Regression guard (issue 27, 4): Ctrl-C between two files: the first is written and says
    so; the second is left as it was, and its checks say "not written"."""
    for name in ("test_m", "test_n"):
        pytester.makepyfile(**{name: module(4)})
    assert pytester.runpytest("--torchmem-update").ret == 0
    pytester.makeconftest(
        "import os\nimport pytest\n\n"
        "@pytest.hookimpl(wrapper=True, tryfirst=True)\n"
        "def pytest_sessionfinish(session):\n"
        "    real = os.replace\n"
        "    def replace(source, target, *args, **kwargs):\n"
        "        if str(target).endswith('test_n.json'):\n"
        "            raise KeyboardInterrupt\n"
        "        return real(source, target, *args, **kwargs)\n"
        "    os.replace = replace\n"
        "    try:\n"
        "        return (yield)\n"
        "    finally:\n"
        "        os.replace = real\n"
    )
    for name in ("test_m", "test_n"):
        pytester.makepyfile(**{name: module(6)})
    result = pytester.runpytest("--torchmem-update", "--torchmem-json", "report.json")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert peaks(pytester, "test_m") == dict.fromkeys(("test_a", "test_b", "test_c"), PEAK_6)
    assert peaks(pytester, "test_n") == dict.fromkeys(("test_a", "test_b", "test_c"), PEAK_4)
    statuses = {
        (r["nodeid"], r["status"], r["not_written"])
        for r in json.loads((pytester.path / "report.json").read_text())["results"]
    }
    assert statuses == {
        *((f"test_m.py::{test}", "updated", None) for test in ("test_a", "test_b", "test_c")),
        *(
            (f"test_n.py::{test}", "not written", "interrupted while writing")
            for test in ("test_a", "test_b", "test_c")
        ),
    }
    result.stdout.fnmatch_lines(
        [
            "test_n.py::test_a * not written (interrupted while writing)",
            "wrote __torchmem__/test_m.json",
            "torchmem: interrupted while writing snapshot files; left as they were: "
            "__torchmem__/test_n.json; rerun with --torchmem-update",
            "torchmem: 6 checks: 0 passed, *, 3 updated, 3 not written",
        ]
    )


@pytest.mark.parametrize("stop", [("-x",), ("--maxfail=1",), ("--sw",)])
def test_a_stop_between_tests_writes_the_tests_that_ran(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, stop: tuple[str, ...]
) -> None:
    """Regression guard (issue 27, 4): --sw's stop wrote nothing (-x's wrote) and said
    "updated"; each stop pytest makes between two tests is at a test's end: the checks of
    the tests that ran are whole, and written."""
    pytester.makepyfile(test_m=module(4))
    assert pytester.runpytest("--torchmem-update", "-p", "no:stepwise").ret == 0
    pytester.makepyfile(test_m=module(6))
    monkeypatch.setenv("FAIL", "1")
    result = pytester.runpytest("--torchmem-update", *stop)
    result.assert_outcomes(passed=1, failed=1)
    assert peaks(pytester) == {"test_a": PEAK_6, "test_b": PEAK_6, "test_c": PEAK_4}
    assert rows(result) == {"test_m.py::test_a": "updated", "test_m.py::test_b": "updated"}
    result.stdout.fnmatch_lines(["wrote __torchmem__/test_m.json"])


def test_the_stepwise_flow_ends_with_every_update_written(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression guard (issue 27, 4): `--torchmem-update --sw` stopped at test_b and wrote
    nothing; the next one skipped test_a, wrote test_b's and test_c's entries and exited 0;
    the compare then failed on test_a's update, never written."""
    pytester.makepyfile(test_m=module(4))
    assert pytester.runpytest("--torchmem-update").ret == 0
    pytester.makepyfile(test_m=module(6))
    monkeypatch.setenv("FAIL", "1")
    first = pytester.runpytest("--torchmem-update", "--sw")
    first.assert_outcomes(passed=1, failed=1)
    monkeypatch.delenv("FAIL")
    second = pytester.runpytest("--torchmem-update", "--sw")
    second.stdout.fnmatch_lines(["stepwise: skipping 1 already passed items*"])
    second.assert_outcomes(passed=2, deselected=1)
    assert second.ret == 0
    assert peaks(pytester) == dict.fromkeys(("test_a", "test_b", "test_c"), PEAK_6)
    compare = pytester.runpytest()
    assert compare.ret == 0, compare.stdout.str()


FAULT_ONCE = """
import os
import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session):
    # Ctrl-C as the snapshot file is put in place, in the run that sets FAULT.
    real = os.replace

    def replace(source, target, *args, **kwargs):
        if os.environ.get("FAULT") and "__torchmem__" in str(target):
            raise KeyboardInterrupt
        return real(source, target, *args, **kwargs)

    os.replace = replace
    try:
        return (yield)
    finally:
        os.replace = real
"""


def test_a_run_that_skips_a_test_whose_update_was_never_written_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression guard (issue 27, 4): after an update whose write was interrupted, the next
    `--sw` run skipped test_a (stepwise remembered test_b), wrote the rest and exited 0,
    test_a's update lost. The record of unwritten updates fails that run until test_a runs."""
    pytester.makepyfile(test_m=module(4))
    assert pytester.runpytest("--torchmem-update").ret == 0
    pytester.makeconftest(FAULT_ONCE)
    pytester.makepyfile(test_m=module(6))
    monkeypatch.setenv("FAIL", "1")
    monkeypatch.setenv("FAULT", "1")
    first = pytester.runpytest("--torchmem-update", "--sw")
    assert first.ret == pytest.ExitCode.INTERRUPTED
    assert rows(first) == {
        "test_m.py::test_a": "not written (interrupted while writing)",
        "test_m.py::test_b": "not written (interrupted while writing)",
    }
    assert peaks(pytester) == dict.fromkeys(("test_a", "test_b", "test_c"), PEAK_4)

    monkeypatch.delenv("FAIL")
    monkeypatch.delenv("FAULT")
    second = pytester.runpytest("--torchmem-update", "--sw")
    second.assert_outcomes(passed=2, deselected=1)
    assert second.ret == pytest.ExitCode.TESTS_FAILED
    second.stdout.fnmatch_lines(
        [
            "torchmem: test_m.py::test_a: its update by an earlier run was not written "
            "(interrupted while writing), and this run did not run it: rerun it with "
            'pytest --torchmem-update "test_m.py::test_a"',
        ]
    )
    assert peaks(pytester) == {"test_a": PEAK_4, "test_b": PEAK_6, "test_c": PEAK_6}

    third = pytester.runpytest("--torchmem-update", "test_m.py::test_a")
    assert third.ret == 0, third.stdout.str()
    assert peaks(pytester) == dict.fromkeys(("test_a", "test_b", "test_c"), PEAK_6)
    assert pytester.runpytest("--torchmem-update", "--sw").ret == 0
    assert pytester.runpytest().ret == 0


def test_the_record_of_unwritten_updates_is_kept_by_runs_that_do_not_collect_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of another module is not failed by it, nor does it forget it."""
    pytester.makepyfile(test_m=module(4), test_other=module(4))
    assert pytester.runpytest("--torchmem-update").ret == 0
    pytester.makepyfile(test_m=module(6, interrupt=True))
    interrupted = pytester.runpytest("--torchmem-update", "test_m.py", no_reraise_ctrlc=True)
    assert interrupted.ret == pytest.ExitCode.INTERRUPTED
    assert pytester.runpytest("--torchmem-update", "test_other.py").ret == 0
    skipping = pytester.runpytest("--torchmem-update", "-k", "not test_a", no_reraise_ctrlc=True)
    assert skipping.ret == pytest.ExitCode.INTERRUPTED  # test_c presses Ctrl-C again
    pytester.makepyfile(test_m=module(6))
    skipping = pytester.runpytest("--torchmem-update", "-k", "not test_a")
    assert skipping.ret == pytest.ExitCode.TESTS_FAILED
    skipping.stdout.fnmatch_lines(["torchmem: test_m.py::test_a: its update by an earlier run*"])
    assert pytester.runpytest("--torchmem-update").ret == 0
    assert pytester.runpytest("--torchmem-update", "-k", "not test_a").ret == 0


def test_under_xdist_a_stop_writes_what_the_table_says_was_written(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-x under pytest-xdist ends the run as interrupted (its controller raises an exception of
    its own): a stop between tests, whose checks are written; each row says what happened."""
    pytester.makepyfile(test_m=module(4))
    assert pytester.runpytest("--torchmem-update").ret == 0
    pytester.makepyfile(test_m=module(6))
    monkeypatch.setenv("FAIL", "1")
    result = pytester.runpytest_subprocess("--torchmem-update", "-n", "2", "-x")
    assert result.ret in (pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.INTERRUPTED)
    assert "INTERNALERROR" not in result.stdout.str()
    written = peaks(pytester)
    shown = rows(result)
    assert "test_m.py::test_b" in shown
    for test, peak in written.items():
        status = shown.get(f"test_m.py::{test}")
        assert (status, peak) in (("updated", PEAK_6), (None, PEAK_4)), (test, status, peak)
