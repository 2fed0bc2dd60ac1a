"""CUDA rules: what ATen's own CUDA kernels take from the caching allocator.

These buffers are allocated with ``c10::cuda::CUDACachingAllocator`` inside a
kernel and given back before it returns, so ``torch.cuda.max_memory_allocated()``
sees them and the fake trace (meta kernels) does not. Each rule follows the
kernel's source in torch 2.13 (``Reduce.cuh``, ``MultiTensorApply.cuh``,
``cub.cuh`` and ``cub-RadixSortPairs.cuh`` are read from the 2.13 wheel's own
headers; the ``.cu`` files from pytorch/pytorch's main branch of the 2.11-2.13
cycle, whose logic these parts did not change):

* **reductions** (``gpu_reduce_kernel`` in ``aten/src/ATen/native/cuda/Reduce.cuh``):
  the partial results and semaphores of a launch that splits each output's inputs
  across thread blocks, and the input's cast copy; the launch configuration is
  modelled in :mod:`.reduce_launch`, and the rules here say which launch each
  reduction makes (``sum``, ``mean``, ``amax``, the arg reductions, norms, Welford).
* **``_foreach_norm`` / ``_foreach_max``** (``ForeachReduceOp.cu``): the fast
  route keeps one partial result per 65536-element chunk of every tensor,
  ``at::zeros({ntensors * max_chunks_per_tensor}, opmath dtype)``, allocated
  before the results.
* **``embedding_dense_backward``** (``Embedding.cu``,
  ``EmbeddingBackwardKernel.cu``): above 3072 indices (or with
  ``scale_grad_by_freq``) the indices are radix-sorted with their positions
  and the gradient is summed per segment of equal indices; every buffer is
  sized by the number of indices and ``num_weights`` (never by the index
  values), the cub temp storages as :mod:`.cub_storage` models them, per
  release (the fused atomic path from 2.11, the sort's key bits from 2.13).
* **``native_layer_norm_backward``** (``layer_norm_kernel.cu``,
  ``LaunchGammaBetaBackwardCUDAKernel``): when ``M > 65536`` rows and
  ``N / 32 < sm_count / 2``, the weight and bias gradients are first summed per
  block of 32 rows into ``[blocks.y, N]`` buffers, then ``.sum(0)``.

Library memory that the caching allocator does not see (cudnn/cublas handles,
cuFFT plans, NCCL buffers, the CUDA context) is not charged: neither is it by
``max_memory_allocated()``.

* **``native_group_norm_backward``** (``group_norm_kernel.cu``): the per-sample,
  per-channel sums ``ds`` and ``db`` and the coefficients ``c1``-``c3`` in the
  accumulation type.
* **``sort``** (``Sort.cpp``, ``sort_cuda_kernel``; ``SortStable.cu``,
  ``launch_stable_sort_kernel``; the same in every release, cub's storage per
  release): up to 4096 elements per slice the index ``arange``; beyond, one of
  three cub paths by the number of slices, each with its index buffers and
  cub's temporary storage.

Not modelled (the outputs are exact, these kernels' scratch is not):
``cumsum``/``cumprod`` of
one-dimensional inputs (``cub::DeviceScan`` temp storage), ``unique``,
``nonzero``, ``index_put_(accumulate=True)`` (its sort of the linear index),
``multinomial`` (radix-select buffers), and
``native_batch_norm`` when cuDNN does not take it (the channels-last
statistics kernels' staging buffers).

* **``topk``** (``TensorTopK.cpp``, ``structured_topk_out_cuda::impl``;
  ``TensorTopK.cu``, ``launch_gather_topk_kernel``; the same in every release):
  the input's contiguous copy; for many long slices the multi-block radix select's
  buffers and two cub scans by key (blocks from the GPU's SM count); above
  ``k = 4096`` the sort of the values (as ``sort``'s), both index buffers and the gather.

* **softmax backward** (``SoftMax.cu``, ``softmax_backward_cuda_out``): the
  product ``tmp = grad * output`` that ``host_softmax_backward`` runs on, a
  tensor of the gradient's size (every release; not ``log_softmax``'s).

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
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.cub_storage import (
    SCAN_TILE_ITEMS,
    alias_temporaries,
    exclusive_scan_bytes,
    radix_sort_pairs_bytes,
    scan_by_key_bytes,
    unique_by_key_bytes,
)
from pytest_torchmem.engine.tracing.devices.cuda.reduce_launch import (
    WELFORD_VT0,
    acc_size,
    cast_copy_bytes,
    div_up,
    itemsize,
    reduction_steps,
    sm_count,
)
from pytest_torchmem.engine.tracing.devices.tensor_iterator import (
    is_contiguous,
    non_overlapping_and_dense,
    reorder_dimensions,
)
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Step, nbytes_of

__all__ = ["EMBEDDING_FUSED_FROM", "EMBEDDING_NBITS_FROM", "GROUP_NORM_CONTIGUOUS_FROM", "KCHUNK_SIZE", "SMALL_SORT_MAX"]

aten = torch.ops.aten


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


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
    return 16 if acc_size(dtype) == 4 else 32


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
    chunks = max(div_up(t.numel(), KCHUNK_SIZE) for t in tensors)
    out_dtype = dtype if dtype is not None else tensors[0].dtype
    nbytes = len(tensors) * chunks * itemsize(_opmath(out_dtype))
    return [Alloc("output_per_tensor", nbytes), OUTPUTS, Free("output_per_tensor")]


@CUDA.scratch(aten._foreach_max.default)
def _foreach_max(call: OpCall) -> list[Step]:
    """``foreach_tensor_max_cuda`` (``ForeachReduceOp.cu``): ``output_per_tensor`` of
    ``ntensors * max_chunks_per_tensor`` elements of the tensors' dtype."""
    tensors = list(call.args[0])
    if not _fast_route(tensors):
        return [OUTPUTS]
    chunks = max(div_up(t.numel(), KCHUNK_SIZE) for t in tensors)
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
#: ``MAX_ATOMIC_ACCUM_BLOCKS_PER_SM`` (``EmbeddingBackwardKernel.cu``, from 2.11: pytorch#172454):
#: the fused atomic kernel runs where the sum-and-scatter grid is below this many blocks per SM.
_ATOMIC_ACCUM_BLOCKS_PER_SM: Final = 4
#: ``MAX_BLOCK_SIZE`` (``ATen/native/cuda/SortingCommon.cuh``, the CUDA branch).
_MAX_BLOCK_SIZE: Final = 1024
#: The first release whose ``embedding_backward_cuda_kernel`` has the fused atomic path
#: (``compute_grad_weight_atomic_accumulate``: in each wheel's kernel names from 2.11.0, not 2.10.0).
EMBEDDING_FUSED_FROM: Final = (2, 11)
#: The first release whose ``embedding_dense_backward_cuda`` sorts only the bits of
#: ``num_weights`` (pytorch#183578, ``get_num_bits``): 2.10.0 to 2.12.1 pass ``end_bit = 64``
#: (``push $0x40`` before the ``radix_sort_pairs_impl<long, 8>`` call), 2.13.0 to 2.15.0 the
#: loop's count (``shr %rax`` ... ``push -0x328(%rbp)``).
EMBEDDING_NBITS_FROM: Final = (2, 13)


