"""Temporaries of ATen's CUDA kernels on the fake cuda device: global-reduce buffers of
gpu_reduce_kernel, reduction input casts, _foreach_norm partials, embedding backward
and layer-norm backward buffers. Expected figures are worked out by hand from
Reduce.cuh's setReduceConfig (torch 2.13 headers) and the kernels' sources."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cuda import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.engine.tracing.devices.cuda import reduce_launch, temporaries
from pytest_torchmem.engine.tracing.devices.cuda.temporaries import cub_sort_pairs_temp_bytes
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    OpCall,
    TraceContext,
)

from torch_sources import header_constant, header_text

aten = torch.ops.aten


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def run_rule(
    func: Any, args: tuple[Any, ...], out: Any, gpu: str = "H100", **kwargs: Any
) -> list[Any]:
    rule = CUDA.scratch_rule(func)
    assert rule is not None, func
    return list(
        rule(
            OpCall(func, args, kwargs, out, TraceContext("cuda", gpu=gpu_profile(gpu)))
        )
    )


# -- gpu_reduce_kernel ----------------------------------------------------------------------


def test_full_sum_splits_across_blocks_by_sm_count() -> None:
    """sum() of 2**24 contiguous floats: one dimension, reduced on the fastest stride,
    vectorised along the input; block 512 x 1; each thread would sum 2**24 / 512 =
    32768 values, so the inputs are split across ctas_per_output = max(min(target grid,
    32768 / 16), 32768 / 256) blocks, target grid = SMs x (maxThreadsPerSM / 512):
    H100 132 x 4 = 528, A100 108 x 4 = 432, T4 40 x 2 = 80 (then 128 wins). The
    buffer holds one float per block; the semaphores one int per output block."""
    x = meta(1 << 24)
    for gpu, ctas in (("H100", 528), ("A100", 432), ("T4", 128)):
        steps = run_rule(aten.sum.default, (x,), meta(), gpu=gpu)
        assert steps == [
            OUTPUTS,
            Alloc("reduce:buffer", 4 * ctas),
            Alloc("reduce:semaphores", 4),
        ], gpu


def test_small_reduction_takes_nothing() -> None:
    """sum(dim=(0, 2, 3)) of a (8, 16, 32, 32) gradient (a conv bias gradient): 16
    outputs of 8192 inputs; block 32 x 16 leaves 16 values per thread, under 256:
    no global reduction."""
    steps = run_rule(aten.sum.dim_IntList, (meta(8, 16, 32, 32), [0, 2, 3]), meta(16))
    assert steps == [OUTPUTS]


def test_column_sum_of_a_tall_matrix() -> None:
    """sum(dim=0) of (65536, 64) floats, a Linear bias gradient over 65536 rows: the
    reduced dimension is not the fastest, so outputs are vectorised by 4 (block 16 x 8,
    128 threads); 65536 / 8 = 8192 values per thread split over min(2112, 512) = 512
    blocks per output (target grid 132 x 16 = 2112). Without block-x reduction the
    buffer keeps a partial per lane: 4 B x 64 outputs x 512 x (16 x 4) = 8 MiB."""
    steps = run_rule(aten.sum.dim_IntList, (meta(65536, 64), [0]), meta(64))
    assert steps == [
        OUTPUTS,
        Alloc("reduce:buffer", 8 * 1024 * 1024),
        Alloc("reduce:semaphores", 4),
    ]


def test_estimate_charges_the_buffers_as_blocks() -> None:
    """A forward that sums 2**24 floats on H100: input 64 MiB, the 0-dim output (512),
    the 2112-byte buffer (a 2560-byte block) and the 4-byte semaphores (512)."""

    class Sum(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    report = tm.estimate(
        Sum(), torch.empty(1 << 24, device="meta"), device="cuda", train=False
    )
    assert report.forward_peak == (1 << 26) + 512 + 2560 + 512


def test_mask_sum_casts_to_int64() -> None:
    """sum() of a bool mask into int64: make_reduction reduces mask.to(int64),
    1000 x 8 bytes, for the call."""
    steps = run_rule(
        aten.sum.default, (meta(1000, dtype=torch.bool),), meta(dtype=torch.int64)
    )
    assert steps == [OUTPUTS, Alloc("reduce:cast", 8000)]
    # half into float is read directly on CUDA
    steps = run_rule(
        aten.sum.dim_IntList,
        (meta(1000, dtype=torch.float16), [0]),
        meta(dtype=torch.float32),
        dtype=torch.float32,
    )
    assert steps == [OUTPUTS]


def test_welford_variance_uses_its_accumulator_size() -> None:
    """var() of 2**24 floats: WelfordOps, vt0 = 2, arg_t WelfordData<float, int> of 16
    bytes: the same 528 blocks as a sum on H100, 16 bytes each."""
    steps = run_rule(aten.var.correction, (meta(1 << 24), None), meta())
    assert steps == [
        OUTPUTS,
        Alloc("reduce:buffer", 16 * 528),
        Alloc("reduce:semaphores", 4),
    ]


# -- foreach --------------------------------------------------------------------------------


def test_foreach_norm_partials() -> None:
    """_foreach_norm of 3 float tensors of 100000, 10 and 70000 elements: 2 chunks of
    65536 at most, 3 x 2 float partials (24 bytes) before the results; bfloat16
    tensors keep float partials too."""
    tensors = [meta(100000), meta(10), meta(70000)]
    outs = [meta(), meta(), meta()]
    steps = run_rule(aten._foreach_norm.Scalar, (tensors, 2), outs)
    assert steps == [Alloc("output_per_tensor", 24), OUTPUTS, Free("output_per_tensor")]
    bf16 = [t.to(torch.bfloat16) for t in tensors]
    steps = run_rule(aten._foreach_norm.Scalar, (bf16, 2), outs)
    assert steps[0] == Alloc("output_per_tensor", 24)
    steps = run_rule(
        aten._foreach_norm.Scalar, (tensors, 3), outs
    )  # p = 3: the slow route
    assert steps == [OUTPUTS]


# -- embedding backward -----------------------------------------------------------------


def test_embedding_backward_direct_kernel_up_to_3072_indices() -> None:
    steps = run_rule(
        aten.embedding_dense_backward.default,
        (meta(3072, 16), meta(3072, dtype=torch.long), 1000, -1, False),
        meta(1000, 16),
    )
    assert steps == [OUTPUTS]


def test_embedding_backward_sorted_path() -> None:
    """4096 int64 indices into 1000 rows of 16 floats: sorted and original indices and
    the arange (32768 bytes each), the radix sort's temp storage (bins 8 x 256 x 4,
    one look-back tile 1024, alternate keys and values 32768 each, counters 32 ->
    256, plus 255), then the result and the segment buffers for at most 1000
    segments and 1000 + 3096 // 10 = 1309 partial segments (16 floats each)."""
    assert (
        cub_sort_pairs_temp_bytes(4096, 8, 8) == 8192 + 1024 + 32768 + 32768 + 256 + 255
    )
    steps = run_rule(
        aten.embedding_dense_backward.default,
        (meta(4096, 16), meta(4096, dtype=torch.long), 1000, -1, False),
        meta(1000, 16),
    )
    allocs = [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)]
    assert allocs == [
        ("sorted_indices", 32768),
        ("orig_indices", 32768),
        ("range", 32768),
        ("cub_sort", 75263),
        ("segment_offsets", 32768),
        ("partials_per_segment", 8000),
        ("partials_per_segment_offset", 8000),
        ("partial_segment_offset", 1309 * 8),
        ("grad_weight_per_segment", 1309 * 16 * 4),
    ]
    assert any(isinstance(s, Inexact) for s in steps)


