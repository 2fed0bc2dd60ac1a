"""CPU backward formulas whose eager algorithm is not followed
(``pytest_torchmem/engine/tracing/devices/cpu/formulas.py``): listed in
``unsupported``, never silently inexact; the same ops elsewhere stay unflagged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from exactness import Lambda

import pytest_torchmem as tm


def _flagged(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> list[str]:
    return [u.reason for u in tm.estimate(Lambda(fn), inputs).unsupported]


@pytest.mark.parametrize(
    "fn, formula",
    [
        (lambda x: x.max(), "evenly_distribute_backward"),
        (lambda x: x.min(), "evenly_distribute_backward"),
        (lambda x: x.median(), "evenly_distribute_backward"),
        (lambda x: x.nanmedian(), "evenly_distribute_backward"),
        (lambda x: x.cumprod(1), "cumprod_backward"),
        (lambda x: x.prod(), "prod_backward"),
        (lambda x: x.prod(0), "prod_backward"),
        (lambda x: x.masked_fill(x > 0, x[0, 0]), "masked_fill_backward"),
    ],
)
def test_formulas_with_another_eager_algorithm_are_flagged(
    fn: Callable[[torch.Tensor], torch.Tensor], formula: str
) -> None:
    """Measured on a (5, 5) float input: ``max()``'s backward 100 B over the step's
    eager figure, ``cumprod(1)``'s 2,750 B, ``prod()``'s 2,000 B (OpInfo samples)."""
    x = torch.randn(5, 5, requires_grad=True)
    reasons = _flagged(fn, x)
    assert any(formula in r for r in reasons), reasons


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.max(0).values,  # value_selecting_reduction_backward: followed
        lambda x: x.isnan().float() + x,  # isnan outside the formula
        lambda x: torch.cat([x, x]),
        lambda x: x[:1].cumprod(0),  # one element along dim: the gradient as is
        lambda x: x.masked_fill(x > 0, 0.0),  # a number value: no value gradient
    ],
)
def test_the_same_ops_elsewhere_are_not_flagged(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x = torch.randn(5, 5, requires_grad=True)
    assert _flagged(fn, x) == []
