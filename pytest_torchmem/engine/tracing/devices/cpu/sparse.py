"""CPU rules: sparse COO tensors (``aten/src/ATen/native/sparse``).

A sparse tensor's memory is its parts, its ``indices`` (sparse dims × nnz,
int64) and ``values`` (nnz × dense dims) (``engine/user/layouts.py``). The fake
kernels of sparse ops do not know how many elements (nnz) a result holds (a
fake ``clone`` has none); each rule here makes the result as the CPU kernel
does: its parts, and the scratch between them, allocated in the kernel's
order through the trace (``torch.empty`` of their sizes), the result a COO
tensor holding them. An in-place op gives its tensor new parts as the kernel
does (``alias_into_sparse``): they are made out of the trace's sight
(``copy_sparse_to_sparse_``) and charged, and the old ones die as the tensor
lets go of them.

Each rule was checked against the profiler's allocator events of the kernel
(``measure``), byte for byte, on the cases ``tests/test_sparse.py`` runs;
what a rule does not follow (a case the kernel takes another path for) is
listed in ``unsupported``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import torch

from pytest_torchmem.engine.user.layouts import parts, sparse_like
from pytest_torchmem.engine.figures.report import Unsupported
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.sparse import refuse_memory_format
from pytest_torchmem.engine.tracing.rules import OpCall
from pytest_torchmem.engine.user.user_code import user_location
from pytest_torchmem.engine.tracing.values import on_values

__all__: list[str] = []

aten = torch.ops.aten

# torch's private names (engine/torch_compat/torch_private.py)
_current_autograd_node: Final = private("torch._C._current_autograd_node")

_COO: Final = torch.sparse_coo
#: The autograd node that stores a parameter's gradient (``accumulate_grad.h``).
_ACCUMULATE_GRAD: Final = "torch::autograd::AccumulateGrad"


def _flag(call: OpCall, reason: str) -> None:
    """List ``call``'s op in ``unsupported`` with ``reason``."""
    tracer = call.context.tracer if call.context is not None else None
    if tracer is not None:
        tracer.flag(Unsupported(str(call.func), reason, user_location()))


@contextmanager
def _traced(call: OpCall) -> Iterator[None]:
    """Ops called in the block are recorded by the trace, as the kernel's own calls."""
    tracer = call.context.tracer if call.context is not None else None
    if tracer is None:
        yield
        return
    with tracer.decomposed():
        yield


def _charge(call: OpCall, t: torch.Tensor) -> None:
    """Charge the parts a rule gave ``t`` out of the trace's sight, now."""
    tracer = call.context.tracer if call.context is not None else None
    if tracer is not None:
        tracer.charge(t, str(call.func))


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of ``t``'s shape and dtype (through the trace, in a
    :func:`_traced` block): what ``t.to(options, copy=True)`` and ``at::empty`` make."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _dense_parts_copy(call: OpCall, self: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``copy_into_sparse``'s copies: ``values.to(..., copy=True)`` is made first (the
    compiler evaluates ``alias_into_sparse``'s arguments right to left), then the indices';
    their values are known where the originals' are (in a :func:`_traced` block)."""
    indices, values = parts(self)
    new_values = _empty_like(values)
    new_indices = _empty_like(indices)
    _know(call, new_indices, call.value(indices))
    _know(call, new_values, call.value(values))
    return new_indices, new_values


def _know(call: OpCall, t: torch.Tensor, real: torch.Tensor | None) -> None:
    """The trace knows ``t`` to hold ``real`` (where ``real`` is known)."""
    known = call.context.values if call.context is not None else None
    if real is not None and known is not None:
        known.know(t, real)


