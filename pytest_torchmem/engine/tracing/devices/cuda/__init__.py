"""The fake ``cuda`` device model.

Traced on fake meta tensors (a CPU-only torch aborts on autograd over cuda
tensors), it adds what a GPU does differently:

* :mod:`.router`: a torch-function mode that sends the calls CUDA dispatch
  resolves differently to the CUDA kernels' ops, through the routes of
  :mod:`.routes` (:mod:`.placement`, :mod:`.kernel_choices` for dropout, batch norm
  and softmax, :mod:`.sdpa` for the attention backend, :mod:`.rnn`, :mod:`.autocast`);
* per-op rules in :data:`CUDA`: library workspaces (:mod:`.workspaces`) and kernel
  temporaries (:mod:`.temporaries`, ``unique``'s in :mod:`.unique`), a reduction's launch modelled in :mod:`.reduce_launch`,
  cub's temporary storage in :mod:`.cub_storage`;
* :mod:`.allocator`: the caching allocator every storage is charged through
  (block sizes, reserved segments), with its settings (:mod:`.allocator_config`),
  constants (:mod:`.allocator_constants`) and blocks (:mod:`.allocator_blocks`);
* :mod:`.profiles`: the GPU whose architecture the rules follow;
* :mod:`.gpu_view`: what the traced code sees of the device (a GPU), and torch's own
  decisions by a device's kernels (foreach, fused and capturable optimizers, gradient
  clipping), taken as on the GPU.
"""

from __future__ import annotations

from typing import Any

from pytest_torchmem.engine.tracing.devices.cuda import kernels as _kernels  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import masks as _masks  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import pinned as _pinned  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import temporaries as _temporaries  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import unique as _unique  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda import workspaces as _workspaces  # noqa: F401
from pytest_torchmem.engine.tracing.devices.cuda.allocator import AllocatorConfig, CachingAllocator
from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA

# (imported with the device, as its other rule modules are: imported lazily, by the first
# trace, the router and its routes' modules could be dropped from sys.modules without the
# package (pytester's in-process runs drop what a run imported); imported again, the
# router's ``from package import module`` then took the package's stale attributes, whose
# handlers (dropout's among them) sat in the old ROUTES, not in the new one it read)
from pytest_torchmem.engine.tracing.devices.cuda.router import CudaRouter
from pytest_torchmem.engine.tracing.rules import TraceContext

__all__ = ["CUDA", "caching_allocator", "router"]


def caching_allocator(context: TraceContext) -> CachingAllocator:
    """A fresh caching allocator configured from ``PYTORCH_CUDA_ALLOC_CONF``."""
    return CachingAllocator(AllocatorConfig.from_env())


def router(context: TraceContext) -> Any:
    """The torch-function mode routing CUDA dispatch decisions for this trace."""
    return CudaRouter(context)
