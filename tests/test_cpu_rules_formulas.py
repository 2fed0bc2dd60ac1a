"""CPU backward formulas that pick their eager algorithm by values
(``pytest_torchmem/engine/tracing/devices/cpu/formulas.py``): their eager
replica runs (exact where the values are known: ``tests/test_values.py``);
where it cannot (saved tensors behind a checkpoint's hooks), the node's own
formula is counted and listed in ``unsupported``, never silently inexact; the
same ops elsewhere stay unflagged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from exactness import Lambda

import pytest_torchmem as tm
from torch.utils.checkpoint import checkpoint


def _flagged(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> list[str]:
    return [u.reason for u in tm.estimate(Lambda(fn), inputs).unsupported]


def _checkpointed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda x: checkpoint(fn, x, use_reentrant=False)


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
def test_formulas_behind_a_checkpoint_are_flagged(
    fn: Callable[[torch.Tensor], torch.Tensor], formula: str
) -> None:
    """The replica reads the node's saved tensors; a non-reentrant checkpoint's unpack
    hooks would recompute the forward for it, so the node's own (composite) formula
    runs, which on a (5, 5) float input is 100 B over eager for ``max()``, 2,750 B
    for ``cumprod(1)``, 2,000 B for ``prod()`` (OpInfo samples)."""
    x = torch.randn(5, 5, requires_grad=True)
    reasons = _flagged(_checkpointed(fn), x)
    assert any(formula in r for r in reasons), reasons


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.max(),
        lambda x: x.cumprod(1),
        lambda x: x.prod(),
        lambda x: x.prod(0),
        lambda x: x.masked_fill(x > 0, x[0, 0]),
    ],
)
def test_formulas_with_known_values_are_not_flagged(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    assert _flagged(fn, torch.randn(5, 5, requires_grad=True)) == []


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
