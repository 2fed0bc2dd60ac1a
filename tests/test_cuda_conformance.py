"""The CUDA model against the facts PyTorch's own GPU tests assert on real GPUs.

PyTorch's CUDA tests assert exact figures of the native caching allocator
(and of the cuBLAS workspace) that CI measures on real GPUs, with and without
``expandable_segments`` (``test/test_cuda_expandable_segments.py`` runs the
classes of ``test_cuda.py`` again under ``expandable_segments:True``). Each
test below replays what such a test does, with the simulator in place of the
GPU, and asserts the same figures. The facts are restated in our own terms,
not copied; the sources are the files of pytorch/pytorch as stored for this
work (``test/test_cuda.py`` of a recent main, the newest stored: classes
``TestCuda``, ``TestCudaMallocAsync`` (the allocator tests, native backend),
``TestMemPool``, ``TestBlockStateAbsorption``; ``test/test_cuda_multigpu.py``;
``test/test_cuda_expandable_segments.py``). Which commit torch 2.13.0 was cut
from cannot be told from the stored files; every fact below holds for the
allocator rules of ``c10/cuda/CUDACachingAllocator.cpp`` the simulator follows.

Graph capture's private pools are not modelled; a capture into a fresh
private pool allocates as a fresh allocator does (its own segments, blocks
reused within the capture), which is how those tests are replayed.

| id | source (file :: test) | what the GPU test asserts | here |
| --- | --- | --- | --- |
| A1 | test_cuda.py :: TestCuda.test_memory_allocation | a 1-byte raw allocation raises memory_allocated; freeing it restores the previous figure exactly | pass |
| A2 | test_cuda.py :: TestCuda.test_memory_stats | a 256-float tensor adds exactly 1024 active bytes; freed and emptied, active is back; reset_peak_memory_stats leaves peaks at the current figures | pass |
| A3 | test_cuda.py :: TestCuda.test_memory_stats_of_multiple_generators_and_graphs | each 8-byte RNG seed/offset holder is one 512-byte block | pass |
| A4 | test_cuda.py :: TestCudaMallocAsync.test_cachingAllocator_raw_alloc | a 1 MiB raw allocation adds exactly 1 MiB to requested_bytes | pass |
| B1 | test_cuda.py :: TestCudaMallocAsync.test_allocator_settings | 21M floats (84 MiB) allocate 84 MiB; after roundup_power2_divisions:4, 96 MiB (requested still 84 MiB); a later settings string without it resets the divisions (84 MiB); [64:8,128:2,256:2,512:2,1024:1,>:1] gives 88 MiB for 84 MiB and 512 MiB for 100M floats (400 MiB); release_lock_on_cudamalloc:True resets them again | pass (simulator gained set_allocator_settings) |
| B2 | test_cuda.py :: TestCudaMallocAsync.test_allocator_settings | "foo:1,bar:2", "garbage_collection_threshold:1.2", "max_split_size_mb:2", "release_lock_on_cudamalloc:none", "pinned_use_cuda_host_register:none", "pinned_num_register_threads:none" and ":1024" are refused (ValueError) | pass |
| B3 | test_cuda.py :: TestCudaMallocAsync.test_allocator_memory_fraction_setting | per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF: 0.0, 0.5, 1.0 read back; -0.1 and 1.1 refused ("per_process_memory_fraction is invalid") | pass |
| C1 | test_cuda.py :: TestCuda.test_out_of_memory | 800000000 GiB fails with "Tried to allocate 800000000.00 GiB"; 8000000000 GiB with "Tried to allocate more than 1EB memory"; a live allocation is undisturbed | pass |
| C2 | test_cuda.py :: TestCuda.test_out_of_memory_retry | int(0.5 x total) bytes succeed, a second such allocation fails, and succeeds once the first is freed | pass |
| C3 | test_cuda.py :: TestCuda.test_set_per_process_memory_fraction | at fraction 0.5, int(0.499 x total) - max_memory_reserved bytes succeed beside a live 1024-float tensor; after empty_cache int(0.5 x total) fails; fractions -0.1 and 2.0 are refused | pass (simulator gained set_memory_fraction) |
| C4 | test_cuda.py :: TestCudaMallocAsync.test_raises_oom | 4 TiB fails with OutOfMemoryError, with and without max_split_size_mb:1024 | pass |
| C5 | test_cuda.py :: TestCudaMallocAsync.test_max_split_expandable | under a 120 MiB cap and max_split_size_mb:40, three 40 MiB blocks (the middle one expandable) fill it and a fourth fails; freed, 120 MiB succeeds (release_cached_blocks with expandable blocks cached) | pass |
| C6 | test_cuda.py :: TestCudaMallocAsync.test_garbage_collect_expandable | under a 120 MiB cap and garbage_collection_threshold:0.5, a 40 MiB block and a 40 MiB expandable block, freed, leave room for 80 MiB (GC with an expandable block cached) | pass |
| D1 | test_cuda.py :: TestCudaMallocAsync.test_memory_snapshot | a 310x410 then a 311x411 float tensor share a small segment, the latter second, its block recording the 511284 requested bytes; 1000 tensors of 128 floats tile into the same segment; freed and emptied, the last trace event is segment_free (segment_unmap with expandable segments) | pass |
| D2 | test_cuda.py :: TestMemPool.test_mempool_with_allocator | 1 MiB allocations pack two to a 2 MiB segment: the third makes a second segment | pass |
| D3 | test_cuda.py :: TestMemPool.test_mempool_no_split | a 4 MiB allocation takes a 20 MiB segment and a second 4 MiB is split from it (one segment, three blocks) | pass |
| D4 | test_cuda.py :: TestMemPool.test_nested_mempool | 20 MiB allocations take a segment each | pass |
| D5 | test_cuda.py :: TestMemPool.test_mempool_ctx_multithread | two 1 MiB int8 tensors share one 2 MiB segment (2 MiB active) | pass |
| D6 | test_cuda.py :: TestBlockStateAbsorption.test_allocate_in_thread_to_pool | a 16-byte tensor, then ten rounds of three live 20 MiB tensors freed at the end of each round: 4 segments (2 with expandable segments) | pass |
| D7 | test_cuda.py :: TestCuda.test_graph_memory_stats_and_use_result_after_destroy_graph | b = a.clone(); 5 x (b = b.clone() + 1) in a fresh pool: segments, reserved and active bytes for 512 B, 1 MiB, 1 MiB + 512 B, 10 MiB - 512 B, 10 MiB + 512 B; after the graph is gone and the cache emptied, the one segment b holds; the expandable figures (no segment counted, 40 MiB for the last two, 40 and 20 MiB after) | pass |
| D8 | test_cuda.py :: TestCuda.test_graph_two_successive | two captures of 4000-byte temporaries reserve one 2 MiB small segment less when they share a pool | pass |
| D9 | test_cuda.py :: TestCuda.test_record_stream, test_record_stream_on_shifted_view | a freed block is handed to the next request of its size on its stream; blocks freed on one stream are not reused by another | pass |
| E1 | test_cuda_multigpu.py :: TestCudaMultiGPU.test_memory_stats (_test_memory_stats_generator, _check_memory_stat_consistency) | along 35 rounds of float tensors allocated and freed: memory_allocated moves up, down or not at all as each step says, returns exactly to its earlier figures, never passes its peak; reset makes peaks current; empty_cache never raises reserved or its peak; the statistics equal the sums over the segments' blocks | pass |
| E2 | test_cuda.py :: TestCudaMallocAsync.test_allocator_fuzz | 10000 random steps (seed 123) of 2-20 MiB int32 allocations, frees and empty_cache: no live allocation overlaps another | pass |
| F1 | test_cuda.py :: TestCuda.test_cublas_workspace_explicit_allocation | the cuBLAS workspace: 4096 KiB x 2 + 16 KiB x 8 by default, 32 MiB on compute capability 9.0, 3072 KiB under CUBLAS_WORKSPACE_CONFIG=:128:8:64:16:32:32, the default again under "-1" | pass |
| F2 | test_cuda.py :: TestCuda.test_matmul_memory_use | matmul of (1, 32, 32) by (24, 32, 1), the same with the first expanded to 24, and bmm of the expanded pair peak at the same allocated bytes | pass |

Not replayed (not modelled): record_stream and its events
(test_caching_allocator_record_stream_oom), out-of-memory observers
(test_notifies_oom), custom and use_on_oom memory pools, cudaMallocAsync, host
(pinned) memory. The memory-viewer export (``--torchmem-timeline``) lists
block sizes where a real trace lists requested bytes
(test_cpp_memory_snapshot_pickle asserts 311 x 411 x 4 for the last alloc);
that is a documented choice of ``memory_viz.py``, whose blocks keep the
requested bytes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cuda.allocator import (
    AllocatorConfig,
    Block,
    CachingAllocator,
    OutOfMemoryError,
)
from pytest_torchmem.engine.tracing.devices.cuda.profiles import PROFILES
from pytest_torchmem.engine.tracing.devices.cuda.workspaces import cublas_workspace_size

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
F32 = 4
#: The device the capacity facts are replayed on: an 80 GiB GPU whose CUDA context
#: and other processes hold 600 MiB (cudaMalloc never gets those).
TOTAL = 80 * GiB
CAPACITY = TOTAL - 600 * MiB

EXPANDABLE = [pytest.param(False, id="segments"), pytest.param(True, id="expandable")]


def make(expandable: bool = False, capacity: int | None = None, text: str = "") -> CachingAllocator:
    if expandable:
        text = ",".join(filter(None, (text, "expandable_segments:True")))
    return CachingAllocator(AllocatorConfig.parse(text), capacity=capacity)


def live_blocks(alloc: CachingAllocator) -> Iterator[Block]:
    for segment in alloc.segments:
        yield from (block for block in segment.blocks() if block.allocated)


# -- A: statistics ----------------------------------------------------------------------


def test_a1_a_one_byte_allocation_and_its_free() -> None:
    alloc = CachingAllocator()
    before = alloc.allocated
    block = alloc.malloc(1)
    assert alloc.allocated > before
    alloc.free(block)
    assert alloc.allocated == before


@pytest.mark.parametrize("expandable", EXPANDABLE)
def test_a2_active_bytes_of_a_256_float_tensor(expandable: bool) -> None:
    alloc = make(expandable)
    alloc.malloc(100)  # something already live
    alloc.reset_peaks()
    peaks = (alloc.peak_allocated, alloc.peak_reserved)
    active = alloc.active
    block = alloc.malloc(256 * F32)
    assert alloc.active == active + 1024
    alloc.free(block)
    alloc.empty_cache()
    assert alloc.active == active
    alloc.reset_peaks()
    assert (alloc.peak_allocated, alloc.peak_reserved) == peaks


def test_a3_an_rng_state_holder_is_a_512_byte_block() -> None:
    alloc = CachingAllocator()
    seed, offset = alloc.malloc(8), alloc.malloc(8)
    assert seed is not None and offset is not None
    assert (seed.size, offset.size, alloc.allocated) == (512, 512, 1024)


def test_a4_requested_bytes_are_the_request() -> None:
    alloc = CachingAllocator()
    alloc.malloc(1 * MiB)
    assert alloc.requested == 1 * MiB


# -- B: settings --------------------------------------------------------------------------


def test_b1_rounding_settings_changed_mid_run() -> None:
    """The sequence of test_allocator_settings, tensors kept alive as there; each
    figure is the growth of allocated bytes over one ``torch.rand``."""
    nbytes, nbytes_big = 21 * MiB * F32, 100 * MiB * F32
    alloc = CachingAllocator()

    def grows(nbytes: int) -> int:
        before = alloc.allocated
        alloc.malloc(nbytes)
        return alloc.allocated - before

    alloc.set_allocator_settings("")
    assert grows(nbytes) == nbytes
    alloc.set_allocator_settings("roundup_power2_divisions:4")
    requested = alloc.requested
    assert grows(nbytes) == 96 * MiB  # quarters of [64, 128) MiB
    assert alloc.requested - requested == nbytes
    alloc.set_allocator_settings("garbage_collection_threshold:0.5")
    alloc.set_allocator_settings("garbage_collection_threshold:0.5,max_split_size_mb:40")
    alloc.empty_cache()
    assert grows(nbytes) == nbytes  # the divisions are reset
    alloc.empty_cache()
    alloc.set_allocator_settings(
        "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"
    )
    w = alloc.malloc(nbytes)
    assert w is not None and w.size == 88 * MiB  # eighths of [64, 128) MiB
    alloc.empty_cache()
    assert grows(nbytes_big) == 512 * MiB  # halves of [256, 512) MiB
    alloc.empty_cache()
    alloc.set_allocator_settings("release_lock_on_cudamalloc:True")
    assert grows(nbytes) == nbytes
    alloc.free(w)  # ``w = torch.rand(...)`` drops the old w after the new one is made


@pytest.mark.parametrize(
    "text",
    [
        "foo:1,bar:2",
        "garbage_collection_threshold:1.2",
        "max_split_size_mb:2",
        "release_lock_on_cudamalloc:none",
        "pinned_use_cuda_host_register:none",
        "pinned_num_register_threads:none",
        "pinned_num_register_threads:1024",
    ],
)
def test_b2_bad_settings_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        CachingAllocator().set_allocator_settings(text)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_b3_memory_fraction_setting_read_back(fraction: float) -> None:
    config = AllocatorConfig.parse(f"per_process_memory_fraction:{fraction}")
    assert config.per_process_memory_fraction == fraction


@pytest.mark.parametrize("fraction", ["-0.1", "1.1"])
def test_b3_memory_fraction_setting_out_of_range(fraction: str) -> None:
    with pytest.raises(ValueError, match="per_process_memory_fraction is invalid"):
        AllocatorConfig.parse(f"per_process_memory_fraction:{fraction}")


# -- C: capacity, caps, out of memory ----------------------------------------------------


@pytest.mark.parametrize("expandable", EXPANDABLE)
def test_c1_out_of_memory_messages(expandable: bool) -> None:
    alloc = make(expandable, CAPACITY)
    tensor = alloc.malloc(1024 * F32)
    with pytest.raises(OutOfMemoryError, match=r"Tried to allocate 800000000\.00 GiB"):
        alloc.malloc(800000000 * GiB)
    with pytest.raises(OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
        alloc.malloc(8000000000 * GiB)
    assert tensor is not None and tensor.allocated and alloc.allocated == 4096
    assert alloc.malloc(4096) is not None


@pytest.mark.parametrize("expandable", EXPANDABLE)
def test_c2_half_the_memory_twice(expandable: bool) -> None:
    alloc = make(expandable, CAPACITY)
    size = int(TOTAL * 0.5)
    a = alloc.malloc(size)
    with pytest.raises(OutOfMemoryError, match="Tried to allocate"):
        alloc.malloc(size)
    alloc.free(a)
    assert alloc.malloc(size) is not None


@pytest.mark.parametrize("expandable", EXPANDABLE)
def test_c3_per_process_memory_fraction(expandable: bool) -> None:
    alloc = make(expandable, TOTAL)
    with pytest.raises(ValueError, match="Invalid fraction value"):
        alloc.set_memory_fraction(-0.1)
    with pytest.raises(ValueError, match="Invalid fraction value"):
        alloc.set_memory_fraction(2.0)
    tensor = alloc.malloc(1024 * F32)
    alloc.empty_cache()
    alloc.set_memory_fraction(0.5)
    tmp = alloc.malloc(int(TOTAL * 0.499) - alloc.peak_reserved)
    alloc.free(tmp)
    alloc.empty_cache()
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        alloc.malloc(int(TOTAL * 0.5))
    assert tensor is not None and tensor.allocated


@pytest.mark.parametrize("max_split", ["", "max_split_size_mb:1024"])
def test_c4_four_tebibytes_raise(max_split: str) -> None:
    alloc = make(capacity=CAPACITY, text=max_split)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(1024 * GiB * F32)


def _capped(mib: int) -> CachingAllocator:
    """An allocator with ``mib`` MiB allowed, set as the tests set it: a fraction of
    the device's total memory (exact here: 120 MiB / 80 GiB = 3/2048)."""
    alloc = CachingAllocator(capacity=TOTAL)
    fraction = mib * MiB / TOTAL
    assert int(fraction * TOTAL) == mib * MiB
    alloc.set_memory_fraction(fraction)
    return alloc


