"""Lightning's ``Trainer.fit``, checked as a project runs it.

``fit`` makes a ``lightning.Trainer`` (``accelerator="auto"``: it picks the GPU
where there is one) and fits the ``LightningModule`` for two steps, Lightning's
automatic optimization calling ``training_step`` and ``backward`` inside the
optimizer's closure. On the fake ``cuda`` device the trainer finds the GPU (an
H100), as on a real machine. The module and the data loader are left as they
were.

Run it with ``pytest examples/lightning_trainer`` (``pip install lightning``);
accept a change with ``pytest --torchmem-update examples/lightning_trainer``.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning", reason="needs Lightning: pip install lightning")


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_loader(samples: int = 256, batch_size: int = 32) -> DataLoader:
    data = TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
    return DataLoader(data, batch_size=batch_size)


def fit(module: L.LightningModule, loader: DataLoader, steps: int = 2) -> None:
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)


@pytest.mark.memory_budget(peak="72 MiB")
def test_lightning_fit(torchmem):
    torch.manual_seed(0)
    torchmem.check(fit, (Classifier(), make_loader()))