def _num_bits(max_key: int) -> int:
    """``at::cuda::cub::get_num_bits`` (``ATen/cuda/cub.h``)."""
    bits = 1
    while max_key > 1:
        max_key >>= 1
        bits += 1
    return bits


def _embedding_sort_bits(num_weights: int, padding_idx: int, key_size: int) -> int:
    """The key bits the radix sort of the indices covers in this release."""
    if torch_minor() < EMBEDDING_NBITS_FROM:
        return key_size * 8
    return _num_bits(num_weights if padding_idx >= 0 else num_weights - 1 - padding_idx)


def _embedding_fused(
    call: OpCall, max_segments: int, max_partials: int, dim: int
) -> bool:
    """``use_fused_kernel`` (2.11 on): the sum-and-scatter grid is small against the SMs
    and the partial segments outnumber it fourfold, unless deterministic algorithms
    are asked for."""
    if torch_minor() < EMBEDDING_FUSED_FROM or torch.are_deterministic_algorithms_enabled():
        return False
    gpu = call.gpu
    stride_warped = div_up(dim, 32) * 32
    block = min(stride_warped, _MAX_BLOCK_SIZE)
    grid = div_up(max_segments * stride_warped, block)
    return grid < sm_count(gpu) * _ATOMIC_ACCUM_BLOCKS_PER_SM and max_partials > grid * 4


