"""CPU rules for LAPACK-backed linear algebra
(``pytest_torchmem/engine/tracing/devices/cpu/linalg.py``): calls whose workspaces
are not modelled are listed in ``unsupported``, never silently inexact."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from exactness import Lambda

import pytest_torchmem as tm


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda a: torch.linalg.pinv(a), "linalg_pinv"),
        (lambda a: torch.linalg.pinv(a, hermitian=True), "linalg_pinv"),
        (lambda a: torch.pinverse(a), "linalg_pinv"),
        (lambda a: torch.cholesky_solve(a, torch.eye(5)), "cholesky_solve"),
    ],
)
def test_composites_run_whole_by_fake_tensors_are_flagged(
    fn: Callable[[torch.Tensor], torch.Tensor], op: str
) -> None:
    """``linalg_pinv`` and ``cholesky_solve`` reach the fake trace as one op, while the
    real kernel runs an SVD / eigendecomposition or a LAPACK solve with its own info
    tensors and workspaces (measured: ``_linalg_svd`` takes 220 B of scratch on a
    5 x 5 float matrix, ``cholesky_solve`` two 1-byte infos): flagged."""
    a = torch.randn(5, 5, requires_grad=True)
    report = tm.estimate(Lambda(fn, (a,)), ())
    flagged = [u for u in report.unsupported if op in str(u) and "LAPACK" in u.reason]
    assert flagged, report.unsupported
