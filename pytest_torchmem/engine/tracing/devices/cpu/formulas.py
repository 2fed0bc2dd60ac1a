"""CPU rules: backward formulas whose eager algorithm the fake trace takes only by replica.

Some backward formulas (torch 2.13) pick their algorithm by
``areAnyTensorSubclassLike(...)`` and by tensor values (``.item()``,
``nonzero()``). Fake tensors count as tensor subclasses, so the node's own
formula always runs the composite-compliant algorithm, which the eager CPU
step does not. Each formula below is replaced by a Python replica of its eager
branch (a :class:`~pytest_torchmem.engine.tracing.rules.Formula`): its ops run
through the trace, so the value-dependent choices (``.item()``, ``nonzero``)
are answered from the values the trace knows, and listed in ``unsupported``
where it does not. Replicas, line by line after ``FunctionsManual.cpp`` and
``ReduceOps.cpp``:

* ``evenly_distribute_backward`` (``max()``, ``min()``, ``median()``,
  ``nanmedian()`` without a dim): ``grad.new_zeros(...).masked_fill_(mask, grad /
  mask.sum())`` with ``mask`` chosen by ``value.isnan().item()`` (on CUDA the
  eager step takes the composite algorithm too: the rule is the CPU's);
* ``cumprod_backward``: ``reversed_cumsum(output * grad).div(input)`` when
  ``(input == 0).any().item()`` is false, else the masked O(n) algorithm;
* ``prod_backward``: by ``(input == 0).nonzero()`` (``prod()``) or the zeros'
  count (``prod(dim)``): ``grad * (result / input)`` without zeros, else
  ``prod_safe_zeros_backward``;
* ``masked_fill_backward`` (the gradient of a tensor ``value``):
  ``grad.masked_select(mask).sum()`` (a value-sized selection).

Where a replica does not run (its saved tensors have unpack hooks, a
checkpoint's; ``cumprod``'s backward with grad mode on), the node's own formula
is counted and an op found only in its composite algorithm, run under the node,
lists the call in ``unsupported`` (never a silent miss).

One more formula takes its composite-compliant algorithm for any subclass, not
by values, but keeps its pieces alive across a loop, so that no later rule can
give back what it holds (listed):

* ``householder_product_backward`` (``FunctionsManual.cpp``;
  ``linalg.householder_product``, ``ormqr``): eagerly each column's gradient is
  copied into ``zeros_like(input)`` and freed; traced: all columns are kept
  and joined with ``cat``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    REPLICA,
    FormulaCall,
    Inexact,
    OpCall,
    Steps,
)

# torch's private names (engine/torch_compat/torch_private.py)
_current_autograd_node: Final = private("torch._C._current_autograd_node")

aten = torch.ops.aten

_EVENLY: Final = frozenset({"MaxBackward1", "MinBackward1", "MedianBackward0", "NanmedianBackward0"})

_HOUSEHOLDER: Final = "householder_product_backward"

#: op -> {autograd node whose formula runs it only on its traced path: the formula}.
_TRACED_ONLY: Final = {
    aten.isnan.default: dict.fromkeys(_EVENLY, "evenly_distribute_backward"),
    aten.bitwise_not.default: {"CumprodBackward0": "cumprod_backward"},
    # torch 2.10, 2.11: the composite cumprod_backward is the O(n^2) loop, joined by stack
    aten.stack.default: {"CumprodBackward0": "cumprod_backward"},
    aten.cat.default: {
        "ProdBackward0": "prod_backward",
        "ProdBackward1": "prod_backward",
        "LinalgHouseholderProductBackward0": _HOUSEHOLDER,
        "OrmqrBackward0": _HOUSEHOLDER,
    },
    aten.scalar_tensor.default: {"MaskedFillBackward1": "masked_fill_backward"},
}


@CPU.scratch(*_TRACED_ONLY)
def _traced_only(call: OpCall) -> Steps:
    node = _current_autograd_node()
    if node is None or node.metadata.get(REPLICA, False):
        return [OUTPUTS]
    formula = _TRACED_ONLY[call.func].get(node.name())
    if formula is None or (call.func is aten.stack.default and torch.is_grad_enabled()):
        # with grad mode on (double backward) eager takes that loop too
        return [OUTPUTS]
    why = (
        "keeps every column's gradient for a cat where the eager CPU step writes them into "
        "zeros_like(input) one by one"
        if formula == _HOUSEHOLDER
        else "takes another algorithm eagerly on the CPU, chosen by tensor values"
    )
    return [
        Inexact(f"{formula} (under {node.name()}) {why}; the traced composite-compliant one is counted"),
        OUTPUTS,
    ]


# -- evenly_distribute_backward ---------------------------------------------------------


def _evenly_distribute(call: FormulaCall) -> Sequence[Any]:
    """``self: evenly_distribute_backward(grad, self, result)``, its CPU branch."""
    grad, input, value = call.grads[0], call.saved("self"), call.saved("result")
    value_isnan = value.isnan()  # held to the end of the statement that picks the mask
    mask = input.isnan() if value_isnan.item() else aten.eq.Tensor(input, value)
    del value_isnan
    zeros = grad.new_zeros(input.shape, dtype=input.dtype)
    count = mask.sum()
    share = grad / count
    return (zeros.masked_fill_(mask, share),)


for _op, _node in (
    (aten.max.default, "MaxBackward1"),
    (aten.min.default, "MinBackward1"),
    (aten.median.default, "MedianBackward0"),
    (aten.nanmedian.default, "NanmedianBackward0"),
):
    CPU.formula(_op, node=_node, saved=("self", "result"))(_evenly_distribute)


# -- cumprod_backward ---------------------------------------------------------------------


def _reversed_cumsum(w: torch.Tensor, dim: int) -> torch.Tensor:
    """``w.flip(dim).cumsum(dim).flip(dim)``; C++ keeps the chain's temporaries to the
    end of the statement, Python frees each once the next call returns: named here."""
    flipped = w.flip(dim)
    summed = flipped.cumsum(dim)
    return summed.flip(dim)


@CPU.formula(
    aten.cumprod.default,
    node="CumprodBackward0",
    saved=("self", "result"),
    # the O(n^2) loop taken with grad mode on (double backward) is not replicated
    applies=lambda call: not torch.is_grad_enabled(),
)
def _cumprod(call: FormulaCall) -> Sequence[Any]:
    """``self: cumprod_backward(grad.to(self.scalar_type()), self, dim, result)``
    (``ReduceOps.cpp``). Temporaries are named where C++ holds them to the end of
    a statement."""
    input, output, dim = call.saved("self"), call.saved("result"), call.saved("dim")
    grad = call.grads[0].to(input.dtype)
    if input.numel() <= 1:
        return (grad,)
    dim = dim % input.dim()
    if input.shape[dim] == 1:
        return (grad,)
    w = output * grad
    is_zero = aten.eq.Scalar(input, 0)
    if aten.any.default(is_zero).item() == 0:
        return (_reversed_cumsum(w, dim).div(input),)
    # with zeros (grad mode off): the masked O(n) algorithm; torch 2.13 writes each
    # part with at::where into a new grad_input, 2.10 to 2.12 scatter each part into
    # it in place (masked_scatter_ of a masked_select). Statement by statement, as
    # its allocations and frees show (ReduceOps.cpp's comments explain the algebra).
    if torch_minor() < (2, 12):
        return (_cumprod_zeros_scattered(input, output, grad, w, is_zero, dim),)
    grad_input = torch.zeros(input.shape, dtype=grad.dtype, device=grad.device)
    cumsum = is_zero.cumsum(dim)
    # case k < z1: everything before the first zero
    mask = aten.eq.Scalar(cumsum, 0)
    outside = ~mask
    masked = w.masked_fill(outside, 0.0)
    before_zero = _reversed_cumsum(masked, dim)
    del outside, masked
    grad_input = torch.where(mask, before_zero.div_(input), grad_input)
    # case k = z1: the first zero
    mask = aten.eq.Scalar(cumsum, 1)
    first_zero_index, first_zero_mask, products, held = _first_zero_products(input, mask, dim)
    del held
    other = aten.ne.Scalar(cumsum, 1)
    grad_after = grad.masked_fill(other, 0.0)
    del other
    before = aten.sub.Scalar(first_zero_index, 1).relu_()
    gathered = torch.gather(output, dim, before)
    at_start = aten.eq.Scalar(first_zero_index, 0)
    gathered.masked_fill_(at_start, 1.0)
    del at_start, before
    sums = products.mul_(grad_after).sum(dim, keepdim=True).mul_(gathered)
    del grad_after
    grad_input = torch.where(first_zero_mask, sums, grad_input)
    return (grad_input,)


def _first_zero_products(
    input: torch.Tensor, mask: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Case k = z1 of ``cumprod_backward``, alike in every release, given ``mask =
    cumsum == 1``: the first zero's index and mask (taken out of ``mask`` in place),
    and the cumulative products of ``input`` with every element outside ``mask`` set
    to 1. The statement's temporaries still held come back too, for the caller to
    free where its release does."""
    first_zero_index = mask.max(dim, keepdim=True)[1]
    first_zero_mask = torch.zeros_like(mask).scatter_(dim, first_zero_index, 1).logical_and_(mask)
    mask &= ~first_zero_mask
    outside = ~mask
    filled = input.masked_fill(outside, 1.0)
    return first_zero_index, first_zero_mask, filled.cumprod(dim), (outside, filled)


