"""The process's own state that training code changes: recorded before a step function's call, put back after it.

Beside the objects a step reaches, training frameworks change the process:
environment variables (Lightning's ``PL_GLOBAL_SEED``, a launcher's ranks),
the random number generators a trainer seeds (torch's, Python's, numpy's:
transformers' ``set_seed``, Lightning's ``seed_everything``),
torch's global settings (the default dtype, cuDNN's benchmark, deterministic
and TF32 flags, float32 matmul precision, deterministic algorithms, intra-op
threads), and libraries' singletons
(Accelerate's ``PartialState``, ``AcceleratorState`` and ``GradientState``
share one state per process: made inside a trace of the fake cuda device it
would say the process has a GPU). :class:`ProcessState` records them, and
:meth:`ProcessState.restore` puts them back: a singleton made in the call (its
library imported there, or not yet initialised) is emptied again.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from collections.abc import Callable
from typing import Any, Final

import torch

__all__ = ["ProcessState"]

#: torch's global settings: (read, write) of each.
_TORCH_SETTINGS: Final[tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...]] = (
    (torch.get_default_dtype, torch.set_default_dtype),
    (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
    ),
    (
        lambda: (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32),
        lambda value: torch.backends.cudnn.set_flags(_benchmark=value[0], _deterministic=value[1], _allow_tf32=value[2]),
    ),
    (torch.get_num_threads, torch.set_num_threads),
)

#: Libraries' process-wide singletons: (module, class, the attribute holding the shared state).
SINGLETONS: Final = (
    ("accelerate.state", "PartialState", "_shared_state"),
    ("accelerate.state", "AcceleratorState", "_shared_state"),
    ("accelerate.state", "GradientState", "_shared_state"),
)


class ProcessState:
    """The process's state as it was (see the module)."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.settings = [read() for read, _ in _TORCH_SETTINGS]
        self.singletons = {key: dict(found) for key in SINGLETONS if (found := _shared(key, import_it=False)) is not None}
        self.rng = _generators()

    def restore(self) -> None:
        """Put the environment, torch's settings and the singletons back as they were."""
        if dict(os.environ) != self.environ:
            for name in set(os.environ) - set(self.environ):
                del os.environ[name]
            for name, value in self.environ.items():
                if os.environ.get(name) != value:
                    os.environ[name] = value
        for (read, write), value in zip(_TORCH_SETTINGS, self.settings):
            if read() != value:
                write(value)
        for (getter, setter), state in zip(_RNG, self.rng):
            if state is not None:
                setter(state)
        for key in SINGLETONS:
            found = _shared(key, import_it=False)
            if found is None:
                continue
            before = self.singletons.get(key, {})
            if found.keys() != before.keys() or any(found[name] is not value for name, value in before.items()):
                found.clear()
                found.update(before)


def _numpy_state() -> Any:
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state()


def _set_numpy_state(state: Any) -> None:
    sys.modules["numpy"].random.set_state(state)


def _torch_state() -> bytes:
    # (as bytes: a tensor kept would be memory measure() sees held through the step;
    # through a list, not .numpy(): numpy is not one of the plugin's dependencies)
    return bytes(torch.get_rng_state().tolist())


def _set_torch_state(state: bytes) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


#: The process's generators: (read the state, set it).
_RNG: Final = (
    (_torch_state, _set_torch_state),
    (random.getstate, random.setstate),
    (_numpy_state, _set_numpy_state),
)


def _generators() -> list[Any]:
    return [getter() for getter, _ in _RNG]


def _shared(key: tuple[str, str, str], import_it: bool) -> dict[str, Any] | None:
    """The shared state of a singleton, where its library is imported."""
    module_name, cls, attribute = key
    module = sys.modules.get(module_name)
    if module is None and import_it:
        module = importlib.import_module(module_name)
    found = getattr(getattr(module, cls, None), attribute, None)
    return found if isinstance(found, dict) else None
