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
from contextlib import ExitStack, contextmanager
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_replacing import replacing
from pytest_torchmem.engine.tracing.the_program import dispatch_depth, out_of_the_programs_sight

__all__ = ["charged_rng_states"]

# torch's private names (engine/torch_compat/torch_private.py)
_FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
_get_dispatch_mode: Final = private("torch._C._get_dispatch_mode")
_FAKE_KEY: Final = private("torch._C._TorchDispatchModeKey.FAKE")
#: The names a step reads the CPU generator's state by (torch.utils.checkpoint: torch.random's).
_GETTERS: Final = ("torch.get_rng_state", "torch.random.get_rng_state")
_SETTERS: Final = ("torch.set_rng_state", "torch.random.set_rng_state")


@contextmanager
def charged_rng_states() -> Iterator[None]:
    """Within a fake trace on ``cpu``: RNG state copies are fake tensors of their real size."""
    real_get, real_set = torch.get_rng_state, torch.set_rng_state
    nbytes = real_get().numel()
    ours = dispatch_depth()

    def get_rng_state() -> torch.Tensor:
        if _get_dispatch_mode(_FAKE_KEY) is None:
            # dynamo, compiling with every mode popped, saves and restores the real state
            return real_get()
        # (made outside the dispatcher in a real run: the program's own modes see nothing)
        with out_of_the_programs_sight(ours):
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def set_rng_state(new_state: Any) -> None:
        if not isinstance(new_state, _FakeTensor):
            real_set(new_state)

    with ExitStack() as replaced:
        for path in _GETTERS:
            replaced.enter_context(replacing(path, get_rng_state))
        for path in _SETTERS:
            replaced.enter_context(replacing(path, set_rng_state))
        yield
