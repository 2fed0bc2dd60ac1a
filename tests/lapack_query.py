"""MKL's answers to LAPACK's ``lwork = -1`` workspace queries, against ``cpu.lapack``.

The single-precision routines are exported by torch's ``libtorch_cpu.so`` (MKL is
linked statically); each is called through ctypes with null matrices, as a query
reads only the sizes. Used by ``tests/test_cpu_rules_linalg.py``, in process and,
with ``MKL_ENABLE_INSTRUCTIONS`` set, as a script::

    MKL_ENABLE_INSTRUCTIONS=AVX2 python tests/lapack_query.py THREADS   # prints the mismatches
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pytest_torchmem.engine.tracing.devices.cpu import lapack

_I = ctypes.c_int
_F = ctypes.c_float


def _lib() -> Any:
    return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))


def _ref(value: int) -> Any:
    return ctypes.byref(_I(value))


def _chars(*values: str) -> list[Any]:
    return [ctypes.c_char_p(v.encode()) for v in values]


def geqrf(lib: Any, m: int, n: int) -> float:
    work, info = _F(), _I()
    lib.sgeqrf_(_ref(m), _ref(n), None, _ref(max(1, m)), None, ctypes.byref(work), _ref(-1), ctypes.byref(info))
    return work.value


def orgqr(lib: Any, m: int, n: int, k: int) -> float:
    work, info = _F(), _I()
    lib.sorgqr_(_ref(m), _ref(n), _ref(k), None, _ref(max(1, m)), None, ctypes.byref(work), _ref(-1), ctypes.byref(info))
    return work.value


def ormqr(lib: Any, left: bool, transpose: bool, m: int, n: int, k: int) -> float:
    work, info = _F(), _I()
    side, trans = _chars("L" if left else "R", "T" if transpose else "N")
    lda = max(1, m if left else n)
    lib.sormqr_(
        side, trans, _ref(m), _ref(n), _ref(k), None, _ref(lda), None, None, _ref(max(1, m)),
        ctypes.byref(work), _ref(-1), ctypes.byref(info),
    )  # fmt: skip
    return work.value


def syevd(lib: Any, vectors: bool, n: int) -> tuple[float, int]:
    work, iwork, info = _F(), _I(), _I()
    jobz, uplo = _chars("V" if vectors else "N", "L")
    lib.ssyevd_(
        jobz, uplo, _ref(n), None, _ref(max(1, n)), None, ctypes.byref(work), _ref(-1),
        ctypes.byref(iwork), _ref(-1), ctypes.byref(info),
    )  # fmt: skip
    return work.value, iwork.value


def geev(lib: Any, vectors: bool, n: int) -> float:
    work, info = _F(), _I()
    jobvl, jobvr = _chars("N", "V" if vectors else "N")
    lib.sgeev_(
        jobvl, jobvr, _ref(n), None, _ref(max(1, n)), None, None, None, _ref(1), None,
        _ref(max(1, n) if vectors else 1), ctypes.byref(work), _ref(-1), ctypes.byref(info),
    )  # fmt: skip
    return work.value


def sytrf(lib: Any, n: int) -> float:
    work, info = _F(), _I()
    uplo = ctypes.c_char_p(b"L")
    lib.ssytrf_(uplo, _ref(n), None, _ref(max(1, n)), None, ctypes.byref(work), _ref(-1), ctypes.byref(info))
    return work.value


def _cases(lib: Any, threads: int) -> Iterator[tuple[str, Any, Any]]:
    """``(what, MKL's answer, the formula's)`` over the sizes each formula claims."""
    shapes = [(m, n) for m in range(51) for n in range(51)]
    shapes += [(m, n) for m in (64, 100, 1000, 4096, 10000) for n in range(21)]
    for m, n in shapes:
        yield f"geqrf {m}x{n}", geqrf(lib, m, n), lapack.geqrf_lwork(m, n)
    for m in range(32):
        for n in range(m + 1):
            for k in sorted({0, n // 2, n}):
                yield f"orgqr {m}x{n} k={k}", orgqr(lib, m, n, k), lapack.orgqr_lwork(m, n, k)
    for left in (True, False):
        for transpose in (False, True):
            for m in range(32):
                for n in range(32):
                    for k in sorted({0, (m if left else n) // 2, m if left else n}):
                        answer = ormqr(lib, left, transpose, m, n, k)
                        yield f"ormqr {left} {transpose} {m}x{n} k={k}", answer, lapack.ormqr_lwork(left, m, n, k)
    for n in range(600):
        for vectors in (False, True):
            yield f"syevd {vectors} {n}", syevd(lib, vectors, n), lapack.syevd_lwork(vectors, n, threads)
            yield f"geev {vectors} {n}", geev(lib, vectors, n), lapack.geev_lwork(vectors, n)
        yield f"sytrf {n}", sytrf(lib, n), lapack.sytrf_lwork(n)


def mismatches(threads: int) -> list[str]:
    """The queries whose answer the formula does not give, at ``threads`` threads."""
    torch.set_num_threads(threads)
    lib = _lib()
    found = []
    for what, answer, formula in _cases(lib, threads):
        if isinstance(answer, tuple):
            same = formula is not None and (float(formula[0]), formula[1]) == answer
        else:
            same = formula is not None and float(formula) == answer
        if not same:
            found.append(f"{what}: MKL {answer}, formula {formula}")
    return found


if __name__ == "__main__":
    print(mismatches(int(sys.argv[1])))
