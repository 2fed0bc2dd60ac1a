"""How fast ``estimate`` is, beside what it has to beat.

    python benchmarks/speed.py [--layers N] [--repeats R] [--real-params] [--check] [--profile]
                               [--transformers]

On a GPT-2-small-shaped model (``benchmarks/gpt2.py``; 12 layers, width 768,
vocab 50257, context 1024; ``--transformers``: Hugging Face transformers'
``GPT2LMHeadModel`` of the same shape, its logits summed) and a batch of
8 x 1024 tokens it times, in one
run and interleaved round by round (so that a machine's changing load hits
every contender alike):

* ``estimate``   -- ``pytest_torchmem.estimate(model, tokens, device="cpu")``
  (``--device cuda``: the fake cuda device, with its router and allocator model),
  forward and backward;
* ``plain fake`` -- the same forward and backward under a bare
  ``FakeTensorMode``: the parameters and tokens made fake here, no tracking.
  This is the floor: tracing cannot be cheaper than running the fake step;
* ``MemTracker`` -- ``torch.distributed._tools.mem_tracker.MemTracker`` under
  ``FakeTensorMode`` on the same step, PyTorch's own fake-tensor memory tracker;
* ``estimate`` at batch 1 and at batch 64: tracing cost must not grow with
  the tensors' sizes;
* ``both devices`` -- what one ``torchmem.check`` traces: ``estimate`` on the
  fake ``cpu`` and on the fake ``cuda`` device, one after the other;
* ``step function`` -- ``estimate`` of the same step written as a function
  (``model(tokens).sum().backward()``): recognising its phases costs nothing
  the built-in step does not pay.

Each contender runs once to warm up (FakeTensorMode's dispatch cache is shared
by all of them), then ``--repeats`` times; the table shows medians. The ratios
are taken on process CPU time, which other processes on a busy machine barely
disturb (the fake step runs on one thread); wall-clock medians are shown too.

The model is built on the meta device (the way the plugin is meant to be fed
in CI: no parameter memory, no initialisation cost); ``--real-params`` builds
it with real, initialised parameters (~500 MB) instead.

``--check`` exits 1 when a target is missed:
estimate / plain fake <= 1.2, estimate / MemTracker <= 0.25,
estimate@64 / estimate@1 <= 1.2, both devices / plain fake <= 2.2,
step function / estimate <= 1.1. ``--profile`` adds a cProfile of one
``estimate`` call on ``--device``, summarised by where the time goes.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2 import GPT2Config, build  # noqa: E402

import pytest_torchmem as tm  # noqa: E402

TARGETS = {
    "estimate / plain fake": 1.2,
    "estimate / MemTracker": 0.25,
    "estimate@64 / estimate@1": 1.2,
    "step function / estimate": 1.1,
    "both devices / plain fake": 2.2,
}
MiB = 2**20


def _fake_mode() -> FakeTensorMode:
    # The settings estimate uses, so that only the tracking differs.
    return FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)


def _fake_parameters(model: nn.Module) -> None:
    """Replace ``model``'s parameters by fresh fake ones (tied ones stay tied).

    Call under the FakeTensorMode; ``model`` is a private copy.
    """
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            new = made.get(id(p))
            if new is None:
                data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu")
                new = made[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[name] = new


def _forward_backward(model: nn.Module, tokens: torch.Tensor) -> None:
    """The built-in step (forward, the output's sum, backward), written as a step function."""
    model(tokens).sum().backward()


def plain_fake(model: nn.Module, tokens: torch.Tensor) -> None:
    """Forward and backward under a bare FakeTensorMode, nothing tracked."""
    with _fake_mode() as mode:
        _fake_parameters(model)
        model(mode.from_tensor(tokens)).sum().backward()


def mem_tracker(model: nn.Module, tokens: torch.Tensor) -> int:
    """Forward and backward under FakeTensorMode and MemTracker; its total peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with _fake_mode() as mode:
        _fake_parameters(model)
        fake_tokens = mode.from_tensor(tokens)
        tracker = MemTracker()
        tracker.track_external(model, fake_tokens)
        with tracker:
            model(fake_tokens).sum().backward()
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())


class _TransformersGPT2(nn.Module):
    """transformers' GPT-2 of ``cfg``'s shape, called with token ids, returning its logits."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        # Before transformers, which imports torchvision when it is installed
        # (see tests/torchvision_import.py: beside the CPU torch wheel it needs help).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from torchvision_import import import_torchvision

        import_torchvision()
        import transformers

        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(
            n_layer=cfg.layers,
            n_embd=cfg.width,
            n_head=cfg.width // 64,
            vocab_size=cfg.vocab,
            n_positions=cfg.context,
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def _build(cfg: GPT2Config, device: str, hugging_face: bool) -> nn.Module:
    if not hugging_face:
        return build(cfg, device)
    with torch.device(device):
        return _TransformersGPT2(cfg)


def _tokens(batch: int, cfg: GPT2Config) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (batch, cfg.context))


class Contender:
    """One timed thing: a setup that is not timed and a call that is."""

    def __init__(self, name: str, setup: Callable[[], Any], call: Callable[[Any], Any]) -> None:
        self.name = name
        self.setup = setup
        self.call = call
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.result: Any = None

    def run(self, record: bool) -> None:
        state = self.setup()
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        self.result = self.call(state)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if record:
            self.cpu.append(cpu)
            self.wall.append(wall)


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux
        return "unknown"
    return f"{one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def profile_estimate(model: nn.Module, tokens: torch.Tensor, device: str = "cpu", top: int = 15) -> None:
    """cProfile one estimate on ``device`` and print where its time goes."""
    tm.estimate(model, tokens, device=device)  # warm
    profiler = cProfile.Profile()
    profiler.enable()
    tm.estimate(model, tokens, device=device)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt  # type: ignore[attr-defined]
    package = str(Path(tm.__file__).resolve().parent)
    rows = []
    for (filename, line, name), (_cc, _nc, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename.startswith(package):
            where = f"{os.path.relpath(filename, Path(package).parent)}:{line}({name})"
            rows.append([where, f"{tottime:.3f}", f"{tottime / total:.1%}", f"{cumtime:.3f}", f"{cumtime / total:.1%}"])
    rows.sort(key=lambda r: -float(r[1]))
    # (the tracker calls FakeTensorMode.dispatch itself; through the dispatcher it is
    # reached from FakeTensorMode.__torch_dispatch__)
    fake = sum(
        cumtime
        for (filename, _line, name), (_cc, _nc, _tt, cumtime, _callers) in stats.stats.items()  # type: ignore[attr-defined]
        if filename.endswith("fake_tensor.py") and name == "dispatch"
    )
    print(f"\ncProfile of one estimate on {device}: {total:.3f} s in all (profiler overhead included), "
          f"{fake / total:.0%} of it inside FakeTensorMode.dispatch (the fake kernels)")
    print(tabulate(rows[:top], headers=["pytest_torchmem function", "self s", "self %", "cum s", "cum %"]))
    print()
    stats.sort_stats("cumulative").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (12: GPT-2 small)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each contender")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--real-params", action="store_true", help="real parameters, not meta")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="the fake device estimate models"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--profile", action="store_true", help="also cProfile one estimate")
    parser.add_argument(
        "--transformers", action="store_true", help="transformers' GPT2LMHeadModel of that shape"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    cfg = GPT2Config(layers=args.layers)
    model = _build(cfg, "cpu" if args.real_params else "meta", args.transformers)
    meta_model = _build(cfg, "meta", args.transformers)  # the fake contenders' copies start from it
    tokens = {b: _tokens(b, cfg) for b in (args.batch, 1, 64)}
    n_params = sum(p.numel() for p in model.parameters())

    def estimate_at(batch: int, name: str) -> Contender:
        return Contender(name, lambda: None, lambda _: tm.estimate(model, tokens[batch], device=args.device))

    est = estimate_at(args.batch, "estimate")
    plain = Contender("plain fake", lambda: copy.deepcopy(meta_model), lambda m: plain_fake(m, tokens[args.batch]))
    tracker = Contender("MemTracker", lambda: copy.deepcopy(meta_model), lambda m: mem_tracker(m, tokens[args.batch]))
    est1, est64 = estimate_at(1, "estimate (batch 1)"), estimate_at(64, "estimate (batch 64)")
    both = Contender(
        "both devices",
        lambda: None,
        lambda _: [tm.estimate(model, tokens[args.batch], device=d) for d in ("cpu", "cuda")][-1],
    )
    function = Contender(
        "step function",
        lambda: None,
        lambda _: tm.estimate(_forward_backward, (model, tokens[args.batch]), device=args.device),
    )
    contenders = [est, plain, tracker, est1, est64, both, function]

    print(
        f"{'transformers GPT2LMHeadModel' if args.transformers else 'GPT-2-shaped model'}: "
        f"{cfg.layers} layers, width {cfg.width}, {n_params / 1e6:.1f} M parameters "
        f"({'real' if args.real_params else 'meta'}), batch {args.batch} x {cfg.context} tokens; "
        f"torch {torch.__version__}"
    )
    print(f"load before: {_load()}")
    start = time.perf_counter()
    for contender in contenders:
        contender.run(record=False)
    for _ in range(args.repeats):
        for contender in contenders:
            contender.run(record=True)
    elapsed = time.perf_counter() - start
    print(f"load after:  {_load()}; {elapsed:.0f} s for warm-up and {args.repeats} rounds\n")

    med = {c.name: (statistics.median(c.cpu), statistics.median(c.wall)) for c in contenders}
    print(tabulate(
        [[c.name, f"{med[c.name][0]:.3f}", f"{med[c.name][1]:.3f}", f"{min(c.cpu):.3f}", f"{max(c.cpu):.3f}"]
         for c in contenders],
        headers=["contender", "CPU s (median)", "wall s (median)", "CPU s min", "CPU s max"],
    ))

    pairs = {
        "estimate / plain fake": (est.name, plain.name),
        "estimate / MemTracker": (est.name, tracker.name),
        "estimate@64 / estimate@1": (est64.name, est1.name),
        "both devices / plain fake": (both.name, plain.name),
        "step function / estimate": (function.name, est.name),
    }
    rows, missed = [], []
    for label, (a, b) in pairs.items():
        ratio = med[a][0] / med[b][0]
        ok = ratio <= TARGETS[label]
        if not ok:
            missed.append(label)
        rows.append([label, f"{ratio:.3f}", f"{med[a][1] / med[b][1]:.3f}", f"<= {TARGETS[label]}", "ok" if ok else "MISSED"])
    print()
    print(tabulate(rows, headers=["ratio", "CPU", "wall", "target", "verdict (CPU)"]))

    print()
    peak_rows = []
    for c in (est1, est, est64):
        rep = c.result
        peak_rows.append([c.name, f"{rep.forward_peak / MiB:,.1f}", f"{rep.backward_peak / MiB:,.1f}",
                          len(rep.unsupported)])
    peak_rows.append(["MemTracker (overall peak)", f"{tracker.result / MiB:,.1f}", "", ""])
    print(tabulate(peak_rows, headers=["what was traced", "forward peak MiB", "backward peak MiB", "unsupported"]))

    if args.profile:
        profile_estimate(model, tokens[args.batch], args.device)

    if missed:
        print(f"\nmissed: {', '.join(missed)}")
        if args.check:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
