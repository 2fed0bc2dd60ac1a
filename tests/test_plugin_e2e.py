"""The plugin end to end: real pytest sessions (pytester), real snapshot files, real exit codes."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.plugin.snapshots import FILE_SCHEMA

pytest_plugins = ("pytester",)

HEADER = """
import dataclasses
import pytest
import torch
from torch import nn
"""


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    # The first trace imports much of torch lazily; pytester's in-process runs
    # forget modules imported inside them, so import them out here once.
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))


@pytest.fixture(autouse=True)
def _quiet_plugins(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # Hypothesis' plugin imports hypothesis at the end of every in-process run
    # (pytester forgets the modules a run imported): seconds per run, for nothing.
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")


def snapshot(pytester: pytest.Pytester, module: str = "test_m") -> dict[str, Any]:
    return json.loads((pytester.path / "__torchmem__" / f"{module}.json").read_text())


def entries(pytester: pytest.Pytester, module: str = "test_m") -> dict[str, list[str]]:
    return {test: sorted(checks) for test, checks in snapshot(pytester, module)["tests"].items()}


def make(pytester: pytest.Pytester, body: str, name: str = "test_m") -> None:
    pytester.makepyfile(**{name: HEADER + body})


LINEAR = """
def test_linear(torchmem):
    torchmem.check(nn.Linear(8, {out}), torch.randn(2, 8))
"""


# -- missing entries ----------------------------------------------------------------


def test_missing_entry_fails_prints_the_command_and_writes_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression guard: a missing entry is never created silently, in CI or not."""
    make(pytester, LINEAR.format(out=4))
    for ci in ("", "true"):
        monkeypatch.setenv("CI", ci)
        result = pytester.runpytest()
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(
            [
                "torchmem: missing on cpu, missing on cuda: test_m.py::test_linear [[]default[]]",
                "cpu: no snapshot entry (estimate: peak *)",
                "cuda: no snapshot entry (estimate: peak *)",
                'snapshot: __torchmem__/test_m.json, key "test_linear" > "default" > "cpu" (no such entry)',
                'snapshot: __torchmem__/test_m.json, key "test_linear" > "default" > "cuda" (no such entry)',
                'create the entry with: pytest --torchmem-update "test_m.py::test_linear"',
                "torchmem: 2 checks: 0 passed, 0 regressed, 0 improved, 2 missing, 0 unused",
            ]
        )
        assert not (pytester.path / "__torchmem__").exists()


def test_accept_command_is_relative_to_where_pytest_runs(pytester: pytest.Pytester) -> None:
    pytester.mkpydir("sub")
    make(pytester, LINEAR.format(out=4), name="sub/test_m")
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(
        ['create the entry with: pytest --torchmem-update "sub/test_m.py::test_linear"']
    )
    result = pytester.runpytest(
        "--rootdir", str(pytester.path), "--torchmem-update", "sub/test_m.py::test_linear"
    )
    assert result.ret == 0
    assert (pytester.path / "sub" / "__torchmem__" / "test_m.json").is_file()


# -- the snapshot file ----------------------------------------------------------------


def test_snapshot_file_content_and_a_small_diff_for_one_changed_test(
    pytester: pytest.Pytester,
) -> None:
    body = """
class TestModels:
    def test_a(self, torchmem):
        torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))

    @pytest.mark.parametrize("n", [4, 8])
    def test_b(self, torchmem, n):
        torchmem.check(nn.Linear(8, n), torch.randn(2, 8), train=False, name="eval")
"""
    make(pytester, body)
    assert pytester.runpytest("--torchmem-update").ret == 0
    path = pytester.path / "__torchmem__" / "test_m.json"
    text = path.read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    assert data["schema"] == FILE_SCHEMA
    assert sorted(data["tests"]) == [
        "TestModels::test_a",
        "TestModels::test_b[4]",
        "TestModels::test_b[8]",
    ]
    cpu = data["tests"]["TestModels::test_a"]["default"]["cpu"]
    # Linear(8, 4) on a (2, 8) float input: parameters 8*4*4 + 4*4 = 144 B, input 64 B.
    assert cpu["breakdown"]["parameters"] == 144
    assert cpu["breakdown"]["inputs"] == 64
    assert cpu["peak"] == max(cpu["forward_peak"], cpu["backward_peak"], cpu["step_peak"])
    assert cpu["environment"]["torch"] == torch.__version__
    assert cpu["environment"] == {"torch": torch.__version__, "cpu": "avx2:4"}
    assert data["tests"]["TestModels::test_b[8]"]["eval"]["cpu"]["backward_peak"] == 0

    # Change one test: only its entry's lines change.
    make(
        pytester,
        body.replace("nn.Linear(8, 4), torch.randn(2, 8))", "nn.Linear(8, 6), torch.randn(2, 8))"),
    )
    assert pytester.runpytest("--torchmem-update").ret == 0
    after = path.read_text()
    assert (
        json.loads(after)["tests"]["TestModels::test_b[4]"]
        == data["tests"]["TestModels::test_b[4]"]
    )
    lines, new_lines = text.splitlines(), after.splitlines()
    assert len(lines) == len(new_lines)
    changed = [i for i, (x, y) in enumerate(zip(lines, new_lines, strict=True)) if x != y]
    block = text[: text.index('"TestModels::test_b[4]"')].count("\n")
    assert changed and max(changed) < block


