"""Temporaries of ATen's CUDA kernels on the fake cuda device: global-reduce buffers of
gpu_reduce_kernel, reduction input casts, _foreach_norm partials, embedding backward
and layer-norm backward buffers. Expected figures are worked out by hand from
Reduce.cuh's setReduceConfig (torch 2.13 headers) and the kernels' sources."""

from __future__ import annotations

import re
from typing import Any

import pytest

import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cuda import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.engine.tracing.devices.cuda import cub_storage, reduce_launch, temporaries
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    OpCall,
    TraceContext,
)

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from torch_sources import (
    cuda_library,
    disassembly,
    has_function,
    header_constant,
    header_text,
    immediates,
    instructions,
    library,
    wheel_requirement,
)

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


#: The releases the embedding backward differs between: 2.10 (CCCL 2.7, all 64 key bits, no
#: fused path), 2.11 and 2.12 (CCCL 3.0, 64 bits, fused path), 2.13 and 2.14 (CCCL 3.0, the
#: bits of num_weights), 2.15 (CCCL 3.2, as 2.13).
RELEASES = [(2, 10), (2, 11), (2, 12), (2, 13), (2, 14), (2, 15)]


@pytest.fixture
def release(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """The embedding rule and cub's storage as they follow torch ``request.param``."""
    monkeypatch.setattr(temporaries, "torch_minor", lambda: request.param)
    monkeypatch.setattr(cub_storage, "torch_minor", lambda: request.param)
    return request.param


def embedding_allocs(
    n: int, num_weights: int, dim: int, *, dtype: torch.dtype = torch.float32,
    index: torch.dtype = torch.long, padding_idx: int = -1, scale: bool = False, gpu: str = "H100",
) -> list[tuple[str, int]]:
    steps = run_rule(
        aten.embedding_dense_backward.default,
        (meta(n, dim, dtype=dtype), meta(n, dtype=index), num_weights, padding_idx, scale),
        meta(num_weights, dim, dtype=dtype),
        gpu=gpu,
    )
    assert not any(isinstance(s, Inexact) for s in steps)  # no value decides a size
    return [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)]


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_embedding_backward_sorted_path(release: tuple[int, int]) -> None:
    """4096 int64 indices into 1000 rows of 16 floats on an H100 (132 SMs).

    Embedding.cu, embedding_dense_backward_cuda: sorted_indices, orig_indices and
    range, 4096 x 8 = 32768 bytes each; cub::DeviceRadixSort::SortPairs
    (dispatch_radix_sort.cuh, InvokeOnesweep; Policy900's OnesweepPolicyKey64
    <384, 24> and SingleTilePolicy <256, 19> under RegBoundScaling for 8-byte items:
    12 items -> tile 384 x 12 = 4608, single tile 256 x 9 = 2304 < 4096): one tile;
    2.13 on sort get_num_bits(1000) = 10 bits, 2 passes of 8 bits, before 2.13 all
    64 bits, 8 passes. Parts, each rounded to 256 (AliasTemporaries), plus 255:
    bins passes x 256 x 8 (OffsetT unsigned long long), look-back 1 x 256 x 4,
    alternate keys and values 32768 each, counters passes x 4.

    EmbeddingBackwardKernel.cu, embedding_backward_cuda_kernel: segment_offsets 32768,
    the int64 segment count (8), unique_by_key's keys (32768) and its temp storage
    (DeviceSelect::UniqueByKey, tile 448 x 11 = 4928: one tile; ScanTileState of
    8-byte offsets, (1 + 32) x 16 = 528 bytes of descriptors -> 768; CCCL 3 wraps
    them in its own AliasTemporaries, 768 + 255 = 1023 -> 1024, before the
    dispatch's 255), partials_per_segment and its offsets over max_segments =
    min(4096, 1000) = 1000 (8000 bytes each), the exclusive sum's temp storage
    (DeviceScan, ceil(1000 / 896) = 2 tiles: (2 + 32) x 16 = 544 -> 768, wrapped
    likewise in CCCL 3), the partial count (8), partial_segment_offset over
    4096 // 10 + 1000 = 1409 (11272 bytes), and, two-pass (the sum-and-scatter grid,
    1000 x 32 / 32 = 1000 blocks, is not below 132 x 4 = 528),
    grad_weight_per_segment 1409 x 16 x 4 = 90176."""
    passes = 2 if release >= (2, 13) else 8
    sort = (passes * 256 * 8) + 1024 + 32768 + 32768 + 256 + 255
    cccl3 = release >= (2, 11)
    tile_state = (768 + 255 + 1) if cccl3 else 768  # 768 + 255 rounded to 256 again
    assert embedding_allocs(4096, 1000, 16) == [
        ("sorted_indices", 32768),
        ("orig_indices", 32768),
        ("range", 32768),
        ("sort:temp", sort),
        ("segment_offsets", 32768),
        ("num_of_segments", 8),
        ("unique_by_key:keys", 32768),
        ("unique_by_key:temp", tile_state + 255),
        ("partials_per_segment", 8000),
        ("partials_per_segment_offset", 8000),
        ("exclusive_sum:temp", tile_state + 255),
        ("num_of_partial_segments", 8),
        ("partial_segment_offset", 1409 * 8),
        ("grad_weight_per_segment", 1409 * 16 * 4),
    ]
    assert sort == (71167 if release >= (2, 13) else 83455)


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_embedding_backward_fused_path_of_a_small_vocabulary(release: tuple[int, int]) -> None:
    """4096 int64 indices into 100 rows of 16 bfloat16 values (a position or type
    embedding): max_segments = 100, 4096 // 10 + 100 = 509 partial segments;
    the sum-and-scatter grid is 100 x 32 / 32 = 100 blocks, below 132 x 4 = 528, and
    509 > 4 x 100: from 2.11 the fused atomic kernel runs (EmbeddingBackwardKernel.cu,
    use_fused_kernel): partial_to_segment_idx (509 x 8) and, for bfloat16, the float
    accumulator zeros({100, 16}) (6400 bytes) instead of grad_weight_per_segment
    (509 x 16 x 4 = 32576). The sort covers get_num_bits(100) = 7 bits from 2.13: one
    pass, no alternate buffers (bins 2048, look-back 1024, counters 4 -> 256)."""
    allocs = embedding_allocs(4096, 100, 16, dtype=torch.bfloat16)
    tail = allocs[-2:] if release >= (2, 11) else allocs[-1:]
    if release >= (2, 11):
        assert tail == [("partial_to_segment_idx", 509 * 8), ("grad_weight_acc", 100 * 16 * 4)]
    else:
        assert tail == [("grad_weight_per_segment", 509 * 16 * 4)]
    sort = dict(allocs)["sort:temp"]
    assert sort == (2048 + 1024 + 256 + 255 if release >= (2, 13) else 16384 + 1024 + 2 * 32768 + 256 + 255)


