"""Pinned host memory on the fake cuda device.

On a machine with a GPU, ``t.pin_memory()`` copies a host tensor into
page-locked host memory (``at::native::_pin_memory``: an empty tensor from the
host's pinned allocator, then ``copy_``), and ``t.is_pinned()`` says whether a
tensor's memory is such. The DataLoader pins its batches where there is an
accelerator (``pin_memory=True``: transformers' ``Trainer`` asks it by default),
and activation offloading keeps its saved tensors in pinned buffers. Fake tensors
have no kernel for ``_pin_memory`` ("NYI"), and a CPU-only torch has no pinned
allocator; the fake cuda device makes the copy a host tensor of the trace, and
answers ``is_pinned`` for the tensors it pinned, and for those a factory made with
``pin_memory=True`` (``torch.empty(..., pin_memory=True)``: an offloading buffer).
Host memory is not the GPU's: nothing is charged to the device.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Final

import torch

from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.tracing.rules import OpCall

__all__ = ["is_pinned", "made_pinned", "pin_memory"]

aten = torch.ops.aten

#: The host tensors the trace pinned (none outlives its trace).
_PINNED: Final[weakref.WeakSet[torch.Tensor]] = weakref.WeakSet()


@CUDA.implementation(aten._pin_memory.default)
def pin_memory(call: OpCall) -> torch.Tensor:
    """``_pin_memory(self, device=None)``: a contiguous copy of ``self`` in pinned host memory."""
    self = call.arg(0, "self")
    pinned = torch.empty(self.shape, dtype=self.dtype, device=self.device)
    pinned.copy_(self)
    _PINNED.add(pinned)
    return pinned


@CUDA.implementation(aten.empty.memory_format, aten.empty_strided.default)
def made_pinned(call: OpCall) -> torch.Tensor:
    """``empty(..., pin_memory=True)``: a host tensor of the trace, pinned; any other
    ``empty`` as the fake kernel makes it."""
    if not call.kwargs.get("pin_memory"):
        return call.default()  # type: ignore[no-any-return]
    made = dataclasses.replace(call, kwargs={**call.kwargs, "pin_memory": False}).default()
    _PINNED.add(made)
    return made  # type: ignore[no-any-return]


@CUDA.implementation(aten.is_pinned.default)
def is_pinned(call: OpCall) -> bool:
    """``is_pinned(self, device=None)``: whether the trace pinned ``self``'s memory."""
    self = call.arg(0, "self")
    return any(self.untyped_storage()._cdata == pinned.untyped_storage()._cdata for pinned in _PINNED)
