"""The workspace sizes MKL's LAPACK answers to ATen's ``lwork = -1`` queries.

ATen's CPU kernels (``aten/src/ATen/native/BatchLinearAlgebraKernel.cpp``, torch
2.13) ask LAPACK for the optimal size of a work array, then take it from the
allocator (``at::empty({lwork})``), once per call whatever the batch. The
answers below are those of the MKL linked into torch 2.13's wheels, as closed
formulas of the matrix sizes and the intra-op thread count (MKL's thread
count follows ``torch.set_num_threads``); they were checked against the query
itself over the ranges they claim, on every ISA ``MKL_ENABLE_INSTRUCTIONS``
can cap MKL to and at 1 to 16 threads (``tests/test_cpu_rules_linalg.py``
repeats the check). Outside those ranges MKL's blocked and threaded paths
answer by heuristics of their own (some by ISA): a function returns ``None``
there, and the rule lists the call in ``unsupported``.

A query answers a float of the matrix dtype; ATen turns it into an element
count in two ways: :func:`work_to_int` (``lapack_work_to_int``: one ULP up,
then the ceiling, at least 1; for ``?geev``, ``?geqrf``, ``?orgqr`` and
``?syevd``'s ``work``) or a plain truncation to at least 1 (``?ormqr``,
``?sytrf``, ``?syevd``'s ``iwork``).
"""

from __future__ import annotations

import math
import struct
from typing import Final

import torch

__all__ = [
    "work_to_int",
    "geqrf_lwork",
    "orgqr_lwork",
    "ormqr_lwork",
    "syevd_lwork",
    "geev_lwork",
    "sytrf_lwork",
    "VERIFIED",
]

#: The largest matrix order each formula was checked to (the query's answer
#: beyond it is not claimed).
VERIFIED: Final = {
    "geqrf": "n <= 20 and m <= 10000, or m, n <= 50",
    "orgqr": "m < 32",
    "ormqr": "m, n < 32",
    "syevd": "n < 600",
    "geev": "n < 600",
    "sytrf": "n < 600",
}
_SQUARE_LIMIT: Final = 600


def work_to_int(value: float, dtype: torch.dtype) -> int:
    """``lapack_work_to_int``: ``max(1, ceil(nextafter(value, +inf)))`` in the
    query's precision (``float`` for float32 and complex64 matrices)."""
    if dtype in (torch.float32, torch.complex64):
        (bits,) = struct.unpack("<I", struct.pack("<f", value))
        (up,) = struct.unpack("<f", struct.pack("<I", bits + 1))
    else:
        up = math.nextafter(value, math.inf)
    return max(1, math.ceil(up))


def geqrf_lwork(m: int, n: int) -> int | None:
    """``?geqrf``'s optimal ``lwork`` for an ``m x n`` matrix: ``n`` (1 for an
    empty one), MKL's unblocked answer; ``None`` beyond it (blocked panels,
    and from 65536 rows a tall-skinny path, sized by ISA and threads)."""
    if not ((n <= 20 and m <= 10000) or (m <= 50 and n <= 50)):
        return None
    return 1 if m == 0 else max(1, n)


def orgqr_lwork(m: int, n: int, k: int) -> int | None:
    """``?orgqr``'s optimal ``lwork`` for ``Q`` of ``m x n`` from ``k`` reflectors
    (``m >= n >= k``): ``n``; from 32 rows MKL's threaded path asks for more."""
    if m >= 32:
        return None
    return max(1, n)


def ormqr_lwork(left: bool, m: int, n: int, k: int) -> int | None:
    """``?ormqr``'s optimal ``lwork`` for an ``m x n`` ``C`` and ``k`` reflectors:
    ``n`` (left) or ``m`` (right), 1 if anything is empty; for 32 rows or
    columns MKL's blocked and threaded paths ask for more."""
    if m >= 32 or n >= 32:
        return None
    if m == 0 or n == 0 or k == 0:
        return 1
    return n if left else m


def syevd_lwork(vectors: bool, n: int, threads: int) -> tuple[int, int] | None:
    """``?syevd``'s optimal ``(lwork, liwork)`` for an ``n x n`` matrix: with
    vectors LAPACK's documented minimum ``1 + 6n + 2n^2`` and ``3 + 5n``;
    without, ``3n`` up to ``n = 10``, then ``n`` times MKL's block size for
    ``?sytrd`` plus two (22 on one thread, 14 from ``n = 32`` on more)."""
    if n >= _SQUARE_LIMIT:
        return None
    if n <= 1:
        return 1, 1
    if vectors:
        return 1 + 6 * n + 2 * n * n, 3 + 5 * n
    if n <= 10:
        return 3 * n, 1
    return (22 * n if threads == 1 or n < 32 else 14 * n), 1


def geev_lwork(vectors: bool, n: int) -> int | None:
    """``?geev``'s optimal ``lwork`` (right vectors or none) for an ``n x n``
    matrix: ``34n``, and ``386n`` from ``n = 11`` with vectors."""
    if n >= _SQUARE_LIMIT:
        return None
    if n == 0:
        return 1
    return 386 * n if vectors and n > 10 else 34 * n


def sytrf_lwork(n: int) -> int | None:
    """``?sytrf``'s optimal ``lwork`` for an ``n x n`` matrix: ``n``, and
    ``24n`` from ``n = 11`` (blocked)."""
    if n >= _SQUARE_LIMIT:
        return None
    return n if n <= 10 else 24 * n
