"""CPU rules: LU and Cholesky factorizations, solvers and determinants.

Fake tensors run these ops' meta kernels, which make the outputs only. The real
CPU kernels (``aten/src/ATen/native/BatchLinearAlgebra.cpp`` and
``BatchLinearAlgebraKernel.cpp``, ``LinearAlgebra.cpp``, torch 2.13) also take
from the allocator, in this order: column-major (Fortran) copies of their
inputs, pivot and ``info`` tensors, the proxies a structured ``out=`` kernel
makes when an output's strides are not the ones it wants, LAPACK work arrays
sized by the ``lwork = -1`` query (:mod:`.lapack`), and the small tensors of
their checks (``_linalg_check_errors``: ``infos.any()``; ``lu_solve``'s
``pivots.gt(0).all()``). The rules here list them step by step. A workspace
whose MKL answer is not modelled for the call's sizes is listed in
``unsupported``, as are complex inputs to the kernels that query one.

QR and LDL are in :mod:`.qr`, the eigen and singular value decompositions in
:mod:`.spectral`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private_op
from pytest_torchmem.engine.tracing.devices.cpu import lapack
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.tensor_iterator import is_contiguous
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, itemsize, transpose_copy
from pytest_torchmem.engine.tracing.devices.cpu.reduce import two_pass_buffer
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    OpCall,
    Step,
    Steps,
)

__all__ = [
    "INT32",
    "all_item",
    "batch_numel",
    "check_errors",
    "column_major_copy",
    "compare",
    "compare_all",
    "complex_gap",
    "f_contiguous",
    "f_strides",
    "lapack_gap",
    "transpose_block",
    "tri_steps",
    "work",
]

aten = torch.ops.aten

#: The bytes of a LAPACK integer (pivots, info codes): int32.
INT32: Final = 4

# -- layouts ------------------------------------------------------------------


def c_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """``c10::contiguous_strides``: row-major, a size of 0 counted as 1."""
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(sizes[i + 1], 1)
    return tuple(strides)


def f_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """``batched_matrix_contiguous_strides(sizes, /*f_contig=*/true)``: a row-major
    batch of column-major matrices."""
    strides = list(c_strides(sizes))
    if len(sizes) >= 2:
        strides[-1] = max(sizes[-2], 1)
        strides[-2] = 1
    return tuple(strides)


def f_contiguous(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """``t.mT().is_contiguous()``."""
    if len(sizes) < 2:
        return is_contiguous(sizes, strides)
    swap = lambda v: (*v[:-2], v[-1], v[-2])  # noqa: E731
    return is_contiguous(swap(sizes), swap(strides))


def batch_numel(t: torch.Tensor | Sequence[int]) -> int:
    """``batchCount``: the number of matrices in a batch (1 for one matrix)."""
    sizes = t.shape if isinstance(t, torch.Tensor) else t
    return math.prod(sizes[:-2])


def _nbytes(sizes: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(sizes) * itemsize(dtype)


def _broadcast_batch(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))


def _tri_check(sizes: Sequence[int], strides: Sequence[int], in_place: bool) -> tuple[bool, bool]:
    """``checkTrilTriuBatchContiguous`` (``TriangularOpsUtils.h``) for ``tril``/``triu``
    of a tensor laid out as ``sizes``/``strides``: ``(in_place_update, copied)``,
    whether it makes a contiguous copy."""
    if is_contiguous(sizes, strides):
        return tuple(strides) == c_strides(sizes), False
    dims = len(sizes)
    if in_place and dims <= 3:
        return True, False
    expected = sizes[-1] * sizes[-2]
    for i in range(dims - 3, -1, -1):
        if in_place and i == 0 and (strides[i] == 0 or sizes[i] == 1):
            continue
        if expected != strides[i]:
            return False, True
        expected *= sizes[i]
    return True, False


def tri_steps(
    sizes: Sequence[int], strides: Sequence[int], dtype: torch.dtype, in_place: bool, tag: str
) -> list[Step]:
    """The scratch of ``compute_triu_tril`` (``TriangularOps.cpp``): a contiguous copy
    of a batch that is not contiguous per matrix, and for an in-place call that
    cannot update in place a contiguous result copied back."""
    if math.prod(sizes) == 0:
        return []
    update, copy = _tri_check(sizes, strides, in_place)
    size = _nbytes(sizes, dtype)
    steps: list[Step] = []
    if copy:
        steps.append(Alloc(f"{tag}: contiguous input", size))
    if in_place and not update:
        steps += [Alloc(f"{tag}: contiguous result", size), Free(f"{tag}: contiguous result")]
    if copy:
        steps.append(Free(f"{tag}: contiguous input"))
    return steps


def transpose_block(sizes: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> list[Step]:
    """``cloneBatchedColumnMajor`` of a tensor laid out as ``sizes``/``strides``:
    ``src.mT().clone(Contiguous)``, whose ``copy_`` of a row-major 2-D matrix goes
    through ``copy_same_type_transpose_``'s block buffer (:func:`.misc.transpose_copy`)."""
    if len(sizes) != 2:
        return []
    return list(transpose_copy((sizes[1], sizes[0]), (strides[1], strides[0]), dtype))


