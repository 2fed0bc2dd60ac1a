"""The estimate's time per model family and training configuration (issue 54), replay on and off.

    python benchmarks/same_program.py [--layers N] [--repeats R] [--device cpu|cuda] [--family NAME ...]

Over the matrix of ``tests/model_matrix.py`` (tiny public model families in the
configurations users train with), each case's built-in step (forward, loss,
backward) is estimated ``--repeats`` times with block replay on and off
(``TORCHMEM_REPLAY``), round by round in one process (a machine's changing load
hits both alike); the table gives the CPU-time medians, their ratio, the figures'
equality and what replay did. ``--layers`` (default 6: block replay replays six or
more repeated blocks) sets each stack's depth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from torchvision_import import import_torchvision  # noqa: E402

import_torchvision()

import pytest_torchmem as tm  # noqa: E402
from model_matrix import CONFIGURATIONS, FAMILIES, cases, loss_of, made  # noqa: E402


def _estimate(model: Any, arguments: Any, device: str, replay: bool) -> tuple[float, Any]:
    os.environ["TORCHMEM_REPLAY"] = "1" if replay else "0"
    start = time.process_time()
    report = tm.estimate(model, arguments, loss_fn=loss_of, device=device)
    return time.process_time() - start, report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--family", action="append", help="only these families (repeatable)")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for family, configuration in cases():
        if options.family and family not in options.family:
            continue
        if CONFIGURATIONS[configuration].autocast or not FAMILIES[family].depth:
            continue  # (the built-in step runs no autocast; torchvision's ResNet has no depth)
        model, batch, _ = made(family, configuration, options.layers)
        arguments = batch["pixel_values"] if FAMILIES[family].kind == "torchvision" else batch
        times: dict[bool, list[float]] = {True: [], False: []}
        reports: dict[bool, Any] = {}
        try:
            for _ in range(options.repeats):
                for replay in (True, False):
                    seconds, reports[replay] = _estimate(model, arguments, options.device, replay)
                    times[replay].append(seconds)
        except Exception as exc:  # noqa: BLE001 - the table says what stopped
            rows.append((family, configuration, "-", "-", "-", "-", str(exc).splitlines()[0][:60]))
            continue
        on, off = statistics.median(times[True]), statistics.median(times[False])
        same = reports[True].phase_peaks() == reports[False].phase_peaks()
        did = "; ".join(line.partition(": ")[2] for line in reports[True].replayed)[:60]
        rows.append((family, configuration, f"{on:.2f}", f"{off:.2f}", f"{on / off:.2f}", "yes" if same else "NO", did))
    print(tabulate(rows, headers=("family", "configuration", "replay on (s)", "off (s)", "on/off", "same figures", "replay")))
    return 0 if all(row[5] in ("yes", "-") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
