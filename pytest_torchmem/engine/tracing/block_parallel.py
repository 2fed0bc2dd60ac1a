"""Blocks under ``parallel=`` (block_replay.py): which are FSDP2's units, whose own hooks
are all their ``fully_shard`` state's (:func:`fsdp_state`); whether FSDP2 takes a unit's
gradients off it after each backward (:func:`moved_after_backward`); the hooks tensor
parallel puts on a module, compared by what they do (:func:`parallel_style_hook`), and
any others (:func:`foreign_hooks`, :func:`hooked`); DTensor's own autograd functions and
a replayed DTensor gradient (:func:`dtensor_function`, :func:`local_of`,
:func:`dtensor_of`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.torch_compat.torch_private import present, private
from pytest_torchmem.engine.tracing.replay_state import own_hooks

__all__ = [
    "COMPOSABLE_STATE", "dtensor_function", "dtensor_of", "foreign_hooks", "fsdp_state", "hooked", "local_of",
    "moved_after_backward", "parallel_style_hook",
]


#: How torch's composable APIs (``fully_shard``) name the state and registry they put in a
#: module's ``__dict__`` (``torch.distributed._composable.contract``: a uuid follows).
COMPOSABLE_STATE: Final = "__composable_api_state_key_"


def fsdp_state(block: nn.Module) -> Any:
    """The FSDP2 state of ``block`` where ``fully_shard`` made it a unit and every hook of
    its own is that state's (its forward's pre-hook and hook); else None."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(block, FSDPModule):
        return None
    state = fully_shard.state(block)
    hooks = own_hooks(block)
    if state is None or not hooks or any(getattr(hook, "__self__", None) is not state for hook in hooks):
        return None
    return state


def moved_after_backward(block: nn.Module) -> bool:
    """Whether FSDP2 moves the gradients of ``block``'s gathered parameters into gradients of
    its reduce dtype after a backward that does not reduce them (:meth:`BlockReplay._grads_leave`)."""
    moves = "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.to_accumulated_grad_if_needed"
    group = getattr(fsdp_state(block), "_fsdp_param_group", None)
    if group is None or not present(moves):
        return False
    return all(
        param.reduce_dtype is not None and param.reduce_dtype != (param.param_dtype or param.orig_dtype)
        for param in group.fsdp_params
    )


def foreign_hooks(module: nn.Module) -> bool:
    """Under ``parallel=``: whether ``module`` is DDP, or carries hooks neither FSDP2 nor
    tensor parallel put there (``replicate``'s, a user's)."""
    if fsdp_state(module) is not None:
        return False
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel) or _other_hooks(module)


def _other_hooks(module: nn.Module) -> bool:
    """Whether ``module`` carries hooks of its own that are not tensor parallel's."""
    return any(parallel_style_hook(hook) is None for hook in own_hooks(module))


def hooked(block: nn.Module, unit: bool) -> bool:
    """Whether one of ``block``'s modules carries hooks, but an FSDP2 unit's own (``unit``:
    the block is one, under ``parallel=``) and tensor parallel's."""
    modules = block.modules() if not unit else (m for child in block.children() for m in child.modules())
    return any(_other_hooks(m) for m in modules)


#: Where tensor parallel's ``distribute_module`` (``torch.distributed.tensor``'s public
#: function) makes the hooks it puts on a module.
_PARALLEL_STYLE_HOOKS: Final = "torch.distributed.tensor._api"


def parallel_style_hook(hook: Any) -> tuple[Any, ...] | None:
    """A hook tensor parallel put on a module (``parallelize_module``: the redistribution
    of its input or output, as its ``ParallelStyle`` says), as a value equal between
    modules parallelised alike; None for any other hook. Such a hook keeps no state: what
    it does is ops on the tensors it is given, which run inside a replayed block's forward."""
    code = getattr(hook, "__code__", None)
    if (
        code is None
        or getattr(hook, "__module__", None) != _PARALLEL_STYLE_HOOKS
        or not hook.__qualname__.startswith("distribute_module.<locals>.")
    ):
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in hook.__closure__ or ())))
    prepare = cells.get("input_fn", cells.get("output_fn"))
    if set(cells) - {"input_fn", "output_fn", "device_mesh"}:
        return None
    if isinstance(prepare, functools.partial):
        return (code, id(cells.get("device_mesh")), prepare.func, prepare.args, tuple(sorted(prepare.keywords.items())))
    return (code, id(cells.get("device_mesh")), prepare)


#: DTensor's own autograd functions (``to_local``, ``from_local``, ``redistribute``).
_DTENSOR_FUNCTIONS: Final = (
    "torch.distributed.tensor._api._ToTorchTensor",
    "torch.distributed.tensor._api._FromTorchTensor",
    "torch.distributed.tensor._redistribute.Redistribute",
)


def dtensor_function(node: Any) -> bool:
    """Whether ``node`` is one of DTensor's own autograd functions: its backward
    redistributes the gradient it gets, ops and collectives a traced block's backward
    records."""
    cls = getattr(node, "_forward_cls", None)
    return cls is not None and cls in _dtensor_functions()


@functools.cache
def _dtensor_functions() -> frozenset[type]:
    """:data:`_DTENSOR_FUNCTIONS`, resolved once (a recorded block's graph asks of each of
    its custom nodes)."""
    return frozenset(private(path) for path in _DTENSOR_FUNCTIONS)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (whose storage is the rank's), any other tensor itself."""
    return getattr(t, "_local_tensor", t) if type(t).__name__ == "DTensor" else t


def dtensor_of(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """A DTensor of ``local`` laid out as ``spec`` says (a replayed gradient of a parameter
    tensor parallel sharded)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)