def _cumprod_zeros_scattered(
    input: torch.Tensor, output: torch.Tensor, grad: torch.Tensor, w: torch.Tensor, is_zero: torch.Tensor, dim: int
) -> torch.Tensor:
    """``cumprod_backward`` with zeros up to torch 2.11: each part ``masked_select``-ed
    and ``masked_scatter_``-ed into ``grad_input``, every temporary of the statement
    held until it ends."""
    grad_input = torch.zeros(input.shape, dtype=grad.dtype, device=grad.device)
    cumsum = is_zero.cumsum(dim)
    # case k < z1: everything before the first zero
    mask = aten.eq.Scalar(cumsum, 0)
    outside = ~mask
    masked = w.masked_fill(outside, 0.0)
    before_zero = _reversed_cumsum(masked, dim).div_(input)
    selected = before_zero.masked_select(mask)
    grad_input.masked_scatter_(mask, selected)
    del outside, masked, before_zero, selected
    # case k = z1: the first zero
    mask = aten.eq.Scalar(cumsum, 1)
    first_zero_index, first_zero_mask, products, held = _first_zero_products(input, mask, dim)
    other = aten.ne.Scalar(cumsum, 1)
    grad_after = grad.masked_fill(other, 0.0)
    sums = products.mul_(grad_after).sum(dim, keepdim=True)
    before = aten.sub.Scalar(first_zero_index, 1).relu_()
    gathered = torch.gather(output, dim, before)
    at_start = aten.eq.Scalar(first_zero_index, 0)
    selected = sums.mul_(gathered.masked_fill_(at_start, 1.0)).masked_select(first_zero_mask)
    grad_input.masked_scatter_(first_zero_mask, selected)
    return grad_input


