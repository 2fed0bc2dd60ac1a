"""What a leak check costs, beside one estimate of the same step.

    python benchmarks/leaks.py [--model 1b|tiny] [--device cuda|cpu] [--repeats R] [--check]

A leak check (``tm.leaks``) traces the step as a loop runs it, 4 iterations on the
same objects (8 where 4 show no steady state), and then looks for what holds the
growth. This times, in one process and interleaved round by round (so that a
machine's changing load hits both alike):

* ``estimate`` -- ``tm.estimate`` of one training step (forward, cross-entropy,
  backward, AdamW's step) of a Llama-architecture model (``benchmarks/llama.py``;
  ``1b``: width 2048, 16 layers, 16 heads sharing 8 key/value heads, MLP 8192,
  vocabulary 32000, 1.14 B parameters in bfloat16, built on the meta device),
  on 1 x 512 tokens;
* ``leaks`` -- ``tm.leaks`` of the same step: 4 iterations.

The table shows medians of ``--repeats`` rounds (after a warm-up round) in
process CPU time and wall time, and the ratios: the leak check against one
estimate, and per iteration. ``--check`` exits 1 when the leak check takes more
than 5 estimates' time (the target: within a few estimates; an iteration costs
about an estimate, and the first one, which makes AdamW's state, a little more).

Then a leak: a 12-block model whose blocks each keep their output (width 256, batch
64, float32, AdamW, cpu), ``tm.leaks`` estimated and measured (``measure=True``, the
same loop run for real) side by side: their times, and their growth per iteration,
which must be equal (``--check`` exits 1 where it is not, or where the estimate takes
more than the measurement).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama  # noqa: E402

import pytest_torchmem as tm  # noqa: E402

CONFIGS = {
    "1b": llama.LlamaConfig(dim=2048, layers=16, heads=16, kv_heads=8, ffn=8192, vocab=32000),
    "tiny": llama.CONFIGS["tiny"],
}
#: leaks / estimate: at most this many estimates' time
TARGET = 5.0


def _adamw(params):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=1e-4)


def _timed(call) -> tuple[float, float, object]:  # type: ignore[no-untyped-def]
    cpu, wall = time.process_time(), time.perf_counter()
    out = call()
    return time.process_time() - cpu, time.perf_counter() - wall, out


class _Keeps(nn.Module):
    """A block that keeps its output, every call: a leak of one activation per block and
    iteration."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        self.kept.append(y)
        return y


def keeping_leak(repeats: int) -> tuple[list[list[str]], bool]:
    """The leak's rows (see the module), and whether the estimate holds up."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Keeps(256) for _ in range(12)))
    x = torch.randn(64, 256)
    times: dict[str, list[float]] = {"estimated": [], "measured": []}
    reports = {}
    for round_ in range(repeats + 1):
        for name, measured in (("estimated", False), ("measured", True)):
            cpu, _, reports[name] = _timed(lambda measured=measured: tm.leaks(model, x, optimizer=_adamw,
                                                                              measure=measured))
            if round_:
                times[name].append(cpu)
    est, meas = (statistics.median(times[name]) for name in ("estimated", "measured"))
    same = reports["estimated"].per_iteration == reports["measured"].per_iteration  # type: ignore[attr-defined]
    rows = [
        ["leaks, estimated (CPU s)", f"{est:.2f}", tm.format_bytes(reports["estimated"].per_iteration)],  # type: ignore[attr-defined]
        ["leaks, measured (CPU s)", f"{meas:.2f}", tm.format_bytes(reports["measured"].per_iteration)],  # type: ignore[attr-defined]
        ["estimated / measured", f"{est / meas:.2f}", "equal" if same else "DIFFERENT"],
    ]
    return rows, same and est <= meas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="1b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)

    cfg = CONFIGS[args.model]
    model = llama.build(cfg)
    tokens = torch.randint(0, cfg.vocab, (1, args.seq), device="meta")
    inputs = (tokens, tokens)  # labels: the tokens, shifted in the model
    print(f"{args.model}: {llama.parameter_count(cfg) / 1e9:.2f} B parameters, 1 x {args.seq} tokens, {args.device}")

    def estimate() -> object:
        return tm.estimate(model, inputs, device=args.device, optimizer=_adamw)

    def leaks() -> object:
        return tm.leaks(model, inputs, device=args.device, optimizer=_adamw)

    times: dict[str, list[tuple[float, float]]] = {"estimate": [], "leaks": []}
    report = None
    for round_ in range(args.repeats + 1):
        for name, call in (("estimate", estimate), ("leaks", leaks)):
            cpu, wall, out = _timed(call)
            if name == "leaks":
                report = out
            if round_:  # (the first round warms up)
                times[name].append((cpu, wall))
    assert report is not None
    med = {name: (statistics.median(c for c, _ in t), statistics.median(w for _, w in t)) for name, t in times.items()}
    iterations = report.iterations  # type: ignore[attr-defined]
    print(
        tabulate(
            [[name, f"{cpu:.2f}", f"{wall:.2f}"] for name, (cpu, wall) in med.items()],
            headers=["contender", "CPU s (median)", "wall s (median)"],
        )
    )
    ratio = med["leaks"][0] / med["estimate"][0]
    print()
    print(
        tabulate(
            [
                ["leaks / estimate", f"{ratio:.2f}", f"{med['leaks'][1] / med['estimate'][1]:.2f}", f"<= {TARGET}",
                 "ok" if ratio <= TARGET else "MISSED"],
                [f"leaks / estimate, per iteration ({iterations})", f"{ratio / iterations:.2f}",
                 f"{med['leaks'][1] / med['estimate'][1] / iterations:.2f}", "", ""],
            ],
            headers=["ratio", "CPU", "wall", "target", "verdict (CPU)"],
        )
    )
    print(f"\nper iteration: {tm.format_bytes(report.per_iteration)} (growth {report.growth})")  # type: ignore[attr-defined]
    rows, holds = keeping_leak(args.repeats)
    print("\na 12-block model keeping every block's output, cpu:")
    print(tabulate(rows, headers=["", "value", "per iteration"]))
    return 1 if args.check and (ratio > TARGET or not holds) else 0


if __name__ == "__main__":
    sys.exit(main())
