"""Every example suite in ``examples/`` passes against its committed snapshots; CI gates on them."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from examples_verdict import installed, verdict

from pytest_torchmem.engine.torch_compat.torch_release import PIPELINING, installed_release

pytest_plugins = ("pytester",)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SUITES = sorted(path.parent.name for path in EXAMPLES.glob("*/test_*.py"))


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))  # see test_plugin_e2e
    # The frameworks the suites import (and what they import lazily as they train: peft,
    # by transformers' Trainer), imported before pytester's in-process runs snapshot
    # sys.modules: a run's teardown drops what it imported, and a later import makes
    # second copies of their classes (peft then refuses GPT-2's Conv1D of the first).
    for name in ("transformers", "transformers.trainer", "peft", "accelerate", "lightning"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


@pytest.fixture(autouse=True)
def _quiet_plugins(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")


#: The examples keep one snapshot directory per torch release (the project's ini:
#: torchmem_per_torch), as a project tested on several releases does.
RELEASE_DIR = "torch-{}.{}".format(*installed_release()[:2])


#: Suites of a feature the estimate follows on some releases only: their first and last.
#: Elsewhere the suite skips itself, and has no snapshots of that release.
GATED = {"pipeline": PIPELINING}


def runs_here(name: str) -> bool:
    window = GATED.get(name)
    return window is None or window[0] <= tuple(installed_release()[:2]) <= window[1]


def copy_suite(pytester: pytest.Pytester, name: str) -> Path:
    target = pytester.path / name
    shutil.copytree(EXAMPLES / name, target)
    pytester.makeini("[pytest]\ntorchmem_per_torch = true\n")
    return target


def test_there_are_the_three_promised_suites() -> None:
    assert {"mlp", "cnn", "transformer"} <= set(SUITES)
    for name in SUITES:
        (module,) = (EXAMPLES / name).glob("test_*.py")
        snapshot = EXAMPLES / name / "__torchmem__" / RELEASE_DIR / f"{module.stem}.json"
        if not runs_here(name):
            assert not snapshot.exists(), f"{snapshot}: the suite skips itself on this torch"
            continue
        assert json.loads(snapshot.read_text())["tests"], f"{snapshot} is not committed for this torch"


@pytest.mark.parametrize("name", SUITES)
def test_example_suite_passes_against_its_committed_snapshot(
    pytester: pytest.Pytester, name: str
) -> None:
    copy_suite(pytester, name)
    result = pytester.runpytest_inprocess(name, "--torchmem-unused=fail")
    if not runs_here(name):
        assert result.ret == 0, result.stdout.str()
        result.stdout.fnmatch_lines(["*skipped*"])
        assert "passed" not in result.stdout.str().splitlines()[-1]
        return
    # On failure, the output says which figure moved: after a deliberate change to
    # a device model, accept it with `pytest --torchmem-update examples/<name>`.
    # (On a machine whose CPU threads or ISA differ from the snapshots', the cpu
    # checks are stale: reported, not compared.)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        ["torchmem: * checks: * passed, 0 regressed, 0 improved, 0 missing, 0 unused*"]
    )
    assert "cuda" in result.stdout.str()  # both fake devices by default


def test_a_suite_passes_after_another_in_the_same_process(pytester: pytest.Pytester) -> None:
    """Each in-process run drops the modules it imported: the fake GPU's router, once
    imported lazily by the first suite's trace, was imported again by the second's while
    its routes' modules were not (the package kept them as attributes), and ran the CPU's
    dropout (the script suite's cuda figures 48 KiB over its snapshot)."""
    for name in ("mlp", "script"):
        copy_suite(pytester, name)
        result = pytester.runpytest_inprocess(name, "--torchmem-unused=fail")
        assert result.ret == 0, result.stdout.str()


def test_a_wider_layer_fails_the_cnn_example_and_names_the_modules(
    pytester: pytest.Pytester,
) -> None:
    suite = copy_suite(pytester, "cnn")
    module = suite / "test_cnn.py"
    source = module.read_text()
    assert "block(3, 16), block(16, 32)" in source
    module.write_text(source.replace("block(3, 16), block(16, 32)", "block(3, 24), block(24, 32)"))
    result = pytester.runpytest_inprocess("cnn", "-k", "test_cnn_training_step and 4")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "torchmem: regressed on *: cnn/test_cnn.py::test_cnn_training_step[[]4[]] [[]default[]]",
            "* forward peak grew: *",
            "  categories that moved most (at the peak): *",
            "  modules that moved most (forward peak): features*",
            'accept the change with: pytest --torchmem-update "cnn/test_cnn.py::test_cnn_training_step[[]4[]]"',
        ]
    )


