"""Why a trace stopped, and what the user can do about it: a :class:`Stop`.

The tracker stops the trace where an op can be neither run on fake tensors nor
modelled (:data:`CANNOT_RUN`, :data:`VALUES`, :data:`COMPRESSED_SPARSE`); an exception
raised out of the step is the trace's failure, not the program's, where fake
tensors caused it (:data:`READS_VALUES`) or where it came after a value-dependent
op got a stand-in value (:data:`AFTER_STAND_IN`; a device mismatch there has
advice of its own). :func:`stop_of` tells those exceptions from the program's
own, which propagate unchanged. The trace then raises
:class:`~pytest_torchmem.engine.figures.stopped.TraceStopped` with the stop's entry and advice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import torch

from pytest_torchmem.engine.step.nesting import NestedStepError
from pytest_torchmem.engine.figures.report import Unsupported
from pytest_torchmem.engine.figures.modelled_device import is_cuda
from pytest_torchmem.engine.figures.stopped import STOPPED_HERE
from pytest_torchmem.engine.torch_compat.torch_private import present, private
from pytest_torchmem.engine.tracing.fake_limits import fake_tensor_limit, first_line
from pytest_torchmem.engine.user.user_code import location_in

__all__ = [
    "AFTER_STAND_IN",
    "CANNOT_RUN",
    "COMPRESSED_SPARSE",
    "READS_VALUES",
    "VALUES",
    "Stop",
    "stop_of",
    "stopped_here",
]

_MISMATCH_ERROR: Final = "torch._subclasses.fake_tensor.FakeTensorDeviceMismatchError"
#: What torch 2.10 to 2.12 raise instead (torch/_subclasses/fake_tensor.py, 2.12.1 line 1050).
_MISMATCH_MESSAGE: Final = re.compile(
    r"Unhandled FakeTensor Device Propagation for (\S+), found two different devices ([\w:]+), ([\w:]+)"
)


def _device_mismatch(exc: BaseException) -> tuple[str, torch.device, torch.device] | None:
    """``(op, one device, the other)`` where ``exc`` is a fake tensor's refusal of an op on
    tensors of two devices, else None."""
    if present(_MISMATCH_ERROR):
        if isinstance(exc, private(_MISMATCH_ERROR)):
            return str(exc.func), exc.common_device, exc.device  # type: ignore[attr-defined]
        return None
    found = _MISMATCH_MESSAGE.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return None if found is None else (found[1], torch.device(found[2]), torch.device(found[3]))

_MEASURE: Final = "or measure the step for real (tm.measure)"
#: An op with no fake or meta kernel, whose arguments' values the trace does not know.
CANNOT_RUN: Final = (
    "give the op a fake kernel (torch.library.register_fake) or a rule of the device "
    f"(pytest_torchmem_add_rules), {_MEASURE}"
)
#: An op whose outputs depend on values the trace does not know, with no fallback rule.
VALUES: Final = (
    "the trace knows the values of small tensors computed from the step's inputs, buffers "
    "and parameters only: give the op a fallback rule (pytest_torchmem_add_rules), " + _MEASURE
)
#: Code that reads a tensor's data (``.numpy()``, C++ reading values).
READS_VALUES: Final = (
    "code that reads a tensor's data (.numpy(), a C++ extension) cannot run on fake tensors: "
    "keep it out of the step, " + _MEASURE
)
#: A compressed sparse tensor, which fake tensors cannot hold or run ops on.
COMPRESSED_SPARSE: Final = (
    "fake tensors have no kernels for compressed sparse tensors: measure the step for real (tm.measure)"
)
#: An exception after a stand-in value: the real values may not take that path.
AFTER_STAND_IN: Final = (
    "the real values may not take this path: compute that value from the step's inputs, "
    "so that the trace knows it, " + _MEASURE
)


@dataclass(frozen=True)
class Stop:
    """What stopped a trace (as listed in its ``unsupported``), and what to do."""

    entry: Unsupported
    advice: str


def stopped_here(op: str, reason: str, location: str, advice: str) -> Stop:
    """The stop at ``op`` for ``reason``, the entry's reason marked as the stop."""
    return Stop(Unsupported(op, reason + STOPPED_HERE, location), advice)


def stop_of(
    exc: BaseException, assumed: Unsupported | None, device: str, trace_device: torch.device
) -> Stop | None:
    """The stop ``exc``, raised out of the traced step, makes, or None where it is the
    program's own error (the user's exception, a shape error the real kernel raises too).

    The trace's: what fake tensors lack (:func:`fake_tensor_limit`: values read by C++
    code or ``.numpy()``, a fake kernel), and any exception raised after a stand-in for a
    value-dependent op (``assumed``: the first, ``.item()`` or ``nonzero``) was used,
    since the real values could have taken the program elsewhere. ``device`` is the
    modelled device, whose tensors live on ``trace_device`` in the trace.
    """
    if not isinstance(exc, Exception) or isinstance(exc, NestedStepError):
        return None  # (a nested estimate or measure is the caller's error, however it came)
    where = location_in(exc)
    if fake_tensor_limit(exc):
        op = "Tensor.numpy" if ".numpy()" in str(exc) else "(tensor values)"
        return stopped_here(op, f"fake tensors cannot run it ({first_line(exc)})", where, READS_VALUES)
    at = f" at {assumed.location}" if assumed is not None and assumed.location else ""
    after = f"after {assumed.op}{at} was given a stand-in value" if assumed is not None else ""
    mismatch = _device_mismatch(exc)
    if mismatch is not None:
        # (the real device raises too, but in words of the trace's devices: said as the
        # program saw them, with the fix, and the part of the step that ran)
        # the devices as the program saw them (the fake cuda device's tensors are meta ones)
        func, one, other = mismatch
        names = [device if d == trace_device else str(d) for d in (one, other)]
        names.sort(key=lambda name: name != device)  # (the modelled device first)
        advice = (
            f'move the batch to the device (batch.to("{device}")), and any tensor the step takes '
            "from outside its inputs (labels a loss reads: labels.to(logits.device)), as a GPU "
            "would require"
            if is_cuda(device)
            else f"move every tensor of the step to {device}, as a real run would require"
        )
        return stopped_here(
            func, f"its tensors are on two devices, {' and '.join(names)}{f' ({after})' if after else ''}", where, advice
        )
    if assumed is None:
        return None
    return stopped_here(type(exc).__name__, f"{first_line(exc)}, raised {after}", where, AFTER_STAND_IN)
