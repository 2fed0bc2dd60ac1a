"""Public models as users bring them (Hugging Face transformers, torchvision, peft), both fake devices, AdamW.

Small configurations of GPT-2 (plain and with gradient checkpointing, both
kinds), Llama (float32 and bfloat16), BERT, ViT, ResNet, ConvNeXt,
MobileNetV2, EfficientNet, T5,
Mixtral (float32: its experts' grouped matmul) and Whisper, an LSTM
tagger, and torchvision's ResNet-18, ConvNeXt, MobileNetV3-Small, EfficientNet
(MBConv and Fused-MBConv blocks) and ViT (float32, with a cross-entropy loss
on their logits; skipped when torchvision is not installed), and peft's
adapters (``LORA``: LoRA on GPT-2 and Llama, with and without dropout, DoRA on
Llama, LoRA on ViT with its classifier trained whole; skipped when peft is not
installed), each with a tokenizer-style ``Mapping`` batch and an AdamW step
(over the trainable parameters: the adapters' only, under peft): the
cpu estimate equals ``measure`` byte for byte, and the fake cuda device traces each without an exception,
listing nothing in ``unsupported`` but the attention-backward and cuDNN RNN
workspaces whose CUTLASS/cuDNN sizes the models state as estimates.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from following import follows_compiled
from exactness import skip_where_native
from profiled import every_peak
from torch import nn

import pytest_torchmem as tm

transformers = pytest.importorskip("transformers")
T = transformers

_IDS = (2, 16)
_VOCAB = 128

#: case -> bytes the cpu estimate may be off, and why. Every other case is exact.
#: What the fake cuda device may list: kernels whose workspace the model estimates
#: (CUTLASS's and cuDNN's attention backward, cuDNN's RNN reserve and workspace).
CUDA_ESTIMATED = {
    "aten._scaled_dot_product_efficient_attention_backward.default",
    "aten._scaled_dot_product_cudnn_attention_backward.default",
    "aten._cudnn_rnn.default",
    "aten._cudnn_rnn_backward.default",
}


def _lm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, _VOCAB, _IDS)
    return {"input_ids": ids, "labels": ids}


def _image_batch() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 1])}


def _gpt2(reentrant: bool | None = None) -> tuple[nn.Module, Any]:
    model = T.GPT2LMHeadModel(
        T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=_VOCAB, n_positions=64)
    )
    if reentrant is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    return model, _lm_batch()


def _llama(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    config = T.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=_VOCAB,
        max_position_embeddings=64,
    )
    return T.LlamaForCausalLM(config).to(dtype), _lm_batch()


class _LstmTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True, bidirectional=True)
        self.tags = nn.Linear(128, 9)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        scores = self.tags(self.lstm(self.embed(input_ids))[0])
        return nn.functional.cross_entropy(scores.flatten(0, 1), labels.flatten() % 9)


class _Classifier(nn.Module):
    """A torchvision classifier taking the batch's pixels and labels, returning the loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(pixel_values), labels)


def _torchvision(build: Callable[[Any], nn.Module]) -> tuple[nn.Module, Any]:
    """``build(torchvision.models)`` as a :class:`_Classifier` (10 classes), an image batch."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
    return _Classifier(build(torchvision.models)), _image_batch()


def _torchvision_efficientnet(models: Any) -> nn.Module:
    """EfficientNet(V2)'s blocks, few and narrow: Fused-MBConv, then MBConv with squeeze-excitation."""
    fused, mb = models.efficientnet.FusedMBConvConfig, models.efficientnet.MBConvConfig
    setting = [fused(1, 3, 1, 16, 16, 1), fused(4, 3, 2, 16, 24, 1), mb(4, 3, 2, 24, 32, 2)]
    return models.EfficientNet(setting, dropout=0.2, num_classes=10, last_channel=128)


def _vit() -> tuple[nn.Module, Any]:
    config = T.ViTConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        num_labels=2,
    )
    return T.ViTForImageClassification(config), _image_batch()


