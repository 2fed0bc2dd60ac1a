"""Hooks on parameters run in the traced and the measured step, as eager runs them.

``Parameter.register_hook`` (a gradient hook, e.g. clipping) and
``register_post_accumulate_grad_hook`` (the optimizer step fused into
backward, which frees each gradient as soon as it is used) run once per
parameter, on the step's stand-ins, and their memory effect is in the figures,
byte for byte against ``measure``. A hook that looks the model's parameter up
(the PyTorch tutorial's dict of per-parameter optimizers) cannot run on a
stand-in: it is listed in ``unsupported`` and the step goes on.
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


def test_a_hook_that_looks_the_parameter_up_is_listed_and_the_step_goes_on() -> None:
    model = _model()
    optimizers = {p: torch.optim.Adam([p]) for p in model.parameters()}

    def fused_step(parameter: torch.Tensor) -> None:
        optimizers[parameter].step()
        optimizers[parameter].zero_grad()

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(fused_step)
    code = fused_step.__code__
    where = f"{code.co_filename}:{code.co_firstlineno}"
    for report in (tm.estimate(model, X), tm.measure(model, X)):
        assert [(entry.op, entry.location) for entry in report.unsupported] == [
            (f"parameter hook {fused_step.__qualname__}", where)
        ]
        assert report.unsupported[0].reason.startswith("it raised KeyError on the step's stand-in")
    assert all(not optimizer.state for optimizer in optimizers.values())  # untouched