@CUDA.scratch(aten.embedding_dense_backward.default)
def _embedding_dense_backward(call: OpCall) -> list[Step]:
    """``embedding_dense_backward_cuda`` (``Embedding.cu``) and
    ``embedding_backward_cuda_kernel`` (``EmbeddingBackwardKernel.cu``), sync-free
    (pytorch#70943, bounds of pytorch#78588): every buffer is sized from the number
    of indices and ``num_weights``, never from the index values, so the figure is
    exact whatever the token ids.

    ``indices.contiguous()`` and ``grad.contiguous()`` copies come first. Up to
    3072 indices without ``scale_grad_by_freq``: one kernel into the zeroed
    result, nothing else. Otherwise: ``sorted_indices`` and ``orig_indices``
    (``empty_like(indices)``), ``range = arange(num_indices)`` and the radix
    sort's cub temp storage (freed after the sort, then the range); with
    ``scale_grad_by_freq`` ``count`` and the temp storage of two scans by key.
    Then the result (``zeros``), ``segment_offsets`` (numel), the segment count,
    ``unique_by_key``'s key output (numel) and temp storage,
    ``partials_per_segment`` and its offsets (``max_segments = min(numel,
    num_weights)`` each), the exclusive sum's temp storage, the partial-segment
    count and ``partial_segment_offset`` (``numel / 10 + max_segments``). Last,
    two-pass: ``grad_weight_per_segment`` (``[max_partial_segment, dim]`` in the
    opmath type); fused (2.11 on, :func:`_embedding_fused`):
    ``partial_to_segment_idx`` and, for half/bfloat16, a float accumulator of
    the result's shape."""
    grad, indices = call.args[0], call.args[1]
    num_weights = int(call.args[2])
    padding_idx = int(call.arg(3, "padding_idx", -1))
    scale = bool(call.arg(4, "scale_grad_by_freq", False))
    gpu = call.gpu
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
    bits = _embedding_sort_bits(num_weights, padding_idx, isz)
    steps += [
        Alloc("sorted_indices", n * isz),
        Alloc("orig_indices", n * isz),
        Alloc("range", n * isz),
        Alloc("sort:temp", radix_sort_pairs_bytes(n, isz, isz, bits, gpu)),
        Free("sort:temp"),
        Free("range"),
    ]
    if scale:
        steps += [
            Alloc("count", n * isz),
            Alloc("sum_by_key:temp", scan_by_key_bytes(n, isz)),
            Free("sum_by_key:temp"),
            Alloc("max_by_key:temp", scan_by_key_bytes(n, isz)),
            Free("max_by_key:temp"),
        ]
    max_segments = min(n, num_weights)
    max_partials = n // _NROWS_PER_THREAD + max_segments
    opmath = 4 if grad.dtype in (torch.float16, torch.bfloat16) else grad.element_size()
    steps += [
        OUTPUTS,
        Alloc("segment_offsets", n * isz),
        Alloc("num_of_segments", 8),
        Alloc("unique_by_key:keys", n * isz),
        Alloc("unique_by_key:temp", unique_by_key_bytes(n, gpu)),
        Free("unique_by_key:temp"),
        Free("unique_by_key:keys"),
        Alloc("partials_per_segment", max_segments * isz),
        Alloc("partials_per_segment_offset", max_segments * isz),
        Alloc("exclusive_sum:temp", exclusive_scan_bytes(max_segments, isz)),
        Free("exclusive_sum:temp"),
        Alloc("num_of_partial_segments", 8),
        Alloc("partial_segment_offset", max_partials * isz),
    ]
    if _embedding_fused(call, max_segments, max_partials, dim):
        steps.append(Alloc("partial_to_segment_idx", max_partials * isz))
        if opmath != grad.element_size():
            steps.append(Alloc("grad_weight_acc", num_weights * dim * opmath))
    else:
        steps.append(Alloc("grad_weight_per_segment", max_partials * dim * opmath))
    return steps


