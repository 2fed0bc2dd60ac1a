"""A figure is a whole trace, in pytest: a check whose trace stopped fails with where and why,
and writes no entry; an approximate check (an op listed, the trace went on) is a figure,
marked as approximate in the table, the JSON report and the HTML report.

Real pytest sessions (pytester), real snapshot files, real exit codes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)

#: Issue 36, item 7: a DataLoader loop whose batches stay on the host. On the fake cuda
#: device the first matmul meets a host tensor: the trace stops there, as a GPU raises
#: there. (The loader's seed, drawn on the host with ``.item()``, is drawn from a copy of
#: the generator: a value the trace knows.)
LOOP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(8, 32)), batch_size=4)


def train(model):
    for (x,) in loader:
        model({batch}).sum().backward()


def test_loop(torchmem):
    torch.manual_seed(0)
    torchmem.check(train, (nn.Linear(32, 8),))
    torchmem.check(nn.Linear(32, 8), torch.randn(4, 32), name="plain")
"""

#: The line of ``model(...)`` in LOOP.
LOOP_LINE = 10

STOPPED = (
    f"cuda: the trace stopped at test_m.py:{LOOP_LINE} in aten.mm.default: its tensors are on two "
    'devices, cuda and cpu; move the batch to the device (batch.to("cuda")), and any tensor the step '
    "takes from outside its inputs (labels a loss reads: labels.to(logits.device)), as a GPU would require"
)
NO_ESTIMATE = (
    "a trace that stops is no estimate: its figures were not compared with the snapshot, and "
    "--torchmem-update writes no entry for it"
)

#: A boolean mask over an input above the trace's value limit: its size is a stand-in (the
#: largest), listed, and the trace goes on: an approximate figure.
MASKED = """
import torch
from torch import nn


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h[h > 0]


def test_masked(torchmem):
    torch.manual_seed(0)
    torchmem.check(Masked(), torch.randn(4100, 8))
"""


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    # pytester's in-process runs forget the modules imported inside them: import once here
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2), device="cuda")


def _run(pytester: pytest.Pytester, *args: str) -> Any:
    return pytester.runpytest(
        "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:hypothesispytest",
        "--torchmem-devices", "cpu,cuda", *args,
    )