def test_c5_max_split_size_with_expandable_blocks_cached() -> None:
    alloc = _capped(120)
    alloc.set_allocator_settings("expandable_segments:False,max_split_size_mb:40")
    a = alloc.malloc(40 * MiB)
    alloc.set_allocator_settings("expandable_segments:True,max_split_size_mb:40")
    b = alloc.malloc(40 * MiB)
    alloc.set_allocator_settings("expandable_segments:False,max_split_size_mb:40")
    c = alloc.malloc(40 * MiB)
    assert b is not None and b.segment.expandable
    assert a is not None and c is not None and not (a.segment.expandable or c.segment.expandable)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(40 * MiB)
    for block in (a, b, c):
        alloc.free(block)
    assert alloc.malloc(120 * MiB) is not None


def test_c6_garbage_collection_with_an_expandable_block_cached() -> None:
    alloc = _capped(120)
    alloc.set_allocator_settings("expandable_segments:False,garbage_collection_threshold:0.5")
    a = alloc.malloc(40 * MiB)
    alloc.set_allocator_settings("expandable_segments:True,garbage_collection_threshold:0.5")
    b = alloc.malloc(40 * MiB)
    alloc.free(a)
    alloc.free(b)
    assert alloc.malloc(80 * MiB) is not None


# -- D: segments and blocks -----------------------------------------------------------------


