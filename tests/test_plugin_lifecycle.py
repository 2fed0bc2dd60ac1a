"""The life of a snapshot, with and without pytest-xdist: update, pass, regress, read, accept.

Under ``-n 2`` the workers trace and judge, and the controller alone merges
their results and writes the files; two pytest processes updating one file
at once lose no entry.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)

Run = Callable[..., pytest.RunResult]

MODULE = """
import pytest
import torch
from torch import nn

def test_a(torchmem):
    torchmem.check(nn.Linear(8, {a_out}), torch.randn(2, 8))

def test_b(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
{b_extra}
def test_c(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
{d}"""

EXTRA = '    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8), train=False, name="eval")\n'
TEST_D = """
def test_d(torchmem):
    torchmem.check(nn.Linear(8, 2), torch.randn(2, 8))
"""


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))  # see test_plugin_e2e


@pytest.fixture(autouse=True)
def _quiet_plugins(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")


@pytest.fixture(params=["no-xdist", "xdist"])
def run(request: pytest.FixtureRequest, pytester: pytest.Pytester) -> Run:
    if request.param == "xdist":
        return lambda *args: pytester.runpytest_subprocess("-n", "2", *args)
    return pytester.runpytest_inprocess


def stored_tests(pytester: pytest.Pytester) -> dict[str, Any]:
    return json.loads((pytester.path / "__torchmem__" / "test_m.json").read_text())["tests"]


def test_update_pass_regress_read_accept(
    pytester: pytest.Pytester, run: Run, request: pytest.FixtureRequest
) -> None:
    """Regression guard: each step of the snapshot workflow, alike in one process and under -n 2."""
    pytester.makepyfile(test_m=MODULE.format(a_out=4, b_extra=EXTRA, d=""))

    # 1. Create the snapshots (in this process: step 3 shows that the xdist controller writes).
    result = pytester.runpytest_inprocess("--torchmem-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "wrote __torchmem__/test_m.json",
            "torchmem: 8 checks: 0 passed, 0 regressed, 0 improved, 0 missing, 0 unused, 8 new",
        ]
    )
    created = stored_tests(pytester)
    assert {test: sorted(checks) for test, checks in created.items()} == {
        "test_a": ["default"],
        "test_b": ["default", "eval"],
        "test_c": ["default"],
    }

    # 2. A change: test_a needs more memory, test_b drops a check, test_d is new.
    pytester.makepyfile(test_m=MODULE.format(a_out=32, b_extra="", d=TEST_D))
    before = (pytester.path / "__torchmem__" / "test_m.json").read_text()
    result = run("-k", "not test_c")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, failed=2)  # (xdist does not count deselected tests)
    result.stdout.fnmatch_lines(
        [
            "torchmem: regressed on cpu, regressed on cuda: test_m.py::test_a [[]default[]]",
            "cpu forward peak grew: estimate *, snapshot *: +*, allowed ±0 B (rtol 0, atol 0 B)",
            "cpu backward peak grew: *",
            "  categories that moved most (at the peak): *",
            'snapshot: __torchmem__/test_m.json, key "test_a" > "default" > "cpu" (entry)',
            'accept the change with: pytest --torchmem-update "test_m.py::test_a"',
        ]
    )
    result.stdout.fnmatch_lines(
        ['create the entry with: pytest --torchmem-update "test_m.py::test_d"']
    )
    result.stdout.fnmatch_lines(
        [
            'unused: __torchmem__/test_m.json: "test_b" > "eval" > "cpu"',
            'unused: __torchmem__/test_m.json: "test_b" > "eval" > "cuda"',
            "2 unused snapshot entries fail this run: *",
            "torchmem: 6 checks: 2 passed, 2 regressed, 0 improved, 2 missing, 2 unused",
        ]
    )
    assert 'test_c" >' not in result.stdout.str()  # deselected: not judged
    assert (pytester.path / "__torchmem__" / "test_m.json").read_text() == before

    # 3. Accept: the regression, the new test and the dropped check; test_c stays as it was.
    result = run("--torchmem-update", "-k", "not test_c")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        ["removed 2 unused snapshot entries", "wrote __torchmem__/test_m.json"]
    )
    accepted = stored_tests(pytester)
    assert {test: sorted(checks) for test, checks in accepted.items()} == {
        "test_a": ["default"],
        "test_b": ["default"],
        "test_c": ["default"],
        "test_d": ["default"],
    }
    assert accepted["test_c"] == created["test_c"]
    assert (
        accepted["test_a"]["default"]["cpu"]["forward_peak"]
        > created["test_a"]["default"]["cpu"]["forward_peak"]
    )

    # 4. Everything passes again (checked once: the same code under xdist).
    if request.node.callspec.params["run"] == "no-xdist":
        result = run()
        assert result.ret == 0
        result.stdout.fnmatch_lines(
            ["torchmem: 8 checks: 8 passed, 0 regressed, 0 improved, 0 missing, 0 unused"]
        )


def test_two_processes_updating_one_file_lose_no_entry(pytester: pytest.Pytester) -> None:
    """Regression guard: two concurrent `pytest --torchmem-update` runs on one module lose no entry."""
    body = "import torch\nfrom torch import nn\n" + "".join(
        f"def test_{i}(torchmem):\n    torchmem.check(nn.Linear(8, {i + 1}), torch.randn(2, 8))\n"
        for i in range(6)
    )
    pytester.makepyfile(test_m=body)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:hypothesispytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "--torchmem-update",
    ]
    runs = [
        subprocess.Popen(
            [*command, "-k", selection],
            cwd=pytester.path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for selection in ("test_0 or test_2 or test_4", "test_1 or test_3 or test_5")
    ]
    try:  # a generous bound: each run imports torch and traces, on a machine maybe loaded
        outputs = [proc.communicate(timeout=600)[0].decode() for proc in runs]
    finally:
        for proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if [proc.returncode for proc in runs] != [0, 0]:
        pytest.fail("\n\n".join(outputs), pytrace=False)
    assert sorted(stored_tests(pytester)) == [f"test_{i}" for i in range(6)]