def test_embedding_backward_fused_path_yields_to_determinism() -> None:
    """torch.use_deterministic_algorithms(True): the two-pass kernels, atomics avoided."""
    torch.use_deterministic_algorithms(True)
    try:
        allocs = embedding_allocs(4096, 100, 16, dtype=torch.bfloat16)
    finally:
        torch.use_deterministic_algorithms(False)
    assert allocs[-1] == ("grad_weight_per_segment", 509 * 16 * 4)


@pytest.mark.parametrize("release", [(2, 10), (2, 13)], indirect=True)
def test_embedding_backward_scale_grad_by_freq(release: tuple[int, int]) -> None:
    """scale_grad_by_freq with 2048 int32 indices into 300 rows of 8 floats: the sorted
    path at any count. The sort fits one tile (SingleTilePolicy <256, 19>, 4-byte items:
    256 x 19 = 4864): cub asks 1 byte. Then count (2048 x 4) and two scans by key
    (DeviceScan::InclusiveSumByKey / InclusiveScanByKey: ReduceByKeyScanTileState of a
    4-byte key and value, one 16-byte word, ceil(2048 / 896) = 3 tiles: (3 + 32) x 16 =
    560 -> 768, and a key per tile plus one, 4 x 4 = 16 -> 256; plus 255)."""
    allocs = embedding_allocs(2048, 300, 8, index=torch.int32, scale=True)
    assert allocs[:8] == [
        ("sorted_indices", 8192),
        ("orig_indices", 8192),
        ("range", 8192),
        ("sort:temp", 1),
        ("count", 8192),
        ("sum_by_key:temp", 768 + 256 + 255),
        ("max_by_key:temp", 768 + 256 + 255),
        ("segment_offsets", 8192),
    ]


@pytest.mark.parametrize("release", [(2, 13)], indirect=True)
def test_embedding_backward_padding_idx_sorts_the_same_bits(release: tuple[int, int]) -> None:
    """padding_idx only skips a row in sum_and_scatter; the sort's bits are
    get_num_bits(num_weights) for padding_idx >= 0 and get_num_bits(num_weights - 1 -
    padding_idx) below: 1000 -> 10 bits either way for padding_idx 0 and -1."""
    assert embedding_allocs(4096, 1000, 16, padding_idx=0) == embedding_allocs(4096, 1000, 16)


@pytest.mark.parametrize("release", [(2, 13)], indirect=True)
def test_embedding_backward_on_an_a100(release: tuple[int, int]) -> None:
    """On an A100 (sm80, 108 SMs) Policy800's onesweep policy <384, 21> for 8-byte keys:
    10 items, tile 3840 -> 2 tiles of 4096 (look-back 2 x 1024); UniqueByKey's sm80 tile
    192 x 7 = 1344 -> 4 tiles: (4 + 32) x 16 = 576 -> 768 (the same bytes)."""
    allocs = dict(embedding_allocs(4096, 1000, 16, gpu="A100"))
    assert allocs["sort:temp"] == 4096 + 2048 + 32768 + 32768 + 256 + 255
    assert allocs["unique_by_key:temp"] == 1024 + 255


