"""Modules imported while a step runs are imported outside it: as the process imports them, untraced.

Training code imports lazily: transformers' ``Trainer`` imports peft,
accelerate and more the first time it runs, and a module's own code makes
tensors and reads the device at import (``DEFAULT = torch.tensor(...)``,
``DEVICE = "cuda" if torch.cuda.is_available() else "cpu"``). Imported inside
the trace, such a module would keep fake tensors and the fake GPU's answers
for the rest of the process, and its tensors would count as the step's memory,
in the first step that imports it only. :func:`imports_outside_the_step` runs
the code of each module imported within the block with no dispatch or
torch-function mode, and with the fake GPU's view put aside (it answers as the
machine does while :func:`importing`),
inside a profiler region that ``measure`` does not read
(:data:`IMPORTING`): the module is as a plain import makes it, and its tensors
are not the step's, in the estimate and in the measurement alike.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.abc import MetaPathFinder
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = ["IMPORTING", "importing", "imports_outside_the_step"]

# torch's private names (engine/torch_compat/torch_private.py)
_disable_current_modes: Final = private("torch.utils._python_dispatch._disable_current_modes")
_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")

#: The packages whose modules import as they are: torch's and this package's.
_AS_THEY_ARE: Final = frozenset({"torch", "functorch", "pytest_torchmem"})

#: The profiler region of a module's code run on import (measure reads nothing in it).
IMPORTING: Final = "pytest-torchmem: import"

_running = threading.local()  # .depth: modules' code running on import on this thread


def importing() -> bool:
    """Whether a module's code runs on import on this thread (see the module)."""
    return bool(getattr(_running, "depth", 0))


@contextmanager
def _module_code() -> Iterator[None]:
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        yield
    finally:
        _running.depth -= 1


class _Loader:
    """A module's loader whose ``exec_module`` runs outside the step (see the module);
    anything else is the loader's own."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # the module keeps its own loader, as a plain import leaves it
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        with torch.autograd.profiler.record_function(IMPORTING), _disable_current_modes(), _DisableTorchFunction(), _module_code():
            self._loader.exec_module(module)


class _Finder(MetaPathFinder):
    """Finds a module as the other finders do, its loader run outside the step."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            # (another trace's finder, where a pipeline's ranks trace on threads: one wraps)
            if isinstance(finder, _Finder) or find is None:
                continue
            spec = find(name, path, target)
            if spec is None:
                continue
            # (torch's own modules, which make no tensor on import and which the modes put
            # aside here import lazily themselves, and this package's, import as they are)
            if spec.loader is not None and hasattr(spec.loader, "exec_module") and name.partition(".")[0] not in _AS_THEY_ARE:
                spec.loader = _Loader(spec.loader)
            return spec
        return None


@contextmanager
def imports_outside_the_step() -> Iterator[None]:
    """Modules imported within the block are imported outside the step (see the module)."""
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