def column_major_copy(t: torch.Tensor, tag: str) -> list[Step]:
    """``cloneBatchedColumnMajor(t)``, left allocated as ``tag``."""
    return [Alloc(tag, t.numel() * t.element_size()), *transpose_block(t.shape, t.stride(), t.dtype)]


# -- the small tensors of the kernels' checks ---------------------------------------


def check_errors(threads: int, numel: int, tag: str = "info") -> list[Step]:
    """``_linalg_check_errors(infos)``: ``infos.any()`` (its one-byte result, the
    ``int32`` infos cast to ``bool``, and a two-pass reduction's per-thread
    buffer), read with ``.item()``."""
    steps: list[Step] = [Alloc(f"{tag}.any()", 1), Alloc(f"{tag} as bool", numel)]
    buffer = two_pass_buffer(threads, numel, 1, torch.bool)
    if buffer:
        steps += [Alloc(f"{tag}.any() partials", buffer), Free(f"{tag}.any() partials")]
    return [*steps, Free(f"{tag} as bool"), Free(f"{tag}.any()")]


def compare(numel: int, dtype: torch.dtype, tag: str) -> list[Step]:
    """``t.gt(scalar)`` and the like on ``numel`` elements of ``dtype``: the wrapped
    scalar (an ``int64``, or a ``double`` for a floating ``t``) and its cast to
    ``dtype``, then the ``bool`` result, left allocated as ``tag``."""
    number = torch.float64 if dtype.is_floating_point else torch.int64
    steps: list[Step] = [Alloc(f"{tag}: wrapped scalar", itemsize(number))]
    if dtype != number:
        steps.append(Alloc(f"{tag}: scalar as {dtype}", itemsize(dtype)))
    return [*steps, Alloc(tag, numel), Free(f"{tag}: wrapped scalar"), Free(f"{tag}: scalar as {dtype}")]


def all_item(threads: int, numel: int, tag: str) -> list[Step]:
    """``t.all().item()`` of ``numel`` booleans: the one-byte result (and a
    two-pass reduction's per-thread partials)."""
    steps: list[Step] = [Alloc(f"{tag}.all()", 1)]
    buffer = two_pass_buffer(threads, numel, 1, torch.bool)
    if buffer:
        steps += [Alloc(f"{tag}.all() partials", buffer), Free(f"{tag}.all() partials")]
    return [*steps, Free(f"{tag}.all()")]


def compare_all(threads: int, numel: int, dtype: torch.dtype, tag: str) -> list[Step]:
    """``t.gt(scalar).all().item()`` and the like: :func:`compare`, then :func:`all_item`."""
    return [*compare(numel, dtype, tag), *all_item(threads, numel, tag), Free(tag)]


def complex_gap(*tensors: torch.Tensor) -> list[Step]:
    """``[Inexact]`` for a complex matrix: the ``c``/``z`` routines' workspace
    queries (and ``rwork``) are not modelled, nor are the real-valued parts of
    the kernels' temporaries."""
    if any(isinstance(t, torch.Tensor) and t.is_complex() for t in tensors):
        return [Inexact("the complex LAPACK routines' workspaces are not modelled")]
    return []


