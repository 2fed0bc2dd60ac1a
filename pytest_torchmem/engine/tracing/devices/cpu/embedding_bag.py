"""CPU rules: ``embedding_bag`` (``aten/src/ATen/native/EmbeddingBag.cpp``, torch 2.13).

``_embedding_bag_cpu_impl`` makes its four outputs one by one, each with
scratch of its own:

* ``output`` (``bags x D``);
* ``offset2bag``: empty on the fast ``sum`` path (``is_fast_path``: a ``float``,
  ``half`` or ``bfloat16`` table and output of unit inner stride, unit-stride
  per-sample weights, no ``padding_idx``); else resized to ``N + 1`` elements,
  filled by ``make_offset2bag`` (``index_add_`` of ``ones_like(offsets)``,
  ``offset2bag[0] -= 1``, then ``cumsum`` into a new ``N + 1`` storage that
  replaces it) and narrowed to ``N``: its storage keeps ``N + 1`` elements;
* ``bag_size``: ``at::empty(offsets.sizes())`` (``B`` elements, narrowed to the
  bags), whose sizes come from ``offsets[1:] - offsets[:-1]`` and ``N - offsets[-1]``
  when gradients are wanted or the mode is ``mean``/``max``;
* ``max_indices``: ``at::empty(bag_size.sizes())``, resized to ``bags x D`` for
  ``max``.

The reduction then takes a ``float`` buffer for ``bfloat16``/``half`` tables off
the fast path, the ``float`` per-sample weights on it, and for ``mean`` the
divisor ``at::max(bag_size, ones_like(bag_size)).to(dtype)`` (``clamp_min`` from 2.15). The meta kernel gives ``offset2bag`` and
``bag_size`` the sizes of the tensors, not of their storages (and treats a
``bfloat16`` table as off the fast path): an implementation rule makes them as
the kernel does.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, itemsize, promotion_casts
from pytest_torchmem.engine.tracing.rules import (
    Alloc,
    Free,
    Inexact,
    OpCall,
    Output,
    Steps,
    nbytes_of,
)

aten = torch.ops.aten

SUM, MEAN, MAX = 0, 1, 2
_REDUCED: Final = (torch.bfloat16, torch.float16)
_FORWARD: Final = (aten._embedding_bag.default, aten._embedding_bag_forward_only.default)


class _Bag:
    """The tensors and options of an ``embedding_bag`` kernel, and the sizes it derives."""

    def __init__(
        self,
        weight: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        mode: int = SUM,
        psw: torch.Tensor | None = None,
        include_last: bool = False,
        padding_idx: int = -1,
    ) -> None:
        self.weight, self.offsets, self.mode, self.psw = weight, offsets, mode, psw
        self.padding_idx = padding_idx
        # promoteIndicesAndOffsets: the one of the other dtype is copied
        self.index_dtype = torch.promote_types(indices.dtype, offsets.dtype)
        self.isz = itemsize(self.index_dtype)
        self.n, self.b = indices.shape[0], offsets.shape[0]
        self.bags = self.b - int(include_last)
        self.d = weight.shape[1]
        self.promotions = [
            Alloc(f"{name} as {self.index_dtype}", t.numel() * self.isz)
            for name, t in (("indices", indices), ("offsets", offsets))
            if t.dtype != self.index_dtype
        ]

    @classmethod
    def of(cls, call: OpCall) -> _Bag:
        """The forward kernel's arguments."""
        return cls(
            arg(call, 0, "weight"),
            arg(call, 1, "indices"),
            arg(call, 2, "offsets"),
            arg(call, 4, "mode", SUM),
            arg(call, 6, "per_sample_weights"),
            arg(call, 7, "include_last_offset", False),
            arg(call, 8, "padding_idx", -1),
        )

    def fast_path(self) -> bool:
        """``is_fast_path`` (the output is contiguous: inner stride 1)."""
        if self.weight.dtype not in (torch.float32, *_REDUCED) or self.padding_idx >= 0:
            return False
        if self.weight.stride(1) != 1:
            return False
        return self.psw is None or self.psw.stride(0) == 1

    def offset2bag_kept(self) -> bool:
        return self.mode in (MEAN, MAX) or not self.fast_path()

    def make_offset2bag(self, tag: str, offsets: int, output: int | None = None) -> list[Any]:
        """``make_offset2bag`` on a zeroed ``N + 1`` tensor (allocated by the caller as
        ``tag``) with the first ``offsets`` offsets: ``ones_like(offsets)`` for its
        ``index_add_`` (and that kernel's ``index.contiguous()``), ``offset2bag[0] -= 1``
        (a wrapped 1), then ``cumsum`` into a new storage (the op's output ``output``,
        or a buffer) that replaces ``tag``."""
        copy = [Alloc(f"{tag}: offsets.contiguous()", offsets * self.isz)]
        copy = [] if self.offsets.is_contiguous() else copy
        wrapped = f"{tag}: wrapped 1"
        casts = [Alloc(f"{tag}: {c.tag}", c.nbytes) for c in promotion_casts([self.offsets, 1])]
        cumsum = Output(output) if output is not None else Alloc(f"{tag} (cumsum)", self._o2b())
        return [
            Alloc(f"{tag}: ones_like(offsets)", offsets * self.isz),
            *copy,
            *(Free(c.tag) for c in copy),
            Free(f"{tag}: ones_like(offsets)"),
            Alloc(wrapped, 8),
            *casts,
            Free(wrapped),
            *(Free(c.tag) for c in casts),
            cumsum,
            Free(tag),
        ]

    def _o2b(self) -> int:
        return (self.n + 1) * self.isz


