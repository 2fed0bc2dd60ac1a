"""Compiled models: followed on cpu, never reported as eager figures in silence (issue 11).

On cpu the estimate runs the program inductor builds for each compiled module
(no kernel compiled) and equals ``measure``, which runs the real compiled
step (the fake cuda device's program: tests/test_compiled_cuda.py). What is
not followed (compiled functions) runs eagerly and is listed in
``unsupported`` with where it is defined.
"""

from __future__ import annotations

import functools
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


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("kind", ["compiled function in forward"])
def test_a_compiled_region_is_listed_as_traced_eagerly(kind: str, device: str) -> None:
    model, name, where = _compiled(kind)
    x = torch.randn(4, 16)
    report = tm.estimate(model, x, device=device)
    compiled = [entry for entry in report.unsupported if entry.op.startswith("torch.compile")]
    assert [(entry.op, entry.reason, entry.location) for entry in compiled] == [
        (f"torch.compile: {name}", EAGER_REASON, where)
    ]
    assert not report.complete


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


# -- the compiled program, followed on cpu ------------------------------------------


def _compiled_code_ran(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether a real call of ``model`` runs dynamo's compiled code (the profiler's region)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        model(x)
    return any(event.name.startswith("Torch-Compiled Region") for event in prof.events())


class _Attention(nn.Module):
    """A pre-norm transformer block with scaled-dot-product attention."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class _Breaks(nn.Module):
    """A graph break in forward: two compiled graphs with eager code between them."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _Fusable(), _Fusable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def _conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))


class _Selective(nn.Module):
    """Selective activation checkpointing: matmuls saved, the rest recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Fusable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import (
            CheckpointPolicy,
            checkpoint,
            create_selective_checkpoint_contexts,
        )

        def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
            if op == torch.ops.aten.mm.default:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        # a partial: dynamo traces context_fn only as one
        contexts = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=contexts)


def _regional_fusable() -> nn.Module:
    blocks = nn.Sequential(_Fusable(), _Fusable())
    for block in blocks:
        block.compile()
    return blocks


FAMILIES = {
    "mlp": (lambda: torch.compile(_Fusable()), (8, 16, 32)),
    "transformer": (lambda: torch.compile(_Attention()), (2, 16, 32)),
    "conv-bn-relu": (lambda: torch.compile(_conv()), (2, 3, 16, 16)),
    "graph break": (lambda: torch.compile(_Breaks()), (8, 16, 32)),
    "selective checkpointing": (lambda: torch.compile(_Selective()), (8, 16, 32)),
    "regional": (_regional_fusable, (8, 16, 32)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_estimate_follows_the_compiled_program(family: str) -> None:
    """Byte for byte what measure sees of the real compiled step, in every phase; the eager
    estimate (the model without compile) beside it shows what the compiler changed."""
    torch.manual_seed(0)
    build, shape = FAMILIES[family]
    model, x = build(), torch.randn(*shape)
    estimated = tm.estimate(model, x, device="cpu", cpu=None)
    assert estimated.unsupported == ()
    measured = tm.measure(model, x, device="cpu")
    assert measured.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()


def test_an_eager_adamw_step_after_a_compiled_model() -> None:
    """The optimizer step itself is not compiled here: it runs eagerly in both."""
    torch.manual_seed(0)
    model, x = torch.compile(_Fusable()), torch.randn(8, 16, 32)

    def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params)

    estimated = tm.estimate(model, x, optimizer=adamw, cpu=None)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x, optimizer=adamw).phase_peaks()


def test_inference_follows_the_compiled_program() -> None:
    torch.manual_seed(0)
    model, x = torch.compile(_Fusable()), torch.randn(8, 16, 32)
    estimated = tm.estimate(model, x, train=False, cpu=None)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x, train=False).phase_peaks()


def test_dynamic_shapes_two_batch_sizes() -> None:
    torch.manual_seed(0)
    model = torch.compile(_Fusable(), dynamic=True)
    for batch in (4, 8):
        x = torch.randn(batch, 16, 32)
        estimated = tm.estimate(model, x, cpu=None)
        assert estimated.unsupported == ()
        assert estimated.phase_peaks() == tm.measure(model, x).phase_peaks()


def test_the_compiled_program_beats_the_eager_one() -> None:
    torch.manual_seed(0)
    eager, x = _Fusable(), torch.randn(8, 16, 32)
    compiled = tm.estimate(torch.compile(eager), x, cpu=None)
    plain = tm.estimate(eager, x, cpu=None)
    assert compiled.forward_peak < plain.forward_peak
    assert compiled.backward_peak < plain.backward_peak


def test_an_estimate_leaves_the_users_compiled_model_as_it_was() -> None:
    """After an estimate the model's real compiled calls run real compiled code (not the
    estimate's no-op kernels) and compute the eager values; the estimate's cache entries
    live in their own region, invalidated, and the user's region holds only their own."""
    from torch._dynamo.eval_frame import _get_cache_entries_for_region

    torch.manual_seed(0)
    eager, x = _Fusable(), torch.randn(8, 16, 32)
    model = torch.compile(eager)
    forward = model.forward
    with torch.no_grad():
        model(x)  # the user's own compile, in the user's (default) cache region
    codes = [c for c in _seen_codes() if _get_cache_entries_for_region(c, -1)]
    users = {c: len(_get_cache_entries_for_region(c, -1)) for c in codes}
    for _ in range(3):  # repeated estimates stay complete and never touch the user's region
        assert tm.estimate(model, x, cpu=None).unsupported == ()
    assert model.forward is forward
    assert {c: len(_get_cache_entries_for_region(c, -1)) for c in codes} == users
    with torch.no_grad():
        assert torch.allclose(model(x), eager(x), atol=1e-5)
    assert _compiled_code_ran(model, x)
    assert {c: len(_get_cache_entries_for_region(c, -1)) for c in codes} == users  # no recompile


