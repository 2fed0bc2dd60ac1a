"""Where a tensor's memory is: one storage for a strided tensor, two or three for a sparse
one, its inner tensors' for a wrapper subclass.

A sparse tensor has no storage of its own (``untyped_storage()`` raises
``Cannot access storage of SparseTensorImpl``): its memory is its parts', the
dense tensors it holds. A COO tensor holds its ``indices`` (sparse dims × nnz,
int64) and ``values`` (nnz × dense dims); a compressed one (CSR, CSC, BSR,
BSC) its compressed indices, its plain indices and its values. Each part is
counted as a storage like any other (once, however many tensors share it); an
op that makes new parts (a ``coalesce``, a ``clone``) makes new storages.

A traceable wrapper subclass (``torch.Tensor._make_wrapper_subclass`` with
``__tensor_flatten__``: torchao's low-bit optimizer states, its float8 tensors)
has no storage either (``untyped_storage()`` raises "Attempted to access the
data pointer on an invalid python storage"): its memory is its inner tensors',
the ones ``__tensor_flatten__`` names (issue 36).
"""

from __future__ import annotations

from typing import Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = ["COMPRESSED", "is_sparse", "is_wrapper", "parts", "sparse_like"]

#: The compressed sparse layouts, with the names of their compressed and plain indices.
COMPRESSED: Final = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}

_STRIDED: Final = torch.strided
_COO: Final = torch.sparse_coo
_PLAIN: Final = torch.Tensor
_is_wrapper_subclass: Final = private("torch.utils._python_dispatch.is_traceable_wrapper_subclass")


def is_sparse(t: torch.Tensor) -> bool:
    """Whether ``t`` is a sparse tensor (COO or compressed)."""
    layout = t.layout
    return layout is _COO or layout in COMPRESSED


def parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors whose storages hold ``t``'s memory: ``(t,)`` for a strided tensor,
    ``(indices, values)`` for a COO one, ``(compressed indices, plain indices, values)``
    for a compressed one, the inner tensors' parts for a traceable wrapper subclass;
    ``()`` for a layout with no storage to see (``mkldnn``)."""
    layout = t.layout
    if layout is _STRIDED:
        if is_wrapper(t):
            return _inner_parts(t)
        return (t,)
    if layout is _COO:
        return (t._indices(), t._values())
    names = COMPRESSED.get(layout)
    if names is None:
        return ()
    compressed, plain = names
    return (getattr(t, compressed)(), getattr(t, plain)(), t.values())


def is_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` is a traceable wrapper subclass: its memory is its inner tensors'."""
    return type(t) is not _PLAIN and _is_wrapper_subclass(t)


def _inner_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = (getattr(t, name) for name in names)
    return tuple(part for tensor in inner if tensor is not None for part in parts(tensor))


def sparse_like(t: torch.Tensor, new_parts: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    """A sparse tensor of ``t``'s layout, shape, dtype and (COO) coalesced flag on
    ``device``, holding ``new_parts`` (as :func:`parts` lists them), which it shares
    (no copy, no check of their values)."""
    if t.layout is _COO:
        indices, values = new_parts
        return torch.sparse_coo_tensor(
            indices,
            values,
            t.shape,
            dtype=t.dtype,
            device=device,
            is_coalesced=t.is_coalesced(),
            check_invariants=False,
        )
    compressed, plain, values = new_parts
    return torch.sparse_compressed_tensor(
        compressed,
        plain,
        values,
        t.shape,
        dtype=t.dtype,
        layout=t.layout,
        device=device,
        check_invariants=False,
    )
