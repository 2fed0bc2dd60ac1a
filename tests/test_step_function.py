"""A step the user wrote (issue 25): ``tm.estimate(fn, (model, batch, opt))``.

The modules, tensors, optimizers and grad scalers among the function's arguments
become stand-ins and twins, and are left as they were; forward, backward and
optimizer steps are recognised wherever the function runs them; each phase's
figure is the highest of its repeats. On cpu the estimate equals ``measure`` of the
same function byte for byte, on each family of training loop as written.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from exactness import skip_where_native
from following import follows_compiled
from profiled import every_peak
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)


def _mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 8))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


# -- the families: a training loop as users write it -----------------------------------


def loop_of_three(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def accumulation(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    for micro in x.chunk(4):
        loss = model(micro).square().mean() / 4
        loss.backward()
    opt.step()
    opt.zero_grad()


def zero_grad_kept(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    for _ in range(2):
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)


def retained_backward(model: nn.Module, x: torch.Tensor) -> None:
    """A kernel benchmark's protocol: one forward, ten backwards through the kept graph."""
    y = model(x)
    dy = torch.randn_like(y)
    for _ in range(10):
        y.backward(dy, retain_graph=True)


def ema(model: nn.Module, average: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for kept, now in zip(average.parameters(), model.parameters()):
                kept.lerp_(now, 0.01)


def gan(
    g: nn.Module,
    d: nn.Module,
    z: torch.Tensor,
    real: torch.Tensor,
    opt_g: torch.optim.Optimizer,
    opt_d: torch.optim.Optimizer,
) -> None:
    for _ in range(2):
        fake = g(z)
        loss_d = d(real).square().mean() + d(fake.detach()).mean()
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        loss_g = -d(fake).mean()
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad()


def autocast_scaled(
    model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> None:
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def scheduled(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, schedule: Any) -> None:
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        schedule.step()
        opt.zero_grad()


class Lit(nn.Module):
    """A Lightning-style module: the loop calls its ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        return self.net(batch).square().mean()


def lightning_loop(lit: Lit, batches: list[torch.Tensor], opt: torch.optim.Optimizer) -> None:
    for batch in batches:
        loss = lit.training_step(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _families() -> dict[str, tuple[Callable[..., Any], Callable[[], tuple[Any, ...]]]]:
    def plain() -> tuple[Any, ...]:
        model = _mlp()
        return model, torch.randn(16, 32), _adamw(model)

    def with_average() -> tuple[Any, ...]:
        model = _mlp()
        return model, copy.deepcopy(model), torch.randn(16, 32), _adamw(model)

    def two_models() -> tuple[Any, ...]:
        torch.manual_seed(0)
        g = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32))
        d = nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(), nn.Linear(64, 1))
        z, real = torch.randn(16, 8), torch.randn(16, 32)
        return g, d, z, real, torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters())

    def scaled() -> tuple[Any, ...]:
        model = _mlp()
        return model, torch.randn(16, 32), _adamw(model), torch.amp.GradScaler("cpu")

    def lit() -> tuple[Any, ...]:
        module = Lit()
        return module, [torch.randn(16, 32) for _ in range(3)], torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)

    def with_schedule() -> tuple[Any, ...]:
        model, x, opt = plain()
        return model, x, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    return {
        "loop of three": (loop_of_three, plain),
        "learning-rate scheduler": (scheduled, with_schedule),
        "gradient accumulation": (accumulation, plain),
        "zero_grad(set_to_none=False)": (zero_grad_kept, plain),
        "backward(dy, retain_graph=True) x10": (retained_backward, lambda: (_mlp(), torch.randn(16, 32))),
        "ema": (ema, with_average),
        "gan": (gan, two_models),
        "autocast + GradScaler": (autocast_scaled, scaled),
        "lightning-style training_step": (lightning_loop, lit),
    }


FAMILIES = _families()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_estimate_of_a_step_function_is_measure(name: str) -> None:
    """Byte for byte what the real function allocates on this CPU, every phase."""
    fn, make = FAMILIES[name]
    arguments = make()
    estimated = tm.estimate(fn, arguments)
    # autocast's float16 matmuls run natively on an AMX host, flagged there: CI checks the
    # family on the levels below (.ci/run's capped exactness runs)
    skip_where_native(estimated)
    measured = tm.measure(fn, arguments)
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(measured)
    assert estimated.breakdown == measured.breakdown


@follows_compiled
def test_a_compiled_model_in_a_step_function_is_followed() -> None:
    """``torch.compile(model)`` passed to the function: its compiled program (warmed up by
    a run of the whole function) is what the estimate traces, equal to measure's steady
    state, and not the eager program's figures."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    model = torch.compile(eager)
    x = torch.randn(32, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    estimated = tm.estimate(loop_of_three, (model, x, opt))
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(tm.measure(loop_of_three, (model, x, opt)))
    assert every_peak(estimated) != every_peak(tm.estimate(loop_of_three, (eager, x, opt)))


def test_what_the_function_is_given_is_left_as_it_was() -> None:
    """Parameters, gradients, optimizer state and the scaler: the same objects, the same
    values, after an estimate and after a measurement."""
    model = _mlp()
    x = torch.randn(16, 32)
    opt = _adamw(model)
    scaler = torch.amp.GradScaler("cpu")
    autocast_scaled(model, x, opt, scaler)  # real state to keep: Adam's, the scaler's, .grad
    model(x).sum().backward()
    params = list(model.parameters())
    before = copy.deepcopy((model.state_dict(), [p.grad for p in params], opt.state_dict(), scaler.state_dict()))
    for run in (tm.estimate, tm.measure):
        run(autocast_scaled, (model, x, opt, scaler))
        assert list(model.parameters()) == params
        after = (model.state_dict(), [p.grad for p in params], opt.state_dict(), scaler.state_dict())
        torch.testing.assert_close(after, before, rtol=0, atol=0)
        assert all(opt.state[p]["exp_avg"].device.type == "cpu" for p in params)


def test_an_optimizer_that_stepped_before_steps_in_the_estimate() -> None:
    """AdamW's step divides by ``1 - beta1 ** step``, its state's count read with
    ``.item()``: the trace knows the values of the optimizers' state, so an optimizer
    that a real run stepped steps in the estimate too, byte for byte as measured (before,
    its count was a stand-in 0, the division failed, and the figures were of half a step:
    step peak 0 B). (On the fake cuda device the twin's count is not known yet.)"""
    model, x = _mlp(), torch.randn(16, 32)
    opt = _adamw(model)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    estimated = tm.estimate(loop_of_three, (model, x, opt))
    assert estimated.unsupported == ()
    assert estimated.step_peak > estimated.backward_peak
    assert estimated.phase_peaks() == tm.measure(loop_of_three, (model, x, opt)).phase_peaks()


def test_a_scheduler_schedules_the_stand_ins_optimizer() -> None:
    """The scheduler and its optimizer are twinned together: the user's learning rate and
    the scheduler's count are as they were (the optimizer's step counted by the scheduler
    is the twin's)."""
    model = _mlp()
    opt = _adamw(model)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for run in (tm.estimate, tm.measure):
        run(scheduled, (model, torch.randn(4, 32), opt, schedule))
        assert opt.param_groups[0]["lr"] == 1e-3
        assert schedule.last_epoch == 0 and schedule.get_last_lr() == [1e-3]
        assert opt.state == {}


def test_an_optimizer_whose_step_wraps_its_own_bound_method_is_followed() -> None:
    """``opt.step = wrapper(opt.step)`` (a compiled or logged step) calls the user's own
    bound method: the optimizer is the user's object, holding the stand-ins for the call,
    so the wrapper steps them; the wrapper, the parameters and the state are as before."""
    model = _mlp()
    opt = _adamw(model)
    step = opt.step
    opt.step = lambda *args, **kwargs: step(*args, **kwargs)  # type: ignore[method-assign]
    wrapper = opt.step
    x = torch.randn(4, 32)
    before = copy.deepcopy(model.state_dict())
    assert every_peak(tm.estimate(loop_of_three, (model, x, opt))) == every_peak(tm.measure(loop_of_three, (model, x, opt)))
    assert opt.step is wrapper and opt.state == {}
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def _builtin_twin(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    """The built-in step's first iteration, written as a function: forward, default loss
    (the output's sum), the output dropped, backward, step, zero_grad."""
    output = model(x)
    loss = output.sum()
    del output
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_function_that_is_the_builtin_step_has_its_first_step_figures(device: str) -> None:
    """Two drivers, one program: the phases recognised in the function are the built-in
    step's, to the byte, on both fake devices."""
    model = _mlp(256)
    x = torch.randn(64, 32)
    function = tm.estimate(_builtin_twin, (model, x, _adamw(model)), device=device)
    builtin = tm.estimate(model, x, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), device=device)
    assert builtin.first_step is not None
    assert (function.forward_peak, function.backward_peak, function.step_peak) == (
        builtin.first_step.forward,
        builtin.first_step.backward,
        builtin.first_step.step,
    )
    assert function.first_step is None


def test_each_phase_is_the_highest_of_its_repeats() -> None:
    """Iterations that start alike (``zero_grad`` frees the gradients) on a small and a
    large batch: each phase's figure is the large one's, whichever comes first."""

    def iterations(model: nn.Module, first: torch.Tensor, second: torch.Tensor) -> None:
        for x in (first, second):
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)

    model = _mlp()
    small, large = torch.randn(4, 32), torch.randn(256, 32)
    ascending = tm.estimate(iterations, (model, small, large))
    descending = tm.estimate(iterations, (model, large, small))
    assert ascending.phase_peaks() == descending.phase_peaks()
    smaller = tm.estimate(iterations, (model, small, small))
    assert ascending.forward_peak > smaller.forward_peak + large.nbytes
    assert ascending.backward_peak > smaller.backward_peak + large.nbytes


def test_modules_the_function_reads_from_outside_are_stand_ins_too() -> None:
    """A model in the closure, or ``self`` of a bound method: swapped like an argument's."""
    model = _mlp()
    x = torch.randn(16, 32)

    def closure(x: torch.Tensor) -> None:
        model(x).sum().backward()

    lit = Lit()
    assert every_peak(tm.estimate(closure, (x,))) == every_peak(tm.measure(closure, (x,)))
    assert all(p.grad is None for p in model.parameters())
    estimated = tm.estimate(lit.training_step, (x,))
    assert estimated.breakdown[tm.Category.PARAMETERS] == sum(p.nbytes for p in lit.parameters())


def test_an_optimizer_from_outside_the_arguments_is_followed() -> None:
    """A model and an optimizer the function reads from its closure: both hold the
    stand-ins for the call (the figures are measure's), and are as before after it."""
    model = _mlp()
    opt = _adamw(model)

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        opt.step()

    x = torch.randn(2, 32)
    before = copy.deepcopy(model.state_dict())
    estimated = tm.estimate(step, (x,))
    assert every_peak(estimated) == every_peak(tm.measure(step, (x,)))
    assert estimated.breakdown[tm.Category.OPTIMIZER_STATE] == 2 * sum(p.nbytes for p in model.parameters()) + 4 * 4
    assert opt.state == {} and all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize(
    "option", [{"loss_fn": lambda out: out.sum()}, {"optimizer": _adamw}, {"train": False}, {"keep_output": True}]
)
def test_the_builtin_steps_options_are_refused_for_a_function(option: dict[str, Any]) -> None:
    (name,) = option
    with pytest.raises(TypeError, match=rf"runs the function as written, so {name}= "):
        tm.estimate(loop_of_three, (_mlp(), torch.randn(2, 32), None), **option)


def test_parallel_is_refused_for_a_function() -> None:
    parallel = tm.Parallel(mesh={"dp": 2}, apply=lambda model, mesh: model)
    with pytest.raises(ValueError, match="step function with parallel= is not supported"):
        tm.estimate(retained_backward, (_mlp(), torch.randn(2, 32)), parallel=parallel)


def test_a_function_on_the_fake_cuda_device_needs_no_gpu() -> None:
    """The families run on the fake cuda device too (figures are the caching allocator's)."""
    fn, make = FAMILIES["gan"]
    report = tm.estimate(fn, make(), device="cuda")
    assert report.unsupported == ()
    assert report.step_peak > 0 and report.peak == max(report.phase_peaks().values())


# -- in pytest: torchmem.check of a step function, end to end ---------------------------

STEP_TEST = """
import torch
from torch import nn


def train_step(model, x, opt):
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_loop(torchmem):
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    x = torch.randn({batch}, 32)
    torchmem.check(train_step, (model, x, torch.optim.AdamW(model.parameters())))
"""


def test_a_step_function_check_is_snapshotted_and_gated(pytester: pytest.Pytester) -> None:
    """``--torchmem-update`` writes its entries; the same function passes; a larger batch
    in it regresses, and the failure names the phase and the command that accepts it."""
    pytester.makepyfile(test_m=STEP_TEST.format(batch=8))
    result = pytester.runpytest("--torchmem-update", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    written = json.loads((pytester.path / "__torchmem__" / "test_m.json").read_text())
    entry = written["tests"]["test_loop"]["default"]["cpu"]
    assert entry["step_peak"] == tm.estimate(_plugin_step, _plugin_arguments(8), cpu="avx2:4").step_peak
    assert pytester.runpytest("-p", "no:cacheprovider").ret == pytest.ExitCode.OK
    pytester.makepyfile(test_m=STEP_TEST.format(batch=512))
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*forward*", '*pytest --torchmem-update "test_m.py::test_loop"*'])


def _plugin_step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _plugin_arguments(batch: int) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    return model, torch.randn(batch, 32), torch.optim.AdamW(model.parameters())


# -- the user's own phases: tm.phase(name) ------------------------------------------------


def _named_phases(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    with tm.phase("train"):
        for _ in range(2):
            with tm.phase("forward and backward"):
                model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    with tm.phase("eval"), torch.no_grad():
        model(x)


def test_named_phases_are_measure_byte_for_byte() -> None:
    """Each named block's peak, the highest of its runs, equals measure's; the block
    around the whole loop reaches the call's peak, the forward and backward inside it
    the backward's, the inference after it the forward's."""
    model, x = _mlp(), torch.randn(16, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    estimated = tm.estimate(_named_phases, (model, x, opt))
    measured = tm.measure(_named_phases, (model, x, opt))
    assert list(estimated.phases) == ["train", "forward and backward", "eval"]
    assert estimated.phases == measured.phases
    assert estimated.phases["train"] == estimated.peak
    assert estimated.phases["forward and backward"] == estimated.backward_peak
    assert estimated.phases["eval"] < estimated.phases["forward and backward"]
    on_cuda = tm.estimate(_named_phases, (model, x, opt), device="cuda")
    assert on_cuda.phases["train"] == on_cuda.peak
    assert tm.MemoryReport.from_dict(estimated.to_dict()) == estimated


def test_a_phase_named_inside_a_model_counts_in_the_built_in_step() -> None:
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(32, 128), nn.Linear(128, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with tm.phase("body"):
                h = self.body(x).relu()
            return self.head(h)

    model, x = Named(), torch.randn(8, 32)
    estimated = tm.estimate(model, x)
    assert estimated.phases == tm.measure(model, x).phases
    assert 0 < estimated.phases["body"] <= estimated.forward_peak


def test_a_phase_outside_a_check_does_nothing_and_a_bad_name_is_refused() -> None:
    with tm.phase("serving"):
        assert torch.ones(2).sum().item() == 2
    for bad in ("", "  ", None, 3):
        with pytest.raises(ValueError, match="a non-empty string"):
            with tm.phase(bad):  # type: ignore[arg-type]
                pass
    assert tm.estimate(nn.Linear(4, 4), torch.randn(2, 4)).phases == {}


_BODY = tm.phase("body")


@_BODY
def _twice_in_a_loop(model: nn.Module, x: torch.Tensor) -> None:
    for _ in range(2):
        with _BODY:  # the object entered again, inside its own block (as a decorator)
            model(x).square().mean().backward()


def _fresh_each_time(model: nn.Module, x: torch.Tensor) -> None:
    with tm.phase("body"):
        for _ in range(2):
            with tm.phase("body"):
                model(x).square().mean().backward()


def test_one_phase_object_is_entered_again() -> None:
    """Issue 36, item 9: ``p = tm.phase("x")`` entered in a loop raised AttributeError
    ('_GeneratorContextManager' object has no attribute 'args') at its second ``with``.
    One object now counts as a new one each time: in a loop, nested in itself, as a
    decorator, and outside a check."""
    model, x = _mlp(), torch.randn(16, 32)
    for entry in (tm.estimate, tm.measure):
        assert entry(_twice_in_a_loop, (model, x)).phases == entry(_fresh_each_time, (model, x)).phases
    with _BODY, _BODY:
        pass
    assert repr(_BODY) == "tm.phase('body')"


def test_an_estimate_or_measure_inside_the_step_of_another_is_refused() -> None:
    """Issue 36, item 9: ``tm.measure(fn)`` where ``fn`` calls ``tm.measure`` raised an
    IndexError, or gave 0 B; an estimate inside an estimate counted the inner one's step.
    Each is refused in one line, raised as the step's own error (never a stopped trace,
    even after a stand-in value), and the next call runs."""
    model, x = _mlp(), torch.randn(4, 32)
    before = copy.deepcopy(model.state_dict())

    def calls(inner: Callable[..., Any]) -> Callable[..., None]:
        def step(model: nn.Module, x: torch.Tensor, n: torch.Tensor) -> None:
            int(n.random_(1, 3))  # a stand-in value (in the estimate)
            inner(lambda m, x: m(x).sum().backward(), (model, x))
            model(x).sum().backward()

        return step

    names = {tm.estimate: "tm.estimate()", tm.measure: "tm.measure()"}
    for outer, inner in [(o, i) for o in names for i in names]:
        with pytest.raises(RuntimeError) as info:
            outer(calls(inner), (model, x, torch.tensor(1)))
        assert type(info.value).__name__ == "NestedStepError"
        assert str(info.value) == (
            f"{names[inner]} was called inside the step that {names[outer]} is running; one step "
            f"is estimated or measured at a time: call {names[inner]} before or after "
            f"{names[outer]}, not from inside its step"
        )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert tm.estimate(model, x).peak == tm.measure(model, x).peak


def _reset_run_read(x: torch.Tensor, dy: torch.Tensor, runs: int = 10) -> None:
    """A kernel benchmark's protocol: reset the peak, run ``y = f(x); y.backward(dy,
    retain_graph=True)``, read ``max_memory_allocated()``; ten times. Each named phase
    is one reading (the live bytes at the reset included, as the reading's are)."""
    for run in range(1, runs + 1):
        with tm.phase(f"run {run}"):  # torch.cuda.reset_peak_memory_stats()
            y = x.sin()
            y.backward(dy, retain_graph=True)
        # torch.cuda.max_memory_allocated(): phases[f"run {run}"]


def test_the_reset_run_read_protocol_through_the_public_api() -> None:
    """Counted by hand (1024 float32 elements, 4 KiB each; on cuda each a 4 KiB block):
    run 1 starts with x and dy (8 KiB), adds y, cos(x) and the gradient dy * cos(x)
    (20 KiB), which becomes x.grad; every later run starts with x, dy, x.grad and the
    last run's y (16 KiB), makes the new y before the old one goes, and adds cos(x)
    and the new gradient before it is accumulated into x.grad (24 KiB)."""
    x, dy = torch.randn(1024, requires_grad=True), torch.randn(1024)
    by_hand = [20 * 1024] + [24 * 1024] * 9
    for report in (
        tm.estimate(_reset_run_read, (x, dy)),
        tm.measure(_reset_run_read, (x, dy)),
        tm.estimate(_reset_run_read, (x, dy), device="cuda"),
    ):
        assert list(report.phases.values()) == by_hand, (report.device, report.phases)
        assert report.unsupported == ()
    assert x.grad is None  # the user's tensor never had a backward


def test_the_report_numbers_the_iterations_of_a_function() -> None:
    """Each iteration's phases, in order: the first step of a loop of three makes AdamW's
    state, the second and third hold it through forward and backward and are equal; the
    report's three peaks are the highest of them, on cpu as measured."""
    model, x = _mlp(), torch.randn(16, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loop(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    estimated = tm.estimate(loop, (model, x, opt))
    first, second, third = estimated.iterations
    assert second == third and first.forward < second.forward and first.backward < second.backward
    assert (estimated.forward_peak, estimated.backward_peak) == (second.forward, second.backward)
    assert estimated.iterations == tm.measure(loop, (model, x, opt)).iterations
    assert tm.MemoryReport.from_dict(estimated.to_dict()) == estimated
    assert tm.estimate(model, x, optimizer=lambda p: torch.optim.AdamW(p)).iterations == ()