# -- prod_backward --------------------------------------------------------------------------


def _prod_safe_zeros(grad: torch.Tensor, inp: torch.Tensor, dim: int) -> torch.Tensor:
    """``prod_safe_zeros_backward``: exclusive products from both sides, joined by ``cat``."""
    if inp.numel() == 0:
        return grad.expand_as(inp)
    size = inp.shape[dim]
    if size == 1:
        return grad
    ones_size = list(inp.shape)
    ones_size[dim] = 1
    ones = torch.ones(ones_size, dtype=grad.dtype, device=grad.device)
    exclusive_normal_nocp = torch.cat([ones, inp.narrow(dim, 0, size - 1)], dim)
    exclusive_normal = exclusive_normal_nocp.cumprod(dim)
    narrow_reverse = inp.narrow(dim, 1, size - 1).flip(dim)
    exclusive_reverse_nocp = torch.cat([ones, narrow_reverse], dim)
    del ones, narrow_reverse  # moved into the cat's list
    exclusive_reverse = exclusive_reverse_nocp.cumprod(dim).flip(dim)
    return grad * (exclusive_normal * exclusive_reverse)


@CPU.formula(aten.prod.default, node="ProdBackward0", saved=("self", "result"))
def _prod(call: FormulaCall) -> Sequence[Any]:
    """``self: prod_backward(grad, self.to(grad.scalar_type()), result)``."""
    grad = call.grads[0]
    input, result = call.saved("self").to(grad.dtype), call.saved("result")
    if input.dim() == 0:
        return (grad,)
    zero_idx = aten.eq.Scalar(input, 0).nonzero()
    if zero_idx.numel() == 0:
        return (grad * (result / input),)
    if not torch.is_grad_enabled() and zero_idx.shape[0] > 1:
        return (torch.zeros_like(input, memory_format=torch.contiguous_format),)
    return (_prod_safe_zeros(grad, input.contiguous().view(-1), 0).view_as(input),)


@CPU.formula(aten.prod.dim_int, node="ProdBackward1", saved=("self", "result"))
def _prod_dim(call: FormulaCall) -> Sequence[Any]:
    """``self: prod_backward(grad, self.to(grad.scalar_type()), result, dim, keepdim)``."""
    grad = call.grads[0]
    input, result = call.saved("self").to(grad.dtype), call.saved("result")
    if input.dim() == 0:
        return (grad,)
    dim = call.saved("dim") % input.dim()
    if not call.saved("keepdim"):
        grad, result = grad.unsqueeze(dim), result.unsqueeze(dim)
    zero_mask = aten.eq.Scalar(input, 0)
    slice_zero_count = zero_mask.sum(dim, True)
    total_zeros = slice_zero_count.sum().item()
    if total_zeros == 0:
        return (grad * (result / input),)
    return (_prod_safe_zeros(grad, input, dim),)


# -- masked_fill_backward ---------------------------------------------------------------------


@CPU.formula(
    aten.masked_fill.Tensor, aten.masked_fill_.Tensor, node="MaskedFillBackward1", saved=("mask",)
)
def _masked_fill(call: FormulaCall) -> Sequence[Any]:
    """``self: grad.masked_fill(mask, 0)``, then ``value: masked_fill_backward(grad, mask)``."""
    grad, mask = call.grads[0], call.saved("mask")
    needs_self, needs_value = call.needed
    grad_self = grad.masked_fill(mask, 0) if needs_self else None
    grad_value = grad.masked_select(mask).sum() if needs_value else None
    return (grad_self, grad_value)
