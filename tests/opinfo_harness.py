"""PyTorch's OpInfo samples run through ``estimate`` and ``measure``: one op, one verdict.

Shared by the op-coverage benchmark (``benchmarks/opinfo.py``) and its subset in
the test suite (``tests/test_opinfo.py``). Each sample of an OpInfo becomes an
``nn.Module`` whose forward calls the op on the sample's tensors, which are the
step's inputs (so they are charged as inputs); everything else the sample holds
is captured in the module. The loss is the sum of the floating outputs that
require grad, and the step trains only when there is one.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

import pytest_torchmem as tm

__all__ = [
    "DTYPES",
    "OpCallModule",
    "OpResult",
    "Outcome",
    "SampleResult",
    "op_function",
    "op_infos",
    "op_name",
    "run_op",
    "run_sample",
    "samples_of",
    "sum_of_outputs",
    "supports",
]

#: The dtypes the benchmark knows by name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


class Outcome(str, Enum):
    """What happened to one sample (or, worst sample first, to one op)."""

    #: ``estimate`` raised an exception that ``measure`` did not: a tracer failure.
    RAISED = "raised"
    #: The estimate differs from the measurement and ``unsupported`` is empty.
    INEXACT = "inexact"
    #: The estimate lists ``unsupported`` ops (an upper bound, or a stopped trace).
    FLAGGED = "flagged"
    #: Traced without ``unsupported`` entries, not measured (the fake cuda device).
    TRACED = "traced"
    #: Every phase peak equals the measurement.
    EXACT = "exact"
    #: The real op raised (or the step could not be measured): nothing to compare.
    MEASURE_FAILED = "measure failed"
    #: The sample cannot be a step's input (sparse or non-CPU tensors, no tensor at all).
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value


#: Worst first: an op's outcome is its worst sample's.
_SEVERITY = [
    Outcome.RAISED,
    Outcome.INEXACT,
    Outcome.FLAGGED,
    Outcome.TRACED,
    Outcome.EXACT,
    Outcome.MEASURE_FAILED,
    Outcome.SKIPPED,
]


@dataclass
class SampleResult:
    outcome: Outcome
    train: bool = False
    estimate: dict[str, int] = field(default_factory=dict)
    measure: dict[str, int] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def error_bytes(self) -> int:
        """The largest absolute phase-peak difference, in bytes."""
        if not self.estimate or not self.measure:
            return 0
        return max(abs(self.estimate[k] - self.measure[k]) for k in ("forward", "backward", "step"))


@dataclass
class OpResult:
    """The verdict on one OpInfo at one dtype."""

    op: str
    dtype: str
    samples: list[SampleResult] = field(default_factory=list)

    @property
    def outcome(self) -> Outcome:
        if not self.samples:
            return Outcome.SKIPPED
        return min((s.outcome for s in self.samples), key=_SEVERITY.index)

    @property
    def error_bytes(self) -> int:
        return max((s.error_bytes for s in self.samples), default=0)

    def to_dict(self) -> dict[str, Any]:
        samples = []
        for sample in self.samples:
            entry = asdict(sample)
            entry["outcome"] = sample.outcome.value
            samples.append(entry)
        return {
            "op": self.op,
            "dtype": self.dtype,
            "outcome": self.outcome.value,
            "samples": samples,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpResult:
        samples = [
            SampleResult(**{**entry, "outcome": Outcome(entry["outcome"])})
            for entry in data["samples"]
        ]
        return cls(data["op"], data["dtype"], samples)


def op_infos() -> list[Any]:
    """PyTorch's OpInfo database (needs the ``expecttest`` package)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def op_name(op: Any) -> str:
    """``name`` or ``name.variant`` (unique in op_db)."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


# -- a sample as a step --------------------------------------------------------------


class _Slot:
    """Where the ``index``-th tensor input goes back into the sample's structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a slot; the tensors appended in order."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if type(value) in (list, tuple):
        return type(value)(_split(v, tensors) for v in value)
    if type(value) is dict:
        return {k: _split(v, tensors) for k, v in value.items()}
    return value


def _join(value: Any, tensors: tuple[Any, ...]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if type(value) in (list, tuple):
        return type(value)(_join(v, tensors) for v in value)
    if type(value) is dict:
        return {k: _join(v, tensors) for k, v in value.items()}
    return value


def _seeded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    torch.manual_seed(42)
    return fn(*args, **kwargs)


def op_function(op: Any) -> Any:
    """The function an OpInfo calls, less the RNG stash of OpInfo's ``wrapper_set_seed``.

    Random ops are wrapped in ``wrapper_set_seed``, which seeds and restores the
    generator around the call: its ``torch.get_rng_state()`` is a 5056-byte CPU
    tensor made in C++ outside the dispatcher, a cost of the test harness (and of
    ``torch.utils.checkpoint``, where it is a known limit), not of the op. The copy
    only seeds.
    """
    fn = op.op
    code = getattr(fn, "__code__", None)
    if code is None or "wrapper_set_seed" not in code.co_names:
        return fn
    scope = {**fn.__globals__, "wrapper_set_seed": _seeded}
    return types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)


