"""Device models: what a device does differently from what fake tensors show.

Each model names its device and holds its :class:`~pytest_torchmem.tracing.rules.RuleSet`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from pytest_torchmem.tracing.devices.cpu import CPU
from pytest_torchmem.tracing.rules import RuleSet

__all__ = ["DeviceModel", "device_model", "DEVICES"]


@dataclass(frozen=True)
class DeviceModel:
    """How one device kind is traced."""

    name: str
    #: Where the fake tensors live during the trace.
    trace_device: torch.device
    rules: RuleSet


DEVICES: Final[dict[str, DeviceModel]] = {
    "cpu": DeviceModel("cpu", torch.device("cpu"), CPU),
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
