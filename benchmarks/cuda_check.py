"""The estimate of this GPU against its measurement, replayed and traced: the check a GPU session runs.

    python benchmarks/cuda_check.py [zoo|public|all] [--out DIR]

Needs a GPU. For every accuracy family of ``tests/zoo.py``, the RMSNorm and
Llama-style models below, and (``public``) the public models of
``tests/test_public_models.py`` that this machine can build, it estimates the
step on the fake GPU that follows this one (``gpu`` the named profile whose name
the device's has, as ``benchmarks/accuracy.py`` picks it), once with the loop
replayed and once traced (``TORCHMEM_REPLAY``), then measures it
(``tm.measure(device="cuda")``). One JSON line per case goes to
``DIR/cuda_check.jsonl`` (the estimate's and the measurement's reports whole);
one line per case is printed: the differences by phase, whether replayed and
traced agree, and an error where a case failed. Stop 47 ran it on an H100 with
torch 2.11 (its closing note has the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accuracy import _gpu_name  # noqa: E402
from torch import nn  # noqa: E402
from zoo import CASES, adamw  # noqa: E402

import pytest_torchmem as tm  # noqa: E402
from pytest_torchmem.engine.tracing.replay import ENV  # noqa: E402


class RmsMlp(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm, self.norm2 = nn.RMSNorm(512, dtype=dtype), nn.RMSNorm(512, dtype=dtype)
        self.up, self.down = nn.Linear(512, 1024, dtype=dtype), nn.Linear(1024, 512, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.down(F.silu(self.up(self.norm(x)))))


class Block(nn.Module):
    """A Llama-style decoder block: RMSNorm, causal SDPA, SwiGLU."""

    def __init__(self, d: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.n1, self.n2, self.heads = nn.RMSNorm(d), nn.RMSNorm(d), heads
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, 4 * d, bias=False), nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class MiniLlama(nn.Module):
    def __init__(self, layers: int = 4, d: int = 256, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _lm_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().logsumexp(-1).mean()


def own_cases() -> list[tuple[str, Callable[[], tuple[nn.Module, Any]], dict[str, Any]]]:
    llama = {"optimizer": adamw, "loss_fn": _lm_loss}
    return [
        ("rmsnorm_mlp fp32", lambda: (RmsMlp(), torch.randn(64, 512)), {}),
        ("rmsnorm_mlp bf16", lambda: (RmsMlp(torch.bfloat16), torch.randn(64, 512, dtype=torch.bfloat16)), {}),
        ("rmsnorm_mlp adamw", lambda: (RmsMlp(), torch.randn(64, 512)), {"optimizer": adamw}),
        ("rmsnorm many rows", lambda: (nn.RMSNorm(256), torch.randn(70000, 256)), {}),
        ("minillama adamw", lambda: (MiniLlama(), torch.randint(0, 1000, (4, 128))), llama),
        ("minillama bf16 adamw", lambda: (MiniLlama().to(torch.bfloat16), torch.randint(0, 1000, (4, 128))), llama),
    ]


def check(name: str, make: Callable[[], tuple[nn.Module, Any]], options: dict[str, Any], gpu: str | None) -> dict[str, Any]:
    record: dict[str, Any] = {"case": name}
    try:
        reports = {}
        for replay in ("1", "0"):
            os.environ[ENV] = replay
            torch.manual_seed(0)
            model, inputs = make()
            start = time.perf_counter()
            reports[replay] = tm.estimate(model, inputs, device="cuda", gpu=gpu, **options)
            record[f"estimate_s_{'replayed' if replay == '1' else 'traced'}"] = round(time.perf_counter() - start, 2)
        replayed, traced = (reports[r].to_dict() for r in ("1", "0"))
        record["replayed"] = replayed.pop("replayed")
        traced.pop("replayed")
        record["replay_equal"] = replayed == traced
        os.environ[ENV] = "1"
        torch.manual_seed(0)
        model, inputs = make()
        measured = tm.measure(model, inputs, device="cuda", **options)
        estimate = reports["1"]
        record.update(estimate=replayed, measured=measured.to_dict())
        record["diff"] = {
            phase: estimate.phase_peaks()[phase] - value for phase, value in measured.phase_peaks().items()
        }
        record["diff"]["reserved"] = (estimate.reserved_peak or 0) - (measured.reserved_peak or 0)
        record["unsupported"] = [str(entry)[:200] for entry in estimate.unsupported]
    except Exception as exc:  # noqa: BLE001 (one case's failure is its line)
        record["error"] = f"{type(exc).__name__}: {exc}"[:600]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", choices=("zoo", "public", "all"), default="all")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    options = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_check.py measures on a GPU, and torch.cuda.is_available() is False here")
        return 2
    warnings.filterwarnings("ignore")
    gpu = _gpu_name(None)
    cases: list[tuple[str, Callable[[], tuple[nn.Module, Any]], dict[str, Any]]] = []
    if options.which in ("zoo", "all"):
        cases += [(case.name, case.build, case.options) for case in CASES] + own_cases()
    if options.which in ("public", "all"):
        import test_public_models as public

        cases += [
            (f"public {name}", lambda name=name: public._made(name), {"optimizer": public._adamw})
            for name in public.CASES
        ]
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "cuda_check.jsonl", "w") as log:
        log.write(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "gpu": gpu}) + "\n")
        for name, make, step_options in cases:
            record = check(name, make, step_options, gpu)
            log.write(json.dumps(record, default=str) + "\n")
            log.flush()
            moved = {k: v for k, v in record.get("diff", {}).items() if v}
            print(f"{name:<36} {record.get('error') or moved or 'equal'}  replay equal: {record.get('replay_equal')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
