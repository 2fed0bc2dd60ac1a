"""Where a tensor's memory is: one storage for a strided tensor, two or three for a sparse one.

A sparse tensor has no storage of its own (``untyped_storage()`` raises
``Cannot access storage of SparseTensorImpl``): its memory is its parts', the
dense tensors it holds. A COO tensor holds its ``indices`` (sparse dims × nnz,
int64) and ``values`` (nnz × dense dims); a compressed one (CSR, CSC, BSR,
BSC) its compressed indices, its plain indices and its values. Each part is
counted as a storage like any other (once, however many tensors share it); an
op that makes new parts (a ``coalesce``, a ``clone``) makes new storages.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = ["COMPRESSED", "parts", "is_sparse", "sparse_like"]

#: The compressed sparse layouts, with the names of their compressed and plain indices.
COMPRESSED: Final = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}

_STRIDED: Final = torch.strided
_COO: Final = torch.sparse_coo


def is_sparse(t: torch.Tensor) -> bool:
    """Whether ``t`` is a sparse tensor (COO or compressed)."""
    layout = t.layout
    return layout is _COO or layout in COMPRESSED


def parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors whose storages hold ``t``'s memory: ``(t,)`` for a strided tensor,
    ``(indices, values)`` for a COO one, ``(compressed indices, plain indices, values)``
    for a compressed one; ``()`` for a layout with no storage to see (``mkldnn``)."""
    layout = t.layout
    if layout is _STRIDED:
        return (t,)
    if layout is _COO:
        return (t._indices(), t._values())
    names = COMPRESSED.get(layout)
    if names is None:
        return ()
    compressed, plain = names
    return (getattr(t, compressed)(), getattr(t, plain)(), t.values())


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