@pytest.mark.parametrize("expandable", EXPANDABLE)
def test_d1_memory_snapshot_blocks(expandable: bool) -> None:
    alloc = make(expandable)
    events: list[str] = []
    alloc.observer = lambda action, *_: events.append(action)
    alloc.free(alloc.malloc(2 * 311 * 411 * F32))  # a temporary: the segment is made
    unused = alloc.malloc(310 * 410 * F32)
    x = alloc.malloc(311 * 411 * F32)
    assert unused is not None and x is not None and x.segment is unused.segment
    blocks = [b for b in x.segment.blocks() if b.mapped]
    assert blocks.index(x) == 1 and x.requested == 311 * 411 * F32
    tensors = [alloc.malloc(128 * F32) for _ in range(1000)]
    assert {id(t.segment) for t in tensors if t is not None} == {id(x.segment)}
    rng = random.Random(0)
    while tensors:
        alloc.free(tensors.pop(rng.randrange(len(tensors))))
    alloc.free(alloc.malloc(128 * 5 * F32))
    alloc.free(unused)
    alloc.free(x)
    alloc.empty_cache()
    assert events[-1] == ("segment_unmap" if expandable else "segment_free")


def test_d2_one_mebibyte_allocations_pack_two_to_a_segment() -> None:
    alloc = CachingAllocator()
    a, b = alloc.malloc(1 * MiB), alloc.malloc(1 * MiB)
    assert len(alloc.segments) == 1
    c = alloc.malloc(1 * MiB)
    assert len(alloc.segments) == 2 and a is not None and b is not None and c is not None