def test_embedding_estimate_with_token_ids_is_complete() -> None:
    """An embedding trained on real token ids reports complete on cuda: the backward's
    buffers do not depend on the ids, so repeated ids, distinct ids and ids the trace
    cannot know (meta) give one figure."""

    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1000, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.embed(ids).sum()

    reports = [
        tm.estimate(Lookup(), ids, device="cuda")
        for ids in (
            torch.zeros(4096, dtype=torch.long),
            torch.arange(4096) % 1000,
            torch.empty(4096, dtype=torch.long, device="meta"),
        )
    ]
    assert all(report.unsupported == () for report in reports)
    assert len({report.backward_peak for report in reports}) == 1


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


def test_softmax_backward_multiplies_before_it_copies() -> None:
    """softmax(x).sum(): the gradient is a stride-0 expand of (4, 10) floats.
    SoftMax.cu, softmax_backward_cuda_out: tmp = grad * output, 4 x 10 x 4 = 160
    bytes (one 512-byte block), laid out by TensorIterator: the expand's stride-0
    dimensions do not order it (reorder_dimensions skips them), the contiguous
    output does: tmp is contiguous, so host_softmax_backward's grad_.contiguous()
    and output_.contiguous() copy nothing. The forward on a contiguous input copies
    nothing; on a transposed one host_softmax's input_.contiguous() copies 160."""
    grad = meta(1, 1).expand(4, 10)
    steps = run_rule(
        aten._softmax_backward_data.default,
        (grad, meta(4, 10), 1, torch.float32),
        meta(4, 10),
    )
    assert steps == [OUTPUTS, Alloc("tmp", 4 * 10 * 4), Alloc("grad", 0), Alloc("output", 0)]
    assert run_rule(aten._softmax.default, (meta(4, 10), 1, False), meta(4, 10)) == [
        OUTPUTS,
        Alloc("input", 0),
    ]
    transposed = meta(10, 4).t()
    assert run_rule(aten._log_softmax.default, (transposed, 1, False), meta(4, 10)) == [
        OUTPUTS,
        Alloc("input", 160),
    ]


def test_softmax_backward_of_a_transposed_gradient_copies_the_product() -> None:
    """A transposed (4, 10) gradient (strides (1, 4)): grad * output follows the first
    operand's strides (reorder_dimensions: grad decides before output), so tmp (160
    bytes) is transposed too and host_softmax_backward copies it contiguous (160)."""
    steps = run_rule(
        aten._softmax_backward_data.default,
        (meta(10, 4).t(), meta(4, 10), 1, torch.float32),
        meta(4, 10),
    )
    assert steps == [OUTPUTS, Alloc("tmp", 160), Alloc("grad", 160), Alloc("output", 0)]


def test_log_softmax_backward_copies_an_expanded_gradient() -> None:
    """log_softmax_backward_cuda_out calls host_softmax_backward on grad itself (no
    product): a stride-0 expand of (4, 10) floats is copied contiguous, 160 bytes."""
    steps = run_rule(
        aten._log_softmax_backward_data.default,
        (meta(1, 1).expand(4, 10), meta(4, 10), 1, torch.float32),
        meta(4, 10),
    )
    assert steps == [OUTPUTS, Alloc("grad", 160), Alloc("output", 0)]


def test_softmax_backward_half_to_float_multiplies_in_float() -> None:
    """softmax of fp16 into fp32 (half_to_float): the backward gets fp32 grad and
    output and writes an fp16 gradient; tmp is their fp32 product, 8 x 1000 x 4 =
    32000 bytes."""
    steps = run_rule(
        aten._softmax_backward_data.default,
        (meta(8, 1000), meta(8, 1000), 1, torch.float16),
        meta(8, 1000, dtype=torch.float16),
    )
    assert steps == [OUTPUTS, Alloc("tmp", 8 * 1000 * 4), Alloc("grad", 0), Alloc("output", 0)]


#: An RTX 3090 (sm86, 82 SMs), where the short-row figures were published.
RTX3090 = "RTX3090: memory=24GiB cc=8.6 sms=82"


