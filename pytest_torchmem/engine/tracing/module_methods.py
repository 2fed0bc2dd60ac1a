"""A module's own methods on fake tensors, as they act on real ones: ``.to()``, casts, ``deepcopy``.

Inside the traced step the modules hold fake tensors: the stand-ins of the
user's, and those of modules the step builds. torch's ``Module._apply`` (behind
``.to(device | dtype)``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.float()``,
``.bfloat16()``, ``.double()``, ``.type()``) swaps a fake parameter with its
converted copy by ``torch.utils.swap_tensors``, which refuses a tensor anything
holds a weak reference to (the trace's ledger does) or that autograd holds;
real parameters are converted in place (``param.data = converted``), keeping
their identity, so that an optimizer made before the move steps the moved
parameters. ``Tensor.__deepcopy__`` copies a real tensor's storage, which a
fake one (of the meta device) has none of: ``copy.deepcopy(model)``, an EMA's
copy, ``swa_utils.AveragedModel``, raise.

:func:`module_methods_on_fakes` makes both act on fake tensors as they act on
real ones, on the tracing thread: ``_apply`` converts a fake parameter (and
its gradient) in place, as a real one is, where the converted copy has a
compatible type (a move between the host and the fake GPU does not: there it
is swapped, as torch swaps, or, where that is refused too, the module's slot
takes the converted parameter); ``deepcopy`` of a fake tensor is its clone
(made under the trace, so charged), with its ``requires_grad``, gradient,
attributes and parameter flag, each copied once (the memo keeps shared and
tied tensors shared). Real tensors, and every other thread, get torch's own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_replacing import on_this_thread

__all__ = ["module_methods_on_fakes"]

# torch's private names (engine/torch_compat/torch_private.py)
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
_has_compatible_shallow_copy_type: Final = private("torch._has_compatible_shallow_copy_type")

#: A fake tensor's memos of values read from its data (``nonzero``, ``item``, ...), stale
#: once its data is another tensor's.
_MEMOS: Final = ("nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo")


@contextmanager
def module_methods_on_fakes() -> Iterator[None]:
    """On this thread, ``Module._apply`` and ``Tensor.__deepcopy__`` act on fake tensors as
    they do on real ones (see the module)."""
    with ExitStack() as stack:
        real_apply = stack.enter_context(
            on_this_thread("torch.nn.modules.module.Module._apply", lambda *a, **k: _apply(real_apply, *a, **k))
        )
        real_deepcopy = stack.enter_context(
            on_this_thread("torch._tensor.Tensor.__deepcopy__", lambda self, memo: _deepcopy(real_deepcopy, self, memo))
        )
        yield


def _fakes(module: nn.Module) -> bool:
    return any(type(t) is FakeTensor for t in (*module._parameters.values(), *module._buffers.values()))


def _apply(real: Callable[..., Any], module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
    """``Module._apply`` (torch/nn/modules/module.py), a fake parameter converted in place."""
    if not _fakes(module):
        return real(module, fn, recurse)  # (its children's _apply is this one again)
    if recurse:
        for child in module.children():
            child._apply(fn)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    for key, param in module._parameters.items():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        grad = param.grad
        if applied is not param:
            if overwrite or type(param) is not FakeTensor:
                module._parameters[key] = _as_parameter(applied, param)
                param = module._parameters[key]
            else:
                param = _converted(module, key, param, applied)
        if grad is not None:
            with torch.no_grad():
                grad_applied = fn(grad)
            if grad_applied is not grad:
                param.grad = grad_applied.requires_grad_(grad.requires_grad)
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = fn(buf)
    return module


def _converted(module: nn.Module, key: str, param: torch.Tensor, applied: torch.Tensor) -> torch.Tensor:
    """``param`` holding ``applied``'s data, in place where the types allow it (a real
    parameter's ``param.data = applied``), else swapped, else a new parameter in the slot."""
    if _has_compatible_shallow_copy_type(param, applied):
        param.data = applied
        param.fake_device = applied.fake_device
        for memo in _MEMOS:
            setattr(param, memo, None)
        return param
    new = _as_parameter(applied, param)
    grad, param.grad = param.grad, None
    try:
        torch.utils.swap_tensors(param, new)
    except Exception:  # noqa: BLE001 - held (weak references, autograd): a new one in the slot
        param.grad = grad
        module._parameters[key] = new
        return new
    return param


def _as_parameter(applied: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    new = applied.detach().requires_grad_(like.requires_grad)
    if getattr(like, "_is_param", False) or isinstance(like, nn.Parameter):
        new._is_param = True  # type: ignore[attr-defined]
    return new


def _deepcopy(real: Callable[..., Any], t: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
    """``Tensor.__deepcopy__`` (torch/_tensor.py) of a fake tensor: its clone."""
    if type(t) is not FakeTensor:
        return real(t, memo)  # type: ignore[no-any-return]
    if not t.is_leaf:
        return real(t, memo)  # (torch's own error: only leaves deep-copy)
    if id(t) in memo:
        return memo[id(t)]  # type: ignore[no-any-return]
    with torch.no_grad():
        new = t.clone()
    new.requires_grad_(t.requires_grad)
    if getattr(t, "_is_param", False):
        new._is_param = True  # type: ignore[attr-defined]
    memo[id(t)] = new
    if t.grad is not None:
        new.grad = copy.deepcopy(t.grad, memo)
    fresh = set(vars(new))
    for name, value in vars(t).items():
        if name not in fresh:
            setattr(new, name, copy.deepcopy(value, memo))
    return new
