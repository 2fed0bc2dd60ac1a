"""Compiled models: followed on cpu, never reported as eager figures in silence (issue 11).

On cpu the estimate runs the program inductor builds for each compiled region
(compiled modules, compiled functions called in ``forward``, a compiled
optimizer step; no kernel compiled), built for the CPU profile, and equals
``measure``, which runs the real compiled step in its steady state (the fake
cuda device's program: tests/test_compiled_cuda.py). What is not followed
(other backends, inductor's C++ wrapper, compiled functions on cuda) runs
eagerly and is listed in ``unsupported`` with where it is defined.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import tempfile
import warnings

import pytest
import torch
from compiled_zoo import FAMILIES, Attention, Fusable, adamw, compiled_adamw
from following import follows_compiled
from profiled import as_measured_here, every_peak, measure_compiled, reachable
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.compiled import (
    UNISOLATED_REASON,
    eager_reason,
    following_blocked,
    isolating,
)
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile, host_profile


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


def _where(function: object) -> str:
    code = inspect.unwrap(function).__code__  # type: ignore[arg-type]
    return f"{code.co_filename}:{code.co_firstlineno}"


@pytest.mark.skipif(isolating(), reason="torch 2.13 on: compiled functions are followed on cuda too")
def test_a_compiled_function_on_cuda_is_listed_as_traced_eagerly() -> None:
    """Where no compiled region is followed (torch 2.10 to 2.12): the eager figures, said.
    (From 2.13 a compiled function in forward is followed on cuda: test_compiled_cuda.py.)"""
    report = tm.estimate(_CallsCompiledFunction(), torch.randn(4, 16), device="cuda")
    compiled = [entry for entry in report.unsupported if entry.op.startswith("torch.compile")]
    assert [(entry.op, entry.reason, entry.location) for entry in compiled] == [
        ("torch.compile: _scaled_gelu", eager_reason(), _where(_scaled_gelu))
    ]
    assert not report.complete


def test_the_private_names_of_compiled_models_are_where_the_table_says() -> None:
    """Each private dynamo and inductor name of compiled models is present in exactly the
    releases its entry names (since/until): following is blocked nowhere it need not be."""
    from pytest_torchmem.engine.torch_compat.torch_private import present
    from pytest_torchmem.engine.torch_compat.torch_private_compiled import COMPILED_ENTRIES
    from pytest_torchmem.engine.torch_compat.torch_release import installed_release

    release = installed_release()[:2]
    assert {e.path: present(e.path) for e in COMPILED_ENTRIES} == {
        e.path: e.expected(release) for e in COMPILED_ENTRIES
    }
    assert (following_blocked() is None) == (release >= (2, 13))


def test_the_watch_is_gone_after_the_trace() -> None:
    import torch._dynamo.eval_frame as eval_frame

    real = eval_frame._maybe_set_eval_frame
    tm.estimate(torch.compile(_block()), torch.randn(4, 16))
    assert eval_frame._maybe_set_eval_frame is real


# -- the compiled program, followed on cpu: the accuracy suite -----------------------


def _figures(name: str, compiled: bool, cpu: object = None) -> list[dict[str, int]]:
    """The estimates of family ``name`` (each of its shapes), compiled or eager."""
    family = FAMILIES[name]
    model, x, options = family.make(compiled)
    shapes = [x, *(torch.randn(*shape) for shape in family.more_shapes)]
    reports = [tm.estimate(model, inputs, cpu=cpu, **options) for inputs in shapes]  # type: ignore[arg-type]
    assert all(report.unsupported == () for report in reports), [r.unsupported for r in reports]
    return [every_peak(report) for report in reports]


@follows_compiled
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_estimate_follows_the_compiled_program(name: str) -> None:
    """Byte for byte what measure sees of the real compiled step, in every phase, at this
    host's level and threads; the eager estimate beside it shows what the compiler changed."""
    family = FAMILIES[name]
    model, x, options = family.make(compiled=True)
    measured = []
    for inputs in [x, *(torch.randn(*shape) for shape in family.more_shapes)]:
        report = tm.measure(model, inputs, **options)
        assert report.unsupported == ()
        measured.append(every_peak(report))
    estimated = _figures(name, compiled=True)
    eager = _figures(name, compiled=False)
    assert estimated == measured, f"eager: {eager}"


