"""Ground truth for a CPU profile: the model zoo measured in a process capped to its level.

``measure`` reads the CPU the process runs on. For a profile below this host's
level, the zoo is measured in a subprocess whose ATen, oneDNN and MKL are capped
to that level (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``) and that runs at the profile's intra-op thread
count; the estimate under the named profile, made in any process, must give the
same bytes. Used by ``tests/test_accuracy_profiles.py``
and ``benchmarks/accuracy.py --profiles``; the compiled families of
``compiled_zoo.py`` likewise (``tests/test_compiled.py``), and torchao's cases of
``torchao_cases.py`` (``tests/test_torchao.py``).

    python tests/profiled.py THREADS [case ...]   # in the capped process: JSON on stdout
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_torchmem.engine.tracing.devices.cpu.profiles import (
    ISA_LEVELS,
    CpuProfile,
    capped_environment,
    host_profile,
)

_HERE = Path(__file__).resolve()


def every_peak(report: Any) -> dict[str, int]:
    """The report's phase peaks, and each phase of its first step where it ran as a
    training loop (``first_step.backward``, ...): what estimate and measure must agree on."""
    peaks = dict(report.phase_peaks())
    if report.first_step is not None:
        for phase in ("forward", "backward", "step"):
            peaks[f"first_step.{phase}"] = getattr(report.first_step, phase)
    return peaks


def reachable(profile: CpuProfile) -> bool:
    """Whether this host can run ``profile``'s level (capping only lowers it) with the
    host's cache sizes (the levels' cache sizes are the typical ones, not this host's)."""
    host = host_profile()
    return ISA_LEVELS.index(profile.isa) <= ISA_LEVELS.index(host.isa)


def as_measured_here(profile: CpuProfile) -> CpuProfile:
    """``profile`` with this host's cache sizes: what a capped process here really is."""
    host = host_profile()
    return CpuProfile(profile.isa, profile.threads, l1d=host.l1d, l2=host.l2, l3=host.l3)


def measure_zoo(profile: CpuProfile, names: Sequence[str]) -> dict[str, dict[str, int]]:
    """``measure`` of the zoo ``names`` in a process capped to ``profile``: name -> phase peaks."""
    return _capped(profile, _HERE, names)


def measure_compiled(profile: CpuProfile, names: Sequence[str]) -> dict[str, list[dict[str, int]]]:
    """``measure`` of the compiled families ``names`` (``compiled_zoo.py``) in a process
    capped to ``profile``: name -> phase peaks of each of its shapes."""
    return _capped(profile, _HERE.parent / "compiled_zoo.py", names)


def measure_torchao(profile: CpuProfile, names: Sequence[str]) -> dict[str, dict[str, int]]:
    """``measure`` of the torchao cases ``names`` (``torchao_cases.py``) in a process
    capped to ``profile``: name -> phase peaks."""
    return _capped(profile, _HERE.parent / "torchao_cases.py", names)


def _capped(profile: CpuProfile, script: Path, names: Sequence[str]) -> Any:
    env = {**os.environ, **capped_environment(profile)}
    done = subprocess.run(
        [sys.executable, str(script), str(profile.threads), *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring under {profile} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main(argv: list[str]) -> int:
    import warnings

    import torch
    from zoo import CASES

    import pytest_torchmem as tm

    warnings.filterwarnings("ignore")
    torch.set_num_threads(int(argv[0]))
    wanted = set(argv[1:])
    out = {}
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        model, inputs = case.make()
        out[case.name] = every_peak(tm.measure(model, inputs, **case.options))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(_HERE.parent))
    raise SystemExit(_main(sys.argv[1:]))
