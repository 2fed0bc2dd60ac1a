"""Compiled models whose estimate must equal ``measure`` byte for byte (issue 11).

Each family builds its model twice from the same seed: compiled as a user
would compile it, and eager (the figure beside it, which shows what the
compiler changed). Shared by ``tests/test_compiled.py`` (in this process, and
in processes capped to lower ISA levels: ``python tests/compiled_zoo.py THREADS``)
and the accuracy benchmark.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class Fusable(nn.Module):
    """LayerNorm, an up projection, ``gelu(h) * sigmoid(h) + tanh(h)`` (one fused kernel
    compiled, five eager ops) and a down projection with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        h = torch.nn.functional.gelu(h) * torch.sigmoid(h) + torch.tanh(h)
        return x + self.down(h)


class Attention(nn.Module):
    """A pre-norm transformer block with scaled-dot-product attention."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class Breaks(nn.Module):
    """A graph break in forward: two compiled graphs with eager code between them."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Fusable(), Fusable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))


class Selective(nn.Module):
    """Selective activation checkpointing: matmuls saved, the rest recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Fusable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import (
            CheckpointPolicy,
            checkpoint,
            create_selective_checkpoint_contexts,
        )

        def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
            if op == torch.ops.aten.mm.default:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        # a partial: dynamo traces context_fn only as one
        contexts = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=contexts)


def _chain(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(h) * torch.sigmoid(h) + torch.tanh(h)


#: ``_chain``, compiled: a compiled function called in ``forward``.
compiled_chain = torch.compile(_chain)


class CallsFunction(nn.Module):
    """An eager module whose forward calls a compiled function between two linears."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)
        self.chain = compiled_chain if compiled else _chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.chain(self.up(x)))


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def compiled_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW whose ``step`` is compiled: ``opt.step = torch.compile(opt.step)``."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step = torch.compile(opt.step)  # type: ignore[method-assign]
    return opt


def compiled_adamw_function(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW stepped by a compiled function that calls ``opt.step()`` (PyTorch's
    "compiled optimizer" tutorial)."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    eager_step = opt.step

    @torch.compile(fullgraph=False)
    def step() -> None:
        eager_step()

    opt.step = step  # type: ignore[method-assign]
    return opt


def _regional(compiled: bool) -> nn.Module:
    blocks = nn.Sequential(Fusable(), Fusable())
    if compiled:
        for block in blocks:
            block.compile()
    return blocks


def _whole(make: Callable[[], nn.Module], **options: Any) -> Callable[[bool], nn.Module]:
    def build(compiled: bool) -> nn.Module:
        model = make()
        return torch.compile(model, **options) if compiled else model  # type: ignore[return-value]

    return build


@dataclass(frozen=True)
class Family:
    """A compiled model, its input shape, and ``estimate``/``measure`` keyword arguments
    (``optimizer``: compiled, and its eager counterpart)."""

    build: Callable[[bool], nn.Module]
    shape: tuple[int, ...]
    optimizer: tuple[Callable[..., Any], Callable[..., Any]] | None = None
    #: more batch sizes run through the same compiled model (``dynamic=True``)
    more_shapes: tuple[tuple[int, ...], ...] = field(default=())

    def make(self, compiled: bool) -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
        """The model (compiled, or its eager twin), its input, the step's options."""
        torch.manual_seed(0)
        model = self.build(compiled)
        x = torch.randn(*self.shape)
        options: dict[str, Any] = {}
        if self.optimizer is not None:
            options["optimizer"] = self.optimizer[0] if compiled else self.optimizer[1]
        return model, x, options


FAMILIES: dict[str, Family] = {
    "mlp": Family(_whole(Fusable), (8, 16, 32)),
    "transformer": Family(_whole(Attention), (2, 16, 32)),
    "conv-bn-relu": Family(_whole(conv), (2, 3, 16, 16)),
    "graph break": Family(_whole(Breaks), (8, 16, 32)),
    "regional": Family(_regional, (8, 16, 32)),
    "selective checkpointing": Family(_whole(Selective), (8, 16, 32)),
    "dynamic": Family(_whole(Fusable, dynamic=True), (4, 16, 32), more_shapes=((8, 16, 32),)),
    "compiled function": Family(CallsFunction, (8, 16, 32)),
    # the model compiled too: its program is built in a warm-up step, the optimizer's in the step
    "adamw step": Family(_whole(Fusable), (8, 16, 32), optimizer=(compiled_adamw, adamw)),
    "adamw function": Family(
        lambda compiled: Fusable(), (8, 16, 32), optimizer=(compiled_adamw_function, adamw)
    ),
}


def measure_families(threads: int, names: list[str]) -> dict[str, list[dict[str, int]]]:
    """``measure`` of each family (every shape) in this process at ``threads`` threads."""
    from profiled import every_peak

    import pytest_torchmem as tm

    torch.set_num_threads(threads)
    out: dict[str, list[dict[str, int]]] = {}
    for name in names or list(FAMILIES):
        family = FAMILIES[name]
        model, x, options = family.make(compiled=True)
        figures = [every_peak(tm.measure(model, x, **options))]
        for shape in family.more_shapes:
            figures.append(every_peak(tm.measure(model, torch.randn(*shape), **options)))
        out[name] = figures
    return out


if __name__ == "__main__":
    import json
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    print(json.dumps(measure_families(int(sys.argv[1]), sys.argv[2:])))