#: Lower levels than this host's, measured in capped processes, and the families
#: measured there: the plugin's default profile with every family, and a CPU without
#: AVX on one thread (inductor's scalar kernels) with one family of each kind of
#: program (fused pointwise, convolution, recomputation, optimizer step).
LOWER = {
    CpuProfile("avx2", 4): list(FAMILIES),
    CpuProfile("default", 1): ["mlp", "conv-bn-relu", "selective checkpointing", "adamw step"],
}


@follows_compiled
@pytest.mark.parametrize("profile", list(LOWER), ids=str)
def test_the_estimate_under_a_named_profile_is_that_cpus(profile: CpuProfile) -> None:
    """Under a named profile inductor builds for that CPU (its vector width and threads),
    and the kernels it leaves to ATen follow the profile's rules: the estimate made in this
    process equals measure in a process capped to the level, at the profile's threads."""
    if not reachable(profile):
        pytest.skip(f"this host cannot run {profile.isa}")
    here = as_measured_here(profile)
    names = LOWER[profile]
    measured = measure_compiled(here, names)
    wrong = {}
    for name in names:
        estimated = _figures(name, compiled=True, cpu=here)
        if estimated != measured[name]:
            wrong[name] = (estimated, measured[name])
    assert wrong == {}


class _ScatterSum(nn.Module):
    """A summing ``scatter_reduce``: inductor runs its own kernel on one thread and ATen's
    on more (``needs_fallback_due_to_atomic_add_limitations``), with other buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        h = self.linear(x).relu() * 2
        out = torch.zeros(16, 32, dtype=h.dtype).scatter_reduce(0, index, h, "sum")
        return out.sigmoid()


@follows_compiled
def test_the_program_is_built_for_the_profiles_threads() -> None:
    """The plan depends on the thread count here (1 thread: a smaller forward); the
    estimate follows the profile's threads, not this process's."""
    from exactness import intra_op_threads

    torch.manual_seed(0)
    inputs = (torch.randn(64, 32), torch.randint(0, 16, (64, 32)))
    host = host_profile()
    measured = {}
    for threads in (1, 4):
        with intra_op_threads(threads):
            measured[threads] = tm.measure(torch.compile(_ScatterSum()), inputs).phase_peaks()
    assert measured[1] != measured[4]
    with intra_op_threads(2):
        for threads in (1, 4):
            profile = CpuProfile(host.isa, threads, l1d=host.l1d, l2=host.l2, l3=host.l3)
            report = tm.estimate(torch.compile(_ScatterSum()), inputs, cpu=profile)
            assert report.unsupported == ()
            assert report.phase_peaks() == measured[threads]


@follows_compiled
def test_inference_follows_the_compiled_program() -> None:
    torch.manual_seed(0)
    model, x = torch.compile(Fusable()), torch.randn(8, 16, 32)
    estimated = tm.estimate(model, x, train=False, cpu=None)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x, train=False).phase_peaks()


@follows_compiled
def test_a_compiled_dropout_equals_measure() -> None:
    """Inductor draws a dropout's mask inside its fused kernel (no random tensor) and
    saves the mask for backward: estimated as the real compiled step runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64))
    compiled, x = torch.compile(model), torch.randn(32, 64)
    estimated = tm.estimate(compiled, x, cpu=None)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(compiled, x).phase_peaks()
    assert estimated.forward_peak < tm.estimate(model, x, cpu=None).forward_peak


@follows_compiled
def test_the_compiled_program_beats_the_eager_one() -> None:
    """Fusion saves activations; the compiled AdamW step makes no per-parameter temporaries."""
    torch.manual_seed(0)
    eager, x = Fusable(), torch.randn(8, 16, 32)
    compiled = tm.estimate(torch.compile(eager), x, cpu=None, optimizer=compiled_adamw)
    plain = tm.estimate(eager, x, cpu=None, optimizer=adamw)
    assert compiled.forward_peak < plain.forward_peak
    assert compiled.backward_peak < plain.backward_peak
    assert compiled.step_peak < plain.step_peak


