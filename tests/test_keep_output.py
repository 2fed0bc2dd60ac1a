"""``keep_output``: the model's output released before backward (default) or held to the end of the step.

``False``: a loop that keeps only the loss (``loss = model(x).loss``).
``True``: ``out = model(**batch); out.loss.backward(); opt.step()``, which
holds ``out`` (for a language model the logits, batch x length x vocabulary)
through backward and the optimizer step. Estimate and measurement run the same
step for both settings; the differences are worked out by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pytest_torchmem as tm

F32 = 4


def _exact(model: nn.Module, inputs: Any, keep_output: bool, **options: Any) -> tm.MemoryReport:
    estimated = tm.estimate(model, inputs, keep_output=keep_output, **options)
    measured = tm.measure(model, inputs, keep_output=keep_output, **options)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.breakdown == measured.breakdown
    return estimated


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class TinyLM(nn.Module):
    """Embedding -> Linear to the vocabulary; returns the loss and the logits, as a
    Hugging Face causal LM does."""

    def __init__(self, vocab: int = 1000, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def _lm_batch(batch: int = 4, length: int = 16, vocab: int = 1000) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (batch, length))
    return {"input_ids": ids, "labels": ids}


def _convnet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    return model, torch.randn(2, 3, 8, 8)


CASES = {
    "linear": lambda: (nn.Linear(64, 512), torch.randn(32, 64), {}),
    "mlp-adamw": lambda: (
        nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 128)),
        torch.randn(16, 32),
        {"optimizer": _adamw},
    ),
    "tiny-lm": lambda: (TinyLM(), _lm_batch(), {"optimizer": _adamw}),
    "convnet": lambda: (*_convnet(), {}),
}


@pytest.mark.parametrize("keep_output", [False, True], ids=["released", "kept"])
@pytest.mark.parametrize("case", list(CASES))
def test_estimate_equals_measure_for_both_settings(case: str, keep_output: bool) -> None:
    torch.manual_seed(0)
    model, inputs, options = CASES[case]()
    _exact(model, inputs, keep_output, **options)


def test_a_kept_output_adds_its_bytes_to_backward_and_step() -> None:
    """Linear(64, 4096) on a (32, 64) batch, default loss (the sum of the output): the
    (32, 4096) output (524288 B) is not saved for backward (sum's backward keeps no
    tensor, addmm's keeps the input and the weight), so releasing it before backward
    frees it; holding it adds exactly its 524288 B to the backward and step peaks, and
    nothing to the forward peak (it is alive there either way)."""
    torch.manual_seed(0)
    model, x = nn.Linear(64, 4096), torch.randn(32, 64)
    released = _exact(model, x, False, optimizer=_adamw)
    kept = _exact(model, x, True, optimizer=_adamw)
    output = 32 * 4096 * F32
    assert kept.forward_peak == released.forward_peak
    assert kept.backward_peak - released.backward_peak == output
    assert kept.step_peak - released.step_peak == output
    assert kept.breakdown[tm.Category.ACTIVATIONS] - released.breakdown[tm.Category.ACTIVATIONS] == output


def test_a_language_models_logits_are_the_difference() -> None:
    """TinyLM on 4 x 16 tokens, vocabulary 1000: cross_entropy saves its log-softmax
    (4 * 16 * 1000 floats) for backward, not the logits, so the logits (256000 B)
    are what keep_output=True holds on top; with AdamW, through the step as well."""
    model, batch = TinyLM(), _lm_batch()
    released = _exact(model, batch, False, optimizer=_adamw)
    kept = _exact(model, batch, True, optimizer=_adamw)
    logits = 4 * 16 * 1000 * F32
    assert kept.backward_peak - released.backward_peak == logits
    assert kept.step_peak - released.step_peak == logits


class MeanSquare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).square().mean()


def test_a_scalar_output_differs_by_its_four_bytes_unless_it_is_the_loss() -> None:
    """The model returns a 0-dim float (4 B). The default loss is the sum of the
    output's floating tensors, a new 0-dim tensor: keeping the output keeps 4 more
    bytes through backward. With ``loss_fn=lambda out: out`` the output is the loss,
    held through backward either way; with train=False there is no backward: no
    difference."""
    torch.manual_seed(0)
    model, x = MeanSquare(), torch.randn(8, 16)
    assert _exact(model, x, True).backward_peak - _exact(model, x, False).backward_peak == F32
    itself: dict[str, Any] = {"loss_fn": lambda out: out}
    assert _exact(model, x, True, **itself).phase_peaks() == _exact(model, x, False, **itself).phase_peaks()
    assert _exact(model, x, True, train=False).phase_peaks() == _exact(model, x, False, train=False).phase_peaks()


def test_on_the_fake_cuda_device_the_output_block_is_the_difference() -> None:
    """The same Linear on cuda: the output's 524288 B is a 512-byte multiple, so its
    block charges exactly that to allocated memory."""
    torch.manual_seed(0)
    model, x = nn.Linear(64, 4096), torch.randn(32, 64)
    released = tm.estimate(model, x, device="cuda")
    kept = tm.estimate(model, x, device="cuda", keep_output=True)
    assert kept.unsupported == released.unsupported == ()
    assert kept.backward_peak - released.backward_peak == 32 * 4096 * F32


def test_gpt2_from_transformers_holds_its_logits() -> None:
    """GPT-2 from transformers (2 layers, width 64, vocabulary 1000, no KV cache) on a
    BatchEncoding of 4 x 64 tokens with labels: the output (a ModelOutput) holds the loss
    and the logits; keep_output=True adds the 4 * 64 * 1000 float logits to backward."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (4, 64))
    batch = transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    released = _exact(model, batch, False)
    kept = _exact(model, batch, True)
    assert kept.backward_peak - released.backward_peak == 4 * 64 * 1000 * F32


@pytest.mark.parametrize("entry", [tm.estimate, tm.measure], ids=["estimate", "measure"])
def test_keep_output_must_be_a_bool(entry: Any) -> None:
    with pytest.raises(TypeError, match="keep_output must be True or False, got 'yes'"):
        entry(nn.Linear(4, 4), torch.randn(2, 4), keep_output="yes")
