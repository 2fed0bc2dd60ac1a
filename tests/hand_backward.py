"""``loss.backward()`` without autograd's engine: each node of the graph called from Python.

On a CUDA build of torch with no GPU, autograd's engine refuses fake ``cuda`` tensors
before it runs any node: a graph with a node on the accelerator makes
``Engine::compute_dependencies`` stash the accelerator's current streams, which asks
CUDA's hooks whether device 0 has a primary context, and with no device that raises
("hasPrimaryContext expects a valid device index"). Registering another accelerator
(``torch.utils.backend_registration``'s Python PrivateUse1 backend) moves that question
elsewhere, but then building a cuda tensor's autograd metadata asks the CUDA runtime for
its current stream and aborts the process: there is no way round the engine that keeps
the interpreter alive. The nodes themselves run: called one by one from Python, in the
engine's order (a node is ready once every edge into it has delivered, the ready node
with the highest sequence number first, ``AccumulateGrad`` at once), each runs the
backward formulas that CUDA dispatch picks.

What this cannot do: release a node's saved tensors before calling it (the engine's
``will_release_variables``; no Python API), so a node that would take a saved tensor
over (cuDNN batch norm's and RNNs' reserve) clones it instead; and the live bytes during
and after the backward are not the engine's (saved tensors are kept to the end). Used by
``benchmarks/cuda_routing.py`` (reference traces) and ``tests/device_audit.py`` (the
device audit), which compare ops, not live bytes.
"""

from __future__ import annotations

import heapq
import sys
from collections import Counter
from typing import Any

import torch

__all__ = ["backward_by_hand"]


def _dense(t: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense_or_false`` (torch._prims_common, from 2.11; 2.10 has
    ``is_non_overlapping_and_dense``, the same for tensors of concrete sizes)."""
    import torch._prims_common as prims_common

    check = getattr(prims_common, "is_non_overlapping_and_dense_or_false", None)
    return bool(check(t)) if check is not None else bool(prims_common.is_non_overlapping_and_dense(t))


def _obeys_layout_contract(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    """``torch::autograd::utils::obeys_layout_contract`` (accumulate_grad.h)."""
    if _dense(variable):
        for size, stride, vstride in zip(grad.shape, grad.stride(), variable.stride()):
            if size != 1 and stride != vstride:
                return False
            if size == 1 and stride == 0:
                return False
        return True
    return grad.is_contiguous()


def _accumulate_grad(variable: torch.Tensor, grad: torch.Tensor) -> None:
    """``AccumulateGrad::accumulateGrad`` for dense tensors, grad mode off: steal the
    incoming gradient when it obeys the layout contract (the engine's buffer holds
    its only reference), else copy it into the variable's layout; add in place
    into an existing ``.grad``."""
    if variable.grad is None:
        if _obeys_layout_contract(grad, variable):
            variable.grad = grad.detach()
        elif _dense(variable):
            variable.grad = grad.new_empty_strided(variable.shape, variable.stride()).copy_(grad)
        else:
            variable.grad = grad.clone(memory_format=torch.contiguous_format)
    else:
        variable.grad.add_(grad)


def _buffer_only(t: torch.Tensor) -> bool:
    """Whether the engine's input buffer would add into ``t`` in place
    (``InputBuffer::accumulate``, ``can_accumulate_inplace``): dense, and no one
    but the buffer holds it or its storage. (The engine never does for tensor
    subclasses; the tracker makes it do so, as for plain tensors.)"""
    return (
        _dense(t)
        and t._use_count() == 1
        and sys.getrefcount(t) <= 3  # the buffer's list, the argument, getrefcount's own
        # the tensor's reference and the one of the storage object asked here
        and torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2
    )


def backward_by_hand(root: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
    """``root.backward(gradient)`` with each autograd node called directly."""
    from torch.autograd.function import BackwardCFunction

    node = root.grad_fn
    if node is None:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    if gradient is None:
        gradient = torch.ones_like(root, memory_format=torch.preserve_format)
    dependencies: Counter[Any] = Counter()
    inputs: dict[Any, int] = {}
    seen, stack = {node}, [node]
    while stack:
        current = stack.pop()
        for child, nr in current.next_functions:
            if child is None:
                continue
            dependencies[child] += 1
            inputs[child] = max(inputs.get(child, 0), nr + 1)
            if child not in seen:
                seen.add(child)
                stack.append(child)

    def width(n: Any) -> int:
        meta = getattr(n, "_input_metadata", None)
        return len(meta) if meta is not None else inputs.get(n, 1)

    buffers: dict[Any, list[Any]] = {node: [gradient] + [None] * (width(node) - 1)}
    del gradient
    order = 0
    ready = [(-node._sequence_nr(), order, node)]
    with torch.no_grad():
        while ready:
            _, _, current = heapq.heappop(ready)
            grads = buffers.pop(current)
            if type(current).__name__ == "AccumulateGrad" or current.name().endswith("AccumulateGrad"):
                if grads[0] is not None:
                    _accumulate_grad(current.variable, grads.pop(0))
                continue
            if isinstance(current, BackwardCFunction):
                outs = current.apply(*grads)
            else:
                outs = current(*grads)
            del grads
            if not isinstance(outs, (tuple, list)):
                outs = (outs,)
            for (child, nr), grad in zip(current.next_functions, outs):
                if child is None:
                    continue
                meta = getattr(child, "_input_metadata", None)
                if grad is not None and meta is not None:
                    # the engine's validate_outputs: reduce broadcast gradients, cast dtypes
                    expected = meta[nr]
                    if tuple(grad.shape) != tuple(expected.shape):
                        grad = grad.sum_to_size(expected.shape)
                    if grad.dtype != expected.dtype:
                        grad = grad.to(expected.dtype)
                slot = buffers.setdefault(child, [None] * width(child))
                if grad is not None:
                    if slot[nr] is None:
                        slot[nr] = grad
                    elif _buffer_only(slot[nr]):
                        slot[nr].add_(grad)
                    else:
                        slot[nr] = slot[nr] + grad
                del grad
                dependencies[child] -= 1
                if dependencies[child] == 0:
                    order += 1
                    heapq.heappush(ready, (-child._sequence_nr(), order, child))
            del outs