@follows_compiled
def test_the_compiled_optimizer_state_is_optimizer_state() -> None:
    """Dynamo makes the state while it compiles the first step (it calls ``_init_group``
    itself): the estimate sees it made there, and charges it as optimizer state through
    the loop's later forward and backward, whose peak is then the step's peak."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)), torch.randn(8, 64)
    report = tm.estimate(model, x, cpu=None, optimizer=compiled_adamw)
    assert report.first_step is not None and report.first_step.peak == report.first_step.step
    assert report.peak == report.backward_peak > report.first_step.backward
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = 4 * len(list(model.parameters()))  # one float32 step counter per parameter
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == 2 * params + steps


@follows_compiled
def test_an_eager_adamw_step_after_a_compiled_model() -> None:
    """The optimizer step itself is not compiled here: it runs eagerly in both."""
    torch.manual_seed(0)
    model, x = torch.compile(Fusable()), torch.randn(8, 16, 32)
    estimated = tm.estimate(model, x, optimizer=adamw, cpu=None)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x, optimizer=adamw).phase_peaks()


@follows_compiled
def test_measure_runs_a_compiled_module_in_its_steady_state() -> None:
    """One warm-up step compiles; the measured step runs the compiled code (checked in the
    profiler's events), whose saved activations are fewer than eager's."""
    torch.manual_seed(0)
    model, x = Fusable(), torch.randn(8, 16, 32)
    eager = tm.measure(model, x)
    compiled = tm.measure(torch.compile(model), x)
    assert compiled.unsupported == ()
    assert compiled.modules == {}  # per-module hooks would make dynamo fall back to eager code
    assert compiled.forward_peak < eager.forward_peak
    assert compiled.backward_peak < eager.backward_peak
    # the model is left as it was, and its eager figures are unchanged
    assert tm.measure(model, x).phase_peaks() == eager.phase_peaks()


@follows_compiled
def test_measures_never_use_up_the_users_recompile_limit() -> None:
    """Each measurement compiles in a dynamo cache region of its own: a compiled optimizer
    step compiles once per optimizer, and dynamo counts invalidated entries against the
    limit, so measurements in the user's region would leave later steps eager."""
    from torch._dynamo import config as dynamo_config

    torch.manual_seed(0)
    model, x = Fusable(), torch.randn(8, 16, 32)
    with dynamo_config.patch(recompile_limit=2):
        reports = [tm.measure(model, x, optimizer=compiled_adamw) for _ in range(3)]
    assert all(report.unsupported == () for report in reports)
    assert len({report.step_peak for report in reports}) == 1


def _compiled_code_ran(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether a real call of ``model`` runs dynamo's compiled code (the profiler's region)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        model(x)
    return any(event.name.startswith("Torch-Compiled Region") for event in prof.events())


def _seen_codes() -> list[object]:
    from torch._dynamo.convert_frame import input_codes

    return [code for ref in list(input_codes.seen) if (code := ref()) is not None]


@follows_compiled
def test_an_estimate_leaves_the_users_compiled_model_as_it_was() -> None:
    """After estimates and measurements the model's real compiled calls run real compiled
    code (not the estimate's no-op kernels) and compute the eager values; our cache entries
    live in regions of their own, invalidated, and the user's region holds only their own."""
    from torch._dynamo.eval_frame import _get_cache_entries_for_region

    torch.manual_seed(0)
    eager, x = Fusable(), torch.randn(8, 16, 32)
    model = torch.compile(eager)
    forward = model.forward
    with torch.no_grad():
        model(x)  # the user's own compile, in the user's (default) cache region
    codes = [c for c in _seen_codes() if _get_cache_entries_for_region(c, -1)]
    users = {c: len(_get_cache_entries_for_region(c, -1)) for c in codes}
    for _ in range(3):  # repeated estimates stay complete and never touch the user's region
        assert tm.estimate(model, x, cpu=None).unsupported == ()
    assert tm.measure(model, x).unsupported == ()
    assert model.forward is forward
    assert {c: len(_get_cache_entries_for_region(c, -1)) for c in codes} == users
    with torch.no_grad():
        assert torch.allclose(model(x), eager(x), atol=1e-5)
    assert _compiled_code_ran(model, x)
    assert {c: len(_get_cache_entries_for_region(c, -1)) for c in codes} == users  # no recompile


def _cache_entries() -> int:
    """How many dynamo cache entries the code objects dynamo has seen hold (every region)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return sum(len(_debug_get_cache_entry_list(code)) for code in _seen_codes())


@pytest.mark.skipif(isolating(), reason="torch 2.13 on: compiled regions are followed (the tests above)")
def test_compiled_regions_are_listed_where_dynamo_cannot_isolate_them() -> None:
    """Before torch 2.13 dynamo has one cache per code object, shared by every backend and
    counted against ``recompile_limit``, with no cache region of our own: the engine
    compiles nothing there. A compiled module and a compiled function run eagerly in
    estimate and measure, each listed with why (never an eager figure in silence); the
    figures are the eager model's; the user's cache is as it was and their compiled code
    still runs."""
    torch.manual_seed(0)
    eager, x = Fusable(), torch.randn(8, 16, 32)
    model = torch.compile(eager)
    with torch.no_grad():
        model(x)  # the user's own compile
    entries = _cache_entries()
    calls = _CallsCompiledFunction()
    cases = [
        (model, eager, "Fusable.forward", _where(Fusable.forward)),
        (calls, calls, "_scaled_gelu", _where(_scaled_gelu)),
    ]
    for compiled, plain, name, where in cases:
        inputs = torch.randn(4, 16) if compiled is calls else x
        for run in (tm.estimate, tm.measure):
            report = run(compiled, inputs)
            listed = [(u.op, u.reason, u.location) for u in report.unsupported]
            assert listed == [(f"torch.compile: {name}", UNISOLATED_REASON, where)], run.__name__
            if compiled is not calls:  # the same model, eager
                assert report.phase_peaks() == run(plain, inputs).phase_peaks(), run.__name__
    assert _cache_entries() == entries
    assert _compiled_code_ran(model, x)
    assert _cache_entries() == entries  # no recompile


@pytest.mark.parametrize(
    "options", [{"backend": "eager"}, {"backend": "aot_eager"}, {"options": {"cpp_wrapper": True}}]
)
def test_a_compiled_module_not_followed_is_listed(options: dict[str, object]) -> None:
    """Backends other than inductor, and inductor's C++ wrapper: eager figures, flagged."""
    torch.manual_seed(0)
    eager, x = Fusable(), torch.randn(8, 16, 32)
    report = tm.estimate(torch.compile(eager, **options), x, cpu=None)  # type: ignore[call-overload]
    assert [entry.op for entry in report.unsupported] == ["torch.compile: Fusable.forward"]
    assert report.phase_peaks() == tm.estimate(eager, x, cpu=None).phase_peaks()


def _broken_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as compile_fx

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("inductor failed")

    monkeypatch.setattr(compile_fx, "compile_fx", broken)


def test_a_program_that_cannot_be_built_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of inductor while the estimate compiles: the module runs eagerly, flagged."""
    _broken_inductor(monkeypatch)
    torch.manual_seed(0)
    eager, x = Fusable(), torch.randn(8, 16, 32)
    report = tm.estimate(torch.compile(eager), x, cpu=None)
    assert [entry.op for entry in report.unsupported] == ["torch.compile: Fusable.forward"]
    assert report.phase_peaks() == tm.estimate(eager, x, cpu=None).phase_peaks()


def test_an_optimizer_step_that_cannot_be_built_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled step is built in the traced step (its optimizer is new there): an error
    of inductor there runs dynamo's graph as traced, flagged."""
    _broken_inductor(monkeypatch)
    torch.manual_seed(0)
    model, x = Fusable(), torch.randn(8, 16, 32)
    report = tm.estimate(model, x, cpu=None, optimizer=compiled_adamw)
    assert [entry.op for entry in report.unsupported] == ["torch.compile: Adam.step"]


# -- compile=: an eager model checked as compiled ------------------------------------


@follows_compiled
def test_compile_checks_an_eager_model_as_compiled() -> None:
    """``compile=True`` is ``torch.compile(model)``'s figures, in estimate and measure; the
    model is not compiled, and its eager figures stay as they were."""
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 16, 32)
    attributes = dict(model.__dict__)
    eager = tm.estimate(model, x, cpu=None)
    estimated = tm.estimate(model, x, cpu=None, compile=True)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x, compile=True).phase_peaks()
    assert model.__dict__ == attributes
    assert tm.estimate(model, x, cpu=None).phase_peaks() == eager.phase_peaks()
    assert estimated.phase_peaks() != eager.phase_peaks()
    assert estimated.phase_peaks() == tm.estimate(torch.compile(model), x, cpu=None).phase_peaks()