class _Scaled(nn.Module):
    """``(f(x, -1) * 2).sum()``: the gradient reaching f's backward is a new contiguous
    tensor (mul's backward), not an expand."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.f(x, -1) * 2).sum()


@pytest.mark.parametrize("rows", [2048, 4096])
def test_softmax_of_short_rows_estimates_the_product_buffer(rows: int) -> None:
    """(softmax(x, -1) * 2).sum() of rows x 64 floats (short rows: the persistent
    kernel, PersistentSoftmax.cuh, allocates nothing) on an RTX 3090. Backward peak,
    each tensor rows x 64 x 4 = rows x 256 bytes (a multiple of 512, its own block):
    the input x, softmax's saved output, mul's backward gradient (grad * 2), the
    gradient of x (the structured output), and SoftMax.cu's softmax_backward_cuda_out
    tmp = grad * output (contiguous: no further copy); plus two 512-byte blocks, the
    loss and sum's backward ones_like. log_softmax's backward (LogSoftMaxBackwardEpilogue)
    takes no tmp: one tensor less."""
    x = torch.empty(rows, 64, device="meta", requires_grad=True)
    tensor = rows * 64 * 4
    softmax = tm.estimate(_Scaled(torch.softmax), x, device="cuda", gpu=RTX3090)
    log_softmax = tm.estimate(_Scaled(torch.log_softmax), x, device="cuda", gpu=RTX3090)
    assert softmax.backward_peak == 5 * tensor + 2 * 512
    assert log_softmax.backward_peak == 4 * tensor + 2 * 512
    assert softmax.unsupported == log_softmax.unsupported == ()


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


def test_embedding_backward_constants_are_pinned_by_the_installed_header() -> None:
    """``MAX_BLOCK_SIZE`` of ``SortingCommon.cuh`` as CUDA compiles it (1024; 256 is
    ROCm's), the fused path's block width; ``get_num_bits`` of ``cub.h`` as
    :func:`temporaries._num_bits` follows it."""
    text = header_text("ATen/native/cuda/SortingCommon.cuh")  # #if defined(USE_ROCM) 256 #else 1024
    assert _values(r"#else\s*constexpr int MAX_BLOCK_SIZE = (\d+);", text) == {temporaries._MAX_BLOCK_SIZE} == {1024}
    cub_h = header_text("ATen/cuda/cub.h")
    assert re.search(
        r"int get_num_bits\(uint64_t max_key\) \{\s*int num_bits = 1;\s*while \(max_key > 1\) \{\s*"
        r"max_key >>= 1;\s*num_bits\+\+;",
        cub_h,
    )
    assert [temporaries._num_bits(k) for k in (1, 2, 100, 256, 1000, 32000)] == [1, 2, 7, 9, 10, 15]


#: The CUDA toolkit a wheel pins (``cuda-toolkit[...]`` from 2.11, ``nvidia-cuda-runtime-cu12``
#: in 2.10) and the CCCL that toolkit ships (``nvidia-cuda-cccl`` 12.8.90: CUB 2.7.0; 13.0.85:
#: 3.0.1; 13.2.86: 3.2.0).
CUB_OF_TOOLKIT = {(12, 8): 200700, (13, 0): 300001, (13, 2): 300200}


def test_cub_version_is_pinned_by_the_installed_wheel() -> None:
    """The CUDA toolkit the installed CUDA wheel pins gives the CCCL modelled for its
    release, and its radix sort kernels carry that CCCL's policy names (CCCL 2's
    ``DeviceRadixSortPolicy<...>::Policy900``, CCCL 3's ``policy_hub<...>::Policy1000``)."""
    path = cuda_library("libtorch_cuda.so")
    pinned = wheel_requirement(r"cuda-toolkit\[[^\]]*\]|nvidia-cuda-runtime-cu12")
    assert pinned is not None
    major, minor = (int(part) for part in pinned.split(".")[:2])
    assert CUB_OF_TOOLKIT[(major, minor)] == cub_storage.cub_version()
    onesweep = r"DeviceRadixSortOnesweepKernel.*Policy1000" if cub_storage.cub_version() >= 300000 else (
        r"DeviceRadixSortOnesweepKernel.*DeviceRadixSortPolicy.*Policy900"
    )
    assert has_function(path, onesweep)


def test_softmax_backward_product_is_pinned_by_the_installed_library() -> None:
    """``softmax_backward_cuda_out`` calls ``at::mul`` (``tmp = grad * output``) before
    ``host_softmax_backward``; ``log_softmax_backward_cuda_out`` does not (2.10, 2.11
    and 2.15 read: the same)."""
    path = cuda_library("libtorch_cuda.so")
    softmax = disassembly(path, r"^_ZN2at6native36structured_softmax_backward_cuda_out4impl")
    log_softmax = disassembly(path, r"^_ZN2at6native40structured_log_softmax_backward_cuda_out4impl")
    assert "mul_Tensor4call" in softmax
    assert "mul_Tensor" not in log_softmax


def test_embedding_backward_paths_are_pinned_by_the_installed_library() -> None:
    """The fused atomic kernel exists from 2.11 (``compute_grad_weight_atomic_accumulate``);
    the sort passes ``end_bit = 64`` (``push $0x40``) before 2.13 and ``get_num_bits``'s
    count from 2.13."""
    path = cuda_library("libtorch_cuda.so")
    fused = has_function(path, r"compute_grad_weight_atomic_accumulate")
    assert fused == (torch_minor() >= temporaries.EMBEDDING_FUSED_FROM)
    code = instructions(disassembly(path, r"^_ZN2at6native29embedding_dense_backward_cudaERKNS_6TensorES3_llb$"))
    assert ("push $0x40" in code) == (torch_minor() < temporaries.EMBEDDING_NBITS_FROM)


# -- sort --------------------------------------------------------------------------------------


def sort_allocs(*shape: int, dtype: torch.dtype = torch.float32, gpu: str = "H100") -> list[tuple[str, int]]:
    x = meta(*shape, dtype=dtype)
    steps = run_rule(aten.sort.default, (x, -1, True), (meta(*shape, dtype=dtype), meta(*shape, dtype=torch.long)), gpu=gpu)
    assert not any(isinstance(s, Inexact) for s in steps)
    return [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)]


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_sort_of_short_slices_writes_an_arange(release: tuple[int, int]) -> None:
    """4 x 100 floats: Sort.h, should_use_small_sort (nsort <= 4096): Sort.cpp's
    fillSliceWithIndex copies at::arange(100) (int64, 800 bytes) into the indices,
    and sortKeyValueInplace sorts in place (its kernels take nothing). The same at
    4096, the threshold."""
    assert sort_allocs(4, 100) == [("sort:arange", 100 * 8)]
    assert sort_allocs(2, 4096) == [("sort:arange", 4096 * 8)]


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_sort_of_many_long_slices_is_cub_segmented(release: tuple[int, int]) -> None:
    """256 x 8192 floats (a sparsemax over a vocabulary of 8192): 256 slices, not below
    128: SortStable.cu, segmented_sort_pairs: reverse indices n x 8 = 2,097,152 x 8,
    then cub::DeviceSegmentedRadixSort::SortPairs (dispatch_segmented_radix_sort.cuh,
    the same in CCCL 2.7, 3.0 and 3.2): its alternate keys n x 4 and values n x 8,
    each rounded to 256 (already multiples), plus 255."""
    n = 256 * 8192
    assert sort_allocs(256, 8192) == [("sort:reverse_indices", n * 8), ("sort:temp", n * 4 + n * 8 + 255)]


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_sort_of_a_few_long_slices_sorts_them_all_at_once(release: tuple[int, int]) -> None:
    """16 x 8192 floats on an H100: fewer than 128 slices: segmented_sort_pairs_by_full_sort.
    Two int2 buffers of n = 131072 (1,048,576 bytes each); radix_sort_pairs<float, int2>
    with keys_out null, so cub-RadixSortPairs.cuh allocates the keys out (n x 4), and
    SortPairs (Policy900's OnesweepPolicyKey32 for 8-byte values and OffsetT of 8 bytes:
    <384, 29>, RegBoundScaling for 8-byte items: 14 items, tile 5376, 25 tiles): bins
    4 passes x 256 x 8 = 8192, look-back 25 x 1024 = 25600, alternate keys 524288 and
    values 1048576, counters 16 -> 256, plus 255. Then radix_sort_keys<int64_t> over
    ceil(log2(16)) = 4 bits (one pass, no alternate keys): OnesweepPolicyKey64 for
    keys only <384, 30> -> 15 items, tile 5760, 23 tiles: bins 2048, look-back 23 x
    1024 = 23552, counters 4 -> 256, plus 255 (the keys-only tile is read from
    tuning_radix_sort.cuh of CCCL 3.2; an assumption for 2.7 and 3.0, where it only
    matters past one tile)."""
    n = 16 * 8192
    assert sort_allocs(16, 8192) == [
        ("sort:indices_and_segment", n * 8),
        ("sort:indices_and_segment2", n * 8),
        ("sort:keys_out", n * 4),
        ("sort:temp", 8192 + 25600 + n * 4 + n * 8 + 256 + 255),
        ("sort:segment_temp", 2048 + 23552 + 256 + 255),
    ]


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_sort_of_one_long_slice_is_one_radix_sort(release: tuple[int, int]) -> None:
    """One row of 8192 floats: segmented_sort_large_segments: the reverse indices (a
    DeviceArray of 8192 int64) and one SortPairs<float, int64_t> of 8192 items: tile
    5376 (as above), 2 tiles: bins 8192, look-back 2048, alternate keys 32768 and
    values 65536, counters 256, plus 255."""
    assert sort_allocs(1, 8192) == [
        ("sort:reverse_indices", 8192 * 8),
        ("sort:temp", 8192 + 2048 + 32768 + 65536 + 256 + 255),
    ]


