"""Collectives of ``torch.distributed`` on fake tensors, as a rank's device sees them.

Under ``parallel=`` the step runs over a fake process group: no other rank
exists and no data moves. What a rank's memory sees of a collective is what
its kernel allocates, so each in-place ``c10d`` op (``allreduce_``,
``broadcast_``, ``_allgather_base_``, ``_reduce_scatter_base_``, ...) returns
its output tensors as they are, allocating nothing, with a work item that is
already complete and whose future holds those tensors (as gloo's and NCCL's
do: DDP's reducer reads the bucket back from it). The functional collectives
(``_c10d_functional.all_reduce``, ``all_gather_into_tensor``, used by DTensor)
keep their fake kernels, which allocate the output the real ones allocate on
the calling thread; ``wait_tensor`` returns the tensor it is given, as its
kernel does (the fake one makes a new one).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["register_collectives"]


def _done(value: Any) -> Any:
    """A completed work item whose future holds ``value``, boxed as c10d ops return it."""
    _create_work_from_future = private("torch._C._distributed_c10d._create_work_from_future")
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(value)
    return _create_work_from_future(future).boxed()


def _first_with_work(call: OpCall) -> Any:
    return call.args[0], _done(call.args[0])


def _work_only(call: OpCall) -> Any:
    return _done(None)


def _waited(call: OpCall) -> Any:
    # wait_tensor hands back the tensor it waited for (the kernel returns its input)
    return call.args[0]


def register_collectives(rules: RuleSet) -> None:
    """Register the in-place ``c10d`` collectives into ``rules``."""
    if not dist.is_available():
        return
    c10d = torch.ops.c10d
    rules.implementation(
        c10d.allreduce_.default,
        c10d.broadcast_.default,
        c10d.scatter_.default,
        c10d.alltoall_.default,
        # these write into their first argument (a tensor, or lists of tensors)
        c10d.allgather_.default,
        c10d._allgather_base_.default,
        c10d.reduce_scatter_.default,
        c10d._reduce_scatter_base_.default,
    )(_first_with_work)
    rules.implementation(
        c10d.reduce_.default,
        c10d.gather_.default,
        c10d.alltoall_base_.default,
        c10d.barrier.default,
        c10d.send.default,
        c10d.recv_.default,
        c10d.recv_any_source_.default,
    )(_work_only)
    rules.implementation(torch.ops._c10d_functional.wait_tensor.default)(_waited)
