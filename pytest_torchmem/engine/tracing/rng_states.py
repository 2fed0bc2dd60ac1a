"""The CPU random-number state a step copies out, charged as the CPU allocator sees it.

Activation checkpointing keeps the CPU generator's state for each checkpointed
region (``preserve_rng_state=True``, the default): ``torch.get_rng_state()``
copies it into a new ``uint8`` CPU tensor (5056 bytes for the default
generator), held until the region is recomputed. The copy is made outside
the dispatcher, so a fake trace would not see it; on the ``cpu`` device it is
memory like any other (``measure`` sees it), so while this context is
active ``torch.get_rng_state()`` gives a fake tensor of the same size, charged
and freed as the copy would be, and ``torch.set_rng_state`` of such a tensor
does nothing (fake tensors draw no random numbers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["charged_rng_states"]


@contextmanager
def charged_rng_states() -> Iterator[None]:
    """Within a fake trace on ``cpu``: RNG state copies are fake tensors of their real size."""
    real_get, real_set = torch.get_rng_state, torch.set_rng_state
    nbytes = real_get().numel()

    def get_rng_state() -> torch.Tensor:
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
            # dynamo, compiling with every mode popped, saves and restores the real state
            return real_get()
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def set_rng_state(new_state: Any) -> None:
        if not isinstance(new_state, FakeTensor):
            real_set(new_state)

    names = ((torch, "get_rng_state", get_rng_state), (torch, "set_rng_state", set_rng_state))
    names += ((torch.random, "get_rng_state", get_rng_state),)
    names += ((torch.random, "set_rng_state", set_rng_state),)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in names]
    for owner, name, replacement in names:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
