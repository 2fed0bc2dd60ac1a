"""What replaying a loop's later iterations and a model's repeated blocks saves (issue 40),
measured side by side.

    python benchmarks/replay.py [--repeats R] [--device cuda|cpu] [--check]

In one process, round by round (so that a machine's changing load hits every
contender alike), on the fake ``--device`` (default cuda), CPU time medians:

* ``7B loop``: ``estimate`` of a Llama-2-7B-shaped step (``benchmarks/llama.py``,
  bf16, built on meta, 1 x 4096 tokens, AdamW): the loop's two iterations, the
  second replayed (``replayed``) and traced again (``traced``, ``TORCHMEM_REPLAY=0``);
* ``70B FSDP2/64``: one rank of the Llama-2-70B shape over 64 fake ranks, each decoder
  layer an FSDP2 unit (``benchmarks/scale.py``'s ``70b-fsdp64``: fp32 shards, bf16
  compute, 1 x 4096 tokens, AdamW), its blocks replayed and traced (``--no-70b``
  leaves it out: about 20 s a round);
* ``--transformers``: the same with transformers' own ``LlamaForCausalLM`` at Llama-2's
  7B shape (built on meta, bf16, 1 x 4096 tokens, AdamW), as users train it: with the
  cache as its config has it (``use_cache=True``) and without (``use_cache=False``, what
  fine-tuning scripts and gradient checkpointing set), each replayed and traced; with
  ``--transformers-70b``, also its 70B shape, one rank of FSDP2 over 64 (each decoder
  layer a unit, as above), with and without the cache (about 40 s a call);
* on a 24-layer transformer (width 1024, 1 x 1024 tokens, float32, meta):
  ``loop``, the estimate with AdamW (two iterations); ``leaks x4`` and ``leaks x16``,
  ``tm.leaks`` of the same step for 4 and 16 iterations (an extra iteration's cost is
  their difference over 12: over 4, a busy machine's noise hid it; the loop's first
  iteration, with its optimizer step, is the loop but an extra one); ``one iteration``, the
  estimate without optimizer (forward and backward once); ``plain fake``, forward
  and backward under a bare ``FakeTensorMode`` (nothing tracked).

Beside plain fake, ``one iteration`` is the same work (one forward and backward, the
issue's "replay beats tracing"); ``loop`` does more (two iterations, the optimizer's
first step and its state), and is listed too.

The table gives the issue's targets as ratios and times, with the verdict; the figures
of the replayed and traced runs must be equal (checked here too). ``--check`` exits 1
when a target is missed. Peak RSS is the process's (everything above included).

``--profile`` (with ``--transformers``): where one estimate of each transformers
contender, replayed, spends its time, from a cProfile of it (the profiler's overhead
included, spread alike): each function's own time in the part of the code it belongs to
(torch's fake tensors; the tracker and its rules; the block and loop replay; autograd's
engine; the user's world and the step; FSDP2 and the parallel set-up; the timeline and
the report; the model's own Python; the rest of torch; Python's builtins).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch
from tabulate import tabulate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from llama import CONFIGS, LlamaConfig, build  # noqa: E402
from speed import Contender, _fake_mode, _load  # noqa: E402

import pytest_torchmem as tm  # noqa: E402
from pytest_torchmem.engine.tracing.replay import ENV  # noqa: E402

GiB = 2**30
#: The 24-layer transformer of the ratios beside a plain fake step.
MID = LlamaConfig(dim=1024, layers=24, heads=16, kv_heads=16, ffn=2816, vocab=32000)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def fake_model(cfg: LlamaConfig) -> tuple[Any, Any]:
    """A bare FakeTensorMode and the model built under it (not timed)."""
    mode = _fake_mode()
    with mode:
        return mode, build(cfg, device="cpu", dtype=torch.float32)


def plain_fake(made: tuple[Any, Any], tokens: torch.Tensor) -> None:
    """Forward and backward under the bare FakeTensorMode (the labels the tokens, as the
    estimate's): nothing tracked."""
    mode, model = made
    with mode:
        fake = mode.from_tensor(tokens)
        model(fake, fake)["loss"].backward()


def _transformers_llama(size: str) -> Any:
    """transformers' LlamaForCausalLM at Llama-2's ``size`` ("7b", "70b"), built on meta."""
    # (before transformers, which imports torchvision: see tests/torchvision_import.py)
    sys.path.insert(0, str(HERE.parent / "tests"))
    from torchvision_import import import_torchvision

    import_torchvision()
    import transformers

    shapes = {
        "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=32),
        "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                    num_key_value_heads=8),
    }[size]
    config = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **shapes)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return model if size == "70b" else model.to(torch.bfloat16)


