"""The cuda router's registry: the handler each torch function is routed to, and what the handlers share.

A handler is registered with :func:`route` for the torch-level callables it
takes over (``torch._C._VariableFunctions.dropout``, ``torch.Tensor.to``, ...);
a callable is routed once at most. The modules that register handlers
(:mod:`.placement`, :mod:`.kernel_choices`, :mod:`.sdpa`, :mod:`.rnn`,
:mod:`.autocast`) are imported by :mod:`.router`, whose
:class:`~pytest_torchmem.engine.tracing.devices.cuda.router.CudaRouter` looks
each call up in :data:`ROUTES`. Handlers see the mode as a :class:`Router`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.rules import TraceContext

__all__ = [
    "FLOATS",
    "HALVES",
    "ROUTES",
    "TRACE_DEVICE",
    "Handler",
    "LinalgFunctions",
    "NNFunctions",
    "Router",
    "TensorBase",
    "VariableFunctions",
    "aten",
    "bind",
    "eligible",
    "on_gpu",
    "route",
]

aten = torch.ops.aten

#: The device the trace keeps the modelled GPU's tensors on.
TRACE_DEVICE: Final = torch.device("meta")
# torch's private names (engine/torch_compat/torch_private.py): the C bindings the routes' keys are
VariableFunctions: Final = private("torch._C._VariableFunctions")
NNFunctions: Final = private("torch._C._nn")
LinalgFunctions: Final = private("torch._C._linalg")
TensorBase: Final = private("torch._C.TensorBase")

FLOATS: Final = (torch.float16, torch.bfloat16, torch.float32)
HALVES: Final = (torch.float16, torch.bfloat16)


class Router(Protocol):
    """What a handler may ask of the mode that called it."""

    context: TraceContext

    def autocast_dtype(self) -> torch.dtype | None:
        """The lower-precision dtype of the active CUDA autocast region, or None."""
        ...

    def cast(self, t: Any, dtype: torch.dtype, lower: torch.dtype) -> Any:
        """``cached_cast``: ``t`` in ``dtype`` if eligible."""
        ...


Handler = Callable[[Router, Any, Any, tuple[Any, ...], dict[str, Any]], Any]
#: Torch-level callable -> the handler that runs it in the fake cuda step.
ROUTES: Final[dict[Any, Handler]] = {}


def route(*funcs: Any) -> Callable[[Handler], Handler]:
    """Register the decorated handler for ``funcs``; a callable routed twice is refused."""

    def register(handler: Handler) -> Handler:
        for func in funcs:
            if func in ROUTES:
                raise ValueError(f"{func} is routed twice")
            ROUTES[func] = handler
        return handler

    return register


def on_gpu(t: Any) -> bool:
    """Whether ``t`` is a tensor of the modelled GPU (the trace keeps those on meta)."""
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def eligible(t: Any) -> bool:
    """``is_eligible`` (``aten/src/ATen/autocast_mode.h``) for CUDA: a defined floating
    tensor on the GPU, not float64."""
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "meta"
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def bind(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...], defaults: tuple[Any, ...]) -> list[Any]:
    """Positional-or-keyword arguments ``names`` of a call, with ``defaults`` for the
    trailing ones (as many as given)."""
    out = []
    first_default = len(names) - len(defaults)
    for i, name in enumerate(names):
        if i < len(args):
            out.append(args[i])
        elif name in kwargs:
            out.append(kwargs[name])
        else:
            out.append(defaults[i - first_default])
    return out
