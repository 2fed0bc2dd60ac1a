"""The CPU rule set, and the CPU its rules model."""

from __future__ import annotations

from typing import Final

import torch

from pytest_torchmem.engine.tracing.devices.common import COMMON
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile, host_profile
from pytest_torchmem.engine.tracing.rules import Inexact, OpCall, RuleSet

__all__ = ["CPU", "NATIVE_INSTRUCTIONS", "profile_of", "native_kernel_gap"]

#: The CPU rules; the modules of this package register into it.
CPU: Final[RuleSet] = COMMON.copy("cpu")

#: What the reason of a :func:`native_kernel_gap` says, to be told apart from other gaps.
NATIVE_INSTRUCTIONS: Final = "(native instructions)"


def profile_of(call: OpCall) -> CpuProfile:
    """The CPU a rule models: the trace's profile. A rule never asks the host
    itself; only a call made outside a trace (a rule's own test) reads the host
    as the process runs now (ISA caps, ``torch.get_num_threads()``)."""
    context = call.context
    if context is not None and context.cpu is not None:
        return context.cpu
    return host_profile()


def native_kernel_gap(call: OpCall, dtype: torch.dtype, kernels: str) -> tuple[Inexact, ...]:
    """``(Inexact,)`` when the modelled CPU computes ``dtype`` natively (the
    ``avx512_bf16`` and ``amx`` levels: oneDNN's brgemm, ATen's packed blocks),
    whose scratch no rule models; the call is then listed in ``unsupported``."""
    cpu = profile_of(call)
    name = str(dtype).removeprefix("torch.")
    if name not in cpu.native_dtypes:
        return ()
    return (
        Inexact(
            f"{kernels} in {name} on the {cpu.isa} level {NATIVE_INSTRUCTIONS} take scratch "
            "that is not modelled; the figure is that of the avx512 level"
        ),
    )
