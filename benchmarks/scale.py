"""How ``estimate`` copes with large models: Llama 2 7B and 70B shapes on the fake cuda device.

    python benchmarks/scale.py                       # 7b training step and 70b forward
    python benchmarks/scale.py --model 7b --repeat 3 # medians of three fresh processes
    python benchmarks/scale.py --device cpu --check  # the fake cpu device; exit 1 on a miss

The model is ``benchmarks/llama.py``, built on the meta device in bfloat16,
fed ``--batch`` x ``--seq`` tokens (its labels are the tokens, shifted inside
the model). The cases:

* ``7b``: one training step -- forward, cross-entropy, backward,
  ``torch.optim.AdamW`` step (the first, which creates its state) and
  ``zero_grad``. Target: at most 60 s and 4 GiB peak RSS;
* ``70b``: the forward alone, tokens to logits (``train=False``, no labels).
  Target: it runs;
* ``70b-fsdp64``: one rank of FSDP2 over 64 fake ranks (``fully_shard`` per
  decoder layer and root; float32 shards, bfloat16 compute, float32
  reduce-scatter), one training step with AdamW. Target: at most 60 s and
  4 GiB peak RSS.

Each estimate runs in a fresh Python process, so that its peak RSS
(``ru_maxrss``) is its own; that process also reads its RSS after importing
torch and pytest_torchmem and after building the model, so the share of the
estimate itself is the difference. Wall and CPU time are of the ``estimate``
call alone (a fresh process: nothing is warm). With ``--repeat R`` each case
runs in R processes; the table shows the median times and the largest RSS.
The figures (peaks, breakdown) must come out the same every time.

Under the table, the breakdown at the peak of each case sits beside the
bytes its parameters, gradients and optimizer state must take, counted by
hand from the configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_RESULT: Final = "scale-result: "
GiB: Final = 2**30

#: case -> (train, optimizer, seconds target or None, peak RSS target or None)
CASES: Final[dict[str, tuple[bool, bool, float | None, int | None]]] = {
    "7b": (True, True, 60.0, 4 * GiB),
    "70b": (False, False, None, None),
    "70b-fsdp64": (True, True, 60.0, 4 * GiB),
}
#: cases that are one rank of FSDP2 over this many fake ranks
FSDP_WORLD: Final = {"70b-fsdp64": 64}


def fsdp2_mixed_precision(model: Any, mesh: Any) -> Any:
    """FSDP2 per decoder layer and root: float32 shards, bfloat16 compute, float32 reduce."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _rss_now() -> int:
    """The process's resident set now, in bytes (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        return _rss_peak()


def _rss_peak() -> int:
    """``ru_maxrss`` in bytes (kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def child(model_name: str, device: str, seq: int, batch: int) -> dict[str, Any]:
    """One estimate in this process: its report, times and RSS figures."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from benchmarks.llama import CONFIGS, build, parameter_count
    from pytest_torchmem.engine import api

    rss_import = _rss_now()
    import pytest_torchmem as tm

    train, with_optimizer, _, _ = CASES[model_name]
    world = FSDP_WORLD.get(model_name)
    cfg = CONFIGS[model_name.split("-")[0]]
    model = build(cfg, dtype=torch.bfloat16 if world is None else torch.float32)
    parallel = None if world is None else tm.Parallel(mesh={"dp": world}, apply=fsdp2_mixed_precision)
    tokens = torch.randint(0, cfg.vocab, (batch, seq))
    rss_model = _rss_now()

    optimizer = (lambda params: torch.optim.AdamW(params, lr=1e-4)) if with_optimizer else None
    wall, cpu = time.perf_counter(), time.process_time()
    inputs = (tokens, tokens) if train else tokens  # labels: the tokens, shifted in the model
    report = api.estimate(model, inputs, device=device, optimizer=optimizer, train=train, parallel=parallel)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "report": report.to_dict(),
        "params": parameter_count(cfg),
        "world": world,
        "wall": wall,
        "cpu": cpu,
        "rss_import": rss_import,
        "rss_model": rss_model,
        "rss_peak": _rss_peak(),
    }


def run_child(model_name: str, device: str, seq: int, batch: int) -> dict[str, Any]:
    """:func:`child` in a fresh interpreter."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        model_name,
        "--device",
        device,
        "--seq",
        str(seq),
        "--batch",
        str(batch),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
    raise RuntimeError(
        f"the {model_name} estimate exited {done.returncode} without a result:\n{done.stderr[-4000:]}"
    )


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GiB:,.2f}"


