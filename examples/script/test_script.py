"""A plain PyTorch training script, checked as it is written.

``train`` is what a script's ``main`` does: it finds its device
(``"cuda" if torch.cuda.is_available() else "cpu"``), moves the model there,
and runs an epoch over a ``DataLoader``, each batch moved to the device, with
AdamW. ``torchmem.check`` runs it on the fake ``cpu`` device, where there is no
GPU, and on the fake ``cuda`` device, where the script finds one (an H100):
there the model's stand-ins are on the GPU, and each batch is made on the host
by the loader and copied to the GPU, as on a real machine. The model, the
loader and the optimizer are left as they were.

Run it with ``pytest examples/script``; accept a change with
``pytest --torchmem-update examples/script``.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 10))


def make_loader(samples: int = 256, batch_size: int = 64) -> DataLoader:
    data = TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
    return DataLoader(data, batch_size=batch_size, shuffle=True)


def train(model: nn.Module, loader: DataLoader, opt: torch.optim.Optimizer) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    model.train()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.memory_budget(peak="72 MiB")
def test_training_script(torchmem):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torchmem.check(train, (model, make_loader(), opt))