class OpCallModule(nn.Module):
    """``forward(*tensors)`` calls ``fn`` on the sample with ``tensors`` put back in."""

    def __init__(self, fn: Any, structure: Any) -> None:
        super().__init__()
        self.fn = fn
        self.structure = structure

    def forward(self, *tensors: torch.Tensor) -> Any:
        inp, args, kwargs = _join(self.structure, tensors)
        return self.fn(inp, *args, **kwargs)


def _floating_outputs(output: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [
        t
        for t in tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]


def sum_of_outputs(output: Any) -> torch.Tensor:
    """The loss: the sum of the floating outputs that require grad."""
    floats = _floating_outputs(output)
    total = floats[0].sum()
    for t in floats[1:]:
        total = total + t.sum()
    return total


def _usable(t: torch.Tensor) -> str:
    """Why ``t`` cannot be a step's input ('' when it can)."""
    if t.layout != torch.strided:
        return f"{t.layout} input"
    if t.device.type != "cpu":
        return f"input on {t.device}"
    if t.is_nested or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return "wrapped input"
    if type(t) not in (torch.Tensor, nn.Parameter):
        return f"{type(t).__name__} input"
    return ""


def _clone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _peaks(report: tm.MemoryReport) -> dict[str, int]:
    return {
        "forward": report.forward_peak,
        "backward": report.backward_peak,
        "step": report.step_peak,
    }


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def run_sample(op: Any, sample: Any, *, device: str = "cpu") -> SampleResult:
    """Estimate one sample (and, on cpu, measure it) and compare."""
    tensors: list[torch.Tensor] = []
    structure = _split((sample.input, list(sample.args), dict(sample.kwargs)), tensors)
    for t in tensors:
        why = _usable(t)
        if why:
            return SampleResult(Outcome.SKIPPED, error=why)
    module = OpCallModule(op_function(op), structure)
    # The real op decides whether there is anything to train, and whether the
    # sample is valid at all.
    try:
        output = module(*_clone(tensors))
    except Exception as exc:  # noqa: BLE001 - the real op's own failure
        return SampleResult(Outcome.MEASURE_FAILED, error=_describe(exc))
    train = bool(_floating_outputs(output))
    del output
    options: dict[str, Any] = {"train": train}
    if train:
        options["loss_fn"] = sum_of_outputs
    inputs = tuple(tensors)
    result = SampleResult(Outcome.EXACT, train=train)
    try:
        try:
            estimated = tm.estimate(module, inputs, device=device, **options)
        except tm.TraceStopped as stopped:  # flagged: its partial report lists the stop
            estimated = stopped.report
    except Exception as exc:  # noqa: BLE001 - recorded, then compared with the real run
        result.outcome = Outcome.RAISED
        result.error = _describe(exc)
    else:
        result.estimate = _peaks(estimated)
        result.unsupported = [str(entry) for entry in estimated.unsupported]
    if device != "cpu":
        if result.outcome is not Outcome.RAISED:
            result.outcome = Outcome.FLAGGED if result.unsupported else Outcome.TRACED
            return result
        # No GPU to run the step on: the CPU step says whether the program itself
        # fails (a backward formula with no kernel for the dtype, say).
        try:
            tm.measure(module, inputs, device="cpu", **options)
        except Exception as exc:  # noqa: BLE001
            if type(exc).__name__ == result.error.split(":")[0]:
                return SampleResult(Outcome.MEASURE_FAILED, train=train, error=_describe(exc))
        return result
    try:
        measured = tm.measure(module, inputs, device="cpu", **options)
    except Exception as exc:  # noqa: BLE001
        error = _describe(exc)
        if result.outcome is Outcome.RAISED and result.error.split(":")[0] == error.split(":")[0]:
            # The same failure as the real step: the user's error, propagated.
            return SampleResult(Outcome.MEASURE_FAILED, train=train, error=error)
        if result.outcome is Outcome.RAISED:
            return result
        return SampleResult(
            Outcome.MEASURE_FAILED, train=train, error=error, estimate=result.estimate
        )
    result.measure = _peaks(measured)
    if result.outcome is Outcome.RAISED:
        return result
    if result.unsupported:
        result.outcome = Outcome.FLAGGED
    elif result.estimate != result.measure:
        result.outcome = Outcome.INEXACT
    return result


def samples_of(op: Any, dtype: torch.dtype, limit: int) -> Iterator[Any]:
    requires_grad = bool(op.supports_autograd and dtype.is_floating_point)
    torch.manual_seed(0)
    for i, sample in enumerate(op.sample_inputs("cpu", dtype, requires_grad=requires_grad)):
        if i >= limit:
            return
        yield sample


def run_op(op: Any, dtype: torch.dtype, *, limit: int = 3, device: str = "cpu") -> OpResult:
    """Run the first ``limit`` samples of ``op`` at ``dtype``."""
    result = OpResult(op_name(op), str(dtype).removeprefix("torch."))
    try:
        for sample in samples_of(op, dtype, limit):
            result.samples.append(run_sample(op, sample, device=device))
    except Exception as exc:  # noqa: BLE001 - OpInfo's own sample generation failed
        if not result.samples:
            result.samples.append(SampleResult(Outcome.SKIPPED, error="samples: " + _describe(exc)))
    return result


def supports(op: Any, dtype: torch.dtype) -> bool:
    """Whether ``op`` runs at ``dtype`` on cpu, as its OpInfo says."""
    return dtype in op.supported_dtypes("cpu")