def _lora(build: Callable[[], tuple[nn.Module, Any]], **config: Any) -> tuple[nn.Module, Any]:
    """``build()``'s model as peft wraps it for fine-tuning (``get_peft_model``, rank 8):
    its weights frozen, only the adapters (and ``modules_to_save``) trained."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    model, batch = build()
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, **config)), batch


#: peft's adapters on the models above, each changing the step's memory its own way.
LORA: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    # GPT-2's Conv1D projections (fan_in_fan_out), the attention's and the MLP's c_proj
    "gpt2 lora": lambda: _lora(
        _gpt2, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, task_type="CAUSAL_LM"
    ),
    # every attention projection of Llama, the usual recipe
    "llama lora": lambda: _lora(
        _llama,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    ),
    # dropout on the adapters' input: each adapted layer keeps its dropped copy and mask
    "llama lora dropout": lambda: _lora(
        _llama, target_modules=["q_proj", "v_proj"], lora_dropout=0.1, task_type="CAUSAL_LM"
    ),
    # DoRA: a trained magnitude per output, the norm of the adapted weight in every forward
    "llama dora": lambda: _lora(
        _llama, target_modules=["q_proj", "v_proj"], use_dora=True, task_type="CAUSAL_LM"
    ),
    # a vision encoder, its classifier trained whole beside the adapters (modules_to_save)
    "vit lora": lambda: _lora(
        _vit, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"]
    ),
}


CASES: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "gpt2": _gpt2,
    "gpt2 checkpointed": lambda: _gpt2(reentrant=False),
    "gpt2 checkpointed (reentrant)": lambda: _gpt2(reentrant=True),
    "llama": _llama,
    "llama bf16": lambda: _llama(torch.bfloat16),
    "bert": lambda: (
        T.BertForMaskedLM(
            T.BertConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=_VOCAB,
                max_position_embeddings=64,
            )
        ),
        _lm_batch(),
    ),
    "vit": _vit,
    "resnet": lambda: (
        T.ResNetForImageClassification(
            T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=2)
        ),
        _image_batch(),
    ),
    "convnext": lambda: (
        T.ConvNextForImageClassification(
            T.ConvNextConfig(
                num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=2, image_size=32
            )
        ),
        _image_batch(),
    ),
    "mobilenet v2": lambda: (
        T.MobileNetV2ForImageClassification(
            T.MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=2)
        ),
        _image_batch(),
    ),
    "efficientnet": lambda: (
        T.EfficientNetForImageClassification(
            T.EfficientNetConfig(
                image_size=32,
                width_coefficient=0.25,
                depth_coefficient=0.25,
                hidden_dim=320,
                num_labels=2,
            )
        ),
        _image_batch(),
    ),
    "t5": lambda: (
        T.T5ForConditionalGeneration(
            T.T5Config(
                d_model=64,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                d_kv=16,
                vocab_size=_VOCAB,
                decoder_start_token_id=0,
            )
        ),
        _lm_batch(),
    ),
    "mixtral": lambda: (
        T.MixtralForCausalLM(
            T.MixtralConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=_VOCAB,
                num_local_experts=4,
                num_experts_per_tok=2,
                max_position_embeddings=64,
            )
        ),
        _lm_batch(),
    ),
    "whisper": lambda: (
        T.WhisperForConditionalGeneration(
            T.WhisperConfig(
                d_model=64,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                vocab_size=_VOCAB,
                num_mel_bins=16,
                max_source_positions=32,
                max_target_positions=32,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            )
        ),
        {"input_features": torch.randn(2, 16, 64), "labels": torch.randint(0, _VOCAB, _IDS)},
    ),
    "lstm tagger": lambda: (_LstmTagger(), _lm_batch()),
    "torchvision resnet18": lambda: _torchvision(lambda m: m.resnet18(num_classes=10)),
    "torchvision convnext": lambda: _torchvision(
        lambda m: m.ConvNeXt(
            [m.convnext.CNBlockConfig(16, 32, 1), m.convnext.CNBlockConfig(32, None, 1)],
            stochastic_depth_prob=0.1,
            num_classes=10,
        )
    ),
    "torchvision mobilenet v3 small": lambda: _torchvision(
        lambda m: m.mobilenet_v3_small(num_classes=10, width_mult=0.5)
    ),
    "torchvision efficientnet": lambda: _torchvision(_torchvision_efficientnet),
    "torchvision vit": lambda: _torchvision(
        lambda m: m.VisionTransformer(
            image_size=32,
            patch_size=8,
            num_layers=2,
            num_heads=2,
            hidden_dim=64,
            mlp_dim=128,
            num_classes=10,
        )
    ),
    **LORA,
}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


def _made(case: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T.logging.set_verbosity_error()
        model, batch = CASES[case]()
    return model.train(), T.BatchEncoding(batch)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_estimate_equals_measure(case: str) -> None:
    model, batch = _made(case)
    estimated = tm.estimate(model, batch, optimizer=_adamw, cpu="host")
    skip_where_native(estimated)
    measured = tm.measure(model, batch, optimizer=_adamw)
    assert estimated.unsupported == ()
    # (GPT-2 checkpointed was 512 B over until issue 54: transformers' mask helper took a
    # fake tensor for a trace and built the causal mask a real run skips)
    assert every_peak(estimated) == every_peak(measured)


@pytest.mark.parametrize("case", list(CASES))
def test_the_fake_cuda_device_traces_it(case: str) -> None:
    model, batch = _made(case)
    report = tm.estimate(model, batch, optimizer=_adamw, device="cuda")
    assert {entry.op for entry in report.unsupported} <= CUDA_ESTIMATED
    parameters = sum(_nbytes(p) for p in model.parameters())
    trained = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
    # parameters; gradients and AdamW's two moments of the trained ones
    assert report.peak > parameters + 3 * trained


@follows_compiled
def test_the_fake_cuda_device_follows_it_compiled() -> None:
    """Compiled, inductor's cuda program is followed (GPT-2's key-value cache starts
    from ``torch.tensor([], device=...)``, as Llama's does): no region falls back to
    the eager figures, which the compiled ones undercut."""
    model, batch = _made("gpt2")
    compiled = tm.estimate(model, batch, device="cuda", compile=True)
    assert {entry.op for entry in compiled.unsupported} <= CUDA_ESTIMATED
    eager = tm.estimate(model, batch, device="cuda")
    assert compiled.backward_peak < eager.backward_peak


#: The caching allocator's smallest block (kMinBlockSize): below 1 MiB a cuda
#: storage takes a whole number of them.
_CUDA_BLOCK = 512


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", list(LORA))
def test_peft_trains_the_adapters_only(case: str, device: str) -> None:
    """The step driver hands the optimizer the trainable parameters: AdamW keeps
    two moments of each adapter and nothing of the frozen weights, and backward
    makes gradients of the adapters only. At the loop's peak (AdamW's state is
    alive from the first step on) the breakdown holds exactly the adapters'
    state, and no more gradient bytes than the adapters have."""
    model, batch = _made(case)
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trained and sum(map(_nbytes, frozen)) > 4 * sum(map(_nbytes, trained))
    profile = {"cpu": "avx2:4"} if device == "cpu" else {}
    report = tm.estimate(model, batch, optimizer=_adamw, device=device, **profile)
    if device == "cpu":
        # exp_avg, exp_avg_sq and the float32 step count of each trained parameter
        state = sum(2 * _nbytes(p) + 4 for p in trained)
        grads = sum(map(_nbytes, trained))
    else:
        # in blocks; the step counts stay on the host (AdamW is neither fused nor capturable)
        def block(p: torch.Tensor) -> int:
            return -(-_nbytes(p) // _CUDA_BLOCK) * _CUDA_BLOCK

        state = sum(2 * block(p) for p in trained)
        grads = sum(map(block, trained))
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == state
    assert report.breakdown[tm.Category.GRADIENTS] <= grads
