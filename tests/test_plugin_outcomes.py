"""A check's verdict reaches pytest's outcome and exit code however the test ends.

A failed check does not stop its test (its later checks run too); the verdict
waits until pytest reports the phase that ends the test's checks, and fails
that report: the body's end (it returned, skipped, xfailed, raised, or was an
expected failure), a setup that ends the test early, or a fixture's teardown
that checked. Real pytest runs (pytester), real exit codes, with and without
pytest-xdist (whose workers make the reports).
"""

from __future__ import annotations

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
    # (after pytester, which clears PYTEST_ADDOPTS) see test_plugin_e2e
    monkeypatch.setenv(
        "PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider -p no:randomly"
    )


HEADER = """
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.memory_budget(devices="cpu")
OUT = {out}


def check(torchmem, name=None):
    torchmem.check(nn.Linear(8, OUT), torch.randn(2, 8), name=name)


@pytest.fixture
def checks_in_setup(torchmem):
    check(torchmem, "setup")
    yield


@pytest.fixture
def checks_in_teardown(torchmem):
    yield
    check(torchmem, "teardown")


@pytest.fixture
def skips_in_setup():
    pytest.skip("a later fixture skips")


@pytest.fixture
def raises_in_setup():
    raise RuntimeError("a later fixture fails")
"""

#: How a test ends after its check: the test, its outcome when the check passes
#: (``--torchmem-update`` of the first model: every check writes its entry), and its
#: outcome (as ``assert_outcomes`` counts them) when the check regressed.
ENDINGS = {
    "returns": (
        "def test_it(torchmem):\n    check(torchmem)\n",
        {"passed": 1},
        {"failed": 1},
    ),
    "skips": (
        "def test_it(torchmem):\n    check(torchmem)\n    pytest.skip('skipped after the check')\n",
        {"skipped": 1},
        {"failed": 1},
    ),
    "calls pytest.xfail": (
        "def test_it(torchmem):\n    check(torchmem)\n    pytest.xfail('xfailed after the check')\n",
        {"xfailed": 1},
        {"failed": 1},
    ),
    "raises": (
        "def test_it(torchmem):\n    check(torchmem)\n    raise ValueError('its own failure')\n",
        {"failed": 1},
        {"failed": 1},
    ),
    "marked xfail, fails": (
        "@pytest.mark.xfail(reason='a known bug')\n"
        "def test_it(torchmem):\n    check(torchmem)\n    assert False\n",
        {"xfailed": 1},
        {"failed": 1},
    ),
    "marked xfail, passes": (
        "@pytest.mark.xfail(reason='a known bug')\ndef test_it(torchmem):\n    check(torchmem)\n",
        {"xpassed": 1},
        {"failed": 1},
    ),
    "marked xfail strict, passes": (
        "@pytest.mark.xfail(reason='a known bug', strict=True)\n"
        "def test_it(torchmem):\n    check(torchmem)\n",
        {"failed": 1},
        {"failed": 1},
    ),
    "checks in a fixture's setup": (
        "def test_it(checks_in_setup):\n    pass\n",
        {"passed": 1},
        {"failed": 1},
    ),
    "checks in a fixture's setup, then skips": (
        "def test_it(checks_in_setup, skips_in_setup):\n    pass\n",
        {"skipped": 1},
        {"errors": 1},
    ),
    "checks in a fixture's setup, then a fixture fails": (
        "def test_it(checks_in_setup, raises_in_setup):\n    pass\n",
        {"errors": 1},
        {"errors": 1},
    ),
    "checks in a fixture's teardown": (
        "def test_it(checks_in_teardown):\n    pass\n",
        {"passed": 1},
        {"passed": 1, "errors": 1},
    ),
}

