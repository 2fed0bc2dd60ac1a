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

from typing import Any, Final

import torch

from pytest_torchmem.tracing.devices.common import COMMON
from pytest_torchmem.tracing.devices.cuda.allocator import AllocatorConfig, CachingAllocator
from pytest_torchmem.tracing.rules import RuleSet, TraceContext

__all__ = ["CUDA", "caching_allocator", "router", "prepare_optimizer"]

#: The CUDA rules; the modules of this package register into it.
CUDA: Final[RuleSet] = COMMON.copy("cuda")


def caching_allocator(context: TraceContext) -> CachingAllocator:
    """A fresh caching allocator configured from ``PYTORCH_CUDA_ALLOC_CONF``."""
    return CachingAllocator(AllocatorConfig.from_env())


def router(context: TraceContext) -> Any:
    """The torch-function mode routing CUDA dispatch decisions for this trace."""
    from pytest_torchmem.tracing.devices.cuda.router import CudaRouter

    return CudaRouter(context)


def prepare_optimizer(optimizer: torch.optim.Optimizer, context: TraceContext) -> None:
    """CUDA parameters default to the foreach implementation.

    ``torch.optim``'s ``_default_to_fused_or_foreach`` picks foreach when every
    parameter is a CUDA tensor and the optimizer is not differentiable; the
    trace's meta tensors would not qualify, so groups that left ``foreach`` and
    ``fused`` unset get ``foreach=True`` here, on the trace's own optimizer.
    """
    for group in optimizer.param_groups:
        if (
            "foreach" in group
            and group.get("foreach") is None
            and not group.get("fused")
            and not group.get("differentiable", False)
        ):
            group["foreach"] = True
