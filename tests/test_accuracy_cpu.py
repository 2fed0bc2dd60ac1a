"""estimate(device="cpu") against measure(device="cpu"), byte for byte, per model family.

``measure`` reads every allocation and free of the real CPU allocator from the
profiler; the estimate must give the same forward, backward and step peaks.
Where exactness is impossible, ``TOLERANCES`` says by how much and why.
"""

from __future__ import annotations

import pytest
import torch

import pytest_torchmem as tm
from zoo import CASES, Case

#: case name -> (allowed absolute error in bytes, reason). Empty: every case is exact.
TOLERANCES: dict[str, tuple[int, str]] = {}


def _peaks(report: tm.MemoryReport) -> tuple[int, int, int]:
    return report.forward_peak, report.backward_peak, report.step_peak


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_estimate_equals_measure(case: Case) -> None:
    model, inputs = case.make()
    estimated = tm.estimate(model, inputs, **case.options)
    measured = tm.measure(model, inputs, **case.options)
    assert estimated.unsupported == ()
    tolerance, _reason = TOLERANCES.get(case.name, (0, ""))
    if tolerance == 0:
        assert _peaks(estimated) == _peaks(measured)
    else:
        for est, real in zip(_peaks(estimated), _peaks(measured)):
            assert abs(est - real) <= tolerance


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_breakdown_of_lasting_roles_matches(case: Case) -> None:
    """Parameters, buffers, inputs, gradients and optimizer state at the peak agree too."""
    if case.name in TOLERANCES:
        pytest.skip(TOLERANCES[case.name][1])
    model, inputs = case.make()
    estimated = tm.estimate(model, inputs, **case.options)
    measured = tm.measure(model, inputs, **case.options)
    lasting = (
        tm.Category.PARAMETERS,
        tm.Category.BUFFERS,
        tm.Category.INPUTS,
        tm.Category.GRADIENTS,
        tm.Category.OPTIMIZER_STATE,
    )
    assert {c: estimated.breakdown[c] for c in lasting} == {c: measured.breakdown[c] for c in lasting}
    assert sum(estimated.breakdown.values()) == estimated.peak
    assert sum(measured.breakdown.values()) == measured.peak