#: The line each failed report starts with (``-rfE``), the test's own failure kept.
SHORT = {
    "checks in a fixture's setup, then skips": "ERROR test_m.py::test_it - Failed: torchmem: *",
    "checks in a fixture's setup, then a fixture fails": (
        "ERROR test_m.py::test_it - RuntimeError: a later fixture fails"
    ),
    "checks in a fixture's teardown": "ERROR test_m.py::test_it - Failed: torchmem: *",
    "raises": "FAILED test_m.py::test_it - ValueError: its own failure",
    "marked xfail strict, passes": "FAILED test_m.py::test_it - [[]XPASS(strict)] a known bug",
}
JUDGED = "its memory checks are judged all the same"
#: What the failure says besides the verdict: how the test itself ended.
ENDED = {
    "skips": "the test then skipped (Skipped: skipped after the check); " + JUDGED,
    "calls pytest.xfail": "the test then called pytest.xfail (xfailed after the check); " + JUDGED,
    "marked xfail, fails": "the test failed as its xfail marker expects (a known bug); " + JUDGED,
    "marked xfail, passes": "the test passed, although marked xfail (a known bug); " + JUDGED,
    "checks in a fixture's setup, then skips": (
        "the test then skipped (Skipped: a later fixture skips); " + JUDGED
    ),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_regression_fails_the_test_however_it_ends(
    pytester: pytest.Pytester, ending: str
) -> None:
    """Regression guard (issue 27, 1): a test that checks and then skips, xfails or raises, or
    checks in a fixture, exited 0 while the table said "regressed"."""
    body, passing, regressed = ENDINGS[ending]
    pytester.makepyfile(test_m=HEADER.format(out=4) + "\n\n" + body)
    update = pytester.runpytest("--torchmem-update", "-rfE")
    update.assert_outcomes(**passing)
    assert update.ret == (0 if set(passing) <= {"passed", "skipped", "xfailed", "xpassed"} else 1)
    assert (pytester.path / "__torchmem__" / "test_m.json").is_file()

    pytester.makepyfile(test_m=HEADER.format(out=6) + "\n\n" + body)
    result = pytester.runpytest("-rfE")
    result.assert_outcomes(**regressed)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    name = "teardown" if "teardown" in ending else "setup" if "setup" in ending else "default"
    label = "test_m.py::test_it" + ("" if name == "default" else f" [[]{name}]")  # fnmatch's [
    result.stdout.fnmatch_lines(
        [
            f"torchmem: regressed on cpu: test_m.py::test_it [[]{name}]",
            "cpu * peak grew: *",
            'accept the change with: pytest --torchmem-update "test_m.py::test_it"',
            *([ENDED[ending]] if ending in ENDED else []),
        ]
    )
    result.stdout.fnmatch_lines(
        [f"{label} * regressed", "torchmem: 1 check: 0 passed, 1 regressed, *"]
    )
    short = SHORT.get(ending, "FAILED test_m.py::test_it - Failed: torchmem: regressed on cpu*")
    result.stdout.fnmatch_lines([short])
    if ending == "raises":  # the test's own failure, and the verdict beside it
        result.stdout.fnmatch_lines(["E       ValueError: its own failure", "*- torchmem -*"])


def test_under_xdist_the_workers_reports_carry_the_verdict(pytester: pytest.Pytester) -> None:
    """Regression guard (issue 27, 1): the report a pytest-xdist worker sends is the failed one."""
    tests = ""
    for index, (body, _, _) in enumerate(ENDINGS.values()):
        tests += "\n\n" + body.replace("def test_it(", f"def test_{index}(")
    pytester.makepyfile(test_m=HEADER.format(out=4) + tests)
    assert pytester.runpytest_subprocess("--torchmem-update", "-n", "2").ret == 1  # its raise
    pytester.makepyfile(test_m=HEADER.format(out=6) + tests)
    result = pytester.runpytest_subprocess("-n", "2", "-rfE")
    result.assert_outcomes(failed=8, errors=3, passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["torchmem: 11 checks: 0 passed, 11 regressed, *"])


def test_a_passing_check_leaves_the_outcome_as_it_was(pytester: pytest.Pytester) -> None:
    """The verdict only ever fails a report: a skip after a check that passed is a skip."""
    tests = ""
    for index, (body, _, _) in enumerate(ENDINGS.values()):
        tests += "\n\n" + body.replace("def test_it(", f"def test_{index}(")
    pytester.makepyfile(test_m=HEADER.format(out=4) + tests)
    pytester.runpytest("--torchmem-update")
    result = pytester.runpytest()
    result.assert_outcomes(passed=3, skipped=2, xfailed=2, xpassed=1, failed=2, errors=1)
    result.stdout.fnmatch_lines(["torchmem: 11 checks: 11 passed, 0 regressed, *"])
