"""CUDA rules: ``unique`` without ``dim`` (``_unique2``, ``_unique``, ``unique_consecutive``).

``unique_cuda_template`` (``aten/src/ATen/native/cuda/UniqueCub.cu``, the same calls in
every release 2.10-2.15: ``UniqueCub``, ``compute_unique``) makes its outputs at the input's
size and only resizes them to the unique count: ``data_out = at::empty({num_inp})``,
``counts.resize_(num_inp)``, then ``resize_(num_out)`` of both, which keeps the storage. The
caching allocator holds the full-size blocks for as long as the outputs live, so the
outputs are charged at the input's size whatever the values (:func:`_unique_outputs`); their
shapes are the unique count's, from the values the trace knows (else the common fallback's
largest output, listed in ``unsupported``).

Beside them (:func:`_unique_scratch`): ``self.expect_contiguous()``; unless consecutive, the
sorted copy and cub's radix sort (``radix_sort_keys``, or ``radix_sort_pairs`` with an
``arange`` and the sorted indices when the inverse is asked); for the inverse, an ``int``
flag per element (consecutive) or an ``int64`` scan buffer, and cub's inclusive scan; then
the one-element ``length`` and cub's ``DeviceSelect::Unique`` (no counts) or
``DeviceRunLengthEncode::Encode`` (counts). cub's storage per CCCL release is
:mod:`.cub_storage`'s. A ``bool`` input counts its trues instead of sorting
(``UniqueCub<bool>``).

``unique_dim`` and ``unique_dim_consecutive`` (``Unique.cu``, thrust's sort and unique with
the ThrustAllocator's temporaries) stay listed by :mod:`.masks`.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.cub_storage import (
    inclusive_scan_int_bytes,
    radix_sort_pairs_bytes,
    run_length_encode_bytes,
    select_unique_bytes,
)
from pytest_torchmem.engine.tracing.rules import Alloc, Free, Inexact, OpCall, Output, Step
from pytest_torchmem.engine.tracing.values import on_values

__all__ = ["unique_flags", "unique_storage_bytes"]

aten = torch.ops.aten

_UNIQUE_OPS: Final = (aten._unique2.default, aten._unique.default, aten.unique_consecutive.default)
#: ``UniqueCub<bool>``: ``output = at::empty({2})`` and ``counts = at::empty({2}, kLong)``.
_BOOL_SLOTS: Final = 2


def unique_flags(call: OpCall) -> tuple[bool, bool, bool]:
    """``(consecutive, return_inverse, return_counts)`` of a call, as ``unique_cuda_template``
    takes them (``_unique`` never counts)."""
    if call.func is aten.unique_consecutive.default:
        return True, bool(call.arg(1, "return_inverse", False)), bool(call.arg(2, "return_counts", False))
    inverse = bool(call.arg(2, "return_inverse", False))
    counts = call.func is aten._unique2.default and bool(call.arg(3, "return_counts", False))
    return False, inverse, counts


def _with_dim(call: OpCall) -> bool:
    return call.func is aten.unique_consecutive.default and call.arg(3, "dim") is not None


def unique_storage_bytes(call: OpCall) -> list[int]:
    """The bytes each output's storage holds on the GPU: values, inverse indices and (for
    ``_unique2`` and ``unique_consecutive``) counts."""
    self = call.args[0]
    consecutive, inverse, counts = unique_flags(call)
    n = self.numel()
    inverse_bytes = n * 8 if inverse else 0
    if n == 0:
        sizes = [0, 0, 0]  # at::empty({0}), at::empty(self.sizes()) of no element, at::empty({0})
    elif self.dtype == torch.bool and not consecutive:
        sizes = [_BOOL_SLOTS, inverse_bytes, _BOOL_SLOTS * 8]
    else:
        sizes = [n * self.element_size(), inverse_bytes, n * 8 if counts else 0]
    return sizes[:2] if call.func is aten._unique.default else sizes


@CUDA.implementation(*_UNIQUE_OPS)
def _unique_outputs(call: OpCall) -> Any:
    """The outputs with the shapes of the unique count (the op run on the values the trace
    knows) over storages of the kernel's full-size allocations. Where the values are not
    known, the fake kernel runs, and its refusal takes the trace to the common fallback."""
    self = call.args[0]
    value = call.value(self)
    if value is None or _with_dim(call):
        return call.default()
    with on_values():
        real = call.func(value, *call.args[1:], **call.kwargs)
    return tuple(
        _over_storage(self, r, nbytes) for r, nbytes in zip(real, unique_storage_bytes(call), strict=True)
    )


def _over_storage(self: torch.Tensor, real: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A fake tensor of ``real``'s geometry over a storage of ``nbytes``."""
    elements = max(nbytes // real.element_size(), real.numel())
    out = self.new_empty((elements,), dtype=real.dtype)
    return out.as_strided_(real.shape, real.stride(), 0)


@CUDA.scratch(*_UNIQUE_OPS)
def _unique_scratch(call: OpCall) -> list[Step]:
    """``unique_cuda_template`` and ``UniqueCub`` (``UniqueCub.cu``), outputs made where the
    kernel makes them: the inverse indices, then the values and the counts."""
    self = call.args[0]
    if _with_dim(call):
        return [Inexact("its CUDA kernel's temporary storage (the sorted index) is not modelled")]
    n = self.numel()
    if n == 0:
        return [Output(0), Output(1), Output(2)]
    gpu = call.gpu
    consecutive, inverse, counts = unique_flags(call)
    steps: list[Step] = []
    held: list[str] = []
    if not self.is_contiguous():
        steps.append(Alloc("unique:self.contiguous()", n * self.element_size()))
        held.append("unique:self.contiguous()")
    if self.dtype == torch.bool and not consecutive:
        return [*steps, *_bool_steps(), *(Free(tag) for tag in held)]
    key = self.element_size()
    if not consecutive:
        sort = radix_sort_pairs_bytes(n, key, 8 if inverse else 0, key * 8, gpu)
        if key not in (4, 8) and sort > 1:  # (one tile of SingleTilePolicy: any key size)
            steps.append(Inexact(f"cub's radix sort of {key}-byte keys"))
        steps.append(Alloc("unique:sorted", n * key))
        held.append("unique:sorted")
        if inverse:
            steps += [
                Alloc("unique:range", n * 8),
                Alloc("unique:sorted_indices", n * 8),
                Alloc("unique:sort:temp", sort),
                Free("unique:sort:temp"),
                Free("unique:range"),
            ]
            held.append("unique:sorted_indices")
        else:
            steps += [Alloc("unique:sort:temp", sort), Free("unique:sort:temp")]
    steps.append(Output(1))  # inverse_indices (empty({0}) without the inverse)
    if inverse:
        scan, exact = inclusive_scan_int_bytes(n)
        if not exact:
            steps.append(Inexact("cub's scan storage of unique's inverse past 32 scan tiles"))
        # consecutive: an int flag per element, the inverse the scan's output; else the
        # flags are written into the inverse and scanned into inv_loc_out (int64)
        loc = ("unique:inv_loc", n * 4) if consecutive else ("unique:inv_loc_out", n * 8)
        steps += [Alloc(*loc), Alloc("unique:scan:temp", scan), Free("unique:scan:temp"), Free(loc[0])]
    steps += [Output(0), Output(2), Alloc("unique:length", 8)]
    if counts:
        temp = run_length_encode_bytes(n)
    else:
        temp, exact = select_unique_bytes(n, key)
        if not exact:
            steps.append(Inexact("cub's DeviceSelect::Unique storage past 32 tiles of its smallest policy"))
    steps += [Alloc("unique:temp", temp), Free("unique:temp"), Free("unique:length")]
    steps += [Free(tag) for tag in reversed(held)]
    return steps


def _bool_steps() -> list[Step]:
    """``UniqueCub<bool>``: ``tmp_num_true`` (a ``DeviceArray<int>`` of one element) and
    ``cub::DeviceReduce::Reduce``'s storage (listed: not modelled), then ``output`` and
    ``counts`` (two slots each) and the inverse indices."""
    return [
        Inexact("cub's DeviceReduce storage of unique's count of trues is not modelled"),
        Alloc("unique:tmp_num_true", 4),
        Output(0),
        Output(2),
        Output(1),
        Free("unique:tmp_num_true"),
    ]

