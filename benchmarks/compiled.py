"""How long the estimate of a compiled model takes, beside the real first compiled step.

    python benchmarks/compiled.py [--layers N] [--batch B] [--length T] [--check] [--profile]

On a GPT-2-small-shaped model (``benchmarks/gpt2.py``: 12 layers, width 768,
vocab 50257; a small batch: 1 x 128 tokens by default) compiled with
``torch.compile`` it times, each in a fresh process and in one run:

* ``real first step`` -- what a user waits for before a compiled model has
  run once: ``torch.compile(model)``, then one forward and backward on CPU,
  with inductor's cache cold (``TORCHINDUCTOR_CACHE_DIR`` a fresh temporary
  directory): dynamo, AOTAutograd, inductor and the C++ compiler;
* ``estimate cpu`` -- ``pytest_torchmem.estimate(torch.compile(model), tokens,
  device="cpu")``: the same program built by inductor with no kernel compiled,
  in an untracked fake warm-up, then traced (the model on the meta device);
* ``estimate cuda`` -- the same on the fake cuda device: inductor's cuda
  program (its triton scheduling) built without a GPU.

Each process's clocks start after ``import torch`` and the model's
construction (the real step's parameters are initialised, the estimate's are
on the meta device), so the times hold dynamo's and inductor's imports, which
both pay. Two clocks: wall-clock seconds, and CPU seconds of the process and
its children (inductor's compile workers, the C++ compiler, its ISA probes),
which the load of a busy machine barely disturbs. The ratio ``estimate / real
first step`` on CPU seconds is the target (``--check`` exits 1 above 0.5). ``--profile`` adds where the cpu estimate's time goes:
inductor's import, the warm-up that builds the program (dynamo, AOTAutograd,
lowering, scheduling, the wrapper) and the traced step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET = 0.5


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have exited."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _child(kind: str, layers: int, batch: int, length: int, profile: bool) -> dict[str, float]:
    """Run one contender in this (fresh) process; its times in seconds."""
    import torch

    sys.path.insert(0, str(HERE))
    from gpt2 import GPT2Config, build

    torch.manual_seed(0)
    cfg = GPT2Config(layers=layers)
    tokens = torch.randint(0, cfg.vocab, (batch, length))
    times: dict[str, float] = {}
    if kind == "real":
        model = build(cfg, device="cpu")
        start, cpu = time.perf_counter(), _cpu_seconds()
        compiled = torch.compile(model)
        compiled(tokens).sum().backward()
        times["total"] = time.perf_counter() - start
        # the compile workers' CPU time is counted once they have exited
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
        times["cpu"] = _cpu_seconds() - cpu
        return times
    model = build(cfg, device="meta")
    start, cpu = time.perf_counter(), _cpu_seconds()
    import torch._inductor.compile_fx  # noqa: F401  (inductor's import, timed on its own)

    import pytest_torchmem as tm

    times["import"] = time.perf_counter() - start
    device = "cuda" if kind == "estimate cuda" else "cpu"
    options = {"cpu": "host"} if device == "cpu" else {}
    if profile:
        _profiled_estimate(tm, model, tokens, device, options, times)
    else:
        report = tm.estimate(torch.compile(model), tokens, device=device, **options)
        assert not [u for u in report.unsupported if u.op.startswith("torch.compile: ")], report.unsupported
    times["total"] = time.perf_counter() - start
    times["cpu"] = _cpu_seconds() - cpu
    return times


def _profiled_estimate(tm: object, model: object, tokens: object, device: str, options: dict, times: dict) -> None:
    """The estimate with the warm-up (which builds the program) timed apart."""
    import torch

    from pytest_torchmem.engine.tracing import trace as trace_module

    real = trace_module._warm_up

    def warm_up(*args: object, **kwargs: object) -> object:
        begin = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            times["warm-up (build the program)"] = time.perf_counter() - begin

    trace_module._warm_up = warm_up
    begin = time.perf_counter()
    try:
        tm.estimate(torch.compile(model), tokens, device=device, **options)  # type: ignore[attr-defined]
    finally:
        trace_module._warm_up = real
    times["estimate"] = time.perf_counter() - begin
    times["traced step"] = times["estimate"] - times["warm-up (build the program)"]


def _run(kind: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="torchmem-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        command = [
            sys.executable, __file__, "--child", kind,
            "--layers", str(args.layers), "--batch", str(args.batch), "--length", str(args.length),
        ]
        if args.profile:
            command.append("--profile")
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{kind} failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", choices=["real", "estimate cpu", "estimate cuda"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.layers, args.batch, args.length, args.profile)))
        return 0
    results = {kind: _run(kind, args) for kind in ("real", "estimate cpu", "estimate cuda")}
    real, real_cpu = results["real"]["total"], results["real"]["cpu"]
    print(f"GPT-2-small-shaped, {args.layers} layers, batch {args.batch} x {args.length} tokens, compiled")
    print(f"{'contender':<30}{'wall s':>9}{'/ real':>8}{'CPU s':>9}{'/ real':>8}")
    for kind, label in (("real", "real first step"), ("estimate cpu", "estimate cpu"), ("estimate cuda", "estimate cuda")):
        wall, cpu = results[kind]["total"], results[kind]["cpu"]
        print(f"{label:<30}{wall:>9.1f}{wall / real:>8.2f}{cpu:>9.1f}{cpu / real_cpu:>8.2f}")
        for part, seconds in results[kind].items():
            if part not in ("total", "cpu"):
                print(f"  {part:<28}{seconds:>9.1f}")
    missed = any(results[kind]["cpu"] / real_cpu > TARGET for kind in ("estimate cpu", "estimate cuda"))
    if args.check and missed:
        print(f"target missed: estimate / real first step <= {TARGET}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
