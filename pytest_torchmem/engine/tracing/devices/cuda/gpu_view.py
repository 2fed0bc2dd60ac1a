"""What the model's code sees of the fake cuda device: a GPU.

The fake cuda device is traced on fake ``meta`` tensors (on a CPU-only torch,
autograd on a fake ``cuda`` tensor kills the interpreter). Libraries branch on
what they see: ``x.is_cuda``, ``x.device.type == "cuda"``,
``torch.cuda.is_available()``, the device's capability. While :func:`gpu_view`
is active, the code of the model and its libraries sees the GPU the profile
names: a fake tensor of the device answers ``.device`` with ``cuda:0`` and
``.is_cuda`` with True, and ``torch.cuda``'s queries answer as that GPU
would. torch's own code and this package's still see ``meta`` (they route
the step), so only callers outside them are answered so; the tensors the
program then makes on "cuda" are placed by the device's router.

Not redirected (the answer stays the CPU-only build's): ``x.get_device()``
and other C++ queries, ``torch.cuda`` functions beyond the queries below
(streams, events, memory statistics), and code that reads a tensor's device
from C++ (custom extensions).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["gpu_view"]

_CUDA: Final = torch.device("cuda", 0)
#: Code whose callers keep seeing the trace's real devices.
_INTERNAL: Final = (
    os.path.dirname(os.path.abspath(torch.__file__)),
    str(Path(__file__).resolve().parents[4]),  # pytest_torchmem/
)


def _from_the_program() -> bool:
    """Whether the caller of the caller (a query's caller) is the model's or a library's code."""
    filename = sys._getframe(2).f_code.co_filename
    return not filename.startswith(_INTERNAL) and not filename.startswith("<frozen")


@contextmanager
def gpu_view(profile: Any) -> Iterator[None]:
    """Within a fake cuda trace: the program sees the GPU ``profile`` describes."""
    real_device = FakeTensor.device
    real_is_cuda = torch._C.TensorBase.is_cuda

    def device(self: FakeTensor) -> torch.device:
        seen = real_device.fget(self)  # type: ignore[attr-defined]
        if seen.type == "meta" and _from_the_program():
            return _CUDA
        return seen

    def is_cuda(self: FakeTensor) -> bool:
        if self.fake_device.type == "meta" and _from_the_program():
            return True
        return real_is_cuda.__get__(self)  # type: ignore[no-any-return]

    properties = SimpleNamespace(
        name=f"NVIDIA {profile.name}",
        major=profile.compute_capability[0],
        minor=profile.compute_capability[1],
        total_memory=profile.memory,
        multi_processor_count=profile.sm_count,
        is_integrated=False,
        is_multi_gpu_board=False,
    )
    answers: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_capability": lambda device=None: profile.compute_capability,
        "get_device_properties": lambda device=None: properties,
        "get_device_name": lambda device=None: properties.name,
        "is_bf16_supported": lambda including_emulation=True: profile.sm >= 80,
    }
    saved = {name: getattr(torch.cuda, name) for name in answers}

    def answering(name: str) -> Any:
        real = saved[name]

        def query(*args: Any, **kwargs: Any) -> Any:
            if _from_the_program():
                return answers[name](*args, **kwargs)
            return real(*args, **kwargs)

        query.__name__ = name
        query.__doc__ = real.__doc__
        return query

    FakeTensor.device = property(device)  # type: ignore[assignment,method-assign]
    FakeTensor.is_cuda = property(is_cuda)  # type: ignore[assignment,method-assign]
    for name in answers:
        setattr(torch.cuda, name, answering(name))
    try:
        yield
    finally:
        FakeTensor.device = real_device  # type: ignore[method-assign]
        del FakeTensor.is_cuda
        for name, real in saved.items():
            setattr(torch.cuda, name, real)