def test_d3_a_second_four_mebibytes_is_split_from_the_first_segment() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(4 * MiB)
    assert a is not None and a.segment.size == 20 * MiB
    b = alloc.malloc(4 * MiB)
    assert b is not None and b.segment is a.segment
    assert len(alloc.segments) == 1
    assert [blk.size for blk in a.segment.blocks()] == [4 * MiB, 4 * MiB, 12 * MiB]


def test_d4_twenty_mebibyte_allocations_take_a_segment_each() -> None:
    alloc = CachingAllocator()
    blocks = [alloc.malloc(20 * MiB) for _ in range(2)]
    assert len(alloc.segments) == 2
    assert all(b is not None and b.size == b.segment.size == 20 * MiB for b in blocks)


def test_d5_two_one_mebibyte_int8_tensors_share_a_segment() -> None:
    alloc = CachingAllocator()
    alloc.malloc(1 * MiB)
    alloc.malloc(1 * MiB)
    (segment,) = alloc.segments
    assert sum(b.size for b in segment.blocks() if b.allocated) == 2 * MiB == segment.size


@pytest.mark.parametrize("expandable", EXPANDABLE)
def test_d6_three_live_large_buffers_reused_round_after_round(expandable: bool) -> None:
    pool = make(expandable)
    pool.free(pool.malloc(4 * F32))  # the capture's torch.rand([4]): freed with its graph output
    for _ in range(10):
        a = pool.malloc(20 * MiB)
        b = pool.malloc(20 * MiB)
        c = pool.malloc(20 * MiB)  # a + b
        for block in (a, b, c):
            pool.free(block)
    assert len(pool.segments) == (2 if expandable else 4)


