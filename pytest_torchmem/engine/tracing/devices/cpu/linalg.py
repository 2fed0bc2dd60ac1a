"""CPU rules: LAPACK-backed linear algebra, listed as partly modelled.

These kernels take workspaces from the allocator whose sizes LAPACK or MKL
decide at run time (``lwork`` queries: ``?getri``, ``?syevd``, ``?gesdd``...),
and pivot, info and permuted input copies that follow each function's own code
(``aten/src/ATen/native/BatchLinearAlgebra.cpp``). The
rules count the outputs, and list the call in ``unsupported``: the estimate
there is a lower bound by those buffers (tens to thousands of bytes in
PyTorch's OpInfo samples), never a silent miss.
"""

from __future__ import annotations

from typing import Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Steps

aten = torch.ops.aten

_LAPACK: Final = Inexact(
    "LAPACK's workspaces and the kernel's pivot and info tensors are not modelled; "
    "only the outputs are counted"
)


@CPU.scratch(
    aten._linalg_det, aten._linalg_slogdet, aten._linalg_solve_ex, aten._linalg_eigh,
    aten._linalg_eigvals, aten._linalg_svd, aten.linalg_inv_ex, aten.linalg_lu,
    aten.linalg_lu_factor_ex, aten.linalg_lu_solve, aten.linalg_cholesky_ex, aten.linalg_eig,
    aten.linalg_ldl_factor_ex, aten.linalg_ldl_solve, aten.linalg_householder_product,
    aten.linalg_matrix_exp, aten.cholesky, aten.cholesky_inverse, aten._cholesky_solve_helper,
    aten.geqrf, aten.ormqr, aten.lu_unpack, aten.linalg_qr,
    aten.linalg_pinv, aten.cholesky_solve,
)  # fmt: skip
def _lapack(call: OpCall) -> Steps:
    """Also two composites that fake tensors run whole (they reach the trace as one
    op, with a meta kernel for the result only): ``linalg_pinv``
    (``LinearAlgebra.cpp``: ``_linalg_svd`` or ``_linalg_eigh``, then a dozen
    elementwise temporaries of the singular values and two products) and
    ``cholesky_solve`` (``BatchLinearAlgebra.cpp``: ``_cholesky_solve_helper`` and its
    info tensors)."""
    return [_LAPACK, OUTPUTS]


@CPU.scratch(aten._linalg_check_errors.default)
def _check_errors(call: OpCall) -> Steps:
    """``_linalg_check_errors``: for one matrix's ``info``, two one-byte bool tensors
    while it is checked; more infos are listed in ``unsupported``."""
    infos = call.args[0]
    if infos.numel() == 0:
        return [OUTPUTS]
    if infos.numel() > 1:
        return [Inexact("the check of a batch's info tensors is not modelled"), OUTPUTS]
    return [OUTPUTS, Alloc("info != 0", 1), Alloc("any", 1), Free("any"), Free("info != 0")]
