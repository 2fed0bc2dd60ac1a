"""The result of one traced or measured step: :class:`MemoryReport` and its JSON form."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Final

__all__ = ["Category", "ModulePeak", "StepPeaks", "Unsupported", "MemoryReport", "SCHEMA_VERSION", "worst_first"]

#: Version of the report's JSON form; bumped on any incompatible change. Schema 2: a
#: training step's figures are its loop's, the first step beside them (``first_step``);
#: schema-1 reports (written before) are read as reports with no first step.
SCHEMA_VERSION: Final = 2


#: The name of the whole model in a report's ``modules``.
ROOT_NAME: Final = "(model)"


class Category(str, Enum):
    """What a storage is for; each live byte at the peak belongs to exactly one.

    A storage shared by several roles is charged to the first role in this order.
    """

    #: ``nn.Parameter`` storages of the model.
    PARAMETERS = "parameters"
    #: Registered buffers of the model (running statistics, caches, masks).
    BUFFERS = "buffers"
    #: The tensors handed to the model.
    INPUTS = "inputs"
    #: ``.grad`` of parameters and inputs (existing ones and those made by backward).
    GRADIENTS = "gradients"
    #: Tensors kept by the optimizer in ``optimizer.state``.
    OPTIMIZER_STATE = "optimizer_state"
    #: Tensors made during forward and ``loss_fn``, including those saved for backward.
    ACTIVATIONS = "activations"
    #: Other tensors made during backward and the optimizer step.
    TEMPORARIES = "temporaries"
    #: Scratch that kernels take from the allocator and return before they finish.
    WORKSPACE = "workspace"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ModulePeak:
    """Peak live bytes on the device while a module's forward, and its backward, ran.

    The figure is the whole device's live bytes, not only what the module made;
    0 means the module did not run in that phase.
    """

    forward: int = 0
    backward: int = 0


@dataclass(frozen=True, slots=True)
class StepPeaks:
    """Peak live bytes of each phase of one iteration of a training loop."""

    forward: int
    backward: int = 0
    step: int = 0

    @property
    def peak(self) -> int:
        return max(self.forward, self.backward, self.step)

    def to_dict(self) -> dict[str, int]:
        return {
            "forward_peak": self.forward,
            "backward_peak": self.backward,
            "step_peak": self.step,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepPeaks:
        return cls(
            int(data["forward_peak"]),
            int(data.get("backward_peak", 0)),
            int(data.get("step_peak", 0)),
        )


@dataclass(frozen=True, slots=True)
class Unsupported:
    """An op that could not be traced faithfully, and where the user's code called it."""

    op: str
    reason: str
    location: str = ""

    def __str__(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"{self.op}{where}: {self.reason}"


def _frozen(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class MemoryReport:
    """Peak memory of one step on one device, in bytes.

    Produced by :func:`pytest_torchmem.estimate` and :func:`pytest_torchmem.measure`;
    see the design notes for the exact meaning of each figure.

    A step with an optimizer runs as a training loop does: ``forward_peak``,
    ``backward_peak`` and ``step_peak`` are the loop's from its second iteration on
    (the optimizer's state alive through forward and backward), and ``first_step``
    the first iteration's, which creates that state (None for a step without an
    optimizer, which runs once). ``peak`` is the largest of them all.
    """

    device: str
    forward_peak: int
    backward_peak: int = 0
    step_peak: int = 0
    breakdown: Mapping[Category, int] = field(default_factory=dict)
    reserved_peak: int | None = None
    modules: Mapping[str, ModulePeak] = field(default_factory=dict)
    unsupported: tuple[Unsupported, ...] = ()
    #: The machine the figures are for: the CPU profile (``"avx2:4"``) on cpu, the
    #: GPU (``"H100"``) on cuda; for :func:`~pytest_torchmem.measure`, the host's.
    profile: str | None = None
    #: The first iteration of the loop (a step with an optimizer), else None.
    first_step: StepPeaks | None = None
    #: The peak of each of the user's own phases (``with tm.phase("generate"): ...``),
    #: by name, in the order first met: the highest live bytes while it lasted.
    phases: Mapping[str, int] = field(default_factory=dict)
    #: A step function's iterations in order (a forward after a backward or a step
    #: begins the next), each one's forward, backward and step peaks; the three peaks
    #: above are the highest of them. Empty for the built-in step (its loop is
    #: :attr:`first_step` and the three peaks).
    iterations: tuple[StepPeaks, ...] = ()
    #: What the trace replayed instead of tracing it again (a loop's later iterations'
    #: forward and backward, recorded in its first), or why it traced it: one line each.
    #: The figures are the same either way, so reports compare equal whatever it says.
    replayed: tuple[str, ...] = field(default=(), compare=False)
    #: cuda only (``estimate``): the highest bytes of host memory the step held at once of
    #: what it made on the host (pinned buffers, offloaded activations, batches made on the
    #: CPU): the GPU's figures above do not count them. None elsewhere, and where the trace
    #: replayed (a loop's later iterations, repeated blocks: replays repeat the GPU's work),
    #: so that it takes no part in a report's equality, as :attr:`replayed` does not.
    host_peak: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        breakdown = {Category(key): int(value) for key, value in self.breakdown.items()}
        ordered = {category: breakdown.get(category, 0) for category in Category}
        object.__setattr__(self, "breakdown", _frozen(ordered))
        object.__setattr__(self, "modules", _frozen(self.modules))
        object.__setattr__(self, "phases", _frozen({str(k): int(v) for k, v in self.phases.items()}))
        object.__setattr__(self, "unsupported", tuple(self.unsupported))
        iterations = tuple(it if isinstance(it, StepPeaks) else StepPeaks(*it) for it in self.iterations)
        object.__setattr__(self, "iterations", iterations)
        object.__setattr__(self, "replayed", tuple(self.replayed))

    @property
    def peak(self) -> int:
        """The largest of the phase peaks, the first step's included."""
        loop = max(self.forward_peak, self.backward_peak, self.step_peak)
        return loop if self.first_step is None else max(loop, self.first_step.peak)

    @property
    def complete(self) -> bool:
        """True when every op was traced faithfully (``unsupported`` is empty)."""
        return not self.unsupported

    def phase_peaks(self) -> dict[str, int]:
        """``{"forward": ..., "backward": ..., "step": ..., "peak": ...}``, and the first
        step's peak (``"first_step"``: :attr:`first_step`'s largest phase) where the step
        ran as a training loop."""
        peaks = {
            "forward": self.forward_peak,
            "backward": self.backward_peak,
            "step": self.step_peak,
            "peak": self.peak,
        }
        if self.first_step is not None:
            peaks["first_step"] = self.first_step.peak
        return peaks

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` gives back an equal report."""
        return {
            "schema": SCHEMA_VERSION,
            "device": self.device,
            "forward_peak": self.forward_peak,
            "backward_peak": self.backward_peak,
            "step_peak": self.step_peak,
            "peak": self.peak,
            "reserved_peak": self.reserved_peak,
            "breakdown": {category.value: nbytes for category, nbytes in self.breakdown.items()},
            "modules": {
                name: {"forward": peak.forward, "backward": peak.backward}
                for name, peak in self.modules.items()
            },
            "unsupported": [
                {"op": entry.op, "reason": entry.reason, "location": entry.location}
                for entry in self.unsupported
            ],
            "profile": self.profile,
            "first_step": None if self.first_step is None else self.first_step.to_dict(),
            "phases": dict(self.phases),
            "iterations": [it.to_dict() for it in self.iterations],
            "replayed": list(self.replayed),
            "host_peak": self.host_peak,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryReport:
        """Rebuild a report from :meth:`to_dict` output."""
        schema = data.get("schema", SCHEMA_VERSION)
        if schema not in (1, SCHEMA_VERSION):
            raise ValueError(
                f"report schema {schema!r} is not supported "
                f"(this version reads 1 to {SCHEMA_VERSION})"
            )
        first = data.get("first_step")
        return cls(
            device=data["device"],
            forward_peak=int(data["forward_peak"]),
            backward_peak=int(data.get("backward_peak", 0)),
            step_peak=int(data.get("step_peak", 0)),
            reserved_peak=data.get("reserved_peak"),
            breakdown=data.get("breakdown", {}),
            modules={
                name: ModulePeak(int(peak["forward"]), int(peak["backward"]))
                for name, peak in data.get("modules", {}).items()
            },
            unsupported=tuple(Unsupported(**entry) for entry in data.get("unsupported", ())),
            profile=data.get("profile"),
            first_step=None if first is None else StepPeaks.from_dict(first),
            phases=data.get("phases", {}),
            iterations=tuple(StepPeaks.from_dict(it) for it in data.get("iterations", ())),
            replayed=tuple(data.get("replayed", ())),
            host_peak=data.get("host_peak"),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # its mappings are read-only proxies, which do not pickle: it travels as its dict
        return (MemoryReport.from_dict, (self.to_dict(),))

    def to_json(self, **kwargs: Any) -> str:
        """The report as JSON text (sorted keys, two-space indent unless overridden)."""
        kwargs.setdefault("indent", 2)
        kwargs.setdefault("sort_keys", True)
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> MemoryReport:
        return cls.from_dict(json.loads(text))


def worst_first(report: MemoryReport) -> tuple[int, int]:
    """The order of ranks, worst first (as a sort key, ascending): the highest reserved
    peak (what runs out of a GPU; on cpu there is none), then the highest peak."""
    reserved = report.reserved_peak if report.reserved_peak is not None else report.peak
    return (-reserved, -report.peak)