# -- layer norm backward ------------------------------------------------------------------


def test_layer_norm_backward_many_rows() -> None:
    """M = 70000 rows of N = 64 (N / 32 = 2 < 132 / 2): blocks.y = min(32768 / 2,
    ceil(70000 / 32)) = 2188; dgamma and dbeta blocks of 2188 x 64 floats; each
    .sum(0) makes a new 64-float gradient, with a global reduction: outputs
    vectorised by 4 (block 16 x 8), ceil(2188 / 8) = 274 values per thread -> 18
    blocks per output, 4 x 64 x 18 x (16 x 4) = 294912 bytes, and 4 of semaphores."""
    x = meta(70000, 64)
    args = (
        meta(70000, 64),
        x,
        [64],
        meta(70000, 1),
        meta(70000, 1),
        meta(64),
        meta(64),
        [True, True, True],
    )
    steps = run_rule(
        aten.native_layer_norm_backward.default,
        args,
        (meta(70000, 64), meta(64), meta(64)),
    )
    allocs = [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)]
    assert allocs == [
        ("dgamma_blocks", 2188 * 64 * 4),
        ("dbeta_blocks", 2188 * 64 * 4),
        ("dgamma_sum", 256),
        ("dgamma_sum:buffer", 294912),
        ("dgamma_sum:semaphores", 4),
        ("dbeta_sum", 256),
        ("dbeta_sum:buffer", 294912),
        ("dbeta_sum:semaphores", 4),
    ]
    # 60000 rows: the one-pass kernel, no buffers
    small = run_rule(
        aten.native_layer_norm_backward.default,
        (
            meta(60000, 64),
            meta(60000, 64),
            [64],
            meta(60000, 1),
            meta(60000, 1),
            meta(64),
            meta(64),
            [True, True, True],
        ),
        (meta(60000, 64), meta(64), meta(64)),
    )
    assert small == [OUTPUTS]


# -- contiguous copies ------------------------------------------------------------------------


