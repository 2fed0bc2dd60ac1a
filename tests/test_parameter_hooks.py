"""Hooks on parameters run in the traced and the measured step, as eager runs them.

``Parameter.register_hook`` (a gradient hook, e.g. clipping) and
``register_post_accumulate_grad_hook`` (the optimizer step fused into
backward, which frees each gradient as soon as it is used) run once per
parameter, on the step's stand-ins, and their memory effect is in the figures,
byte for byte against ``measure``. A hook that looks its parameter up in a dict
(the PyTorch tutorial's per-parameter optimizers) finds the stand-in's twin
there; one that finds it another way cannot run on a stand-in: it is listed in
``unsupported`` and the step goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


X = torch.randn(32, 64)


def _with_hooks(register: Callable[[nn.Parameter], Any]) -> nn.Module:
    model = _model()
    for parameter in model.parameters():
        register(parameter)
    return model


def test_gradient_hooks_run_once_per_parameter_and_their_outputs_count() -> None:
    calls: list[int] = []

    def clip(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return grad.clamp(-1, 1)

    model = _with_hooks(lambda p: p.register_hook(clip))
    parameters = len(list(model.parameters()))
    estimated = tm.estimate(model, X)
    assert len(calls) == parameters
    measured = tm.measure(model, X)
    assert len(calls) == 2 * parameters
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.unsupported == ()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_freeing_each_gradient_after_accumulation_lowers_the_backward_peak(device: str) -> None:
    def release(parameter: torch.Tensor) -> None:
        parameter.grad = None  # what a fused optimizer step's zero_grad does

    hooked = _with_hooks(lambda p: p.register_post_accumulate_grad_hook(release))
    plain = tm.estimate(_model(), X, device=device)
    estimated = tm.estimate(hooked, X, device=device)
    assert estimated.backward_peak < plain.backward_peak
    assert estimated.unsupported == ()
    if device == "cpu":
        assert estimated.phase_peaks() == tm.measure(hooked, X).phase_peaks()


def _fused(model: nn.Module, optimizers: dict[Any, torch.optim.Optimizer]) -> Callable[..., None]:
    def fused_step(parameter: torch.Tensor) -> None:  # the PyTorch tutorial's hook
        optimizers[parameter].step()
        optimizers[parameter].zero_grad()

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(fused_step)
    return fused_step


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_tutorials_optimizer_step_fused_into_backward(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dict of per-parameter optimizers keyed by the model's parameters: each
    stand-in finds a twin of its parameter's optimizer, whose state is charged
    in backward, and each gradient dies as soon as it is used. (cuBLAS workspaces
    cached, as every release before 2.15 keeps them: the peaks compared hold the
    same state either way, and a per-call workspace would move them into a matmul.)"""
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "1")
    model = _model()
    optimizers = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters()}
    _fused(model, optimizers)
    keys = list(optimizers)
    separate = tm.estimate(_model(), X, device=device, optimizer=torch.optim.AdamW)
    fused = tm.estimate(model, X, device=device)
    assert fused.unsupported == ()
    assert fused.step_peak == 0  # no separate step: it ran in backward
    # The twins' AdamW state (exp_avg, exp_avg_sq and a step counter per parameter)
    # was made in backward and is optimizer state; at the peak fewer gradients than
    # the model's are alive ...
    n_bytes = sum(p.numel() * 4 for p in model.parameters())
    at_peak = fused.breakdown
    assert 2 * n_bytes < at_peak["optimizer_state"] < 2 * n_bytes + 1024
    assert at_peak["gradients"] < n_bytes
    # ... so the step's peak is below the separate step's, which holds all of them.
    assert separate.step_peak >= separate.breakdown["parameters"] + 3 * n_bytes
    assert fused.peak < separate.peak
    if device == "cpu":
        measured = tm.measure(model, X)
        assert measured.unsupported == ()
        assert fused.phase_peaks() == measured.phase_peaks()
        assert dict(fused.breakdown) == dict(measured.breakdown)
    # The user's optimizers and their dict are as they were.
    assert list(optimizers) == keys
    assert all(not optimizer.state for optimizer in optimizers.values())
    assert all(p.grad is None for p in model.parameters())


def test_a_hook_that_finds_the_parameter_elsewhere_is_listed_and_the_step_goes_on() -> None:
    model = _model()
    by_position = {i: torch.optim.Adam([p]) for i, p in enumerate(model.parameters())}
    positions = {id(p): i for i, p in enumerate(model.parameters())}

    def fused_step(parameter: torch.Tensor) -> None:
        by_position[positions[id(parameter)]].step()

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(fused_step)
    code = fused_step.__code__
    where = f"{code.co_filename}:{code.co_firstlineno}"
    for report in (tm.estimate(model, X), tm.measure(model, X)):
        assert [(entry.op, entry.location) for entry in report.unsupported] == [
            (f"parameter hook {fused_step.__qualname__}", where)
        ]
        assert report.unsupported[0].reason.startswith("it raised KeyError on the step's stand-in")
    assert all(not optimizer.state for optimizer in by_position.values())  # untouched
