"""CPU rules: QR (``geqrf``, ``orgqr``, ``ormqr``) and LDL (``sytrf``, ``sytrs``).

The kernels (``BatchLinearAlgebra.cpp``, ``BatchLinearAlgebraKernel.cpp``,
torch 2.13) take LAPACK work arrays sized by the ``lwork = -1`` query
(:mod:`.lapack`), column-major and contiguous copies of their inputs, and
the small tensors of their checks; see :mod:`.linalg`.
"""

from __future__ import annotations

import torch

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu import lapack
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.linalg import (
    INT32,
    batch_numel,
    check_errors,
    column_major_copy,
    compare_all,
    complex_gap,
    f_contiguous,
    f_strides,
    lapack_gap,
    tri_steps,
    work,
)
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Step, Steps

__all__: list[str] = []

aten = torch.ops.aten


# -- QR ---------------------------------------------------------------------------------


def _geqrf_work(m: int, n: int, dtype: torch.dtype) -> list[Step]:
    """``apply_geqrf``: ``max(n, lapack_work_to_int(lwork))`` elements."""
    lwork = lapack.geqrf_lwork(m, n)
    if lwork is None:
        return [lapack_gap("?geqrf", f"a {m}x{n} matrix")]
    return work("geqrf work", max(n, lapack.work_to_int(lwork, dtype)), dtype)


def _orgqr_work(m: int, n: int, k: int, dtype: torch.dtype) -> list[Step]:
    """``apply_orgqr`` (nothing for an empty ``Q``)."""
    if m * n == 0:
        return []
    lwork = lapack.orgqr_lwork(m, n, k)
    if lwork is None:
        return [lapack_gap("?orgqr", f"a {m}x{n} Q")]
    return work("orgqr work", lapack.work_to_int(lwork, dtype), dtype)