def lapack_gap(routine: str, sizes: str) -> Inexact:
    """What the estimate says of a work array whose MKL answer is not modelled."""
    return Inexact(
        f"MKL's {routine} workspace for {sizes} is not modelled (its answer is modelled for "
        f"{lapack.VERIFIED[routine.strip('?')]}); the call's other buffers are counted"
    )


def work(tag: str, elements: int, dtype: torch.dtype) -> list[Step]:
    """A LAPACK work array of ``elements`` of ``dtype`` (``at::empty({lwork})``)."""
    return [Alloc(tag, elements * itemsize(dtype)), Free(tag)]


# -- _linalg_check_errors, cholesky ---------------------------------------------------


@CPU.scratch(aten._linalg_check_errors.default)
def _check_errors(call: OpCall) -> Steps:
    """``_linalg_check_errors`` (``BatchLinearAlgebra.cpp``) called by a composite
    (``linalg_inv``, ``linalg_cholesky``...): ``infos.any().item()``."""
    return [OUTPUTS, *check_errors(profile_of(call).threads, call.args[0].numel())]


@CPU.scratch(aten.linalg_cholesky_ex.default)
def _cholesky_ex(call: OpCall) -> Steps:
    """``linalg_cholesky_ex_out``: ``tril_out(L, A)`` (or ``triu_out``) into the output,
    ``potrf`` in place, and the check of ``info`` if ``check_errors``."""
    A = call.args[0]
    if A.numel() == 0:
        return [OUTPUTS]
    steps: list[Step] = [OUTPUTS, *tri_steps(A.shape, A.stride(), A.dtype, False, "tril")]
    if arg(call, 2, "check_errors", False):
        steps += check_errors(profile_of(call).threads, batch_numel(A))
    return steps


@CPU.scratch(private_op("cholesky.default"))  # removed in 2.14
def _cholesky(call: OpCall) -> Steps:
    """``cholesky`` (deprecated): the output is ``cloneBatchedColumnMajor(self)``,
    then ``info`` (``at::empty`` of the batch shape) and its check."""
    A = call.args[0]
    if A.numel() == 0:
        return [OUTPUTS]
    batch = batch_numel(A)
    return [
        OUTPUTS, *transpose_block(A.shape, A.stride(), A.dtype), Alloc("info", batch * INT32),
        *check_errors(profile_of(call).threads, batch), Free("info"),
    ]  # fmt: skip


@CPU.scratch(private_op("linalg_matrix_sqrth.default"), private_op("linalg_polar.default"))  # from 2.14
def _unmodelled_since_2_14(call: OpCall) -> Steps:
    """``linalg.matrix_sqrth`` and ``linalg.polar``, new in torch 2.14: native kernels
    whose inner decomposition's buffers are not modelled (the forward peak of OpInfo's
    worst sample: 460 and 520 B above the outputs): listed, never a low figure in silence."""
    name = call.func.overloadpacket.__name__
    return [Inexact(f"{name}'s CPU kernel (torch 2.14 on) decomposes its input inside, whose buffers are not modelled"), OUTPUTS]


@CPU.scratch(aten.cholesky_inverse.default)
def _cholesky_inverse(call: OpCall) -> Steps:
    """``cholesky_inverse_out``: ``infos`` (``at::zeros({max(1, batch)})``) before the
    output is resized, ``potri`` in place, the check."""
    A = call.args[0]
    infos = max(1, batch_numel(A))
    return [
        Alloc("infos", infos * INT32), OUTPUTS,
        *check_errors(profile_of(call).threads, infos), Free("infos"),
    ]  # fmt: skip


@CPU.scratch(aten.cholesky_solve.default, aten._cholesky_solve_helper.default)
def _cholesky_solve(call: OpCall) -> Steps:
    """``cholesky_solve`` broadcasts the batches (views), then
    ``_cholesky_solve_helper_cpu``: column-major copies of ``B`` (the output) and
    of ``A``, ``infos`` (``at::zeros({batchCount(B)})``) and their check."""
    B, A = call.args[0], call.args[1]
    batch = _broadcast_batch(B.shape, A.shape)
    count = math.prod(batch)
    a_sizes = (*batch, *A.shape[-2:])
    b_sizes = (*batch, *B.shape[-2:])
    return [
        OUTPUTS, *transpose_block(b_sizes, _expanded_strides(B, b_sizes), B.dtype),
        Alloc("A (column-major)", _nbytes(a_sizes, A.dtype)),
        *transpose_block(a_sizes, _expanded_strides(A, a_sizes), A.dtype),
        Alloc("infos", count * INT32), *check_errors(profile_of(call).threads, count, "infos"),
        Free("infos"), Free("A (column-major)"),
    ]  # fmt: skip