def _transformers_fsdp(model: Any, mesh: Any) -> Any:
    """FSDP2 per decoder layer and root, as :func:`scale.fsdp2_mixed_precision`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _transformers_contenders(device: str, big: bool) -> list[Contender]:
    """transformers' Llama-2 7B (and 70B, one FSDP2 rank of 64), with and without the
    cache, each replayed and traced."""
    ids = torch.randint(0, 32000, (1, 4096))
    contenders = []
    seven = _transformers_llama("7b")
    for cache in (True, False):
        inputs = {"input_ids": ids, "labels": ids, "use_cache": cache}
        for on in (True, False):
            def run(_: Any, inputs: Any = inputs, on: bool = on) -> tm.MemoryReport:
                _replay(on)
                return tm.estimate(seven, inputs, device=device, optimizer=_adamw)

            name = f"transformers 7B{'' if cache else ' no cache'}, {'replayed' if on else 'traced'}"
            contenders.append(Contender(name, lambda: None, run))
    if big:
        fsdp64 = tm.Parallel(mesh={"dp": 64}, apply=_transformers_fsdp)
        for cache in (True, False):
            inputs = {"input_ids": ids, "labels": ids, "use_cache": cache}
            for on in (True, False):
                def run_big(model: Any, inputs: Any = inputs, on: bool = on) -> tm.MemoryReport:
                    _replay(on)
                    return tm.estimate(model, inputs, device=device, optimizer=_adamw, parallel=fsdp64)

                name = f"transformers 70B FSDP2/64{'' if cache else ' no cache'}, {'replayed' if on else 'traced'}"
                contenders.append(Contender(name, lambda: _transformers_llama("70b"), run_big))
    return contenders


#: Where a function's own time goes, by the path of its file (the first that matches).
_PARTS: Final = (
    ("block and loop replay", ("/tracing/block_", "/tracing/replay", "/tracing/optimizer_replay")),
    ("the tracker and its rules", ("pytest_torchmem/engine/tracing/",)),
    ("the user's world and the step", ("pytest_torchmem/engine/user/", "pytest_torchmem/engine/step/")),
    ("FSDP2 and the parallel set-up", ("torch/distributed/", "pytest_torchmem/engine/parallel/")),
    ("the timeline and the report", ("pytest_torchmem/engine/figures/",)),
    ("the rest of pytest-torchmem", ("pytest_torchmem/",)),
    ("torch's fake tensors", ("torch/_subclasses/", "torch/_prims", "torch/_refs/", "torch/_decomp/",
                              "torch/_meta_registrations", "torch/_ops.py", "torch/utils/_pytree",
                              "torch/fx/experimental/symbolic_shapes")),
    ("autograd's engine", ("torch/autograd/", "run_backward")),
    ("the model's own Python", ("transformers/", "torch/nn/")),
    ("the rest of torch", ("torch/",)),
)


def where_time_goes(run: Callable[[], Any]) -> list[tuple[str, float]]:
    """``run()`` under cProfile: each function's own time, summed by :data:`_PARTS`."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    totals: dict[str, float] = {}
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        where = filename if filename != "~" else name
        part = next((part for part, marks in _PARTS if any(mark in where for mark in marks)),
                    "Python's builtins and the rest")
        totals[part] = totals.get(part, 0.0) + tottime
    return sorted(totals.items(), key=lambda item: -item[1])


