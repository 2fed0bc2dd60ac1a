"""Block replay of decoders that fill a KV cache (issue 56): a decoder layer trained with
``use_cache=True`` reads its ``layer_idx`` to tell transformers' cache which of its layers
keeps its keys and values. Its blocks replay where that is all the number does; the
replayed blocks leave their keys and values in the cache as the traced ones do, held by
the cache and the graph as the program's are; every figure is the same as with every
block traced, on both devices, leak checks included, and anything else a block does with
its number, or to its cache, is traced and says why."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from replay_checks import both, both_steps, import_transformers, same_figures, transformers_decoder

import pytest_torchmem as tm

PICKS = "read only to pick the layer of the KV cache they fill"


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _line(report: tm.MemoryReport, name: str) -> str:
    [line] = [line for line in report.replayed if line.startswith(f"{name}: ")]
    return line


def _replays(report: tm.MemoryReport, name: str) -> None:
    line = _line(report, name)
    assert re.fullmatch(rf"{re.escape(name)}: \d+ of \d+ block calls replayed \(forward and backward; their "
                        rf"layer_idx, {PICKS}, differ\)", line), report.replayed


def _traced(report: tm.MemoryReport, name: str, why: str) -> None:
    line = _line(report, name)
    assert line.startswith(f"{name}: blocks traced (") and why in line, report.replayed


# -- transformers' own decoders, as they train by default ----------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_transformers_decoders_filling_their_cache_replay(name: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, transformers_decoder(name, True), device=device, optimizer=_adamw)
    same_figures(replayed, traced)
    _replays(replayed, "transformer.h" if name == "gpt2" else "model.layers")
    assert "iteration 2: forward and backward replayed from iteration 1" in replayed.replayed, replayed.replayed


def test_layers_sliding_and_not_in_turn_are_traced_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # (their attention reads its sliding window, None on every other layer: one program per
    # kind, but the blocks of a list are replayed alike or not at all)
    replayed, traced = both(monkeypatch, transformers_decoder("qwen2 sliding", True), device="cuda", optimizer=_adamw)
    same_figures(replayed, traced)
    _traced(replayed, "model.layers", "its blocks differ in attribute sliding_window, which their forward reads")


def test_a_decoder_filling_its_cache_estimates_what_a_real_run_measures() -> None:
    make = transformers_decoder("llama", True)
    estimated = tm.estimate(*make(), optimizer=_adamw)
    _replays(estimated, "model.layers")
    assert estimated.phase_peaks() == tm.measure(*make(), optimizer=_adamw).phase_peaks()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_leak_check_of_a_decoder_filling_its_cache_replays_to_the_same_growth(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replayed, traced = both(monkeypatch, transformers_decoder("llama", True), tm.leaks, device=device, optimizer=_adamw,
                            iterations=3)
    assert (replayed.held, replayed.growth, replayed.per_iteration) == (traced.held, traced.growth, traced.per_iteration)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_forward_only_a_decoder_filling_its_cache_replays(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, transformers_decoder("llama", True), device=device, train=False)
    same_figures(replayed, traced)
    _replays(replayed, "model.layers")


# -- the cache held through the backward, or dropped before it ----------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("keep_output", [True, False], ids=["output kept", "output dropped"])
def test_a_cache_held_through_the_backward_or_dropped_before_it_replays_to_the_same_bytes(
    keep_output: bool, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (kept: the cache holds the keys and values the graph let go; dropped: the graph holds
    # what it saved of them, freed in the backward)
    make = transformers_decoder("llama", True)
    replayed, traced = both(monkeypatch, make, device=device, optimizer=_adamw, keep_output=keep_output)
    same_figures(replayed, traced)
    _replays(replayed, "model.layers")
    if device == "cpu":
        assert replayed.phase_peaks() == tm.measure(*make(), optimizer=_adamw, keep_output=keep_output).phase_peaks()


# -- blocks that do more with their number, or with their cache, are traced -------------------


class _Block(nn.Module):
    """A decoder block as transformers writes one: its keys and values handed to the cache
    under its number, attention over what the cache gives back."""

    def __init__(self, layer_idx: int, width: int = 64) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
        return q, k, v

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        q, k, v = self.project(x)
        k, v = cache.update(k, v, self.layer_idx)
        return self.attend(x, q, k, v)


class _AlsoBranches(_Block):
    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        q, k, v = self.project(x)
        k, v = cache.update(k, v, self.layer_idx)
        out = self.attend(x, q, k, v)
        return out.clone() if self.layer_idx == 4 else out  # (one block runs one more op)


class _Computes(_Block):
    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        q, k, v = self.project(x)
        k, v = cache.update(k, v, int(self.layer_idx))  # (not the number itself, handed on)
        return self.attend(x, q, k, v)


class _FillsTwo(_Block):
    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        q, k, v = self.project(x)
        cache.update(k.detach().clone(), v.detach().clone(), self.layer_idx + 8)  # (and another layer)
        k, v = cache.update(k, v, self.layer_idx)
        return self.attend(x, q, k, v)


def _cache_kinds() -> dict[str, Any]:
    transformers = import_transformers()

    class OwnUpdate(transformers.DynamicCache):
        def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
            if layer_idx == 5:
                key = key * 2
            return super().update(key, value, layer_idx, *args, **kwargs)

    return {"dynamic": transformers.DynamicCache, "own update": OwnUpdate}


class _Decoder(nn.Module):
    def __init__(self, block: type[_Block], cache: str, layers: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 64)
        self.layers = nn.ModuleList(block(i) for i in range(layers))
        self.head = nn.Linear(64, 128)
        self.cache = cache

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cache = _cache_kinds()[self.cache]()
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cache)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _made(block: type[_Block], cache: str = "dynamic") -> Any:
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return _Decoder(block, cache), torch.randint(0, 128, (2, 16))

    return make


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_decoder_block_of_ones_own_filling_a_transformers_cache_replays(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replayed, traced = both(monkeypatch, _made(_Block), device=device, optimizer=_adamw)
    same_figures(replayed, traced)
    _replays(replayed, "layers")


@pytest.mark.parametrize(
    ("block", "cache", "why"),
    [
        (_AlsoBranches, "dynamic", "its blocks differ in attribute layer_idx, which their forward reads"),
        (_Computes, "dynamic", "its blocks differ in attribute layer_idx, which their forward reads"),
        (_FillsTwo, "dynamic", "its blocks differ in attribute layer_idx, which their forward reads"),
        (_Block, "own update", "its blocks differ in attribute layer_idx, which their forward reads"),
    ],
    ids=["branches on it", "computes with it", "fills two layers", "a cache's own update"],
)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_blocks_doing_more_with_their_number_or_cache_are_traced_and_say_why(
    block: type[_Block], cache: str, why: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replayed, traced = both(monkeypatch, _made(block, cache), device=device, optimizer=_adamw)
    same_figures(replayed, traced)
    _traced(replayed, "layers", why)


# -- in a step function: the output, and its cache, kept through the backward or not ----------


def _keeps_the_output(model: nn.Module, batch: dict[str, Any], opt: torch.optim.Optimizer) -> None:
    out = model(**batch)
    out.loss.backward()  # (the output, and its cache, alive through the backward)
    opt.step()
    opt.zero_grad()
    del out


def _drops_the_output(model: nn.Module, batch: dict[str, Any], opt: torch.optim.Optimizer) -> None:
    loss = model(**batch).loss  # (the cache dropped before the backward)
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("step", [_keeps_the_output, _drops_the_output], ids=["keeps", "drops"])
def test_a_step_functions_decoder_filling_its_cache_replays_to_the_same_bytes(
    step: Any, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make = transformers_decoder("llama", True)
    replayed, traced = both_steps(monkeypatch, make, step, _adamw, device=device)
    same_figures(replayed, traced)
    _replays(replayed, "model.model.layers")
    if device == "cpu":
        model, batch = make()
        assert replayed.phase_peaks() == tm.measure(step, (model, batch, _adamw(model.parameters()))).phase_peaks()