def test_a_kept_loss_and_an_evaluation_without_no_grad_fail_the_leaks_example(
    pytester: pytest.Pytester,
) -> None:
    """The two failures docs/howto/leaks.md shows: each names what grows, where it was
    made, what holds it and the fix."""
    suite = copy_suite(pytester, "leaks")
    module = suite / "test_leaks.py"
    source = module.read_text()
    kept = "self.losses.append(loss.item())"
    summed = 'with torch.no_grad():\n        totals["loss"] += F.cross_entropy(model(x), y).item()'
    assert kept in source and summed in source
    source = source.replace(kept, "self.losses.append(loss)")
    # the total of the losses themselves, without torch.no_grad()
    module.write_text(source.replace(summed, 'if True:\n        totals["loss"] += F.cross_entropy(model(x), y)'))
    result = pytester.runpytest_inprocess("leaks", "--torchmem-devices=cpu")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "torchmem: leaks/test_leaks.py::test_the_training_step_does_not_leak [[]default[]] leaks on cpu: "
            "4 B more is held after every iteration, 0 B allowed (memory_budget(leak=...))",
            "  4 B per iteration: 1 tensor(s) made at leaks/test_leaks.py:* in train_step by "
            "aten.nll_loss_forward.default, held by self.losses (list)",
            "  fix: self.losses gains tensors every iteration: keep numbers (.item())*",
        ]
    )
    # the graph kept per iteration, by hand: the first Linear's output (32 x 256 float32:
    # 32 KiB, saved by GELU), GELU's (32 KiB, saved by the second Linear), log_softmax's
    # (32 x 10: 1.25 KiB) and nll_loss's total weight (4 B)
    result.stdout.fnmatch_lines(
        [
            "torchmem: leaks/test_leaks.py::test_the_evaluation_does_not_leak [[]default[]] leaks on cpu: "
            "65.25 KiB more is held after every iteration, 0 B allowed (memory_budget(leak=...))",
            "  32.00 KiB per iteration: 1 tensor(s) made at leaks/test_leaks.py:* in evaluate by "
            "aten.addmm.default, held by totals.loss (graph)",
            "*fix: totals.loss is a tensor whose autograd graph reaches back through every iteration*",
        ]
    )


def test_ci_workflow_gates_pull_requests_on_the_examples() -> None:
    workflow = (EXAMPLES / "ci" / "memory-regression.yml").read_text()
    assert "\non:\n  pull_request:" in workflow
    assert "python -m pytest examples" in workflow
    assert "--torchmem-unused=fail" in workflow
    # In CI a missing or moved entry must fail, so the gate never updates.
    run_lines = [line for line in workflow.splitlines() if not line.lstrip().startswith("#")]
    assert not any("--torchmem-update" in line for line in run_lines)


def test_the_examples_docs_describe_the_entries_as_they_are_recorded() -> None:
    """Regression guard (issue 36): the examples' README and workflow said that cpu entries
    record the machine's threads and ISA (``cpu_threads``, ``cpu_isa``) and go stale on
    another machine, and pinned ``OMP_NUM_THREADS``; the entries record the fixed CPU
    profile, ``avx2:4``, and compare on any machine."""
    cpu_environments = {
        json.dumps(entry["environment"], sort_keys=True)
        for path in EXAMPLES.glob("*/__torchmem__/*/*.json")
        for checks in json.loads(path.read_text())["tests"].values()
        for devices in checks.values()
        for device, entry in devices.items()
        if device == "cpu"
    }
    assert cpu_environments and all(json.loads(env)["cpu"] == "avx2:4" for env in cpu_environments)
    assert not any("cpu_threads" in env or "cpu_isa" in env for env in cpu_environments)
    readme = (EXAMPLES / "README.md").read_text()
    workflow = (EXAMPLES / "ci" / "memory-regression.yml").read_text()
    assert '`"cpu": "avx2:4"`' in readme and '"avx2:4"' in workflow
    for text in (readme, workflow):
        for stale in ("cpu_threads", "cpu_isa", "OMP_NUM_THREADS", "thread count the snapshots"):
            assert stale not in text, stale


# -- a fresh machine: only what the README's main job installs --------------------------------

ROOT = EXAMPLES.parent