def _replay(on: bool) -> None:
    os.environ[ENV] = "1" if on else "0"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--no-70b", dest="big70", action="store_false")
    parser.add_argument("--transformers", action="store_true")
    parser.add_argument("--transformers-70b", dest="transformers70", action="store_true")
    parser.add_argument("--profile", action="store_true", help="where each transformers estimate's time goes")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = args.device

    big = build(CONFIGS["7b"], dtype=torch.bfloat16)
    big_tokens = torch.randint(0, CONFIGS["7b"].vocab, (1, 4096))
    mid = build(MID, dtype=torch.float32)
    mid_tokens = torch.randint(0, MID.vocab, (1, 1024))

    def estimate_big(on: bool) -> tm.MemoryReport:
        _replay(on)
        return tm.estimate(big, (big_tokens, big_tokens), device=device, optimizer=_adamw)

    huge_tokens = torch.randint(0, CONFIGS["70b"].vocab, (1, 4096))

    def huge() -> Any:
        """The 70B model, built for each call (not timed) and dropped after it: alive, its
        objects would slow the other contenders' leak checks, which walk what is alive."""
        return build(CONFIGS["70b"], dtype=torch.float32)

    def estimate_huge(model: Any, on: bool) -> tm.MemoryReport:
        from scale import fsdp2_mixed_precision

        _replay(on)
        fsdp64 = tm.Parallel(mesh={"dp": 64}, apply=fsdp2_mixed_precision)
        return tm.estimate(model, (huge_tokens, huge_tokens), device=device, optimizer=_adamw, parallel=fsdp64)

    def leaks(iterations: int) -> Any:
        _replay(True)
        return tm.leaks(mid, (mid_tokens, mid_tokens), device=device, optimizer=_adamw, iterations=iterations)

    def loop(_: Any) -> tm.MemoryReport:
        _replay(True)
        return tm.estimate(mid, (mid_tokens, mid_tokens), device=device, optimizer=_adamw)

    def once(_: Any) -> tm.MemoryReport:
        _replay(True)
        return tm.estimate(mid, (mid_tokens, mid_tokens), device=device)

    contenders = [
        Contender("7B loop, replayed", lambda: None, lambda _: estimate_big(True)),
        Contender("7B loop, traced", lambda: None, lambda _: estimate_big(False)),
        Contender("loop", lambda: None, loop),
        Contender("leaks x4", lambda: None, lambda _: leaks(4)),
        Contender("leaks x16", lambda: None, lambda _: leaks(16)),
        Contender("one iteration", lambda: None, once),
        Contender("plain fake", lambda: fake_model(MID), lambda made: plain_fake(made, mid_tokens)),
    ]
    if args.big70:
        contenders[2:2] = [
            Contender("70B FSDP2/64, replayed", huge, lambda model: estimate_huge(model, True)),
            Contender("70B FSDP2/64, traced", huge, lambda model: estimate_huge(model, False)),
        ]
    if args.transformers or args.transformers70:
        contenders[2:2] = _transformers_contenders(device, args.transformers70)
    for round_ in range(args.repeats + 1):  # the first round warms up
        for contender in contenders:
            contender.run(record=round_ > 0)
    _replay(True)
    cpu = {c.name: statistics.median(c.cpu) for c in contenders}
    result = {c.name: c.result for c in contenders}

    replayed, traced = result["7B loop, replayed"], result["7B loop, traced"]
    same = replayed == traced  # (every figure: a report's equality leaves out what it replayed)
    if args.big70:
        same = same and result["70B FSDP2/64, replayed"] == result["70B FSDP2/64, traced"]
    per_extra = (cpu["leaks x16"] - cpu["leaks x4"]) / 12
    # the loop's first iteration: the 2-iteration loop but its second (an extra one)
    first = cpu["loop"] - per_extra
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = [
        ("7B loop, replayed (s)", cpu["7B loop, replayed"], "<= 1.5", cpu["7B loop, replayed"] <= 1.5),
        ("7B replayed / traced", cpu["7B loop, replayed"] / cpu["7B loop, traced"], "(< 1)", None),
        *(
            [
                ("70B FSDP2/64, replayed (s)", cpu["70B FSDP2/64, replayed"], "<= 8",
                 cpu["70B FSDP2/64, replayed"] <= 8),
                ("70B replayed / traced", cpu["70B FSDP2/64, replayed"] / cpu["70B FSDP2/64, traced"], "(< 1)", None),
            ]
            if args.big70
            else []
        ),
        ("leaks x4 / loop", cpu["leaks x4"] / cpu["loop"], "<= 1.3", cpu["leaks x4"] / cpu["loop"] <= 1.3),
        ("extra iteration / the loop's first", per_extra / first, "<= 0.10", per_extra / first <= 0.10),
        ("extra iteration / one forward and backward", per_extra / cpu["one iteration"], "", None),
        ("one iteration / plain fake (24 layers)", cpu["one iteration"] / cpu["plain fake"], "< 1.0",
         cpu["one iteration"] / cpu["plain fake"] < 1.0),
        ("loop / plain fake (24 layers)", cpu["loop"] / cpu["plain fake"], "(more work)", None),
        ("peak RSS (GiB)", rss / GiB, "<= 1", rss <= GiB),
    ]
    print(f"fake {device}, {args.repeats} rounds, load {_load()}, torch {torch.__version__}")
    print(tabulate([(c.name, f"{cpu[c.name]:.2f}", f"{statistics.median(c.wall):.2f}") for c in contenders],
                   headers=["contender", "CPU s (median)", "wall s (median)"]))
    print()
    print(tabulate([(name, f"{value:.3f}", target, "" if ok is None else ("ok" if ok else "MISSED"))
                    for name, value, target, ok in rows], headers=["target", "measured", "target", "verdict"]))
    print()
    print("7B replayed:", "; ".join(replayed.replayed) or "nothing")
    if args.big70:
        print("70B FSDP2/64 replayed:", "; ".join(result["70B FSDP2/64, replayed"].replayed) or "nothing")
    print("figures, replayed and traced (7B" + (", 70B FSDP2/64):" if args.big70 else "):"),
          "equal" if same else "DIFFERENT")
    print("24-layer loop:", "; ".join(result["loop"].replayed) or "nothing")
    print("24-layer one iteration:", "; ".join(result["one iteration"].replayed) or "nothing")
    for name in [c.name for c in contenders if c.name.startswith("transformers") and c.name.endswith("replayed")]:
        twin = name.removesuffix("replayed") + "traced"
        equal = result[name] == result[twin]
        same = same and equal
        print(f"{name}: {cpu[name]:.2f} s (traced {cpu[twin]:.2f} s, figures {'equal' if equal else 'DIFFERENT'}):",
              "; ".join(result[name].replayed) or "nothing")
    if args.profile:
        for contender in [c for c in contenders if c.name.startswith("transformers") and c.name.endswith("replayed")]:
            state = contender.setup()
            parts = where_time_goes(lambda: contender.call(state))
            total = sum(seconds for _, seconds in parts)
            print(f"\nwhere the time of {contender.name} goes (cProfile, {total:.2f} s with its overhead):")
            print(tabulate([(part, f"{seconds:.2f}", f"{seconds / total:.0%}") for part, seconds in parts],
                           headers=["part", "s", "share"]))
    missed = [name for name, _, _, ok in rows if ok is False]
    if not same:
        return 1
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