@follows_compiled
def test_compile_options_reach_torch_compile() -> None:
    """Inductor's options change its program (without buffer reuse, another backward
    plan here): the estimate is ``torch.compile``'s with them, as the measurement is."""
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 16, 32)
    options = {"options": {"allow_buffer_reuse": False}, "dynamic": False}
    estimated = tm.estimate(model, x, cpu=None, compile=options)
    assert estimated.phase_peaks() != tm.estimate(model, x, cpu=None, compile=True).phase_peaks()
    assert estimated.phase_peaks() == tm.measure(model, x, compile=options).phase_peaks()
    compiled = torch.compile(model, options={"allow_buffer_reuse": False}, dynamic=False)
    assert estimated.phase_peaks() == tm.estimate(compiled, x, cpu=None).phase_peaks()


@follows_compiled
def test_autotuning_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where inductor benchmarks kernel choices (max-autotune), the estimate's candidates
    are no-op kernels: its choice may not be a real compile's, and the report says so.
    (Inductor benchmarks only where it has several candidates: simulated here.)"""
    import torch._inductor.compile_fx as compile_fx
    from torch._dynamo.utils import counters

    real = compile_fx.compile_fx

    def autotuning(*args: object, **kwargs: object) -> object:
        counters["inductor"]["select_algorithm_autotune"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx", autotuning)
    report = tm.estimate(Fusable(), torch.randn(2, 32), cpu=None, compile={"mode": "max-autotune"})
    assert [entry.op for entry in report.unsupported] == ["torch.compile: autotuning"]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (1, TypeError, "compile must be True, False, None or a dict"),
        ("max-autotune", TypeError, "compile must be True, False, None or a dict"),
        ({"backend": "eager"}, ValueError, "does not take 'backend'.*inductor"),
        ({"mode": "fast"}, ValueError, "mode 'fast' is not one of default"),
        ({"dynamic": "yes"}, TypeError, "dynamic must be True, False or None"),
        ({"fullgraph": None}, TypeError, "fullgraph must be True or False"),
        ({"mode": "default", "options": {}}, ValueError, "mode or options, not both"),
        ({"options": ["epilogue_fusion"]}, TypeError, "options must be a dict"),
        ({"options": {"x": object()}}, TypeError, r"options\['x'\] is <object"),
    ],
)
def test_malformed_compile_values_are_clear_errors(value: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        tm.estimate(Fusable(), torch.randn(2, 32), compile=value)  # type: ignore[arg-type]


def test_compile_of_a_compiled_model_is_refused() -> None:
    with pytest.raises(ValueError, match="already holds compiled modules"):
        tm.measure(torch.compile(Fusable()), torch.randn(2, 32), compile=True)


def test_compile_and_parallel_together_are_refused() -> None:
    parallel = tm.Parallel(mesh={"dp": 2}, apply=lambda model, mesh: model)
    with pytest.raises(ValueError, match="compile= and parallel= together"):
        tm.estimate(Fusable(), torch.randn(2, 32), compile=True, parallel=parallel)


@follows_compiled
def test_an_estimate_leaves_no_file_behind(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With its caches off, inductor writes each program into a new temporary directory
    under its cache directory that it never deletes; those the estimate builds are
    deleted when it ends. (Both directories are this test's own: another xdist worker's
    real compiles write into the shared cache directory.)"""
    inductors, temporary = tmp_path / "inductor", tmp_path / "tmp"
    inductors.mkdir()
    temporary.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductors))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # where the estimate's directory goes
    torch.manual_seed(0)
    report = tm.estimate(torch.compile(Fusable()), torch.randn(8, 16, 32))
    assert report.unsupported == ()
    assert os.listdir(inductors) == []
    assert os.listdir(temporary) == []


