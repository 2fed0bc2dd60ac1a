"""torchao's training features as the torchao tests trace and measure them (issue 36).

Each case builds a fresh model and its inputs (seeded) and names the step options:
torchao's float8 training (``convert_to_float8_training`` on a small MLP, its
dimensions multiples of 16) and its low-bit optimizers (``torchao.optim``) on one
weight of 4096 elements, quantized in blocks (one parameter: torchao compiles its
step per parameter shape, and each compile takes seconds).

    python tests/torchao_cases.py THREADS [case ...]   # measure in this process: JSON on stdout
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, Any]]
    options: dict[str, Any] = field(default_factory=dict)

    def make(self) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return self.build()


def _float8_mlp(
    dtype: torch.dtype, recipe: str = "tensorwise", batch: tuple[int, ...] = (32,), bias: bool = True
) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = nn.Sequential(nn.Linear(64, 128, bias=bias), nn.GELU(), nn.Linear(128, 64, bias=bias))
        model = model.to(dtype)
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
        return model, torch.randn(*batch, 64, dtype=dtype)

    return build


def _one_weight(dtype: torch.dtype = torch.float32) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        return nn.Linear(64, 64, bias=False).to(dtype), torch.randn(8, 64, dtype=dtype)

    return build


def low_bit(name: str, **options: Any) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> torchao.optim.<name>(params, **options)``."""

    def make(params: Any) -> torch.optim.Optimizer:
        import torchao.optim

        return getattr(torchao.optim, name)(params, **options)

    make.__name__ = name
    return make


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


FLOAT8: list[Case] = [
    Case("float8 tensorwise float32", _float8_mlp(torch.float32)),
    Case("float8 tensorwise bfloat16 3-d", _float8_mlp(torch.bfloat16, batch=(2, 16), bias=False)),
    Case("float8 rowwise bfloat16", _float8_mlp(torch.bfloat16, "rowwise")),
    Case("float8 rowwise_with_gw_hp bfloat16", _float8_mlp(torch.bfloat16, "rowwise_with_gw_hp")),
    Case("float8 tensorwise float32 adamw", _float8_mlp(torch.float32), {"optimizer": adamw}),
]

OPTIMIZERS: list[Case] = [
    Case("AdamW8bit", _one_weight(), {"optimizer": low_bit("AdamW8bit")}),
    Case("AdamW4bit", _one_weight(), {"optimizer": low_bit("AdamW4bit")}),
    Case("AdamWFp8", _one_weight(), {"optimizer": low_bit("AdamWFp8")}),
    Case("AdamW8bit bfloat16", _one_weight(torch.bfloat16), {"optimizer": low_bit("AdamW8bit")}),
    Case(
        "_AdamW bfloat16 stochastic rounding",
        _one_weight(torch.bfloat16),
        {"optimizer": low_bit("_AdamW", bf16_stochastic_round=True)},
    ),
]

CASES: dict[str, Case] = {case.name: case for case in FLOAT8 + OPTIMIZERS}


def measure_cases(threads: int, names: list[str]) -> dict[str, dict[str, int]]:
    """``measure`` of each case in this process at ``threads`` threads."""
    from profiled import every_peak

    import pytest_torchmem as tm

    torch.set_num_threads(threads)
    out = {}
    for name in names or list(CASES):
        model, inputs = CASES[name].make()
        out[name] = every_peak(tm.measure(model, inputs, **CASES[name].options))
    return out


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    print(json.dumps(measure_cases(int(sys.argv[1]), sys.argv[2:])))