def test_sort_of_half_keys_beyond_the_small_sort_is_flagged() -> None:
    """cub tunes 2-byte keys apart (sm90_small_key_tuning): not modelled, listed."""
    steps = run_rule(aten.sort.default, (meta(16, 8192, dtype=torch.float16), -1, False), None)
    assert any(isinstance(s, Inexact) for s in steps)
    # the segmented path's storage does not depend on the tuning
    steps = run_rule(aten.sort.default, (meta(256, 8192, dtype=torch.float16), -1, False), None)
    assert not any(isinstance(s, Inexact) for s in steps)


def test_sort_estimate_of_a_vocabulary_counts_cubs_buffers() -> None:
    """torch.sort(x, -1, descending=True) of 256 x 8192 floats on an RTX 3090, forward
    only: x and the values (8 MiB each), the int64 indices (16 MiB), then the reverse
    indices (16 MiB) and cub's segmented storage (25,166,079 bytes: a 25,166,336-byte
    block, 512-byte rounding) live together at the peak."""

    class Sort(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sort(x, -1, descending=True)[0]

    report = tm.estimate(Sort(), torch.empty(256, 8192, device="meta"), device="cuda", gpu=RTX3090, train=False)
    mib = 1 << 20
    assert report.forward_peak == 8 * mib + 8 * mib + 16 * mib + 16 * mib + 25166336
    assert report.unsupported == ()


# -- topk --------------------------------------------------------------------------------------


def topk_allocs(
    shape: tuple[int, ...], k: int, *, dtype: torch.dtype = torch.float32, gpu: str = "H100",
    sorted_: bool = True, x: torch.Tensor | None = None,
) -> list[tuple[str, int]]:
    x = meta(*shape, dtype=dtype) if x is None else x
    out = (meta(*shape[:-1], k, dtype=dtype), meta(*shape[:-1], k, dtype=torch.long))
    steps = run_rule(aten.topk.default, (x, k, -1, True, sorted_), out, gpu=gpu)
    assert steps[0] is OUTPUTS  # the structured outputs come first
    assert not any(isinstance(s, Inexact) for s in steps)
    allocs = [s.tag for s in steps if isinstance(s, Alloc)]
    assert sorted(allocs) == sorted(s.tag for s in steps if isinstance(s, Free))  # all freed on return
    return [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)]


