"""A multi-layer perceptron: the smallest memory regression suite.

Each check is traced on the fake ``cpu`` and ``cuda`` devices. Run it with
``pytest examples/mlp``; after a change to the model, accept the new figures
with ``pytest --torchmem-update examples/mlp`` and commit the diff of
``examples/mlp/__torchmem__/test_mlp.json``.
"""

import pytest
import torch
from torch import nn


def make_mlp(
    features: int = 128, hidden: int = 256, depth: int = 3, classes: int = 10
) -> nn.Module:
    layers: list[nn.Module] = []
    width = features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def cross_entropy(labels: torch.Tensor):
    # The loss runs on the device being traced: move what it captures there.
    return lambda logits: nn.functional.cross_entropy(logits, labels.to(logits.device))


# A hard cap on every traced device (cpu and cuda by default): the test fails
# when the training step needs more, even under --torchmem-update. The snapshot
# catches smaller drifts. On the fake cuda device (an H100 unless told
# otherwise) most of the step is cuBLAS workspace: 32 MiB for the forward's
# stream and 32 MiB more for the backward, which autograd runs on its own
# stream.
@pytest.mark.memory_budget(peak="80 MiB")
def test_mlp_training_step(torchmem):
    torch.manual_seed(0)
    x, labels = torch.randn(64, 128), torch.randint(0, 10, (64,))
    torchmem.check(make_mlp(), x, loss_fn=cross_entropy(labels))


@pytest.mark.parametrize("batch", [1, 64])
def test_mlp_inference(torchmem, batch):
    torchmem.check(make_mlp(), torch.randn(batch, 128), train=False)
