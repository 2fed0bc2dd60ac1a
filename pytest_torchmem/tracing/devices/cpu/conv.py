"""CPU rules: conv."""

from __future__ import annotations

import torch

from pytest_torchmem.tracing.devices.cpu.base import CPU  # noqa: F401

aten = torch.ops.aten
