"""``keep_output`` and user-shaped inputs through the plugin: real pytest runs, real snapshot files.

``keep_output`` comes from ``torchmem.check(keep_output=...)``, else the
marker's ``keep_output=``, else ``--torchmem-keep-output`` / ini
``torchmem_keep_output``, else False. An entry records ``"keep_output": true``
in its environment (nothing for the default, so existing snapshots stay as they
were); an entry recorded with the other setting is never compared and fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)

Run = Callable[..., pytest.RunResult]

HEADER = """
import collections
import dataclasses
import pytest
import torch
from torch import nn

torch.manual_seed(0)
MODEL, X = nn.Linear(64, 512), torch.randn(32, 64)
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


def stored(pytester: pytest.Pytester) -> dict[str, Any]:
    return json.loads((pytester.path / "__torchmem__" / "test_m.json").read_text())["tests"]


def _figures(keep_output: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model, x = nn.Linear(64, 512), torch.randn(32, 64)
    report = tm.estimate(model, x, keep_output=keep_output, cpu="avx2:4")
    return {"forward_peak": report.forward_peak, "backward_peak": report.backward_peak}


SOURCES = """
def test_default(torchmem):
    torchmem.check(MODEL, X)

def test_argument(torchmem):
    torchmem.check(MODEL, X, keep_output=True)

@pytest.mark.memory_budget(keep_output=True)
def test_marker(torchmem):
    torchmem.check(MODEL, X)

@pytest.mark.memory_budget(keep_output=True)
def test_argument_beats_marker(torchmem):
    torchmem.check(MODEL, X, keep_output=False)

@pytest.mark.memory_budget(keep_output=False)
def test_marker_beats_option(torchmem):
    torchmem.check(MODEL, X)
"""


@pytest.mark.parametrize(
    ("args", "ini"),
    [([], ""), (["--torchmem-keep-output"], ""), ([], "torchmem_keep_output = true")],
    ids=["no-option", "command-line", "ini"],
)
def test_where_keep_output_comes_from(pytester: pytest.Pytester, args: list[str], ini: str) -> None:
    pytester.makeini(f"[pytest]\ntorchmem_devices = cpu\n{ini}\n")
    pytester.makepyfile(test_m=HEADER + SOURCES)
    result = pytester.runpytest_inprocess("--torchmem-update", *args)
    assert result.ret == 0
    option = bool(args or ini)
    if option:
        result.stdout.fnmatch_lines(["torchmem: update, devices cpu, *, keep_output"])
    expected = {
        "test_default": option,
        "test_argument": True,
        "test_marker": True,
        "test_argument_beats_marker": False,
        "test_marker_beats_option": False,
    }
    entries = {test: checks["default"]["cpu"] for test, checks in stored(pytester).items()}
    for test, keep_output in expected.items():
        entry = entries[test]
        assert ("keep_output" in entry["environment"]) == keep_output, test
        assert entry["environment"].get("keep_output", False) == keep_output
        figures = {name: entry[name] for name in ("forward_peak", "backward_peak")}
        assert figures == _figures(keep_output), test
    assert pytester.runpytest_inprocess(*args).ret == 0


def test_flipping_keep_output_fails_until_the_entry_is_re_recorded(
    pytester: pytest.Pytester, run: Run
) -> None:
    """The entry made with keep_output=False is not compared with a keep_output=True
    check (whose backward peak is 64 KiB higher here: the (32, 512) output), even
    under the default --torchmem-stale=warn: the test changed what it measures.
    Under -n 2 the verdict travels from the worker to the controller's summary."""
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    pytester.makepyfile(test_m=HEADER + "def test_lm(torchmem):\n    torchmem.check(MODEL, X)\n")
    assert pytester.runpytest_inprocess("--torchmem-update").ret == 0
    path = pytester.path / "__torchmem__" / "test_m.json"
    recorded = path.read_text()
    assert "keep_output" not in recorded

    pytester.makepyfile(
        test_m=HEADER + "def test_lm(torchmem):\n    torchmem.check(MODEL, X, keep_output=True)\n"
    )
    result = run()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*torchmem: stale on cpu: test_m.py::test_lm [[]default[]]",
            (
                "*cpu: the snapshot entry was recorded with other step settings "
                "(keep_output False -> True): its figures are not compared with this run's *"
            ),
            '*re-record the entry with its new settings with: pytest --torchmem-update "test_m.py::test_lm"',
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "stale: test_m.py::test_lm on cpu: snapshot step settings differ (keep_output False -> "
            'True); re-record with: pytest --torchmem-update "test_m.py::test_lm"',
            "1 check failed: its snapshot entry was recorded with other step settings",
        ]
    )
    assert path.read_text() == recorded  # nothing written without --torchmem-update

    assert pytester.runpytest_inprocess("--torchmem-update").ret == 0
    entry = stored(pytester)["test_lm"]["default"]["cpu"]
    assert entry["environment"]["keep_output"] is True
    assert entry["backward_peak"] - json.loads(recorded)["tests"]["test_lm"]["default"]["cpu"][
        "backward_peak"
    ] == 32 * 512 * 4
    assert pytester.runpytest_inprocess().ret == 0


def test_a_marker_keep_output_that_is_not_a_bool_is_a_collection_error(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_m=HEADER
        + '@pytest.mark.memory_budget(keep_output="yes")\ndef test_x(torchmem):\n    torchmem.check(MODEL, X)\n'
    )
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        ["*test_m.py::test_x: memory_budget(keep_output='yes'): keep_output must be True or False*"]
    )


INPUTS = """
@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    extra: dict

class TakesBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, batch, scale):
        return self.fc(batch.x) * batch.extra["w"] * scale

def test_user_shaped_inputs(torchmem):
    batch = Batch(torch.randn(4, 8), {"w": torch.randn(8)})
    reports = torchmem.check(TakesBatch(), collections.UserDict(batch=batch, scale=torch.ones(8)))
    assert reports["cpu"].breakdown["inputs"] == (4 * 8 + 8 + 8) * 4
"""


def test_check_takes_mappings_and_nested_dataclasses(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m=HEADER + INPUTS)
    assert pytester.runpytest_inprocess("--torchmem-update").ret == 0
    assert sorted(stored(pytester)["test_user_shaped_inputs"]["default"]) == ["cpu", "cuda"]
    result = pytester.runpytest_inprocess()
    assert result.ret == 0
    result.assert_outcomes(passed=1)