@CPU.implementation(aten.geqrf.default)
def _geqrf_outputs(call: OpCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``geqrf`` has no meta kernel: its outputs, ``QR`` column-major like the input
    and ``tau`` of ``min(m, n)`` per matrix (``geqrf_out_helper``)."""
    A = call.args[0]
    if A.dim() < 2:
        raise RuntimeError("torch.geqrf: input must have at least 2 dimensions.")
    m, n = A.shape[-2], A.shape[-1]
    qr = A.new_empty_strided(A.shape, f_strides(A.shape))
    tau = A.new_empty((*A.shape[:-2], min(m, n)))
    return qr, tau


@CPU.scratch(aten.geqrf.default)
def _geqrf(call: OpCall) -> Steps:
    A = call.args[0]
    return [*complex_gap(A), OUTPUTS, *_geqrf_work(A.shape[-2], A.shape[-1], A.dtype)]


def _contiguous_copy(t: torch.Tensor, tag: str) -> list[Step]:
    return [] if t.is_contiguous() else [Alloc(tag, t.numel() * t.element_size())]


@CPU.scratch(aten.linalg_householder_product.default)
def _householder_product(call: OpCall) -> Steps:
    """``householder_product_out_helper``: the output resized column-major, ``tau``
    made contiguous, ``orgqr`` in place."""
    A, tau = call.args[0], call.args[1]
    m, n, k = A.shape[-2], A.shape[-1], tau.shape[-1]
    return [
        *complex_gap(A), OUTPUTS, *_contiguous_copy(tau, "tau (contiguous)"),
        *_orgqr_work(m, n, k, A.dtype), Free("tau (contiguous)"),
    ]  # fmt: skip


@CPU.scratch(aten.ormqr.default)
def _ormqr(call: OpCall) -> Steps:
    """``ormqr_out_helper``: the output column-major, ``tau`` contiguous and the
    reflectors column-major (copies if not), then ``apply_ormqr``'s work array
    (``max(1, lwork)`` elements, truncated)."""
    A, tau, other = call.args[0], call.args[1], call.args[2]
    left = arg(call, 3, "left", True)
    m, n, k = other.shape[-2], other.shape[-1], tau.shape[-1]
    steps: list[Step] = [*complex_gap(A), OUTPUTS, *_contiguous_copy(tau, "tau (contiguous)")]
    if not f_contiguous(A.shape, A.stride()):
        steps.append(Alloc("input (column-major)", A.numel() * A.element_size()))
    lwork = lapack.ormqr_lwork(left, m, n, k)
    if lwork is None:
        steps.append(lapack_gap("?ormqr", f"a {m}x{n} C"))
    else:
        steps += work("ormqr work", max(1, lwork), A.dtype)
    return [*steps, Free("input (column-major)"), Free("tau (contiguous)")]


@CPU.scratch(aten.linalg_qr.default)
def _qr(call: OpCall) -> Steps:
    """``linalg_qr_out``: ``tau``; ``geqrf`` in ``Q`` if it is ``m x n``, else in ``R``
    if it is ``m`` rows tall, else in a column-major copy of ``A``; ``R`` is the
    upper triangle of that (``triu_out`` of a slice, or ``triu_`` in place), then
    ``orgqr`` makes ``Q``."""
    A = call.args[0]
    mode = arg(call, 1, "mode", "reduced")
    Q, R = call.out
    m, n = A.shape[-2], A.shape[-1]
    k = min(m, n)
    size = A.element_size()
    compute_q = mode != "r"
    steps: list[Step] = [*complex_gap(A), OUTPUTS, Alloc("tau", batch_numel(A) * k * size)]
    in_r = False
    if compute_q and Q.shape[-1] == n:
        qr_sizes, qr_strides = Q.shape, Q.stride()
    elif R.shape[-2] == m:
        in_r = True
    else:
        steps += column_major_copy(A, "A (column-major)")
        qr_sizes, qr_strides = A.shape, f_strides(A.shape)
    steps += _geqrf_work(m, n, A.dtype)
    if in_r:
        steps += tri_steps(R.shape, R.stride(), A.dtype, True, "triu_")
    else:
        steps += tri_steps((*qr_sizes[:-2], n, qr_sizes[-1]), qr_strides, A.dtype, False, "triu")
    if compute_q:
        steps += _orgqr_work(m, Q.shape[-1], k, A.dtype)
    return [*steps, Free("A (column-major)"), Free("tau")]


# -- LDL ----------------------------------------------------------------------------


@CPU.scratch(aten.linalg_ldl_factor_ex.default)
def _ldl_factor_ex(call: OpCall) -> Steps:
    """``linalg_ldl_factor_ex_out``: ``tril_out(LD, A)``, then ``sytrf``'s work array
    (``max(1, lwork)``, truncated); the check if ``check_errors``."""
    A = call.args[0]
    if A.numel() == 0:
        return [OUTPUTS]
    n = A.shape[-1]
    steps: list[Step] = [*complex_gap(A), OUTPUTS, *tri_steps(A.shape, A.stride(), A.dtype, False, "tril")]
    lwork = lapack.sytrf_lwork(n)
    if lwork is None:
        steps.append(lapack_gap("?sytrf", f"a {n}x{n} matrix"))
    else:
        steps += work("sytrf work", max(1, lwork), A.dtype)
    if arg(call, 2, "check_errors", False):
        steps += check_errors(profile_of(call).threads, batch_numel(A))
    return steps


@CPU.scratch(aten.linalg_ldl_solve.default)
def _ldl_solve(call: OpCall) -> Steps:
    """``linalg_ldl_solve_out``: ``pivots`` contiguous and ``LD`` column-major (copies
    if not), then, from torch 2.13, the kernel's checks of the pivots:
    ``pivots.abs() >= 1`` and ``pivots.abs() <= n``, each through the absolute
    values (2.10 to 2.12 check nothing)."""
    LD, pivots = call.args[0], call.args[1]
    if LD.numel() == 0 or pivots.numel() == 0:
        return [OUTPUTS]
    threads = profile_of(call).threads
    count = pivots.numel()
    steps: list[Step] = [*complex_gap(LD), OUTPUTS, *_contiguous_copy(pivots, "pivots (contiguous)")]
    if not f_contiguous(LD.shape, LD.stride()):
        steps += column_major_copy(LD, "LD (column-major)")
    for check in ("|pivots| >= 1", "|pivots| <= n") if torch_minor() >= (2, 13) else ():
        steps.append(Alloc(f"{check}: abs", count * INT32))
        steps += [*compare_all(threads, count, torch.int32, check), Free(f"{check}: abs")]
    return [*steps, Free("LD (column-major)"), Free("pivots (contiguous)")]
