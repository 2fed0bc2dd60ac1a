"""CPU rules: matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``,
``dot``, ``_grouped_mm``).

The CPU matmuls of ATen (``aten/src/ATen/native/LinearAlgebra.cpp``,
``Blas.cpp``) take scratch from the allocator in three ways, all modelled here:

* ``addmm_impl_cpu_`` hands BLAS column-major matrices: an operand (or the
  result) whose strides no BLAS leading dimension can describe (a stride-0
  gradient expanded by ``sum()``'s backward, a strided slice) is first copied
  into a contiguous buffer;
* ``bmm_out_or_baddbmm_`` routes a batched product to a small-size kernel,
  to MKL's batched gemm, to oneDNN's matmul (bfloat16/float16) or to one
  ``addmm_impl_cpu_`` per batch, each with its own copies;
* oneDNN (``ideep::matmul_forward``, reached through ``cpublas::gemm``'s
  ``mkldnn_bf16_gemm`` and through ``mkldnn_matmul``) takes its scratchpad
  from the allocator: for a bfloat16 output, the float accumulator of
  ``gemm_bf16_matmul_t`` (oneDNN ``src/cpu/matmul/gemm_based_common.hpp``).

The oneDNN figures are those of ``gemm_bf16_matmul_t``, the implementation
oneDNN 3.12 picks on AVX-512 CPUs without native bfloat16 (verified there).
On CPUs with AVX512-BF16 or AMX (the ``avx512_bf16`` and ``amx`` levels) oneDNN
picks its brgemm matmul, whose scratchpad is not modelled: such calls are listed
in ``unsupported``; nor are float32 matmuls routed to oneDNN by
``torch.backends.mkldnn.matmul.fp32_precision`` = "bf16"/"tf32" (brgemm).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, native_kernel_gap, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile
from pytest_torchmem.engine.tracing.devices.memo import BoundedMemo
from pytest_torchmem.engine.tracing.devices.tensor_iterator import is_contiguous
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Inexact, OpCall, Step, Steps, nbytes_of

__all__ = ["is_contiguous", "onednn_gemm_accumulator_bytes", "onednn_gemm_bytes"]

# torch's private names (engine/torch_compat/torch_private.py)
DataDependentOutputException: Final = private("torch._subclasses.fake_tensor.DataDependentOutputException")

aten = torch.ops.aten

#: ``checksize`` / ``mkldnn_gemm`` in aten/src/ATen/native/mkldnn/Matmul.cpp: oneDNN
#: is used only when the product has more than 16 * 16 * 16 multiply-adds.
_MKLDNN_GEMM_MIN_SIZE: Final = 16 * 16 * 16
#: ``bmm_out_or_baddbmm_``: below this many multiply-adds per matrix the naive
#: kernel parallel over the batch runs.
_BMM_SMALL: Final = 400
#: ``memory_tracking::default_alignment`` (oneDNN): each scratchpad buffer is
#: booked with this much room for its alignment.
_ONEDNN_SCRATCH_ALIGN: Final = 128
_MATMUL_KERNELS: Final = "oneDNN's matmul kernels"




# -- oneDNN ----------------------------------------------------------------------


def _mkldnn_enabled() -> bool:
    """``at::globalContext().userEnabledMkldnn()``."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def _onednn_usable(cpu: CpuProfile, dtype: torch.dtype) -> bool:
    """``use_mkldnn_bf16_matmul()`` / ``use_mkldnn_fp16_matmul()`` (no tensors): oneDNN
    computes this reduced-precision matmul on the modelled CPU."""
    return _mkldnn_enabled() and dtype == torch.bfloat16 and cpu.onednn_bf16