# -- LU: lu_factor, lu, lu_unpack, lu_solve, solve, inv, det, slogdet ---------------


def _lu_solve_checks(threads: int, pivots: int) -> list[Step]:
    """``lu_solve_kernel``: ``pivots.gt(0).all()`` and ``pivots.le(n).all()``."""
    return [
        *compare_all(threads, pivots, torch.int32, "pivots > 0"),
        *compare_all(threads, pivots, torch.int32, "pivots <= n"),
    ]


@CPU.check(aten.linalg_lu_factor_ex.default, aten.linalg_lu.default)
def _lu_without_pivoting(call: OpCall) -> None:
    """``apply_lu_factor`` refuses ``pivot=False`` on the CPU (an empty input returns first)."""
    if call.args[0].numel() and not arg(call, 1, "pivot", True):
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")


@CPU.scratch(aten.linalg_lu_factor_ex.default)
def _lu_factor_ex(call: OpCall) -> Steps:
    """``linalg_lu_factor_ex_out``: ``getrf`` in place in the output; the check of
    ``info`` if ``check_errors``."""
    A = call.args[0]
    steps: list[Step] = [OUTPUTS]
    if A.numel() and arg(call, 2, "check_errors", False):
        steps += check_errors(profile_of(call).threads, batch_numel(A))
    return steps


def _proxy(t: torch.Tensor, wanted: Sequence[int], tag: str) -> list[Step]:
    """A structured ``out=`` kernel's proxy (``maybe_create_proxy``): a new tensor
    with the strides it wants when ``t``'s differ, copied back at the end."""
    if tuple(t.stride()) == tuple(wanted):
        return []
    return [Alloc(tag, t.numel() * t.element_size())]


def lu_unpack_steps(
    LU: tuple[Sequence[int], Sequence[int], torch.dtype],
    pivots_copy: int,
    P: torch.Tensor,
    same_as_L: bool,
    unpack_data: bool,
    unpack_pivots: bool,
) -> list[Step]:
    """``lu_unpack_out`` (``BatchLinearAlgebra.cpp``) of ``LU`` (sizes, strides,
    dtype): ``triu_out``/``tril_out`` of its slices into ``U`` and ``L``, and the
    permutation: ``arange(m)`` (``int64``) expanded to the batch and made
    contiguous, ``pivots.contiguous()`` (``pivots_copy`` bytes if a copy)."""
    sizes, strides, dtype = LU
    m, n = sizes[-2], sizes[-1]
    steps: list[Step] = []
    if unpack_data:
        if m > n or same_as_L:
            u_sizes = sizes if m == n else (*sizes[:-2], n, n)
            steps += tri_steps(u_sizes, strides, dtype, False, "triu")
            steps += tri_steps(sizes, strides, dtype, same_as_L, "tril")
        else:
            l_sizes = sizes if m == n else (*sizes[:-2], m, m)
            steps += tri_steps(l_sizes, strides, dtype, False, "tril")
            steps += tri_steps(sizes, strides, dtype, False, "triu")
    if unpack_pivots:
        perm = P.shape[:-1]
        steps.append(Alloc("arange(m)", m * 8))
        copied = not is_contiguous(perm, (*(0,) * (len(perm) - 1), 1))
        if copied:
            steps += [Alloc("permutation", math.prod(perm) * 8), Free("arange(m)")]
        if pivots_copy:
            steps += [Alloc("pivots (contiguous)", pivots_copy), Free("pivots (contiguous)")]
        steps.append(Free("permutation" if copied else "arange(m)"))
    return steps


