"""The device a step is modelled (or measured) on: :class:`ModelledDevice`, its kind and the
profile its figures follow.

A step request (:mod:`pytest_torchmem.engine.step.request`) holds one, made from the
user's ``device=`` by :func:`modelled_device`, the one place outside the tracer's device
rules (:mod:`pytest_torchmem.engine.tracing.devices`) that reads a device's name; the
profiles are resolved once, by the entry point (``estimate``'s ``gpu=`` and ``cpu=``, the
plugin's markers and options), and read from it downstream. Callers ask its predicates
(:attr:`ModelledDevice.is_cuda`, :func:`is_cuda`) rather than compare names.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile

__all__ = [
    "CPU",
    "CUDA",
    "DEVICE_KINDS",
    "ModelledDevice",
    "device_kind",
    "is_cpu",
    "is_cuda",
    "modelled_device",
    "names_cuda",
]

CPU: Final = "cpu"
CUDA: Final = "cuda"
#: The device kinds the engine models, as reports and snapshot entries name them.
DEVICE_KINDS: Final = (CPU, CUDA)


@dataclass(frozen=True)
class ModelledDevice:
    """One device kind, with the profile its figures follow once resolved."""

    #: ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` is ``"cuda"``): what reports name.
    kind: str
    #: cuda: the GPU the caching allocator and the CUDA rules follow; None: not resolved (a
    #: measurement runs on this machine's GPU).
    gpu: GpuProfile | None = None
    #: cpu: the :class:`~pytest_torchmem.engine.tracing.devices.cpu.profiles.CpuProfile` the
    #: CPU rules follow; None: not resolved (a measurement runs on this host).
    cpu: Any = None

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.kind!r}")
        if self.gpu is not None and self.kind != CUDA:
            raise ValueError(f"a GPU profile applies to device='cuda' only, not {self.kind!r}")
        if self.cpu is not None and self.kind != CPU:
            raise ValueError(f"a CPU profile applies to device='cpu' only, not {self.kind!r}")

    @property
    def is_cuda(self) -> bool:
        return self.kind == CUDA

    @property
    def is_cpu(self) -> bool:
        return self.kind == CPU

    @property
    def profile(self) -> GpuProfile | Any | None:
        """The profile the figures follow: the GPU's on cuda, the CPU's on cpu."""
        return self.gpu if self.is_cuda else self.cpu

    def following(self, gpu: GpuProfile | None = None, cpu: Any = None) -> ModelledDevice:
        """This kind following ``gpu`` (on cuda) or ``cpu`` (on cpu): the other is dropped,
        so that a caller holding both (the plugin: the run's GPU and CPU) passes both."""
        return dataclasses.replace(self, gpu=gpu if self.is_cuda else None, cpu=cpu if self.is_cpu else None)

    def __str__(self) -> str:
        return self.kind


def device_kind(device: Any) -> str:
    """The kind ``device`` names (``"cpu"``, ``"cuda"`` or ``"cuda:N"``): ``"cpu"`` or
    ``"cuda"``; ``TypeError`` or ``ValueError`` for anything else."""
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu' or 'cuda', got {device!r}")
    kind, _, index = device.partition(":")
    if kind not in DEVICE_KINDS or (index and (kind == CPU or not index.isdecimal())):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return kind


def modelled_device(device: Any, gpu: GpuProfile | None = None, cpu: Any = None) -> ModelledDevice:
    """The device ``device`` names (see :func:`device_kind`), following ``gpu`` or ``cpu``
    where it is of their kind (the other is dropped)."""
    return ModelledDevice(device_kind(device)).following(gpu, cpu)


def names_cuda(device: object) -> bool:
    """Whether a user's ``device=`` (``"cuda"``, ``"cuda:N"``, a ``torch.device``) names the
    ``cuda`` kind, before it is validated (:func:`device_kind` refuses what names none)."""
    return str(device).partition(":")[0] == CUDA


def is_cuda(name: object) -> bool:
    """Whether ``name`` is ``"cuda"``: a device kind as a report, a snapshot entry or an
    option holds it (for a user's argument, which may say ``"cuda:N"``, see
    :func:`device_kind`)."""
    return name == CUDA


def is_cpu(name: object) -> bool:
    """Whether ``name`` is ``"cpu"`` (as :func:`is_cuda`)."""
    return name == CPU