def onednn_gemm_accumulator_bytes(batch: int, rows: int, cols: int, threads: int) -> int:
    """Scratchpad of oneDNN's ``gemm_bf16_matmul_t`` for a ``batch`` x ``rows`` x ``cols``
    bfloat16 (or float16) output: a float accumulator per thread.

    ``gemm_based::get_scratchpad_num_elements`` (oneDNN
    ``src/cpu/matmul/gemm_based_common.hpp``): each of ``threads`` threads gets
    whole output rows of its share of the work, at most one matrix, rounded up
    to 64 elements; never less than one thread's block. The scratchpad
    registry books each buffer with 128 bytes of alignment room.
    """
    if batch * rows * cols == 0:
        return 0

    def block(nthr: int) -> int:
        work = -(-batch * rows * cols // nthr)
        size = min(rows * cols, work // cols * cols) if work >= cols else work
        return -(-size // 64) * 64

    elements = max(block(1), block(threads) * threads)
    return elements * 4 + _ONEDNN_SCRATCH_ALIGN


def _float32(value: Any) -> float:
    """``value`` rounded to a C ``float``, as the kernels pass ``alpha`` to oneDNN."""
    return struct.unpack("f", struct.pack("f", float(value)))[0]


def _onednn_matmul_bytes(cpu: CpuProfile, batch: int, rows: int, cols: int, alpha: Any) -> int:
    """What one ``ideep::matmul_forward::compute`` into a bfloat16/float16 output
    takes from the allocator: a one-float tensor of source scales when ``alpha``
    is not 1 (``do_prepare``: oneDNN applies ``dst_coeff`` as a source scale),
    and the scratchpad (:func:`onednn_gemm_accumulator_bytes`)."""
    scales = 4 if _float32(alpha) != 1.0 else 0
    return scales + onednn_gemm_accumulator_bytes(batch, rows, cols, cpu.threads)


def onednn_gemm_bytes(
    cpu: CpuProfile,
    dtype: torch.dtype, trans_a: bool, trans_b: bool, m: int, n: int, k: int, alpha: Any
) -> int:
    """Bytes ``at::native::cpublas::gemm`` (aten/src/ATen/native/CPUBlas.cpp) takes
    from the allocator for a column-major ``m`` x ``n`` x ``k`` product whose
    output has type ``dtype``; all of it is given back before it returns.

    Float, double and complex go to MKL (nothing from the allocator). bfloat16
    and float16 go to ``mkldnn_bf16_gemm`` / ``mkldnn_fp16_gemm`` when oneDNN
    supports them here, except a transposed matrix-vector product on a CPU
    without native bfloat16 (``use_bf16_gemv_trans``), and the products of at
    most 16 * 16 * 16 multiply-adds or with ``alpha == 0`` (``mkldnn_gemm``).
    oneDNN computes C^T = B^T A^T, so its output rows are ``n``.
    """
    if not _onednn_usable(cpu, dtype) or _float32(alpha) == 0.0 or m * n * k <= _MKLDNN_GEMM_MIN_SIZE:
        return 0
    gemv_trans = trans_a and not trans_b and n == 1 and _float32(alpha) == 1.0
    if gemv_trans:  # use_bf16_gemv_trans: no profile has avx512_bf16
        return 0
    return _onednn_matmul_bytes(cpu, 1, n, m, alpha)


# -- addmm_impl_cpu_ -------------------------------------------------------------


@dataclass(frozen=True)
class _Gemm:
    """What ``addmm_impl_cpu_`` does for one 2-D product: its copies and its gemm."""

    result_copy: int
    mat1_copy: int
    mat2_copy: int
    scratch: int

    def steps(self, tag: str = "") -> list[Alloc]:
        return [
            Alloc(f"{tag}result (column-major copy)", self.result_copy),
            Alloc(f"{tag}mat1 (contiguous copy)", self.mat1_copy),
            Alloc(f"{tag}mat2 (contiguous copy)", self.mat2_copy),
            Alloc(f"{tag}oneDNN scratchpad", self.scratch),
        ]

    @property
    def nbytes(self) -> int:
        return self.result_copy + self.mat1_copy + self.mat2_copy + self.scratch


_NOTHING: Final = _Gemm(0, 0, 0, 0)


def _addmm_impl(
    cpu: CpuProfile,
    result_shape: tuple[int, ...],
    result_stride: tuple[int, ...],
    m1: tuple[tuple[int, ...], tuple[int, ...]],
    m2: tuple[tuple[int, ...], tuple[int, ...]],
    dtype: torch.dtype,
    itemsize: int,
    alpha: Any,
) -> _Gemm:
    """``addmm_impl_cpu_`` (aten/src/ATen/native/LinearAlgebra.cpp) on sizes and strides.

    BLAS is column-major: the result must be usable as a column-major matrix
    (or, swapping the operands, as a row-major one), else it is computed in a
    Fortran-contiguous copy; each operand must have a unit stride and a
    leading dimension at least its size, else it is cloned contiguous.
    """
    (r0, r1), (rs0, rs1) = result_shape, result_stride
    (m1_sizes, m1_strides), (m2_sizes, m2_strides) = m1, m2
    if r0 * r1 == 0 or m1_sizes[1] == 0:
        return _NOTHING
    result_copy = 0
    if rs0 == 1 and (r1 == 1 or rs1 >= max(1, r0)):
        transpose_c = False
    elif rs1 == 1 and (r0 == 1 or rs0 >= max(1, r1)):
        transpose_c = True
        m1_sizes, m2_sizes = m2_sizes, m1_sizes
        m1_strides, m2_strides = m2_strides, m1_strides
    else:
        transpose_c = False
        result_copy = r0 * r1 * itemsize
    i, j = (1, 0) if transpose_c else (0, 1)
    m, n, k = result_shape[i], result_shape[j], m1_sizes[j]

    def cast(strides: tuple[int, ...], sizes: tuple[int, ...], lead: int, other: int) -> tuple[bool, int]:
        if strides[i] == 1 and strides[j] >= max(1, lead):
            return False, 0
        if strides[j] == 1 and strides[i] >= max(1, other):
            return True, 0
        return not transpose_c, sizes[0] * sizes[1] * itemsize

    trans_a, a_copy = cast(m1_strides, m1_sizes, m, k)
    trans_b, b_copy = cast(m2_strides, m2_sizes, k, n)
    scratch = onednn_gemm_bytes(cpu, dtype, trans_a, trans_b, m, n, k, alpha)
    if transpose_c:  # BLAS's first operand is mat2
        a_copy, b_copy = b_copy, a_copy
    return _Gemm(result_copy, a_copy, b_copy, scratch)


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(t.shape), tuple(t.stride())


def _gemm_of(
    cpu: CpuProfile, result: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, alpha: Any
) -> _Gemm:
    return _addmm_impl(
        cpu,
        tuple(result.shape), tuple(result.stride()), _layout(mat1), _layout(mat2),
        result.dtype, result.element_size(), alpha,
    )


def _result(call: OpCall) -> torch.Tensor:
    out = call.out
    return out[0] if isinstance(out, (tuple, list)) else out


def _native_gap(call: OpCall) -> tuple[Inexact, ...]:
    """The product's dtype is computed natively on the modelled CPU (oneDNN enabled)."""
    if not profile_of(call).native_dtypes or not _mkldnn_enabled():
        return ()  # most profiles: nothing to ask on this hot path
    return native_kernel_gap(call, _result(call).dtype, _MATMUL_KERNELS)


def _product_steps(call: OpCall, mat1: torch.Tensor, mat2: torch.Tensor, alpha: Any) -> Steps:
    """The steps of one ``addmm_impl_cpu_`` call: the output first (structured
    kernel), then the copies of unusable operands and oneDNN's scratchpad."""
    cpu, result = profile_of(call), _result(call)
    try:
        key = (
            cpu.isa, cpu.threads, _mkldnn_enabled(), result.dtype, alpha,
            tuple(result.shape), result.stride(), _layout(mat1), _layout(mat2),
        )
        return _PRODUCT_STEPS.get(key, lambda: _work_out_product(call, cpu, result, mat1, mat2, alpha))
    except TypeError:  # symbolic sizes: no key
        return _work_out_product(call, cpu, result, mat1, mat2, alpha)


def _work_out_product(
    call: OpCall, cpu: CpuProfile, result: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, alpha: Any
) -> tuple[Step, ...]:
    gemm = _gemm_of(cpu, result, mat1, mat2, alpha)
    steps = (*_native_gap(call), OUTPUTS, *(step for step in gemm.steps() if step.nbytes > 0))
    return () if steps == (OUTPUTS,) else steps  # () : only the outputs, as without a rule


#: :func:`_product_steps` by what alone decides them: the CPU's level and threads,
#: whether oneDNN is on, the dtype, ``alpha`` and the sizes and strides of the
#: result and operands (a model repeats a few products layer after layer).
_PRODUCT_STEPS: Final[BoundedMemo[tuple[Step, ...]]] = BoundedMemo()


@CPU.scratch(aten.mm.default, aten.mm.out)
def _mm(call: OpCall) -> Steps:
    """``mm_out_cpu`` → ``addmm_impl_cpu_``."""
    return _product_steps(call, call.args[0], call.args[1], 1)


@CPU.scratch(
    aten.addmm.default, aten.addmm.out, aten.addmm_.default,
    aten._addmm_activation.default, aten._addmm_activation.out,
)
def _addmm(call: OpCall) -> Steps:
    """``addmm_out_cpu`` / ``addmm_activation_out_cpu`` → ``addmm_impl_cpu_`` (the
    bias is copied into the output, which costs nothing more)."""
    return _product_steps(call, call.args[1], call.args[2], call.arg(4, "alpha", 1))


# -- bmm_out_or_baddbmm_ ---------------------------------------------------------


def _mkldnn_optimized_format(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """``is_mkldnn_optimized_format`` in ``mkldnn_matmul``: contiguous, or the
    (each) matrix transposed."""
    if is_contiguous(sizes, strides):
        return True
    if len(sizes) == 2:
        return strides[0] == 1 and strides[1] == sizes[0]
    return strides[0] == sizes[1] * sizes[2] and strides[1] == 1 and strides[2] == sizes[1]


def _mkldnn_matmul_steps(
    cpu: CpuProfile,
    mat1: torch.Tensor, mat2: torch.Tensor, batch: int, rows: int, cols: int, alpha: Any
) -> list[Alloc]:
    """``mkldnn_matmul`` (aten/src/ATen/native/mkldnn/Matmul.cpp) for a ``batch`` x
    ``rows`` x ``cols`` output: nothing when ``alpha`` is 0; else each operand
    not in an optimized format (vectors seen as a row, resp. a column) made
    contiguous, then ``ideep::matmul_forward::compute``."""
    if _float32(alpha) == 0.0:
        return []
    steps = []
    for name, mat, dim in (("mat1", mat1, 0), ("mat2", mat2, 1)):
        sizes, strides = tuple(mat.shape), tuple(mat.stride())
        if len(sizes) == 1:  # unsqueeze(0) for mat1, unsqueeze(1) for mat2
            sizes, strides = ((1, sizes[0]), (sizes[0] * strides[0], strides[0])) if dim == 0 else (
                (sizes[0], 1), (strides[0], 1))
        copy = 0 if _mkldnn_optimized_format(sizes, strides) else nbytes_of(mat)
        steps.append(Alloc(f"{name} (contiguous copy)", copy))
    steps.append(Alloc("oneDNN scratchpad", _onednn_matmul_bytes(cpu, batch, rows, cols, alpha)))
    return steps


def _items_contiguous_or_transposed(t: torch.Tensor) -> bool:
    sizes, strides = t.shape, t.stride()
    return (strides[2] == 1 and (sizes[1] == 1 or strides[1] >= sizes[2])) or (
        strides[1] == 1 and (sizes[2] == 1 or strides[2] >= sizes[1])
    )


def _bmm_steps(
    cpu: CpuProfile, result: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, alpha: Any
) -> list[Alloc]:
    """``bmm_out_or_baddbmm_`` (aten/src/ATen/native/LinearAlgebra.cpp)."""
    bs, rows, inner = batch1.shape
    cols = batch2.shape[2]
    if result.numel() == 0 or inner == 0:
        return []
    dtype = result.dtype
    # apply_mkldnn_matmul_heur (x86 defaults: no minimum) and use_mkldnn_matmul.
    if (
        _onednn_usable(cpu, dtype)
        and batch1.dtype == batch2.dtype == dtype
        and bs * rows * inner * cols > _MKLDNN_GEMM_MIN_SIZE
    ):
        return _mkldnn_matmul_steps(cpu, batch1, batch2, bs, rows, cols, alpha)
    if inner * rows * cols < _BMM_SMALL:
        return []  # baddbmm_cpu_kernel: no scratch
    if (
        torch.backends.mkl.is_available()
        and (dtype.is_complex or (dtype.is_floating_point and dtype not in (torch.bfloat16, torch.float16)))
        and _items_contiguous_or_transposed(batch1)
        and _items_contiguous_or_transposed(batch2)
        and result.is_contiguous()
    ):
        return []  # baddbmm_with_gemm_: MKL's batched gemm
    # One addmm_impl_cpu_ per batch; the copies of one batch are freed before the next.
    rs, s1, s2 = result.stride(), batch1.stride(), batch2.stride()
    gemm = _addmm_impl(
        cpu,
        (rows, cols), (rs[1], rs[2]),
        ((rows, inner), (s1[1], s1[2])), ((inner, cols), (s2[1], s2[2])),
        dtype, result.element_size(), alpha,
    )
    return gemm.steps("per batch: ")


@CPU.scratch(aten.bmm.default, aten.bmm.out)
def _bmm(call: OpCall) -> Steps:
    """``bmm_out_cpu`` → ``bmm_out_or_baddbmm_``."""
    return [*_native_gap(call), OUTPUTS, *_bmm_steps(profile_of(call), _result(call), call.args[0], call.args[1], 1)]


@CPU.scratch(aten.baddbmm.default, aten.baddbmm.out, aten.baddbmm_.default)
def _baddbmm(call: OpCall) -> Steps:
    """``baddbmm_out_cpu`` → ``bmm_out_or_baddbmm_`` (the output holds ``self``)."""
    alpha = call.arg(4, "alpha", 1)
    return [*_native_gap(call), OUTPUTS, *_bmm_steps(profile_of(call), _result(call), call.args[1], call.args[2], alpha)]


# -- addmv, dot -------------------------------------------------------------------


def _use_mkldnn_matmul(cpu: CpuProfile, dtype: torch.dtype, *tensors: torch.Tensor, size: int) -> bool:
    """``use_mkldnn_matmul`` for inputs of one reduced type (bfloat16, float16) whose
    ``checksize`` product is ``size``."""
    return (
        _onednn_usable(cpu, dtype)
        and all(t.dtype == dtype and t.numel() for t in tensors)
        and size > _MKLDNN_GEMM_MIN_SIZE
    )


def _addmv_steps(
    cpu: CpuProfile, result: torch.Tensor, mat: torch.Tensor, vec: torch.Tensor, alpha: Any
) -> list[Alloc]:
    """``addmv_out_cpu`` (aten/src/ATen/native/Blas.cpp): oneDNN when
    ``use_mkldnn_matmul`` (matrix of more than 16 * 16 * 16 elements); else
    ``gemv`` on the matrix or its transpose, or on a contiguous copy when
    neither has a usable leading dimension."""
    if mat.numel() == 0 or result.numel() == 0:
        return []
    rows, cols = mat.shape
    if _use_mkldnn_matmul(cpu, mat.dtype, mat, vec, size=rows * cols):
        return _mkldnn_matmul_steps(cpu, mat, vec, 1, rows, 1, alpha)
    s0, s1 = mat.stride()

    def lda_cond(m: int, n: int, lda: int) -> bool:
        return n == 1 or lda >= max(1, m)

    if (s0 == 1 and lda_cond(rows, cols, s1)) or (s1 == 1 and lda_cond(cols, rows, s0)):
        return []
    return [Alloc("mat (contiguous copy)", nbytes_of(mat))]


@CPU.scratch(aten.mv.default, aten.mv.out)
def _mv(call: OpCall) -> Steps:
    """``mv`` → ``addmv_`` into a fresh result (``mv_out`` → ``addmv_out``)."""
    return [*_native_gap(call), OUTPUTS, *_addmv_steps(profile_of(call), _result(call), call.args[0], call.args[1], 1)]


@CPU.scratch(aten.addmv.default, aten.addmv.out, aten.addmv_.default)
def _addmv(call: OpCall) -> Steps:
    """``addmv_out_cpu``."""
    alpha = call.arg(4, "alpha", 1)
    return [*_native_gap(call), OUTPUTS, *_addmv_steps(profile_of(call), _result(call), call.args[1], call.args[2], alpha)]


@CPU.implementation(aten.addmv.default)
def _addmv_result(call: OpCall) -> Any:
    """Up to torch 2.11 ``addmv`` accepts a ``self`` of another dtype than the matrix
    and the vector, and its result takes the matrix's dtype (the fake kernel promotes
    it with ``self``'s); from 2.12 the three must agree (``eager_checks``)."""
    out = call.default()
    mat = call.args[1]
    if torch_minor() < (2, 12) and out.dtype != mat.dtype:
        return torch.empty_like(out, dtype=mat.dtype)
    return out


@CPU.scratch(aten.dot.default, aten.vdot.default)
def _dot(call: OpCall) -> Steps:
    """``dot`` (and ``vdot`` of real vectors, which calls it): with oneDNN
    (``use_mkldnn_matmul``: more than 16 * 16 * 16 elements) a 1 x 1 result."""
    self, other = call.args[0], call.args[1]
    cpu = profile_of(call)
    if self.is_complex() or not _use_mkldnn_matmul(cpu, self.dtype, self, other, size=self.shape[0]):
        return [*_native_gap(call), OUTPUTS]
    return [*_native_gap(call), OUTPUTS, *_mkldnn_matmul_steps(cpu, self, other, 1, 1, 1, 1)]


# -- _grouped_mm -----------------------------------------------------------------

_GROUPED_MM_DTYPES: Final = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_check_strides(name: str, mat: torch.Tensor) -> None:
    """``check_valid_strides_and_return_transposed`` (aten/src/ATen/native/GroupedMMUtils.h):
    each matrix must be row- or column-major with a leading dimension that is a
    multiple of 16 bytes; a stride-0 (expanded) operand is refused."""
    sizes, strides = mat.shape, mat.stride()
    end = mat.dim() - 1
    alignment = 16 // mat.element_size()
    if strides[end - 1] == 1 and strides[end] >= max(1, sizes[end - 1]):
        lead = strides[end]
    elif strides[end] == 1 and strides[end - 1] >= max(1, sizes[end]):
        lead = strides[end - 1]
    else:
        raise RuntimeError(
            f"Invalid strides/sizes, got {list(strides)} for strides and {list(sizes)} for sizes ({name})"
        )
    if lead % alignment:
        raise RuntimeError(f"strides should be multiple of 16 bytes ({name})")


def grouped_mm_output(call: OpCall) -> torch.Tensor:
    """``_grouped_mm_cpu`` (aten/src/ATen/native/Blas.cpp): the meta kernel follows
    the CUDA kernel, which takes bfloat16 alone and checks CUDA's alignment; the
    CPU kernel takes float32, bfloat16 and float16. This follows
    ``_grouped_mm_validate_inputs`` and ``create_grouped_gemm_output_tensor``:
    the output's last dimension is padded to 16 bytes (for TMA on CUDA, kept on
    CPU), so its storage can be larger than its elements."""
    mat_a, mat_b = call.args[0], call.args[1]
    offs = call.arg(2, "offs", None)
    bias = call.arg(3, "bias", None)
    out_dtype = call.arg(4, "out_dtype", None)
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in _GROUPED_MM_DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
        if mat.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if (not a_2d or not b_2d) and mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    _grouped_mm_check_strides("mat_a", mat_a)
    _grouped_mm_check_strides("mat_b", mat_b)
    if (offs is not None) != (a_2d or b_2d):
        raise RuntimeError(
            "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d"
        )
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise RuntimeError("offs has to be 1D int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    dtype = out_dtype if out_dtype is not None else mat_a.dtype
    if dtype != mat_a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a_2d and b_2d:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a_2d:
        if offs.shape[0] != mat_b.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b_2d:
        if offs.shape[0] != mat_a.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        if mat_a.shape[0] != mat_b.shape[0]:
            raise RuntimeError("batched dimension has to match")
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    alignment = 16 // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if a_2d != b_2d else [size[1] * padded, padded, 1]
    return mat_a.new_empty_strided(size, stride, dtype=dtype)


@CPU.implementation(aten._grouped_mm.default)
def _grouped_mm(call: OpCall) -> Any:
    """``_grouped_mm`` on CPU (see :func:`grouped_mm_output`). When the kernel's
    scratch grows with the group sizes held in ``offs`` and fake tensors do not
    know them, the op is handed to :func:`_grouped_mm_unknown_groups`, which
    reports it."""
    out = grouped_mm_output(call)
    offs = call.arg(2, "offs", None)
    if offs is not None and _offsets(offs) is None and _onednn_usable(profile_of(call), out.dtype):
        raise DataDependentOutputException(call.func)
    return out


@CPU.fallback(aten._grouped_mm.default)
def _grouped_mm_unknown_groups(call: OpCall) -> tuple[Any, str]:
    """bfloat16/float16 ``_grouped_mm`` with offsets computed in the step: the
    oneDNN scratch of each group's gemm grows with the group, whose size fake
    tensors do not know; the scratch rule takes the largest possible group."""
    return grouped_mm_output(call), (
        "the group sizes in offs depend on tensor values; the oneDNN scratch of "
        "the largest possible group (every row) was assumed"
    )


def _offsets(offs: torch.Tensor) -> list[int] | None:
    """The group ends in ``offs`` when the fake tensor still knows them."""
    constant = getattr(offs, "constant", None)
    if constant is None:
        return None
    return [int(v) for v in constant.tolist()]


@CPU.scratch(aten._grouped_mm.default)
def _grouped_mm_scratch(call: OpCall) -> Steps:
    """``_grouped_mm_fallback``: one ``mm_out`` per group into a slice of the output
    (2-D operands with offsets), or one ``bmm_out`` (3-D x 3-D). Each ``mm_out``
    is an ``addmm_impl_cpu_`` whose copies and oneDNN scratch are given back
    before the next group, so the largest group's count.

    Where the offsets are computed in the step (a router's counts), fake tensors
    do not know the group sizes; the largest possible group (every row) is
    assumed, which matters only where the scratch grows with the group: the
    bfloat16/float16 oneDNN accumulator, and copies of a degenerate slice.
    """
    mat_a, mat_b, out = call.args[0], call.args[1], call.out
    offs = call.arg(2, "offs", None)
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    cpu = profile_of(call)
    if not a_2d and not b_2d:
        return [*_native_gap(call), OUTPUTS, *_bmm_steps(cpu, out, mat_a, mat_b, 1)]
    # The dimension the groups split, and how many rows it has.
    total = mat_a.shape[1] if (a_2d and b_2d) else (mat_a.shape[0] if a_2d else mat_b.shape[1])
    ends = _offsets(offs)
    sizes = [total] if ends is None else [e - s for s, e in zip([0, *ends[:-1]], ends)]
    worst = _NOTHING
    for rows in set(sizes):
        if rows <= 0:
            continue
        if a_2d and b_2d:  # out[g] = mat_a[:, group] @ mat_b[group, :]
            m1, m2 = (mat_a.shape[0], rows), (rows, mat_b.shape[1])
            s1, s2 = mat_a.stride(), mat_b.stride()
        elif a_2d:  # out[group, :] = mat_a[group, :] @ mat_b[g]
            m1, m2 = (rows, mat_a.shape[1]), tuple(mat_b.shape[1:])
            s1, s2 = mat_a.stride(), mat_b.stride()[1:]
        else:  # out[:, group] = mat_a[g] @ mat_b[:, group]
            m1, m2 = tuple(mat_a.shape[1:]), (mat_b.shape[0], rows)
            s1, s2 = mat_a.stride()[1:], mat_b.stride()
        shape = (m1[0], m2[1])
        gemm = _addmm_impl(
            cpu,
            shape, tuple(out.stride()[-2:]), (m1, tuple(s1)), (m2, tuple(s2)),
            out.dtype, out.element_size(), 1,
        )
        if gemm.nbytes > worst.nbytes:
            worst = gemm
    return [OUTPUTS, *worst.steps("largest group: ")]
