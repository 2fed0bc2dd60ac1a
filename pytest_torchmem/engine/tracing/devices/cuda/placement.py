"""Placement on the fake cuda device: factories, copies and ``.cuda()`` that name ``cuda`` go to the trace's device.

On a CPU-only torch, naming ``cuda`` in a factory or in ``.to()`` / ``.cuda()``
raises before dispatch ("not linked with support for cuda devices"), so the
router moves those arguments to the trace device (``meta``, which stands for the
GPU); a tensor made from Python data is made on the host and copied, as CUDA
does. The router's generic path moves any other call's ``device=`` keyword
with :func:`place`.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cuda.routes import TRACE_DEVICE, Router, route

__all__ = ["names_cuda", "place"]


def names_cuda(value: Any) -> bool:
    """Whether ``value`` (a device or its name) names a CUDA device."""
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":", 1)[0] == "cuda"
    return False


def place(value: Any) -> Any:
    """The trace device where ``value`` names cuda; anything else as it is."""
    return TRACE_DEVICE if names_cuda(value) else value


@route(torch.Tensor.cuda)
def _tensor_cuda(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0].to(TRACE_DEVICE, non_blocking=kwargs.get("non_blocking", False))


@route(torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)
def _from_data(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A tensor made on the GPU from Python data (a list, numbers, an array): made on
    the host and copied, as CUDA does. Made on the trace's ``meta`` device it would
    reach no dispatcher (``torch.tensor(data, device="meta")`` makes a plain meta
    tensor): the fake mode and the tracker would never see it, its memory uncounted."""
    method = func is torch.Tensor.new_tensor
    data = args[1] if method else (args[0] if args else kwargs.get("obj", kwargs.get("data")))
    device = kwargs.get("device", args[0].device if method else None)
    on_gpu = names_cuda(device) or (isinstance(device, torch.device) and device == TRACE_DEVICE)
    if not on_gpu or isinstance(data, torch.Tensor):
        if "device" in kwargs:
            kwargs = {**kwargs, "device": place(device)}
        return func(*args, **kwargs)
    host = {key: value for key, value in kwargs.items() if key not in ("device", "requires_grad", "pin_memory")}
    if method:
        host.setdefault("dtype", args[0].dtype)
        made = torch.tensor(data, **host)
    else:
        made = func(*args, **host)
    placed = made.to(TRACE_DEVICE)
    return placed.requires_grad_() if kwargs.get("requires_grad") else placed


@route(torch.Tensor.to, torch.Tensor.new_empty)
def _tensor_to(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "device" in kwargs and names_cuda(kwargs["device"]):
        kwargs = {**kwargs, "device": TRACE_DEVICE}
    return func(*(place(a) for a in args), **kwargs)


#: The last release whose ``t[index] = number`` makes the number a tensor on ``t``'s device
#: for any device but CUDA (``THPVariable_setitem``: on CUDA, a CPU scalar made without a
#: dispatch, then ``fill_``); 2.15 fills with the number itself on every device.
_SETITEM_SCALAR_ON_DEVICE_UNTIL: Final = (2, 14)


@route(torch.Tensor.__setitem__)
def _setitem(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t[index] = number`` on the GPU: the number made a host scalar of ``t``'s dtype, as
    CUDA's path makes it (then ``select``, ``fill_``), not a tensor on the trace's ``meta``
    device (``scalar_tensor``, charged a block, then ``copy_``), up to torch 2.14."""
    self, index, value = args
    if (
        isinstance(value, (bool, int, float, complex))
        and isinstance(self, torch.Tensor)
        and self.device.type == TRACE_DEVICE.type
        and torch_minor() <= _SETITEM_SCALAR_ON_DEVICE_UNTIL
    ):
        value = torch.tensor(value, dtype=self.dtype)
    return func(self, index, value, **kwargs)
