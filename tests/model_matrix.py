"""Public model families in the configurations users train them with, small enough for a test.

Each :data:`FAMILIES` entry makes a tiny model of a transformers (or torchvision) family
from a config, seeded, and its batch; each :data:`CONFIGURATIONS` entry changes the model
or the batch as a training script does (the cache off, gradient checkpointing, the eager
attention, a padded or a packed batch, labels with ignored tokens, bf16 autocast, LoRA
adapters, a frozen half). :func:`cases` pairs them where the configuration applies to the
family. ``tests/test_same_program.py`` checks each pair, ``benchmarks/same_program.py``
times them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: Token batches: 2 sequences of 32 tokens from a 256-token vocabulary.
BATCH, LENGTH, VOCAB = 2, 32, 256
#: Ignored label positions (``-100``), where a padded batch has padding.
PAD = 8


@dataclass(frozen=True)
class Family:
    """A model family: how to make its tiny model and its batch."""

    name: str
    kind: str  # "decoder", "encoder", "encoder-decoder", "vision", "speech", "torchvision"
    make: Callable[[dict[str, Any]], nn.Module]
    #: Config keys each configuration may set (the family does not take the others).
    takes: frozenset[str] = field(default_factory=frozenset)
    #: The config keys of its number of layers (2 in each stack unless a case asks more).
    depth: tuple[str, ...] = ("num_hidden_layers",)


def _transformers() -> Any:
    import transformers

    return transformers


def _decoder(config: str, model: str, **sizes: Any) -> Callable[[dict[str, Any]], nn.Module]:
    def make(overrides: dict[str, Any]) -> nn.Module:
        t = _transformers()
        base = dict(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
        )
        base.update(sizes)
        base.update(overrides)
        torch.manual_seed(0)
        return getattr(t, model)(getattr(t, config)(**base))

    return make


def _made(config: str, model: str, **fixed: Any) -> Callable[[dict[str, Any]], nn.Module]:
    def make(overrides: dict[str, Any]) -> nn.Module:
        t = _transformers()
        torch.manual_seed(0)
        return getattr(t, model)(getattr(t, config)(**{**fixed, **overrides}))

    return make


_DECODER_KEYS = frozenset({"use_cache", "attn_implementation"})
_ENCODER_KEYS = frozenset({"attn_implementation"})


def _torchvision_resnet(overrides: dict[str, Any]) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        # decoders: grouped-query attention (2 key-value heads for 4 heads) unless said
        Family("llama", "decoder", _decoder("LlamaConfig", "LlamaForCausalLM"), _DECODER_KEYS),
        Family("mistral", "decoder", _decoder("MistralConfig", "MistralForCausalLM", sliding_window=16), _DECODER_KEYS),
        Family("qwen2", "decoder", _decoder("Qwen2Config", "Qwen2ForCausalLM"), _DECODER_KEYS),
        Family("qwen3", "decoder", _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=16), _DECODER_KEYS),
        Family("gemma", "decoder", _decoder("GemmaConfig", "GemmaForCausalLM", head_dim=16, num_key_value_heads=1), _DECODER_KEYS),
        # alternating sliding-window and full layers
        Family("gemma2", "decoder", _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=16), _DECODER_KEYS),
        Family("phi3", "decoder", _decoder("Phi3Config", "Phi3ForCausalLM", pad_token_id=0), _DECODER_KEYS),
        # mixtures of experts
        Family("mixtral", "decoder", _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2), _DECODER_KEYS),
        Family(
            "qwen2-moe", "decoder",
            _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
            _DECODER_KEYS,
        ),
        # multi-head attention (no grouped keys and values)
        Family("gpt2", "decoder", _made("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128), _DECODER_KEYS, ("n_layer",)),
        Family(
            "gpt-neox", "decoder",
            _made("GPTNeoXConfig", "GPTNeoXForCausalLM", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=128),
            _DECODER_KEYS,
        ),
        # encoders
        Family("bert", "encoder", _made("BertConfig", "BertForMaskedLM", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB), _ENCODER_KEYS),
        Family("roberta", "encoder", _made("RobertaConfig", "RobertaForMaskedLM", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=130), _ENCODER_KEYS),
        Family("distilbert", "encoder", _made("DistilBertConfig", "DistilBertForMaskedLM", n_layers=2, dim=64, hidden_dim=128, n_heads=4, vocab_size=VOCAB), _ENCODER_KEYS, ("n_layers",)),
        # encoder-decoders
        Family("t5", "encoder-decoder", _made("T5Config", "T5ForConditionalGeneration", num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, d_kv=16, num_heads=4, vocab_size=VOCAB, decoder_start_token_id=0), frozenset({"use_cache"}), ("num_layers", "num_decoder_layers")),
        Family("bart", "encoder-decoder", _made("BartConfig", "BartForConditionalGeneration", encoder_layers=2, decoder_layers=2, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=128), _DECODER_KEYS, ("encoder_layers", "decoder_layers")),
        # vision and speech
        Family("vit", "vision", _made("ViTConfig", "ViTForImageClassification", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, image_size=32, patch_size=8, num_labels=10), _ENCODER_KEYS),
        Family(
            "whisper", "speech",
            _made("WhisperConfig", "WhisperForConditionalGeneration", encoder_layers=2, decoder_layers=2, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4, num_mel_bins=16, max_source_positions=16, max_target_positions=64, vocab_size=VOCAB, decoder_start_token_id=1, pad_token_id=0),
            _DECODER_KEYS,
            ("encoder_layers", "decoder_layers"),
        ),
        Family(
            "wav2vec2", "audio",
            _made("Wav2Vec2Config", "Wav2Vec2ForCTC", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=32, pad_token_id=0, mask_time_prob=0.0),
            _ENCODER_KEYS,
        ),
        Family("resnet18", "torchvision", _torchvision_resnet, depth=()),
    )
}


def batch_for(family: Family, configuration: str) -> dict[str, Any]:
    """The family's batch, as ``configuration`` has it (seeded)."""
    generator = torch.Generator().manual_seed(1)
    if family.kind in ("vision", "torchvision"):
        batch: dict[str, Any] = {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=generator)}
        if family.kind == "vision":
            batch["labels"] = torch.randint(0, 10, (BATCH,), generator=generator)
        return batch
    if family.kind == "speech":
        return {
            "input_features": torch.randn(BATCH, 16, 32, generator=generator),
            "labels": torch.randint(2, VOCAB, (BATCH, 12), generator=generator),
        }
    if family.kind == "audio":
        return {
            "input_values": torch.randn(BATCH, 1600, generator=generator),
            "labels": torch.randint(1, 32, (BATCH, 8), generator=generator),
        }
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if family.kind == "encoder-decoder":
        batch["labels"] = torch.randint(1, VOCAB, (BATCH, LENGTH // 2), generator=generator)
    if configuration in ("padded", "ignored labels"):
        mask = torch.ones_like(ids)
        mask[1, -PAD:] = 0  # the second sequence is padded on the right
        if configuration == "padded":
            batch["attention_mask"] = mask
        labels = batch["labels"]
        labels[1, -PAD:] = -100
    if configuration == "packed":
        # two sequences packed in each row, positions restarting where the second begins
        half = LENGTH // 2
        batch["position_ids"] = torch.cat([torch.arange(half), torch.arange(LENGTH - half)]).repeat(BATCH, 1)
    return batch


def _lora(model: nn.Module) -> nn.Module:
    import peft

    # the attention's query and value projections (or its fused one), as the recipes target them
    names = ("q_proj", "v_proj", "qkv_proj", "query", "value", "c_attn", "q", "v", "q_lin", "v_lin", "query_key_value")
    targets = {name.rpartition(".")[2] for name, _ in model.named_modules() if name.rpartition(".")[2] in names}
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=sorted(targets)))


