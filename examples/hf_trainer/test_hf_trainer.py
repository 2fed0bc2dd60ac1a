"""Hugging Face ``Trainer.train()``, checked as a project runs it.

``train`` makes the ``TrainingArguments`` and the ``Trainer`` (its default
AdamW optimizer and linear schedule, its default data collator) and trains
for two optimizer steps. They are made inside the function: ``TrainingArguments``
reads the device it runs on when the trainer first asks, so on the fake
``cuda`` device the trainer finds the GPU (an H100) and moves the model and
each batch there, as on a real machine. The model (a small GPT-2 made from a
config) and the dataset are left as they were.

Run it with ``pytest examples/hf_trainer`` (``pip install transformers accelerate``:
the ``Trainer`` needs Accelerate); accept a change with
``pytest --torchmem-update examples/hf_trainer``.
"""

import tempfile

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install transformers accelerate"
)
pytest.importorskip("accelerate", reason="transformers' Trainer needs Accelerate: pip install accelerate")


def make_model():
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=128)
    return transformers.GPT2LMHeadModel(config)


def make_dataset(samples: int = 16, length: int = 64) -> list:
    ids = torch.randint(0, 512, (samples, length))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def train(model, dataset, steps: int = 2) -> None:
    with tempfile.TemporaryDirectory() as output_dir:
        args = transformers.TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=4,
            max_steps=steps,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        transformers.Trainer(model=model, args=args, train_dataset=dataset).train()


@pytest.mark.memory_budget(peak="128 MiB")
def test_trainer_train(torchmem):
    torch.manual_seed(0)
    torchmem.check(train, (make_model(), make_dataset()))