@CPU.scratch(aten.lu_unpack.default)
def _lu_unpack(call: OpCall) -> Steps:
    LU, pivots = call.args[0], call.args[1]
    unpack_data, unpack_pivots = arg(call, 2, "unpack_data", True), arg(call, 3, "unpack_pivots", True)
    P = call.out[0]
    copy = 0 if pivots.is_contiguous() else pivots.numel() * INT32
    return [
        OUTPUTS,
        *lu_unpack_steps((LU.shape, LU.stride(), LU.dtype), copy, P, False, unpack_data, unpack_pivots),
    ]


@CPU.scratch(aten.linalg_lu.default)
def _lu(call: OpCall) -> Steps:
    """``linalg_lu_out``: ``pivots`` and ``info``, ``linalg_lu_factor_ex_out`` into ``L``
    (if taller than wide) or ``U`` through a column-major proxy (both are
    row-major), then ``lu_unpack_out`` of it."""
    A = call.args[0]
    pivot = arg(call, 1, "pivot", True)
    P, L, U = call.out
    m, n = A.shape[-2], A.shape[-1]
    target = L if m > n else U
    steps: list[Step] = [OUTPUTS, *_proxy(target, f_strides(target.shape), "LU (column-major)")]
    batch = batch_numel(A)
    steps += [Alloc("pivots", batch * min(m, n) * INT32), Alloc("info", batch * INT32)]
    steps.append(Free("LU (column-major)"))
    steps += lu_unpack_steps((target.shape, target.stride(), A.dtype), 0, P, m > n, True, pivot)
    return [*steps, Free("info"), Free("pivots")]


def _broadcast_indices(lu_batch: Sequence[int], b_batch: Sequence[int]) -> list[Step]:
    """``BroadcastLinearIndices`` (``LinearAlgebraUtils.h``) when ``LU``'s batch is
    broadcast to ``B``'s: ``arange(batchCount(LU))`` (``int64``) viewed as ``LU``'s
    batch, ``broadcast_to`` ``B``'s and made contiguous; kept to the end."""
    if tuple(lu_batch) == tuple(b_batch):
        return []
    view = c_strides(lu_batch)
    pad = len(b_batch) - len(lu_batch)
    strides = [
        0 if i < pad or (lu_batch[i - pad] == 1 and b_batch[i] != 1) else view[i - pad]
        for i in range(len(b_batch))
    ]
    steps: list[Step] = [Alloc("LU batch indices", math.prod(lu_batch) * 8)]
    if not is_contiguous(b_batch, strides):
        steps += [Alloc("LU batch indices (broadcast)", math.prod(b_batch) * 8), Free("LU batch indices")]
    return steps


def lu_solve_steps(
    threads: int, LU: torch.Tensor, pivots: torch.Tensor, result: Sequence[int]
) -> list[Step]:
    """``linalg_lu_solve_out`` after its output (of sizes ``result``):
    ``pivots.expect_contiguous()``, ``LU`` made column-major unless it is, the
    kernel's checks, then ``apply_lu_solve``'s broadcast batch indices."""
    if math.prod(result) == 0:
        return []
    steps: list[Step] = []
    if not pivots.is_contiguous():
        steps.append(Alloc("pivots (contiguous)", pivots.numel() * INT32))
    if not f_contiguous(LU.shape, LU.stride()):
        steps += column_major_copy(LU, "LU (column-major)")
    steps += _lu_solve_checks(threads, pivots.numel())
    steps += _broadcast_indices(LU.shape[:-2], result[:-2])
    return [
        *steps, Free("LU batch indices (broadcast)"), Free("LU batch indices"),
        Free("LU (column-major)"), Free("pivots (contiguous)"),
    ]  # fmt: skip


@CPU.scratch(aten.linalg_lu_solve.default)
def _lu_solve(call: OpCall) -> Steps:
    LU, pivots = call.args[0], call.args[1]
    result = call.out
    return [OUTPUTS, *lu_solve_steps(profile_of(call).threads, LU, pivots, result.shape)]


def _is_vector_rhs(A: torch.Tensor, B: torch.Tensor) -> bool:
    """``linalg_solve_is_vector_rhs``."""
    return B.dim() == 1 or (A.dim() - 1 == B.dim() and tuple(B.shape) == tuple(A.shape[:-1]))