def _hand_count(model_name: str, params: int, report: dict[str, Any]) -> list[list[str]]:
    """The breakdown at the peak beside what the configuration says it must hold.

    bfloat16 parameters take 2 bytes each, as do their gradients; AdamW keeps
    ``exp_avg`` and ``exp_avg_sq`` in the parameters' dtype (its ``step``
    counters stay on the host on cuda, 4-byte tensors on cpu).
    """
    train, with_optimizer, _, _ = CASES[model_name]
    world = FSDP_WORLD.get(model_name)
    # one FSDP2 rank holds 1/world of float32 shards, gradients and state (bytes as
    # requested: the caching allocator rounds each shard's block up, see the test)
    weights = 2 * params if world is None else 4 * params // world
    expected = {"parameters": weights}
    if train and with_optimizer and report["step_peak"] == report["peak"]:
        expected.update(gradients=weights, optimizer_state=2 * weights)
    rows = []
    for category, nbytes in report["breakdown"].items():
        hand = expected.get(category)
        rows.append(
            [
                model_name,
                category,
                _gib(nbytes),
                "" if hand is None else _gib(hand),
                "" if hand is None else f"{nbytes - hand:+,d} B",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=(*CASES, "all"), default="all")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="the fake device estimated (default cuda)",
    )
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="fresh processes per case")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--child", choices=tuple(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        result = child(args.child, args.device, args.seq, args.batch)
        print(_RESULT + json.dumps(result), flush=True)
        return 0

    from tabulate import tabulate

    names = list(CASES) if args.model == "all" else [args.model]
    print(
        f"Llama-shaped models on the fake {args.device} device, bfloat16, built on meta; "
        f"batch {args.batch} x {args.seq} tokens; {os.cpu_count()} cores; "
        f"load {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    figures, costs, hand, notes = [], [], [], []
    missed = []
    for name in names:
        train, with_optimizer, seconds_target, rss_target = CASES[name]
        runs = [run_child(name, args.device, args.seq, args.batch) for _ in range(args.repeat)]
        report = runs[0]["report"]
        if any(run["report"] != report for run in runs[1:]):
            raise RuntimeError(f"the {name} estimate differs between runs")
        what = "train step, AdamW" if with_optimizer else ("train step" if train else "forward")
        label = f"{name} {what}"
        figures.append(
            [
                label,
                f"{runs[0]['params'] / 1e9:.2f} B",
                _gib(report["forward_peak"]),
                _gib(report["backward_peak"]),
                _gib(report["step_peak"]),
                _gib(report["reserved_peak"]),
                len(report["unsupported"]),
            ]
        )
        wall = statistics.median(run["wall"] for run in runs)
        cpu = statistics.median(run["cpu"] for run in runs)
        rss = max(run["rss_peak"] for run in runs)
        rss_import = max(run["rss_import"] for run in runs)
        rss_model = max(run["rss_model"] for run in runs)
        verdict = "runs"
        if args.device == "cuda" and seconds_target is not None and rss_target is not None:
            ok = wall <= seconds_target and rss <= rss_target
            verdict = "ok" if ok else "MISSED"
            if not ok:
                missed.append(name)
            target = f"<= {seconds_target:.0f} s, <= {rss_target / GiB:.0f} GiB"
        else:
            target = "runs" if args.device == "cuda" else "-"
        costs.append(
            [
                label,
                f"{wall:.1f}",
                f"{cpu:.1f}",
                f"{rss_import / 2**20:,.0f}",
                f"{rss_model / 2**20:,.0f}",
                f"{rss / 2**20:,.0f}",
                f"{(rss - rss_model) / 2**20:+,.0f}",
                target,
                verdict,
            ]
        )
        hand.extend(_hand_count(name, runs[0]["params"], report))
        notes.extend(f"{name}: {u['op']}: {u['reason']}" for u in report["unsupported"])

    print()
    print(
        tabulate(
            figures,
            headers=[
                "case",
                "params",
                "forward GiB",
                "backward GiB",
                "step GiB",
                "reserved GiB",
                "unsupported",
            ],
        )
    )
    print()
    print(
        tabulate(
            costs,
            headers=[
                "case",
                "wall s",
                "CPU s",
                "RSS import MiB",
                "RSS model MiB",
                "peak RSS MiB",
                "estimate's RSS MiB",
                "target",
                "verdict",
            ],
        )
    )
    print("\nbreakdown at the peak, beside the bytes counted by hand from the configuration:")
    print(tabulate(hand, headers=["case", "category", "estimate GiB", "by hand GiB", "difference"]))
    if notes:
        print("\nunsupported:")
        for note in notes:
            print(f"  {note}")
    if missed:
        print(f"\nmissed: {', '.join(missed)}")
        return 1 if args.check else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
