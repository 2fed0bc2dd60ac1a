"""CUDA rules: what ATen's own CUDA kernels take from the caching allocator.

These buffers are allocated with ``c10::cuda::CUDACachingAllocator`` inside a
kernel and given back before it returns, so ``torch.cuda.max_memory_allocated()``
sees them and the fake trace (meta kernels) does not. Each rule follows the
kernel's source in torch 2.13 (``Reduce.cuh``, ``MultiTensorApply.cuh``,
``cub.cuh`` and ``cub-RadixSortPairs.cuh`` are read from the 2.13 wheel's own
headers; the ``.cu`` files from pytorch/pytorch's main branch of the 2.11-2.13
cycle, whose logic these parts did not change):

* **reductions** (``gpu_reduce_kernel`` in ``aten/src/ATen/native/cuda/Reduce.cuh``):
  when ``setReduceConfig`` splits each output's inputs across thread blocks
  (``should_global_reduce()``), the kernel takes a ``buffer`` of
  ``global_memory_size()`` bytes for the blocks' partial results and
  ``semaphore_size()`` bytes of semaphores. The launch configuration is
  rebuilt here from the TensorIterator geometry (``reorder_dimensions`` and
  ``coalesce_dimensions`` of ``TensorIterator.cpp``), the accumulator type and
  the GPU's ``multiProcessorCount`` / ``maxThreadsPerMultiProcessor``. The
  iterator's input is ``self.to(dtype)`` when the reduction's dtype differs
  (``make_reduction`` in ``ReduceOpsUtils.h``; half/bfloat16 into float is read
  directly on CUDA): that copy is a temporary too.
* **``_foreach_norm`` / ``_foreach_max``** (``ForeachReduceOp.cu``): the fast
  route keeps one partial result per 65536-element chunk of every tensor,
  ``at::zeros({ntensors * max_chunks_per_tensor}, opmath dtype)``, allocated
  before the results.
* **``embedding_dense_backward``** (``Embedding.cu``,
  ``EmbeddingBackwardKernel.cu``): above 3072 indices (or with
  ``scale_grad_by_freq``) the indices are radix-sorted with their positions
  (cub temp storage through the allocator) and the gradient is summed per
  segment of equal indices into a ``[partial segments, dim]`` accumulator; how
  many segments there are depends on the index values, so the largest count
  (every index distinct) is charged and the op is listed as inexact.
* **``native_layer_norm_backward``** (``layer_norm_kernel.cu``,
  ``LaunchGammaBetaBackwardCUDAKernel``): when ``M > 65536`` rows and
  ``N / 32 < sm_count / 2``, the weight and bias gradients are first summed per
  block of 32 rows into ``[blocks.y, N]`` buffers, then ``.sum(0)``.

Library memory that the caching allocator does not see (cudnn/cublas handles,
cuFFT plans, NCCL buffers, the CUDA context) is not charged: neither is it by
``max_memory_allocated()``.

Not modelled (the outputs are exact, these kernels' scratch is not):
cub-based ``sort``/``argsort`` of large segments, ``cumsum``/``cumprod`` of
one-dimensional inputs (``cub::DeviceScan`` temp storage), ``unique``,
``nonzero``, ``index_put_(accumulate=True)`` (its sort of the linear index),
``multinomial`` and ``topk`` of very long rows (radix-select buffers), and
``native_batch_norm`` when cuDNN does not take it (the channels-last
statistics kernels' staging buffers).

Contiguous copies that kernels make of their operands are charged where the
kernel takes them: ``host_softmax``/``host_softmax_backward`` (``SoftMax.cu``),
``nll_loss_forward``/``backward`` (``Loss.cu``), ``cumsum``/``cumprod``
(``ScanUtils.cuh``, also its dtype cast). Foreach and fused optimizer kernels
(``MultiTensorApply.cuh``) pass their tensor lists as kernel arguments and
take nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from pytest_torchmem.engine.figures.gpu_profiles import DEFAULT_GPU, PROFILES
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.tracing.devices.memo import BoundedMemo
from pytest_torchmem.engine.tracing.devices.tensor_iterator import (
    coalesce_dimensions,
    non_overlapping_and_dense,
    reorder_dimensions,
)
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    OpCall,
    Step,
    TraceContext,
    nbytes_of,
)

__all__ = [
    "KCHUNK_SIZE",
    "MAX_REDUCE_THREADS",
    "MAX_REDUCE_THREADS_COMPLEX_DOUBLE",
    "MAX_VALUES_PER_THREAD",
    "MIN_VALUES_PER_THREAD",
    "OUTPUT_VEC_SIZE",
    "REDUCE_VT0",
    "SEMAPHORE_BYTES",
    "VECTORIZE_INPUT_MIN_DIM0",
    "WARP_SIZE",
    "WARP_SPLIT_FACTOR",
    "ReduceConfig",
    "cast_copy_bytes",
    "max_threads_per_sm",
    "reduce_config",
    "reduction_steps",
]

# torch's private names (engine/torch_compat/torch_private.py)
make_contiguous_strides_for: Final = private("torch._prims_common.make_contiguous_strides_for")

aten = torch.ops.aten

_INT32_MAX: Final = 2**31 - 1

# -- the constants of Reduce.cuh (``aten/src/ATen/native/cuda/Reduce.cuh``, a header
# every wheel ships: tests/test_cuda_temporaries.py reads them from it) --------------

#: ``mnt_wrapper<T>::MAX_NUM_THREADS`` (``max_reduce_threads``): threads per block of a
#: reduction, 256 for complex double.
MAX_REDUCE_THREADS: Final = 512
MAX_REDUCE_THREADS_COMPLEX_DOUBLE: Final = 256
#: ``gpu_reduce_kernel``'s template default ``int vt0=4`` (values per thread and load).
REDUCE_VT0: Final = 4
#: ``get_output_vec_size``: ``int vec_size = 4``, halved until everything divides it.
OUTPUT_VEC_SIZE: Final = 4
#: ``setReduceConfig``: the input is vectorized along a contiguous reduced dimension of
#: at least 128 elements (``dim0 >= 128``).
VECTORIZE_INPUT_MIN_DIM0: Final = 128
#: ``at::cuda::warp_size()`` (``C10_WARP_SIZE``) on NVIDIA GPUs: the most block width.
WARP_SIZE: Final = 32
#: ``setReduceConfig``: ``min_values_per_thread`` (CUDA; 128 on ROCm) and
#: ``max_values_per_thread``, and the warp split's ``block_height * 16``.
MIN_VALUES_PER_THREAD: Final = 16
MAX_VALUES_PER_THREAD: Final = 256
WARP_SPLIT_FACTOR: Final = 16
#: ``ReduceConfig::semaphore_size``: ``sizeof(int)`` per block column.
SEMAPHORE_BYTES: Final = 4
#: ``std_var_kernel_impl`` (``aten/src/ATen/native/cuda/ReduceMomentKernel.cu``) launches
#: its Welford reduction with ``vt0 = 2`` (``gpu_reduce_kernel<scalar_t, out_t, 2>``).
WELFORD_VT0: Final = 2

#: The GPU a figure follows where none is given: the default profile.
_DEFAULT: Final = PROFILES[DEFAULT_GPU]


def max_threads_per_sm(gpu: Any) -> int:
    """``maxThreadsPerMultiProcessor`` of the profiled GPU (:class:`~pytest_torchmem.GpuProfile`;
    the default profile's without one)."""
    return int(getattr(gpu, "max_threads_per_sm", _DEFAULT.max_threads_per_sm))


def _sm_count(gpu: Any) -> int:
    return int(getattr(gpu, "sm_count", _DEFAULT.sm_count))



def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _acc_size(dtype: torch.dtype) -> int:
    """``sizeof(acc_type<scalar_t, /*is_cuda=*/true>)``: float for half, bfloat16
    and float; double for double; int64 for integers; complex<float> for
    complex32/64."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return 4
    if dtype == torch.float64:
        return 8
    if dtype in (torch.complex32, torch.complex64):
        return 8
    if dtype == torch.complex128:
        return 16
    if dtype == torch.bool:
        return 1
    return 8



# -- the TensorIterator of a reduction ----------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    """A reduction TensorIterator after ``reorder_dimensions`` and ``coalesce_dimensions``."""

    shape: tuple[int, ...]
    #: Byte strides of the first output (0 along reduced dimensions).
    out_strides: tuple[int, ...]
    #: Byte strides of the input (the last operand).
    in_strides: tuple[int, ...]
    #: Other operands' byte strides, for the 32-bit indexing check.
    all_strides: tuple[tuple[int, ...], ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_reduce_dims(self) -> int:
        return sum(1 for s in self.out_strides if s == 0)

    @property
    def num_output_elements(self) -> int:
        n = 1
        for size, stride in zip(self.shape, self.out_strides):
            if stride != 0 or size == 0:
                n *= size
        return n

    def can_use_32bit_indexing(self) -> bool:
        """``TensorIteratorBase::can_use_32bit_indexing``."""
        if self.numel > _INT32_MAX:
            return False
        for strides in self.all_strides:
            offset = 1 + sum(
                (size - 1) * stride for size, stride in zip(self.shape, strides)
            )
            if offset > _INT32_MAX:
                return False
        return True


def _reduction_geometry(
    shape: Sequence[int],
    in_strides: Sequence[int],
    out_strides: Sequence[Sequence[int]],
    reduced: Sequence[bool],
) -> _Geometry:
    """Reorder and coalesce as ``TensorIteratorBase::build`` does for a reduction.

    ``shape``/``in_strides`` (bytes) describe the input, ``out_strides`` each
    output's byte strides over the same dimensions (keepdim view; ignored for
    reduced dimensions, which get stride 0 in ``compute_strides``).
    Dimensions of size 1 are dropped first: ``coalesce_dimensions`` merges them
    into a neighbour wherever the sort puts them.
    """
    keep = [d for d, size in enumerate(shape) if size != 1]
    sizes = [int(shape[d]) for d in keep]
    outs = [[0 if reduced[d] else int(s[d]) for d in keep] for s in out_strides]
    inp = [int(in_strides[d]) for d in keep]
    operands = [*outs, inp]
    perm = reorder_dimensions(sizes, operands, n_outputs=len(outs))
    sizes, operands = coalesce_dimensions(
        [sizes[p] for p in perm], [[strides[p] for p in perm] for strides in operands]
    )
    return _Geometry(
        tuple(sizes),
        tuple(operands[0]),
        tuple(operands[-1]),
        tuple(tuple(s) for s in operands),
    )


# -- setReduceConfig ------------------------------------------------------------------


def _last_pow2(n: int) -> int:
    """``last_pow2`` in Reduce.cuh: the largest power of two <= n (1 for n < 1)."""
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _cdiv(a: int, b: int) -> int:
    """C++ integer division of non-negative ints."""
    return a // b


@dataclass(frozen=True)
class ReduceConfig:
    """The parts of ``ReduceConfig`` (Reduce.cuh) that decide the global-reduce buffers."""

    element_size_bytes: int
    num_outputs: int
    num_inputs: int
    block_width: int
    block_height: int
    output_vec_size: int
    input_mult: tuple[int, int, int]
    step_output: int
    ctas_per_output: int

    @property
    def should_global_reduce(self) -> bool:
        return self.input_mult[2] != 0

    @property
    def grid_x(self) -> int:
        return _div_up(self.num_outputs // self.output_vec_size, self.step_output)

    def global_memory_size(self) -> int:
        if not self.should_global_reduce:
            return 0
        size = self.element_size_bytes * self.num_outputs * self.ctas_per_output
        if self.input_mult[0] == 0:  # !should_block_x_reduce()
            size *= self.block_width * self.output_vec_size
        return size

    def semaphore_size(self) -> int:
        return SEMAPHORE_BYTES * self.grid_x if self.should_global_reduce else 0


def _output_vec_size(geo: _Geometry, scalar_size: int, input_offset: int) -> int:
    """``get_output_vec_size<scalar_t>``: 4, halved until the input's base address
    (a caching-allocator block, 512-byte aligned, plus ``input_offset`` elements),
    the first output dimension and the input's other strides divide it."""
    vec = OUTPUT_VEC_SIZE

    def update(n: int) -> None:
        nonlocal vec
        while n % vec != 0:
            vec //= 2

    update(input_offset)
    output_index = geo.num_reduce_dims
    update(geo.shape[output_index])
    for j, stride in enumerate(geo.in_strides):
        if j != output_index:
            update(stride // scalar_size)
    return vec


def reduce_config(
    geo: _Geometry,
    *,
    arg_size: int,
    scalar_size: int,
    gpu: Any,
    vt0: int = REDUCE_VT0,
    input_vec_size: int | None = None,
    max_num_threads: int = MAX_REDUCE_THREADS,
    input_offset: int = 0,
) -> ReduceConfig:
    """``setReduceConfig<arg_t, scalar_t, vt0, input_vec_size>`` (Reduce.cuh, torch 2.13)."""
    input_vec_size = vt0 if input_vec_size is None else input_vec_size
    num_outputs = geo.num_output_elements
    inputs_per_output = geo.numel // num_outputs
    output_vec_size = 1
    if geo.ndim > 0:
        nrd = geo.num_reduce_dims
        on_fastest = nrd == geo.ndim or geo.in_strides[0] < geo.in_strides[nrd]
        if on_fastest:
            dim0, dim1, fastest = inputs_per_output, num_outputs, geo.in_strides[0]
        else:
            dim0, dim1, fastest = num_outputs, inputs_per_output, geo.in_strides[nrd]
    else:
        on_fastest, fastest, dim0, dim1 = True, scalar_size, 1, 1
    if fastest == scalar_size:
        if on_fastest and dim0 >= VECTORIZE_INPUT_MIN_DIM0 and geo.num_reduce_dims == 1:
            dim0 = _cdiv(dim0, input_vec_size)  # vectorize along input
        elif not on_fastest:
            output_vec_size = _output_vec_size(geo, scalar_size, input_offset)
            dim0 = _cdiv(dim0, output_vec_size)

    # set_block_dimension<scalar_t>
    max_threads = max_num_threads // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, WARP_SIZE)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height

    input_mult = [0, 0, 0]
    step_input, step_output = 1, 1
    if geo.ndim == 0 or on_fastest:
        input_mult[0] = step_input
        step_input *= block_width
    else:
        step_output *= block_width

    def values_per_thread() -> int:
        return _div_up(inputs_per_output, step_input)

    warp_split_threshold = min(block_height * WARP_SPLIT_FACTOR, MAX_VALUES_PER_THREAD)
    if values_per_thread() >= warp_split_threshold:
        input_mult[1] = step_input
        step_input *= block_height
    else:
        step_output *= block_height

    blocks_per_sm = max_threads_per_sm(gpu) // num_threads
    target_grid_size = _sm_count(gpu) * blocks_per_sm
    grid = _div_up(num_outputs // output_vec_size, step_output)
    ctas_per_output = 1
    if input_mult[1] != 0 and values_per_thread() >= MAX_VALUES_PER_THREAD and grid <= target_grid_size:
        ctas1 = _div_up(target_grid_size, grid)
        ctas2 = _div_up(values_per_thread(), MIN_VALUES_PER_THREAD)
        ctas3 = _div_up(values_per_thread(), MAX_VALUES_PER_THREAD)
        ctas_per_output = max(min(ctas1, ctas2), ctas3)
        if ctas_per_output > 1:
            input_mult[2] = step_input
            step_input *= ctas_per_output
    return ReduceConfig(
        element_size_bytes=arg_size,
        num_outputs=num_outputs,
        num_inputs=inputs_per_output,
        block_width=block_width,
        block_height=block_height,
        output_vec_size=output_vec_size,
        input_mult=(input_mult[0], input_mult[1], input_mult[2]),
        step_output=step_output,
        ctas_per_output=ctas_per_output,
    )


# -- reductions as ops --------------------------------------------------------------


def _reduced_dims(ndim: int, dim: Any) -> list[bool]:
    """Which input dimensions a reduction over ``dim`` reduces (``None``/``[]``: all)."""
    if dim is None:
        dims: Sequence[int] = range(ndim)
    elif isinstance(dim, int):
        dims = [dim]
    else:
        dims = list(dim) or range(ndim)
    mask = [False] * ndim
    if ndim == 0:
        return mask
    for d in dims:
        mask[d % ndim if ndim else 0] = True
    return mask


def _viewed_out_strides(
    out: torch.Tensor, reduced: Sequence[bool], keepdim: bool
) -> list[int]:
    """Byte strides of ``review_reduce_result``'s view of ``out`` over the input's dims."""
    isz = out.element_size()
    if keepdim and out.dim() == len(reduced):
        return [s * isz for s in out.stride()]
    strides: list[int] = []
    it = iter(out.stride())
    for r in reduced:
        strides.append(0 if r else next(it) * isz)
    return strides


def cast_copy_bytes(self: torch.Tensor, in_dtype: torch.dtype) -> int:
    """Bytes of ``self.to(in_dtype)`` (0 when no cast is needed)."""
    if self.dtype == in_dtype:
        return 0
    return self.numel() * _itemsize(in_dtype)


def _input_layout(self: torch.Tensor, in_dtype: torch.dtype) -> tuple[list[int], int]:
    """Byte strides and element offset of the reduction's input: ``self``, or its
    ``to(in_dtype)`` copy (strides preserved when dense, else contiguous)."""
    if self.dtype == in_dtype:
        isz = self.element_size()
        return [s * isz for s in self.stride()], self.storage_offset()
    isz = _itemsize(in_dtype)
    if non_overlapping_and_dense(self):
        return [s * isz for s in self.stride()], 0
    return [s * isz for s in make_contiguous_strides_for(self.shape)], 0


def reduction_steps(
    self: torch.Tensor,
    outs: Sequence[torch.Tensor],
    dim: Any,
    keepdim: bool,
    *,
    in_dtype: torch.dtype | None = None,
    arg_size: int | None = None,
    vt0: int = REDUCE_VT0,
    context: TraceContext | None = None,
    tag: str = "reduce",
) -> list[Step]:
    """The temporaries of one ``gpu_reduce_kernel`` launch over ``self`` into ``outs``.

    ``in_dtype`` is the iterator's input dtype (a ``self.to(in_dtype)`` copy is
    charged when it differs), ``arg_size`` ``sizeof(arg_t)`` (default: the
    accumulate type of ``in_dtype``), ``vt0`` the kernel's template parameter
    (4; 2 for Welford). Returns ``Alloc`` steps (the caller frees them, or the
    tracker does at the end of the op).
    """
    in_dtype = self.dtype if in_dtype is None else in_dtype
    steps: list[Step] = []
    cast = cast_copy_bytes(self, in_dtype)
    if cast:
        steps.append(Alloc(f"{tag}:cast", cast))
    if self.numel() == 0 or not outs:
        return steps
    gpu = context.gpu if context is not None else None
    if self.layout != torch.strided or any(o.layout != torch.strided for o in outs):
        return steps + _launch_steps(self, outs, dim, keepdim, in_dtype, arg_size, vt0, gpu, tag)
    # The launch's buffers follow from the geometry alone: a step reduces the same
    # shapes again and again (each layer's bias gradients), so they are worked out
    # once per geometry.
    key = (
        tuple(self.shape),
        self.stride(),
        self.storage_offset(),
        self.dtype,
        tuple((o.dim(), o.stride(), o.dtype) for o in outs),
        dim if dim is None or isinstance(dim, int) else tuple(dim),
        keepdim,
        in_dtype,
        arg_size,
        vt0,
        gpu,
        tag,
    )
    def work_out() -> tuple[Step, ...]:
        return tuple(_launch_steps(self, outs, dim, keepdim, in_dtype, arg_size, vt0, gpu, tag))

    try:
        launch = _LAUNCH_STEPS.get(key, work_out)
    except TypeError:  # an unhashable stand-in for a GPU profile: worked out each time
        launch = work_out()
    return steps + list(launch)


#: :func:`_launch_steps` by the reduction's geometry (see :func:`reduction_steps`).
_LAUNCH_STEPS: Final[BoundedMemo[tuple[Step, ...]]] = BoundedMemo()


def _launch_steps(
    self: torch.Tensor,
    outs: Sequence[torch.Tensor],
    dim: Any,
    keepdim: bool,
    in_dtype: torch.dtype,
    arg_size: int | None,
    vt0: int,
    gpu: Any,
    tag: str,
) -> list[Step]:
    """The buffers of the ``gpu_reduce_kernel`` launch of :func:`reduction_steps`
    (over a non-empty ``self``, into at least one output)."""
    steps: list[Step] = []
    reduced = _reduced_dims(self.dim(), dim)
    in_strides, offset = _input_layout(self, in_dtype)
    out_strides = [_viewed_out_strides(o, reduced, keepdim) for o in outs]
    geo = _reduction_geometry(self.shape, in_strides, out_strides, reduced)
    if not geo.can_use_32bit_indexing():
        steps.append(
            Inexact(
                "a reduction over more than 2**31 bytes runs in 32-bit sub-iterations (not modelled)"
            )
        )
        return steps
    config = reduce_config(
        geo,
        arg_size=_acc_size(in_dtype) if arg_size is None else arg_size,
        scalar_size=_itemsize(in_dtype),
        gpu=gpu,
        vt0=vt0,
        max_num_threads=MAX_REDUCE_THREADS_COMPLEX_DOUBLE if in_dtype == torch.complex128 else MAX_REDUCE_THREADS,
        input_offset=offset,
    )
    if config.should_global_reduce:
        steps.append(Alloc(f"{tag}:buffer", config.global_memory_size()))
        steps.append(Alloc(f"{tag}:semaphores", config.semaphore_size()))
    return steps


def _with_outputs(steps: list[Step]) -> list[Step]:
    """Outputs first (structured kernels allocate them before running), then the scratch."""
    return [OUTPUTS, *steps]


def _sum_in_dtype(self: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """``make_reduction_from_out_ty``: half/bfloat16 read directly into a float result."""
    if self.dtype in (torch.float16, torch.bfloat16) and out_dtype == torch.float32:
        return self.dtype
    return out_dtype


@CUDA.scratch(
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.nansum.default,
    aten.prod.default,
    aten.prod.dim_int,
)
def _sum(call: OpCall) -> list[Step]:
    """``sum_out``/``prod_out`` (``ReduceOps.cpp``) -> ``sum_kernel_cuda`` / ``prod_kernel_cuda``
    (``ReduceSumProdKernel.cu``): ``gpu_reduce_kernel<scalar_t, out_t>`` (vt0 = 4)
    accumulating in ``acc_type``; the input cast to the result dtype first
    when it is not half/bfloat16 into float."""
    self, out = call.args[0], _first(call.out)
    if call.func in (aten.sum.default, aten.nansum.default, aten.prod.default):
        dim, keepdim = None, False
    elif call.func == aten.prod.dim_int:
        dim, keepdim = call.arg(1, "dim"), bool(call.arg(2, "keepdim", False))
    else:
        dim, keepdim = call.arg(1, "dim"), bool(call.arg(2, "keepdim", False))
    in_dtype = _sum_in_dtype(self, out.dtype)
    return _with_outputs(
        reduction_steps(
            self, [out], dim, keepdim, in_dtype=in_dtype, context=call.context
        )
    )


@CUDA.scratch(aten.mean.default, aten.mean.dim)
def _mean(call: OpCall) -> list[Step]:
    """``mean_out`` on CUDA -> ``mean_stub`` (``ReduceMomentKernel.cu``, ``MeanOps``,
    vt0 = 4, accumulating in ``acc_type``)."""
    self, out = call.args[0], _first(call.out)
    if call.func == aten.mean.default:
        dim, keepdim = None, False
    else:
        dim, keepdim = call.arg(1, "dim"), bool(call.arg(2, "keepdim", False))
    in_dtype = _sum_in_dtype(self, out.dtype)
    return _with_outputs(
        reduction_steps(
            self, [out], dim, keepdim, in_dtype=in_dtype, context=call.context
        )
    )


@CUDA.scratch(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def _amax(call: OpCall) -> list[Step]:
    """``amax``/``amin`` and full ``max()``/``min()`` -> ``max_values_kernel_cuda`` /
    ``min_values_kernel_cuda`` (``ReduceMaxValuesKernel.cu``): arg_t is the
    ``opmath`` type (float for half/bfloat16)."""
    self, out = call.args[0], _first(call.out)
    if call.func in (aten.max.default, aten.min.default):
        dim, keepdim = None, False
    else:
        dim, keepdim = call.arg(1, "dim", ()), bool(call.arg(2, "keepdim", False))
    return _with_outputs(
        reduction_steps(self, [out], dim, keepdim, context=call.context)
    )


@CUDA.scratch(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def _arg_reduction(call: OpCall) -> list[Step]:
    """``max.dim``/``min.dim`` (values and indices) and ``argmax``/``argmin``
    (``ReduceArgMaxKernel.cu``, ``ReduceMinMaxKernel.cu``): arg_t is
    ``thrust::pair<acc_t, int64_t>``, 16 bytes. ``argmax`` without ``dim``
    reduces ``self.reshape(-1)`` (a copy when ``self`` cannot be viewed so)."""
    self = call.args[0]
    outs = list(call.out) if isinstance(call.out, (tuple, list)) else [call.out]
    dim = call.arg(1, "dim")
    keepdim = bool(call.arg(2, "keepdim", False))
    steps: list[Step] = []
    if dim is None:  # argmax/argmin over everything: self.reshape({-1})
        if not self.is_contiguous() and self.numel() > 1:
            steps.append(Alloc("reshape", nbytes_of(self)))
            self = torch.empty(self.numel(), dtype=self.dtype, device="meta")
        else:
            self = self.reshape(-1)
        dim, keepdim = 0, False
        outs = [o.reshape(()) for o in outs]
    arg_size = 16  # thrust::pair<acc_t, int64_t>
    steps += reduction_steps(
        self, outs, dim, keepdim, arg_size=arg_size, context=call.context
    )
    return _with_outputs(steps)


@CUDA.scratch(aten.linalg_vector_norm.default)
def _vector_norm(call: OpCall) -> list[Step]:
    """``linalg_vector_norm`` -> ``norm_stub`` (``ReduceNormKernel.cu``,
    ``Norm*Ops<scalar_t, acc_t>``, vt0 = 4); the input is cast when ``dtype``
    asks for another type (half/bfloat16 into float is read directly)."""
    self, out = call.args[0], _first(call.out)
    dim = call.arg(2, "dim")
    keepdim = bool(call.arg(3, "keepdim", False))
    in_dtype = _sum_in_dtype(self, out.dtype) if not self.is_complex() else self.dtype
    return _with_outputs(
        reduction_steps(
            self, [out], dim, keepdim, in_dtype=in_dtype, context=call.context
        )
    )


def _welford_size(dtype: torch.dtype) -> int:
    """``sizeof(WelfordData<acc_t, int32_t>)``: mean, m2, n (int32), nf."""
    return 16 if _acc_size(dtype) == 4 else 32


@CUDA.scratch(
    aten.var.correction,
    aten.std.correction,
    aten.var_mean.correction,
    aten.std_mean.correction,
)
def _var(call: OpCall) -> list[Step]:
    """``std_var_out`` / ``std_var_mean_out`` on CUDA -> ``std_var_stub``
    (``ReduceMomentKernel.cu``): ``gpu_reduce_kernel<scalar_t, out_t, /*vt0=*/2>``
    with ``WelfordOps`` (arg_t ``WelfordData``: 16 bytes in float, 32 in double)."""
    self = call.args[0]
    outs = list(call.out) if isinstance(call.out, (tuple, list)) else [call.out]
    dim = call.arg(1, "dim")
    keepdim = bool(
        call.kwargs.get("keepdim", call.args[3] if len(call.args) > 3 else False)
    )
    if self.is_complex():
        return [
            OUTPUTS,
            Inexact(
                "complex var/std runs on the real and imaginary parts (not modelled)"
            ),
        ]
    in_dtype = _sum_in_dtype(self, outs[0].dtype)
    return _with_outputs(
        reduction_steps(
            self,
            outs,
            dim,
            keepdim,
            in_dtype=in_dtype,
            arg_size=_welford_size(in_dtype),
            vt0=WELFORD_VT0,
            context=call.context,
        )
    )


# -- foreach reductions -------------------------------------------------------------

#: ``kChunkSize`` (``aten/src/ATen/native/cuda/MultiTensorApply.cuh``, read from each
#: release's header by tests/test_cuda_temporaries.py): the elements of one chunk.
KCHUNK_SIZE: Final = 65536


def _fast_route(tensors: Sequence[torch.Tensor]) -> bool:
    """``can_use_fast_route`` (ForeachUtils.h), as far as layouts go: one dtype,
    every tensor dense and non-overlapping with the same strides as its sizes
    ask (the meta trace has one device)."""
    if not tensors:
        return False
    dtype = tensors[0].dtype
    return all(
        t.dtype == dtype and non_overlapping_and_dense(t)
        for t in tensors
    )


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@CUDA.scratch(aten._foreach_norm.Scalar)
def _foreach_norm(call: OpCall) -> list[Step]:
    """``foreach_tensor_norm_cuda`` (``ForeachReduceOp.cu``): for L1, L2 and inf norms
    of floating tensors on the fast route, ``output_per_tensor = at::zeros({ntensors
    * max_chunks_per_tensor}, opmath)`` with ``max_chunks_per_tensor`` the largest
    ``ceil(numel / 65536)``, allocated before the results; otherwise the slow
    route (one ``linalg_vector_norm`` per tensor, whose ops are traced)."""
    tensors = list(call.args[0])
    ord_ = float(call.arg(1, "ord", 2))
    dtype = call.arg(2, "dtype")
    if (
        not _fast_route(tensors)
        or any(not (t.dtype.is_floating_point) for t in tensors)
        or ord_ not in (1.0, 2.0, math.inf)
    ):
        return [OUTPUTS]
    chunks = max(_div_up(t.numel(), KCHUNK_SIZE) for t in tensors)
    out_dtype = dtype if dtype is not None else tensors[0].dtype
    nbytes = len(tensors) * chunks * _itemsize(_opmath(out_dtype))
    return [Alloc("output_per_tensor", nbytes), OUTPUTS, Free("output_per_tensor")]


@CUDA.scratch(aten._foreach_max.default)
def _foreach_max(call: OpCall) -> list[Step]:
    """``foreach_tensor_max_cuda`` (``ForeachReduceOp.cu``): ``output_per_tensor`` of
    ``ntensors * max_chunks_per_tensor`` elements of the tensors' dtype."""
    tensors = list(call.args[0])
    if not _fast_route(tensors):
        return [OUTPUTS]
    chunks = max(_div_up(t.numel(), KCHUNK_SIZE) for t in tensors)
    nbytes = len(tensors) * chunks * tensors[0].element_size()
    return [Alloc("output_per_tensor", nbytes), OUTPUTS, Free("output_per_tensor")]


# -- embedding backward -------------------------------------------------------------

#: ``NROWS_PER_THREAD`` (``aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu``): the
#: rows of one partial segment.
_NROWS_PER_THREAD: Final = 10
#: ``embedding_dense_backward_cuda`` (``aten/src/ATen/native/cuda/Embedding.cu``:
#: ``num_indices <= 3072 && !scale_grad_by_freq``): at most this many indices take
#: the direct kernel.
_EMBEDDING_DIRECT_MAX: Final = 3072
#: cub's ``AliasTemporaries`` alignment of each temporary (``ALIGN_BYTES = 256``).
_CUB_ALIGN: Final = 256
#: Tile of cub's onesweep radix sort for 8-byte keys (``AgentRadixSortOnesweepPolicy``
#: of cub's sm80+ policies: 384 threads x 16 items).
_ONESWEEP_TILE: Final = 384 * 16


def _cub_align(n: int) -> int:
    return (n + _CUB_ALIGN - 1) // _CUB_ALIGN * _CUB_ALIGN


def cub_sort_pairs_temp_bytes(n: int, key_size: int, value_size: int) -> int:
    """Temp storage of ``cub::DeviceRadixSort::SortPairs`` (onesweep, full key
    bits) for ``n`` items: the per-pass bins, the look-back tile states, the
    alternate key and value buffers and the pass counters, each aligned to 256
    bytes by ``AliasTemporaries`` (plus 255 bytes of base alignment). The tile
    size is cub's sm80+ onesweep policy; the two alternate buffers, which
    dominate, are exact."""
    passes = _div_up(key_size * 8, 8)
    blocks = _div_up(max(n, 1), _ONESWEEP_TILE)
    parts = (
        passes * 256 * 4,  # bins
        blocks * 256 * 4,  # lookback
        n * key_size,  # alternate keys
        n * value_size,  # alternate values
        passes * 4,  # counters
    )
    return sum(_cub_align(p) for p in parts) + _CUB_ALIGN - 1


@CUDA.scratch(aten.embedding_dense_backward.default)
def _embedding_dense_backward(call: OpCall) -> list[Step]:
    """``embedding_dense_backward_cuda`` (``Embedding.cu``) and
    ``embedding_backward_cuda_kernel`` (``EmbeddingBackwardKernel.cu``).

    ``indices.contiguous()`` and ``grad.contiguous()`` copies come first. Up to
    3072 indices without ``scale_grad_by_freq``: one kernel into the zeroed
    result, nothing else. Otherwise: ``sorted_indices`` and ``orig_indices``
    (``empty_like(indices)``), ``arange(num_indices)`` and the radix sort's cub
    temp storage (freed after the sort), ``count`` with ``scale_grad_by_freq``,
    then the result, ``segment_offsets`` (numel indices), per-segment counts
    and offsets (2 x segments), ``partial_segment_offset`` (partial segments)
    and ``grad_weight_per_segment`` (``[partial segments, dim]`` in the
    accumulate type). The segment counts depend on the index values: every
    index distinct is assumed (at most ``min(numel, num_weights)`` segments,
    each of at most ``1 + (rows - 1) / 10`` partial segments)."""
    grad, indices = call.args[0], call.args[1]
    num_weights = int(call.args[2])
    scale = bool(call.arg(4, "scale_grad_by_freq", False))
    steps: list[Step] = []
    if not indices.is_contiguous():
        steps.append(Alloc("indices", nbytes_of(indices)))
    if not grad.is_contiguous():
        steps.append(Alloc("grad", nbytes_of(grad)))
    n = indices.numel()
    if n <= _EMBEDDING_DIRECT_MAX and not scale:
        return [*steps, OUTPUTS]
    isz = indices.element_size()
    dim = grad.shape[-1] if grad.dim() else 1
    steps += [
        Alloc("sorted_indices", n * isz),
        Alloc("orig_indices", n * isz),
        Alloc("range", n * isz),
        Alloc("cub_sort", cub_sort_pairs_temp_bytes(n, isz, 8)),
        Free("cub_sort"),
        Free("range"),
    ]
    if scale:
        steps.append(Alloc("count", n * isz))
    segments = min(n, num_weights)
    partials = segments + (n - segments) // _NROWS_PER_THREAD
    acc = 4 if grad.dtype in (torch.float16, torch.bfloat16) else grad.element_size()
    steps += [
        OUTPUTS,
        Alloc("segment_offsets", n * isz),
        Alloc("partials_per_segment", segments * isz),
        Alloc("partials_per_segment_offset", segments * isz),
        Alloc("partial_segment_offset", partials * isz),
        Alloc("grad_weight_per_segment", partials * dim * acc),
        Inexact(
            "embedding backward sums per distinct index: every index was assumed distinct "
            "(an upper bound on its segment buffers)"
        ),
    ]
    return steps


# -- layer norm backward ------------------------------------------------------------

#: ``LaunchGammaBetaBackwardCUDAKernel`` (``aten/src/ATen/native/cuda/layer_norm_kernel.cu``):
#: above 64 Ki rows (``M > 64 * 1024``) the gradients are summed per block of 32 rows
#: (``kWarpSize``) into at most ``64 * 1024 / 2`` blocks.
_LAYER_NORM_SPLIT_ROWS: Final = 64 * 1024
_LAYER_NORM_BLOCK_ROWS: Final = 32
_LAYER_NORM_MAX_BLOCKS: Final = 64 * 1024 // 2


@CUDA.scratch(aten.native_layer_norm_backward.default)
def _layer_norm_backward(call: OpCall) -> list[Step]:
    """``LaunchGammaBetaBackwardCUDAKernel`` (``layer_norm_kernel.cu``): with
    ``M > 65536`` rows and ``N / 32 < multiProcessorCount / 2`` the weight and
    bias gradients are summed per block of 32 rows into ``[blocks.y, N]``
    buffers (``blocks.y = min(32768 / ceil(N / 32), ceil(M / 32))``) of the
    weight's dtype, then reduced with ``.sum(0)`` into new tensors that replace
    the preallocated ones (each briefly live beside it)."""
    input_, normalized_shape = call.args[1], call.args[2]
    weight = call.args[5] if len(call.args) > 5 else None
    mask = list(call.args[7]) if len(call.args) > 7 else [True, True, True]
    names = [name for index, name in ((1, "dgamma"), (2, "dbeta")) if mask[index]]
    return _gamma_beta_blocks(call, input_, normalized_shape, weight, names)


@CUDA.scratch(aten._fused_rms_norm.default)
def _rms_norm_forward(call: OpCall) -> list[Step]:
    """``_fused_rms_norm_cuda``: ``input.expect_contiguous()`` and
    ``weight.expect_contiguous()`` before the outputs, freed when the kernel returns."""
    copies = [(name, _contiguous_copy(call.arg(index, name))) for index, name in ((0, "input"), (2, "weight"))]
    return [
        *(Alloc(f"{name} contiguous", size) for name, size in copies if size),
        OUTPUTS,
        *(Free(f"{name} contiguous") for name, size in copies if size),
    ]


@CUDA.scratch(aten._fused_rms_norm_backward.default)
def _rms_norm_backward(call: OpCall) -> list[Step]:
    """``_fused_rms_norm_backward`` (``layer_norm_kernel.cu``): the layer norm's
    backward kernels with ``rms_norm=true`` (no mean, no bias): the operands
    ``expect_contiguous()``, and the weight gradient through the same
    ``LaunchGammaBetaBackwardCUDAKernel``, so summed per block of 32 rows above
    64 Ki rows as :func:`_layer_norm_backward` says."""
    grad_out, input_, normalized_shape, rstd = call.args[:4]
    weight = call.args[4] if len(call.args) > 4 else None
    mask = list(call.args[5]) if len(call.args) > 5 else [True, True]
    copies = [(name, _contiguous_copy(t)) for name, t in (("dY", grad_out), ("X", input_), ("rstd", rstd), ("gamma", weight))]
    steps: list[Step] = [Alloc(f"{name} contiguous", size) for name, size in copies if size]
    steps += _gamma_beta_blocks(call, input_, normalized_shape, weight, ["dgamma"] if mask[1] else [])
    steps += [Free(f"{name} contiguous") for name, size in copies if size]
    return steps


def _gamma_beta_blocks(
    call: OpCall, input_: Any, normalized_shape: Any, weight: Any, names: list[str]
) -> list[Step]:
    """The outputs, then ``LaunchGammaBetaBackwardCUDAKernel``'s per-block buffers of
    the gradients ``names`` (``"dgamma"``, ``"dbeta"``) where it splits the rows."""
    n = math.prod(int(s) for s in normalized_shape)
    m = input_.numel() // n if n else 0
    gpu = call.context.gpu if call.context is not None else None
    if weight is None or not names:
        return [OUTPUTS]
    rows = _LAYER_NORM_BLOCK_ROWS
    if not (m > _LAYER_NORM_SPLIT_ROWS and n // rows < _sm_count(gpu) // 2):
        return [OUTPUTS]
    blocks_x = _div_up(n, rows)
    blocks_y = min(_LAYER_NORM_MAX_BLOCKS // blocks_x, _div_up(m, rows))
    isz = weight.element_size()
    steps: list[Step] = [OUTPUTS]
    partial = torch.empty((blocks_y, n), dtype=weight.dtype, device="meta")
    total = torch.empty((n,), dtype=weight.dtype, device="meta")
    for name in names:
        steps.append(Alloc(f"{name}_blocks", blocks_y * n * isz))
    for name in names:
        steps.append(Alloc(f"{name}_sum", n * isz))
        steps += reduction_steps(partial, [total], 0, False, context=call.context, tag=f"{name}_sum")
        # the sum's buffers, then the preallocated gradient it replaces
        steps += [
            Free(f"{name}_sum:semaphores"),
            Free(f"{name}_sum:buffer"),
            Free(f"{name}_sum"),
        ]
    return steps


# -- softmax and NLL loss: contiguous copies -------------------------------------------


def _contiguous_copy(t: Any) -> int:
    """Bytes ``t.contiguous()`` / ``expect_contiguous()`` allocates (0 when it already is)."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return 0
    return nbytes_of(t)


@CUDA.scratch(aten._softmax.default, aten._log_softmax.default)
def _softmax(call: OpCall) -> list[Step]:
    """``host_softmax`` (``SoftMax.cu``) runs on ``input_.contiguous()``; the
    structured output exists before."""
    return [OUTPUTS, Alloc("input", _contiguous_copy(call.args[0]))]


@CUDA.scratch(
    aten._softmax_backward_data.default, aten._log_softmax_backward_data.default
)
def _softmax_backward(call: OpCall) -> list[Step]:
    """``host_softmax_backward`` (``SoftMax.cu``): ``grad_.contiguous()`` and
    ``output_.contiguous()`` (a gradient that ``sum()``'s backward expanded is
    copied)."""
    grad, output = call.args[0], call.args[1]
    return [
        OUTPUTS,
        Alloc("grad", _contiguous_copy(grad)),
        Alloc("output", _contiguous_copy(output)),
    ]


@CUDA.scratch(aten.nll_loss_forward.default)
def _nll_loss_forward(call: OpCall) -> list[Step]:
    """``nll_loss_forward_out_cuda_template`` (``Loss.cu``): ``input_`` and ``target_``
    through ``expect_contiguous()`` and ``weight.contiguous()``; the kernels
    themselves reduce in one block (``total_weight`` is an output)."""
    self, target = call.args[0], call.args[1]
    weight = call.arg(2, "weight")
    return [
        OUTPUTS,
        Alloc("input", _contiguous_copy(self)),
        Alloc("target", _contiguous_copy(target)),
        Alloc("weight", _contiguous_copy(weight)),
    ]


@CUDA.scratch(aten.nll_loss_backward.default)
def _nll_loss_backward(call: OpCall) -> list[Step]:
    """``nll_loss_backward_out_cuda_template`` (``Loss.cu``): ``target``, ``input``
    and ``grad_output`` through ``expect_contiguous()``, ``weight.contiguous()``."""
    grad_output, self, target = call.args[0], call.args[1], call.args[2]
    weight = call.arg(3, "weight")
    return [
        OUTPUTS,
        Alloc("target", _contiguous_copy(target)),
        Alloc("input", _contiguous_copy(self)),
        Alloc("grad_output", _contiguous_copy(grad_output)),
        Alloc("weight", _contiguous_copy(weight)),
    ]


@CUDA.scratch(aten.cumsum.default, aten.cumprod.default)
def _cumsum(call: OpCall) -> list[Step]:
    """``impl_func_cum_ops`` (``ReduceOps.cpp``) scans ``self.to(result dtype)`` (a copy
    when the dtypes differ: an integer or bool mask summed into int64), and
    ``scan_dim`` (``ScanUtils.cuh``) reads it through ``expect_contiguous()``.
    The scan of a whole 1-d tensor goes through ``cub::DeviceScan``, whose few
    KiB of temp storage are not modelled; scans along a dimension of a larger
    tensor use ATen's own kernels and take nothing."""
    self, out = call.args[0], _first(call.out)
    if self.dim() == 0 or self.numel() == 0:
        return [OUTPUTS]
    steps: list[Step] = [OUTPUTS]
    scanned = self
    if self.dtype != out.dtype:
        steps.append(Alloc("cast", cast_copy_bytes(self, out.dtype)))
        if not non_overlapping_and_dense(self):
            scanned = out  # the copy is contiguous; a dense one keeps self's strides
    if not scanned.is_contiguous():
        steps.append(Alloc("contiguous", self.numel() * out.element_size()))
    return steps
