"""Routing of the decisions CUDA dispatch makes differently from the trace's meta tensors.

A torch-function mode, active while the fake ``cuda`` step runs: it sees each
``torch.*`` / ``Tensor.*`` / ``torch.nn.functional.*`` call before autograd
and the C++ composites do, so it can send a call to the op a GPU would run.

Device placement: on a CPU-only torch, naming ``cuda`` in a factory or in
``.to()`` / ``.cuda()`` raises before dispatch ("not linked with support for
cuda devices"), so those arguments are moved to the trace device here.
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch.overrides import TorchFunctionMode

from pytest_torchmem.tracing.rules import TraceContext

__all__ = ["CudaRouter"]

_TRACE_DEVICE: Final = torch.device("meta")


def _names_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":", 1)[0] == "cuda"
    return False


def _place(value: Any) -> Any:
    return _TRACE_DEVICE if _names_cuda(value) else value


class CudaRouter(TorchFunctionMode):
    """Sends calls that CUDA dispatch resolves differently to the CUDA kernels' ops."""

    def __init__(self, context: TraceContext) -> None:
        super().__init__()
        self.context = context

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0].to(_TRACE_DEVICE, non_blocking=kwargs.get("non_blocking", False))
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _TRACE_DEVICE}
        if func is torch.Tensor.to or func is torch.Tensor.new_empty:
            args = tuple(_place(a) for a in args)
        return func(*args, **kwargs)