def _extras() -> set[str]:
    """The top-level names of the packages the test extras add (pyproject.toml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[ ]", requirement)[0].replace("-", "_") for requirement in project["optional-dependencies"]["test"]}


def test_no_example_folder_can_stand_in_for_a_package() -> None:
    """Regression guard (issue 53): pytest puts ``examples/`` on ``sys.path`` (the folder of
    its conftest), so where Lightning was not installed ``importorskip("lightning")``
    imported the folder ``examples/lightning`` as a namespace package, and the README's
    main job stopped at collection instead of skipping the suite. No suite's folder may be
    named as a package an example imports, a package installed here, a package of the test
    extras or a module of the standard library."""
    imported: set[str] = set()
    for path in EXAMPLES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.partition(".")[0])
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip":
                imported.add(ast.literal_eval(node.args[0]).partition(".")[0])
    assert {"lightning", "accelerate", "transformers"} <= imported  # (the scan sees the frameworks' suites)
    taken = imported | set(importlib.metadata.packages_distributions()) | _extras() | set(sys.stdlib_module_names)
    folders = {path.name for path in EXAMPLES.iterdir() if path.is_dir()}
    assert not folders & taken, f"example folders named as packages: {sorted(folders & taken)}"


#: What the test extras install that the README's main job (``pip install torch==2.13.0 -e .``)
#: does not: hidden from a run of the example suites, as on a fresh machine. (numpy too:
#: torch runs without it, and so must the plugin.)
HIDDEN = ("numpy", "transformers", "accelerate", "lightning", "lightning_fabric", "pytorch_lightning",
          "torchmetrics", "peft", "torchao", "torchvision", "expecttest")

_HIDING = f"""
import importlib.machinery, sys

HIDDEN = {HIDDEN!r}


class PathFinderWithoutTheHidden:
    # sys.path's finder, to which the hidden packages are not there: neither their modules
    # (importlib.util.find_spec gives None, import raises ModuleNotFoundError) nor their
    # distributions (importlib.metadata)
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        for found in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if (found.metadata["Name"] or "").lower().replace("-", "_") not in HIDDEN:
                yield found

    @staticmethod
    def invalidate_caches():
        importlib.machinery.PathFinder.invalidate_caches()


sys.meta_path[:] = [
    PathFinderWithoutTheHidden if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path
]
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""

#: The README's command runs the suites that skip for a missing framework, and a step
#: function's (the plugin's own use of numpy failed there); the exhaustive run, every suite.
WITHOUT_EXTRAS = {
    "frameworks and a step function": ["accelerate_loop", "hf_trainer", "lightning_trainer", "script"],
    "every suite": SUITES,
}


@pytest.mark.parametrize("chosen", list(WITHOUT_EXTRAS))
def test_without_the_optional_packages_each_suite_passes_or_names_what_to_install(chosen: str, tmp_path: Path) -> None:
    """Regression guard (issue 53): on a fresh machine, with only what the README's main job
    installs, ``pytest examples`` stopped at collection (a folder stood in for Lightning),
    and the step functions' suites failed (the plugin read torch's random state through
    numpy). Run as a newcomer runs it, with the test extras and numpy hidden: each suite
    passes, or skips with one line that names the package and the ``pip install`` that
    enables it."""
    junit = tmp_path / "examples.xml"
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    names = [name for name in WITHOUT_EXTRAS[chosen] if runs_here(name)]
    run = subprocess.run(
        [sys.executable, "-c", _HIDING, "-p", "no:cacheprovider", "-p", "no:xdist", f"--junitxml={junit}",
         *(f"examples/{name}" for name in names)],
        cwd=ROOT, env=environment, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    lines, problems = verdict(junit, names, lambda name: name not in HIDDEN and installed(name))
    assert not problems, run.stdout[-6000:]
    skipped = sorted(line for line in lines if ": skipped: " in line)
    assert skipped == [
        "examples/accelerate_loop/: skipped: needs Accelerate: pip install accelerate",
        "examples/hf_trainer/: skipped: needs transformers: pip install transformers accelerate",
        "examples/lightning_trainer/: skipped: needs Lightning: pip install lightning",
    ]
    # the newcomer reads the same lines at the end of the run
    summary = run.stdout.partition("example suites skipped")[2]
    assert all(line.replace(": skipped: ", ": ") in summary for line in skipped), run.stdout[-3000:]
    assert "numpy" not in run.stdout.lower()
