"""CPU rules: eigen and singular value decompositions, the matrix exponential, pinv.

As in :mod:`.linalg`, the kernels (``BatchLinearAlgebra.cpp``,
``BatchLinearAlgebraKernel.cpp``, torch 2.13) take column-major copies, an
``info`` tensor and LAPACK work arrays from the allocator around their outputs.
``?gesdd``'s work arrays are ``std::vector``\\ s, outside the allocator.

Values only: ``linalg_svdvals``, ``linalg_eigvalsh`` (and ``matrix_rank``,
``cond``, ``matrix_norm`` through them) compute the vectors only when the input
may need a gradient, ``_may_require_fw_or_bw_grad``, which is true for any
tensor subclass: fake tensors always take the vectors. The CPU router
(:mod:`.linalg_routes`) marks these calls when no gradient is needed; the
decompositions then run without vectors, as the real kernels do.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cpu import lapack
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.linalg import (
    INT32,
    all_item,
    batch_numel,
    check_errors,
    column_major_copy,
    compare,
    compare_all,
    complex_gap,
    lapack_gap,
)
from pytest_torchmem.engine.tracing.devices.cpu.linalg_routes import values_only
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Step, Steps

__all__: list[str] = []

# torch's private names (engine/torch_compat/torch_private.py)
DispatchKey: Final = private("torch._C.DispatchKey")

aten = torch.ops.aten


# -- SVD ------------------------------------------------------------------------------


@CPU.implementation(aten._linalg_svd.default)
def _svd_outputs(call: OpCall) -> Any:
    """``linalg_svdvals``'s ``_linalg_svd(A, false, compute_uv=false)`` where the
    composite, on a fake tensor, asked for the vectors."""
    A, full_matrices = call.args[0], arg(call, 1, "full_matrices", True)
    driver = arg(call, 3, "driver", None)
    if arg(call, 2, "compute_uv", True) and call.context is not None and values_only(call.context.memo):
        return call.func(A, full_matrices, False, driver=driver)
    return call.default()


@CPU.scratch(aten._linalg_svd.default)
def _svd(call: OpCall) -> Steps:
    """``_linalg_svd_out``: ``info`` (``at::zeros`` of the batch shape), then
    ``svd_kernel``'s column-major copy of ``A`` (``?gesdd``'s work arrays are
    ``std::vector``\\ s), the check of ``info``."""
    A = call.args[0]
    if A.numel() == 0:
        return [OUTPUTS]
    batch = batch_numel(A)
    return [
        OUTPUTS, Alloc("info", batch * INT32),
        *column_major_copy(A, "A (column-major)"), Free("A (column-major)"),
        *check_errors(profile_of(call).threads, batch), Free("info"),
    ]  # fmt: skip


# -- symmetric eigendecomposition ------------------------------------------------------


@CPU.implementation(aten._linalg_eigh.default)
def _eigh_outputs(call: OpCall) -> Any:
    """``linalg_eigvalsh``'s ``_linalg_eigh(A, uplo, compute_v=false)`` where the
    composite, on a fake tensor, asked for the vectors."""
    A, uplo = call.args[0], arg(call, 1, "UPLO", "L")
    if arg(call, 2, "compute_v", True) and call.context is not None and values_only(call.context.memo):
        return call.func(A, uplo, False)
    return call.default()


@CPU.scratch(aten._linalg_eigh.default)
def _eigh(call: OpCall) -> Steps:
    """``_linalg_eigh_out``: without vectors, a column-major copy of ``A`` to work
    in; ``info``; ``apply_lapack_eigh``'s ``?syevd`` ``work`` (one ULP up) and
    ``iwork``; the check of ``info``."""
    A = call.args[0]
    if A.numel() == 0:
        return [OUTPUTS]
    vectors = call.out[1].numel() > 0
    n = A.shape[-1]
    batch = batch_numel(A)
    threads = profile_of(call).threads
    steps: list[Step] = [*complex_gap(A), OUTPUTS]
    if not vectors:
        steps += column_major_copy(A, "A (column-major)")
    steps.append(Alloc("info", batch * INT32))
    sizes = lapack.syevd_lwork(vectors, n, threads)
    if sizes is None:
        steps.append(lapack_gap("?syevd", f"a {n}x{n} matrix"))
    else:
        lwork, liwork = sizes
        steps += [
            Alloc("syevd work", lapack.work_to_int(lwork, A.dtype) * A.element_size()),
            Alloc("syevd iwork", max(1, liwork) * INT32),
            Free("syevd iwork"), Free("syevd work"),
        ]  # fmt: skip
    return [*steps, *check_errors(threads, batch), Free("info"), Free("A (column-major)")]


# -- general eigendecomposition ----------------------------------------------------------


def _isfinite_all(threads: int, A: torch.Tensor) -> list[Step]:
    """``input.isfinite().all().item()`` (``linalg_eig_out``'s check): ``isfinite`` is
    ``(self == self) * (self.abs() != inf)``, its right operand first."""
    numel = A.numel()
    return [
        Alloc("abs(A)", numel * A.element_size()), *compare(numel, A.dtype, "abs(A) != inf"),
        Alloc("A == A", numel), Alloc("isfinite", numel),
        Free("A == A"), Free("abs(A) != inf"), Free("abs(A)"),
        *all_item(threads, numel, "isfinite"), Free("isfinite"),
    ]  # fmt: skip


def _eig_steps(call: OpCall, vectors: bool) -> list[Step]:
    """``linalg_eig_out_info`` after ``infos`` and the outputs: the real and
    imaginary parts of the values (``2n`` per matrix), a column-major ``float``
    copy for the vectors, ``linalg_eig_kernel``'s column-major copy of ``A`` and
    ``?geev``'s work array, then ``all(imag == 0)``."""
    A = call.args[0]
    n = A.shape[-1]
    batch = batch_numel(A)
    size = A.element_size()
    threads = profile_of(call).threads
    steps: list[Step] = [Alloc("real and imaginary values", batch * 2 * n * size)]
    if vectors:
        steps.append(Alloc("real vectors", A.numel() * size))
    steps.append(Alloc("A (column-major)", A.numel() * size))
    lwork = lapack.geev_lwork(vectors, n)
    if lwork is None:
        steps.append(lapack_gap("?geev", f"a {n}x{n} matrix"))
    else:
        work = lapack.work_to_int(lwork, A.dtype) * size
        steps += [Alloc("geev work", work), Free("geev work")]
    steps += [Free("A (column-major)"), *compare_all(threads, batch * n, A.dtype, "imag == 0")]
    return [*steps, Free("real vectors"), Free("real and imaginary values")]


@CPU.scratch(aten.linalg_eig.default)
def _eig(call: OpCall) -> Steps:
    """``linalg_eig_out``: the check ``input.isfinite().all()``, ``infos``
    (``at::zeros({max(1, batch)})``), the outputs, ``linalg_eig_out_info``, the
    check of ``infos``."""
    A = call.args[0]
    threads = profile_of(call).threads
    infos = max(1, batch_numel(A))
    return [
        *complex_gap(A), *_isfinite_all(threads, A), Alloc("infos", infos * INT32), OUTPUTS,
        *_eig_steps(call, vectors=True), *check_errors(threads, infos, "infos"), Free("infos"),
    ]  # fmt: skip


@CPU.scratch(aten._linalg_eigvals.default)
def _eigvals(call: OpCall) -> Steps:
    """``linalg_eigvals_out``: ``infos``, the output, ``linalg_eig_out_info`` without
    vectors, the check (no finiteness check)."""
    A = call.args[0]
    threads = profile_of(call).threads
    infos = max(1, batch_numel(A))
    return [
        *complex_gap(A), Alloc("infos", infos * INT32), OUTPUTS,
        *_eig_steps(call, vectors=False), *check_errors(threads, infos, "infos"), Free("infos"),
    ]  # fmt: skip


# -- matrix exponential ----------------------------------------------------------------

_MEXP: Final = Inexact(
    "the matrix exponential's degree and scaling are chosen from the matrices' norms "
    "(tensor values), and its temporaries with them; only the output is counted"
)


@CPU.scratch(aten.linalg_matrix_exp.default)
def _matrix_exp(call: OpCall) -> Steps:
    """``linalg_matrix_exp`` (``LinearAlgebra.cpp``): ``clone`` for 0x0 matrices,
    ``exp`` for 1x1 ones (the output alone); otherwise ``mexp``, whose Taylor
    degree (one matrix) or squarings (a batch: sort, ``unique_consecutive``) are
    chosen from the norms."""
    n = call.args[0].shape[-1]
    return [OUTPUTS] if n <= 1 else [_MEXP, OUTPUTS]


# -- pinv ----------------------------------------------------------------------------------


@CPU.composite(aten.linalg_pinv.atol_rtol_tensor)
def _pinv(call: OpCall) -> Any:
    """``linalg_pinv`` (``LinearAlgebra.cpp``) is ``CompositeExplicitAutogradNonFunctional``
    without a meta kernel: fake tensors run its composite inside their own
    dispatch, where the trace would see one op. Run here, its ``_linalg_svd`` or
    ``_linalg_eigh`` and a dozen elementwise temporaries are traced."""
    return call.func._op_dk(DispatchKey.CompositeExplicitAutogradNonFunctional, *call.args, **call.kwargs)