def _entries(pytester: pytest.Pytester) -> dict[str, dict[str, list[str]]]:
    tests = json.loads((pytester.path / "__torchmem__" / "test_m.json").read_text())["tests"]
    return {test: {name: sorted(devices) for name, devices in checks.items()} for test, checks in tests.items()}


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_stopped_check_fails_with_where_and_why_and_writes_no_entry(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """Under --torchmem-update the stopped check writes nothing, the test's other checks
    (the other device, the other name) are written; the run fails (exit 1) with the one
    line, and so does every later run, which compares nothing with it."""
    pytester.makepyfile(test_m=LOOP.format(batch="x"))
    for args in (("--torchmem-update",), ()):
        result = _run(pytester, "--torchmem-json", "report.json", *args, *workers)
        assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(
            ["torchmem: stopped on cuda: test_m.py::test_loop [[]default[]]", STOPPED, NO_ESTIMATE]
        )
        result.stdout.re_match_lines(
            [
                r"test_m\.py::test_loop +cpu +\d",  # (the loader's seed: drawn, known)
                r"test_m\.py::test_loop +cuda( +-){7} +stopped$",
                r"test_m\.py::test_loop \[plain\] +cpu +\d",
            ]
        )
        result.stdout.fnmatch_lines(["torchmem: 4 checks: *, 1 stopped*"])
        assert "accept the change" not in result.stdout.str()
        assert "create the entry" not in result.stdout.str()
        assert _entries(pytester) == {"test_loop": {"default": ["cpu"], "plain": ["cpu", "cuda"]}}
        report = json.loads((pytester.path / "report.json").read_text())
        [cuda] = [r for r in report["results"] if r["name"] == "default" and r["device"] == "cuda"]
        assert (cuda["status"], cuda["failed"], cuda["estimate"], cuda["delta"]) == ("stopped", True, None, None)
        assert cuda["stopped"] == STOPPED.removeprefix("cuda: ")
        assert cuda["approximate"] is False
        assert "aten.mm.default" in cuda["unsupported"]
        assert report["totals"]["stopped"] == 1
    # moved to the device, the check is a figure again: missing, then written
    pytester.makepyfile(test_m=LOOP.format(batch="x.to(next(model.parameters()).device)"))
    assert _run(pytester, "--torchmem-update", *workers).ret == pytest.ExitCode.OK
    assert _entries(pytester) == {"test_loop": {"default": ["cpu", "cuda"], "plain": ["cpu", "cuda"]}}


def test_an_entry_recorded_from_a_stopped_trace_no_longer_passes(pytester: pytest.Pytester) -> None:
    """Issue 36, item 7: before, the stopped trace was an entry (forward 9.50 KiB, backward
    0 B) that every later run passed against. Now the check fails against it; the entry is
    neither compared, nor unused (an update keeps it), nor rewritten."""
    pytester.makepyfile(test_m=LOOP.format(batch="x"))
    path = pytester.path / "__torchmem__" / "test_m.json"
    path.parent.mkdir()
    old = {"backward_peak": 0, "breakdown": {}, "environment": {"gpu": "H100", "torch": torch.__version__},
           "forward_peak": 9728, "modules": {}, "peak": 9728, "reserved_peak": 2097152, "step_peak": 0,
           "unsupported": ["FakeTensorDeviceMismatchError", "aten._local_scalar_dense.default"]}
    assert _run(pytester, "--torchmem-update").ret == pytest.ExitCode.TESTS_FAILED
    snapshot = json.loads(path.read_text())
    snapshot["tests"]["test_loop"]["default"]["cuda"] = old
    path.write_text(json.dumps(snapshot, indent=2, sort_keys=True) + "\n")
    before = path.read_text()
    for args in ((), ("--torchmem-update",)):
        result = _run(pytester, *args)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines([STOPPED])
        assert "unused" not in result.stdout.str().split("torchmem: 4 checks:")[0]
        result.stdout.fnmatch_lines(["torchmem: 4 checks: * 0 unused, 1 stopped*"])
        assert path.read_text() == before


def test_an_approximate_check_is_a_figure_marked_as_approximate(pytester: pytest.Pytester) -> None:
    """It passes against its entry; its figures are marked ``~`` in the table, with a line
    saying what that means, and ``approximate`` in the JSON report."""
    pytester.makepyfile(test_m=MASKED)
    assert _run(pytester, "--torchmem-update").ret == pytest.ExitCode.OK
    result = _run(pytester, "--torchmem-json", "report.json")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.re_match_lines(
        [
            r"test +device +forward +backward +step +peak +reserved +headroom +change +status$",
            r"test_m\.py::test_masked +cpu +~929\.19 KiB +~801\.07 KiB +~0 B +~929\.19 KiB +- +- +0 B +passed$",
            r"test_m\.py::test_masked +cuda +~32\.41 MiB +~64\.25 MiB +~0 B +~64\.25 MiB +~66\.00 MiB +~78\.62 GiB +0 B +passed$",
            r"~ approximate: the trace went on past ops it could not follow exactly$",
        ]
    )
    report = json.loads((pytester.path / "report.json").read_text())
    assert [(r["device"], r["approximate"], r["stopped"]) for r in report["results"]] == [
        ("cpu", True, None),
        ("cuda", True, None),
    ]
    assert all(r["unsupported"] for r in report["results"])  # what the figures went on past
    # a complete check is not marked
    pytester.makepyfile(test_m="def test_linear(torchmem):\n    import torch\n    torchmem.check(torch.nn.Linear(8, 8), torch.randn(2, 8))\n")
    result = _run(pytester, "--torchmem-update", "--torchmem-json", "report.json")
    assert "~" not in result.stdout.str()
    assert not any(r["approximate"] for r in json.loads((pytester.path / "report.json").read_text())["results"])


#: A custom op without a fake kernel, which a conftest's rule runs on fake tensors.
CUSTOM_OP = """
import pytest
import torch


@torch.library.custom_op("torchmem_stops::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.hookimpl(optionalhook=True)
def pytest_torchmem_add_rules(device, rules):
    @rules.implementation(torch.ops.torchmem_stops.double.default)
    def _double(call):
        return torch.empty_like(call.args[0])
"""

OVER_BUDGET = """
import pytest
import torch
from torch import nn

from conftest import double


class Doubling(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return double(self.fc(x))


@pytest.mark.memory_budget(peak=1, devices=("cpu",))
def test_doubling(torchmem):
    torchmem.check(Doubling(), torch.randn(8, 64), train=False)
"""


def test_advice_whose_trace_stops_says_so(pytester: pytest.Pytester) -> None:
    """--torchmem-advise traces with the built-in rules: where the conftest's rule is what
    lets the check's trace through, the advice's stops, and the failure says so in its
    line instead of raising out of the check."""
    pytester.makeconftest(CUSTOM_OP)
    pytester.makepyfile(test_m=OVER_BUDGET)
    result = _run(pytester, "--torchmem-update", "--torchmem-advise")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "cpu peak over budget: estimate *, budget 1 B *",
            "no advice (--torchmem-advise): the trace stopped at test_m.py:14 in "
            "torchmem_stops.double.default: fake tensors cannot run it *",
        ]
    )
    assert _entries(pytester) == {"test_doubling": {"default": ["cpu"]}}