@CPU.scratch(aten._linalg_solve_ex.default)
def _solve_ex(call: OpCall) -> Steps:
    """``_linalg_solve_ex_out``: ``lu_factor`` into the ``LU`` output (of ``A`` or of
    ``A.mT``), the check if ``check_errors``, then ``linalg_lu_solve_out`` into
    the result; a vector right-hand side is an unsqueezed view whose strides
    are not the column-major ones ``lu_solve`` wants, so it solves into a proxy."""
    A, B = call.args[0], call.args[1]
    left = arg(call, 2, "left", True)
    result, LU, pivots, info = call.out
    threads = profile_of(call).threads
    steps: list[Step] = [OUTPUTS]
    if A.numel() and arg(call, 3, "check_errors", False):
        steps += check_errors(threads, info.numel())
    vector = _is_vector_rhs(LU, B)
    r_sizes = (*result.shape, 1) if vector else tuple(result.shape)
    r_strides = (*result.stride(), 1) if vector else tuple(result.stride())
    b_sizes = (*B.shape, 1) if vector else tuple(B.shape)
    wanted = (*_broadcast_batch(b_sizes, LU.shape), *b_sizes[-2:])
    if r_strides != (f_strides(wanted) if left else c_strides(wanted)):
        steps.append(Alloc("result (proxy)", math.prod(r_sizes) * result.element_size()))
    steps += lu_solve_steps(threads, LU, pivots, wanted)
    return [*steps, Free("result (proxy)")]


@CPU.scratch(aten.linalg_inv_ex.default)
def _inv_ex(call: OpCall) -> Steps:
    """``linalg_inv_ex_out``: the identity in the output, then ``linalg_solve_ex_out``
    into it, which makes ``LU`` (column-major) and ``pivots``; the check of
    ``info`` if ``check_errors``, once they are freed."""
    A = call.args[0]
    inverse = call.out[0]
    threads = profile_of(call).threads
    pivots = math.prod(A.shape[:-1])
    steps: list[Step] = [
        OUTPUTS, Alloc("LU", A.numel() * A.element_size()), Alloc("pivots", pivots * INT32),
    ]  # fmt: skip
    if inverse.numel():
        steps += _lu_solve_checks(threads, pivots)  # (the same batch: no indices)
    steps += [Free("pivots"), Free("LU")]
    if arg(call, 1, "check_errors", False):
        steps += check_errors(threads, batch_numel(A))
    return steps


def _reduce_partials(threads: int, numel: int, out_numel: int, dtype: torch.dtype, tag: str) -> list[Step]:
    buffer = two_pass_buffer(threads, numel, out_numel, dtype)
    return [Alloc(tag, buffer), Free(tag)] if buffer else []


def _det_p_steps(threads: int, pivots: torch.Tensor) -> list[Step]:
    """``lu_det_P(pivots)`` (``BatchLinearAlgebra.cpp``): ``(arange(1, k + 1) !=
    pivots).sum(-1, kLong).fmod_(2).mul_(-2).add_(1)``: the ``int32`` range, the
    ``bool`` comparison, the ``int64`` sum (of the comparison cast to ``int64``),
    a wrapped scalar for each in-place op. Leaves ``det_P`` allocated."""
    k = pivots.shape[-1]
    batch = math.prod(pivots.shape[:-1])
    return [
        Alloc("arange(1, k + 1)", k * INT32), Alloc("arange != pivots", batch * k),
        Alloc("det_P", batch * 8), Alloc("(arange != pivots) as int64", batch * k * 8),
        *_reduce_partials(threads, batch * k, batch, torch.int64, "det_P partials"),
        Free("(arange != pivots) as int64"),
        *_wrapped("fmod_"), *_wrapped("mul_"), *_wrapped("add_"),
        Free("arange != pivots"), Free("arange(1, k + 1)"),
    ]  # fmt: skip


def _wrapped(op: str) -> list[Step]:
    """The ``int64`` scalar an in-place op on an ``int64`` tensor wraps its number in."""
    return [Alloc(f"{op}: wrapped scalar", 8), Free(f"{op}: wrapped scalar")]


