"""The dimension order of a TensorIterator, as ``TensorIteratorBase::build`` computes it.

Rules that size a kernel's buffers by the iterator's geometry (reductions on
cpu and cuda) share these two steps of ``aten/src/ATen/TensorIterator.cpp``
(torch 2.13): ``reorder_dimensions`` and ``coalesce_dimensions``. Strides are
per operand, in any unit (each operand is compared only with itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private_any

__all__ = ["coalesce_dimensions", "is_contiguous", "non_overlapping_and_dense", "reorder_dimensions"]


def reorder_dimensions(
    sizes: Sequence[int], operands: Sequence[Sequence[int]], n_outputs: int
) -> list[int]:
    """``reorder_dimensions``: the order of the dimensions, fastest first.

    An insertion sort over the dimensions, last first: the outputs' stride-0
    (reduced or broadcast) dimensions move to the front; otherwise the operands'
    strides decide in order, the smaller size first on ties.
    """
    n = len(sizes)

    def should_swap(dim0: int, dim1: int) -> int:
        for index, strides in enumerate(operands):
            s0, s1 = strides[dim0], strides[dim1]
            if index < n_outputs and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if sizes[dim0] > sizes[dim1]:
                return 1
        return 0

    perm = list(range(n - 1, -1, -1))
    for i in range(1, n):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return perm


def coalesce_dimensions(
    sizes: Sequence[int], operands: Sequence[Sequence[int]]
) -> tuple[list[int], list[list[int]]]:
    """``coalesce_dimensions``: adjacent dimensions that every operand walks as one
    (or of size 1) merged; the new sizes and each operand's strides."""
    sizes = list(sizes)
    operands = [list(strides) for strides in operands]
    prev = 0
    for dim in range(1, len(sizes)):
        if (
            sizes[prev] == 1
            or sizes[dim] == 1
            or all(sizes[prev] * strides[prev] == strides[dim] for strides in operands)
        ):
            if sizes[prev] == 1:
                for strides in operands:
                    strides[prev] = strides[dim]
            sizes[prev] *= sizes[dim]
        else:
            prev += 1
            if prev != dim:
                for strides in operands:
                    strides[prev] = strides[dim]
                sizes[prev] = sizes[dim]
    return sizes[: prev + 1], [strides[: prev + 1] for strides in operands]


def is_contiguous(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """``TensorImpl::is_contiguous`` (row-major) on sizes and strides: dimensions of
    size 1 are ignored, and an empty tensor is contiguous."""
    if 0 in sizes:
        return True
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense_or_false(t)`` of torch's prims (as TensorIterator
    and cuBLAS ask whether a tensor is dense), answered at once for the
    common case, a contiguous strided tensor with no zero stride (the prims
    helper takes ~14 us through its symbolic-shape guards, on every BLAS call).

    Such a tensor is dense: its dimensions longer than 1 have distinct strides,
    each the product of the sizes after it, so the prims helper's sort by stride
    puts them back in order and its check passes. A zero stride (only on a
    dimension of size 1 here) is left to the helper, whose comparison treats it
    specially.
    """
    if t.layout == torch.strided and t.is_contiguous() and 0 not in t.stride():
        return True
    return private_any(
        "torch._prims_common.is_non_overlapping_and_dense_or_false",
        "torch._prims_common.is_non_overlapping_and_dense",  # its name in 2.10
    )(t)