@CPU.implementation(*_FORWARD)
def _embedding_bag_outputs(call: OpCall) -> Any:
    """The outputs with the kernel's storages: ``offset2bag`` of ``N + 1`` elements
    viewed as ``N`` (empty on the fast ``sum`` path, ``bfloat16`` included), and
    ``bag_size`` (and ``max_indices`` off ``max``) of ``B`` elements viewed as the
    bags where they hold the bags' sizes."""
    output, _, _, _ = call.default()
    bag = _Bag.of(call)
    index = bag.offsets.new_empty((0,), dtype=bag.index_dtype)
    offset2bag = index.new_empty((0,))
    if bag.offset2bag_kept():
        offset2bag = index.new_empty((bag.n + 1,))[: bag.n]
    sized = call.func is aten._embedding_bag.default or bag.mode in (MEAN, MAX)
    bag_size = index.new_empty((bag.b,))[: bag.bags if sized else bag.b]
    if bag.mode == MAX:
        max_indices = index.new_empty((bag.bags, bag.d))
    else:
        max_indices = index.new_empty(bag_size.shape)
    return output, offset2bag, bag_size, max_indices


@CPU.scratch(*_FORWARD)
def _embedding_bag(call: OpCall) -> Steps:
    """``_embedding_bag_cpu_impl``: the index promotions, then the outputs one by one with
    their scratch (module docstring), then the reduction's."""
    bag = _Bag.of(call)
    steps: list[Any] = [*bag.promotions, Output(0)]
    if bag.offset2bag_kept():
        steps += [Alloc("offset2bag (N + 1)", bag._o2b())]
        # (include_last_offset: make_offset2bag_out drops the last offset)
        steps += bag.make_offset2bag("offset2bag (N + 1)", bag.bags, output=1)
    else:
        steps.append(Output(1))
    steps.append(Output(2))
    if call.func is aten._embedding_bag.default or bag.mode in (MEAN, MAX):
        if bag.bags != 1:
            steps += [Alloc("offsets[1:] - offsets[:-1]", max(bag.bags - 1, 0) * bag.isz)]
            steps.append(Free("offsets[1:] - offsets[:-1]"))
        if bag.bags > 0:
            steps += [Alloc("N - offsets[-1]", bag.isz), Free("N - offsets[-1]")]
    if bag.mode == MAX:
        steps += [Alloc("max_indices before resize_", bag.bags * bag.isz), Output(3)]
        steps.append(Free("max_indices before resize_"))
        return steps
    steps.append(Output(3))
    steps += _reduction_buffers(bag)
    if bag.mode == MEAN:
        steps += _mean_divisor(bag)
    return steps


