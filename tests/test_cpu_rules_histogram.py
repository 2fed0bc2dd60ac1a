"""CPU rules for histograms (``pytest_torchmem/engine/tracing/devices/cpu/histogram.py``);
``histogram`` and ``histogramdd``'s ops have no meta kernel in torch
(``devices/meta_kernels.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from exactness import Lambda, intra_op_threads

import pytest_torchmem as tm

F32 = 4


def _forward(fn: Callable[..., Any], *inputs: torch.Tensor) -> int:
    report = tm.estimate(Lambda(fn), inputs, train=False)
    assert report.unsupported == ()
    assert report.forward_peak == tm.measure(Lambda(fn), inputs, train=False).forward_peak
    return report.forward_peak


@pytest.mark.parametrize("n", [1, 4])
def test_histc_bytes_by_hand(n: int) -> None:
    """``histc(x, 10)``, x (1000,) float32, ``min == max``: the bin edges (11 floats),
    the histogram (10), ``aminmax``'s two results (4 + 4, given back), then one
    histogram per thread (``n`` x 10 floats): x + 44 + 40 + n x 40."""
    with intra_op_threads(n):
        assert _forward(lambda x: torch.histc(x, 10), torch.randn(1000)) == 4000 + 44 + 40 + n * 40


def test_histc_of_a_transposed_matrix_copies_it_by_blocks() -> None:
    """``histc(x.t(), 10, -1, 1)``, x (100, 100) float32: ``self.reshape({numel, 1})``
    copies the transposed matrix (40000 B), and ``copy_`` takes its 60 x 60 float
    block buffer (14400 B) while it does; one thread. Peak: x + the copy + the buffer."""
    with intra_op_threads(1):
        peak = _forward(lambda x: torch.histc(x.t(), 10, -1, 1), torch.randn(100, 100))
    assert peak == 40000 + 40000 + 60 * 60 * F32


def test_histogramdd_bytes_by_hand() -> None:
    """``histogramdd(x, [2, 3])``, x (50, 2) float32, one thread: ``_histogramdd_bin_edges``
    takes ``aminmax`` over the points (2 + 2 floats, given back) and returns the edges
    (3 + 4 floats); ``_histogramdd_from_bin_cts`` makes them again (3 + 4, plus the
    out variant's copies 3 + 4), the (2, 3) histogram and one per thread (6 floats).
    Peak: x 400 + edges 28 + 56 + histogram 24 + 24."""
    with intra_op_threads(1):
        peak = _forward(lambda x: torch.histogramdd(x, [2, 3]).hist, torch.randn(50, 2))
    assert peak == 400 + 28 + 56 + 24 + 24


CASES: dict[str, tuple[Callable[..., Any], tuple[int, ...]]] = {
    "histc": (lambda x: torch.histc(x, 7), (30,)),
    "histc range": (lambda x: torch.histc(x, 5, -1.0, 1.0), (4, 6)),
    "histc transposed": (lambda x: torch.histc(x.t(), 7), (70, 60)),
    "histc empty": (lambda x: torch.histc(x[:0], 7), (5,)),
    "histogram": (lambda x: torch.histogram(x, 6).hist, (40,)),
    "histogram edges": (lambda x: torch.histogram(x, 6).bin_edges, (40,)),
    "histogram density range": (lambda x: torch.histogram(x, 4, range=(-1.0, 1.0), density=True).hist, (8, 5)),
    "histogram bins tensor": (lambda x: torch.histogram(x, torch.tensor([-1.0, 0.0, 0.5, 2.0])).hist, (20,)),
    "histogram weighted transposed": (
        lambda x: torch.histogram(x.t(), 3, weight=torch.rand(6, 5).t(), density=True).hist, (5, 6),
    ),
    "histogramdd": (lambda x: torch.histogramdd(x, [3, 2, 4]).hist, (40, 3)),
    "histogramdd density": (lambda x: torch.histogramdd(x, 3, density=True).hist, (20, 2)),
    "histogramdd range weight": (
        lambda x: torch.histogramdd(x, [2, 2], range=[0.0, 1.0, -1.0, 1.0], weight=torch.rand(4, 6)).hist,
        (4, 6, 2),
    ),
    "histogramdd transposed": (lambda x: torch.histogramdd(x.transpose(0, 1), [2, 3]).hist, (6, 8, 2)),
    "histogramdd edges": (
        lambda x: torch.histogramdd(x, [torch.tensor([0.0, 1.0]), torch.tensor([-1.0, 0.0, 3.0])]).hist,
        (30, 2),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_histogram_equals_measure(name: str, threads: int) -> None:
    fn, shape = CASES[name]
    _forward(fn, torch.randn(shape))


@pytest.mark.parametrize("fn", [lambda x: torch.histc(x, 9), lambda x: torch.histc(x.t(), 4, 0, 1)])
def test_histc_bfloat16_equals_measure(fn: Callable[..., Any], threads: int) -> None:
    _forward(fn, torch.randn(70, 60, dtype=torch.bfloat16))


def test_bincount_bytes_by_hand() -> None:
    """``bincount`` of 1,000 int64 values in [0, 50): the 50 counts beside the input
    (its ``min()`` and ``max()``, 8 B each, die before the counts are made); a strided
    input is copied for the call (``self.contiguous()``, 500 values, the even ones: 49
    counts, up to 48); float16 weights
    are copied to double (``weights.to(kDouble)``), the counts double too."""
    x = torch.arange(1000) % 50
    assert _forward(lambda x: torch.bincount(x), x) == 8000 + 50 * 8
    assert _forward(lambda x: torch.bincount(x[::2]), x) == 8000 + 500 * 8 + 49 * 8
    w = torch.ones(1000, dtype=torch.float16)
    assert _forward(lambda x, w: torch.bincount(x, weights=w), x, w) == 8000 + 2000 + 1000 * 8 + 50 * 8
    assert _forward(lambda x: torch.bincount(x[:0], minlength=7), x) == 8000 + 7 * 8
