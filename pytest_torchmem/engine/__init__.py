"""The estimate engine: one training step traced on fake tensors, or measured for real, and its figures.

Rooms by job, each importing only the rooms listed before it (``tests/test_layout.py``
checks the order):

- :mod:`.figures`: the report, the storage timeline, byte units, a stopped trace, GPU
  profiles. No torch.
- :mod:`.torch_compat`: the torch releases supported, the one table of torch's private
  names, the one mechanism that replaces a torch attribute.
- :mod:`.user`: what belongs to the user: the world a step function reaches, a model's
  tensors, nested containers, tensor layouts, twins of optimizers, the loss, where in the
  user's code (or inductor's code for it) a trace is.
- :mod:`.parallel`: parallel training: :class:`~.parallel.mesh.Parallel` and its mesh,
  pipelines, real gloo ranks, ranks traced in a process beside, the engine's threads.
- :mod:`.step`: the step: the built-in training step, step functions and their phases,
  what a step holds, the validated request, one step at a time, ``compile=``.
- :mod:`.tracing`: the fake-tensor tracer, with one rule set per device.
- :mod:`.measuring`: real runs, read through the allocator or the profiler.
- :mod:`.every_rank`: every distinct rank of a parallel run, each traced.
- :mod:`.api`: the public entry points, :func:`~.api.estimate`, :func:`~.api.measure`,
  :func:`~.api.every_rank`.
- :mod:`.leaks`: a step run again and again, and what it keeps.
- :mod:`.fit`: the largest size that fits, and what to change when it does not.

The modules' names before these rooms (release 0.1.0: ``engine.gpu_profiles``,
``engine.report``, ...) still import, with a :class:`DeprecationWarning`, until the next
release: :data:`MOVED` says where each went. Three old modules' names are their rooms'
now (``engine.parallel``, ``engine.step``, ``engine.measuring``): the room gives the old
module's names (:func:`moved_attribute`). This module imports nothing of the engine: it
is the lowest layer.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import MappingProxyType, ModuleType
from typing import Any, Final

__all__ = ["MOVED", "moved_attribute"]

#: The engine's modules that moved into its rooms (after release 0.1.0), by their old
#: names: each old name imports the module of its new one, with a DeprecationWarning,
#: until the next release.
MOVED: Final = MappingProxyType(
    {
        "pytest_torchmem.engine.advice": "pytest_torchmem.engine.fit.advice",
        "pytest_torchmem.engine.compiling": "pytest_torchmem.engine.step.compiling",
        "pytest_torchmem.engine.containers": "pytest_torchmem.engine.user.containers",
        "pytest_torchmem.engine.cpu_profiler": "pytest_torchmem.engine.measuring.cpu_profiler",
        "pytest_torchmem.engine.distinct_ranks": "pytest_torchmem.engine.every_rank",
        "pytest_torchmem.engine.distributed": "pytest_torchmem.engine.parallel.real_ranks",
        "pytest_torchmem.engine.fitting": "pytest_torchmem.engine.fit.search",
        "pytest_torchmem.engine.gpu_profiles": "pytest_torchmem.engine.figures.gpu_profiles",
        "pytest_torchmem.engine.holdings": "pytest_torchmem.engine.step.holdings",
        "pytest_torchmem.engine.layouts": "pytest_torchmem.engine.user.layouts",
        "pytest_torchmem.engine.loss": "pytest_torchmem.engine.user.loss",
        "pytest_torchmem.engine.model_state": "pytest_torchmem.engine.user.model_state",
        "pytest_torchmem.engine.nesting": "pytest_torchmem.engine.step.nesting",
        "pytest_torchmem.engine.phases": "pytest_torchmem.engine.step.phases",
        "pytest_torchmem.engine.pipeline": "pytest_torchmem.engine.parallel.pipeline",
        "pytest_torchmem.engine.private_name": "pytest_torchmem.engine.torch_compat.private_name",
        "pytest_torchmem.engine.profiler_events": "pytest_torchmem.engine.measuring.profiler_events",
        "pytest_torchmem.engine.report": "pytest_torchmem.engine.figures.report",
        "pytest_torchmem.engine.request": "pytest_torchmem.engine.step.request",
        "pytest_torchmem.engine.step_function": "pytest_torchmem.engine.step.step_function",
        "pytest_torchmem.engine.stopped": "pytest_torchmem.engine.figures.stopped",
        "pytest_torchmem.engine.threads": "pytest_torchmem.engine.parallel.threads",
        "pytest_torchmem.engine.timeline": "pytest_torchmem.engine.figures.timeline",
        "pytest_torchmem.engine.torch_private": "pytest_torchmem.engine.torch_compat.torch_private",
        "pytest_torchmem.engine.torch_private_compiled": "pytest_torchmem.engine.torch_compat.torch_private_compiled",
        "pytest_torchmem.engine.torch_release": "pytest_torchmem.engine.torch_compat.torch_release",
        "pytest_torchmem.engine.torch_replacing": "pytest_torchmem.engine.torch_compat.torch_replacing",
        "pytest_torchmem.engine.traced_beside": "pytest_torchmem.engine.parallel.traced_beside",
        "pytest_torchmem.engine.tracing.generated_code": "pytest_torchmem.engine.user.generated_code",
        "pytest_torchmem.engine.tracing.user_code": "pytest_torchmem.engine.user.user_code",
        "pytest_torchmem.engine.twins": "pytest_torchmem.engine.user.twins",
        "pytest_torchmem.engine.units": "pytest_torchmem.engine.figures.units",
        "pytest_torchmem.engine.world": "pytest_torchmem.engine.user",
        "pytest_torchmem.engine.world.journal": "pytest_torchmem.engine.user.journal",
        "pytest_torchmem.engine.world.process": "pytest_torchmem.engine.user.process",
        "pytest_torchmem.engine.world.reaching": "pytest_torchmem.engine.user.reaching",
        "pytest_torchmem.engine.world.standins": "pytest_torchmem.engine.user.standins",
        "pytest_torchmem.engine.world.watching": "pytest_torchmem.engine.user.watching",
    }
)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module's old name (:data:`MOVED`) as the module itself, and says so."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        _warn(old, MOVED[old])
        # The import returns what sys.modules holds under the old name when this ends:
        # the module itself, so that both names are one module.
        sys.modules[old] = importlib.import_module(MOVED[old])


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    # First: an old name left on disk (a folder of stale bytecode) must not shadow it.
    sys.meta_path.insert(0, _MovedModules())


def __getattr__(name: str) -> Any:
    """``pytest_torchmem.engine.gpu_profiles`` as an attribute, by its old name."""
    old = f"{__name__}.{name}"
    if old not in MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warn(old, MOVED[old])
    module = globals()[name] = sys.modules[old] = importlib.import_module(MOVED[old])
    return module


def moved_attribute(package: str, module: str, name: str) -> Any:
    """``name`` of ``package.module``, looked up on ``package`` (whose name the module had
    until release 0.1.0), with a DeprecationWarning; an AttributeError for any other name,
    a submodule's first (the import system then imports it, and nothing more)."""
    if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    moved = importlib.import_module(f"{package}.{module}")
    if name not in getattr(moved, "__all__", ()):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{package}.{module}.{name}", stacklevel=4)
    value = vars(sys.modules[package])[name] = getattr(moved, name)
    return value


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Say that ``old`` moved to ``new``, at the line that used the old name (the import
    machinery's frames are skipped)."""
    warnings.warn(
        f"{old} moved to {new}; the old name goes in the release after 0.1.0", DeprecationWarning, stacklevel=stacklevel
    )