def test_a_training_loop_records_its_first_step_beside_the_loops_figures(
    pytester: pytest.Pytester,
) -> None:
    """A check with an optimizer records the loop's figures (its later steps: Adam's state
    alive through forward and backward) and the first step's beside them, as estimate
    reports them; an entry recorded before the loop (one step's figures, no ``figures``
    in its environment) is not compared with them: the check fails with the command that
    re-records it. The entry of a step without an optimizer stays as it was."""
    body = """
@pytest.mark.memory_budget(devices=["cpu"])
def test_adam(torchmem):
    torch.manual_seed(0)
    torchmem.check(nn.Linear(64, 64), torch.randn(8, 64), optimizer=torch.optim.Adam)

@pytest.mark.memory_budget(devices=["cpu"])
def test_plain(torchmem):
    torchmem.check(nn.Linear(64, 64), torch.randn(8, 64))
"""
    make(pytester, body)
    assert pytester.runpytest("--torchmem-update").ret == 0
    data = snapshot(pytester)
    adam = data["tests"]["test_adam"]["default"]["cpu"]
    report = tm.estimate(
        nn.Linear(64, 64), torch.randn(8, 64), optimizer=torch.optim.Adam, cpu="avx2:4"
    )
    assert report.first_step is not None
    assert adam["first_step"] == report.first_step.to_dict()
    assert (adam["forward_peak"], adam["backward_peak"], adam["step_peak"]) == (
        report.forward_peak,
        report.backward_peak,
        report.step_peak,
    )
    # Adam's two states (2 x 16,640 B) and its step counts (2 x 4 B) are alive in the
    # loop's forward, not in the first step's
    assert adam["forward_peak"] - adam["first_step"]["forward_peak"] == 2 * 16_640 + 2 * 4
    assert adam["peak"] == report.peak == max(*report.phase_peaks().values())
    assert adam["environment"]["figures"] == "training loop"
    plain = data["tests"]["test_plain"]["default"]["cpu"]
    assert "first_step" not in plain and "figures" not in plain["environment"]
    assert pytester.runpytest().ret == 0

    # the file as a version before the loop wrote it: one step's figures
    old = json.loads(json.dumps(data))
    old["schema"] = 2
    first = old["tests"]["test_adam"]["default"]["cpu"].pop("first_step")
    old_adam = old["tests"]["test_adam"]["default"]["cpu"]
    old_adam.update(first, peak=max(first.values()))
    del old_adam["environment"]["figures"]
    (pytester.path / "__torchmem__" / "test_m.json").write_text(json.dumps(old))
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*cpu: the snapshot entry was recorded with other step settings "
            "(figures one step -> training loop)*",
            're-record the entry with its new settings with: pytest --torchmem-update '
            '"test_m.py::test_adam"',
        ]
    )
    assert pytester.runpytest("--torchmem-update").ret == 0
    assert snapshot(pytester) == data


def test_unreadable_snapshot_file_fails_the_check_with_its_name(pytester: pytest.Pytester) -> None:
    make(pytester, LINEAR.format(out=4))
    (pytester.path / "__torchmem__").mkdir()
    (pytester.path / "__torchmem__" / "test_m.json").write_text("<<<<<<< HEAD\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*cannot read snapshot file *test_m.json:1:1: it holds git conflict markers*"]
    )


# -- several checks in one test --------------------------------------------------------


def test_names_tell_checks_apart_and_unnamed_twice_is_an_error(pytester: pytest.Pytester) -> None:
    body = """
def test_two(torchmem):
    a = torchmem.check(nn.Linear(8, 4), torch.randn(2, 8), name="train")
    b = torchmem.check(nn.Linear(8, 4), torch.randn(2, 8), name="eval", train=False)
    assert set(a) == set(b) == {"cpu", "cuda"}
    assert a["cpu"].backward_peak > 0 and b["cpu"].backward_peak == 0

def test_unnamed_twice(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))

def test_bad_name(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8), name="")
"""
    make(pytester, body)
    result = pytester.runpytest("--torchmem-update")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*ValueError: torchmem.check was called twice without a name as 'default' in "
            "test_m.py::test_unnamed_twice; pass name=... to tell several checks in one test apart",
            "*TypeError: torchmem.check(name=...) must be a non-empty string, got ''",
        ]
    )
    assert entries(pytester)["test_two"] == ["eval", "train"]


# -- update, pass, regress, accept -----------------------------------------------------


