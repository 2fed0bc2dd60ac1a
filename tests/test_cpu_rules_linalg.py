"""CPU rules for LAPACK-backed linear algebra (``cpu.linalg``, ``cpu.qr``, ``cpu.spectral``,
``cpu.lapack``, ``cpu.linalg_routes``): the kernels' column-major copies, pivots and
``info`` tensors, checks and LAPACK work arrays, equal to ``measure`` byte for byte;
what is not modelled is listed in ``unsupported``."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from exactness import Lambda, assert_exact

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cpu import CPU, lapack
from pytest_torchmem.engine.torch_compat.torch_release import installed_release, torch_minor
from pytest_torchmem.engine.tracing.rules import Alloc, OpCall

F32, I32, I64 = 4, 4, 8
L = torch.linalg


def _spd(*shape: int) -> torch.Tensor:
    a = torch.randn(*shape)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


def _fortran(t: torch.Tensor) -> torch.Tensor:
    return t.mT.contiguous().mT


def _exact(fn: Callable[..., Any], *tensors: torch.Tensor, train: bool = True) -> tm.MemoryReport:
    """``estimate == measure`` in every phase for ``fn(*tensors)``, nothing flagged."""
    torch.manual_seed(0)
    model = Lambda(fn, tensors)
    assert_exact(model, (), train=train)
    return tm.estimate(model, (), train=train)


# -- hand-computed figures ------------------------------------------------------------


def test_inv_factors_a_column_major_copy_and_checks_the_pivots() -> None:
    """``linalg.inv`` of a 5x5 matrix, forward: the input (100), the inverse (100) and
    ``info`` (4), then ``linalg_solve_ex_out``'s ``LU`` (100) and ``pivots`` (20), and
    ``lu_solve``'s checks ``pivots.gt(0).all()``: the wrapped 0 (8) cast to ``int32``
    (4), the ``bool`` result (5), the two freed, ``all``'s byte: 100 + 100 + 4 + 100 +
    20 + 8 + 4 + 5 = 341."""
    a = torch.randn(5, 5, requires_grad=True)
    report = _exact(lambda a: L.inv(a), a)
    assert report.forward_peak == 341


def test_eigh_takes_syevd_work_one_element_up() -> None:
    """``linalg.eigvalsh`` of a 5x5 matrix (no gradient): the values (20), a column-major
    copy of the input (100), ``info`` (4), ``?syevd``'s work without vectors (``3n`` =
    15, one ULP up: 16 floats) and ``iwork`` (1 int): 100 (input) + 20 + 100 + 4 + 64 + 4."""
    a = _spd(5, 5)
    assert _exact(lambda a: L.eigvalsh(a), a, train=False).forward_peak == 100 + 20 + 100 + 4 + 64 + 4


def test_geqrf_has_a_fake_kernel_and_its_work_array() -> None:
    """``geqrf`` has no meta kernel: the rule makes ``QR`` (column-major) and ``tau``,
    then ``apply_geqrf``'s ``max(n, lapack_work_to_int(n))`` = 6 floats for 5x5."""
    a = torch.randn(5, 5)
    report = _exact(lambda a: torch.geqrf(a), a, train=False)
    assert report.forward_peak == 100 + 100 + 20 + 6 * F32
    op = torch.ops.aten.geqrf.default
    call = OpCall(op, (torch.empty(5, 4, device="meta"),), {})
    steps = CPU.scratch_rule(op)(OpCall(op, call.args, {}, CPU.implementation_rule(op)(call)))
    assert {s.tag: s.nbytes for s in steps if isinstance(s, Alloc)} == {"geqrf work": 5 * F32}


def test_work_to_int_is_one_ulp_up() -> None:
    """``lapack_work_to_int``: exact integers gain one element; beyond 2**24 a float32's
    ULP is 2."""
    assert lapack.work_to_int(5.0, torch.float32) == 6
    assert lapack.work_to_int(1.0, torch.float64) == 2
    assert lapack.work_to_int(float(2**24 + 2), torch.float32) == 2**24 + 4
    assert lapack.work_to_int(0.0, torch.float32) == 1


# -- estimate == measure ------------------------------------------------------------------