#: scan_by_key of up to 16 scan tiles of 4-byte keys and values (cub's DeviceScanByKey,
#: ReduceByKeyScanTileState<uint32_t, int>: a 16-byte word): (tiles + 32) x 16 <= 768,
#: keys (tiles + 1) x 4 <= 256, aliased: 768 + 256 + 255.
TOPK_SCAN = 768 + 256 + 255


def topk_buffers(slices: int, blocks: int, t: int = 4, radix: int = 4) -> list[tuple[str, int]]:
    return [
        ("topk:kthValues", slices * t),
        ("topk:ks_to_find", 2 * slices * 4),
        ("topk:desired", 2 * slices * radix),
        ("topk:counts", blocks * 256 * 2),
        ("topk:digit_cum_sum", slices * 256 * 4),
        ("topk:withinKCounts", blocks * 4),
        ("topk:kthCounts", blocks * 4),
        ("topk:sum_by_key:temp", TOPK_SCAN),
        ("topk:sum_by_key:temp", TOPK_SCAN),
    ]


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_topk_of_one_long_row_is_the_multiblock_radix_select(release: tuple[int, int]) -> None:
    """topk(k=10) of one row of 1,000,000 floats on an H100 (132 SMs). TensorTopK.cu,
    should_use_multiblock: 1 slice (<= 20) of >= 20,000: mbtopk::launch.
    get_items_per_thread: 65536 registers / (40 x 256) = 6 blocks an SM, ceil(1e6 /
    (132 x 6 x 256 = 202,752)) = 5 items a thread (within 4..64); blocks_per_slice =
    ceil(1e6 / (5 x 256)) = 782. Its buffers: kthValues 1 x 4, ks_to_find 2 x 1 x 4,
    desired 2 x 1 x 4 (uint32 RadixType), counts 782 x 256 shorts = 400,384,
    digit_cum_sum 1 x 256 x 4, withinKCounts and kthCounts 782 x 4 = 3,128 each, and
    two InclusiveSumByKey over 782 blocks (one scan tile). k = 10 <= 4096: the sort
    is sortKeyValueInplace's, in place. The same code in every wheel 2.10-2.15."""
    assert topk_allocs((1, 1_000_000), 10) == topk_buffers(1, 782)
    assert topk_buffers(1, 782)[3] == ("topk:counts", 400_384)


def test_topk_blocks_follow_the_sm_count() -> None:
    """The same row on an A100 (108 SMs): ceil(1e6 / (108 x 6 x 256 = 165,888)) = 7
    items, ceil(1e6 / 1792) = 559 blocks: counts 559 x 512 = 286,208."""
    assert topk_allocs((1, 1_000_000), 10, gpu="A100") == topk_buffers(1, 559)


def test_topk_of_int64_and_half_rows() -> None:
    """4 rows of 50,000 (4 slices, >= 20,000): int64 keys have a uint64 RadixType and
    8-byte kthValues; half keeps uint32 and 2-byte kthValues. ceil(200,000 / 202,752) = 1
    item -> clamped to 4, ceil(50,000 / 1024) = 49 blocks a slice, 196 in all."""
    assert topk_allocs((4, 50_000), 8, dtype=torch.long) == topk_buffers(4, 196, t=8, radix=8)
    assert topk_allocs((4, 50_000), 8, dtype=torch.half) == topk_buffers(4, 196, t=2, radix=4)


def test_topk_of_short_rows_is_one_block_a_slice() -> None:
    """32 x 100 and 4 x 5,000 (4 slices need >= 20,000; 4001 slices need >= 400):
    sbtopk's single-block kernel, which takes nothing."""
    assert topk_allocs((32, 100), 8) == []
    assert topk_allocs((4, 5_000), 8) == []
    assert temporaries.topk_multiblock(4001, 400) and not temporaries.topk_multiblock(4000, 799)