def _mean_divisor(bag: _Bag) -> list[Any]:
    """``mean``'s divisor: up to torch 2.14 ``at::max(bag_size, ones_like(bag_size))``
    then ``.to(dtype)``; from 2.15 ``bag_size.clamp_min(1).to(dtype)``, without the
    ``ones_like`` (the profiler's op events of 2.14.1: ``ones_like, max, to``; of 2.15.0:
    ``clamp_min, to``)."""
    divisor = ("bag_size as output dtype", bag.bags * bag.weight.element_size())
    if torch_minor() >= (2, 15):
        made = [("clamp_min(bag_size, 1)", bag.bags * bag.isz), divisor]
    else:
        made = [
            ("ones_like(bag_size)", bag.bags * bag.isz),
            ("max(bag_size, ones)", bag.bags * bag.isz),
            divisor,
        ]
    return [*(Alloc(tag, n) for tag, n in made), *(Free(tag) for tag, _ in made)]


def _reduction_buffers(bag: _Bag) -> list[Any]:
    """``index_select_add`` / ``index_select_scale_add`` for a ``bfloat16``/``half`` table:
    on the fast path (FBGEMM), the per-sample weights as ``float``; off it, a
    ``float`` row of the table (without weights) and a ``float`` output."""
    if bag.weight.dtype not in _REDUCED:
        return []
    if bag.fast_path():
        if bag.psw is None:
            return []
        tag = "per_sample_weights as float"
        return [Alloc(tag, bag.n * 4), Free(tag)]
    steps: list[Any] = []
    if bag.psw is None:
        steps.append(Alloc("float row", bag.d * 4))
    steps.append(Alloc("float output", bag.bags * bag.d * 4))
    return [*steps, *(Free(s.tag) for s in reversed(steps))]


def _backward_offset2bag(bag: _Bag, offset2bag: torch.Tensor) -> list[Any]:
    """The backward kernels recompute an ``offset2bag`` the forward left empty (its fast
    path): a zeroed ``N + 1`` tensor, then ``make_offset2bag``; held until they return."""
    if bag.n == 0 or offset2bag.numel() != 0:
        return []
    tag = "offset2bag (N + 1)"
    return [Alloc(tag, bag._o2b()), *bag.make_offset2bag(tag, bag.b)]


@CPU.scratch(aten._embedding_bag_backward.default)
def _embedding_bag_backward(call: OpCall) -> Steps:
    """``_embedding_bag_backward_symint``: index promotions, ``offset2bag`` recomputed
    where the forward left it empty, then ``_embedding_bag_dense_backward_cpu``:
    ``grad.contiguous()`` (a copy of a sum's expanded gradient), the zeroed output,
    and for ``sum``/``mean`` ``indices.sort()`` (values, order, the sort's ``arange``)
    with ``offset2bag`` (and the per-sample weights) gathered in that order. The
    ``max`` backward (:func:`_max_backward`) selects the non-empty bags, whose number
    depends on the values: listed, with all bags taken as non-empty."""
    grad, indices, offsets = arg(call, 0, "grad"), arg(call, 1, "indices"), arg(call, 2, "offsets")
    offset2bag, mode = arg(call, 3, "offset2bag"), arg(call, 8, "mode")
    psw = arg(call, 10, "per_sample_weights")
    bag = _Bag(grad, indices, offsets)
    if arg(call, 9, "sparse"):
        return _sparse_backward(call, bag, grad, offset2bag, mode)
    steps: list[Any] = [*bag.promotions, *_backward_offset2bag(bag, offset2bag)]
    if not grad.is_contiguous():
        steps.append(Alloc("grad.contiguous()", nbytes_of(grad)))
    if mode == MAX:
        return [
            Inexact(
                "embedding_bag's max backward selects the non-empty bags "
                "(bag_size.nonzero()), whose number depends on the values: every bag "
                "was assumed non-empty (an upper bound)"
            ),
            *steps,
            Output(0),
            *_max_backward(bag, grad, arg(call, 5, "maximum_indices")),
        ]
    steps.append(Output(0))
    if bag.n:
        steps += [
            Alloc("sorted indices", bag.n * bag.isz),
            Alloc("sort order", bag.n * 8),
            Alloc("sort: arange indices", bag.n * 8),
            Free("sort: arange indices"),
            Alloc("offset2bag in sorted order", bag.n * bag.isz),
        ]
        if psw is not None:
            steps.append(Alloc("per_sample_weights in sorted order", nbytes_of(psw)))
    return steps


