"""Outputs of the ops torch gives no meta kernel (``devices/meta_kernels.py`` on every
device model, ``devices/cpu/histogram.py`` for the CPU-only ops): the implementations
make what the real CPU kernel returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import Lambda
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.common import COMMON
from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.engine.tracing.rules import OpCall

aten = torch.ops.aten


def _pooled() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 3, 7, 6, 5)
    out, indices = F.fractional_max_pool3d(x, 2, output_size=3, return_indices=True)
    return x, out, indices


def _margin() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 6).t(), torch.tensor([[3, 0, -1, 1]] * 6)


CASES: dict[str, tuple[Any, Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]]] = {
    "fractional_max_pool3d_backward": (
        aten.fractional_max_pool3d_backward.default,
        lambda: ((torch.ones(2, 3, 3, 3, 3), _pooled()[0].transpose(2, 4), [2, 2, 2], [3, 3, 3], _pooled()[2]), {}),
    ),
    "multi_margin_loss_backward": (
        aten.multi_margin_loss_backward.default,
        lambda: ((torch.ones(6), torch.randn(4, 6).t(), torch.tensor([0, 3, 1, 2, 2, 0]), 1, 1.0, None, 0), {}),
    ),
    "multilabel_margin_loss_backward": (
        aten.multilabel_margin_loss_backward.default,
        lambda: ((torch.ones(()), *_margin(), 1, aten.multilabel_margin_loss_forward(*_margin(), 1)[1]), {}),
    ),
    "histogram.bin_ct": (aten.histogram.bin_ct, lambda: ((torch.randn(5, 7), 9), {"density": True})),
    "histogram.bins_tensor": (aten.histogram.bins_tensor, lambda: ((torch.randn(30), torch.tensor([0.0, 1.0, 4.0])), {})),
    "_histogramdd_bin_edges": (aten._histogramdd_bin_edges.default, lambda: ((torch.randn(10, 3), [2, 1, 4]), {})),
    "_histogramdd_from_bin_cts": (aten._histogramdd_from_bin_cts.default, lambda: ((torch.randn(10, 3), [2, 1, 4]), {})),
    "_histogramdd_from_bin_tensors": (
        aten._histogramdd_from_bin_tensors.default,
        lambda: ((torch.randn(4, 5, 2), [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([-1.0, 1.0])]), {}),
    ),
}


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.stride()


@pytest.mark.parametrize("name", CASES)
def test_outputs_are_the_real_kernels(name: str) -> None:
    op, make = CASES[name]
    args, kwargs = make()
    real = tree_flatten(op(*args, **kwargs))[0]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, args)
        rules = COMMON if COMMON.implementation_rule(op) is not None else CPU
        fake = tree_flatten(rules.implementation_rule(op)(OpCall(op, fake_args, kwargs)))[0]
    assert [_layout(t) for t in fake] == [_layout(t) for t in real]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "fn",
    [
        lambda x, t: F.fractional_max_pool3d(x[None], 2, output_size=2),
        lambda x, t: F.multi_margin_loss(x[0, 0], t[0]),
        lambda x, t: F.multilabel_margin_loss(x[0, 0], t),
    ],
    ids=["fractional_max_pool3d", "multi_margin_loss", "multilabel_margin_loss"],
)
def test_backward_is_traced_on_every_device(fn: Callable[..., Any], device: str) -> None:
    """The trace went on to the end of the step instead of stopping at the backward."""
    x = torch.randn(3, 5, 5, 5, requires_grad=True)
    target = torch.tensor([[3, 0, -1, 1, 2]] * 5).clamp(min=0)
    report = tm.estimate(Lambda(fn), (x, target), device=device)
    assert report.unsupported == ()
    assert report.backward_peak > 0


def test_cpu_only_ops_stop_the_cuda_trace() -> None:
    """``histogram`` has no CUDA kernel: the fake cuda device does not trace it as if
    it had one (it says so in ``unsupported``), while the CPU traces it whole."""
    x = torch.randn(40)
    model = Lambda(lambda x: torch.histogram(x, 5).hist)
    assert tm.estimate(model, x, train=False).unsupported == ()
    reasons = [u.reason for u in tm.estimate(model, x, train=False, device="cuda").unsupported]
    assert any("fake tensors cannot run it" in r for r in reasons), reasons


@pytest.mark.parametrize(
    "fn",
    [
        lambda src, x: torch.diagonal_scatter(x, src),
        lambda src, x: torch.select_scatter(x, src, 0, 1),
        lambda src, x: torch.slice_scatter(x, src.expand(2, 5), 0, 0, 2),
        lambda src, x: x.index_fill(0, torch.tensor([1, 3]), 2.0) * src.sum(),
    ],
    ids=["diagonal_scatter", "select_scatter", "slice_scatter", "index_fill"],
)
def test_ops_made_as_a_clone_of_an_expanded_self_are_laid_out_as_the_real_ones(fn: Callable[..., Any]) -> None:
    """``self.clone()`` of an expanded ``self`` is contiguous (the fake kernels of torch 2.10
    to 2.12 kept its stride 0, where the values the trace copies in overlap): traced to
    the end on every release, equal to ``measure``."""
    x = torch.randn(5, 1).expand(5, 5)
    model = Lambda(fn, params=(torch.randn(5),))
    estimated = tm.estimate(model, x)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x).phase_peaks()
