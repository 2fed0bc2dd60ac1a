"""The CPU rule set, and the CPU its rules model."""

from __future__ import annotations

from typing import Final

from pytest_torchmem.engine.tracing.devices.common import COMMON
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile, host_profile
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["CPU", "profile_of"]

#: The CPU rules; the modules of this package register into it.
CPU: Final[RuleSet] = COMMON.copy("cpu")


def profile_of(call: OpCall) -> CpuProfile:
    """The CPU a rule models: the trace's profile. A rule never asks the host
    itself; only a call made outside a trace (a rule's own test) reads the host
    as the process runs now (ISA caps, ``torch.get_num_threads()``)."""
    context = call.context
    if context is not None and context.cpu is not None:
        return context.cpu
    return host_profile()