# -- sort ---------------------------------------------------------------------------------

#: ``should_use_small_sort`` (``ATen/native/cuda/Sort.h``): slices of at most 4096 elements
#: are sorted in place by ``sortKeyValueInplace``.
SMALL_SORT_MAX: Final = 4096
#: ``do_launch_stable_sort_kernel`` (``SortStable.cu``): one slice, or slices of a million
#: elements and more, are radix-sorted one by one; fewer than 128 slices by one full sort.
_SORT_ONE_BY_ONE: Final = 1_000_000
_SORT_FULL_BELOW: Final = 128
_INT_MAX: Final = 2**31 - 1


@CUDA.scratch(aten.sort.default, aten.sort.stable)
def _sort(call: OpCall) -> list[Step]:
    """``sort_cuda_kernel`` (``Sort.cpp``) after the structured outputs.

    Up to :data:`SMALL_SORT_MAX` elements per slice, ``fillSliceWithIndex`` writes
    ``at::arange(nsort)`` (int64) into the indices, freed before the in-place sort
    (``sortKeyValueInplace``'s kernels take nothing). Beyond, for an input dense with
    the sorted dimension innermost (``stride(dim) == 1``; other layouts are copied
    and listed as inexact), ``launch_stable_sort_kernel`` (``SortStable.cu``) sorts
    batches of ``INT_MAX // nsort`` slices:

    * one slice, or ``nsort >= 1e6`` (``segmented_sort_large_segments``): the
      reverse indices ``nsort x 8``, then per slice ``cub::DeviceRadixSort::SortPairs``;
    * fewer than 128 slices (``segmented_sort_pairs_by_full_sort``): two ``int2``
      buffers of ``n x 8``, ``SortPairs`` of the keys with the ``int2`` pairs (its keys
      out allocated, ``n x sizeof(key)``), then ``SortKeys`` of the pairs as int64 over
      ``ceil(log2(nsegments))`` bits;
    * otherwise (``segmented_sort_pairs``): the reverse indices ``n x 8`` and
      ``cub::DeviceSegmentedRadixSort::SortPairs``, whose storage is its alternate keys
      and values (``n x sizeof(key)`` and ``n x 8``, through ``AliasTemporaries``).

    The radix sorts' storage is :mod:`.cub_storage`'s onesweep model, for keys of 4
    and 8 bytes; smaller keys take other tunings and are listed as inexact there.
    """
    self = call.args[0]
    dim = call.kwargs.get("dim", -1) if call.func is aten.sort.stable else call.arg(1, "dim", -1)
    return [OUTPUTS, *sort_kernel_steps(self, dim, call.gpu)]