#: (bytes per tensor, cudaMallocs, reserved during capture, reserved after; expandable:
#: reserved during, reserved after), test_graph_memory_stats_and_use_result_after_destroy_graph.
GRAPH_CASES = [
    (512, 1, 2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB),
    (1 * MiB, 2, 4 * MiB, 2 * MiB, 4 * MiB, 2 * MiB),
    (1 * MiB + 512, 1, 20 * MiB, 20 * MiB, 20 * MiB, 20 * MiB),
    (10 * MiB - 512, 2, 40 * MiB, 20 * MiB, 40 * MiB, 40 * MiB),
    (10 * MiB + 512, 3, 36 * MiB, 12 * MiB, 40 * MiB, 20 * MiB),
]


@pytest.mark.parametrize("expandable", EXPANDABLE)
@pytest.mark.parametrize(("nbytes", "mallocs", "during", "after", "x_during", "x_after"), GRAPH_CASES)
def test_d7_clone_chain_in_a_fresh_pool(
    expandable: bool, nbytes: int, mallocs: int, during: int, after: int, x_during: int, x_after: int
) -> None:
    pool = make(expandable)
    b = pool.malloc(nbytes)  # b = a.clone()
    for _ in range(5):  # b = b.clone() + 1
        clone = pool.malloc(nbytes)
        result = pool.malloc(nbytes)
        pool.free(clone)
        pool.free(b)
        b = result
    counted = [s for s in pool.segments if not s.expandable]  # expandable ones are not counted
    assert len(counted) == (0 if expandable else mallocs)
    assert len(pool.segments) == (1 if expandable else mallocs)  # one expandable segment per pool
    assert pool.reserved == (x_during if expandable else during)
    assert list(live_blocks(pool)) == [b] and pool.active == nbytes
    pool.empty_cache()  # the graph is gone: its pool's free memory goes back
    assert pool.reserved == (x_after if expandable else after)
    assert len([s for s in pool.segments if not s.expandable]) == (0 if expandable else 1)


