"""The accuracy table: estimate(device="cpu") against measure(device="cpu") for the model zoo.

    python benchmarks/accuracy.py [case ...]

Prints, per model family and phase, the estimate, the measurement and the error.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import pytest_torchmem as tm  # noqa: E402
from zoo import CASES  # noqa: E402


def main(names: list[str]) -> int:
    warnings.filterwarnings("ignore")
    rows = []
    exact = 0
    cases = [case for case in CASES if not names or case.name in names]
    for case in cases:
        model, inputs = case.make()
        start = time.perf_counter()
        est = tm.estimate(model, inputs, **case.options)
        seconds = time.perf_counter() - start
        real = tm.measure(model, inputs, **case.options)
        same = est.phase_peaks() == real.phase_peaks()
        exact += same
        for phase in ("forward", "backward", "step"):
            e, r = est.phase_peaks()[phase], real.phase_peaks()[phase]
            if e == r == 0:
                continue
            error = (e - r) / r if r else float("inf")
            rows.append([case.name, phase, e, r, e - r, f"{error:+.3%}", f"{seconds:.2f}"])
        if est.unsupported:
            rows.append([case.name, "unsupported", "; ".join(map(str, est.unsupported)), "", "", "", ""])
    print(tabulate(rows, headers=["model", "phase", "estimate B", "measured B", "error B", "error", "estimate s"]))
    print(f"\n{exact}/{len(cases)} model families exact in every phase")
    return 0 if exact == len(cases) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