@follows_compiled
def test_the_compiled_programs_buffers_are_made_at_the_users_lines() -> None:
    """Each buffer inductor's program allocates, in forward and backward, is made at the
    line of the user's code its graph node came from, not in inductor's output module."""
    from pytest_torchmem.engine.figures.timeline import Phase
    from pytest_torchmem.engine.tracing.devices import device_model
    from pytest_torchmem.engine.tracing.trace import trace

    torch.manual_seed(0)
    traced = trace(
        torch.compile(Fusable()), (torch.randn(8, 16, 32),), {}, device=device_model("cpu"),
        loss_fn=None, optimizer=None, train=True, record_frames=True,
    )
    lines, first = inspect.getsourcelines(Fusable.forward)
    forward = {(inspect.getsourcefile(Fusable), number) for number in range(first, first + len(lines))}
    made = [
        (info.phase, info.frames[0].filename, info.frames[0].line)
        for info in traced.timeline.storages
        if info.frames and info.phase in (Phase.FORWARD, Phase.BACKWARD)
    ]
    assert {phase for phase, *where in made if tuple(where) in forward} == {Phase.FORWARD, Phase.BACKWARD}
    # the rest: the input, the loss and its gradient, made by the test's call
    assert {filename for _, filename, _ in made} == {inspect.getsourcefile(Fusable), __file__}


def test_an_estimate_of_a_compiled_model_does_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caches the estimate turns off while it compiles are not the user's concern
    (dynamo warned, once per process, that they turned its profile-guided shapes off)."""
    from torch._dynamo import utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tm.estimate(torch.compile(Fusable()), torch.randn(8, 16, 32))
    assert [str(w.message) for w in caught if "torch" in w.filename] == []
