"""``measure(device="cuda")`` on a real GPU, against the estimate of the same GPU (``gpu="current"``).

These run only where a GPU is present (none on CI: they ran on an H100 with torch
2.11.0+cu130 in stop 47). CI checks the estimate's side of the same figures against
the numbers those runs measured (tests/test_cuda_rms_norm.py, test_cuda_workspaces.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from test_cuda_rms_norm import RmsMlp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _same(estimate: tm.MemoryReport, measured: tm.MemoryReport) -> None:
    assert estimate.phase_peaks() == measured.phase_peaks()
    assert estimate.reserved_peak == measured.reserved_peak


def test_measurements_in_a_row_reserve_alike() -> None:
    """A measurement starts from no workspaces and an empty cache: the last one's
    cuBLAS workspaces were freed before the cache was emptied (the other way round,
    the step ran in their cached segments: 0 B reserved for a small model)."""
    model, x = nn.Linear(8, 4), torch.randn(2, 8)
    first, second = (tm.measure(model, x, device="cuda") for _ in range(2))
    assert first.reserved_peak == second.reserved_peak > 0
    assert first.phase_peaks() == second.phase_peaks()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: (nn.Linear(8, 4), torch.randn(2, 8)), id="linear"),
        pytest.param(lambda: (RmsMlp(), torch.randn(64, 512)), id="rms-mlp"),
        pytest.param(lambda: (RmsMlp(torch.bfloat16), torch.randn(64, 512, dtype=torch.bfloat16)), id="rms-mlp-bf16"),
    ],
)
def test_the_estimate_of_this_gpu_is_its_measurement(make: object) -> None:
    torch.manual_seed(0)
    model, x = make()  # type: ignore[operator]
    estimate = tm.estimate(model, x, device="cuda", gpu="current")
    _same(estimate, tm.measure(model, x, device="cuda"))
