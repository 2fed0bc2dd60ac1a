"""pytest-torchmem: memory regression tests for PyTorch models.

``estimate`` traces one training step with fake tensors and predicts its
memory on a fake ``cpu`` or ``cuda`` device; ``measure`` runs the same step for
real. Both return a :class:`MemoryReport`.

The names are imported on first use: pytest imports this package for its
plugin entry point in every run, and ``pytest --help`` or a test suite that
never checks memory should not pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from pytest_torchmem.engine.api import estimate, every_rank, measure
    from pytest_torchmem.engine.every_rank import RankFigures
    from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile
    from pytest_torchmem.engine.figures.report import (
        Category,
        MemoryReport,
        ModulePeak,
        StepPeaks,
        Unsupported,
    )
    from pytest_torchmem.engine.figures.stopped import TraceStopped
    from pytest_torchmem.engine.figures.units import format_bytes, parse_bytes
    from pytest_torchmem.engine.fit.advice import Advice, Suggestion, advise
    from pytest_torchmem.engine.fit.search import Fit, GpuRoom, Probe, fit, rank_gpus
    from pytest_torchmem.engine.leaks.check import leaks
    from pytest_torchmem.engine.leaks.report import LeakReport, LeakSource
    from pytest_torchmem.engine.parallel.mesh import Parallel
    from pytest_torchmem.engine.step.phases import phase
    from pytest_torchmem.engine.torch_compat.torch_release import TorchReleaseError
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile
    from pytest_torchmem.engine.user import UnfollowedError

__all__ = [
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
]

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_LAZY: Final = {
    "estimate": "pytest_torchmem.engine.api",
    "measure": "pytest_torchmem.engine.api",
    "leaks": "pytest_torchmem.engine.leaks.check",
    "LeakReport": "pytest_torchmem.engine.leaks.report",
    "LeakSource": "pytest_torchmem.engine.leaks.report",
    "fit": "pytest_torchmem.engine.fit.search",
    "rank_gpus": "pytest_torchmem.engine.fit.search",
    "Fit": "pytest_torchmem.engine.fit.search",
    "GpuRoom": "pytest_torchmem.engine.fit.search",
    "Probe": "pytest_torchmem.engine.fit.search",
    "advise": "pytest_torchmem.engine.fit.advice",
    "Advice": "pytest_torchmem.engine.fit.advice",
    "Suggestion": "pytest_torchmem.engine.fit.advice",
    "MemoryReport": "pytest_torchmem.engine.figures.report",
    "Parallel": "pytest_torchmem.engine.parallel.mesh",
    "every_rank": "pytest_torchmem.engine.api",
    "RankFigures": "pytest_torchmem.engine.every_rank",
    "phase": "pytest_torchmem.engine.step.phases",
    "Category": "pytest_torchmem.engine.figures.report",
    "ModulePeak": "pytest_torchmem.engine.figures.report",
    "StepPeaks": "pytest_torchmem.engine.figures.report",
    "Unsupported": "pytest_torchmem.engine.figures.report",
    "UnfollowedError": "pytest_torchmem.engine.user",
    "TraceStopped": "pytest_torchmem.engine.figures.stopped",
    "CpuProfile": "pytest_torchmem.engine.tracing.devices.cpu.profiles",
    "GpuProfile": "pytest_torchmem.engine.figures.gpu_profiles",
    "TorchReleaseError": "pytest_torchmem.engine.torch_compat.torch_release",
    "parse_bytes": "pytest_torchmem.engine.figures.units",
    "format_bytes": "pytest_torchmem.engine.figures.units",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