_CASES: dict[str, tuple[Callable[..., Any], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "inv batch": (lambda a: L.inv(a), lambda: (torch.randn(3, 4, 4),)),
    "inv_ex check_errors": (lambda a: L.inv_ex(a, check_errors=True)[0], lambda: (torch.randn(2, 4, 4),)),
    "inv column-major": (lambda a: L.inv(a), lambda: (_fortran(torch.randn(6, 6)),)),
    "solve vector": (lambda a, b: L.solve(a, b), lambda: (torch.randn(6, 6), torch.randn(6))),
    "solve batch vector": (lambda a, b: L.solve(a, b), lambda: (torch.randn(3, 6, 6), torch.randn(3, 6))),
    "solve broadcast": (lambda a, b: L.solve(a, b), lambda: (torch.randn(6, 6), torch.randn(2, 6, 3))),
    "solve right": (lambda a, b: L.solve(a, b, left=False), lambda: (torch.randn(5, 5), torch.randn(3, 5))),
    "det batch": (lambda a: L.det(a), lambda: (torch.randn(4, 6, 6),)),
    "slogdet batch": (lambda a: L.slogdet(a)[1], lambda: (torch.randn(3, 5, 5),)),
    "logdet": (lambda a: torch.logdet(a), lambda: (_spd(6, 6),)),
    "cholesky batch": (lambda a: L.cholesky(a), lambda: (_spd(3, 5, 5),)),
    "cholesky of a transposed batch": (lambda a: L.cholesky(a.mT, upper=True), lambda: (_spd(2, 2, 5, 5),)),
    "cholesky (deprecated)": (lambda a: torch.cholesky(a), lambda: (_spd(3, 5, 5),)),
    "cholesky_inverse": (lambda a: torch.cholesky_inverse(L.cholesky(a)), lambda: (_spd(3, 5, 5),)),
    "cholesky_solve broadcast": (
        lambda b, a: torch.cholesky_solve(b, L.cholesky(a)),
        lambda: (torch.randn(2, 5, 3), _spd(5, 5)),
    ),
    "lu batch wide": (lambda a: L.lu(a)[1:], lambda: (torch.randn(3, 4, 6),)),
    "lu batch tall": (lambda a: L.lu(a)[1:], lambda: (torch.randn(2, 6, 4),)),
    "lu_unpack batch": (lambda a: torch.lu_unpack(*L.lu_factor(a))[1:], lambda: (torch.randn(3, 4, 5),)),
    "lu_solve batch": (lambda a, b: L.lu_solve(*L.lu_factor(a), b), lambda: (torch.randn(3, 5, 5), torch.randn(3, 5, 2))),
    "lu_solve broadcast": (
        lambda a, b: L.lu_solve(*L.lu_factor(a), b),
        lambda: (torch.randn(5, 5), torch.randn(3, 5, 2)),
    ),
    "lu_solve adjoint right": (
        lambda a, b: L.lu_solve(*L.lu_factor(a), b, left=False, adjoint=True),
        lambda: (torch.randn(5, 5), torch.randn(2, 5)),
    ),
    "lu_solve row-major LU": (
        lambda a, b: L.lu_solve(L.lu_factor(a)[0].contiguous(), L.lu_factor(a)[1], b),
        lambda: (torch.randn(5, 5), torch.randn(5, 2)),
    ),
    "qr batch": (lambda a: L.qr(a), lambda: (torch.randn(3, 6, 4),)),
    "qr batch wide": (lambda a: L.qr(a), lambda: (torch.randn(3, 4, 6),)),
    "svd batch": (lambda a: L.svd(a, full_matrices=False), lambda: (torch.randn(3, 6, 4),)),
    "svd full": (lambda a: L.svd(a), lambda: (torch.randn(6, 4),)),
    "svd, a copy through transpose blocks": (lambda a: L.svd(a, full_matrices=False), lambda: (torch.randn(100, 80),)),
    "cholesky_solve, copies through transpose blocks": (
        lambda b, a: torch.cholesky_solve(b, L.cholesky(a)),
        lambda: (torch.randn(70, 70), _spd(70, 70)),
    ),
    "eigh batch": (lambda a: L.eigh(a), lambda: (_spd(3, 6, 6),)),
    "eigh blocked": (lambda a: L.eigh(a), lambda: (_spd(12, 12),)),
    "eig, real part": (lambda a: L.eig(a)[0].real, lambda: (torch.randn(5, 5),)),
    "pinv batch": (lambda a: L.pinv(a), lambda: (torch.randn(2, 5, 4),)),
    "pinv hermitian": (lambda a: L.pinv(a, hermitian=True), lambda: (_spd(2, 5, 5),)),
    "pinv atol": (lambda a: L.pinv(a, atol=0.1), lambda: (torch.randn(5, 4),)),
    "solve_triangular broadcast": (
        lambda a, b: L.solve_triangular(a.triu(), b, upper=True),
        lambda: (torch.randn(5, 5), torch.randn(3, 5, 2)),
    ),
    "solve_triangular strided A": (
        lambda a, b: L.solve_triangular(a[:, ::2], b, upper=False),
        lambda: (torch.randn(5, 10), torch.randn(5, 2)),
    ),
    "tril of a transposed batch": (lambda a: a.mT.tril(), lambda: (torch.randn(2, 3, 4, 4),)),
    "triu_ of a transposed batch": (lambda a: (a * 1).mT.triu_(), lambda: (torch.randn(2, 3, 4, 4),)),
    "tensorinv": (lambda a: L.tensorinv(a, 2), lambda: (torch.randn(4, 6, 8, 3),)),
}

if installed_release()[:2] >= (2, 14):
    # From 2.14 torch.cholesky only raises "This function was deprecated since
    # version 1.9 and is now removed" (torch/_linalg_utils.py:74-75 of 2.14.1
    # and 2.15.0) and aten.cholesky is gone: there is no step to compare.
    del _CASES["cholesky (deprecated)"]

_FORWARD: dict[str, tuple[Callable[..., Any], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "svdvals": (lambda a: L.svdvals(a), lambda: (torch.randn(3, 6, 4),)),
    "eigvalsh": (lambda a: L.eigvalsh(a), lambda: (_spd(12, 12),)),
    "eigvalsh, 40x40": (lambda a: L.eigvalsh(a), lambda: (_spd(40, 40),)),
    "eigvals batch": (lambda a: L.eigvals(a), lambda: (torch.randn(2, 12, 12),)),
    "eig": (lambda a: L.eig(a)[0], lambda: (torch.randn(12, 12),)),
    "cond": (lambda a: L.cond(a), lambda: (torch.randn(2, 5, 5),)),
    "matrix_norm 2": (lambda a: L.matrix_norm(a, 2), lambda: (torch.randn(2, 5, 5),)),
    "svd(compute_uv=False)": (lambda a: torch.svd(a, compute_uv=False)[1], lambda: (torch.randn(5, 4),)),
    "matrix_rank batch": (lambda a: L.matrix_rank(a), lambda: (torch.randn(3, 5, 4),)),
    "matrix_rank atol": (lambda a: L.matrix_rank(a, atol=0.5), lambda: (torch.randn(5, 4),)),
    "matrix_rank tensor atol": (lambda a: L.matrix_rank(a, atol=torch.tensor(0.5)), lambda: (torch.randn(5, 4),)),
    "matrix_rank hermitian": (lambda a: L.matrix_rank(a, hermitian=True), lambda: (_spd(3, 5, 5),)),
    "matrix_rank 1x1": (lambda a: L.matrix_rank(a), lambda: (torch.randn(1, 1),)),
    "matrix_rank tol": (lambda a: L.matrix_rank(a, 0.5), lambda: (torch.randn(5, 4),)),
    "matrix_rank tensor tol": (lambda a: L.matrix_rank(a, torch.tensor(0.5)), lambda: (torch.randn(5, 4),)),
    "matrix_rank rtol": (lambda a: L.matrix_rank(a, rtol=0.1), lambda: (torch.randn(5, 4),)),
    "matrix_rank out": (
        lambda a: L.matrix_rank(a, out=torch.empty((), dtype=torch.long)),
        lambda: (torch.randn(5, 4),),
    ),
    "geqrf batch": (lambda a: torch.geqrf(a), lambda: (torch.randn(3, 6, 4),)),
    "qr complete": (lambda a: L.qr(a, "complete"), lambda: (torch.randn(6, 4),)),
    "qr r batch": (lambda a: L.qr(a, "r")[1], lambda: (torch.randn(2, 6, 4),)),
    "householder_product": (lambda a, t: L.householder_product(a, t), lambda: (torch.randn(3, 6, 4), torch.randn(3, 3))),
    "ormqr right": (
        lambda a, t, c: torch.ormqr(a, t, c, left=False),
        lambda: (torch.randn(5, 5), torch.randn(5), torch.randn(3, 5)),
    ),
    "ldl_factor batch": (lambda a: L.ldl_factor(a), lambda: (_spd(2, 6, 6),)),
    "ldl_factor blocked": (lambda a: L.ldl_factor(a), lambda: (_spd(12, 12),)),
    "ldl_solve batch": (lambda a, b: L.ldl_solve(*L.ldl_factor(a), b), lambda: (_spd(2, 6, 6), torch.randn(2, 6, 3))),
    "matrix_exp of 1x1 matrices": (lambda a: torch.matrix_exp(a), lambda: (torch.randn(3, 1, 1),)),
    "eigvalsh 70x70, a copy through transpose blocks": (lambda a: L.eigvalsh(a), lambda: (_spd(70, 70),)),
    "qr r, a copy through transpose blocks": (lambda a: L.qr(a, "r")[1], lambda: (torch.randn(200, 20),)),
}


@pytest.mark.parametrize("name", _CASES)
@pytest.mark.filterwarnings(r"ignore:torch\.cholesky is deprecated:UserWarning")  # (the deprecated case's own)
def test_step_equals_measure(name: str, threads: int) -> None:
    fn, make = _CASES[name]
    torch.manual_seed(0)
    _exact(fn, *make())


@pytest.mark.parametrize("name", _FORWARD)
def test_forward_equals_measure(name: str, threads: int) -> None:
    """Without a gradient: the values-only paths (``svdvals``, ``eigvalsh``,
    ``_linalg_eigvals``, ``matrix_rank``'s ``sum_out``), and ops with no derivative."""
    fn, make = _FORWARD[name]
    torch.manual_seed(0)
    _exact(fn, *make(), train=False)


def test_lu_without_pivoting_raises_as_the_cpu_kernel_does() -> None:
    model = Lambda(lambda a: L.lu(a, pivot=False), (torch.randn(3, 3),))
    with pytest.raises(RuntimeError, match="LU without pivoting is not implemented on the CPU"):
        tm.estimate(model, ())


# -- what is listed in unsupported ------------------------------------------------------------


def _flagged(fn: Callable[..., Any], *tensors: torch.Tensor, train: bool = False) -> list[str]:
    report = tm.estimate(Lambda(fn, tensors), (), train=train)
    return [u.reason for u in report.unsupported]


def test_matrix_exp_is_listed_where_norms_choose_the_algorithm() -> None:
    reasons = _flagged(lambda a: torch.matrix_exp(a), torch.randn(2, 4, 4))
    assert any("norms" in r for r in reasons), reasons


def test_householder_backward_is_listed() -> None:
    """``householder_product_backward`` keeps every column's gradient for a ``cat`` on
    fake tensors (a tensor subclass), where the eager step writes them into zeros."""
    reasons = _flagged(lambda a, t: L.householder_product(a, t), torch.randn(6, 4), torch.randn(3), train=True)
    assert any("householder_product_backward" in r for r in reasons), reasons


@pytest.mark.parametrize(
    "fn, shape, routine",
    [
        (lambda a: torch.geqrf(a), (100, 100), "?geqrf"),
        (lambda a: L.qr(a), (40, 8), "?orgqr"),
        (lambda a: L.eigvalsh(a), (600, 600), "?syevd"),
        (lambda a: L.eigvals(a), (600, 600), "?geev"),
        (lambda a: L.ldl_factor(a), (600, 600), "?sytrf"),
    ],
)
def test_unmodelled_workspace_sizes_are_listed(fn: Callable[..., Any], shape: tuple[int, ...], routine: str) -> None:
    """Beyond the sizes whose MKL answer is modelled, the call is listed (the fake trace
    never runs LAPACK: a large matrix costs nothing)."""
    reasons = _flagged(fn, torch.empty(shape, device="meta"))
    assert any(routine in r for r in reasons), reasons


def test_complex_routines_are_listed() -> None:
    reasons = _flagged(lambda a: L.eigh(a), torch.randn(4, 4, dtype=torch.complex64))
    assert any("complex" in r for r in reasons), reasons


# -- MKL's answers to the workspace queries ---------------------------------------------------

_QUERY = Path(__file__).with_name("lapack_query.py")


def _library() -> ctypes.CDLL:
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        lib.sgeqrf_  # noqa: B018 - the symbol is looked up
    except (OSError, AttributeError):
        pytest.skip("torch is not linked with an exported MKL LAPACK")
    return lib


def test_workspace_formulas_equal_mkls_answers(threads: int) -> None:
    """:mod:`cpu.lapack`'s formulas against ``?geqrf``, ``?orgqr``, ``?ormqr``, ``?syevd``,
    ``?geev`` and ``?sytrf`` queried with ``lwork = -1`` (``tests/lapack_query.py``), over
    the sizes each claims, at this thread count."""
    _library()
    from lapack_query import mismatches

    assert mismatches(threads) == []


@pytest.mark.parametrize("isa", ["SSE4_2", "AVX2"])
def test_workspace_formulas_hold_on_lower_isas(isa: str) -> None:
    """The same, in a process whose MKL is capped (``MKL_ENABLE_INSTRUCTIONS``): the
    answers within the modelled sizes do not depend on the ISA."""
    _library()
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": isa}
    done = subprocess.run(
        [sys.executable, str(_QUERY), "2"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.skipif(torch_minor() < (2, 14), reason="linalg.matrix_sqrth and linalg.polar are new in torch 2.14")
@pytest.mark.parametrize("fn", ["matrix_sqrth", "polar"])
def test_the_kernels_new_in_torch_2_14_are_listed_not_silently_low(fn: str) -> None:
    """Their CPU kernels decompose the input inside, which the rules do not model: the
    estimate lists them (the real forward peak is above the outputs the trace counts)."""
    a = torch.randn(4, 4)
    spd = a @ a.mT + 4 * torch.eye(4)
    model = Lambda(lambda x: getattr(torch.linalg, fn)(x))
    estimated = tm.estimate(model, spd, train=False)
    assert [u.op for u in estimated.unsupported] == [f"aten.linalg_{fn}.default"]
    assert estimated.forward_peak < tm.measure(model, spd, train=False).forward_peak
