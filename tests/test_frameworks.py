"""Frameworks as their users run them (issue 36): a script with a DataLoader, Accelerate, Hugging Face's
``Trainer.train()`` and Lightning's ``Trainer.fit``, each the function of its ``examples/`` suite.

On cpu each estimate equals ``measure`` byte for byte (every phase's peak and the
breakdown at the peak); on the fake cuda device each runs as on a machine with a
GPU (the framework finds one and puts the model and the batches there); and
every object the step is given, and the process's state the frameworks change
(Accelerate's singletons, the environment, torch's settings), is as it was after.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from exactness import skip_where_native
from fingerprint import fingerprint
from profiled import every_peak

import pytest_torchmem as tm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str) -> ModuleType:
    """The test module of the example suite ``name`` (skipped where its framework is missing)."""
    (path,) = (EXAMPLES / name).glob("test_*.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script() -> tuple[Any, ...]:
    example = _example("script")
    model = example.make_model()
    return example.train, (model, example.make_loader(), torch.optim.AdamW(model.parameters(), lr=1e-3))


def _accelerate(mixed_precision: str) -> Any:
    def build() -> tuple[Any, ...]:
        example = _example("accelerate_loop")
        model = example.make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return example.train, (model, opt, example.make_loader(), mixed_precision)

    return build


def _hf_trainer() -> tuple[Any, ...]:
    example = _example("hf_trainer")
    return example.train, (example.make_model(), example.make_dataset())


def _lightning() -> tuple[Any, ...]:
    example = _example("lightning_trainer")
    return example.fit, (example.Classifier(), example.make_loader())


FRAMEWORKS = {
    "script": _script,
    "accelerate": _accelerate("no"),
    "accelerate bf16": _accelerate("bf16"),
    "hf trainer": _hf_trainer,
    "lightning": _lightning,
}

#: What the fake cuda device lists for a framework (none elsewhere).
CUDA_LISTED = {
    # GPT-2's attention backward (the cutlass kernel's workspace, an upper bound)
    "hf trainer": {"aten._scaled_dot_product_efficient_attention_backward.default"},
}


@pytest.mark.parametrize("name", list(FRAMEWORKS))
# (on cpu the Trainer's DataLoader asks to pin its batches and finds no accelerator: a real
# run on a machine without a GPU warns so too; on the fake cuda device it pins them)
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator is found:UserWarning")
# (torch 2.10's DataLoader pins with a device argument it deprecated itself: as on a GPU)
@pytest.mark.filterwarnings("ignore:The argument 'device' of Tensor.(pin_memory|is_pinned)\\(\\) is deprecated:DeprecationWarning")
def test_each_framework_is_measure_on_cpu_finds_the_fake_gpu_and_leaves_everything_as_it_was(name: str) -> None:
    torch.manual_seed(0)
    function, arguments = FRAMEWORKS[name]()
    environment = dict(os.environ)
    settings = (torch.get_default_dtype(), torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)
    rng = torch.get_rng_state()
    gpu = torch.cuda.is_available()  # (a real one: the fake GPU's view must leave it as it was)
    before = fingerprint(arguments)

    def as_it_was() -> None:
        assert fingerprint(arguments) == before
        assert dict(os.environ) == environment
        assert (torch.get_default_dtype(), torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark) == settings
        assert torch.equal(torch.get_rng_state(), rng)
        assert torch.cuda.is_available() == gpu  # (nothing of the fake GPU's view is left)
        state = sys.modules.get("accelerate.state")
        if state is not None:  # (Accelerate's process-wide state: none made by a check)
            assert "device" not in state.PartialState._shared_state

    # the fake cuda device first: a framework that kept what it saw there would say so on cpu
    parameters = sum(p.nbytes for p in _parameters(arguments))
    report = tm.estimate(function, arguments, device="cuda")
    as_it_was()
    assert {entry.op for entry in report.unsupported} == CUDA_LISTED.get(name, set())
    # the model's parameters are on the GPU (each block of the caching allocator's, a
    # multiple of 512 bytes), and so is the step: at least the 32 MiB cuBLAS workspace
    assert report.breakdown[tm.Category.PARAMETERS] >= parameters
    assert report.peak > 32 << 20

    if gpu:  # (measured, each framework trains on the real GPU: not the cpu the estimate models)
        pytest.skip("a machine with a GPU: the frameworks' real run takes it, so measure is not on cpu")
    estimated = tm.estimate(function, arguments)
    as_it_was()
    skip_where_native(estimated)  # (bfloat16 matmuls on a host with native ones: not modelled)
    measured = tm.measure(function, arguments)
    as_it_was()
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(measured)
    assert estimated.breakdown == measured.breakdown
    assert estimated.forward_peak and estimated.backward_peak and estimated.step_peak


def _parameters(arguments: tuple[Any, ...]) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for value in arguments:
        if isinstance(value, torch.nn.Module):
            found.update((id(p), p) for p in value.parameters())
    return list(found.values())
