"""Trace once, replay the rest (issue 40): a loop's later iterations replay the first's
forward and backward, with the same figures as tracing every iteration, or are traced
where they may differ, and say why."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from torch import nn

from replay_checks import both, same_figures
from leak_patterns import Caching, batch, mlp
from zoo import CASES, Case

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.replay import ENV

REPLAYED = "iteration 2: forward and backward replayed from iteration 1"
#: What the loop's second iteration says of the step of an optimizer of
#: optimizer_replay.FIRST_STEP_REPEATS (AdamW's, the families' default).
FIRST_STEP = "optimizer step replayed from iteration 1 (without the state it made)"


def _looped(case: Case) -> dict[str, Any]:
    """The family's options, as a training loop: its optimizer, else AdamW."""
    return {"optimizer": lambda p: torch.optim.AdamW(p, lr=1e-3), **case.options}


#: Every family that trains (a forward-only step runs once: nothing to replay).
TRAINED = [case for case in CASES if case.options.get("train", True)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", TRAINED, ids=lambda case: case.name)
def test_each_family_replays_to_the_same_bytes(case: Case, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, case.make, device=device, **_looped(case))
    same_figures(replayed, traced)
    assert traced.replayed == ()
    loop, *step = replayed.replayed
    assert loop == REPLAYED or "forward and backward traced (" in loop
    # (AdamW's second step replays its first; SGD's second is recorded, for the third)
    assert step in ([f"iteration 2: {FIRST_STEP}"], []) or "optimizer step traced (" in step[0], step


def test_the_families_replay() -> None:
    """Most of the families' loops replay (a test that could pass with replay never
    happening would prove nothing); those that do not say why."""
    lines = {case.name: tm.estimate(*case.make(), **_looped(case)).replayed for case in TRAINED}
    replayed = [name for name, said in lines.items() if said[0] == REPLAYED]
    assert len(TRAINED) >= 20 and len(replayed) >= len(TRAINED) - 3, lines


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("keep_output", [False, True])
def test_a_language_model_replays_its_loop(device: str, keep_output: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.llama import LlamaConfig, build

    config = LlamaConfig(dim=128, layers=3, heads=4, kv_heads=2, ffn=256, vocab=500)

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        tokens = torch.randint(0, config.vocab, (2, 32))
        return build(config, dtype=torch.float32), (tokens, tokens)

    replayed, traced = both(
        monkeypatch, make, device=device, keep_output=keep_output, optimizer=lambda p: torch.optim.AdamW(p)
    )
    same_figures(replayed, traced)
    assert replayed.replayed == (REPLAYED, f"iteration 2: {FIRST_STEP}")


def test_the_replayed_loop_is_what_a_real_loop_measures() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)), torch.randn(32, 64)
    options: dict[str, Any] = dict(optimizer=lambda p: torch.optim.AdamW(p))
    estimated = tm.estimate(model, x, **options)
    assert estimated.replayed == (REPLAYED, f"iteration 2: {FIRST_STEP}")
    measured = tm.measure(model, x, **options)
    assert estimated.phase_peaks() == measured.phase_peaks()