def _seen_codes() -> list[object]:
    from torch._dynamo.convert_frame import input_codes

    return [code for ref in list(input_codes.seen) if (code := ref()) is not None]


@pytest.mark.parametrize(
    "options", [{"backend": "eager"}, {"backend": "aot_eager"}, {"options": {"cpp_wrapper": True}}]
)
def test_a_compiled_module_not_followed_is_listed(options: dict[str, object]) -> None:
    """Backends other than inductor, and inductor's C++ wrapper: eager figures, flagged."""
    torch.manual_seed(0)
    eager, x = _Fusable(), torch.randn(8, 16, 32)
    report = tm.estimate(torch.compile(eager, **options), x, cpu=None)  # type: ignore[call-overload]
    assert [entry.op for entry in report.unsupported] == ["torch.compile: _Fusable.forward"]
    assert report.phase_peaks() == tm.estimate(eager, x, cpu=None).phase_peaks()


def test_a_program_that_cannot_be_built_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of inductor while the estimate compiles: the module runs eagerly, flagged."""
    import torch._inductor.compile_fx as compile_fx

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("inductor failed")

    monkeypatch.setattr(compile_fx, "compile_fx", broken)
    torch.manual_seed(0)
    eager, x = _Fusable(), torch.randn(8, 16, 32)
    report = tm.estimate(torch.compile(eager), x, cpu=None)
    assert [entry.op for entry in report.unsupported] == ["torch.compile: _Fusable.forward"]
    assert report.phase_peaks() == tm.estimate(eager, x, cpu=None).phase_peaks()


def test_a_named_cpu_profile_other_than_the_host_is_said() -> None:
    """Inductor builds the program for the CPU it runs on: under a profile that is not
    this host (the plugin's default avx2:4 on most machines) the report says so."""
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import host_profile

    host = host_profile()
    other = f"{'avx2' if host.isa != 'avx2' else 'default'}:{host.threads}"
    model, x = torch.compile(_Fusable()), torch.randn(8, 16, 32)
    assert tm.estimate(model, x, cpu="host").unsupported == ()
    said = [u for u in tm.estimate(model, x, cpu=other).unsupported if u.op == "torch.compile: CPU profile"]
    assert len(said) == 1 and other in said[0].reason