def _holding(out: torch.Tensor, new_parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``out``, keeping the tensors its parts were made as: the trace knows a storage's
    values while a tensor it knew them by lives (``values.py``), and ``out`` holds
    its parts as tensors of its own."""
    out._torchmem_parts = new_parts  # type: ignore[attr-defined]
    return out


@CPU.sparse(aten.clone.default)
def _clone(call: OpCall) -> Any:
    """``clone_sparse`` (``SparseTensor.cpp``): copies of the indices and values, the
    coalesced flag kept. From a backward, ``AccumulateGrad`` (``accumulate_grad.h``) takes
    a new sparse gradient without the copy where its indices and values are contiguous
    (held by it alone, as a backward formula's result is): eagerly it calls no ``clone``
    then; a fake tensor's use counts make it call one, which is undone here."""
    refuse_memory_format(call)
    self = call.args[0]
    if self.layout is not _COO:
        return _unfollowed(call, "a clone of a compressed sparse tensor")
    indices, values = parts(self)
    node = _current_autograd_node()
    if (
        node is not None
        and node.name() == _ACCUMULATE_GRAD
        and not torch.is_grad_enabled()
        and indices.is_contiguous()
        and values.is_contiguous()
    ):
        return sparse_like(self, (indices, values), self.device)
    with _traced(call):
        new_parts = _dense_parts_copy(call, self)
    return _holding(sparse_like(self, new_parts, self.device), new_parts)


@CPU.sparse(aten._coalesce.default)
def _coalesce(call: OpCall) -> Any:
    """``_coalesce_sparse_cpu`` (``SparseTensor.cpp``): fewer than two elements, a clone;
    else ``values.contiguous()``, the new indices and values (of the input's nnz), then
    ``flatten_indices(...).sort(0)`` (its values and order, the sort's ``arange``), freed
    when it returns; the result is a view of the first ``k`` of each, ``k`` the number
    of distinct indices: known where the trace knows the indices' values, else the
    input's nnz (no duplicate merged), listed."""
    self = call.args[0]
    nnz = self._nnz()
    if nnz < 2:
        out = _clone(OpCall(aten.clone.default, (self,), {}, context=call.context))
        return out._coalesced_(True)
    if self.sparse_dim() != 1:
        # flatten_indices of several sparse dims computes a linear index (scratch of its own)
        _flag(call, "coalesce of a tensor of more than one sparse dimension is not modelled")
    indices, values = parts(self)
    flat = indices[0]  # flatten_indices of one sparse dim: indices.squeeze(0), a view
    distinct = _distinct(call, flat)  # (1, k)
    kept = nnz if distinct is None else distinct.numel()
    with _traced(call):
        contiguous = values.contiguous()
        new_indices = _empty_like(indices)
        new_values = _empty_like(contiguous)
        order = flat.sort(0)
        del order, contiguous
    new_parts = (new_indices.narrow(1, 0, kept), new_values.narrow(0, 0, kept))
    if distinct is not None:  # the coalesced indices: the distinct ones, sorted
        _know(call, new_parts[0], distinct)
    return _holding(sparse_like(self, new_parts, self.device)._coalesced_(True), new_parts)


def _distinct(call: OpCall, flat: torch.Tensor) -> torch.Tensor | None:
    """The distinct values of the 1-d index ``flat``, sorted, as a real (1, k) tensor where
    the trace knows its values; else None (listed)."""
    value = call.value(flat)
    if value is None:
        _flag(
            call,
            "how many distinct indices a coalesce keeps depends on their values, which the "
            "trace does not know here: none was taken as merged (an upper bound)",
        )
        return None
    with on_values():  # (real tensors: the fake mode must not see them)
        return torch.unique(value).unsqueeze(0)


@CPU.sparse(aten.sparse_mask.default)
def _sparse_mask(call: OpCall) -> Any:
    """``sparse_mask`` of a dense ``t`` (``SparseTensor.cpp``): ``t.mul(mask_template)``, the
    template holding the mask's indices and ``ones({1}).expand_as(values)``;
    ``_mul_dense_sparse_out`` gathers ``t`` at the mask's indices (freed after), copies
    the indices, and multiplies the values. Followed for a coalesced mask of ``t``'s dtype."""
    t, mask = call.args[0], call.args[1]
    if t.layout is not torch.strided or mask.layout is not _COO:
        return _unfollowed(call, "a sparse_mask of a sparse tensor")
    if not mask.is_coalesced() or mask.dtype != t.dtype or mask._nnz() == 0:
        return _unfollowed(call, "a sparse_mask with an uncoalesced, empty or other-dtype mask")
    indices, values = parts(mask)
    nnz, sparse_dim = mask._nnz(), mask.sparse_dim()
    with _traced(call):
        ones = torch.empty((1,), dtype=values.dtype, device=values.device)
        gathered = torch.empty((nnz, *t.shape[sparse_dim:]), dtype=t.dtype, device=t.device)
        new_indices = _empty_like(indices)
        new_values = torch.empty(gathered.shape, dtype=t.dtype, device=t.device)
        del gathered, ones
    _know(call, new_indices, call.value(indices))
    return _holding(sparse_like(mask, (new_indices, new_values), t.device), (new_indices, new_values))


@CPU.sparse(aten.add_.Tensor)
def _add_(call: OpCall) -> Any:
    """``add_`` with a sparse ``other`` (``SparseTensorMath.cpp``). Into a dense ``self``
    (``add_out_dense_sparse_cpu``) of one sparse dimension and ``other``'s dtype: in
    place, no buffer. Into a sparse ``self`` (``add_out_sparse_cpu``, autograd
    accumulating a sparse gradient): the two tensors' indices and values concatenated
    into new parts (indices first), which ``self`` takes, letting its own go."""
    self, other = call.args[0], call.args[1]
    alpha = call.arg(2, "alpha", 1)
    if not isinstance(other, torch.Tensor) or other.layout is not _COO:
        return _unfollowed(call, "an add_ of a sparse tensor and a dense one")
    if self.layout is torch.strided:
        if other.sparse_dim() != 1 or other.dtype != self.dtype:
            _flag(
                call,
                "a dense add_ of a sparse tensor of several sparse dimensions or another dtype "
                "is not modelled",
            )
        return self
    if (
        self.layout is not _COO
        or alpha != 1
        or other.dtype != self.dtype
        or self.sparse_dim() != other.sparse_dim()
    ):
        return _unfollowed(call, "a sparse add_ with alpha, or of other dtypes or dimensions")
    nnz = self._nnz() + other._nnz()
    indices, values = parts(self)
    new_indices = torch.empty((indices.shape[0], nnz), dtype=indices.dtype, device=indices.device)
    new_values = torch.empty((nnz, *values.shape[1:]), dtype=values.dtype, device=values.device)
    _take_parts(call, self, (new_indices, new_values))
    return self


def _take_parts(call: OpCall, self: torch.Tensor, new_parts: tuple[torch.Tensor, ...]) -> None:
    """Give the sparse ``self`` parts like ``new_parts`` (made out of the trace's sight),
    charged now, in order; its old parts die after, as the kernel lets go of them."""
    old = parts(self)
    source = sparse_like(self, new_parts, self.device)._coalesced_(False)
    aten.copy_sparse_to_sparse_(self, source)  # (its fake kernel copies them: new storages)
    for part in parts(self):
        _charge(call, part)
    del old


def _unfollowed(call: OpCall, what: str) -> Any:
    """A case the rule does not follow: as for an op with no rule (the trace lists it,
    or stops on a compressed sparse tensor)."""
    tracer = call.context.tracer if call.context is not None else None
    if tracer is None:
        return call.default()
    return tracer.unfollowed_sparse(call, what)


@CPU.sparse(aten.addmm.default, aten._sparse_addmm.default)
def _addmm(call: OpCall) -> Any:
    """``addmm`` of a sparse ``mat1`` and a dense ``mat2`` (``s_addmm_out_sparse_dense_cpu``
    in ``SparseTensorMath.cpp``: ``nn.Linear`` on a sparse input; ``_sparse_addmm``,
    which ``torch.sparse.mm`` calls on a zeroed ``t``): the result alone, made empty
    and resized."""
    bias, mat1, mat2 = call.args[0], call.args[1], call.args[2]
    if mat1.layout is not _COO or mat2.layout is not torch.strided or bias.layout is not torch.strided:
        return _unfollowed(call, "an addmm of other layouts")
    with _traced(call):
        out = torch.empty((mat1.shape[0], mat2.shape[1]), dtype=mat2.dtype, device=mat2.device)
    return out


@CPU.sparse(aten.mm.default)
def _mm(call: OpCall) -> Any:
    """``mm`` of a sparse ``self`` and a dense ``mat2`` (``_sparse_mm``): ``_sparse_addmm``
    of a zeroed ``t`` (freed after) into its own result."""
    self, mat2 = call.args[0], call.args[1]
    if self.layout is not _COO or mat2.layout is not torch.strided:
        return _unfollowed(call, "an mm of other layouts")
    shape = (self.shape[0], mat2.shape[1])
    with _traced(call):
        zeros = torch.empty(shape, dtype=mat2.dtype, device=mat2.device)
        out = torch.empty(shape, dtype=mat2.dtype, device=mat2.device)
        del zeros
    return out


@CPU.sparse(aten.t.default, aten.transpose.int)
def _transpose(call: OpCall) -> Any:
    """``transpose`` of a sparse tensor (``sparse_transpose_`` on ``self.clone()``): the
    clone's parts, then the swap of two rows of its indices through a zeroed row
    (``zeros_like(row0)``, freed); the result is not coalesced."""
    self = call.args[0]
    if self.layout is not _COO:
        return _unfollowed(call, "a transpose of a compressed sparse tensor")
    if call.func is aten.t.default:
        dim0, dim1 = 0, min(1, self.dim() - 1)
    else:
        dim0, dim1 = (d % max(self.dim(), 1) for d in (call.args[1], call.args[2]))
    if dim0 == dim1:
        return call.default()
    if max(dim0, dim1) >= self.sparse_dim():
        return _unfollowed(call, "a transpose of a sparse tensor's dense dimensions")
    indices, _ = parts(self)
    with _traced(call):
        new_indices, new_values = _dense_parts_copy(call, self)
        row = torch.empty((indices.shape[1],), dtype=indices.dtype, device=indices.device)
        del row
    shape = list(self.shape)
    shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
    out = torch.sparse_coo_tensor(
        new_indices,
        new_values,
        shape,
        dtype=self.dtype,
        device=self.device,
        is_coalesced=False,
        check_invariants=False,
    )
    return _holding(out, (new_indices, new_values))