def test_topk_of_a_transposed_input_copies_it_first() -> None:
    """launch_gather_topk_kernel runs on self.contiguous(): 100 x 64 floats seen
    transposed (25,600 bytes), held while the (single-block) kernel runs."""
    x = meta(100, 64).t()
    assert topk_allocs((64, 100), 8, x=x) == [("topk:input", 25_600)]


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_topk_of_more_than_4096_sorts_the_values_and_gathers(release: tuple[int, int]) -> None:
    """topk(k=5000) of 2 x 100,000 floats on an H100: multi-block (2 slices of >=
    20,000): 1 item -> 4, ceil(100,000 / 1024) = 98 blocks a slice, 196 in all. Then
    sorted with k > 4096 (TensorTopK.cpp): sortedIndices (2 x 5000 x 8) and sortedValues
    (2 x 5000 x 4), at::cuda::sort_outf of the values: 2 slices of 5000 (< 128 slices),
    segmented_sort_pairs_by_full_sort of n = 10,000: two int2 buffers 80,000 each, the
    keys out 40,000, SortPairs<float, int2> (tile 5376 as for sort, 2 tiles): bins 4 x
    256 x 8 = 8192, look-back 2 x 1024, alternate keys 40,000 -> 40,192 and values 80,000
    -> 80,128, counters 16 -> 256, plus 255 = 131,071; SortKeys<int64> over 1 bit (tile
    5760, 2 tiles): bins 2048, look-back 2048, counters 256, plus 255 = 4,607. Then
    indices.gather(dim, sortedIndices): 80,000."""
    sort_temp = 8192 + 2048 + 40_192 + 80_128 + 256 + 255
    assert sort_temp == 131_071
    assert topk_allocs((2, 100_000), 5000) == [
        *topk_buffers(2, 196),
        ("topk:sortedIndices", 80_000),
        ("topk:sortedValues", 40_000),
        ("topk:sort:indices_and_segment", 80_000),
        ("topk:sort:indices_and_segment2", 80_000),
        ("topk:sort:keys_out", 40_000),
        ("topk:sort:temp", sort_temp),
        ("topk:sort:segment_temp", 2048 + 2048 + 256 + 255),
        ("topk:gather", 80_000),
    ]
    assert topk_allocs((2, 100_000), 5000, sorted_=False) == topk_buffers(2, 196)


def test_topk_estimate_of_a_long_row_counts_the_radix_select() -> None:
    """torch.topk(x, 10) of one row of 1,000,000 floats on the default H100, forward
    only: x (4,000,000 bytes: a 4,000,256-byte block), the outputs (40 and 80 bytes: a
    512-byte block each), then the multi-block buffers as blocks of 512: kthValues,
    ks_to_find, desired 512 each, counts 400,384, digit_cum_sum 1024, withinKCounts
    and kthCounts 3,584 each, one scan's storage 1,536."""

    class TopK(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.topk(x, 10).values

    report = tm.estimate(TopK(), torch.empty(1, 1_000_000, device="meta"), device="cuda", train=False)
    assert report.forward_peak == 4_000_256 + 2 * 512 + 3 * 512 + 400_384 + 1024 + 2 * 3584 + 1536
    assert report.unsupported == ()


def test_topk_paths_are_pinned_by_the_installed_library() -> None:
    """structured_topk_out_cuda::impl launches the gather kernel, sorts in place up to
    4096 ($0x1000) and otherwise calls at::cuda::sort_outf and gather, never the
    full-sort fallback (at::cuda::sort: should_use_sort is false on CUDA);
    should_use_multiblock's table and get_items_per_thread's 40 x 256 registers
    (a division by 10,240: 0x66666667 >> 44) and clamp (4, 64); mbtopk::launch zeroes
    digit_cum_sum and withinKCounts and scans by key (every wheel 2.10-2.15)."""
    path = cuda_library("libtorch_cuda.so")
    impl = disassembly(path, r"^_ZN2at6native24structured_topk_out_cuda4implE")
    assert "launch_gather_topk_kernel" in impl and "sort_outf" in impl and "gather4call" in impl
    assert "_ZN2at4cuda4sortE" not in impl
    assert 0x1000 in immediates(impl)
    table = immediates(disassembly(path, r"^_ZN2at6native21should_use_multiblockEll$"))
    rows = [*temporaries._TOPK_MULTIBLOCK, (None, temporaries._TOPK_MULTIBLOCK_MANY)]
    assert {shortest - 1 for _, shortest in rows} <= table  # slice_size > shortest - 1
    assert {20, 4000} <= table
    items = disassembly(path, r"^_ZN2at6native6mbtopk20get_items_per_threadEmm$")
    assert {0x66666667, 0x2C, 4, 64} <= immediates(items)
    assert 65536 // 10240 == 65536 // (temporaries._TOPK_REGS_PER_THREAD * temporaries._TOPK_BLOCK_THREADS)
    launch = disassembly(path, r"^_ZN2at6native6mbtopk6launchIfjLi1EEEv")
    assert len(re.findall(r"call.*cudaMemsetAsync", launch)) == 2
    assert "InclusiveSumByKey" in launch


# -- group norm backward -------------------------------------------------------------------------


def test_group_norm_backward_sums_per_channel_and_group() -> None:
    """native_group_norm_backward of (4, 64, 16, 16) floats in 8 groups with a weight:
    group_norm_kernel.cu, GroupNormBackwardKernelImplInternal: ds and db at::empty({N, C})
    of the accumulation type, 4 x 64 x 4 = 1024 bytes each; for dX, c1 (empty({0})
    resized by the rstd * gamma TensorIterator to N x G x D = 4 x 8 x 8 floats = 1024),
    c2 and c3 ({N, G}: 4 x 8 x 4 = 128 each). Without a weight no c1; without dX
    (output_mask [False, True, True]) only ds and db; bfloat16 sums in float."""

    def allocs(dtype: torch.dtype = torch.float32, weight: bool = True, mask: list[bool] | None = None) -> list[tuple[str, int]]:
        x = meta(4, 64, 16, 16, dtype=dtype)
        args = (x, x, meta(4, 8, dtype=dtype), meta(4, 8, dtype=dtype), meta(64, dtype=dtype) if weight else None,
                4, 64, 256, 8, mask or [True, True, True])
        steps = run_rule(aten.native_group_norm_backward.default, args, None)
        return [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)]

    assert allocs() == [("ds", 1024), ("db", 1024), ("c1", 1024), ("c2", 128), ("c3", 128)]
    assert allocs(weight=False) == [("ds", 1024), ("db", 1024), ("c2", 128), ("c3", 128)]
    assert allocs(mask=[False, True, True]) == [("ds", 1024), ("db", 1024)]
    assert allocs(dtype=torch.bfloat16) == [("ds", 1024), ("db", 1024), ("c1", 1024), ("c2", 128), ("c3", 128)]