@CPU.scratch(aten._linalg_det.default)
def _det(call: OpCall) -> Steps:
    """``_linalg_det_out``: ``info``, ``lu_factor`` into the ``LU`` output, then
    ``mul_out(det, lu_det_P(pivots), prod(diag(LU)))``, its arguments evaluated
    right to left; ``det_P`` (``int64``) is cast to the result's dtype."""
    A = call.args[0]
    det, LU, pivots = call.out
    threads = profile_of(call).threads
    batch = batch_numel(A)
    k = pivots.shape[-1]
    size = A.element_size()
    return [
        OUTPUTS, Alloc("info", batch * INT32), Alloc("prod(diag(LU))", batch * size),
        *_reduce_partials(threads, batch * k, batch, A.dtype, "prod partials"),
        *_det_p_steps(threads, pivots),
        Alloc("det_P as result dtype", batch * size), Free("det_P as result dtype"),
        Free("det_P"), Free("prod(diag(LU))"), Free("info"),
    ]  # fmt: skip


@CPU.scratch(aten._linalg_slogdet.default)
def _slogdet(call: OpCall) -> Steps:
    """``_linalg_slogdet_out``: ``info``, ``lu_factor`` into ``LU``; the sign is
    ``mul_out(sign, diag_U.sgn().prod(-1), lu_det_P(pivots))`` (right to left),
    the log is ``sum_out(logabsdet, diag_U.abs().log_(), -1)``."""
    A = call.args[0]
    pivots = call.out[3]
    threads = profile_of(call).threads
    batch = batch_numel(A)
    k = pivots.shape[-1]
    size = A.element_size()
    return [
        *complex_gap(A), OUTPUTS, Alloc("info", batch * INT32),
        *_det_p_steps(threads, pivots),
        Alloc("sgn(diag(LU))", batch * k * size), Alloc("prod(sgn)", batch * size),
        *_reduce_partials(threads, batch * k, batch, A.dtype, "prod partials"),
        Alloc("det_P as result dtype", batch * size), Free("det_P as result dtype"),
        Free("prod(sgn)"), Free("sgn(diag(LU))"), Free("det_P"),
        Alloc("abs(diag(LU))", batch * k * size),
        *_reduce_partials(threads, batch * k, batch, A.dtype, "sum partials"),
        Free("abs(diag(LU))"), Free("info"),
    ]  # fmt: skip


def _expanded_strides(t: torch.Tensor, sizes: Sequence[int]) -> tuple[int, ...]:
    """The strides of ``t.expand(sizes)``."""
    pad = len(sizes) - t.dim()
    return tuple(
        0 if i < pad or (t.shape[i - pad] == 1 and sizes[i] != 1) else t.stride(i - pad)
        for i in range(len(sizes))
    )


@CPU.scratch(aten.linalg_solve_triangular.default)
def _solve_triangular(call: OpCall) -> Steps:
    """``linalg_solve_triangular_out``: ``B`` is copied into the (column-major)
    output; ``A``, broadcast to ``B``'s batch, is copied column-major unless it
    is contiguous or transposed-contiguous (a broadcast batch is neither)."""
    A, B = call.args[0], call.args[1]
    sizes = (*_broadcast_batch(B.shape, A.shape), *A.shape[-2:])
    strides = _expanded_strides(A, sizes)
    steps: list[Step] = [OUTPUTS]
    if A.is_neg() or A.is_conj():
        steps.insert(0, Inexact("the copies of a conjugate or negative-bit view of A are not modelled"))
    if not (is_contiguous(sizes, strides) or f_contiguous(sizes, strides)):
        steps += [Alloc("A (column-major)", _nbytes(sizes, A.dtype)), Free("A (column-major)")]
    return steps


_TRI: Final = (aten.tril.default, aten.triu.default, aten.tril.out, aten.triu.out)
_TRI_IN_PLACE: Final = (aten.tril_.default, aten.triu_.default)


@CPU.scratch(*_TRI, *_TRI_IN_PLACE)
def _tril_triu(call: OpCall) -> Steps:
    """``compute_triu_tril`` (``TriangularOps.cpp``): a batch whose matrices are not
    laid out one after another is copied contiguous first (out of place, from
    three dimensions; in place, from four); in place, a result that cannot be
    updated in place is computed into a contiguous tensor and copied back."""
    t = call.args[0]
    name = call.func._schema.name.removeprefix("aten::")
    return [OUTPUTS, *tri_steps(t.shape, t.stride(), t.dtype, call.func in _TRI_IN_PLACE, name)]
