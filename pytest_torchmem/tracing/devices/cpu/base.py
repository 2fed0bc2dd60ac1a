"""The CPU rule set, and what CPU rules read about the machine."""

from __future__ import annotations

from typing import Final

import torch

from pytest_torchmem.tracing.devices.common import COMMON
from pytest_torchmem.tracing.rules import RuleSet

__all__ = ["CPU", "num_threads", "cpu_capability"]

#: The CPU rules; the modules of this package register into it.
CPU: Final[RuleSet] = COMMON.copy("cpu")


def num_threads() -> int:
    """Intra-op threads of this process (``torch.get_num_threads()``): per-thread
    buffers of parallel kernels scale with it."""
    return torch.get_num_threads()


def cpu_capability() -> str:
    """The vector ISA ATen's kernels dispatch to: ``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``..."""
    return torch.backends.cpu.get_cpu_capability()