def test_group_norm_of_one_position_takes_the_1d_kernel() -> None:
    """HxW == 1 (a (32, 64) input, 8 groups): ds and db (32 x 64 x 4 = 8192 each) are
    made, then GroupNorm1dBackward takes its own c2 and c3 ({N, G}: 32 x 8 x 4 = 1024
    each; its two at::empty calls, read in the 2.15 wheel) and no c1."""
    x = meta(32, 64)
    steps = run_rule(
        aten.native_group_norm_backward.default,
        (x, x, meta(32, 8), meta(32, 8), meta(64), 32, 64, 1, 8, [True, True, True]),
        None,
    )
    assert [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)] == [
        ("ds", 8192), ("db", 8192), ("c2", 1024), ("c3", 1024),
    ]


def test_group_norm_estimate_counts_the_backward_buffers() -> None:
    """nn.GroupNorm(8, 64) on (4, 64, 16, 16) floats, the loss the output's sum, on an
    RTX 3090. Backward peak: x, sum's gradient cloned contiguous, dX (262144 bytes
    each); eight 512-byte blocks (weight, bias, the saved mean and rstd, the loss, sum's
    ones, dgamma, dbeta); and the kernel's ds, db, c1 (1024 each) and c2, c3 (128 each,
    a 512-byte block each): 4096 bytes, which the estimate lacked before. The same
    bytes in every release: before 2.14 the autograd formula clones the gradient (a
    traced op), from 2.14 native_group_norm_backward copies it contiguous itself."""
    report = tm.estimate(
        nn.GroupNorm(8, 64), torch.empty(4, 64, 16, 16, device="meta", requires_grad=True), device="cuda", gpu=RTX3090
    )
    assert report.backward_peak == 3 * 262144 + 8 * 512 + (3 * 1024 + 2 * 512)
    assert report.unsupported == ()


@pytest.mark.parametrize("release", [(2, 13), (2, 14), (2, 15)], indirect=True)
def test_group_norm_backward_copies_its_operands_from_2_14(release: tuple[int, int]) -> None:
    """group_norm.cpp, native_group_norm_backward from 2.14: dY.contiguous() of a
    stride-0 expand of (4, 64, 16, 16) floats (262144 bytes) before the outputs; X,
    mean, rstd and gamma already contiguous. Before 2.14 nothing (the autograd
    formula's grad.contiguous() is an op of its own)."""
    x = meta(4, 64, 16, 16)
    dy = meta(1, 1, 1, 1).expand(4, 64, 16, 16)
    steps = run_rule(
        aten.native_group_norm_backward.default,
        (dy, x, meta(4, 8), meta(4, 8), meta(64), 4, 64, 256, 8, [True, True, True]),
        None,
    )
    before = steps[: steps.index(OUTPUTS)]
    assert before == ([Alloc("dY contiguous", 262144)] if release >= (2, 14) else [])


def test_group_norm_backward_copies_are_pinned_by_the_installed_library() -> None:
    """native_group_norm_backward calls contiguous five times (dY, X, mean, rstd, gamma)
    from GROUP_NORM_CONTIGUOUS_FROM, none before (libtorch_cpu.so, in every build)."""
    code = disassembly(
        library("libtorch_cpu.so"), r"^_ZN2at6native26native_group_norm_backwardERKNS_6TensorE.*Lm3EE$"
    )
    calls = len(re.findall(r"call.*__dispatch_contiguous", code))
    assert calls == (5 if torch_minor() >= temporaries.GROUP_NORM_CONTIGUOUS_FROM else 0)