def test_messages_under_q_and_vv(pytester: pytest.Pytester) -> None:
    make(pytester, LINEAR.format(out=4))
    assert pytester.runpytest("--torchmem-update").ret == 0
    make(pytester, LINEAR.format(out=64))
    quiet = pytester.runpytest("-q")
    quiet.stdout.fnmatch_lines(
        [
            "torchmem: regressed on cpu, regressed on cuda: test_m.py::test_linear [[]default[]]",
            "cpu forward peak grew: estimate *, snapshot *: +*, allowed ±0 B (rtol 0, atol 0 B)",
            "cpu backward peak grew: *",
            "cuda forward peak grew: *",
            'accept the change with: pytest --torchmem-update "test_m.py::test_linear"',
        ]
    )
    assert "categories that moved most" not in quiet.stdout.str()
    loud = pytester.runpytest("-vv")
    loud.stdout.fnmatch_lines(
        [
            "  categories that moved most (at the peak): parameters +*",
            "  figure          estimate        snapshot        change",
            "  forward *",
            'snapshot: __torchmem__/test_m.json, key "test_linear" > "default" > "cpu" (entry)',
            'accept the change with: pytest --torchmem-update "test_m.py::test_linear"',
        ]
    )
    assert loud.ret == quiet.ret == pytest.ExitCode.TESTS_FAILED


def test_tolerances_from_marker_option_and_ini(pytester: pytest.Pytester) -> None:
    make(pytester, LINEAR.format(out=4))
    assert pytester.runpytest("--torchmem-update").ret == 0
    forward = snapshot(pytester)["tests"]["test_linear"]["default"]["cpu"]["forward_peak"]
    make(pytester, LINEAR.format(out=5))  # a little more memory
    assert pytester.runpytest().ret == pytest.ExitCode.TESTS_FAILED
    assert pytester.runpytest("--torchmem-rtol", "0.5").ret == 0
    assert pytester.runpytest("--torchmem-atol", "1 KiB").ret == 0
    pytester.makeini("[pytest]\ntorchmem_rtol = 0.5\n")
    assert pytester.runpytest().ret == 0
    # The marker wins over the ini file.
    make(pytester, "@pytest.mark.memory_budget(rtol=0, atol=0)" + LINEAR.format(out=5))
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [f"cpu forward peak grew: estimate *, snapshot {tm.format_bytes(forward)}: *"]
    )


def test_improvement_is_reported_and_fails_when_asked(pytester: pytest.Pytester) -> None:
    """Regression guard: a shrink beyond the tolerance is reported, and fails only when asked."""
    make(pytester, LINEAR.format(out=64))
    assert pytester.runpytest("--torchmem-update").ret == 0
    make(pytester, LINEAR.format(out=4))
    result = pytester.runpytest()
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "test_m.py::test_linear  cpu * -* improved",
            "test_m.py::test_linear  cuda * -* improved",
            "torchmem: 2 checks: 0 passed, 0 regressed, 2 improved, 0 missing, 0 unused",
        ]
    )
    strict = pytester.runpytest("--torchmem-fail-on-improvement")
    assert strict.ret == pytest.ExitCode.TESTS_FAILED
    strict.stdout.fnmatch_lines(
        [
            "torchmem: improved on cpu, improved on cuda: test_m.py::test_linear [[]default[]]",
            "cpu forward peak shrank: *",
            'accept the change with: pytest --torchmem-update "test_m.py::test_linear"',
        ]
    )
    pytester.makeini("[pytest]\ntorchmem_fail_on_improvement = true\n")
    assert pytester.runpytest().ret == pytest.ExitCode.TESTS_FAILED
    assert pytester.runpytest("--torchmem-update").ret == 0
    assert pytester.runpytest().ret == 0


# -- budgets ---------------------------------------------------------------------------------


def test_budget_exceeded_fails_even_under_update(pytester: pytest.Pytester) -> None:
    """Regression guard: --torchmem-update records the figures but never lifts a budget."""
    body = """
@pytest.mark.memory_budget(peak=100)
def test_over(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))

@pytest.mark.memory_budget(forward="48 MiB", backward="100 MB", step="0 B", peak="0.5 GiB")
def test_within(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
"""
    make(pytester, body)
    for args in (["--torchmem-update"], []):
        result = pytester.runpytest(*args)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.assert_outcomes(passed=1, failed=1)
        result.stdout.fnmatch_lines(
            [
                "torchmem: over budget on cpu, over budget on cuda: test_m.py::test_over [[]default[]]",
                "cpu peak over budget: estimate * B, budget 100 B (memory_budget(peak=...)): * B over",
                "cuda peak over budget: estimate * MiB, budget 100 B (memory_budget(peak=...)): * over",
                "a budget is a hard limit: --torchmem-update does not lift it; *",
            ]
        )
    # The update recorded the figures; the budget still decides.
    assert entries(pytester) == {"test_over": ["default"], "test_within": ["default"]}


