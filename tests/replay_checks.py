"""What the replay tests check of each run (tests/test_replay.py, tests/test_block_replay.py):
a check run replayed and traced, the user's objects left as they were by both, and every
figure the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fingerprint import fingerprint

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.replay import ENV

__all__ = ["both", "both_steps", "import_transformers", "same_figures", "transformers_decoder"]


def both(monkeypatch: pytest.MonkeyPatch, make: Any, check: Any = tm.estimate, **options: Any) -> tuple[Any, Any]:
    """``check`` (the estimate, or ``tm.leaks``) with replay (the default) and with every
    iteration and block traced, each of a fresh ``make()``; the user's objects left as they
    were by both (their fingerprints, and every module's attributes: the blocks' forwards
    a replay sets for the step)."""
    reports = []
    for replay in ("1", "0"):
        monkeypatch.setenv(ENV, replay)
        model, inputs = make()
        before = fingerprint(model, inputs)
        attributes = [dict(m.__dict__) for m in model.modules()]
        reports.append(check(model, inputs, **options))
        assert fingerprint(model, inputs) == before
        assert [dict(m.__dict__) for m in model.modules()] == attributes
    monkeypatch.setenv(ENV, "1")
    return reports[0], reports[1]


def both_steps(monkeypatch: pytest.MonkeyPatch, make: Any, step: Any, optimizer: Any, **options: Any) -> tuple[Any, Any]:
    """:func:`both` for a step function: ``step(model, batch, opt)`` of a fresh ``make()``
    and ``optimizer(parameters)``, estimated with replay and with every block traced; the
    model, the batch and the optimizer left as they were by both."""
    reports = []
    for replay in ("1", "0"):
        monkeypatch.setenv(ENV, replay)
        model, batch = make()
        opt = optimizer(model.parameters())
        before = fingerprint(model, batch, opt)
        reports.append(tm.estimate(step, (model, batch, opt), **options))
        assert fingerprint(model, batch, opt) == before
    monkeypatch.setenv(ENV, "1")
    return reports[0], reports[1]


def import_transformers() -> Any:
    """transformers, or the test skipped where it is not installed (torchvision imported
    first: see tests/torchvision_import.py)."""
    from torchvision_import import import_torchvision

    import_torchvision()
    return pytest.importorskip("transformers")


def transformers_decoder(name: str, cache: bool) -> Any:
    """A maker of one of transformers' small decoders (8 layers, width 64: ``"gpt2"``,
    ``"llama"``; ``"qwen2 sliding"``: 16 layers, every other one's attention sliding) and
    its batch (2 x 16 token ids, the labels the same), trained with ``use_cache=cache``."""
    transformers = import_transformers()

    def make() -> tuple[Any, Any]:
        torch.manual_seed(0)
        if name == "gpt2":
            config = transformers.GPT2Config(n_layer=8, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
            model = transformers.GPT2LMHeadModel(config)
        elif name == "qwen2 sliding":
            config = transformers.Qwen2Config(
                num_hidden_layers=16, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, use_sliding_window=True, sliding_window=8,
                max_window_layers=0, layer_types=["sliding_attention", "full_attention"] * 8,
            )
            model = transformers.Qwen2ForCausalLM(config)
        else:
            config = transformers.LlamaConfig(
                num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128,
            )
            model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, 128, (2, 16))
        return model, {"input_ids": ids, "labels": ids, "use_cache": cache}

    return make


def same_figures(replayed: tm.MemoryReport, traced: tm.MemoryReport) -> None:
    a, b = replayed.to_dict(), traced.to_dict()
    a.pop("replayed"), b.pop("replayed")
    a.pop("host_peak"), b.pop("host_peak")  # (cuda's host memory: not known where the trace replayed)
    assert a == b  # every figure, the breakdown, per-module peaks, first step, unsupported
