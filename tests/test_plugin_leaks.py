"""Leak checks in pytest (issue 38): ``memory_budget(leak=...)`` and ``--torchmem-leaks``.

Real pytest runs (pytester), real snapshot files, JSON and HTML reports, real exit
codes: a leaking step fails its test with what grows, by how much, where it was
made, what holds it and the fix; what the first iterations make once passes; the
figures reach the summary, the JSON report (under xdist too) and the HTML report.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)

SUITE = """
import pytest
import torch
from torch import nn


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def evaluate(model, x, running):
    loss = model(x).square().mean()
    running["loss"] = running["loss"] + loss  # no torch.no_grad(): each graph is kept


def train(model, x, opt):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.memory_budget(devices=("cpu",){marker})
def test_evaluation(torchmem):
    torchmem.check(evaluate, (mlp(), torch.randn(16, 32), {{"loss": torch.zeros(())}}))


@pytest.mark.memory_budget(devices=("cpu",){marker})
def test_training(torchmem):
    model = mlp()
    torchmem.check(train, (model, torch.randn(16, 32), torch.optim.AdamW(model.parameters())))
"""

#: The evaluation's growth per iteration, by hand (tests/leak_patterns.py: GROWTH): the
#: graph kept by the running total holds Linear(32, 64)'s output, GELU's and the second
#: Linear's, on a batch of 16, in float32.
GROWTH = 2 * 16 * 64 * 4 + 16 * 8 * 4


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    # pytester's in-process runs forget the modules imported inside them: import them once.
    tm.leaks(lambda x: x.sum(), (torch.randn(2),))
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2), device="cuda")


def _run(pytester: pytest.Pytester, *args: str) -> Any:
    return pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def test_a_leak_fails_its_test_with_what_holds_it_and_the_fix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m=SUITE.format(marker=", leak=0"))
    result = _run(pytester, "--torchmem-update", "--torchmem-json", "report.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert f"test_m.py::test_evaluation [default] leaks on cpu: {tm.format_bytes(GROWTH)} more is held after every iteration, 0 B allowed" in out
    assert "held by running.loss (graph)" in out
    assert "made at test_m.py:12 in evaluate" in out  # the user's line, as pytest shows paths
    assert "fix: running.loss is a tensor whose autograd graph reaches back" in out
    assert "accumulate loss.item() or loss.detach()" in out
    assert "a leak is not accepted by --torchmem-update" in out
    # the snapshot still took the peaks (a leak is no figure to accept), and a second
    # update does not lift the leak either
    assert (pytester.path / "__torchmem__").is_dir()
    assert _run(pytester, "--torchmem-update").ret == pytest.ExitCode.TESTS_FAILED
    # the table's column, the summary and the JSON report
    (row,) = [line for line in out.splitlines() if line.startswith("test_m.py::test_evaluation ")]
    assert "leak / iter" in out and f" {tm.format_bytes(GROWTH)} " in row
    assert f"leak: test_m.py::test_evaluation[default, cpu]: {tm.format_bytes(GROWTH)} per iteration, allowed 0 B: leaks" in out
    assert "leak: test_m.py::test_training[default, cpu]: 0 B per iteration, allowed 0 B: no leak" in out
    leaks = {leak["nodeid"].split("::")[1]: leak for leak in json.loads((pytester.path / "report.json").read_text())["leaks"]}
    assert leaks["test_evaluation"]["per_iteration"] == GROWTH and leaks["test_evaluation"]["leaks"]
    assert sum(source["bytes"] for source in leaks["test_evaluation"]["sources"]) == GROWTH
    assert leaks["test_training"]["per_iteration"] == 0 and not leaks["test_training"]["leaks"]
    # AdamW's state, made by the first step, is held from then on: no growth after it
    first = leaks["test_training"]["held"][0] - leaks["test_training"]["baseline"]
    assert first > 0 and len(set(leaks["test_training"]["held"])) == 1


def test_leak_allows_growth_up_to_its_size(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m=SUITE.format(marker=f', leak="{GROWTH // 1024 + 1} KiB"'))
    result = _run(pytester, "--torchmem-update")
    assert result.ret == pytest.ExitCode.OK
    assert "within the allowance" in result.stdout.str()


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_the_option_checks_every_check(pytester: pytest.Pytester, workers: list[str]) -> None:
    pytester.makepyfile(test_m=SUITE.format(marker=""))
    assert _run(pytester, "--torchmem-update", *workers).ret == pytest.ExitCode.OK  # no leak check asked
    result = _run(pytester, "--torchmem-leaks", "--torchmem-json", "report.json", *workers)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, failed=1)
    leaks = json.loads((pytester.path / "report.json").read_text())["leaks"]
    assert sorted((leak["nodeid"], leak["per_iteration"]) for leak in leaks) == [
        ("test_m.py::test_evaluation", GROWTH),
        ("test_m.py::test_training", 0),
    ]


def test_the_html_report_draws_each_iteration(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m=SUITE.format(marker=", leak=0"))
    _run(pytester, "--torchmem-update", "--torchmem-html", "report.html")
    page = (pytester.path / "report.html").read_text()
    assert page.count('<svg class="leak-chart"') == 2
    assert f"leak check: <strong>{tm.format_bytes(GROWTH)} more held after every iteration</strong>" in page
    assert "leak check: <strong>no growth per iteration</strong>" in page


def test_a_bad_leak_value_is_a_collection_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m=SUITE.format(marker=', leak="a lot"'))
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert "memory_budget(leak='a lot')" in result.stdout.str()
