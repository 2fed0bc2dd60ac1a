"""The fake cuda device's torch-function mode: it follows autocast regions and sends each call to its route.

A torch-function mode, active while the fake ``cuda`` step runs: it sees each
``torch.*`` / ``Tensor.*`` / ``torch.nn.functional.*`` call before autograd
and the C++ composites do, so it can send a call to the op a GPU would run.
The trace's tensors live on ``meta``, which stands for the GPU; a handler
calls the CUDA kernel's aten op itself (which has a meta kernel), so autograd
records exactly the node, and the saved tensors, a GPU would. Each routing
rule follows a named function of torch 2.13/2.14, in its own module, registered
in :data:`~pytest_torchmem.engine.tracing.devices.cuda.routes.ROUTES`:

* :mod:`.placement`: factories, copies and ``.cuda()`` that name ``cuda``;
* :mod:`.kernel_choices`: dropout (``native_dropout``), batch and instance norm
  (``cudnn_batch_norm``), softmax of fp16 into fp32 (``half_to_float``);
* :mod:`.sdpa`: the scaled-dot-product-attention backend a GPU of the trace's
  profile picks, called as the composite does;
* :mod:`.rnn`: ``_cudnn_rnn`` for whole sequences, the fused cell kernels;
* :mod:`.autocast`: autocast on cuda, its op lists and casts (see
  :class:`CudaRouter` for how an active CUDA autocast region is recognised on a
  CPU-only torch).

Not routed (a GPU takes another path than the trace): the inference fast paths
of ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention``
(``_transformer_encoder_layer_fwd`` / ``_native_multi_head_attention``, taken
in eval under ``no_grad`` on cuda), packed-sequence RNNs, and RNNs on CUDA
without cuDNN (their per-step fused cells).

Python-level torch functions (``torch.nn.functional.*``,
``torch.functional.*``) are run with the mode still active inside them
(``torch.overrides.redispatch_function``), so that what they call is routed
too (``F.multi_head_attention_forward`` calls ``dropout`` and
``scaled_dot_product_attention``). Every other call passes straight through
after one dictionary look-up.
"""

from __future__ import annotations

import weakref
from typing import Any, Final

import torch
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode
from torch.overrides import TorchFunctionMode

# the modules of routes register their handlers when imported
from pytest_torchmem.engine.tracing.devices.cuda import kernel_choices as _kernel_choices  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import placement as _placement  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import rnn as _rnn  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import rms_norm as _rms_norm  # noqa: F401
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cuda.autocast import AUTOCAST, autocast_policy
from pytest_torchmem.engine.tracing.devices.cuda.placement import names_cuda
from pytest_torchmem.engine.tracing.devices.cuda.routes import ROUTES, TRACE_DEVICE, eligible
from pytest_torchmem.engine.tracing.devices.cuda.sdpa import CUDNN_VERSION, SDPBackend, select_sdp_backend
from pytest_torchmem.engine.tracing.devices.routing import BodyRouting
from pytest_torchmem.engine.tracing.rules import TraceContext

__all__ = ["CUDNN_VERSION", "CudaRouter", "SDPBackend", "autocast_policy", "select_sdp_backend"]

# torch's private names (engine/torch_compat/torch_private.py): autocast's entry points, the
# torch-function mode stack
_ENTER_AUTOCAST: Final = private("torch.amp.autocast_mode._enter_autocast")
_EXIT_AUTOCAST: Final = private("torch.amp.autocast_mode._exit_autocast")
_get_current_function_mode_stack: Final = private("torch.overrides._get_current_function_mode_stack")


def _autocast_nesting() -> int:
    """The autocast nesting level (``at::autocast::nesting``), read without changing it."""
    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level


