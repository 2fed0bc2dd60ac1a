"""A small transformer language model: a training step with AdamW, and generation-time forward.

The model is built on the meta device, so the test allocates no real memory
for its weights: the estimate works from shapes alone.
"""

import pytest
import torch
from torch import nn

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 512, 64, 4, 2, 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def build() -> nn.Module:
    with torch.device("meta"):
        return TinyLM()


def next_token_loss(tokens: torch.Tensor):
    def loss(logits: torch.Tensor) -> torch.Tensor:
        targets = tokens[:, 1:].reshape(-1).to(logits.device)  # the device being traced
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets)

    return loss


# The optimizer step creates AdamW's two moments per parameter: a budget on the
# step phase catches a change that makes them bigger (a wider model, fp32
# master weights). On the fake cuda device (H100) the step peaks at about
# 67 MiB, two 32 MiB cuBLAS workspaces included.
@pytest.mark.memory_budget(step="80 MiB")
def test_training_step_with_adamw(torchmem):
    tokens = torch.randint(0, VOCAB, (4, CONTEXT))
    torchmem.check(
        build(),
        tokens,
        loss_fn=next_token_loss(tokens),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        name="train",
    )
    torchmem.check(build(), tokens, train=False, name="eval")
