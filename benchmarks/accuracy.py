"""The accuracy table: estimate against measure for the model zoo (tests/zoo.py).

    python benchmarks/accuracy.py [case ...]                 # CPU: profiler allocator events
    python benchmarks/accuracy.py --device cuda [case ...]   # GPU: torch.cuda peak statistics
    python benchmarks/accuracy.py --profiles                 # every CPU level here x 1, 2, 4 threads

Prints, per model family and phase, the estimate, the measurement and the
error; ``--device cuda`` needs a GPU and names its profile with ``--gpu``
(default: the profile whose name appears in the device's name, else H100).
``--profiles`` prints one line per CPU profile this host can run (each level up
to the host's, capped with ``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA``/``MKL_ENABLE_INSTRUCTIONS``, at 1,
2 and 4 intra-op threads): the families exact in every phase, those whose
estimate lists ``unsupported`` (not compared: a level's natively computed
bfloat16/float16 kernels), and the worst error of the others, the ground truth
measured in a capped process (``tests/profiled.py``). Exits 1 unless every
case is exact or flagged (cpu) or within ``--rtol`` (cuda).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from zoo import CASES  # noqa: E402

import pytest_torchmem as tm  # noqa: E402
from pytest_torchmem.engine.tracing.devices.cuda.profiles import PROFILES  # noqa: E402


def _gpu_name(requested: str | None) -> str | None:
    if requested or not torch.cuda.is_available():
        return requested
    device_name = torch.cuda.get_device_name().replace(" ", "").upper()
    for name in sorted(PROFILES, key=len, reverse=True):
        if name.replace("-", "").upper() in device_name:
            return name
    return None


def _profiles(cases: list) -> int:
    from profiled import as_measured_here, measure_zoo, reachable

    from pytest_torchmem.engine.tracing.devices.cpu.profiles import ISA_LEVELS, CpuProfile

    rows = []
    failed = 0
    for level in ISA_LEVELS:
        for threads in (1, 2, 4):
            profile = CpuProfile(level, threads)
            if not reachable(profile):
                rows.append([str(profile), "-", "-", "-", "not reachable on this host"])
                continue
            here = as_measured_here(profile)
            measured = measure_zoo(here, [case.name for case in cases])
            exact, flagged, worst, worst_case = 0, [], 0.0, ""
            for case in cases:
                model, inputs = case.make()
                report = tm.estimate(model, inputs, cpu=here, **case.options)
                if report.unsupported:  # said in the report: not counted as a silent miss
                    flagged.append(case.name)
                    continue
                est, real = report.phase_peaks(), measured[case.name]
                errors = [abs(est[p] - real[p]) / real[p] for p in real if real[p] and est[p] != real[p]]
                exact += not errors
                if errors and max(errors) > worst:
                    worst, worst_case = max(errors), case.name
            failed += exact + len(flagged) != len(cases)
            rows.append([
                str(profile), f"{exact}/{len(cases)}", ", ".join(flagged) or "-", f"{worst:.3%}", worst_case,
            ])
    print(tabulate(rows, headers=["profile", "exact families", "flagged", "worst unflagged error", "worst family"]))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="zoo case names (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpu", default=None, help="GPU profile for --device cuda")
    parser.add_argument("--rtol", type=float, default=0.01, help="allowed error on cuda (default 1%%)")
    parser.add_argument(
        "--profiles", action="store_true", help="one line per CPU level and thread count (capped processes)"
    )
    options = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if options.profiles:
        return _profiles([case for case in CASES if not options.cases or case.name in options.cases])
    gpu = _gpu_name(options.gpu) if options.device == "cuda" else None
    rows = []
    good = 0
    cases = [case for case in CASES if not options.cases or case.name in options.cases]
    for case in cases:
        model, inputs = case.make()
        start = time.perf_counter()
        est = tm.estimate(model, inputs, device=options.device, gpu=gpu, **case.options)
        seconds = time.perf_counter() - start
        real = tm.measure(model, inputs, device=options.device, **case.options)
        worst = 0.0
        for phase in ("forward", "backward", "step"):
            e, r = est.phase_peaks()[phase], real.phase_peaks()[phase]
            if e == r == 0:
                continue
            error = (e - r) / r if r else float("inf")
            worst = max(worst, abs(error))
            rows.append([case.name, phase, e, r, e - r, f"{error:+.3%}", f"{seconds:.2f}"])
        if options.device == "cuda":
            rows.append([case.name, "reserved", est.reserved_peak, real.reserved_peak, "", "", ""])
        if est.unsupported:
            rows.append([case.name, "unsupported", "; ".join(map(str, est.unsupported)), "", "", "", ""])
        exact = est.phase_peaks() == real.phase_peaks()
        good += exact if options.device == "cpu" else worst <= options.rtol
    headers = ["model", "phase", "estimate B", "measured B", "error B", "error", "estimate s"]
    print(tabulate(rows, headers=headers))
    what = "exact in every phase" if options.device == "cpu" else f"within {options.rtol:.1%}"
    print(f"\n{good}/{len(cases)} model families {what} on {options.device}" + (f" ({gpu})" if gpu else ""))
    return 0 if good == len(cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
