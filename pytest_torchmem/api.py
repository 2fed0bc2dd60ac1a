"""The public entry points: :func:`estimate` and :func:`measure`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, is_dataclass
from typing import Any

import torch
from torch import nn

from pytest_torchmem.report import MemoryReport
from pytest_torchmem.step import LossFn, OptimizerFactory
from pytest_torchmem.tracing.devices import device_model
from pytest_torchmem.tracing.devices.cpu.profiles import CpuProfile, cpu_profile
from pytest_torchmem.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.tracing.trace import trace

__all__ = ["estimate", "measure"]


@dataclass(frozen=True)
class StepRequest:
    """Validated arguments of :func:`estimate` and :func:`measure`."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    device: str
    loss_fn: LossFn | None
    optimizer: OptimizerFactory | None
    train: bool
    #: Whether the model's output is held through backward (``keep_output=True``).
    keep_output: bool = False


def _request(
    entry: str,
    model: Any,
    inputs: Any,
    device: Any,
    loss_fn: Any,
    optimizer: Any,
    train: Any,
    keep_output: Any = False,
) -> StepRequest:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{entry}() needs an nn.Module as model, got {type(model).__name__}; "
            "wrap a function in an nn.Module whose forward calls it"
        )
    if isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    elif isinstance(inputs, tuple):
        args, kwargs = inputs, {}
    elif isinstance(inputs, Mapping):  # a dict, a tokenizer's BatchEncoding, any Mapping
        bad = [key for key in inputs if not isinstance(key, str)]
        if bad:
            raise TypeError(f"keyword inputs need string keys, got {bad[0]!r}")
        args, kwargs = (), dict(inputs)
    else:
        hint = ""
        if isinstance(inputs, list):
            hint = "; pass a tuple for positional arguments"
        elif is_dataclass(inputs) and not isinstance(inputs, type):
            hint = "; pass (inputs,) to give it to the model as its one positional argument"
        raise TypeError(
            "inputs must be a tensor, a tuple of positional arguments or a mapping (a dict, "
            f"a BatchEncoding) of keyword arguments, got {type(inputs).__name__}{hint}"
        )
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu' or 'cuda', got {device!r}")
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if isinstance(optimizer, torch.optim.Optimizer):  # it would hold the model's real parameters
        raise TypeError(
            "optimizer must be a factory that makes the optimizer from the parameters it is "
            f"given, not a {type(optimizer).__name__}; "
            "e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    for name, value in (("loss_fn", loss_fn), ("optimizer", optimizer)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    if not isinstance(train, bool):
        raise TypeError(f"train must be True or False, got {train!r}")
    if not isinstance(keep_output, bool):
        raise TypeError(f"keep_output must be True or False, got {keep_output!r}")
    return StepRequest(model, args, kwargs, kind, loss_fn, optimizer, train, keep_output)


def estimate(
    model: nn.Module,
    inputs: Any,
    *,
    device: str = "cpu",
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    train: bool = True,
    keep_output: bool = False,
    gpu: str | None = None,
    cpu: str | CpuProfile | None = None,
) -> MemoryReport:
    """Estimate the memory of one step of ``model`` on ``inputs`` with fake tensors.

    The step is forward, ``loss_fn`` and ``loss.backward()`` (``train=True``),
    then ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` when
    ``optimizer`` (a callable ``params -> Optimizer``) is given; with
    ``train=False`` it is the forward alone under ``torch.no_grad()``.
    ``model`` may hold real or meta-device tensors; it is left exactly as it
    was, and no real memory in proportion to the model or its activations is
    allocated.

    ``inputs``: a tensor, a tuple (positional arguments) or a mapping (keyword
    arguments: a dict, a tokenizer's ``BatchEncoding``, any ``Mapping``); the
    tensors may sit in nested lists, tuples, mappings, dataclasses and named
    tuples. The default loss is ``output.loss`` (attribute or key) when it is
    a scalar tensor, else the sum of every floating-point tensor in the
    output, wherever it sits.

    ``keep_output``: ``False`` releases the model's output before
    ``backward()``, as a loop that keeps only the loss does; ``True`` holds it
    to the end of the step (through backward and the optimizer step), as
    ``out = model(**batch); out.loss.backward(); opt.step()`` does.

    ``device="cuda"`` needs no GPU: the step is traced on fake tensors and
    charged through a model of CUDA's caching allocator, following the
    architecture of ``gpu`` (a name from
    :data:`pytest_torchmem.tracing.devices.cuda.profiles.PROFILES`, default
    ``"H100"``).

    ``device="cpu"`` models the CPU ``cpu`` names: ``None`` (or ``"host"``) this
    host as the process runs now (what :func:`measure` sees), or a profile
    ``"<isa level>:<intra-op threads>"`` such as ``"avx2:4"``, or a
    :class:`~pytest_torchmem.CpuProfile`; under a named profile the figures are
    the same on every host.
    """
    request = _request("estimate", model, inputs, device, loss_fn, optimizer, train, keep_output)
    if gpu is not None and request.device != "cuda":
        raise ValueError(f"gpu={gpu!r} applies to device='cuda' only, not {device!r}")
    if cpu is not None and request.device != "cpu":
        raise ValueError(f"cpu={cpu!r} applies to device='cpu' only, not {device!r}")
    return trace(
        request.model,
        request.args,
        request.kwargs,
        device=device_model(request.device),
        loss_fn=request.loss_fn,
        optimizer=request.optimizer,
        train=request.train,
        keep_output=request.keep_output,
        gpu=gpu_profile(gpu) if request.device == "cuda" else None,
        cpu=cpu_profile(cpu) if request.device == "cpu" else None,
    ).report


def measure(
    model: nn.Module,
    inputs: Any,
    *,
    device: str = "cpu",
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    train: bool = True,
    keep_output: bool = False,
) -> MemoryReport:
    """Run one step of ``model`` for real and report the memory it took.

    The same step as :func:`estimate`, with the same ``inputs`` and
    ``keep_output``. On ``"cpu"`` every allocation and free
    is read from the PyTorch profiler's allocator events; on ``"cuda"`` from
    ``torch.cuda``'s peak statistics. The model's parameters, buffers and
    gradients are cloned first, so the model itself is left as it was. The
    report's ``profile`` names the machine measured: this host's CPU profile
    (``"avx2:2"``; None where the host is no level the CPU rules model), or the GPU.
    """
    from pytest_torchmem.measuring import measure_step

    request = _request("measure", model, inputs, device, loss_fn, optimizer, train, keep_output)
    return measure_step(request)


