"""Routing of the CPU composites that branch on whether their input is a tensor subclass.

Some ATen composites take a cheaper CPU path for plain tensors and a general
one for tensor subclasses (``isTensorSubclassLike``), which fake tensors are:
the fake trace would take the general path where the real step does not. A
torch-function mode, active while the fake ``cpu`` step runs, sees these
calls before the composite does and runs what the real CPU kernel allocates.
Every other call passes through after one dictionary look-up.

* **max_pool1d** (``aten/src/ATen/native/MaxPooling.cpp``, torch 2.13): when no
  gradient is needed (``!(self.requires_grad() && GradMode::is_enabled())``)
  a CPU input goes to ``max_pool1d_impl``, which makes only the output
  (``at::empty({NB, NC, OW})``) and runs the kernel on ``input.contiguous()``;
  otherwise ``max_pool1d_with_indices`` (the 2-d kernel, with int64
  indices), the path fake tensors always take.
* **linear** (``aten/src/ATen/native/Linear.cpp``): an input that is neither
  2-d nor contiguous (with a fusable bias) goes through ``at::matmul`` and
  then ``output.add_(bias)`` in place; for a tensor subclass the composite
  adds out of place ("composite compliance"), one more output-sized tensor
  while the matmul's result is alive.

* **linear algebra** (:mod:`.linalg_routes`): values-only spectral composites,
  ``linalg.eigvals`` and ``linalg.matrix_rank``.
* **tensor_split** with a tensor of indices (``TensorShape.cpp``): C++ reads the
  indices' values (``data_ptr``), which fake tensors do not have; where the
  trace knows them (``values.py``) the call gets them as Python numbers, as the
  C++ code passes them on (views: nothing is allocated).

Python-level functions of ``torch.nn.functional`` (``multi_head_attention_forward``
calls ``linear``) run with the mode active, so that what they call is routed
too, and so does the backward, where checkpoints recompute their forward. C++
composites that call these ops (the RNNs' ``at::linear``) are not reached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pytest_torchmem.engine.tracing.devices.cpu.linalg_routes import LINALG_ROUTES
from pytest_torchmem.engine.tracing.devices.routing import BodyRouting
from pytest_torchmem.engine.tracing.rules import TraceContext
from pytest_torchmem.engine.tracing.values import on_values

__all__ = ["CpuRouter", "pooling_output_size"]

Handler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def pooling_output_size(
    size: int, kernel: int, pad: int, stride: int, dilation: int, ceil_mode: bool
) -> int:
    """``pooling_output_shape`` (``aten/src/ATen/native/Pool.h``)."""
    out = (
        size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    ) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _single(value: Any, default: int | None = None) -> int | None:
    """An int argument given as an int or a one-element sequence (None if neither)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)):
        if len(value) == 0:
            return default
        if len(value) == 1 and isinstance(value[0], int):
            return value[0]
    return None


def _max_pool1d(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    names = (
        "input",
        "kernel_size",
        "stride",
        "padding",
        "dilation",
        "ceil_mode",
        "return_indices",
    )
    defaults: dict[str, Any] = {
        "stride": None,
        "padding": 0,
        "dilation": 1,
        "ceil_mode": False,
        "return_indices": False,
    }
    bound = dict(zip(names, args))
    for name in names[len(args) :]:
        if name in kwargs:
            bound[name] = kwargs[name]
        elif name in defaults:
            bound[name] = defaults[name]
    x = bound.get("input")
    if (
        bound.get("return_indices")
        or not isinstance(x, torch.Tensor)
        or x.device.type != "cpu"
        or x.dim() not in (2, 3)
        or (x.requires_grad and torch.is_grad_enabled())
        or not (x.is_floating_point() and x.numel() > 0)
    ):
        return func(*args, **kwargs)
    kernel = _single(bound.get("kernel_size"))
    stride = (
        _single(bound.get("stride"), default=kernel) if bound.get("stride") is not None else kernel
    )
    pad, dilation = _single(bound.get("padding")), _single(bound.get("dilation"))
    ceil_mode = bound.get("ceil_mode")
    if None in (kernel, stride, pad, dilation) or not isinstance(ceil_mode, bool):
        return func(*args, **kwargs)
    assert kernel is not None and stride is not None and pad is not None and dilation is not None
    if kernel <= 0 or stride <= 0 or dilation <= 0 or pad < 0 or pad > kernel // 2:
        return func(*args, **kwargs)  # the real checks raise; let the composite say why
    width = pooling_output_size(x.shape[-1], kernel, pad, stride, dilation, ceil_mode)
    if width < 1:
        return func(*args, **kwargs)
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if not x.is_contiguous():
        x.contiguous()  # the kernel's copy, given back when it returns
    return out


def _linear(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    names = ("input", "weight", "bias")
    bound = dict(zip(names, args))
    for name in names[len(args) :]:
        bound[name] = kwargs.get(name)
    x, weight, bias = bound["input"], bound["weight"], bound["bias"]
    if (
        not all(isinstance(t, torch.Tensor) for t in (x, weight, bias))
        or x.device.type != "cpu"
        or x.dim() == 2
        or (_fusable(bias) and x.is_contiguous())
    ):
        return func(*args, **kwargs)
    return torch.matmul(x, weight.t()).add_(bias)


def _fusable(bias: torch.Tensor) -> bool:
    """``is_bias_likely_fusable`` of ``linear``."""
    return (bias.dim() == 1 or bias.squeeze().dim() == 1) and bias.is_contiguous()


_ROUTES: Final[dict[Any, Handler]] = {
    torch.max_pool1d: _max_pool1d,
    F.max_pool1d: _max_pool1d,
    F.linear: _linear,
}

_TENSOR_SPLIT: Final = frozenset({torch.tensor_split, torch.Tensor.tensor_split})


def _tensor_split(
    context: TraceContext, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``tensor_split(self, indices_or_sections: Tensor, dim)`` with the tensor's values
    known: ``.item()`` of a 0-dim tensor (sections), ``tolist()`` of a 1-d one."""
    split = args[1] if len(args) > 1 else kwargs.get("indices_or_sections", kwargs.get("indices"))
    value = context.values.of(split) if context.values is not None else None
    if value is None or split.device.type != "cpu" or split.dtype != torch.long:
        return func(*args, **kwargs)
    with on_values():
        numbers = value.item() if value.dim() == 0 else value.tolist()
    rest = {k: v for k, v in kwargs.items() if k not in ("indices_or_sections", "indices")}
    return func(args[0], numbers, *args[2:], **rest)


def _has_tensor_split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    split = args[1] if len(args) > 1 else kwargs.get("indices_or_sections", kwargs.get("indices"))
    return isinstance(split, torch.Tensor)


class CpuRouter(BodyRouting, TorchFunctionMode):
    """Runs what the real CPU kernel allocates for the composites in ``_ROUTES``."""

    #: The backward runs with the mode active too: a checkpoint recomputes its
    #: forward there, whose calls must be routed as they were.
    run_inside = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})

    def __init__(self, context: TraceContext) -> None:
        super().__init__()
        self.context = context
        self._running: set[Any] = set()

    def __torch_function__(self, func, types_, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        handler = _ROUTES.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        route = LINALG_ROUTES.get(func)
        if route is not None:
            return route(self.context, func, args, kwargs)
        if func in _TENSOR_SPLIT and _has_tensor_split(args, kwargs):
            return _tensor_split(self.context, func, args, kwargs)
        if self.runs_body(func):
            return self.run_body(func, types_, args, kwargs)
        return func(*args, **kwargs)
