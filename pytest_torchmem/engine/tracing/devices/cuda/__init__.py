"""The fake ``cuda`` device model.

Traced on fake meta tensors (a CPU-only torch aborts on autograd over cuda
tensors), it adds what a GPU does differently:

* :mod:`.router`: a torch-function mode that sends the calls CUDA dispatch
  resolves differently to the CUDA kernels' ops (dropout, batch norm, the
  attention backend, RNNs, autocast);
* per-op rules in :data:`CUDA` (library workspaces, kernel temporaries);
* :mod:`.allocator`: the caching allocator every storage is charged through
  (block sizes, reserved segments);
* :mod:`.profiles`: the GPU whose architecture the rules follow.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_torchmem.engine.tracing.devices.cuda import kernels as _kernels  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import masks as _masks  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import temporaries as _temporaries  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import workspaces as _workspaces  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda.allocator import AllocatorConfig, CachingAllocator
from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.tracing.rules import TraceContext

__all__ = ["CUDA", "caching_allocator", "router", "prepare_optimizer"]



def caching_allocator(context: TraceContext) -> CachingAllocator:
    """A fresh caching allocator configured from ``PYTORCH_CUDA_ALLOC_CONF``."""
    return CachingAllocator(AllocatorConfig.from_env())


def router(context: TraceContext) -> Any:
    """The torch-function mode routing CUDA dispatch decisions for this trace."""
    from pytest_torchmem.engine.tracing.devices.cuda.router import CudaRouter

    return CudaRouter(context)


def prepare_optimizer(optimizer: torch.optim.Optimizer, context: TraceContext) -> None:
    """The foreach default that ``torch.optim`` picks for CUDA parameters.

    Each optimizer that calls ``_default_to_fused_or_foreach`` (torch/optim,
    2.13) turns foreach on when every parameter is a plain ``Tensor`` /
    ``Parameter`` on a foreach-capable device (cuda) and the call is not
    differentiable; none of them defaults to fused (they pass
    ``use_fused=False``). The trace's meta fake tensors would not qualify, so
    the groups that would get foreach on a GPU get ``foreach=True`` here, on
    the trace's own optimizer, following each optimizer's own condition:

    * SGD, Adam, AdamW, Adagrad: only when ``foreach`` and ``fused`` are both
      unset; SGD ignores ``differentiable`` for the choice (it passes
      ``differentiable=False``); Adam/AdamW keep foreach off for a tensor ``lr``
      without ``capturable``;
    * Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop: when ``foreach`` is
      unset and the group is not differentiable;
    * others (LBFGS, SparseAdam, Adafactor, ...) never default to foreach.

    Where the step counters live follows from the trace itself: foreach and
    single-tensor Adam keep ``state["step"]`` on the host (``torch.tensor(0.0)``,
    uncharged), fused or capturable ones on the parameter's device.
    """
    optim = torch.optim
    both_unset = (optim.SGD, optim.Adam, optim.AdamW, optim.Adagrad)
    foreach_unset = (
        optim.Adadelta, optim.Adamax, optim.ASGD, optim.NAdam, optim.RAdam, optim.RMSprop, optim.Rprop,
    )
    if not isinstance(optimizer, both_unset + foreach_unset):
        return
    for group in optimizer.param_groups:
        if group.get("foreach") is not None:
            continue
        if isinstance(optimizer, both_unset):
            if group.get("fused") is not None:
                continue
            if not isinstance(optimizer, optim.SGD) and group.get("differentiable", False):
                continue
            if (
                isinstance(optimizer, optim.Adam)
                and isinstance(group.get("lr"), torch.Tensor)
                and not group.get("capturable", False)
            ):
                continue
        elif group.get("differentiable", False):
            continue
        group["foreach"] = True
