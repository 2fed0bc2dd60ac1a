"""The accuracy suite on every CPU level this host can run, at 1, 2 and 4 threads.

The estimate under a named profile (``cpu="default:4"``) is made in this process;
its ground truth is ``measure`` in a process capped to that level and thread count
(``tests/profiled.py``). On an AVX2 host this covers the ``default`` level (a CPU
without AVX: ATen's DEFAULT kernels, oneDNN's SSE4.1 ones) and AVX2; on an AVX512
host, AVX512 too, and on an AMX host the ``avx512_bf16`` and ``amx`` levels, where
the reduced-precision families are flagged, not compared. The host's own level at its own thread counts is covered in
process (at the process's thread count) by ``test_accuracy_cpu.py``.
"""

from __future__ import annotations

import pytest
from exactness import flagged_native, release_gap
from profiled import as_measured_here, every_peak, measure_zoo, reachable
from test_accuracy_cpu import TOLERANCES
from zoo import CASES

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cpu.profiles import ISA_LEVELS, CpuProfile

#: Every level this host can run, at 1 and 4 threads (``test_accuracy_cpu`` runs the
#: host's level at the process's own thread count).
PROFILES = [
    CpuProfile(level, threads)
    for level in ISA_LEVELS
    for threads in (1, 4)
    if reachable(CpuProfile(level, 1))
]


@pytest.mark.parametrize("profile", PROFILES, ids=str)
def test_every_family_is_exact_on_the_level(profile: CpuProfile) -> None:
    here = as_measured_here(profile)
    measured = measure_zoo(here, [case.name for case in CASES])
    wrong = {}
    for case in CASES:
        model, inputs = case.make()
        estimated = tm.estimate(model, inputs, cpu=here, **case.options)
        if flagged_native(estimated):
            continue  # the level computes its dtype natively: said in unsupported
        if release_gap(f"tests/test_accuracy_cpu.py::test_estimate_equals_measure[{case.name}]"):
            # a known gap of this torch release (tests/release_gaps.txt): said in unsupported
            assert estimated.unsupported, f"{case.name}: a listed gap of this release, not flagged"
            continue
        tolerance = TOLERANCES.get(case.name, (0, ""))[0]
        real = measured[case.name]
        estimated_peaks = every_peak(estimated)
        assert estimated_peaks.keys() == real.keys(), case.name
        errors = {phase: estimated_peaks[phase] - real[phase] for phase in real}
        if estimated.unsupported or any(abs(error) > tolerance for error in errors.values()):
            wrong[case.name] = (errors, estimated.unsupported)
    assert wrong == {}