def test_class_and_module_markers_merge_closest_first(pytester: pytest.Pytester) -> None:
    body = """
pytestmark = pytest.mark.memory_budget(peak=100, rtol=0.5)

class TestX:
    @pytest.mark.memory_budget(peak="1 GiB")
    def test_raised(self, torchmem):
        torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))

    def test_module_cap(self, torchmem):
        torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
"""
    make(pytester, body)
    result = pytester.runpytest("--torchmem-update")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["torchmem: over budget on cpu, over budget on cuda: test_m.py::TestX::test_module_cap *"]
    )


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (
            'peak="12 parsecs"',
            "memory_budget(peak='12 parsecs'): unknown unit 'parsecs' in '12 parsecs'*",
        ),
        ("forward=-5", "memory_budget(forward=-5): a byte size cannot be negative, got -5"),
        (
            'devices=("cpu", "tpu")',
            "memory_budget(devices=('cpu', 'tpu')): device 'tpu' is not modelled; *",
        ),
        ('rtol="two percent"', "memory_budget(rtol='two percent'): cannot read 'two percent' *"),
        (
            "budget=5",
            "*does not know 'budget'; it takes forward, backward, step, peak, devices, rtol, atol, gpu, cpu, "
            "keep_output, compile, mesh, rank, fits, leak",
        ),
        (
            'gpu="H1000"',
            "memory_budget(gpu='H1000'): unknown GPU profile 'H1000'; known profiles: *H100*",
        ),
        ('"1 GiB"', "*takes keyword arguments only*got positional ('1 GiB',)"),
    ],
)
def test_malformed_marker_is_an_error_at_collection(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    """Regression guard: a bad marker value stops the run at collection, naming the value."""
    make(pytester, f"@pytest.mark.memory_budget({marker})" + LINEAR.format(out=4))
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        ["*ERROR collecting test_m.py*", f"test_m.py::test_linear: {message}"]
    )
    result.assert_outcomes(errors=1)


def test_marker_without_the_fixture_warns(pytester: pytest.Pytester) -> None:
    make(pytester, "@pytest.mark.memory_budget(peak=1)\ndef test_plain():\n    pass\n")
    result = pytester.runpytest()
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        ["*TorchmemWarning: @pytest.mark.memory_budget has no effect on test_m.py::test_plain*"]
    )


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.memory_budget(forward=None, backward=None, step=None, peak=None, devices=None*"
        ]
    )


# -- unused entries --------------------------------------------------------------------------

THREE = """
def test_a(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))

def test_b(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8), name="extra")

def test_c(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
"""