class _SecondCallDiffers(nn.Module):
    """From its second call on, the forward keeps a wider hidden state alive: an
    iteration that differs from the first (a counter in the module's own state)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.net[0](x)
        if self.calls > 1:
            h = torch.cat([h, h], dim=0)[: h.shape[0]]
        return self.net[2](self.net[1](h))


class _FirstCallCaches(nn.Module):
    """Builds a table on its first call and keeps it (a rotary embedding's cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.ones(64, 64, device=x.device)
        return self.net[2](self.net[1](self.net[0](x) @ self.table))


class _ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[1](self.net[0](x))
        keep = h[0] > 0  # a boolean mask: how many it keeps depends on the values
        return self.net[2](h[:, keep].sum(1, keepdim=True).expand(-1, 64))


class _BranchesOnValues(nn.Module):
    """Keeps a wider hidden state where :meth:`wide` says so, from values an op read."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def wide(self, x: torch.Tensor) -> bool:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.wide(x)
        h = self.net[0](x)
        if wide:
            h = torch.cat([h, h], dim=0)[: h.shape[0]]
        return self.net[2](self.net[1](h))


class _CountsInABuffer(_BranchesOnValues):
    """Steps a counter buffer in place and is wide on even calls (a buffer's values change
    from one iteration to the next)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def wide(self, x: torch.Tensor) -> bool:
        self.calls += 1
        return int(self.calls) % 2 == 0


class _FlipsItsInput(_BranchesOnValues):
    """Is wide by its input's sign, then negates its input in place: the next iteration
    reads other values of the same tensor."""

    def wide(self, x: torch.Tensor) -> bool:
        wide = bool(x[0, 0] > 0)
        x.neg_()
        return wide


class _DrawsOnTheHost(_BranchesOnValues):
    """Is wide by a number drawn at random on the host (its generator advances)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def wide(self, x: torch.Tensor) -> bool:
        return float(torch.rand((), generator=self.generator)) > 0.5


def _hooked() -> nn.Module:
    model = mlp()
    model[1].register_forward_hook(lambda module, args, out: None)
    return model


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (_SecondCallDiffers, "the model's state or torch's switches changed since the first iteration"),
        (_FirstCallCaches, "storage(s) it made stay alive beside the gradients"),
        (Caching, "storage(s) it made stay alive beside the gradients"),
        (_ReadsValues, "an op read tensor values, which may differ"),
        (_CountsInABuffer, "an op read tensor values, which may differ"),
        (_FlipsItsInput, "an op read tensor values, and the step wrote in place what it read them from"),
        (_DrawsOnTheHost, "an op read tensor values, which may differ"),
        (_hooked, "the model has hooks"),
    ],
    ids=["state", "cache", "kept", "values", "a buffer's values", "its input written", "a random draw", "hooks"],
)
def test_what_may_differ_is_traced_and_says_why(build: Any, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return build(), batch()

    options: dict[str, Any] = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    replayed, traced = both(monkeypatch, make, **options)
    same_figures(replayed, traced)
    [line] = replayed.replayed
    assert line.startswith("iteration 2: forward and backward traced (") and why in line
    model, x = make()
    assert replayed.phase_peaks() == tm.measure(model, x, **options).phase_peaks()


class _ReadsItsInput(_BranchesOnValues):
    """Keeps as many rows as its input has positive first elements, and builds a mask from
    positions, as transformers' masks are built: values read each iteration alike (made
    of the step's input and of ``arange``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int((x[:, 0] > 0).sum())
        positions = torch.arange(x.shape[0], device=x.device)
        if bool((positions[1:] - positions[:-1] == 1).all()):
            rows += 1
        h = self.net[1](self.net[0](x[:rows]))
        return self.net[2](torch.cat([h, h]))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_values_read_alike_each_iteration_replay(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return _ReadsItsInput(), batch()

    options: dict[str, Any] = dict(device=device, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    replayed, traced = both(monkeypatch, make, **options)
    same_figures(replayed, traced)
    assert replayed.replayed[0] == REPLAYED, replayed.replayed
    if device == "cpu":
        assert replayed.phase_peaks() == tm.measure(*make(), **options).phase_peaks()


def test_a_second_iteration_that_differs_is_measured_as_it_runs() -> None:
    """The case replay must not miss: the second iteration holds more than the first."""
    torch.manual_seed(0)
    options: dict[str, Any] = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    estimated = tm.estimate(_SecondCallDiffers(), batch(), **options)
    assert estimated.first_step is not None and estimated.forward_peak > estimated.first_step.forward
    torch.manual_seed(0)
    assert estimated.phase_peaks() == tm.measure(_SecondCallDiffers(), batch(), **options).phase_peaks()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_leak_check_replays_the_same_growth(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    held = {}
    for replay in ("1", "0"):
        monkeypatch.setenv(ENV, replay)
        torch.manual_seed(0)
        report = tm.leaks(mlp(), batch(), device=device, optimizer=lambda p: torch.optim.AdamW(p))
        held[replay] = (report.held, report.growth, report.per_iteration, report.steady_from)
    assert held["1"] == held["0"]
    monkeypatch.setenv(ENV, "1")
    kept = tm.leaks(Caching(), batch(), device=device, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert kept.per_iteration > 0  # (a leak is traced, not replayed away)


def test_replay_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    assert tm.estimate(mlp(), batch(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).replayed == ()


def test_a_step_without_a_loop_has_nothing_to_replay() -> None:
    assert tm.estimate(mlp(), batch()).replayed == ()


def test_the_report_says_what_was_replayed_through_json() -> None:
    report = tm.estimate(mlp(), batch(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert report.replayed == (REPLAYED,)
    again = tm.MemoryReport.from_json(report.to_json())
    assert again.replayed == report.replayed and again == report


# -- the optimizer step (replayed from the loop's second iteration on) -----------------

STEP_REPLAYED = "optimizer step replayed from iteration 2"


def _leaks_both(monkeypatch: pytest.MonkeyPatch, make: Any, **options: Any) -> tuple[tm.LeakReport, tm.LeakReport]:
    return both(monkeypatch, make, tm.leaks, **options)  # type: ignore[no-any-return]


def _same_held(replayed: tm.LeakReport, traced: tm.LeakReport) -> None:
    a, b = json.loads(replayed.to_json()), json.loads(traced.to_json())
    a.pop("replayed"), b.pop("replayed")
    assert a == b  # what is held and reserved after each iteration, the growth, the sources
    assert traced.replayed == ()


def _mlp_batch() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return mlp(), batch()


#: torch's optimizers whose step replays (optimizer_replay.STEP_COUNTS_ONLY), with the
#: options that change the ops their steps run.
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p),
    "adam-amsgrad-single": lambda p: torch.optim.Adam(p, amsgrad=True, foreach=False),
    "adam-two-groups": lambda p: torch.optim.Adam([{"params": p[:2]}, {"params": p[2:], "lr": 1e-4}]),
    "adamw": lambda p: torch.optim.AdamW(p, weight_decay=0.1),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, foreach=True),
    "adagrad": lambda p: torch.optim.Adagrad(p),
    "adamax": lambda p: torch.optim.Adamax(p),
    "nadam": lambda p: torch.optim.NAdam(p, decoupled_weight_decay=True, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
    "adadelta": lambda p: torch.optim.Adadelta(p),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_replays_its_step_to_the_same_bytes(
    name: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replayed, traced = _leaks_both(monkeypatch, _mlp_batch, device=device, optimizer=OPTIMIZERS[name], iterations=4)
    _same_held(replayed, traced)
    # (SGD's first step with momentum copies the gradient, where a later one scales and adds:
    # its second step is recorded; the others' first step is a later one with its state made)
    expected = (
        f"iterations 3 to 4: {STEP_REPLAYED}"
        if name.startswith("sgd")
        else "iterations 2 to 4: optimizer step replayed from iteration 1"  # (state made by its constructor)
        if name == "adagrad"
        else f"iterations 2 to 4: {FIRST_STEP}"
    )
    assert expected in replayed.replayed, replayed.replayed


@pytest.mark.parametrize("case", TRAINED, ids=lambda case: case.name)
def test_each_family_replays_a_longer_loop_to_the_same_bytes(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three iterations on the fake GPU: the forward and backward of the second and third
    replayed, the optimizer step of the third; what each holds and reserves after each
    iteration, the same bytes."""
    replayed, traced = _leaks_both(monkeypatch, case.make, device="cuda", iterations=3, **_looped(case))
    _same_held(replayed, traced)


@pytest.mark.parametrize("case", TRAINED, ids=lambda case: case.name)
def test_each_family_replays_a_longer_loop_to_the_same_bytes_on_cpu(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    replayed, traced = _leaks_both(monkeypatch, case.make, device="cpu", iterations=3, **_looped(case))
    _same_held(replayed, traced)


class _KeepsHistory(torch.optim.SGD):
    """Keeps a copy of each parameter at every step (state that grows: a leak)."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("history", []).append(p.detach().clone())
        return super().step(closure)


class _CountsSteps(torch.optim.SGD):
    """From its third step on, keeps a buffer per parameter (a counter in its own state:
    a step that differs from the second)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.steps = 0

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        if self.steps == 3:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["late"] = torch.zeros_like(p)
        return super().step(closure)


def _step_hooked(params: Any) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(params)
    opt.register_step_post_hook(lambda optimizer, args, kwargs: None)
    return opt


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: torch.optim.RAdam(p), "RAdam's step read tensor values"),
        (_step_hooked, "the optimizer has step hooks"),
        (_KeepsHistory, "storage(s) it made stay alive"),
        (_CountsSteps, "the optimizer's state, its gradients or torch's switches changed"),
    ],
    ids=["values", "hooks", "kept", "state"],
)
def test_an_optimizer_step_that_may_differ_is_traced_and_says_why(
    make: Any, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options: dict[str, Any] = dict(optimizer=lambda p: make(p), iterations=4)
    replayed, traced = _leaks_both(monkeypatch, _mlp_batch, **options)
    _same_held(replayed, traced)
    [line] = [line for line in replayed.replayed if "optimizer step" in line]
    # (AdamW's first step is recorded, SGD's and RAdam's second)
    assert re.match(r"iterations [23] to 4: optimizer step traced \(", line) and why in line, line
    model, x = _mlp_batch()
    assert replayed.held == tm.leaks(model, x, measure=True, **options).held


def test_a_late_change_of_the_optimizer_is_measured_as_it_runs() -> None:
    """The case replay must not miss: the third step keeps more than the second."""
    model, x = _mlp_batch()
    report = tm.leaks(model, x, optimizer=_CountsSteps, iterations=4)
    growth = report.growth
    assert growth[2] > 0 and growth[1] == growth[3] == 0, growth