def test_d8_two_captures_sharing_a_pool_save_one_small_segment() -> None:
    def capture(pool: CachingAllocator, b: Block | None) -> Block | None:
        size = 1000 * F32

        def with_temps(t: Block | None) -> Block | None:
            x_clone = pool.malloc(size)
            x = pool.malloc(size)
            pool.free(x_clone)
            y_clone = pool.malloc(size)
            y = pool.malloc(size)
            pool.free(y_clone)
            out = pool.malloc(size)
            pool.free(x)
            pool.free(y)
            if t is not None:
                pool.free(t)
            return out

        for _ in range(5):
            b = with_temps(b)
        return b

    separate = [CachingAllocator(), CachingAllocator()]
    b = capture(separate[0], separate[0].malloc(1000 * F32))  # b = a.clone()
    capture(separate[1], None)  # g1 continues from b, in its own pool (b is not freed there)
    shared = CachingAllocator()
    b = capture(shared, shared.malloc(1000 * F32))
    capture(shared, b)
    assert sum(p.reserved for p in separate) - shared.reserved == 2 * MiB


def test_d9_a_freed_block_is_reused_on_its_stream_only() -> None:
    alloc = CachingAllocator()
    tmp = alloc.malloc(4 * F32, stream=1)
    assert tmp is not None
    address = tmp.address
    alloc.free(tmp)
    other = alloc.malloc(4 * F32, stream=0)
    assert other is not None and other.address != address and other.segment is not tmp.segment
    again = alloc.malloc(4 * F32, stream=1)
    assert again is not None and again.address == address


