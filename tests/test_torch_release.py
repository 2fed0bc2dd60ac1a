"""The supported torch releases (``engine/torch_compat/torch_release.py``): one clear line outside them.

Outside the window (2.10 to 2.15) an estimate refuses at once with one line that
names the installed torch, the window and the pip command; in pytest, a test
asking for the ``torchmem`` fixture is an error at setup with that line (no
traceback from the package), the other tests run as usual, and the run's
header says it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import pytest_torchmem
import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat import torch_release
from pytest_torchmem.engine.torch_compat.torch_release import (
    ANY_RELEASE_VARIABLE,
    SUPPORTED,
    TorchReleaseError,
    installed_release,
    release_problem,
    supported_range,
)

pytest_plugins = ("pytester",)

PIP = 'pip install "torch>=2.10,<2.16"'


def test_the_window_is_2_10_to_2_15() -> None:
    assert SUPPORTED == ((2, 10), (2, 15))
    assert supported_range() == "2.10 to 2.15"


def test_the_running_torch_is_in_the_window() -> None:
    assert release_problem(torch.__version__) is None
    assert SUPPORTED[0] <= installed_release()[:2] <= SUPPORTED[1]


@pytest.mark.parametrize("version", ["2.10.0", "2.15.3", "2.13.0+cu130", "2.12.1+cpu", "2.14.0a0+git1234"])
def test_a_release_in_the_window_has_no_problem(version: str) -> None:
    assert release_problem(version) is None


def test_an_older_release_is_one_line_with_the_pip_command() -> None:
    problem = release_problem("2.9.1")
    assert problem == (
        "pytest-torchmem supports torch 2.10 to 2.15, and this is torch 2.9.1: "
        f"{PIP} (or set {ANY_RELEASE_VARIABLE}=1 to try it anyway, with unverified figures)"
    )


def test_a_newer_release_says_to_upgrade_pytest_torchmem() -> None:
    problem = release_problem("2.16.0")
    assert problem == (
        "pytest-torchmem supports torch 2.10 to 2.15, and this is torch 2.16.0, newer than this "
        f"pytest-torchmem knows: upgrade pytest-torchmem, or {PIP} "
        f"(or set {ANY_RELEASE_VARIABLE}=1 to try it anyway, with unverified figures)"
    )


def test_a_local_version_suffix_is_kept_in_the_line_and_ignored_in_the_check() -> None:
    assert release_problem("2.13.0+cu130") is None
    problem = release_problem("2.9.1+cu130")
    assert problem is not None and "this is torch 2.9.1+cu130:" in problem and "\n" not in problem
    assert "newer" in (release_problem("2.16.0+cu130") or "")


def test_a_string_that_is_no_version_is_refused() -> None:
    with pytest.raises(ValueError, match="not a torch version"):
        release_problem("nightly")


@pytest.fixture
def torch_2_9(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The running torch says it is 2.9.1 (the check's cache cleared before and after)."""
    monkeypatch.delenv(ANY_RELEASE_VARIABLE, raising=False)
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    torch_release._problem.cache_clear()
    yield
    monkeypatch.undo()
    torch_release._problem.cache_clear()


@pytest.mark.usefixtures("torch_2_9")
def test_estimate_on_an_unsupported_release_refuses_at_once_with_one_line() -> None:
    with pytest.raises(TorchReleaseError) as raised:
        tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))
    message = str(raised.value)
    assert "\n" not in message
    assert message == release_problem("2.9.1")


@pytest.mark.usefixtures("torch_2_9")
def test_measure_on_an_unsupported_release_refuses_too() -> None:
    with pytest.raises(TorchReleaseError, match=r"this is torch 2\.9\.1"):
        tm.measure(nn.Linear(2, 2), torch.randn(1, 2))


@pytest.mark.usefixtures("torch_2_9")
def test_the_variable_lets_an_unsupported_release_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ANY_RELEASE_VARIABLE, "1")
    torch_release._problem.cache_clear()
    assert tm.estimate(nn.Linear(2, 2), torch.randn(1, 2)).peak > 0


@pytest.mark.usefixtures("torch_2_9")
def test_the_variable_set_after_a_refusal_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression guard (issue 36): the variable set in the process after a first refusal
    lets the next estimate run; it is read on each call, not once."""
    with pytest.raises(TorchReleaseError):
        tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))
    monkeypatch.setenv(ANY_RELEASE_VARIABLE, "1")
    assert tm.estimate(nn.Linear(2, 2), torch.randn(1, 2)).peak > 0
    monkeypatch.delenv(ANY_RELEASE_VARIABLE)
    with pytest.raises(TorchReleaseError):
        tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))


# -- in pytest ------------------------------------------------------------------------------

CONFTEST = """
import torch

torch.__version__ = "2.9.1"
"""

TESTS = """
import torch
from torch import nn


def test_memory(torchmem):
    torchmem.check(nn.Linear(2, 2), torch.randn(1, 2))


def test_plain():
    assert torch.ones(1).item() == 1
"""


def test_a_suite_on_an_unsupported_release(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test asking for the fixture is an error at setup with the one line and no
    traceback from pytest_torchmem's files; the other test passes; exit code 1;
    the header says it."""
    package_root = Path(pytest_torchmem.__file__).parent.parent
    monkeypatch.setenv("PYTHONPATH", str(package_root))  # this checkout's package, in the subprocess
    monkeypatch.delenv(ANY_RELEASE_VARIABLE, raising=False)
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider -p no:xdist -p no:randomly")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_m=TESTS)
    result = pytester.runpytest_subprocess("-rE")
    result.assert_outcomes(errors=1, passed=1)
    assert result.ret == 1
    problem = release_problem("2.9.1")
    assert problem is not None
    output = result.outlines
    header = output[: next(i for i, line in enumerate(output) if line.startswith("collected"))]
    assert f"torchmem: {problem}" in header
    result.stdout.fnmatch_lines(["*ERROR at setup of test_memory*", f"torchmem: {problem}"])
    assert not any("pytest_torchmem/" in line or "pytest_torchmem\\" in line for line in output), "\n".join(output)
    assert not any("Traceback" in line for line in output)
    result.stdout.fnmatch_lines(["ERROR test_m.py::test_memory - Failed: torchmem: pytest-torchmem*"])
