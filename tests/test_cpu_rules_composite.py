"""CPU kernels made of other ATen ops (``pytest_torchmem.engine.tracing.devices.cpu.composite``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from exactness import Lambda, assert_exact

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import installed_release

F32 = 4


def _forward(fn: Callable[..., Any], *inputs: torch.Tensor) -> int:
    report = tm.estimate(Lambda(fn), inputs, train=False)
    assert report.forward_peak == tm.measure(Lambda(fn), inputs, train=False).forward_peak
    return report.forward_peak


def test_logsumexp_bytes_by_hand() -> None:
    """(64, 128) over dim 1: ``maxes`` (64 floats) stays; ``abs``, the wrapped 8-byte
    infinity, its 4-byte float cast and the (64,) mask come and go; then ``self - maxes``
    (64 * 128 floats) beside the result (64 floats): x + maxes + difference + result."""
    x = torch.randn(64, 128)
    assert _forward(lambda x: x.logsumexp(1), x) == (64 * 128 + 64 + 64 * 128 + 64) * F32


def test_isinf_bytes_by_hand() -> None:
    """``self.abs() == inf``: the absolute values (64 * 128 floats), the wrapped number
    and its cast (8 + 4) and the boolean result (64 * 128 bytes)."""
    x = torch.randn(64, 128)
    assert _forward(torch.isinf, x) == 2 * 64 * 128 * F32 + 8 + F32 + 64 * 128


def test_dist_bytes_by_hand() -> None:
    """``norm(self - other, p)``: the broadcast difference, then the 0-dim result."""
    x, y = torch.randn(64, 128), torch.randn(128)
    assert _forward(lambda x, y: torch.dist(x, y, 3), x, y) == (2 * 64 * 128 + 128 + 1) * F32


def test_mvlgamma_bytes_by_hand() -> None:
    """p = 3 on (64, 128) floats: the 3-element arange, ``args`` (64 * 128 * 3 floats),
    the result, then ``add_``'s wrapped number and its cast (8 + 4); at the peak x +
    args + result + 12 bytes (the arange is freed when ``args`` is made, one thread:
    no per-thread partials)."""
    x = torch.rand(64, 128) + 2
    from exactness import intra_op_threads

    with intra_op_threads(1):
        assert _forward(lambda x: torch.mvlgamma(x, 3), x) == (64 * 128 * 5) * F32 + 8 + F32


@pytest.mark.parametrize("p", [1, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_mvlgamma_exact(p: int, dtype: torch.dtype, threads: int) -> None:
    """OpInfo's ``mvlgamma.mvlgamma_p_{1,3,5}``, with the backward, and an integer input
    (cast to float by the addition)."""
    x = (torch.rand(6, 10, 12, dtype=dtype) + p).requires_grad_()
    model = Lambda(lambda x: torch.mvlgamma(x, p))
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()
    for inp in (
        (torch.rand(10, 6, 12, dtype=dtype) + p).transpose(0, 1),
        torch.randint(p, p + 5, (7, 9)),
    ):
        estimated = tm.estimate(model, inp, train=False)
        assert estimated.phase_peaks() == tm.measure(model, inp, train=False).phase_peaks()


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.logsumexp(-1),
        lambda x: x.logsumexp((0, 2), keepdim=True),
        lambda x: torch.logsumexp(x.transpose(0, 1), 0),
        lambda x: x * torch.isinf(x),
        lambda x: torch.dist(x, x.flip(0)),
    ],
    ids=["logsumexp last", "logsumexp keepdim", "logsumexp transposed", "isinf", "dist"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_step_equals_measure(fn: Callable[..., Any], dtype: torch.dtype, threads: int) -> None:
    x = torch.randn(6, 10, 12, dtype=dtype, requires_grad=True)
    model = Lambda(fn)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


# -- kernels followed op by op (``follow_cpu_kernel``) ------------------------------------


def test_soft_margin_loss_bytes_by_hand() -> None:
    """``soft_margin_loss(x, target)``, (64, 128) float32, mean, followed in
    ``Loss.cpp``: ``neg_out`` into the ``empty({0})`` result (64 * 128 floats, which the
    scalar loss keeps after ``resize_({})``), then ``mean``: its 0-dim result, the
    wrapped 8-byte count and its float cast. Peak: x + target + result + 4 + 8 + 4."""
    x, target = torch.randn(64, 128), torch.randn(64, 128).sign()
    peak = _forward(lambda x, t: torch.nn.functional.soft_margin_loss(x, t), x, target)
    assert peak == 3 * 64 * 128 * F32 + F32 + 8 + F32


def test_bilinear_bytes_by_hand() -> None:
    """``bilinear(x1, x2, w)``: x1 (8, 3), x2 (8, 4), w (5, 3, 4), no bias, one thread:
    ``_trilinear`` zeroes the (8, 5) output, then for each of the 5 output features
    ``sumproduct_pair`` multiplies by ``bmm`` (the (8, 4) product, and the (8, 1)
    result of the second pair), added into a column: at the peak the inputs,
    the output, the first product and the second: (24 + 32 + 60 + 40 + 32 + 8) floats."""
    x1, x2, w = torch.randn(8, 3), torch.randn(8, 4), torch.randn(5, 3, 4)
    from exactness import intra_op_threads

    with intra_op_threads(1):
        peak = _forward(lambda a, b, w: torch.nn.functional.bilinear(a, b, w), x1, x2, w)
    assert peak == (24 + 32 + 60 + 40 + 32 + 8) * F32


_FOLLOWED: dict[str, tuple[Callable[..., Any], tuple[tuple[int, ...], ...]]] = {
    "bilinear": (lambda a, b, w, bias: torch.nn.functional.bilinear(a, b, w, bias), ((8, 3), (8, 4), (5, 3, 4), (5,))),
    "bilinear 3-d": (lambda a, b, w, bias: torch.nn.functional.bilinear(a, b, w, bias), ((2, 6, 3), (2, 6, 4), (7, 3, 4), (7,))),
    "soft_margin none": (
        lambda x, t, *_: torch.nn.functional.soft_margin_loss(x, t.detach().sign(), reduction="none"), ((6, 10), (6, 10)),
    ),
    "soft_margin mean": (lambda x, t, *_: torch.nn.functional.soft_margin_loss(x, t.detach().sign()), ((6, 10), (6, 10))),
    "soft_margin sum": (
        lambda x, t, *_: torch.nn.functional.soft_margin_loss(x, t.detach().sign(), reduction="sum"), ((40000,), (40000,)),
    ),
}


@pytest.mark.parametrize("name", _FOLLOWED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_followed_kernels_equal_measure(name: str, dtype: torch.dtype, threads: int) -> None:
    """``_trilinear`` (``bilinear``'s kernel and its backward) and ``soft_margin_loss``
    and its backward: each op of the kernel traced with its own rules."""
    fn, shapes = _FOLLOWED[name]
    inputs = tuple(torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes)
    assert_exact(Lambda(fn), inputs)


@pytest.mark.skipif(
    installed_release()[:2] < (2, 13),
    reason="F.linear_cross_entropy is new in torch 2.13 (torch/nn/functional.py:3698 of 2.13.0)",
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_linear_cross_entropy_equals_measure(reduction: str, dtype: torch.dtype, threads: int) -> None:
    """``linear_cross_entropy`` with chunking options runs custom ops whose forward is
    a Python program (per chunk of the batch: logits, log-sum-exp, the gathered
    targets; for mean/sum the gradients too): the fake kernel made only the outputs,
    the trace now follows the program."""
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    torch.manual_seed(0)
    x = torch.randn(16, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(12, 8, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 12, (16,))
    options = LinearCrossEntropyOptions(batch_chunk_size=4)
    model = Lambda(
        lambda x, w, t: torch.nn.functional.linear_cross_entropy(x, w, t, reduction=reduction, options=options)
    )
    assert_exact(model, (x, w, target))


@pytest.mark.parametrize(
    "window",
    [
        lambda: torch.hann_window(64),
        lambda: torch.hamming_window(64, periodic=False),
        lambda: torch.blackman_window(64),
        lambda: torch.bartlett_window(64),
        lambda: torch.kaiser_window(64),
    ],
    ids=["hann", "hamming", "blackman", "bartlett", "kaiser"],
)
def test_window_functions_are_followed(window: Callable[[], torch.Tensor], threads: int) -> None:
    """The window functions' CPU kernels scale an ``arange`` in place with Python
    numbers, each a wrapped double and its float copy (``hann_window`` within a step
    was 4 bytes short at 2 and 4 threads, unflagged, before it was followed)."""
    model = Lambda(lambda x: x * window())
    x = torch.randn(8, 64, requires_grad=True)
    estimated = tm.estimate(model, x)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x).phase_peaks()


@pytest.mark.parametrize("periodic", [True, False])
@pytest.mark.parametrize("length", [0, 1, 2, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_kaiser_window_holds_its_longer_storage(periodic: bool, length: int, dtype: torch.dtype) -> None:
    """A periodic ``kaiser_window(n)`` is a ``narrow`` of an ``n + 1`` window, whose
    storage it keeps: 4 bytes more than its own size in float32 (was short by them)."""
    model = Lambda(lambda x: x.sum() * torch.kaiser_window(length, periodic, dtype=dtype))
    x = torch.randn(8, dtype=dtype)
    estimated = tm.estimate(model, x, train=False)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x, train=False).phase_peaks()
