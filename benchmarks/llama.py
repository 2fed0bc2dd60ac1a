"""A Llama-architecture decoder in plain torch, for the scale benchmark and its tests.

The architecture of Llama 2 (Touvron et al., 2023, and Meta's reference
``llama/model.py``), written with nothing but torch:

* a token embedding, no position embedding;
* ``layers`` pre-norm decoder blocks, each: RMSNorm, attention, residual add,
  RMSNorm, SwiGLU MLP, residual add;
* attention with rotary position embeddings on queries and keys (the
  rotate-half form, cos/sin computed once per forward from an ``inv_freq``
  buffer), grouped-query attention when ``kv_heads < heads`` (through
  ``F.scaled_dot_product_attention(..., enable_gqa=True)``, which shares each
  key/value head among ``heads // kv_heads`` query heads without copying
  them), causal ``F.scaled_dot_product_attention``;
* RMSNorm in float32, cast back to the input dtype before the weight, as the
  reference does;
* the SwiGLU MLP ``w2(silu(w1(x)) * w3(x))``, no biases anywhere;
* a final RMSNorm and an untied LM head;
* with ``labels``: the cross-entropy of the float32 logits against the labels
  shifted by one (the last position predicts nothing: ``ignore_index``), the
  way Hugging Face's causal-LM loss shifts the labels rather than copy the logits.

``build(CONFIGS["7b"])`` makes the model on the meta device in bfloat16: no
parameter memory, no initialisation cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CONFIGS", "Llama", "LlamaConfig", "build", "parameter_count"]

IGNORE_INDEX: Final = -100


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama model."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


CONFIGS: Final[dict[str, LlamaConfig]] = {
    # Llama 2 7B: multi-head attention (32 key/value heads).
    "7b": LlamaConfig(dim=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    # Llama 2 70B: grouped-query attention, 8 key/value heads for 64 query heads.
    "70b": LlamaConfig(dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000),
    # For tests: grouped-query attention, 2 key/value heads for 4 query heads.
    "tiny": LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=256),
}


def parameter_count(cfg: LlamaConfig) -> int:
    """The number of parameters of the model ``cfg`` describes, counted from its shape."""
    kv_dim = cfg.kv_heads * cfg.head_dim
    attention = cfg.dim * cfg.dim * 2 + cfg.dim * kv_dim * 2  # wq, wo; wk, wv
    mlp = 3 * cfg.dim * cfg.ffn  # w1, w2, w3
    norms = 2 * cfg.dim
    return cfg.vocab * cfg.dim * 2 + cfg.layers * (attention + mlp + norms) + cfg.dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(q_dim, cfg.dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads < self.heads
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False, dtype=dtype)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.attention = Attention(cfg, dtype)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.feed_forward = MLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """``forward(tokens, labels=None)``: the logits, and with ``labels`` the loss too
    (a dict with ``"logits"`` and ``"loss"``, so that the default loss is the loss)."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False, dtype=dtype)
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta**exponents, persistent=False)

    def _rotary(self, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(t, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        h = self.tok_embeddings(tokens)
        cos, sin = self._rotary(tokens.shape[1], h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if labels is None:
            return {"logits": logits}
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        loss = F.cross_entropy(
            logits.float().view(-1, self.cfg.vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX
        )
        return {"logits": logits, "loss": loss}


def build(
    cfg: LlamaConfig,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
) -> Llama:
    """The model with its parameters in ``dtype`` on ``device`` (``"meta"``: no memory).

    The ``inv_freq`` buffer is float32 whatever ``dtype``, as in the reference.
    """
    with torch.device(device):
        return Llama(cfg, dtype)
