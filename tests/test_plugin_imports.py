"""Imports: pytest loads the plugin in every run; torch is imported only by the first memory check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pytest_torchmem

pytest_plugins = ("pytester",)


def run_python(code: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,  # a bound for a hang, not for a loaded machine's slowness
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_importing_the_plugin_does_not_import_torch() -> None:
    """Regression guard: `import pytest_torchmem.plugin.hooks` (pytest's entry point) stays free of torch."""
    run_python(
        """
        import sys
        import pytest_torchmem.plugin.hooks
        assert "torch" not in sys.modules, "the plugin imported torch"
        import pytest_torchmem as tm
        assert tm.__version__ == "0.1.0"
        assert tm.parse_bytes("1 KiB") == 1024 and tm.format_bytes(1024) == "1.00 KiB"
        assert "torch" not in sys.modules, "the units imported torch"
        assert tm.GpuProfile("G", memory="16 GiB", compute_capability="8.9", sm_count=66).sm == 89
        assert "torch" not in sys.modules, "the GPU profiles imported torch"
        """
    )


def test_public_names_are_the_defining_modules() -> None:
    """In a fresh interpreter: pytester's in-process runs elsewhere in the session forget
    the modules imported inside them, so a module imported again later is another object."""
    run_python(
        """
        import pytest_torchmem as tm
        from pytest_torchmem.engine import api, every_rank, leaks, user
        from pytest_torchmem.engine.figures import gpu_profiles, report, stopped, units
        from pytest_torchmem.engine.fit import advice, search as fitting
        from pytest_torchmem.engine.parallel import mesh as parallel
        from pytest_torchmem.engine.step import phases
        from pytest_torchmem.engine.torch_compat import torch_release
        from pytest_torchmem.engine.leaks import check
        from pytest_torchmem.engine.tracing.devices.cpu import profiles

        assert tm.__all__ == [
            "estimate",
            "measure",
            "phase",
            "leaks",
            "fit",
            "rank_gpus",
            "every_rank",
            "advise",
            "Fit",
            "GpuRoom",
            "Probe",
            "Advice",
            "Suggestion",
            "MemoryReport",
            "LeakReport",
            "LeakSource",
            "Parallel",
            "RankFigures",
            "Category",
            "ModulePeak",
            "StepPeaks",
            "Unsupported",
            "TraceStopped",
            "UnfollowedError",
            "CpuProfile",
            "GpuProfile",
            "TorchReleaseError",
            "parse_bytes",
            "format_bytes",
        ], tm.__all__
        modules = (torch_release, api, stopped, user, advice, fitting, check, leaks, parallel, every_rank, phases, report, units, profiles, gpu_profiles)
        for name in tm.__all__:
            defining = next(m for m in modules if hasattr(m, name))
            assert getattr(tm, name) is getattr(defining, name), name
        from pytest_torchmem import MemoryReport, estimate

        assert estimate is api.estimate and MemoryReport is report.MemoryReport
        assert set(tm.__all__) <= set(dir(tm))
        try:
            tm.no_such_name
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError("tm.no_such_name did not raise AttributeError")
        """
    )


def test_a_suite_that_checks_no_memory_never_imports_torch(pytester: pytest.Pytester) -> None:
    """`pytest --help` and a suite without the torchmem fixture run without importing torch."""
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_no_torch_here():
            assert "torch" not in sys.modules
        """
    )
    pytester.makeconftest(
        """
        import sys

        def pytest_unconfigure(config):
            assert "torch" not in sys.modules, "torch was imported"
        """
    )
    # Only this plugin (and pytester's own): another installed plugin may import torch itself.
    args = ("-p", "no:hypothesispytest", "-p", "no:xdist", "-p", "no:cacheprovider")
    assert pytester.runpytest_subprocess(*args, "--help").ret == 0
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        ["torchmem: compare, devices cpu,cuda, *, gpu profile H100, cpu profile avx2:4"]
    )


def test_the_plugins_default_gpu_is_the_device_models() -> None:
    from pytest_torchmem.engine.figures import gpu_profiles as profiles
    from pytest_torchmem.plugin.settings import DEFAULT_GPU, known_devices

    assert DEFAULT_GPU == profiles.DEFAULT_GPU
    from pytest_torchmem.plugin.settings import DEFAULT_DEVICES

    assert set(DEFAULT_DEVICES) == set(known_devices()) == {"cpu", "cuda"}


NO_NUMPY_TESTS = """
import torch
from torch import nn


def test_memory(torchmem):
    torchmem.check(nn.Linear(4, 4), torch.randn(2, 4))


def test_plain():
    assert torch.ones(2).sum().item() == 2
"""


def test_a_project_without_numpy_sees_no_numpy_warning(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression guard (issue 36): torch warns "Failed to initialize NumPy" as it is imported
    where numpy is not installed, and a project without numpy saw the warning in the summary
    of every run. The plugin ignores that one warning, from the first conftest on (this
    one imports torch); with the plugin off, the same run shows it."""
    blocked = pytester.mkdir("site") / "numpy"
    blocked.mkdir()
    (blocked / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n')
    package_root = Path(pytest_torchmem.__file__).parent.parent  # this checkout's package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pytester.path / "site"), str(package_root)]))
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider -p no:xdist -p no:randomly")
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    pytester.makeconftest("import torch\n")
    pytester.makepyfile(test_m=NO_NUMPY_TESTS)
    result = pytester.runpytest_subprocess("--torchmem-update")
    result.assert_outcomes(passed=2)
    assert result.ret == 0
    assert "NumPy" not in result.stdout.str() + result.stderr.str()
    assert "warnings summary" not in result.stdout.str()

    without = pytester.runpytest_subprocess("-p", "no:torchmem", "-k", "plain")
    without.assert_outcomes(passed=1, deselected=1)
    without.stdout.fnmatch_lines(["*UserWarning: Failed to initialize NumPy: No module named 'numpy'*"])