def test_unused_entries_of_deleted_tests_and_dropped_checks(pytester: pytest.Pytester) -> None:
    """Regression guard: stale entries (dropped checks, deleted tests and modules) are found and removed."""
    make(pytester, THREE)
    assert pytester.runpytest("--torchmem-update").ret == 0
    # test_b drops its "extra" check, test_c is deleted, and a module with a snapshot is gone.
    make(
        pytester,
        THREE.replace(
            '    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8), name="extra")\n', ""
        ).split("def test_c")[0],
    )
    orphan = pytester.path / "__torchmem__" / "test_gone.json"
    orphan.write_text((pytester.path / "__torchmem__" / "test_m.json").read_text())
    before = (pytester.path / "__torchmem__" / "test_m.json").read_text()
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # every test passed; the unused entries fail
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            f'unused: __torchmem__/{file}.json: "{test}" > "{name}" > "{device}"'
            for file, test, name in (
                ("test_gone", "test_a", "default"),
                ("test_gone", "test_b", "default"),
                ("test_gone", "test_b", "extra"),
                ("test_gone", "test_c", "default"),
                ("test_m", "test_b", "extra"),
                ("test_m", "test_c", "default"),
            )
            for device in ("cpu", "cuda")
        ]
        + [
            "12 unused snapshot entries fail this run: remove them by rerunning these tests with --torchmem-update",
            "torchmem: 4 checks: 4 passed, 0 regressed, 0 improved, 0 missing, 12 unused",
        ]
    )
    assert (pytester.path / "__torchmem__" / "test_m.json").read_text() == before
    assert pytester.runpytest("--collect-only").ret == 0  # nothing ran: nothing judged
    assert pytester.runpytest("--torchmem-unused=warn").ret == 0
    ignored = pytester.runpytest("-p", "no:randomly", "--torchmem-unused", "ignore")
    assert ignored.ret == 0 and "unused:" not in ignored.stdout.str()
    pytester.makeini("[pytest]\ntorchmem_unused = warn\n")
    assert pytester.runpytest().ret == 0
    # The update removes them, and the emptied orphan file.
    result = pytester.runpytest("--torchmem-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["removed 12 unused snapshot entries"])
    assert entries(pytester) == {"test_a": ["default"], "test_b": ["default"]}
    assert not orphan.exists()


def test_unused_judged_only_over_tests_that_ran(pytester: pytest.Pytester) -> None:
    """Regression guard: -k, node ids, skips and failures must not make entries look unused."""
    make(pytester, THREE)
    assert pytester.runpytest("--torchmem-update").ret == 0
    assert pytester.runpytest("-k", "test_a").ret == 0
    assert pytester.runpytest("test_m.py::test_a").ret == 0
    assert pytester.runpytest("--deselect", "test_m.py::test_b").ret == 0
    # A test that fails before its second check, or skips, is not judged either.
    make(
        pytester,
        THREE.replace(
            'name="extra")', 'name="extra") if False else None\n    assert False'
        ).replace("def test_c(torchmem):", "def test_c(torchmem):\n    pytest.skip('no GPU')"),
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    assert "unused:" not in result.stdout.str()
    result.stdout.fnmatch_lines(["torchmem: 4 checks: 4 passed, *, 0 unused"])
    # Under --torchmem-update with -k, the other tests' entries are kept.
    make(pytester, THREE)
    assert pytester.runpytest("--torchmem-update", "-k", "test_a").ret == 0
    assert entries(pytester) == {
        "test_a": ["default"],
        "test_b": ["default", "extra"],
        "test_c": ["default"],
    }


# -- options and their ini twins -----------------------------------------------------------------


def test_every_option_has_an_ini_twin(pytester: pytest.Pytester) -> None:
    make(pytester, LINEAR.format(out=4))
    pytester.makeini(
        """
[pytest]
torchmem_update = true
torchmem_devices = cpu
torchmem_rtol = 0.25
torchmem_atol = 2 KiB
torchmem_unused = warn
torchmem_json = reports/torchmem.json
torchmem_measure = off
torchmem_measure_rtol = 0.1
torchmem_gpu = A100
torchmem_cpu = AVX512:8
torchmem_fail_on_improvement = true
torchmem_stale = fail
torchmem_keep_output = true
"""
    )
    result = pytester.runpytest()
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "torchmem: update, devices cpu, rtol 0.25, atol 2.00 KiB, gpu profile A100, cpu profile "
            "avx512:8, keep_output"
        ]
    )
    settings = json.loads((pytester.path / "reports" / "torchmem.json").read_text())["settings"]
    assert settings == {
        "update": True,
        "devices": ["cpu"],
        "rtol": 0.25,
        "atol": 2048,
        "unused": "warn",
        "measure": "off",
        "measure_rtol": 0.1,
        "gpu_profile": "A100",
        "cpu_profile": "avx512:8",
        "fail_on_improvement": True,
        "stale": "fail",
        "keep_output": True,
        "compile": False,
        "per_torch": False,
        "leaks": False,
        "measured_on_gpu": False,
    }
    assert (pytester.path / "__torchmem__" / "test_m.json").is_file()
    # The command line wins over the ini file.
    result = pytester.runpytest(
        "--torchmem-gpu", "H200", "--torchmem-rtol", "0", "--torchmem-json", "cli.json",
        "--torchmem-cpu", "default:1",
    )
    assert result.ret == 0
    settings = json.loads((pytester.path / "cli.json").read_text())["settings"]
    assert settings["gpu_profile"] == "H200" and settings["rtol"] == 0.0
    assert settings["cpu_profile"] == "default:1"


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        (
            ["--torchmem-devices", "cpu,tpu"],
            "",
            "--torchmem-devices: device 'tpu' is not modelled; use one of: cpu*",
        ),
        (
            [],
            "torchmem_devices = gpu",
            "ini option torchmem_devices: device 'gpu' is not modelled*",
        ),
        (
            ["--torchmem-rtol", "-1"],
            "",
            "--torchmem-rtol: a relative tolerance cannot be negative, got -1.0",
        ),
        (
            [],
            "torchmem_atol = lots",
            "ini option torchmem_atol: cannot read 'lots' as a byte size*",
        ),
        (
            [],
            "torchmem_unused = sometimes",
            "ini option torchmem_unused: expected one of fail, warn, ignore, got 'sometimes'",
        ),
        (
            ["--torchmem-unused", "never"],
            "",
            "*argument --torchmem-unused: invalid choice: 'never'*",
        ),
        (
            ["--torchmem-gpu", "H1000"],
            "",
            "--torchmem-gpu: unknown GPU profile 'H1000'; known profiles: V100, *, H100, *",
        ),
        (
            [],
            "torchmem_gpu = TPUv5",
            "ini option torchmem_gpu: unknown GPU profile 'TPUv5'; known profiles: *",
        ),
        (
            [],
            "torchmem_stale = sometimes",
            "ini option torchmem_stale: expected one of warn, fail, got 'sometimes'",
        ),
    ],
)
def test_bad_option_values_are_usage_errors(
    pytester: pytest.Pytester, args: list[str], ini: str, message: str
) -> None:
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_measure_on_without_a_gpu_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--torchmem-measure=on")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--torchmem-measure=on compares the estimate with a real GPU run*"]
    )


def test_devices_default_option_and_marker(pytester: pytest.Pytester) -> None:
    """Both fake devices by default; the option narrows the default; the marker wins."""
    body = """
@pytest.mark.memory_budget(devices="cpu")
def test_marked(torchmem):
    assert set(torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))) == {"cpu"}

def test_default(torchmem, request):
    wanted = request.config.getoption("torchmem_devices") or "cpu,cuda"
    assert set(torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))) == set(wanted.split(","))
"""
    make(pytester, body)
    assert pytester.runpytest("--torchmem-update").ret == 0
    stored = snapshot(pytester)["tests"]
    assert sorted(stored["test_default"]["default"]) == ["cpu", "cuda"]
    assert sorted(stored["test_marked"]["default"]) == ["cpu"]
    cpu, cuda = stored["test_default"]["default"]["cpu"], stored["test_default"]["default"]["cuda"]
    assert "reserved_peak" not in cpu
    assert cuda["reserved_peak"] >= cuda["peak"] > 0
    assert cuda["environment"] == {"gpu": "H100", "torch": torch.__version__}
    # Narrowed to cuda on the command line: the cpu entry of test_default is not unused.
    result = pytester.runpytest("--torchmem-devices", "cuda")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["test_m.py::test_default  cuda *passed", "*0 unused"])
    assert "test_m.py::test_default  cpu" not in result.stdout.str()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_a_cpu_tensor_captured_by_loss_fn_gets_a_hint_on_cuda(pytester: pytest.Pytester) -> None:
    body = """
def test_labels(torchmem):
    labels = torch.tensor([0, 1])
    torchmem.check(
        nn.Linear(8, 4), torch.randn(2, 8),
        loss_fn=lambda logits: nn.functional.cross_entropy(logits, labels),
    )
"""
    make(pytester, body)
    result = pytester.runpytest("--torchmem-update")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["cuda: the trace stopped at test_m.py:* its tensors are on two devices, cuda and cpu;*"])
    assert "labels.to(logits.device)" in result.stdout.str()


