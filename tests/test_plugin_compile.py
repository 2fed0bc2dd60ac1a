"""``compile=`` through the plugin: real pytest runs, real snapshot files (issue 11).

``compile`` comes from ``torchmem.check(compile=...)``, else the marker's
``compile=``, else ``--torchmem-compile`` / ini ``torchmem_compile``, else
False. A compiled check's entry is keyed ``"<name> @ compiled"`` (with the
options it was given), so one test keeps its eager and compiled figures side
by side, and each is compared with its own entry.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from compiled_zoo import Fusable
from following import follows_compiled

import pytest_torchmem as tm

pytest_plugins = ("pytester",)

HEADER = """
import pytest
import torch
from torch import nn

WIDTH = 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, WIDTH)
        self.down = nn.Linear(WIDTH, 32)

    def forward(self, x):
        h = self.up(self.norm(x))
        h = torch.nn.functional.gelu(h) * torch.sigmoid(h) + torch.tanh(h)
        return x + self.down(h)


torch.manual_seed(0)
MODEL, X = Block(), torch.randn(8, 16, 32)
"""

SOURCES = """
def test_side_by_side(torchmem):
    eager = torchmem.check(MODEL, X)
    compiled = torchmem.check(MODEL, X, compile=True)
    assert compiled["cpu"].forward_peak < eager["cpu"].forward_peak

@pytest.mark.memory_budget(compile={"dynamic": False})
def test_marker(torchmem):
    torchmem.check(MODEL, X)

@pytest.mark.memory_budget(compile=True)
def test_argument_beats_marker(torchmem):
    torchmem.check(MODEL, X, compile=False)
"""


@pytest.fixture(autouse=True)
def _quiet_plugins(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")


def stored(pytester: pytest.Pytester) -> dict[str, Any]:
    return json.loads((pytester.path / "__torchmem__" / "test_m.json").read_text())["tests"]


def _compiled_figures() -> dict[str, int]:
    torch.manual_seed(0)
    model, x = Fusable(), torch.randn(8, 16, 32)
    report = tm.estimate(model, x, compile=True, cpu="avx2:4")
    assert report.unsupported == ()
    return {"forward_peak": report.forward_peak, "backward_peak": report.backward_peak}


@follows_compiled
def test_eager_and_compiled_entries_side_by_side(pytester: pytest.Pytester) -> None:
    """Recorded under their own keys (the plugin's default avx2:4 profile: the compiled
    program is built for it, nothing flagged), then compared, each with its own entry."""
    pytester.makepyfile(test_m=HEADER + SOURCES)
    assert pytester.runpytest_inprocess("--torchmem-update").ret == 0
    tests = stored(pytester)
    assert {test: sorted(checks) for test, checks in tests.items()} == {
        "test_side_by_side": ["default", "default @ compiled"],
        "test_marker": ["default @ compiled dynamic=False"],
        "test_argument_beats_marker": ["default"],
    }
    compiled = tests["test_side_by_side"]["default @ compiled"]["cpu"]
    assert "unsupported" not in compiled
    assert {name: compiled[name] for name in ("forward_peak", "backward_peak")} == _compiled_figures()
    marked = tests["test_marker"]["default @ compiled dynamic=False"]["cpu"]
    assert marked["forward_peak"] == compiled["forward_peak"]
    eager = tests["test_side_by_side"]["default"]["cpu"]
    assert tests["test_argument_beats_marker"]["default"]["cpu"] == eager
    result = pytester.runpytest_inprocess()
    assert result.ret == 0
    result.assert_outcomes(passed=3)


@follows_compiled
def test_a_regression_of_the_compiled_figure_is_reported(pytester: pytest.Pytester) -> None:
    """A wider block: the compiled entry fails on its own, named by its key, with the
    command that accepts it."""
    pytester.makepyfile(
        test_m=HEADER + "def test_block(torchmem):\n    torchmem.check(MODEL, X, compile=True)\n"
    )
    assert pytester.runpytest_inprocess("--torchmem-update").ret == 0
    recorded = stored(pytester)["test_block"]["default @ compiled"]["cpu"]
    pytester.makepyfile(
        test_m=HEADER.replace("WIDTH = 128", "WIDTH = 256")
        + "def test_block(torchmem):\n    torchmem.check(MODEL, X, compile=True)\n"
    )
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*test_m.py::test_block [[]default @ compiled[]]*",
            "*cpu*forward*grew*",
            '*pytest --torchmem-update "test_m.py::test_block"*',
        ]
    )
    assert stored(pytester)["test_block"]["default @ compiled"]["cpu"] == recorded


@pytest.mark.parametrize(
    ("args", "ini"),
    [(["--torchmem-compile"], ""), ([], "torchmem_compile = true")],
    ids=["command-line", "ini"],
)
def test_the_option_compiles_the_checks_that_do_not_say(
    pytester: pytest.Pytester, args: list[str], ini: str
) -> None:
    pytester.makeini(f"[pytest]\ntorchmem_devices = cpu\n{ini}\n")
    pytester.makepyfile(test_m=HEADER + "def test_block(torchmem):\n    torchmem.check(MODEL, X)\n")
    result = pytester.runpytest_inprocess("--collect-only", *args)
    result.stdout.fnmatch_lines(["torchmem: compare, devices cpu, *, compile"])
    if args:  # one run that checks (the ini's reading is the same setting)
        assert pytester.runpytest_inprocess("--torchmem-update", *args).ret == 0
        assert sorted(stored(pytester)["test_block"]) == ["default @ compiled"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"fast"', "memory_budget(compile='fast') must be True, False, None or a dict*"),
        (
            '{"backend": "eager"}',
            "memory_budget(compile={'backend': 'eager'}) does not take 'backend'*",
        ),
        ('{"mode": "fast"}', "memory_budget(compile={'mode': 'fast'}): mode 'fast' is not one of*"),
    ],
)
def test_a_malformed_marker_compile_is_a_collection_error(
    pytester: pytest.Pytester, value: str, message: str
) -> None:
    marked = f"@pytest.mark.memory_budget(compile={value})\n"
    pytester.makepyfile(test_m=HEADER + marked + "def test_x(torchmem):\n    torchmem.check(MODEL, X)\n")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([f"*test_m.py::test_x: {message}"])


def test_two_compiled_checks_alike_need_names(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_m=HEADER
        + "def test_x(torchmem):\n"
        + "    torchmem.check(MODEL, X, compile=True)\n"
        + "    torchmem.check(MODEL, X, compile=True)\n"
    )
    result = pytester.runpytest_inprocess("--torchmem-update")
    result.stdout.fnmatch_lines(
        ["*torchmem.check was called twice without a name as 'default' (compiled alike)*"]
    )