def sort_kernel_steps(self: torch.Tensor, dim: int, gpu: Any, tag: str = "sort") -> list[Step]:
    """What ``sort_cuda_kernel`` takes beside its outputs to sort ``self`` along ``dim``
    (:func:`_sort`), its buffers tagged ``{tag}:...``; an :class:`Inexact` first where
    the layout or the key size is not modelled."""
    steps: list[Step] = []
    if self.dim() == 0 or self.numel() == 0:
        return steps
    dim = dim % self.dim()
    nsort = int(self.shape[dim])
    if nsort <= SMALL_SORT_MAX:
        return [Alloc(f"{tag}:arange", nsort * 8), Free(f"{tag}:arange")]
    if not (non_overlapping_and_dense(self) and self.stride(dim) == 1):
        return [Inexact("sort of a layout copied with its sorted dimension innermost")]
    key = self.element_size()
    numel = self.numel()
    nbatch = (min(numel, _INT_MAX) // nsort) * nsort
    remaining = numel
    while remaining > 0:
        n = min(remaining, nbatch)
        nsegments = n // nsort
        if nsegments == 1 or nsort >= _SORT_ONE_BY_ONE:
            if key not in (4, 8):
                return [Inexact(f"cub's radix sort of {key}-byte keys")]
            temp = radix_sort_pairs_bytes(nsort, key, 8, key * 8, gpu)
            steps.append(Alloc(f"{tag}:reverse_indices", nsort * 8))
            for _ in range(nsegments):
                steps += [Alloc(f"{tag}:temp", temp), Free(f"{tag}:temp")]
            steps.append(Free(f"{tag}:reverse_indices"))
        elif nsegments < _SORT_FULL_BELOW:
            if key not in (4, 8):
                return [Inexact(f"cub's radix sort of {key}-byte keys")]
            segment_bits = max(1, math.ceil(math.log2(nsegments)))
            steps += [
                Alloc(f"{tag}:indices_and_segment", n * 8),
                Alloc(f"{tag}:indices_and_segment2", n * 8),
                Alloc(f"{tag}:keys_out", n * key),
                Alloc(f"{tag}:temp", radix_sort_pairs_bytes(n, key, 8, key * 8, gpu)),
                Free(f"{tag}:temp"),
                Free(f"{tag}:keys_out"),
                Alloc(f"{tag}:segment_temp", radix_sort_pairs_bytes(n, 8, 0, segment_bits, gpu)),
                Free(f"{tag}:segment_temp"),
                Free(f"{tag}:indices_and_segment2"),
                Free(f"{tag}:indices_and_segment"),
            ]
        else:
            steps += [
                Alloc(f"{tag}:reverse_indices", n * 8),
                Alloc(f"{tag}:temp", alias_temporaries(n * key, n * 8)),
                Free(f"{tag}:temp"),
                Free(f"{tag}:reverse_indices"),
            ]
        remaining -= n
    return steps


# -- topk -------------------------------------------------------------------------------------

#: ``mbtopk`` (``aten/src/ATen/native/cuda/TensorTopK.cu``): ``BLOCK_THREADS`` and
#: ``RADIX_DIGITS`` (``1 << RADIX_BITS``, 8 bits), the clamp of ``get_items_per_thread``
#: (``MIN_ITEMS_PER_THREAD``, ``MAX_ITEMS_PER_THREAD``) and its ``REGS_PER_THREAD``.
_TOPK_BLOCK_THREADS: Final = 256
_TOPK_RADIX_DIGITS: Final = 256
_TOPK_ITEMS_PER_THREAD: Final = (4, 64)
_TOPK_REGS_PER_THREAD: Final = 40
#: ``cudaDeviceProp::regsPerMultiprocessor`` of every GPU the rules model (64 Ki). With
#: 40 x 256 registers a block, 6 blocks fit an SM, below ``maxBlocksPerMultiProcessor``
#: (16 to 32 from compute capability 7.0), so ``get_items_per_thread`` takes 6.
_REGS_PER_SM: Final = 65536
#: ``should_use_multiblock`` (``TensorTopK.cu``, pytorch#74267's table): the multi-block
#: radix select runs for ``(largest slice count, shortest slice)`` rows, the first that
#: holds the slice count.
_TOPK_MULTIBLOCK: Final = ((20, 20000), (40, 10000), (80, 8000), (199, 5000), (799, 3000), (4000, 800))
_TOPK_MULTIBLOCK_MANY: Final = 400
_UINT32_MAX: Final = 2**32 - 1


def topk_multiblock(slices: int, slice_size: int) -> bool:
    """``should_use_multiblock``: many long slices take ``mbtopk::launch``, the rest the
    single-block ``sbtopk`` kernel (which takes nothing)."""
    if slices > _UINT32_MAX or slice_size > _UINT32_MAX:
        return False
    for most, shortest in _TOPK_MULTIBLOCK:
        if slices <= most:
            return slice_size >= shortest
    return slice_size >= _TOPK_MULTIBLOCK_MANY


def topk_items_per_thread(slices: int, slice_size: int, gpu: Any) -> int:
    """``mbtopk::get_items_per_thread``: the items that fill every SM's resident blocks
    once, clamped to 4..64."""
    blocks_per_sm = _REGS_PER_SM // (_TOPK_REGS_PER_THREAD * _TOPK_BLOCK_THREADS)
    items = div_up(slice_size * slices, sm_count(gpu) * blocks_per_sm * _TOPK_BLOCK_THREADS)
    low, high = _TOPK_ITEMS_PER_THREAD
    return max(low, min(items, high))


def _topk_radix_type_size(dtype: torch.dtype) -> int:
    """``sizeof(TopKTypeConfig<T>::RadixType)`` (``SortingRadixSelect.cuh``): ``uint64_t``
    for ``int64_t`` and ``double``, ``uint32_t`` for every other type."""
    return 8 if dtype in (torch.int64, torch.float64) else 4


def _topk_multiblock_steps(self: torch.Tensor, slices: int, slice_size: int, gpu: Any) -> list[Step]:
    """``mbtopk::launch``: seven buffers from the caching allocator, then two
    ``inclusive_sum_by_key`` of the per-block counts (cub's storage each), all freed
    when it returns."""
    items = topk_items_per_thread(slices, slice_size, gpu)
    blocks = slices * div_up(slice_size, items * _TOPK_BLOCK_THREADS)
    buffers = (
        ("kthValues", slices * self.element_size()),
        ("ks_to_find", 2 * slices * 4),
        ("desired", 2 * slices * _topk_radix_type_size(self.dtype)),
        ("counts", blocks * _TOPK_RADIX_DIGITS * 2),  # short
        ("digit_cum_sum", slices * _TOPK_RADIX_DIGITS * 4),
        ("withinKCounts", blocks * 4),
        ("kthCounts", blocks * 4),
    )
    steps: list[Step] = []
    if blocks > 16 * SCAN_TILE_ITEMS:
        steps.append(Inexact("cub's scan-by-key storage of topk past 16 scan tiles"))
    steps += [Alloc(f"topk:{name}", nbytes) for name, nbytes in buffers]
    scan = scan_by_key_bytes(blocks, 4)
    for _ in range(2):  # withinKCounts, kthCounts
        steps += [Alloc("topk:sum_by_key:temp", scan), Free("topk:sum_by_key:temp")]
    steps += [Free(f"topk:{name}") for name, _ in reversed(buffers)]
    return steps


@CUDA.scratch(aten.topk.default)
def _topk(call: OpCall) -> list[Step]:
    """``structured_topk_out_cuda::impl`` (``TensorTopK.cpp``; read in every wheel
    2.10-2.15: the same calls) after the structured outputs; nothing for ``k == 0``.

    ``launch_gather_topk_kernel`` (``TensorTopK.cu``) takes ``self.contiguous()``;
    where :func:`topk_multiblock` says so, ``mbtopk::launch`` takes ``kthValues``
    (slices x ``sizeof(T)``), ``ks_to_find`` (2 x slices x 4), ``desired`` (2 x slices x
    the radix type), ``counts`` (blocks x 256 shorts), ``digit_cum_sum`` (slices x 256 x
    4), ``withinKCounts`` and ``kthCounts`` (blocks x 4 each), and cub's storage of two
    ``InclusiveSumByKey`` over the blocks; blocks = slices x ``ceil(slice / (items x
    256))`` (:func:`topk_items_per_thread`: the GPU's SM count). The single-block kernel
    takes nothing. (``should_use_sort`` is false on CUDA builds, whose cub scans by key:
    the full-sort fallback never runs.)

    Then, when ``sorted`` and ``k > 4096`` (``should_use_small_sort`` fails; up to 4096
    ``sortKeyValueInplace`` sorts in place): ``sortedIndices`` and ``sortedValues``
    (``empty_like``), ``at::cuda::sort_outf`` of the values (:func:`sort_kernel_steps`),
    ``indices.gather(dim, sortedIndices)`` (a new int64 tensor of the indices' size,
    copied into them and freed), all freed on return."""
    self = call.args[0]
    k = int(call.arg(1, "k"))
    dim = int(call.arg(2, "dim", -1))
    sorted_ = bool(call.arg(4, "sorted", True))
    values, indices = call.out
    steps: list[Step] = [OUTPUTS]
    if k == 0:
        return steps
    dim = dim % self.dim() if self.dim() else 0
    slice_size = int(self.shape[dim]) if self.dim() else 1
    copy = _contiguous_copy(self)
    if copy:
        steps.append(Alloc("topk:input", copy))
    if self.numel() > 0:
        slices = self.numel() // slice_size
        if topk_multiblock(slices, slice_size):
            steps += _topk_multiblock_steps(self, slices, slice_size, call.gpu)
    if copy:
        steps.append(Free("topk:input"))
    if sorted_ and values.numel() > 1 and k > SMALL_SORT_MAX:
        steps += [
            Alloc("topk:sortedIndices", nbytes_of(indices)),
            Alloc("topk:sortedValues", nbytes_of(values)),
            *sort_kernel_steps(values, dim, call.gpu, tag="topk:sort"),
            Alloc("topk:gather", nbytes_of(indices)),
            Free("topk:gather"),
            Free("topk:sortedValues"),
            Free("topk:sortedIndices"),
        ]
    return steps


# -- group norm backward ------------------------------------------------------------------

#: The first release whose ``native_group_norm_backward`` makes its operands contiguous.
GROUP_NORM_CONTIGUOUS_FROM: Final = (2, 14)


@CUDA.scratch(aten.native_group_norm_backward.default)
def _group_norm_backward(call: OpCall) -> list[Step]:
    """``GroupNormBackwardKernelImplInternal`` (``group_norm_kernel.cu``; five
    ``at::empty`` calls in every release's code, read in the 2.15 wheel): after the
    outputs, ``ds`` and ``db`` (``N x C`` in the accumulation type: float for half
    and bfloat16), live to the end; for ``dX``, ``c1`` (``empty({0})`` that the
    ``rstd * gamma`` TensorIterator resizes to ``N x G x D = N x C``; nothing
    without a weight), ``c2`` and ``c3`` (``N x G`` each). With ``HxW == 1``
    ``GroupNorm1dBackward`` runs instead after ``ds`` and ``db``: ``c2`` and ``c3``
    only (its two ``at::empty`` calls).

    From 2.14 ``native_group_norm_backward`` (``group_norm.cpp``) takes ``dY``, ``X``,
    ``mean``, ``rstd`` and ``gamma`` ``.contiguous()`` itself, before its outputs (five
    ``contiguous`` calls in the ``libtorch_cpu.so`` of 2.14.0, 2.14.1 and 2.15.0, none
    in 2.10 to 2.13, whose autograd formula passes ``grad.contiguous()``: a traced op
    there)."""
    dy, x, mean, rstd, weight = call.args[:5]
    n, c, hxw, group = (int(v) for v in call.args[5:9])
    mask = list(call.args[9]) if len(call.args) > 9 else [True, True, True]
    if n == 0:
        return [OUTPUTS]
    steps: list[Step] = []
    if torch_minor() >= GROUP_NORM_CONTIGUOUS_FROM:
        if not x.is_contiguous():
            return [Inexact("group norm backward of a non-contiguous input (its memory format)"), OUTPUTS]
        operands = (("dY", dy), ("mean", mean), ("rstd", rstd), ("gamma", weight))
        steps += [Alloc(f"{name} contiguous", size) for name, t in operands if (size := _contiguous_copy(t))]
    acc = acc_size(x.dtype)
    steps += [OUTPUTS, Alloc("ds", n * c * acc), Alloc("db", n * c * acc)]
    if mask[0]:
        if hxw != 1 and isinstance(weight, torch.Tensor):
            steps.append(Alloc("c1", n * c * acc))
        steps += [Alloc("c2", n * group * acc), Alloc("c3", n * group * acc)]
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
    gpu = call.gpu
    if weight is None or not names:
        return [OUTPUTS]
    rows = _LAYER_NORM_BLOCK_ROWS
    if not (m > _LAYER_NORM_SPLIT_ROWS and n // rows < sm_count(gpu) // 2):
        return [OUTPUTS]
    blocks_x = div_up(n, rows)
    blocks_y = min(_LAYER_NORM_MAX_BLOCKS // blocks_x, div_up(m, rows))
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


def _elementwise_result_contiguous(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a * b`` of two tensors of one shape comes out contiguous, as
    ``TensorIteratorBase::build`` lays out a new output: contiguous when both are
    (``compute_fast_setup_type``); the operands' own strides when both are
    non-overlapping and dense with equal strides; otherwise the order
    ``reorder_dimensions`` gives the operands' strides (``allocate_or_resize_outputs``)."""
    sizes = list(a.shape)
    if a.is_contiguous() and b.is_contiguous():
        return True
    if non_overlapping_and_dense(a) and non_overlapping_and_dense(b) and a.stride() == b.stride():
        return is_contiguous(sizes, a.stride())
    perm = reorder_dimensions(sizes, [a.stride(), b.stride()], n_outputs=0)
    strides = [0] * len(sizes)
    step = 1
    for dim in perm:  # fastest first
        strides[dim] = step
        step *= sizes[dim]
    return is_contiguous(sizes, strides)


@CUDA.scratch(aten._softmax_backward_data.default)
def _softmax_backward(call: OpCall) -> list[Step]:
    """``softmax_backward_cuda_out`` (``SoftMax.cu``; every release 2.10-2.15 calls
    ``at::mul`` there, read in each wheel's ``libtorch_cuda.so``): ``tmp = grad *
    output``, a new tensor of the shape in the promoted dtype, laid out as
    TensorIterator lays out a new output (contiguous when ``output`` is, unless
    ``grad``'s strides order the dimensions otherwise); then ``host_softmax_backward``
    takes ``tmp.contiguous()`` and ``output.contiguous()``. ``tmp`` lives until the
    op returns. ``_log_softmax_backward_data`` has no ``tmp``
    (:func:`_log_softmax_backward`)."""
    grad, output = call.args[0], call.args[1]
    numel = output.numel()
    tmp_size = itemsize(torch.promote_types(grad.dtype, output.dtype))
    tmp_copy = 0 if _elementwise_result_contiguous(grad, output) else numel * tmp_size
    return [
        OUTPUTS,
        Alloc("tmp", numel * tmp_size),
        Alloc("grad", tmp_copy),
        Alloc("output", _contiguous_copy(output)),
    ]


@CUDA.scratch(aten._log_softmax_backward_data.default)
def _log_softmax_backward(call: OpCall) -> list[Step]:
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
