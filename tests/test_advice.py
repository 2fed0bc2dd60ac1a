"""What to change when a step does not fit (issue 26, item 3): ``tm.advise``.

Each suggestion's figure is an estimate of the changed step: applied to the model as a
user would write it and measured on this CPU, the changed step takes exactly that.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import pytest_torchmem as tm


class Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Tower(nn.Module):
    """Four blocks and a head; ``recompute`` names the blocks run under checkpoint, as a
    user writes it."""

    def __init__(self, recompute: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(64, 8)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if index in self.recompute else block(x)
        return self.head(x)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _tower() -> Tower:
    torch.manual_seed(0)
    return Tower()


def _x(batch: int = 64) -> torch.Tensor:
    return torch.randn(batch, 32, 64)


def test_the_checkpointing_advice_applied_by_hand_takes_what_it_said() -> None:
    """A budget that needs two of the four blocks recomputed: the advice names two, and
    the model with those two checkpointed in its own forward measures what it said."""
    model, x = _tower(), _x()
    before = tm.measure(model, x, optimizer=_adamw).peak
    one = tm.measure(_with(model, (0,)), x, optimizer=_adamw).peak
    saving = before - one
    assert saving > 0
    advice = tm.advise(model, x, budget=before - saving - saving // 2, device="cpu", optimizer=_adamw)
    assert advice.nbytes == before and not advice.fits
    (recompute,) = [s for s in advice.suggestions if s.modules]
    assert recompute.modules == ("blocks.0", "blocks.1") and recompute.fits
    assert recompute.change == "checkpoint blocks.0 to blocks.1 (2 of 4 Block)"
    assert recompute.nbytes == tm.measure(_with(model, (0, 1)), x, optimizer=_adamw).peak


def _with(model: Tower, recompute: tuple[int, ...]) -> Tower:
    changed = copy.deepcopy(model)
    changed.recompute = recompute
    return changed


def test_micro_batches_with_accumulation_take_what_the_loop_written_by_hand_takes() -> None:
    model, x = _tower(), _x()
    budget = tm.estimate(model, x, optimizer=_adamw).peak - 1
    advice = tm.advise(model, x, budget=budget, device="cpu", optimizer=_adamw)
    (micro,) = [s for s in advice.suggestions if "micro-batches" in s.change]
    assert micro.change == "2 micro-batches of 32 with gradient accumulation"

    def loop(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        for _ in range(2):
            for piece in x.chunk(2):
                loss = model(piece).sum() / 2
                loss.backward()
                del loss
            opt.step()
            opt.zero_grad(set_to_none=True)

    assert micro.nbytes == tm.measure(loop, (model, x, _adamw(model.parameters()))).peak


def test_releasing_the_output_and_autocast_are_the_changed_steps() -> None:
    model, x = _tower(), _x()
    kept = tm.estimate(model, x, keep_output=True, optimizer=_adamw)
    advice = tm.advise(model, x, budget=kept.peak - 1, device="cpu", keep_output=True, optimizer=_adamw)
    changes = {s.change: s.nbytes for s in advice.suggestions}
    released = "release the output before backward() (keep_output=False)"
    assert changes[released] == tm.estimate(model, x, optimizer=_adamw).peak
    autocast = "run the forward under torch.autocast('cpu', dtype=torch.bfloat16)"
    assert changes[autocast] == tm.estimate(_Autocast(model), x, keep_output=True, optimizer=_adamw).peak


class _Autocast(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


def test_the_suggestions_are_ordered_and_the_model_is_left_as_it_was() -> None:
    model, x = _tower(), _x()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules = list(model.modules())
    advice = tm.advise(model, x, budget=tm.estimate(model, x).peak // 2, device="cpu")
    fitting = [s for s in advice.suggestions if s.fits]
    assert [s.nbytes for s in fitting] == sorted((s.nbytes for s in fitting), reverse=True)
    assert all(s.nbytes < advice.nbytes for s in advice.suggestions)
    assert list(model.modules()) == modules and "forward" not in vars(model.blocks[0])
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert str(advice).splitlines()[0].endswith(" over")


def test_a_step_that_fits_needs_no_advice() -> None:
    advice = tm.advise(nn.Linear(4, 4), torch.randn(2, 4), budget="1 GiB", device="cpu")
    assert advice.fits and advice.suggestions == ()
    assert str(advice) == (
        f"the step takes {tm.format_bytes(advice.nbytes)} (peak) of budget 1.00 GiB (1.00 GiB): "
        f"it fits, {tm.format_bytes(2**30 - advice.nbytes)} to spare"
    )


def test_on_a_gpu_the_reserved_peak_decides() -> None:
    model, x = _tower(), _x(4096)
    report = tm.estimate(model, x, device="cuda", gpu="T4", optimizer=_adamw)
    small = tm.GpuProfile("T4-small", memory=report.reserved_peak + (512 << 20) - (64 << 20), compute_capability=(7, 5), sm_count=40)
    advice = tm.advise(model, x, gpu=small, optimizer=_adamw)
    assert advice.figure == "reserved" and advice.nbytes == report.reserved_peak and not advice.fits
    assert any(s.fits for s in advice.suggestions)
    assert all(s.nbytes == s.report.reserved_peak for s in advice.suggestions)


@pytest.mark.parametrize(
    ("model", "arguments", "message"),
    [
        (lambda x: x, {"budget": "1 GiB"}, "give it an nn.Module"),
        (nn.Linear(4, 4), {}, "advise\\(\\) needs a target"),
        (nn.Linear(4, 4), {"budget": "1 GiB", "device": "cpu", "figure": "reserved"}, "needs device='cuda'"),
    ],
)
def test_bad_arguments_are_refused(model: Any, arguments: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        tm.advise(model, torch.randn(2, 4), **arguments)


# -- a trace that stops ---------------------------------------------------------------------------


class _StopsUnderAutocast(nn.Module):
    """A step the trace follows, but for its bfloat16 autocast variant (``.numpy()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            x = torch.from_numpy(x.float().numpy())
        return self.fc(x)


class _StopsInRecomputation(nn.Module):
    """A block the trace follows once per step; run a second time in one estimate (the
    recomputation of a checkpointed one: each estimate starts from the model as the
    user left it, its count too), it reads values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            x = torch.from_numpy(x.detach().numpy())
        return self.fc(x)


def test_the_step_whose_trace_stops_raises_and_a_changed_step_that_stops_is_skipped() -> None:
    """No figure, no advice: the step itself stopping raises; a change whose step stopped
    is said to be skipped, where and why."""
    model = nn.Sequential(_StopsUnderAutocast())
    with pytest.raises(tm.TraceStopped, match="in Tensor.numpy"), torch.autocast("cpu", dtype=torch.bfloat16):
        tm.advise(model, torch.randn(8, 64), budget=1, device="cpu")  # the step itself stops
    advice = tm.advise(model, torch.randn(8, 64), budget=1, device="cpu")
    [skipped] = [line for line in advice.skipped if "autocast" in line]
    assert skipped.startswith(
        "run the forward under torch.autocast('cpu', dtype=torch.bfloat16): TraceStopped: the trace "
        "stopped at "
    )
    assert "in Tensor.numpy" in skipped and "\n" not in skipped
    assert not any("autocast" in s.change for s in advice.suggestions)


def test_a_checkpointed_step_whose_trace_stops_is_skipped() -> None:
    model = nn.Sequential(_StopsInRecomputation(), nn.Linear(64, 8))
    advice = tm.advise(model, torch.randn(8, 64), budget=1, device="cpu")
    [skipped] = [line for line in advice.skipped if line.startswith("checkpoint blocks")]
    assert skipped.startswith("checkpoint blocks: TraceStopped: the trace stopped at ")
    assert not any(s.change.startswith("checkpoint") for s in advice.suggestions)
