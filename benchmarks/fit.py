"""What ``tm.fit`` costs, in estimates' time.

    python benchmarks/fit.py [--gpu A100-40GB] [--repeats R] [--check]

On a GPT-2-small-shaped model (``benchmarks/gpt2.py``, built on the meta device,
AdamW) with a context of 1024 tokens, it times, interleaved round by round (so that
a machine's changing load hits both alike):

* ``estimate`` -- one ``tm.estimate`` of the step at batch 8 on the fake cuda device;
* ``fit``      -- ``tm.fit`` over batch 1 to 4096 against the GPU's usable memory;

and, for a sequence length (eager attention's L x L scores, a figure that bends up),
``fit`` over lengths 16 to 4096 of a one-layer model. The table gives each fit's
cost in estimates' time (its CPU time over the median estimate's) and the number
of estimates it made; ``--check`` exits 1 when the batch search costs more than 12
estimates' time (issue 26). CPU time is what is compared: the estimate runs on one
thread, and other processes on a busy machine barely move it.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Final

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2 import GPT2Config, build  # noqa: E402

import pytest_torchmem as tm  # noqa: E402

#: The batch search over 1 to 4096 may cost at most this many estimates' time.
TARGET: Final = 12.0


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class _EagerAttention(nn.Module):
    """One layer of attention written out: its scores are length x length."""

    def __init__(self, width: int = 768, heads: int = 12) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        scores = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(c // self.heads), dim=-1)
        return self.proj((scores @ v).transpose(1, 2).reshape(b, t, c))


def _timed(call: Any) -> tuple[float, Any]:
    gc.collect()
    start = time.process_time()
    result = call()
    return time.process_time() - start, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="A100-40GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)

    cfg = GPT2Config()
    model = build(cfg)  # meta

    def tokens(batch: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab, (batch, cfg.context), device="meta")

    with torch.device("meta"):
        attention = _EagerAttention()

    def states(length: int) -> torch.Tensor:
        return torch.randn(1, length, 768, device="meta")

    def one_estimate() -> Any:
        return tm.estimate(model, tokens(8), device="cuda", gpu=args.gpu, optimizer=_adamw)

    def batch_fit() -> Any:
        return tm.fit(model, tokens, gpu=args.gpu, optimizer=_adamw, size_name="batch")

    def length_fit() -> Any:
        return tm.fit(attention, states, sizes=range(16, 4097), budget="2 GiB", optimizer=_adamw, size_name="length")

    def attention_estimate() -> Any:
        return tm.estimate(attention, states(1024), device="cuda", gpu=args.gpu, optimizer=_adamw)

    one_estimate(), attention_estimate()  # warm FakeTensorMode's caches alike for all
    estimates: list[float] = []
    attention_estimates: list[float] = []
    fits: list[float] = []
    length_fits: list[float] = []
    found = length_found = None
    for _ in range(args.repeats):
        estimates.append(_timed(one_estimate)[0])
        seconds, found = _timed(batch_fit)
        fits.append(seconds)
        attention_estimates.append(_timed(attention_estimate)[0])
        seconds, length_found = _timed(length_fit)
        length_fits.append(seconds)
    assert found is not None and length_found is not None
    estimate_s, attention_s = statistics.median(estimates), statistics.median(attention_estimates)
    batch_ratio = statistics.median(fits) / estimate_s
    length_ratio = statistics.median(length_fits) / attention_s
    rows = [
        ["GPT-2 small, batch 1-4096", str(found), len(found.probes), f"{statistics.median(fits):.2f}", f"{batch_ratio:.2f}"],
        ["attention, length 16-4096", str(length_found), len(length_found.probes), f"{statistics.median(length_fits):.2f}", f"{length_ratio:.2f}"],
    ]
    print(f"one estimate: GPT-2 small batch 8 {estimate_s:.2f} CPU s; attention length 1024 {attention_s:.2f} CPU s")
    print(tabulate(rows, headers=["search", "found", "estimates", "CPU s", "in estimates' time"]))
    if args.check and batch_ratio > TARGET:
        print(f"FAILED: the batch search cost {batch_ratio:.2f} estimates' time (target {TARGET})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
