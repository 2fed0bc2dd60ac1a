"""Sparse tensors' ops that fake tensors follow as every device runs them.

A sparse tensor's memory is its parts (``engine/user/layouts.py``). These ops make
nothing new: they read a part or a number (``_indices``, ``_nnz``), set a
flag (``_coalesced_``), or make a sparse tensor that shares the parts it is
given (``_sparse_coo_tensor_with_dims_and_tensors``, which every COO
constructor comes to, and which allocates nothing). Their fake kernels are
right; registered as sparse rules, the trace knows it (an op on a sparse
tensor without a rule is listed in ``unsupported``, see ``rules.py``). What
the devices' kernels allocate for the others is each device's own rules'
(``cpu/sparse.py``); the fake cuda device has none.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["FAITHFUL", "refuse_memory_format", "register_sparse", "register_unmodelled_sparse"]

aten = torch.ops.aten

#: Ops on sparse tensors whose fake kernels are right, and that allocate nothing.
FAITHFUL: Final = (
    # parts and numbers
    aten._indices.default,
    aten._values.default,
    aten.indices.default,
    aten.values.default,
    aten.crow_indices.default,
    aten.col_indices.default,
    aten.ccol_indices.default,
    aten.row_indices.default,
    aten._nnz.default,
    aten.is_coalesced.default,
    aten.sparse_dim.default,
    aten.dense_dim.default,
    aten._dimI.default,
    aten._dimV.default,
    # flags and aliases: the same parts
    aten._coalesced_.default,
    aten.detach.default,
    aten.alias.default,
    # a COO tensor holding the parts it is given (SparseTensor.cpp: alias_into_sparse)
    aten._sparse_coo_tensor_with_dims_and_tensors.default,
)


def register_sparse(rules: RuleSet) -> None:
    """Register :data:`FAITHFUL` into ``rules``."""
    rules.sparse(*FAITHFUL)(_fake_kernel)


def _fake_kernel(call: OpCall) -> Any:
    return call.default()


#: ``c10::MemoryFormat``'s names, as ATen's messages print them.
_FORMATS: Final = {
    torch.contiguous_format: "Contiguous",
    torch.preserve_format: "Preserve",
    torch.channels_last: "ChannelsLast",
    torch.channels_last_3d: "ChannelsLast3d",
}


def refuse_memory_format(call: OpCall) -> None:
    """``clone_sparse`` (``SparseTensor.cpp``, every device) refuses a memory format, as
    eagerly: ``x.contiguous()`` on a sparse tensor (``nn.LayerNorm``, a convolution)
    raises ``unsupported memory format option Contiguous``."""
    memory_format = call.kwargs.get("memory_format")
    if memory_format is not None:
        raise RuntimeError(f"unsupported memory format option {_FORMATS.get(memory_format, memory_format)}")


def register_unmodelled_sparse(rules: RuleSet) -> None:
    """For a device whose sparse kernels are not modelled: what its kernels refuse is
    refused as eagerly; the rest is listed as any op on a sparse tensor is."""
    rules.sparse(aten.clone.default)(_clone_unfollowed)


def _clone_unfollowed(call: OpCall) -> Any:
    refuse_memory_format(call)
    tracer = call.context.tracer if call.context is not None else None
    return call.default() if tracer is None else tracer.unfollowed_sparse(call)
