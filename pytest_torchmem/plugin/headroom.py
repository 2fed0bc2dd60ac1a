"""How much of a GPU a cuda check leaves (:class:`Room`), for every cuda check and ``fits=``.

A check's step fits a GPU when the caching allocator's reserved peak (the
segments it holds, fragmentation included: what runs out) stays within the GPU's
usable memory, its memory as the device reports it less what the CUDA context
takes outside the allocator (:func:`pytest_torchmem.engine.figures.gpu_profiles.usable_memory`).
Every cuda check reports its headroom on the GPU it follows; ``memory_budget(fits=...)``
makes fitting a condition of passing, on that GPU (``fits=True``) or on others it
names (each estimated on its own: their kernels differ).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_torchmem.engine.figures.gpu_profiles import CUDA_CONTEXT, usable_memory
from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile
from pytest_torchmem.engine.figures.units import format_bytes

__all__ = ["Room", "room"]


@dataclass(frozen=True)
class Room:
    """A cuda check's step on one GPU: its reserved peak against the GPU's usable memory."""

    gpu: str
    usable: int
    reserved: int
    #: Whether ``memory_budget(fits=...)`` asks this GPU to hold the step: where it does
    #: not, the check fails.
    required: bool = False
    #: The GPU itself, where this process made the room (not in the JSON report: a room
    #: read back names its GPU only).
    profile: GpuProfile | None = field(default=None, compare=False, repr=False)

    @property
    def headroom(self) -> int:
        """Usable memory less the reserved peak (negative: the step does not fit)."""
        return self.usable - self.reserved

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    @property
    def unfit(self) -> bool:
        """Required to fit, and does not: the check fails."""
        return self.required and not self.fits

    def problem(self, device: str) -> str:
        """The failure line of a GPU that does not hold the step."""
        return (
            f"{device} step does not fit {self.gpu}: reserved peak {format_bytes(self.reserved)}, "
            f"usable {format_bytes(self.usable)} (its memory less {format_bytes(CUDA_CONTEXT)} for "
            f"the CUDA context): {format_bytes(-self.headroom)} over (memory_budget(fits=...))"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "usable": self.usable,
            "reserved": self.reserved,
            "headroom": self.headroom,
            "fits": self.fits,
            "required": self.required,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Room:
        return cls(data["gpu"], int(data["usable"]), int(data["reserved"]), bool(data.get("required")))


def room(gpu: GpuProfile, reserved: int, *, required: bool = False) -> Room:
    """The room a step whose reserved peak is ``reserved`` leaves on ``gpu``."""
    return Room(gpu.name, usable_memory(gpu), reserved, required, gpu)