def _sparse_backward(
    call: OpCall, bag: _Bag, grad: torch.Tensor, offset2bag: torch.Tensor, mode: int
) -> Steps:
    """``sparse=True``: after the promotions and ``offset2bag``,
    ``_embedding_bag_sparse_backward_symint`` gathers the gradient per index (the
    result's values, ``grad.index_select(0, offset2bag)``); for ``mean``
    (``apply_bag_size_backward``) it multiplies them in place by
    ``(1 / bag_size.to(dtype)).unsqueeze(1).index_select(0, offset2bag)``, whose two
    temporaries die with that expression and the gathered factors with the kernel;
    ``embedding_sparse_backward`` makes the sparse result of views. Its ``padding_idx``
    filter (rows selected by value) and ``max`` mode are not modelled."""
    padding_idx = arg(call, 11, "padding_idx", -1)
    steps: list[Any] = [*bag.promotions, *_backward_offset2bag(bag, offset2bag), Output(0)]
    if mode == MAX or (padding_idx is not None and padding_idx >= 0):
        return [
            Inexact("embedding_bag's sparse backward with a padding_idx or in max mode is not modelled"),
            *steps,
        ]
    if mode == MEAN and bag.n:
        size = grad.element_size()
        bags = arg(call, 4, "bag_size").numel()
        steps += [
            Alloc("bag_size as the gradient's dtype", bags * size),
            Alloc("1 / bag_size", bags * size),
            Alloc("inverse bag size per index", bag.n * size),
            Free("bag_size as the gradient's dtype"),
            Free("1 / bag_size"),
        ]
    return steps


def _max_backward(bag: _Bag, grad: torch.Tensor, max_indices: torch.Tensor) -> list[Any]:
    """``_embedding_bag_dense_backward_cpu_max`` after its zeroed output, for ``k`` non-empty
    bags (taken as all of them): ``max_indices.index_select(0, bag_size.nonzero())`` and
    ``grad.index_select(0, bag_size.nonzero())`` (each ``nonzero`` freed after its
    gather), then per feature ``index_add_`` of a column of the first, which it copies
    contiguous (a column of more than one row and feature)."""
    k, d = grad.shape[0], bag.d
    column = k * max_indices.element_size() if k > 1 and d > 1 else 0
    steps: list[Any] = [
        Alloc("nonzero bags", k * 8),
        Alloc("max_indices of the non-empty bags", k * d * max_indices.element_size()),
        Free("nonzero bags"),
        Alloc("nonzero bags again", k * 8),
        Alloc("grad of the non-empty bags", k * d * grad.element_size()),
        Free("nonzero bags again"),
    ]
    if column:
        steps += [Alloc("index_add_: index column contiguous", column)]
        steps.append(Free("index_add_: index column contiguous"))
    return steps


@CPU.scratch(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(call: OpCall) -> Steps:
    """``_embedding_bag_per_sample_weights_backward_cpu_template``: index promotions, the
    zeroed output, then ``offset2bag`` recomputed where the forward left it empty."""
    weight = arg(call, 1, "weight")
    indices, offsets = arg(call, 2, "indices"), arg(call, 3, "offsets")
    bag = _Bag(weight, indices, offsets)
    return [*bag.promotions, Output(0), *_backward_offset2bag(bag, arg(call, 4, "offset2bag"))]