class CudaRouter(BodyRouting, PreDispatchTorchFunctionMode):
    """Sends calls that CUDA dispatch resolves differently to the CUDA kernels' ops.

    **Autocast on cuda.** On a CPU-only torch, ``torch.autocast("cuda", ...)``
    finds ``amp_definitely_not_available()``, warns and enters *disabled*;
    within the trace it enters enabled instead, as on a GPU
    (:func:`~pytest_torchmem.engine.tracing.devices.cuda.gpu_view.autocast_opens_cuda_regions`).
    The regions are also followed as they open and close, for a region entered
    disabled where that is not in force: ``torch.autocast.__enter__`` /
    ``__exit__`` report ``(device_type, dtype, enabled, cache_enabled)`` to
    every ``PreDispatchTorchFunctionMode`` on the torch-function mode stack (the
    hook ``torch.export`` uses to keep autocast in pre-dispatch graphs), which
    this mode is. CUDA autocast is then active with the dtype of the innermost
    open ``cuda`` region, none where that region is disabled
    (``autocast("cuda", enabled=False)``, as transformers' rotary embeddings
    force float32); CPU regions leave it alone, as they leave CUDA tensors
    alone. Limit: a region entered before the trace starts is inferred from
    the nesting level (above 0 with CPU autocast off).
    The cache of cast leaf weights is dropped when the nesting level is back
    at 0, as ``torch.autocast.__exit__`` does with ``clear_autocast_cache``.
    """

    def __init__(self, context: TraceContext) -> None:
        TorchFunctionMode.__init__(self)
        # PreDispatchTorchFunctionMode's own state, unused: this mode records no graph.
        self.tracer = None
        self.enter_autocast_nodes = []
        self.context = context
        # id(leaf weight) -> (weak reference to it, its cast), as at::autocast's cached_casts
        self._cast_cache: dict[int, tuple[weakref.ref[Any], torch.Tensor]] = {}
        # Python-level functions whose body runs now with the mode active
        self._running: set[Any] = set()
        # Open autocast regions: (device type, dtype)
        self._regions: list[tuple[str, torch.dtype]] = []
        self._outer_cuda: torch.dtype | None = None
        if torch.is_autocast_enabled("cuda") or (
            _autocast_nesting() > 0 and not torch.is_autocast_enabled("cpu")
        ):
            self._outer_cuda = torch.get_autocast_dtype("cuda")

    def __torch_function__(self, func, types_, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _ENTER_AUTOCAST or func is _EXIT_AUTOCAST:
            return self._autocast_event(func, args, kwargs)
        policy = AUTOCAST.get(func)
        if policy is not None:
            dtype = self.autocast_dtype()
            if dtype is not None:
                args, kwargs = policy(self, dtype, args, kwargs)
        handler = ROUTES.get(func)
        if handler is not None:
            return handler(self, func, types_, args, kwargs)
        if "device" in kwargs and names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": TRACE_DEVICE}
        if self.runs_body(func):
            return self.run_body(func, types_, args, kwargs)
        return func(*args, **kwargs)

    # -- autocast ---------------------------------------------------------------

    def _autocast_event(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An autocast region opens or closes.

        From ``autocast.__enter__``/``__exit__`` the region is already entered or
        left (this mode is still on the stack): only record it. Called through
        ``torch.amp._enter_autocast``/``_exit_autocast`` (this mode popped), enter
        or leave it too.
        """
        notified = self in _get_current_function_mode_stack()
        result = None if notified else func(*args, **kwargs)
        if func is _ENTER_AUTOCAST:
            device = args[0] if args else kwargs.get("device_type")
            dtype = args[1] if len(args) > 1 and args[1] is not None else torch.get_autocast_dtype(device)
            enabled = args[2] if len(args) > 2 else kwargs.get("enabled", True)
            self._regions.append((device, dtype if enabled else None))
        elif self._regions:
            self._regions.pop()
            if _autocast_nesting() == 0:
                self._cast_cache.clear()
        return result

    def autocast_dtype(self) -> torch.dtype | None:
        """The lower-precision dtype of the active CUDA autocast region, or None (none
        open, or the innermost one disabled)."""
        if torch.is_autocast_enabled("cuda"):
            return torch.get_autocast_dtype("cuda")
        for device, dtype in reversed(self._regions):
            if device == "cuda":
                return dtype
        return self._outer_cuda

    def cast(self, t: Any, dtype: torch.dtype, lower: torch.dtype) -> Any:
        """``cached_cast`` (``autocast_mode.h``): ``t`` in ``dtype`` if eligible."""
        if isinstance(t, (list, tuple)):
            return type(t)(self.cast(v, dtype, lower) for v in t)
        if not eligible(t) or t.dtype == dtype:
            return t
        cacheable = (
            dtype == lower
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return t.to(dtype)
        hit = self._cast_cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        cast = t.to(dtype)
        self._cast_cache[id(t)] = (weakref.ref(t), cast)
        return cast
