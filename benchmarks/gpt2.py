"""A GPT-2-small-shaped transformer in plain torch, for the speed benchmark.

12 pre-LayerNorm blocks of width 768 with 12 heads, an MLP of 3072 with the
tanh GELU, learned position embeddings over a context of 1024, a final
LayerNorm, and a language-model head tied to the token embedding (the logits
are ``F.linear(h, wte.weight)``: one parameter, used twice). Attention is
causal ``F.scaled_dot_product_attention``. No dropout: the benchmark times
tracing, and dropout would only add the same mask ops to every contender.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT2Config", "GPT2", "build"]


@dataclass(frozen=True)
class GPT2Config:
    layers: int = 12
    width: int = 768
    heads: int = 12
    mlp: int = 3072
    vocab: int = 50257
    context: int = 1024


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.width, cfg.mlp)
        self.proj = nn.Linear(cfg.mlp, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied LM head: logits


def build(cfg: GPT2Config = GPT2Config(), device: str | torch.device = "meta") -> GPT2:
    """The model with its parameters on ``device`` (``"meta"``: no memory, no init cost)."""
    with torch.device(device):
        return GPT2(cfg)
