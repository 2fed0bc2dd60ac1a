"""The loop's peak beside the first step's, for the public-model zoo.

    python benchmarks/loop_peaks.py [--device cpu|cuda|both] [case ...]

For each model of ``tests/test_public_models.py`` (transformers' and
torchvision's, small configurations, and peft's LoRA and DoRA adapters on some
of them; a tokenizer-style batch, AdamW) it prints,
per device (``cpu`` under the fixed profile ``avx2:4``, ``cuda`` as the default
H100 profile), from one ``estimate(model, batch, optimizer=AdamW)``:

* ``first step``: the peak of the loop's first iteration, whose
  ``optimizer.step()`` creates AdamW's state (``report.first_step``);
* the loop's forward, backward and step peaks, from its second iteration on,
  with the state alive through forward and backward (``report.forward_peak``,
  ``backward_peak``, ``step_peak``) and their largest, ``loop peak``: what
  ``torch.cuda.max_memory_allocated()`` reads after a few iterations;
* how much higher the loop's peak is than the first step's, in bytes and in
  per cent of the first step's peak. It is 0 where the first step's peak is its
  optimizer step, whose state and temporaries outweigh what the state adds to a
  later backward; positive where activations and gradients do. With peft's
  adapters the frozen weights have neither gradients nor state: the first
  step's peak is its backward, and the loop's is higher by AdamW's state of the
  adapters (on cpu by exactly that; on cuda by about that, as blocks are
  reused otherwise once the state holds some). On cuda the two
  32 MiB cuBLAS workspaces (the forward's thread's and autograd's) are in both
  peaks, so these small models' percentages there are small.

The figures are estimates (no GPU is needed for ``cuda``); on cpu the estimate
equals ``measure`` (``tests/test_public_models.py`` checks it on this host). A
model whose estimate lists something in ``unsupported`` is marked ``*``; one
whose library (torchvision, peft) is not installed is left out, and named.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import pytest
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# before transformers imports torchvision (see tests/torchvision_import.py)
from torchvision_import import import_torchvision  # noqa: E402

import_torchvision()

from test_public_models import CASES, _adamw, _made  # noqa: E402

import pytest_torchmem as tm  # noqa: E402

DEVICES = {"cpu": {"cpu": "avx2:4"}, "cuda": {}}


def row(case: str, device: str) -> list[object]:
    """One line of the table: the case's first step and loop on ``device``."""
    model, batch = _made(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = tm.estimate(model, batch, optimizer=_adamw, device=device, **DEVICES[device])
    assert report.first_step is not None
    first = report.first_step.peak
    loop = max(report.forward_peak, report.backward_peak, report.step_peak)
    more = loop - first
    name = case + (" *" if report.unsupported else "")
    return [
        name,
        device,
        tm.format_bytes(first),
        tm.format_bytes(report.forward_peak),
        tm.format_bytes(report.backward_peak),
        tm.format_bytes(report.step_peak),
        tm.format_bytes(loop),
        f"{more:,}",
        f"{100 * more / first:.1f}%",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help="cases of tests/test_public_models.py (default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda", "both"], default="both")
    args = parser.parse_args(argv)
    unknown = [case for case in args.cases if case not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    devices = ["cpu", "cuda"] if args.device == "both" else [args.device]
    rows = []
    for case in args.cases or CASES:
        try:
            rows += [row(case, device) for device in devices]
        except pytest.skip.Exception as skipped:  # its library is not installed
            print(f"{case}: left out ({skipped.msg})", file=sys.stderr)
    headers = ["model", "device", "first step", "loop fwd", "loop bwd", "loop step", "loop peak",
               "loop - first (B)", "loop - first"]
    print(tabulate(rows, headers=headers, colalign=("left", "left", *["right"] * 7)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
