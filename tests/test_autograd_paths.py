"""Backward formulas that scatter into a zero tensor in place eagerly, but not under
a dispatch mode (``pytest_torchmem.engine.tracing.devices.autograd_paths``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from exactness import Lambda

import pytest_torchmem as tm

F32, I64 = 4, 8


def _peaks(report: tm.MemoryReport) -> dict[str, int]:
    return report.phase_peaks()


def test_gather_backward_bytes_by_hand() -> None:
    """``x.gather(1, idx)``, x (32, 256) float32, idx (32, 8) int64, loss = sum.

    Forward: x 32768 + idx 2048 + output 1024 + loss 4 = 35844.
    Backward (the output is dropped once the loss is taken): x, idx, the loss
    and its gradient (4 + 4), and ``gather_backward``'s ``new_zeros`` (32768),
    which ``scatter_add_`` fills in place and which becomes ``x.grad``:
    32768 + 2048 + 8 + 32768 = 67592. (Out of place, a second 32768 would be live.)
    """
    x, idx = torch.randn(32, 256, requires_grad=True), torch.randint(0, 256, (32, 8))
    model = Lambda(lambda x, idx: x.gather(1, idx))
    report = tm.estimate(model, (x, idx))
    assert report.forward_peak == 32 * 256 * F32 + 32 * 8 * I64 + 32 * 8 * F32 + F32
    assert report.backward_peak == 2 * 32 * 256 * F32 + 32 * 8 * I64 + 2 * F32
    assert _peaks(report) == _peaks(tm.measure(model, (x, idx)))


def test_indexing_backward_bytes_by_hand() -> None:
    """``x[idx]``, x (64, 32) float32, idx (16,) int64: ``index_backward`` puts the
    gradient into ``zeros_like(x)`` with ``_index_put_impl_`` in place.

    Backward: x 8192 + idx 128 + loss and its gradient 8 + zeros 8192 = 16520.
    """
    x, idx = torch.randn(64, 32, requires_grad=True), torch.randint(0, 64, (16,))
    model = Lambda(lambda x, idx: x[idx])
    report = tm.estimate(model, (x, idx))
    assert report.backward_peak == 2 * 64 * 32 * F32 + 16 * I64 + 2 * F32
    assert _peaks(report) == _peaks(tm.measure(model, (x, idx)))


def test_topk_backward_on_cuda_by_hand() -> None:
    """The formulas are the same on cuda, where each storage is a 512-byte block at least.

    ``x.topk(4, dim=1).values``, x (32, 64) float32: forward x 8192 + values 512 +
    indices 1024 + loss 512 = 10240; backward x 8192 + indices (saved) 1024 +
    loss and its gradient 2 * 512 + ``zeros`` 8192 = 18432.
    """
    x = torch.randn(32, 64, requires_grad=True)
    report = tm.estimate(Lambda(lambda x: x.topk(4, dim=1).values), x, device="cuda")
    assert report.forward_peak == 8192 + 512 + 1024 + 512
    assert report.backward_peak == 8192 + 1024 + 2 * 512 + 8192


_X = (8, 24, 16)
CASES: dict[str, Callable[..., Any]] = {
    "max.dim": lambda x: x.max(1).values,
    "min.dim keepdim": lambda x: x.min(1, keepdim=True).values,
    "sort": lambda x: x.sort(dim=-1).values,
    "sort.stable": lambda x: x.sort(dim=1, stable=True, descending=True).values,
    "msort": lambda x: torch.msort(x),
    "topk": lambda x: x.topk(3, dim=2).values,
    "kthvalue": lambda x: x.kthvalue(2, dim=1).values,
    "mode": lambda x: x.mode(1).values,
    "median.dim": lambda x: x.median(1).values,
    "nanmedian.dim": lambda x: x.nanmedian(2).values,
    "cummax": lambda x: x.cummax(1).values,
    "cummin": lambda x: x.cummin(2).values,
    "gather": lambda x: x.gather(2, torch.zeros(8, 24, 5, dtype=torch.long)),
    "take_along_dim": lambda x: torch.take_along_dim(x, torch.ones(8, 3, 16, dtype=torch.long), 1),
    "index_select": lambda x: x.index_select(1, torch.tensor([0, 3, 3, 7])),
    "getitem": lambda x: x[:, torch.tensor([1, 2, 2, 5])],
    "clamp tensor bounds": lambda x: x.clamp(torch.full((16,), -0.5), torch.full((16,), 0.5)),
    "trace": lambda x: torch.trace(x[0]),
    "trace of a wide matrix": lambda x: torch.trace(x[:, 0]) * x[0],
    "take": lambda x: torch.take(x, torch.tensor([[0, 5, 5], [100, 7, 3]])),
}


def test_trace_backward_bytes_by_hand() -> None:
    """``trace(x)``, x (64, 64) float32: ``trace_backward`` makes the flat zeros (16 KiB)
    and the diagonal's int64 indices (64 x 8 B), then ``index_fill_`` writes in place:
    at the peak x, the loss, its gradient, the zeros (the input gradient) and the
    indices. (Out of place, a second 16 KiB would be live.)"""
    x = torch.randn(64, 64, requires_grad=True)
    model = Lambda(torch.trace)
    report = tm.estimate(model, x)
    assert report.backward_peak == 2 * 64 * 64 * F32 + 64 * I64 + 2 * F32
    assert _peaks(report) == _peaks(tm.measure(model, x))


def test_binary_cross_entropy_target_backward_multiplies_in_place() -> None:
    """``binary_cross_entropy(x, t)`` with ``t`` requiring grad, (1024,) float32, mean:
    ``binary_cross_entropy_target_backward`` takes ``logit(x).neg_()`` and multiplies
    it by the gradient with ``mul_`` (out of place under a dispatch mode).

    Backward: x and t (4096 + 4096), the loss and its gradient (4 + 4), the input's
    gradient (4096) and the target's (4096), and ``div_``'s wrapped count and its
    float cast (8 + 4) = 16404. (Out of place, a second 4096 would be live.)
    """
    x, t = torch.rand(1024, requires_grad=True), torch.rand(1024, requires_grad=True)
    model = Lambda(torch.nn.functional.binary_cross_entropy)
    report = tm.estimate(model, (x, t))
    assert report.backward_peak == 4 * 1024 * F32 + 2 * F32 + 8 + F32
    assert _peaks(report) == _peaks(tm.measure(model, (x, t)))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_binary_cross_entropy_target_backward_equals_measure(reduction: str, weighted: bool, threads: int) -> None:
    x, t = torch.rand(6, 40, requires_grad=True), torch.rand(6, 40, requires_grad=True)
    weight = torch.rand(40) if weighted else None
    model = Lambda(lambda x, t: torch.nn.functional.binary_cross_entropy(x, t, weight, reduction=reduction))
    assert _peaks(tm.estimate(model, (x, t))) == _peaks(tm.measure(model, (x, t)))


@pytest.mark.parametrize("name", CASES)
def test_estimate_equals_measure(name: str, threads: int) -> None:
    x = torch.randn(*_X, requires_grad=True)
    model = Lambda(CASES[name])
    estimated = tm.estimate(model, x)
    assert estimated.complete
    assert _peaks(estimated) == _peaks(tm.measure(model, x))


def test_out_of_place_op_elsewhere_stays_out_of_place() -> None:
    """A ``scatter`` the program calls itself (here in a custom backward) is not made in place."""

    class Spread(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            zeros = torch.zeros_like(grad)
            return zeros.scatter(0, torch.zeros_like(grad, dtype=torch.long), grad) + zeros

    x = torch.randn(1024, requires_grad=True)
    model = Lambda(Spread.apply)
    assert _peaks(tm.estimate(model, x)) == _peaks(tm.measure(model, x))


# -- in-place ops on views --------------------------------------------------------
#
# An in-place op on a view regenerates the view's node: an AsStridedBackward0 on a
# plain tensor (its backward puts the gradient into a zeroed tensor the size of
# the base), a replay of the view (ViewBackward0, no allocation) on a fake one.


def test_in_place_on_a_view_backward_bytes_by_hand() -> None:
    """``x.sin().view(16, 8).relu_()``, x (8, 16) float32, loss = sum.

    Forward: x 512 + sin's output 512 + loss 4 = 1028. Backward: x, the output
    (saved by relu_'s node), the loss and its gradient (4 + 4),
    ``as_strided_backward``'s zeroed storage 512, then CopySlices' copy of it
    512, the contiguous clone of its slice 512 and ``threshold_backward``'s
    result 512: 512 * 2 + 8 + 512 * 4 = 3080 (2568 with a replayed view).
    """
    x = torch.randn(8, 16, requires_grad=True)
    model = Lambda(lambda x: x.sin().view(16, 8).relu_())
    report = tm.estimate(model, x)
    assert report.forward_peak == 2 * 8 * 16 * F32 + F32
    assert report.backward_peak == 6 * 8 * 16 * F32 + 2 * F32
    assert _peaks(report) == _peaks(tm.measure(model, x))


VIEW_CASES: dict[str, Callable[[], torch.nn.Module]] = {
    # nn.Linear views the addmm result of a 3-d input back to 3-d
    "linear relu_": lambda: torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(inplace=True), torch.nn.Linear(32, 8)
    ),
    "linear relu_ output": lambda: torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Hardtanh(inplace=True)
    ),
    "transpose relu_": lambda: Lambda(lambda x: (x * x).transpose(0, 1).relu_()),
    "permute leaky_relu_": lambda: Lambda(
        lambda x: torch.nn.functional.leaky_relu((x * x).permute(2, 0, 1), inplace=True)
    ),
    # views of views: autograd replays each view op, as_strided_backward is one node
    "view transpose relu_": lambda: Lambda(lambda x: (x * x).view(35, 16).t().relu_()),
    "linear transpose relu_": lambda: _Then(lambda y: y.transpose(0, 1).relu_()),
    "unsqueeze permute relu_": lambda: Lambda(
        lambda x: (x * x).unsqueeze(1).permute(3, 0, 1, 2).relu_()
    ),
    # slices and selects: their replayed nodes allocate the base's gradient as well
    "slice relu_": lambda: Lambda(lambda x: (x * x)[:, 2:].relu_()),
    "select relu_ then whole": lambda: Lambda(lambda x: _whole_after((x * x), lambda y: y[1])),
    # A Python number on an in-place op of a view: its node, inside CopySlices,
    # saves the wrapped number until the backward. Settling it must wait until
    # autograd has regenerated the view's node (grad_fn read within the
    # regeneration deadlocked).
    "transpose mul_ number": lambda: Lambda(lambda x: (x * x).transpose(0, 1).mul_(2)),
    "linear mul_ add_ numbers": lambda: _Then(lambda y: y.mul_(0.5).add_(1.0)),
    "linear transpose div_ number": lambda: _Then(lambda y: y.transpose(1, 2).div_(3.0)),
    "checkpointed transpose mul_ number": lambda: Lambda(
        lambda x: torch.utils.checkpoint.checkpoint(
            lambda x: (x * x).transpose(0, 1).mul_(2),
            x,
            use_reentrant=False,
            preserve_rng_state=False,  # (its RNG state copy is a documented limit)
        )
    ),
    # ... in a graph dropped unrun
    "dropped transpose mul_ number": lambda: Lambda(
        lambda x: [(x * x).transpose(0, 1).mul_(2), x.sin()][1]
    ),
    # ... whose recomputation saves the number again
    "checkpointed transpose mul_ number sin": lambda: Lambda(
        lambda x: torch.utils.checkpoint.checkpoint(
            lambda x: (x * x).transpose(0, 1).mul_(2).sin(),
            x,
            use_reentrant=False,
            preserve_rng_state=False,
        )
    ),
}


class _Then(torch.nn.Module):
    """``fn`` on the output of a Linear (a view of its addmm result, for 3-d inputs)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.linear(x))


def _whole_after(y: torch.Tensor, view: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    view(y).relu_()
    return y


@pytest.mark.parametrize("name", VIEW_CASES)
def test_in_place_on_a_view_equals_measure(name: str, threads: int) -> None:
    model = VIEW_CASES[name]()
    x = torch.randn(5, 7, 16, requires_grad=not name.startswith("linear"))
    estimated = tm.estimate(model, x)
    measured = tm.measure(model, x)
    assert estimated.complete
    assert _peaks(estimated) == _peaks(measured)
    assert estimated.breakdown == measured.breakdown