def test_softmax_backward_copies_an_expanded_gradient() -> None:
    """softmax(x).sum(): the gradient is a stride-0 expand of (4, 10), which
    host_softmax_backward copies contiguous (160 bytes, one 512-byte block);
    the forward on a contiguous input copies nothing."""
    grad = meta(1, 1).expand(4, 10)
    steps = run_rule(
        aten._softmax_backward_data.default,
        (grad, meta(4, 10), 1, torch.float32),
        meta(4, 10),
    )
    assert steps == [OUTPUTS, Alloc("grad", 160), Alloc("output", 0)]
    assert run_rule(aten._softmax.default, (meta(4, 10), 1, False), meta(4, 10)) == [
        OUTPUTS,
        Alloc("input", 0),
    ]
    transposed = meta(10, 4).t()
    assert run_rule(aten._log_softmax.default, (transposed, 1, False), meta(4, 10)) == [
        OUTPUTS,
        Alloc("input", 160),
    ]


def test_cumsum_of_a_mask_casts_it() -> None:
    """mask.cumsum(0) of a (1000, 4) bool mask into int64: self.to(int64), 32000 bytes;
    a transposed float input is read contiguous (4 x 1000 x 4 = 16000 bytes)."""
    steps = run_rule(
        aten.cumsum.default,
        (meta(1000, 4, dtype=torch.bool), 0),
        meta(1000, 4, dtype=torch.int64),
    )
    assert steps == [OUTPUTS, Alloc("cast", 32000)]
    steps = run_rule(aten.cumsum.default, (meta(1000, 4).t(), 1), meta(4, 1000))
    assert steps == [OUTPUTS, Alloc("contiguous", 16000)]


# -- the C++ constants, read again from the installed torch's headers ---------------------
# (each release venv of the release suite pins them for its release; tests/torch_sources.py)

REDUCE_CUH = "ATen/native/cuda/Reduce.cuh"


def _cuda_branch(text: str) -> str:
    """``text`` without the ``#ifdef USE_ROCM ... #else`` part of its ROCm/CUDA branches."""
    return re.sub(r"#ifdef USE_ROCM\n(?:(?!#else|#endif).*\n)*?#else\n", "", text)


def _values(pattern: str, text: str) -> set[int]:
    return {int(value) for value in re.findall(pattern, text)}


def test_reduction_thread_counts_are_pinned_by_the_installed_header() -> None:
    """``mnt_wrapper<T>::MAX_NUM_THREADS``: 512 threads per block, 256 for complex double
    (``max_reduce_threads``)."""
    text = header_text(REDUCE_CUH)
    generic = re.search(r"struct mnt_wrapper\s*\{\s*static constexpr int MAX_NUM_THREADS = (\d+);", text)
    complex_double = re.search(
        r"struct mnt_wrapper\s*<\s*c10::complex<double>\s*>\s*\{\s*static constexpr int MAX_NUM_THREADS = (\d+);", text
    )
    assert generic is not None and complex_double is not None
    assert int(generic.group(1)) == reduce_launch.MAX_REDUCE_THREADS == 512
    assert int(complex_double.group(1)) == reduce_launch.MAX_REDUCE_THREADS_COMPLEX_DOUBLE == 256


def test_reduction_launch_constants_are_pinned_by_the_installed_header() -> None:
    """``setReduceConfig`` and its helpers, as the CUDA (not ROCm) build compiles them:
    ``vt0=4``, ``vec_size = 4``, the vectorization at ``dim0 >= 128``, 16 and 256
    values per thread, the warp split at ``block_height * 16``, ``sizeof(int)``
    semaphores, and the block width capped at the device's warp size (32 on NVIDIA)."""
    text = _cuda_branch(header_text(REDUCE_CUH))
    assert _values(r"\bint vt0\s*=\s*(\d+)", text) == {reduce_launch.REDUCE_VT0}
    assert _values(r"\bint vec_size\s*=\s*(\d+);", text) == {reduce_launch.OUTPUT_VEC_SIZE}
    assert _values(r"\bdim0 >= (\d+) && iter\.num_reduce_dims\(\) == 1", text) == {
        reduce_launch.VECTORIZE_INPUT_MIN_DIM0
    }
    assert _values(r"constexpr int min_values_per_thread = (\d+);", text) == {reduce_launch.MIN_VALUES_PER_THREAD}
    assert _values(r"constexpr int max_values_per_thread = (\d+);", text) == {reduce_launch.MAX_VALUES_PER_THREAD}
    assert _values(r"std::min<int>\(block_height \* (\d+), max_values_per_thread\)", text) == {
        reduce_launch.WARP_SPLIT_FACTOR
    }
    assert "return sizeof(int) * grid().x;" in text and reduce_launch.SEMAPHORE_BYTES == 4
    assert "block_width = std::min(dim0_pow2, int(at::cuda::warp_size()));" in text
    assert reduce_launch.WARP_SIZE == 32


def test_foreach_chunk_size_is_pinned_by_the_installed_header() -> None:
    """``kChunkSize`` of ``MultiTensorApply.cuh``: the elements of one chunk of a foreach
    kernel, the unit of ``_foreach_norm``'s partial results."""
    value = header_constant("ATen/native/cuda/MultiTensorApply.cuh", "kChunkSize")
    assert value == temporaries.KCHUNK_SIZE == 65536