# -- the GPU profile ---------------------------------------------------------------------------

GPU_BODY = """
def test_h100(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))

@pytest.mark.memory_budget(gpu="a100")
def test_a100(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
"""


def test_gpu_profile_from_marker_option_and_ini(pytester: pytest.Pytester) -> None:
    """The cuda estimate follows the GPU profile: marker first, then --torchmem-gpu / ini, then H100."""
    make(pytester, GPU_BODY)
    assert pytester.runpytest("--torchmem-update").ret == 0
    stored = snapshot(pytester)["tests"]
    h100, a100 = stored["test_h100"]["default"]["cuda"], stored["test_a100"]["default"]["cuda"]
    assert h100["environment"]["gpu"] == "H100"
    assert a100["environment"]["gpu"] == "A100"  # the marker's name, spelled as the profile's
    # The profile changes the figures (cuBLAS sizes its workspace by architecture), not the cpu ones.
    assert a100["breakdown"]["workspace"] < h100["breakdown"]["workspace"]
    assert stored["test_h100"]["default"]["cpu"] == stored["test_a100"]["default"]["cpu"]
    # Another profile for the run: the H100 entry is stale (not compared), the marker still wins.
    pytester.makeini("[pytest]\ntorchmem_gpu = A100\n")
    result = pytester.runpytest()
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "torchmem: compare, devices cpu,cuda, rtol 0, atol 0 B, gpu profile A100, cpu profile avx2:4",
            "test_m.py::test_h100  cuda * gpu H100 -> A100  stale",
            "torchmem: 4 checks: 3 passed, 0 regressed, 0 improved, 0 missing, 0 unused, 1 stale",
        ]
    )
    assert pytester.runpytest("--torchmem-gpu", "h100").ret == 0  # the command line wins


# -- stale environments --------------------------------------------------------------------------


