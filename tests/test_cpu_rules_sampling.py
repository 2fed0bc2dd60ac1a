"""CPU rules for the random samplers ``multinomial`` and ``normal``
(``pytest_torchmem/engine/tracing/devices/cpu/sampling.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from exactness import Lambda, assert_exact

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor

F32 = 4


def _forward(fn: Callable[..., Any], *inputs: torch.Tensor) -> int:
    report = tm.estimate(Lambda(fn), inputs, train=False)
    assert report.unsupported == ()
    assert report.forward_peak == tm.measure(Lambda(fn), inputs, train=False).forward_peak
    return report.forward_peak


def test_multinomial_without_replacement_checks_and_draws() -> None:
    """3 samples of 10 categories in 3 rows: the int64 output (72 B), ``aminmax`` (4 + 4 B),
    ``min >= 0`` and ``max < inf`` (8 + 4 + 1 B each), their ``&`` (1 B), the row sums
    (12 B) and ``== 0`` (8 + 4 + 3 B), ``any`` (1 B), then the exponential draws
    ``q`` (120 B) and ``topk``'s values (36 B). The peak: input 120 + output 72 +
    min/max 8 + the kept ``&`` and ``any`` 2 + q 120 + values 36. Up to torch 2.11
    ``min`` and ``max`` are two temporaries of the check, gone before the draws."""
    p = torch.rand(3, 10)
    min_max = 8 if torch_minor() >= (2, 12) else 0
    assert _forward(lambda p: torch.multinomial(p, 3), p) == 120 + 72 + min_max + 2 + 120 + 36


def test_multinomial_with_replacement_keeps_a_cumulative_row() -> None:
    """With replacement: the output and one row's cumulative distribution (10 floats)."""
    p = torch.rand(3, 10)
    assert _forward(lambda p: torch.multinomial(p, 4, replacement=True), p) == 120 + 96 + 40


def test_normal_checks_the_standard_deviations_twice() -> None:
    """``normal(mean, std)`` of (3, 4): ``std.min().ge(0)`` before the output and again
    after (4 + 8 + 4 + 1 B each time); ``normal(mean, 2.0)`` makes an output-sized
    ``std_tensor`` beside the output."""
    m, s = torch.randn(3, 4), torch.rand(3, 4)
    assert _forward(lambda m, s: torch.normal(m, s), m, s) == 48 * 3 + 4 + 8 + 4 + 1
    assert _forward(lambda m: torch.normal(m, 2.0), m) == 48 * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize(
    "fn",
    [
        lambda p: torch.multinomial(p, 3).float(),
        lambda p: torch.multinomial(p[0], 1).float(),
        lambda p: torch.multinomial(p, 5, replacement=True).float(),
        lambda p: torch.multinomial(p.t(), 2).float(),
        lambda p: torch.normal(p, p.detach().abs()),
        lambda p: torch.normal(p[:1], p.t().abs().t()),
        lambda p: torch.normal(p, 0.5),
        lambda p: torch.normal(1.0, p.abs()),
    ],
    ids=["multinomial", "one sample", "replacement", "transposed", "normal", "broadcast std",
         "number std", "number mean"],
)  # fmt: skip
def test_samplers_exact(fn: Callable[..., Any], dtype: torch.dtype, threads: int) -> None:
    p = torch.rand(4, 10, dtype=dtype, requires_grad=True)
    train = fn(p).is_floating_point() and fn(p).requires_grad
    assert_exact(Lambda(fn), p, train=train)
