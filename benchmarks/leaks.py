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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

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
    return 1 if args.check and ratio > TARGET else 0


if __name__ == "__main__":
    sys.exit(main())
