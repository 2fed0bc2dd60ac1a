"""CI's speed gate (issue 56): the estimates of transformers' Llama-2 shapes are not more
than 25% slower than the figures recorded for this machine's class.

    python benchmarks/gate.py [--repeats R] [--record]

In one process, round by round (a warm-up round first, so that a machine's changing load
hits every contender alike), the CPU time medians of:

* ``7B`` and ``7B no cache``: ``estimate`` of transformers' ``LlamaForCausalLM`` at
  Llama-2 7B's shape (built on meta, bf16, 1 x 4096 tokens, AdamW, the fake cuda device,
  block replay on as by default), with the cache as its config has it and without;
* ``70B`` and ``70B no cache``: its 70B shape, one rank of FSDP2 over 64 fake ranks
  (each decoder layer a unit, bf16 compute);
* ``yardstick``: ``benchmarks/replay.py``'s 24-layer transformer, forward and backward
  under a bare ``FakeTensorMode`` (nothing of this package runs).

Each estimate's figure is its time over the yardstick's: a ratio, which a faster or busier
machine moves little (both are torch's fake dispatch at heart). ``benchmarks/gate.json``
holds the ratios recorded per machine class (architecture, the CPU's level, cores);
where this class has none, the gate compares with the first class recorded, and says so.
It exits 1 where a ratio is more than 1.25 times the recorded one, naming it; ``--record``
writes this class's ratios instead. A quiet machine's ratios still vary by a fifth from
run to run (the 70B rank most): the ratios recorded are the highest of several quiet
runs, so that the gate fails on a change, not on a run's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "gate.json"
#: How much slower than recorded a ratio may be.
SLACK = 1.25
YARDSTICK = "yardstick"


def machine_class() -> str:
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import host_profile

    return f"{platform.machine()} {host_profile().isa} {os.cpu_count()} cores"


def contenders() -> list[Any]:
    """The four estimates, replayed (as by default): ``benchmarks/replay.py``'s transformers
    contenders, named as ``gate.json`` names them; and the yardstick."""
    import torch
    from replay import MID, _transformers_contenders, fake_model, plain_fake
    from speed import Contender

    out = [c for c in _transformers_contenders("cuda", big=True) if c.name.endswith(", replayed")]
    for c in out:  # ("transformers 70B FSDP2/64 no cache, replayed": "70B no cache")
        c.name = c.name.removeprefix("transformers ").removesuffix(", replayed").replace(" FSDP2/64", "")
    tokens = torch.randint(0, MID.vocab, (1, 1024))
    out.append(Contender(YARDSTICK, lambda: fake_model(MID), lambda made: plain_fake(made, tokens)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="write this machine class's ratios to gate.json")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import torch
    from speed import _load
    from tabulate import tabulate

    racing = contenders()
    for round_ in range(args.repeats + 1):  # the first round warms up
        for contender in racing:
            contender.run(record=round_ > 0)
    cpu = {c.name: statistics.median(c.cpu) for c in racing}
    ratios = {name: seconds / cpu[YARDSTICK] for name, seconds in cpu.items() if name != YARDSTICK}
    here = machine_class()
    recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
    print(f"{here}, {args.repeats} rounds, load {_load()}, torch {torch.__version__}; yardstick {cpu[YARDSTICK]:.2f} s")
    if args.record:
        recorded[here] = {name: round(ratio, 3) for name, ratio in ratios.items()}
        RECORDED.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
        print(tabulate([(n, f"{cpu[n]:.2f}", f"{r:.3f}") for n, r in ratios.items()],
                       headers=["estimate", "CPU s (median)", "recorded ratio"]))
        return 0
    against, slower = verdict(ratios, recorded, here)
    if against is None:
        print(f"no ratios are recorded in {RECORDED.name}: run it with --record")
        return 1
    if against != here:
        print(f"no ratios are recorded for {here}: compared with those of {against}")
    print(tabulate(
        [(n, f"{cpu[n]:.2f}", f"{r:.3f}", recorded[against].get(n, "-"), "SLOWER" if n in slower else "ok")
         for n, r in ratios.items()],
        headers=["estimate", "CPU s (median)", "ratio to the yardstick", "recorded", "verdict"],
    ))
    if slower:
        print(f"more than {SLACK - 1:.0%} slower than recorded: " + "; ".join(f"{n}: {d}" for n, d in slower.items()))
        return 1
    return 0


def verdict(
    ratios: dict[str, float], recorded: dict[str, dict[str, float]], here: str
) -> tuple[str | None, dict[str, str]]:
    """The class whose ratios ``ratios`` are compared with (``here``'s, else the first
    recorded; None where none is), and the estimates more than :data:`SLACK` times slower
    than recorded there, each with how much slower (an estimate not recorded there is
    one: it must be recorded to be gated)."""
    against = here if here in recorded else next(iter(recorded), None)
    if against is None:
        return None, {}
    slower = {}
    for name, ratio in ratios.items():
        was = recorded[against].get(name)
        if was is None:
            slower[name] = "not recorded"
        elif ratio > was * SLACK:
            slower[name] = f"{ratio / was - 1:+.0%} against the recorded ratio"
    return against, slower


if __name__ == "__main__":
    sys.exit(main())
