"""GPU profiles: the facts about a GPU that change what CUDA kernels allocate.

The fake ``cuda`` device is traced without a GPU, so the rules that depend on
the architecture (which attention kernel runs, how big the cuBLAS workspace
is, how many blocks a reduction launches) read them from a profile, chosen
with ``estimate(..., gpu="H100")``, ``@pytest.mark.memory_budget(gpu=...)`` or
``--torchmem-gpu`` / the ``torchmem_gpu`` ini option. The default is
:data:`DEFAULT_GPU`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["GpuProfile", "PROFILES", "DEFAULT_GPU", "gpu_profile"]

_GiB: Final = 1 << 30


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model, as ``torch.cuda.get_device_properties`` would describe it."""

    name: str
    #: ``(major, minor)``, e.g. ``(9, 0)`` for Hopper.
    compute_capability: tuple[int, int]
    #: Streaming multiprocessors (``multi_processor_count``).
    sm_count: int
    #: Device memory in bytes (``total_memory``).
    memory: int

    @property
    def sm(self) -> int:
        """``major * 10 + minor``: 90 for Hopper, 80 for A100."""
        major, minor = self.compute_capability
        return major * 10 + minor

    def __str__(self) -> str:
        return self.name


PROFILES: Final[dict[str, GpuProfile]] = {
    profile.name: profile
    for profile in (
        GpuProfile("V100", (7, 0), 80, 32 * _GiB),
        GpuProfile("T4", (7, 5), 40, 16 * _GiB),
        GpuProfile("A100", (8, 0), 108, 80 * _GiB),
        GpuProfile("A100-40GB", (8, 0), 108, 40 * _GiB),
        GpuProfile("A10G", (8, 6), 80, 24 * _GiB),
        GpuProfile("RTX4090", (8, 9), 128, 24 * _GiB),
        GpuProfile("L4", (8, 9), 58, 24 * _GiB),
        GpuProfile("L40S", (8, 9), 142, 48 * _GiB),
        GpuProfile("H100", (9, 0), 132, 80 * _GiB),
        GpuProfile("H200", (9, 0), 132, 141 * _GiB),
        GpuProfile("B200", (10, 0), 148, 180 * _GiB),
    )
}

#: The GPU modelled when none is named.
DEFAULT_GPU: Final = "H100"


def gpu_profile(name: str | GpuProfile | None) -> GpuProfile:
    """The profile called ``name`` (case-insensitive), or the default for None."""
    if isinstance(name, GpuProfile):
        return name
    if name is None:
        return PROFILES[DEFAULT_GPU]
    if not isinstance(name, str):
        raise TypeError(f"gpu must be a GPU name such as 'H100', got {name!r}")
    for key, profile in PROFILES.items():
        if key.lower() == name.lower():
            return profile
    raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(PROFILES)}")
