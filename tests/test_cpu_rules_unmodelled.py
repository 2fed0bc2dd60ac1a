"""CPU kernels whose figures depend on tensor values (isin's unique sizes,
``masked_select``'s count, a ``max`` bag's non-empty bags): listed in ``unsupported``,
never silently inexact; their other forms, and the kernels once listed as unmodelled
(``cpu/unmodelled.py``, now gone: every entry is modelled), stay unflagged and exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import Lambda

import pytest_torchmem as tm

_I = torch.tensor([0, 2, 1, 2])


def _reasons(fn: Callable[..., Any], *inputs: torch.Tensor, train: bool = True) -> list[str]:
    return [u.reason for u in tm.estimate(Lambda(fn), inputs, train=train).unsupported]


@pytest.mark.parametrize(
    "fn, train, words",
    [
        (lambda x: torch.isin(x[0], x.flatten()).float(), False, "isin"),
        (lambda x: x.masked_scatter(x > 0, x * 2), True, "masked_scatter_backward"),
        (lambda x: F.embedding_bag(_I, x, torch.tensor([0, 2]), mode="max"), True, "embedding_bag"),
    ],
)
def test_unmodelled_kernels_are_flagged(fn: Callable[..., Any], train: bool, words: str) -> None:
    """Also the value-dependent parts of modelled kernels: isin's ``_unique`` sizes,
    ``masked_select``'s count, the non-empty bags of a ``max`` bag."""
    x = torch.randn(4, 4, requires_grad=train)
    reasons = _reasons(fn, x, train=train)
    assert any(words in r for r in reasons), reasons


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.index_reduce(0, _I, x, "amax"),
        lambda x: x.scatter_reduce(0, _I[:, None].expand(4, 4), x, "sum"),
        lambda x: torch.count_nonzero(x).float() + x,
        lambda x: torch.count_nonzero(x, dim=0).float() + x,
        lambda x: x.index_reduce(0, _I, x, "mean"),
        lambda x: x.scatter_reduce(0, _I[:, None].expand(4, 4), x, "mean"),
        lambda x: torch.isin(x, x[:3]).float() + x,
        lambda x: torch.multinomial(x.abs()[0], 2).float().sum() + x,
        lambda x: torch.normal(x, 1.0),
        lambda x: F.embedding_bag(_I, x, torch.tensor([0, 2])),
        lambda x: F.soft_margin_loss(x, x.detach().sign()),
        lambda x: F.bilinear(x, x, torch.ones(2, 4, 4)),
        lambda x: F.interpolate(x[None, None], scale_factor=2, mode="bilinear", antialias=True),
    ],
)
@pytest.mark.filterwarnings(r"ignore:index_reduce\(\) is in beta:UserWarning")
def test_modelled_forms_are_not_flagged_and_exact(fn: Callable[..., Any], threads: int) -> None:
    x = torch.randn(4, 4, requires_grad=True)
    estimated = tm.estimate(Lambda(fn), x)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(Lambda(fn), x).phase_peaks()