def test_entry_from_another_environment_is_stale(pytester: pytest.Pytester) -> None:
    """Regression guard: an entry recorded on another machine is reported stale, never compared as bytes."""
    make(pytester, LINEAR.format(out=4))
    assert pytester.runpytest("--torchmem-update").ret == 0
    path = pytester.path / "__torchmem__" / "test_m.json"
    data = json.loads(path.read_text())
    cpu = data["tests"]["test_linear"]["default"]["cpu"]
    assert cpu["environment"]["cpu"] == "avx2:4"  # the plugin's default CPU profile
    # Recorded for a bigger CPU, whose kernels needed other scratch: the bytes differ too.
    cpu["environment"]["cpu"] = "avx512:8"
    cpu["forward_peak"] = 8
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    result = pytester.runpytest()
    assert result.ret == 0  # by default a stale entry is reported, and does not fail
    result.stdout.fnmatch_lines(
        [
            "test_m.py::test_linear  cpu * cpu avx512:8 -> avx2:4  stale",
            "test_m.py::test_linear  cuda * 0 B * passed",
            (
                "stale: test_m.py::test_linear on cpu: snapshot environment differs (cpu "
                "avx512:8 -> avx2:4); re-record on this machine with: "
                'pytest --torchmem-update "test_m.py::test_linear"'
            ),
            (
                "1 stale check was not compared: its snapshot entry was recorded in another "
                "environment (--torchmem-stale=warn; budgets still apply)"
            ),
            "torchmem: 2 checks: 1 passed, 0 regressed, 0 improved, 0 missing, 0 unused, 1 stale",
        ]
    )
    for args, ini in ((["--torchmem-stale=fail"], ""), ([], "[pytest]\ntorchmem_stale = fail\n")):
        pytester.makeini(ini)
        strict = pytester.runpytest(*args)
        assert strict.ret == pytest.ExitCode.TESTS_FAILED
        strict.stdout.fnmatch_lines(
            [
                "torchmem: stale on cpu: test_m.py::test_linear [[]default[]]",
                (
                    "cpu: the snapshot entry was recorded in another environment "
                    "(cpu avx512:8 -> avx2:4): its figures are not compared "
                    "with this run's (estimate: peak *, snapshot: peak *)"
                ),
                're-record the entry on this machine with: pytest --torchmem-update "test_m.py::test_linear"',
                "test_m.py::test_linear  cpu * stale (failed)",
            ]
        )
    pytester.makeini("")
    # Budgets still apply to a stale entry.
    make(pytester, "@pytest.mark.memory_budget(peak=100)" + LINEAR.format(out=4))
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "torchmem: over budget on cpu, over budget on cuda: test_m.py::test_linear *",
            "cpu peak over budget: *",
            "cpu: the snapshot entry was recorded in another environment *",
        ]
    )
    # Re-recording on this machine makes the entry current again.
    make(pytester, LINEAR.format(out=4))
    result = pytester.runpytest("--torchmem-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["test_m.py::test_linear  cpu * updated"])
    assert pytester.runpytest().ret == 0
    assert (
        json.loads(path.read_text())["tests"]["test_linear"]["default"]["cpu"]["environment"]["cpu"]
        == "avx2:4"
    )


# -- reports -------------------------------------------------------------------------------------


def test_json_report(pytester: pytest.Pytester) -> None:
    make(pytester, THREE)
    assert pytester.runpytest("--torchmem-update").ret == 0
    make(
        pytester,
        THREE.replace(
            "def test_c(torchmem):\n    torchmem.check(nn.Linear(8, 4)",
            "def test_c(torchmem):\n    torchmem.check(nn.Linear(8, 9)",
        ),
    )
    result = pytester.runpytest("-k", "not test_b", "--torchmem-json", "out/report.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    assert report["schema"] == 1
    assert set(report["environment"]) >= {
        "torch",
        "python",
        "platform",
        "gpu_profile",
        "cpu_profile",
        "cpu_threads",
    }
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["gpu_profile"] == "H100"
    # On cuda, Linear(8, 9) still fits the 512-byte blocks of Linear(8, 4): no change there.
    assert report["totals"] == {
        "passed": 3,
        "regressed": 1,
        "improved": 0,
        "missing": 0,
        "unused": 0,
        "stopped": 0,
        "over budget": 0,
        "mismatch": 0,
        "stale": 0,
        "new": 0,
        "updated": 0,
        "not written": 0,
        "checks": 4,
        "failed": 1,
    }
    by_test = {(entry["test"], entry["device"]): entry for entry in report["results"]}
    stored = snapshot(pytester)["tests"]
    passed, regressed = by_test["test_a", "cpu"], by_test["test_c", "cpu"]
    assert by_test["test_c", "cuda"]["status"] == "passed"
    assert by_test["test_c", "cuda"]["environment"] == {"gpu": "H100", "torch": torch.__version__}
    assert (
        by_test["test_c", "cuda"]["estimate"]["reserved"]
        >= by_test["test_c", "cuda"]["estimate"]["peak"]
    )
    assert passed["status"] == "passed" and not passed["failed"]
    assert passed["estimate"]["peak"] == stored["test_a"]["default"]["cpu"]["peak"]
    assert passed["delta"] == {"forward": 0, "backward": 0, "step": 0, "peak": 0}
    assert passed["stale"] == {}
    assert regressed["status"] == "regressed" and regressed["failed"]
    assert regressed["snapshot"]["forward"] == stored["test_c"]["default"]["cpu"]["forward_peak"]
    assert (
        regressed["delta"]["forward"]
        == regressed["estimate"]["forward"] - regressed["snapshot"]["forward"]
        > 0
    )
    assert regressed["accept"] == 'pytest --torchmem-update "test_m.py::test_c"'
    assert regressed["snapshot_file"] == "__torchmem__/test_m.json"
    assert regressed["tolerance"] == {"rtol": 0.0, "atol": 0}
    assert regressed["breakdown"]["parameters"] == (8 * 9 + 9) * 4


def test_terminal_table_and_totals(pytester: pytest.Pytester) -> None:
    make(pytester, THREE)
    result = pytester.runpytest("--torchmem-update")
    result.stdout.fnmatch_lines(
        [
            "*- torchmem -*",
            "test *device*forward*backward*step*peak*change*status",
            "test_m.py::test_a  * cpu  * B  * B  * 0 B  * B  * -  * new",
            "test_m.py::test_a  * cuda * MiB * MiB * 0 B * MiB * -  * new",
            "test_m.py::test_b [[]extra[]] *cpu*new",
            "test_m.py::test_b [[]extra[]] *cuda*new",
            "wrote __torchmem__/test_m.json",
            "torchmem: 8 checks: 0 passed, 0 regressed, 0 improved, 0 missing, 0 unused, 8 new",
        ]
    )
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(
        ["test_m.py::test_a  * cpu * 0 B * passed", "test_m.py::test_a  * cuda * 0 B * passed"]
    )
    quiet = pytester.runpytest("-q")  # passes only: just the totals
    assert "test_m.py::test_a " not in quiet.stdout.str()
    quiet.stdout.fnmatch_lines(
        ["torchmem: 8 checks: 8 passed, 0 regressed, 0 improved, 0 missing, 0 unused"]
    )


def test_junitxml_properties(pytester: pytest.Pytester) -> None:
    make(pytester, LINEAR.format(out=4))
    assert pytester.runpytest("--torchmem-update").ret == 0
    assert pytester.runpytest("--junitxml", "junit.xml").ret == 0
    case = ET.parse(pytester.path / "junit.xml").getroot().find(".//testcase[@name='test_linear']")
    assert case is not None
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    stored = snapshot(pytester)["tests"]["test_linear"]["default"]["cpu"]
    assert properties["torchmem.default.cpu.peak"] == str(stored["peak"])
    assert properties["torchmem.default.cpu.forward_peak"] == str(stored["forward_peak"])
    assert properties["torchmem.default.cpu.backward_peak"] == str(stored["backward_peak"])
    assert properties["torchmem.default.cpu.step_peak"] == "0"
    assert properties["torchmem.default.cpu.snapshot_peak"] == str(stored["peak"])
    assert properties["torchmem.default.cpu.status"] == "passed"


# -- hooks -------------------------------------------------------------------------------------------

RULE_CONFTEST = """
import torch
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc

def pytest_torchmem_add_rules(device, rules):
    if device == "cpu":
        @rules.scratch(torch.ops.aten.tanh.default)
        def _tanh(call):
            return [OUTPUTS, Alloc("lookup table", 2**20)]
"""

TANH = """
def test_tanh(torchmem):
    reports = torchmem.check(nn.Tanh(), torch.randn(4, 8), train=False)
    assert reports["cpu"].forward_peak == {expected}
"""


def test_conftest_adds_a_per_op_rule_to_its_own_tests_only(pytester: pytest.Pytester) -> None:
    """Regression guard: a conftest's rule applies under its directory and never changes the built-in rules."""
    aten = torch.ops.aten
    assert CPU.scratch_rule(aten.tanh.default) is None  # else pick another op for this test
    # Forward only: the input (4*8 floats = 128 B), tanh's output (128 B) and, with the rule, 1 MiB of scratch.
    pytester.mkdir("ruled")
    pytester.mkdir("plain")
    (pytester.path / "ruled" / "conftest.py").write_text(RULE_CONFTEST)
    (pytester.path / "ruled" / "test_r.py").write_text(
        HEADER + TANH.format(expected=128 + 128 + 2**20)
    )
    (pytester.path / "plain" / "test_p.py").write_text(HEADER + TANH.format(expected=128 + 128))
    result = pytester.runpytest("--torchmem-update")
    result.assert_outcomes(passed=2)
    assert CPU.scratch_rule(aten.tanh.default) is None
    assert tm.estimate(nn.Tanh(), torch.randn(4, 8), train=False).forward_peak == 256


def test_conftest_rule_for_an_op_with_a_rule_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
import torch
from pytest_torchmem.engine.tracing.rules import OUTPUTS

def pytest_torchmem_add_rules(device, rules):
    rules.scratch(torch.ops.aten.tanh.default)(lambda call: [OUTPUTS])
    rules.scratch(torch.ops.aten.tanh.default)(lambda call: [OUTPUTS])
"""
    )
    make(pytester, TANH.format(expected=256))
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["*ValueError: cpu: aten.tanh.default already has a scratch rule*"])


def test_conftest_adjusts_a_report(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
import dataclasses

def pytest_torchmem_adjust_report(item, device, name, report):
    if name == "with context":
        return dataclasses.replace(report, forward_peak=report.forward_peak + 1000)
    return None
"""
    )
    body = """
def test_adjusted(torchmem):
    model, x = nn.Linear(8, 4), torch.randn(2, 8)
    plain = torchmem.check(model, x, train=False)["cpu"]
    adjusted = torchmem.check(model, x, train=False, name="with context")["cpu"]
    assert adjusted.forward_peak == plain.forward_peak + 1000
"""
    make(pytester, body)
    assert pytester.runpytest("--torchmem-update").ret == 0
    stored = snapshot(pytester)["tests"]["test_adjusted"]
    assert (
        stored["with context"]["cpu"]["forward_peak"]
        == stored["default"]["cpu"]["forward_peak"] + 1000
    )
    assert pytester.runpytest().ret == 0


def test_adjust_report_must_return_a_report(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "def pytest_torchmem_adjust_report(item, device, name, report):\n    return 5\n"
    )
    make(pytester, LINEAR.format(out=4))
    result = pytester.runpytest("--torchmem-update")
    result.stdout.fnmatch_lines(
        ["*torchmem: pytest_torchmem_adjust_report must return a MemoryReport or None, got int"]
    )


def test_help_lists_every_option(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    for option in (
        "--torchmem-update",
        "--torchmem-devices=NAMES",
        "--torchmem-rtol=R",
        "--torchmem-atol=SIZE",
        "--torchmem-unused=*",
        "--torchmem-json=PATH",
        "--torchmem-measure=*",
        "--torchmem-measure-rtol=R",
        "--torchmem-gpu=NAME",
        "--torchmem-fail-on-improvement",
        "--torchmem-per-torch",
        "--torchmem-stale=*",
    ):
        result.stdout.fnmatch_lines([f"*{option}*"])
    for ini in (
        "torchmem_update",
        "torchmem_devices",
        "torchmem_rtol",
        "torchmem_atol",
        "torchmem_unused",
        "torchmem_json",
        "torchmem_measure",
        "torchmem_measure_rtol",
        "torchmem_gpu",
        "torchmem_fail_on_improvement",
        "torchmem_per_torch",
        "torchmem_stale",
    ):
        result.stdout.fnmatch_lines([f"*{ini} (*"])
