"""CUDA reductions' launch configuration: the buffers one ``gpu_reduce_kernel`` launch takes.

A model of ``aten/src/ATen/native/cuda/Reduce.cuh`` (read from the 2.13 wheel's own
header): when ``setReduceConfig`` splits each output's inputs across thread blocks
(``should_global_reduce()``), the kernel takes a ``buffer`` of ``global_memory_size()``
bytes for the blocks' partial results and ``semaphore_size()`` bytes of semaphores. The
launch configuration is rebuilt here from the TensorIterator geometry
(``reorder_dimensions`` and ``coalesce_dimensions`` of ``TensorIterator.cpp``), the
accumulator type and the GPU's ``multiProcessorCount`` / ``maxThreadsPerMultiProcessor``.
The iterator's input is ``self.to(dtype)`` when the reduction's dtype differs
(``make_reduction`` in ``ReduceOpsUtils.h``; half/bfloat16 into float is read directly on
CUDA): that copy is a temporary too.

:func:`reduction_steps` is what a rule calls: the per-op rules of the reductions
(:mod:`.temporaries`) and of the libraries' kernels that reduce (:mod:`.workspaces`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from pytest_torchmem.engine.figures.gpu_profiles import DEFAULT_GPU, PROFILES
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.memo import BoundedMemo
from pytest_torchmem.engine.tracing.devices.tensor_iterator import (
    coalesce_dimensions,
    non_overlapping_and_dense,
    reorder_dimensions,
)
from pytest_torchmem.engine.tracing.rules import Alloc, Inexact, Step, TraceContext

__all__ = [
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
    "WELFORD_VT0",
    "ReduceConfig",
    "acc_size",
    "cast_copy_bytes",
    "div_up",
    "itemsize",
    "max_threads_per_sm",
    "reduce_config",
    "reduction_steps",
    "sm_count",
]

# torch's private names (engine/torch_compat/torch_private.py)
make_contiguous_strides_for: Final = private("torch._prims_common.make_contiguous_strides_for")

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


def sm_count(gpu: Any) -> int:
    return int(getattr(gpu, "sm_count", _DEFAULT.sm_count))



def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def acc_size(dtype: torch.dtype) -> int:
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


def div_up(a: int, b: int) -> int:
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
        return div_up(self.num_outputs // self.output_vec_size, self.step_output)

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
        return div_up(inputs_per_output, step_input)

    warp_split_threshold = min(block_height * WARP_SPLIT_FACTOR, MAX_VALUES_PER_THREAD)
    if values_per_thread() >= warp_split_threshold:
        input_mult[1] = step_input
        step_input *= block_height
    else:
        step_output *= block_height

    blocks_per_sm = max_threads_per_sm(gpu) // num_threads
    target_grid_size = sm_count(gpu) * blocks_per_sm
    grid = div_up(num_outputs // output_vec_size, step_output)
    ctas_per_output = 1
    if input_mult[1] != 0 and values_per_thread() >= MAX_VALUES_PER_THREAD and grid <= target_grid_size:
        ctas1 = div_up(target_grid_size, grid)
        ctas2 = div_up(values_per_thread(), MIN_VALUES_PER_THREAD)
        ctas3 = div_up(values_per_thread(), MAX_VALUES_PER_THREAD)
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
    return self.numel() * itemsize(in_dtype)


def _input_layout(self: torch.Tensor, in_dtype: torch.dtype) -> tuple[list[int], int]:
    """Byte strides and element offset of the reduction's input: ``self``, or its
    ``to(in_dtype)`` copy (strides preserved when dense, else contiguous)."""
    if self.dtype == in_dtype:
        isz = self.element_size()
        return [s * isz for s in self.stride()], self.storage_offset()
    isz = itemsize(in_dtype)
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
        arg_size=acc_size(in_dtype) if arg_size is None else arg_size,
        scalar_size=itemsize(in_dtype),
        gpu=gpu,
        vt0=vt0,
        max_num_threads=MAX_REDUCE_THREADS_COMPLEX_DOUBLE if in_dtype == torch.complex128 else MAX_REDUCE_THREADS,
        input_offset=offset,
    )
    if config.should_global_reduce:
        steps.append(Alloc(f"{tag}:buffer", config.global_memory_size()))
        steps.append(Alloc(f"{tag}:semaphores", config.semaphore_size()))
    return steps
