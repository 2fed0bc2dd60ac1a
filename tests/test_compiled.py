"""Compiled models are never reported as eager figures in silence (issue 11, first step).

Under the tracer (and, today, under ``measure``) a compiled region runs
eagerly; the report lists every compiled region the step entered in
``unsupported``, where it is defined, so that nobody mistakes the figures for
the compiled program's. No region is compiled here: the tests stay fast.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.compiled import EAGER_REASON, MEASURED_EAGER_REASON


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


@torch.compile
def _scaled_gelu(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(h) * 2


class _CallsCompiledFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled_gelu(self.linear(x))


class _Regional(nn.Module):
    """Regional compilation: each repeated block compiled on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_block() for _ in range(2))
        for block in self.blocks:
            block.compile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _where(function: object) -> str:
    code = inspect.unwrap(function).__code__  # type: ignore[arg-type]
    return f"{code.co_filename}:{code.co_firstlineno}"


def _compiled(kind: str) -> tuple[nn.Module, str, str]:
    """A compiled model, the region's name and where it is defined."""
    sequential = f"{nn.Sequential.forward.__code__.co_filename}:"
    sequential += str(nn.Sequential.forward.__code__.co_firstlineno)
    if kind == "torch.compile(model)":
        return torch.compile(_block()), "Sequential.forward", sequential
    if kind == "model.compile()":
        model = _block()
        model.compile()
        return model, "Sequential.forward", sequential
    if kind == "compiled function in forward":
        return _CallsCompiledFunction(), "_scaled_gelu", _where(_scaled_gelu)
    return _Regional(), "Sequential.forward", sequential


KINDS = ["torch.compile(model)", "model.compile()", "compiled function in forward", "regional"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_compiled_region_is_listed_as_traced_eagerly(kind: str, device: str) -> None:
    model, name, where = _compiled(kind)
    x = torch.randn(4, 16)
    report = tm.estimate(model, x, device=device)
    compiled = [entry for entry in report.unsupported if entry.op.startswith("torch.compile")]
    assert [(entry.op, entry.reason, entry.location) for entry in compiled] == [
        (f"torch.compile: {name}", EAGER_REASON, where)
    ]
    assert not report.complete


def test_an_eager_model_lists_nothing_and_gives_the_same_figures() -> None:
    """The figures of a compiled model are the eager program's: said, not hidden."""
    torch.manual_seed(0)
    eager = _block()
    compiled = torch.compile(eager)
    x = torch.randn(4, 16)
    plain = tm.estimate(eager, x)
    assert plain.unsupported == ()
    flagged = tm.estimate(compiled, x)
    assert flagged.phase_peaks() == plain.phase_peaks()


def test_measure_lists_a_compiled_region_too() -> None:
    model, name, where = _compiled("compiled function in forward")
    report = tm.measure(model, torch.randn(4, 16))
    assert [(entry.op, entry.reason, entry.location) for entry in report.unsupported] == [
        (f"torch.compile: {name}", MEASURED_EAGER_REASON, where)
    ]


def test_the_watch_is_gone_after_the_trace() -> None:
    import torch._dynamo.eval_frame as eval_frame

    real = eval_frame._maybe_set_eval_frame
    tm.estimate(torch.compile(_block()), torch.randn(4, 16))
    assert eval_frame._maybe_set_eval_frame is real


class _Fusable(nn.Module):
    """The issue's block, small: inductor fuses ``gelu(h) * sigmoid(h) + tanh(h)``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        h = torch.nn.functional.gelu(h) * torch.sigmoid(h) + torch.tanh(h)
        return x + self.down(h)


def test_measure_runs_a_compiled_module_in_its_steady_state() -> None:
    """One warm-up step compiles; the measured step runs the compiled code (checked in the
    profiler's events), whose saved activations are fewer than eager's."""
    torch.manual_seed(0)
    model, x = _Fusable(), torch.randn(8, 16, 32)
    eager = tm.measure(model, x)
    compiled = tm.measure(torch.compile(model), x)
    assert compiled.unsupported == ()
    assert compiled.modules == {}  # per-module hooks would make dynamo fall back to eager code
    assert compiled.forward_peak < eager.forward_peak
    assert compiled.backward_peak < eager.backward_peak
    # the model is left as it was, and its eager figures are unchanged
    assert tm.measure(model, x).phase_peaks() == eager.phase_peaks()
