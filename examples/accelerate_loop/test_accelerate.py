"""A training loop written for Hugging Face Accelerate, checked as it is written.

``train`` makes its ``Accelerator`` (gradient accumulation over two batches,
bfloat16 mixed precision), hands it the model, the optimizer and the data
loader (``prepare``), and runs an epoch with ``accumulate`` and
``accelerator.backward``. The ``Accelerator`` is made inside the function:
it reads the device it runs on when it is made, so on the fake ``cuda`` device
it finds the GPU (an H100) and puts the model and every batch there, as on a
real machine. The model, the optimizer and the loader are left as they were,
and so is Accelerate's process-wide state.

Run it with ``pytest examples/accelerate_loop`` (``pip install accelerate``);
accept a change with ``pytest --torchmem-update examples/accelerate_loop``.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate", reason="needs Accelerate: pip install accelerate")


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def make_loader(samples: int = 256, batch_size: int = 32) -> DataLoader:
    data = TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
    return DataLoader(data, batch_size=batch_size)


def train(model: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader, mixed_precision: str = "no") -> None:
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, mixed_precision=mixed_precision)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    model.train()
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()


@pytest.mark.memory_budget(peak="72 MiB")
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_loop(torchmem, mixed_precision):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torchmem.check(train, (model, opt, make_loader(), mixed_precision))
