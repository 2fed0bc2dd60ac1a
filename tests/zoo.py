"""Model families the accuracy suites trace and measure, written here in plain torch.

Each :class:`Case` builds a fresh model and its inputs (seeded) and names the
step options; sizes are small so that a real CPU step takes well under a
second, but large enough that the CPU kernels take their real paths
(parallel reductions, oneDNN convolutions, BLAS operand copies).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, Any]]
    options: dict[str, Any] = field(default_factory=dict)

    def make(self) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return self.build()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


# -- models --------------------------------------------------------------------


def mlp() -> tuple[nn.Module, Any]:
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    return model, torch.randn(32, 64)


def cnn_bn() -> tuple[nn.Module, Any]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )
    return model, torch.randn(8, 3, 32, 32)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


def resnet_bottleneck() -> tuple[nn.Module, Any]:
    model = nn.Sequential(Bottleneck(32, 16, 64, stride=2), Bottleneck(64, 16, 64))
    return model, torch.randn(4, 32, 16, 16)


def depthwise_grouped() -> tuple[nn.Module, Any]:
    model = nn.Sequential(
        nn.Conv2d(32, 32, 3, padding=1, groups=32),  # depthwise
        nn.Conv2d(32, 64, 1),  # pointwise
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1, groups=4),  # grouped
    )
    return model, torch.randn(4, 32, 16, 16)


def conv_transpose() -> tuple[nn.Module, Any]:
    model = nn.Sequential(
        nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(16, 3, 4, stride=2, padding=1),
    )
    return model, torch.randn(4, 32, 8, 8)


def lstm() -> tuple[nn.Module, Any]:
    return nn.LSTM(32, 64, num_layers=2, batch_first=True), torch.randn(4, 12, 32)


def gru() -> tuple[nn.Module, Any]:
    return nn.GRU(32, 48, num_layers=1, batch_first=True, bidirectional=True), torch.randn(4, 12, 32)


class TinyEncoder(nn.Module):
    def __init__(self, vocab: int = 100, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def transformer_encoder() -> tuple[nn.Module, Any]:
    return TinyEncoder(), torch.randint(0, 100, (4, 16))


class Attention(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4, fused: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.fused = fused
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, c))


def attention_sdpa() -> tuple[nn.Module, Any]:
    return Attention(fused=True), torch.randn(4, 32, 64)


def attention_eager() -> tuple[nn.Module, Any]:
    return Attention(fused=False), torch.randn(4, 32, 64)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def checkpoint_reentrant() -> tuple[nn.Module, Any]:
    return Checkpointed(reentrant=True), torch.randn(32, 64, requires_grad=True)


def checkpoint_nonreentrant() -> tuple[nn.Module, Any]:
    return Checkpointed(reentrant=False), torch.randn(32, 64)


def bf16_mlp() -> tuple[nn.Module, Any]:
    model, x = mlp()
    return model.to(torch.bfloat16), x.to(torch.bfloat16)


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.body(x).float()


def autocast_mlp() -> tuple[nn.Module, Any]:
    return Autocast(), torch.randn(32, 64)


class TopKMoE(nn.Module):
    """Top-k routed mixture of experts with fixed expert capacity (static shapes)."""

    def __init__(self, width: int = 32, hidden: int = 64, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(width, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden) / math.sqrt(width))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        n, experts = tokens.shape[0], self.w1.shape[0]
        capacity = n * self.k // experts
        weights, chosen = self.router(tokens).softmax(-1).topk(self.k, dim=-1)
        onehot = F.one_hot(chosen, experts).to(tokens.dtype)  # n, k, e
        position = (onehot.reshape(n * self.k, experts).cumsum(0) - 1).reshape(n, self.k, experts)
        keep = onehot * (position < capacity).to(tokens.dtype)
        slot = F.one_hot(position.clamp(0, capacity - 1).long(), capacity).to(tokens.dtype)
        dispatch = (keep.unsqueeze(-1) * slot).sum(1)  # n, e, c
        combine = ((keep * weights.unsqueeze(-1)).unsqueeze(-1) * slot).sum(1)
        expert_in = torch.einsum("nec,nd->ecd", dispatch, tokens)
        hidden = F.gelu(torch.bmm(expert_in, self.w1))
        expert_out = torch.bmm(hidden, self.w2)
        return torch.einsum("nec,ecd->nd", combine, expert_out).reshape(x.shape)


def moe_topk() -> tuple[nn.Module, Any]:
    return TopKMoE(), torch.randn(4, 16, 32)


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 200, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> Any:
        logits = self.head(self.body(self.embed(tokens)))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), tokens.flatten())}


def weight_tying() -> tuple[nn.Module, Any]:
    return TiedLM(), torch.randint(0, 200, (4, 16))


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 128)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        h = self.fc2(h)
        h.mul_(0.5).add_(1.0)
        return F.leaky_relu_(h, 0.1)


def inplace() -> tuple[nn.Module, Any]:
    return InPlace(), torch.randn(32, 64)


class LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's channels-first LayerNorm: normalise over C of an N x C x H x W map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, then LayerNorm and the MLP on channels-last permutes, layer
    scale and the residual (ConvNeXt's block, as torchvision writes it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


def convnext(channels_last: bool = False) -> tuple[nn.Module, Any]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 4, stride=4), LayerNorm2d(32, eps=1e-6),
        ConvNeXtBlock(32), ConvNeXtBlock(32),
        LayerNorm2d(32, eps=1e-6), nn.Conv2d(32, 64, 2, stride=2),
        ConvNeXtBlock(64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(64), nn.Linear(64, 10),
    )
    x = torch.randn(4, 3, 64, 64)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    return model, x


CASES: list[Case] = [
    Case("mlp", mlp),
    Case("mlp_eval", mlp, {"train": False}),
    Case("cnn_bn", cnn_bn),
    Case("resnet_bottleneck", resnet_bottleneck),
    Case("depthwise_grouped", depthwise_grouped),
    Case("conv_transpose", conv_transpose),
    Case("lstm", lstm, {"loss_fn": lambda out: out[0].sum()}),
    Case("gru", gru, {"loss_fn": lambda out: out[0].sum()}),
    Case("transformer_encoder", transformer_encoder),
    Case("attention_sdpa", attention_sdpa),
    Case("attention_eager", attention_eager),
    Case("checkpoint_reentrant", checkpoint_reentrant),
    Case("checkpoint_nonreentrant", checkpoint_nonreentrant),
    Case("bf16", bf16_mlp),
    Case("autocast", autocast_mlp),
    Case("moe_topk", moe_topk),
    Case("weight_tying", weight_tying),
    Case("inplace", inplace),
    Case("sgd_momentum", mlp, {"optimizer": sgd}),
    Case("adamw", transformer_encoder, {"optimizer": adamw}),
    Case("convnext", convnext, {"optimizer": adamw}),
    Case("convnext_channels_last", lambda: convnext(channels_last=True)),
]