def _frozen_half(model: nn.Module) -> nn.Module:
    parameters = list(model.parameters())
    for parameter in parameters[: len(parameters) // 2]:
        parameter.requires_grad_(False)
    return model


def _checkpointed(model: nn.Module) -> nn.Module:
    # (transformers 5 names it activation checkpointing; 4.x gradient checkpointing)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@dataclass(frozen=True)
class Configuration:
    """How a training script has the model or the batch: config keys, a change of the
    model once made, the context the step runs in; ``applies``: to which families."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    change: Callable[[nn.Module], nn.Module] | None = None
    autocast: bool = False
    applies: Callable[[Family], bool] = lambda family: True


_TOKENS = ("decoder", "encoder", "encoder-decoder")
CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration("as made"),
        Configuration("no cache", {"use_cache": False}, applies=lambda f: "use_cache" in f.takes),
        Configuration("checkpointed", change=_checkpointed, applies=lambda f: f.kind != "torchvision"),
        Configuration("eager attention", {"attn_implementation": "eager"}, applies=lambda f: "attn_implementation" in f.takes),
        Configuration("padded", applies=lambda f: f.kind in _TOKENS),
        Configuration("packed", applies=lambda f: f.kind == "decoder"),
        Configuration("ignored labels", applies=lambda f: f.kind in _TOKENS),
        Configuration("bf16 autocast", autocast=True),
        Configuration("lora", change=_lora, applies=lambda f: f.kind in _TOKENS),
        Configuration("frozen half", change=_frozen_half),
    )
}


def cases() -> list[tuple[str, str]]:
    """Every (family, configuration) pair where the configuration applies."""
    return [
        (family, configuration)
        for family in FAMILIES
        for configuration, c in CONFIGURATIONS.items()
        if c.applies(FAMILIES[family])
    ]


def made(
    family_name: str, configuration_name: str, layers: int | None = None
) -> tuple[nn.Module, dict[str, Any], Configuration]:
    """The case's model (in training mode, ``layers`` deep where given) and batch."""
    family, configuration = FAMILIES[family_name], CONFIGURATIONS[configuration_name]
    depth = {} if layers is None else dict.fromkeys(family.depth, layers)
    model = family.make({**configuration.config, **depth})
    if configuration.change is not None:
        model = configuration.change(model)
    model.train()
    return model, batch_for(family, configuration_name), configuration


def loss_of(output: Any) -> torch.Tensor:
    """The output's loss, or the sum of its logits (torchvision's models return logits)."""
    loss = getattr(output, "loss", None)
    return loss if loss is not None else output.float().sum()


@contextlib.contextmanager
def step_context(configuration: Configuration) -> Iterator[None]:
    with torch.autocast("cpu", dtype=torch.bfloat16) if configuration.autocast else contextlib.nullcontext():
        yield
