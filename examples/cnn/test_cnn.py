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


# This model trains on A100s: the cuda estimate follows that GPU (its cuBLAS
# workspaces are 8 MiB where a Hopper's are 32 MiB), and the backward pass must
# fit in 24 MiB on every traced device. rtol allows 1 % of drift from the snapshot.
@pytest.mark.memory_budget(backward="24 MiB", rtol=0.01, gpu="A100")
@pytest.mark.parametrize("batch", [4, 16])
def test_cnn_training_step(torchmem, batch):
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    reports = torchmem.check(
        SmallCNN(),
        images,
        # The loss runs on the device being traced: move what it captures there.
        loss_fn=lambda logits: nn.functional.cross_entropy(logits, labels.to(logits.device)),
        optimizer=sgd,
    )
    # check() returns the estimate of each device, for assertions of your own.
    assert reports["cpu"].step_peak > 0
    assert reports["cuda"].reserved_peak >= reports["cuda"].peak  # the caching allocator's segments
