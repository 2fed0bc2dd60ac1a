"""Generation with a growing key-value cache, checked as the project writes it.

``generate`` is a greedy decoding loop over a small causal transformer with a
key-value cache: the prompts' forward, then one token per step, each step's
keys and values concatenated onto the cache. ``torchmem.check`` runs the loop
with the model and the prompts as stand-ins, token by token, on both fake
devices: the peak is the highest point of the whole call, the prompts'
logits early on or the grown cache later (models from Hugging Face
transformers work the same way: ``docs/howto/generation.md``).

Run it with ``pytest examples/generation``; accept a change with
``pytest --torchmem-update examples/generation``.
"""

import pytest
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, cache):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:  # the keys and values of the tokens before
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x)), (k, v)


class Decoder(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 128, heads: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(1024, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids, caches, start=0):
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.position(positions)
        new = []
        for block, cache in zip(self.blocks, caches):
            x, kv = block(x, cache)
            new.append(kv)
        return self.head(x), new


@torch.no_grad()
def generate(model, prompts, new_tokens):
    """Greedy decoding: the prompts' forward, then one token per step from the cache."""
    logits, caches = model(prompts, [None] * len(model.blocks))
    tokens = [prompts]
    for step in range(new_tokens):
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(token)
        if step + 1 < new_tokens:
            logits, caches = model(token, caches, start=prompts.shape[1] + step)
    return torch.cat(tokens, dim=1)


# The budget holds on both devices; on the fake cuda device (an H100) 32 MiB of it
# is the cuBLAS workspace of the forward's thread.
@pytest.mark.memory_budget(peak="56 MiB")
def test_generation(torchmem):
    torch.manual_seed(0)
    model = Decoder().eval()
    prompts = torch.randint(0, 512, (8, 32))  # eight prompts of 32 tokens
    torchmem.check(generate, (model, prompts, 128), name="128 tokens")
    torchmem.check(generate, (model, prompts, 16), name="16 tokens")