# -- E: invariants along long sequences -------------------------------------------------------


def _check_consistency(alloc: CachingAllocator) -> None:
    """_check_memory_stat_consistency: the statistics are the sums over the snapshot."""
    allocated = sum(b.size for b in live_blocks(alloc))
    requested = sum(b.requested for b in live_blocks(alloc))
    assert alloc.allocated == alloc.active == allocated
    assert alloc.requested == requested
    assert alloc.reserved == sum(s.reserved for s in alloc.segments)


@pytest.mark.parametrize("expandable", EXPANDABLE)
def test_e1_memory_stats_generator(expandable: bool) -> None:
    """The steps of _test_memory_stats_generator (N=35), each checked as there."""
    alloc = make(expandable)
    last = {"m": alloc.allocated, "max_m": alloc.peak_allocated, "r": alloc.reserved, "max_r": alloc.peak_reserved}

    def change(comp: int = 1, empty_cache: bool = False, reset_peak: bool = False) -> None:
        m, max_m = alloc.allocated, alloc.peak_allocated
        assert (m > last["m"]) if comp > 0 else (m < last["m"]) if comp < 0 else (m == last["m"])
        assert m <= max_m and max_m >= last["max_m"]
        r, max_r = alloc.reserved, alloc.peak_reserved
        assert r <= max_r and max_r >= last["max_r"]
        last.update(m=m, max_m=max_m, r=r, max_r=max_r)
        if empty_cache:
            allocs, frees = alloc.num_device_alloc, alloc.num_device_free
            assert allocs >= (0 if m == 0 else 1)
            alloc.empty_cache()
            assert alloc.num_device_alloc >= allocs and alloc.num_device_free >= frees
            assert alloc.reserved <= last["r"] and alloc.peak_reserved == last["max_r"]
            last["r"] = alloc.reserved
        if reset_peak:
            alloc.reset_peaks()
            assert alloc.allocated == alloc.peak_allocated == last["m"]
            assert alloc.reserved == alloc.peak_reserved == last["r"]
            last.update(max_m=last["m"], max_r=last["r"])
        _check_consistency(alloc)

    def new(*shape: int) -> Block | None:
        numel = 1
        for size in shape:
            numel *= size
        return alloc.malloc(numel * F32)

    n = 35
    m0 = alloc.allocated
    change(0)
    change(0, reset_peak=True)
    change(0, empty_cache=True)
    change(0, reset_peak=True)
    change(0)
    tensors1 = [new(1), new(10, 20), new(200, 300, 2000)]
    m1 = alloc.allocated
    change(1)
    tensors2: list[Block | None] = []
    for i in range(1, n // 2 + 1):
        tensors2.append(new(i, i * 4))
        change(1)
    for i in range(5, n // 2 + 5):
        tensors2.append(new(i, i * 7, i * 9, i * 11))
        change(1, reset_peak=(i % 2 == 0))
    tensors2.append(new(0, 0, 0))
    change(0)
    random.Random(0).shuffle(tensors2)  # the permutation holds the same tensors
    change(0, reset_peak=True)
    for i in range(n // 2):
        block = tensors2.pop(i)
        alloc.free(block)
        change(-1 if block is not None else 0)
    for i in range(2, 2 * n // 3 + 2):
        tensors2.append(new(i, i * 3, i * 8))
        change(1)
    for block in tensors2:
        alloc.free(block)
    change(-1, reset_peak=True)
    change(0)
    assert alloc.allocated == m1
    for block in tensors1:
        alloc.free(block)
    change(-1, reset_peak=True)
    assert alloc.allocated == m0
    change(0, empty_cache=True)
    change(0, reset_peak=True)


def test_e2_allocator_fuzz() -> None:
    """The same random sequence as test_allocator_fuzz (Python's random, seed 123)."""
    rng = random.Random(123)
    alloc = CachingAllocator()
    live: list[tuple[int, Block]] = []
    total = 0
    for _ in range(10000):
        while total >= 1024 * 1024 * 1024 / (4 * 10):
            numel, block = live.pop(rng.randrange(0, len(live)))
            alloc.free(block)
            total -= numel
        action = rng.choices(["alloc", "free", "empty"], weights=[1, 1 if live else 0, 0.1])[0]
        if action == "alloc":
            numel = rng.randrange(2 * 1024 * 1024 // 4, 20 * 1024 * 1024 // 4)
            block = alloc.malloc(numel * 4)
            assert block is not None
            live.append((numel, block))
            total += numel
        elif action == "free":
            numel, block = live.pop(rng.randrange(0, len(live)))
            alloc.free(block)
            total -= numel
        else:
            alloc.empty_cache()
        spans = sorted((b.address, b.address + b.size) for _, b in live)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    _check_consistency(alloc)


# -- F: figures of the CUDA model besides the allocator -------------------------------------


@pytest.mark.parametrize(
    ("gpu", "config", "nbytes"),
    [
        ("A100", None, 4096 * KiB * 2 + 16 * KiB * 8),
        ("H100", None, 4096 * 8 * KiB),
        ("A100", ":128:8:64:16:32:32", 3072 * KiB),
        ("H100", ":128:8:64:16:32:32", 3072 * KiB),
        ("A100", "-1", 4096 * KiB * 2 + 16 * KiB * 8),
    ],
)
def test_f1_cublas_workspace_sizes(
    gpu: str, config: str | None, nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert cublas_workspace_size(PROFILES[gpu]) == nbytes


class _Fn(nn.Module):
    def __init__(self, fn: object) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fn(a, b)  # type: ignore[operator]


def test_f2_matmul_of_an_expanded_operand_costs_what_bmm_costs() -> None:
    a, b = torch.rand(1, 32, 32), torch.rand(24, 32, 1)
    peaks = {
        name: tm.estimate(_Fn(fn), args, device="cuda", train=False)
        for name, fn, args in (
            ("matmul", torch.matmul, (a, b)),
            ("matmul expanded", torch.matmul, (a.expand(24, 32, 32), b)),
            ("bmm", torch.bmm, (a.expand(24, 32, 32), b)),
        )
    }
    assert all(report.unsupported == () for report in peaks.values())
    assert len({report.forward_peak for report in peaks.values()}) == 1
