"""Device models: how each modelled device is traced, and what it does that fake tensors don't show.

A :class:`DeviceModel` names the device, where its fake tensors live during
the trace, its per-op :class:`~pytest_torchmem.engine.tracing.rules.RuleSet`, the
device's own machinery: an allocator model (CUDA's caching allocator), a
router for the decisions CUDA dispatch makes differently (a torch-function
mode), and the layers its traced step runs in, in order
(:mod:`pytest_torchmem.engine.tracing.layers`). (torch's own optimizer defaults,
foreach and fused, follow on the fake cuda device from what its GPU view
answers: ``cuda/gpu_view.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from pytest_torchmem.engine.figures.timeline import Allocator
from pytest_torchmem.engine.tracing.devices import cuda
from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.engine.tracing.devices.cpu.router import CpuRouter
from pytest_torchmem.engine.tracing.layers import CPU_LAYERS, CUDA_LAYERS, Layer
from pytest_torchmem.engine.tracing.rules import RuleSet, TraceContext

__all__ = ["DeviceModel", "device_model", "DEVICES"]


@dataclass(frozen=True)
class DeviceModel:
    """How one device kind is traced."""

    name: str
    #: Where the fake tensors of the modelled device live during the trace.
    trace_device: torch.device
    rules: RuleSet
    #: Device types a traced program may name that stand for this device.
    aliases: frozenset[str] = frozenset()
    #: Whether Python numbers passed where an op takes a Tensor cost this device memory.
    wraps_numbers: bool = False
    #: The allocator model storages are charged through; None: each costs its bytes.
    allocator: Callable[[TraceContext], Allocator] | None = None
    #: The torch-function mode that routes this device's dispatch decisions, if any.
    router: Callable[[TraceContext], Any] | None = None
    #: The contexts its traced step runs in, outermost first (see layers.py: each says why).
    layers: tuple[Layer, ...] = CPU_LAYERS

    @property
    def is_cuda(self) -> bool:
        """The fake ``cuda`` device's model (its callers ask, rather than compare names)."""
        return self.name == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"


DEVICES: Final[dict[str, DeviceModel]] = {
    "cpu": DeviceModel(
        "cpu",
        trace_device=torch.device("cpu"),
        rules=CPU,
        aliases=frozenset({"meta"}),
        wraps_numbers=True,
        router=CpuRouter,
        layers=CPU_LAYERS,
    ),
    # On a CPU-only torch an autograd op on a (fake) cuda tensor kills the
    # interpreter, so the fake cuda device is traced on fake meta tensors: the
    # program sees a device that is not the host, and host tensors (optimizer
    # step counters, torch.tensor(...) constants) stay on cpu, uncharged.
    "cuda": DeviceModel(
        "cuda",
        trace_device=torch.device("meta"),
        rules=cuda.CUDA,
        aliases=frozenset({"cuda"}),
        wraps_numbers=False,
        allocator=cuda.caching_allocator,
        router=cuda.router,
        layers=CUDA_LAYERS,
    ),
}


def device_model(device: str) -> DeviceModel:
    """The model for ``device`` (``"cpu"``, ``"cuda"`` or ``"cuda:N"``)."""
    kind = device.split(":", 1)[0]
    model = DEVICES.get(kind)
    if model is None:
        raise ValueError(
            f"device {device!r} is not modelled; use one of: {', '.join(sorted(DEVICES))}"
        )
    return model
