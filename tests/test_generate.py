"""Inference with a growing cache: ``model.generate(...)`` of transformers' causal LMs (issue 25).

A step function that calls ``generate`` is traced as any other: the key-value
cache grows token by token under the fake modes, on both devices. Tiny GPT-2,
Llama and Mixtral configurations, a batch of two prompts of different lengths
(left padding, an attention mask), greedy and beam search, dynamic and static
caches. Without an end-of-sequence token a real run generates to its max
length, a decision the trace knows from the lengths: the cpu estimate equals
``measure`` byte for byte, every phase and the breakdown. With one, a real run
may stop earlier (a generated token decides): the estimate is the run to the
max length and says it is an upper bound.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from profiled import every_peak
from torch import nn

import pytest_torchmem as tm

T = pytest.importorskip("transformers")

_VOCAB = 128
_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _gpt2() -> nn.Module:
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=_VOCAB, n_positions=64))


def _llama() -> nn.Module:
    config = T.LlamaConfig(**_SHAPE, num_key_value_heads=2, vocab_size=_VOCAB, max_position_embeddings=64)
    return T.LlamaForCausalLM(config)


def _mixtral() -> nn.Module:
    config = T.MixtralConfig(
        **_SHAPE,
        num_key_value_heads=2,
        vocab_size=_VOCAB,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return T.MixtralForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": _gpt2, "llama": _llama, "mixtral": _mixtral}
SEARCHES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "beam": {"num_beams": 3},
    "greedy static": {"cache_implementation": "static"},
    "beam static": {"num_beams": 2, "cache_implementation": "static"},
}
CASES = [
    (model, search)
    for model in MODELS
    for search in SEARCHES
    if model == "gpt2" or search in ("greedy", "beam") or (model == "llama" and search == "greedy static")
]
#: What a beam search lists: the generated length, read from the beams' indices (values
#: the trace does not have) to crop the output, a view: no memory depends on it.
BEAM_CROP = "the Python value of a tensor is not known; 0 was used"


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second two tokens shorter (left padding)."""
    ids = torch.randint(1, _VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def _model(name: str, eos: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


def _generate(**options: Any) -> Callable[..., Any]:
    def generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int = 5) -> Any:
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **options)

    return generate


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize(("model", "search"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_generate_is_measure_on_cpu(model: str, search: str) -> None:
    """Byte for byte what the real ``generate`` allocates, every phase and the breakdown."""
    fn = _generate(**SEARCHES[search])
    arguments = (_model(model), *_prompts())
    estimated = tm.estimate(fn, arguments)
    measured = tm.measure(fn, arguments)
    allowed = {BEAM_CROP} if "beam" in search else set()
    assert {u.reason for u in estimated.unsupported} <= allowed, estimated.unsupported
    assert every_peak(estimated) == every_peak(measured)
    assert estimated.breakdown == measured.breakdown


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_the_cache_grows_with_the_tokens_generated(search: str) -> None:
    """Forty new tokens hold more than five (the prompt's forward outweighs a short
    cache): the loop runs to its max length, a beam search too, whose stop the trace
    cannot compute from the scores; equal to measure on cpu, and on cuda too."""
    fn = _generate(**SEARCHES[search])
    ids, mask = _prompts()
    model = _model("gpt2")
    long = tm.estimate(fn, (model, ids, mask, 40))
    assert long.peak > tm.estimate(fn, (model, ids, mask, 5)).peak
    assert long.peak == tm.measure(fn, (model, ids, mask, 40)).peak
    if search == "greedy":
        on_cuda = [tm.estimate(fn, (model, ids, mask, new), device="cuda").peak for new in (5, 40)]
        assert on_cuda[1] > on_cuda[0], on_cuda


@pytest.mark.parametrize(("model", "search"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_generate_traces_on_the_fake_cuda_device(model: str, search: str) -> None:
    """On cuda the same call runs through the GPU's kernels (its cuBLAS workspace, the
    allocator's blocks); a static cache there makes transformers compile the forward
    (``reduce-overhead``), which the estimate lists and gives as eager."""
    fn = _generate(**SEARCHES[search])
    lm = _model(model)
    estimated = tm.estimate(fn, (lm, *_prompts()), device="cuda")
    on_cpu = tm.estimate(fn, (lm, *_prompts()))
    assert estimated.peak > on_cpu.peak  # the cuBLAS workspace alone is MiBs
    # each parameter a block of its own, in the caching allocator's 512-byte steps
    blocks = sum(-(-p.nbytes // 512) * 512 for p in lm.parameters())
    assert estimated.breakdown[tm.Category.PARAMETERS] == blocks
    compiled = [u for u in estimated.unsupported if u.op.startswith("torch.compile")]
    assert bool(compiled) == (search == "greedy static"), estimated.unsupported
    others = {u.reason for u in estimated.unsupported if not u.op.startswith("torch.compile")}
    assert others <= ({BEAM_CROP} if "beam" in search else set()), others


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_an_end_of_sequence_token_makes_the_estimate_an_upper_bound(search: str) -> None:
    """With an end-of-sequence token, whether a sequence stops early depends on the
    generated tokens: the estimate is the run to the max length (the figure without
    one, and the criterion's own token id), at least what a real run takes, and lists
    the decision it could not make."""
    fn = _generate(**SEARCHES[search])
    ids, mask = _prompts()
    arguments = (_model("gpt2", eos=_VOCAB - 1), ids, mask, 12)
    with_eos = tm.estimate(fn, arguments)
    without = tm.estimate(fn, (_model("gpt2"), ids, mask, 12))
    assert without.peak <= with_eos.peak <= without.peak + 8  # the end token's id, on the device
    assert tm.measure(fn, arguments).peak <= with_eos.peak
    reasons = " ".join(u.reason for u in with_eos.unsupported)
    expected = "taken to run to the max length" if search == "beam" else "False was used"
    assert expected in reasons, with_eos.unsupported


def test_generate_leaves_the_model_as_it_was() -> None:
    model = _model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tm.estimate(_generate(), (model, *_prompts()), device="cuda")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].device.type == "cpu" for k in before)
