"""A small convolutional network with batch norm, in-place ReLUs and an SGD step.

Losing an ``inplace=True`` or doubling a feature map moves the snapshot:
``pytest examples/cnn`` then fails and names the module that grew.
"""

import pytest
import torch
from torch import nn


def block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(block(3, 16), block(16, 32), block(32, 64))
        self.head = nn.Linear(64 * 4 * 4, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.memory_budget(backward="8 MiB", rtol=0.01)
@pytest.mark.parametrize("batch", [4, 16])
def test_cnn_training_step(torchmem, batch):
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    reports = torchmem.check(
        SmallCNN(),
        images,
        loss_fn=lambda logits: nn.functional.cross_entropy(logits, labels),
        optimizer=sgd,
    )
    # check() returns the estimate of each device, for assertions of your own.
    assert reports["cpu"].step_peak > 0
