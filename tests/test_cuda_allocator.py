"""The CUDA caching allocator simulator against figures worked out by hand.

Every expected figure below follows from the rules of c10/cuda/
CUDACachingAllocator.cpp (torch 2.13/2.14) as the docstrings spell out:
``round_size`` (512-byte multiples, or power-of-two divisions),
``get_allocation_size`` (2 MiB small segments, 20 MiB below 10 MiB, else a
2 MiB multiple), ``get_free_block`` (best fit per stream, oversize rules),
``should_split`` (small pool: >= 512 bytes left; large pool: > 1 MiB left and
the request below ``max_split_size``; expandable: >= 512 bytes left).
"""

from __future__ import annotations

import random
import re

import pytest

from pytest_torchmem.engine.torch_compat.torch_release import installed_release
from pytest_torchmem.engine.tracing.devices.cuda.allocator import (
    SIZE_MAX,
    AllocatorConfig,
    Block,
    CachingAllocator,
    OutOfMemoryError,
)
from pytest_torchmem.engine.tracing.devices.cuda.allocator_constants import (
    KLARGE_BUFFER,
    KMIN_BLOCK_SIZE,
    KMIN_LARGE_ALLOC,
    KPINNED_MAX_REGISTER_THREADS,
    KROUND_LARGE,
    KROUNDUP_POWER2_INTERVALS,
    KROUNDUP_POWER2_START_LOG2,
    KSMALL_BUFFER,
    KSMALL_SIZE,
    ONE_EXA_BYTES,
)
from torch_sources import cuda_library, disassembly, header_constant, header_text, immediates, library

KiB = 1024
MiB = 1024 * 1024


def blocks_of(block: Block) -> list[tuple[int, bool]]:
    """(size, allocated) of every mapped block of ``block``'s segment, by address."""
    return [(b.size, b.allocated) for b in block.segment.blocks() if b.mapped]


def make(
    text: str = "", capacity: int | None = None, release: tuple[int, int] | None = None
) -> CachingAllocator:
    return CachingAllocator(AllocatorConfig.parse(text, release), capacity=capacity)


# ------------------------------------------------------------ default pools


def test_small_requests_share_a_2mib_segment() -> None:
    """1000 B rounds to 1024 B, 3000 B to 3072 B, 1 B to 512 B: all small pool,
    carved front to back from one 2 MiB segment (the remainder is split off
    each time, since far more than 512 B remain). 1 MiB exactly is still small
    and fits the remainder (2 MiB - 4608 B); a second 1 MiB no longer fits
    (1 MiB - 4608 B left) and gets a second 2 MiB segment."""
    alloc = CachingAllocator()
    a = alloc.malloc(1000)
    b = alloc.malloc(3000)
    c = alloc.malloc(1)
    assert a is not None and b is not None and c is not None
    assert (a.size, b.size, c.size) == (1024, 3072, 512)
    assert (b.address, c.address) == (a.address + 1024, a.address + 4096)
    assert alloc.allocated == 4608 and alloc.requested == 4001
    assert alloc.reserved == 2 * MiB
    assert blocks_of(a) == [(1024, True), (3072, True), (512, True), (2 * MiB - 4608, False)]

    d = alloc.malloc(1 * MiB)
    assert d is not None and d.segment is a.segment and d.size == 1 * MiB
    assert alloc.reserved == 2 * MiB
    e = alloc.malloc(1 * MiB)
    assert e is not None and e.segment is not a.segment
    assert alloc.reserved == 4 * MiB
    assert alloc.allocated == 4608 + 2 * MiB


def test_small_pool_hands_out_an_exact_remainder_unsplit() -> None:
    """Two 1 MiB requests fill a 2 MiB small segment exactly: the second takes
    the 1 MiB remainder whole (0 bytes would remain, nothing to split)."""
    alloc = CachingAllocator()
    a = alloc.malloc(1 * MiB)
    b = alloc.malloc(1 * MiB)
    assert a is not None and b is not None
    assert blocks_of(a) == [(1 * MiB, True), (1 * MiB, True)]
    assert alloc.reserved == 2 * MiB and alloc.allocated == 2 * MiB


def test_one_mib_plus_one_byte_goes_to_the_large_pool() -> None:
    """1 MiB + 1 B rounds to 1 MiB + 512 B > kSmallSize: large pool, whose
    segment for a request under 10 MiB is 20 MiB, split (19 MiB - 512 B left,
    more than 1 MiB)."""
    alloc = CachingAllocator()
    block = alloc.malloc(1 * MiB + 1)
    assert block is not None and not block.small
    assert block.size == 1 * MiB + 512 and block.requested == 1 * MiB + 1
    assert alloc.allocated == 1 * MiB + 512
    assert alloc.reserved == 20 * MiB
    assert blocks_of(block) == [(1 * MiB + 512, True), (19 * MiB - 512, False)]


def test_mid_size_request_gets_a_20mib_segment_reused_after_free() -> None:
    """5 MiB: a 20 MiB segment, split. Freed, the two halves merge back into
    one cached 20 MiB block, which serves 8 MiB (split again), then the
    12 MiB remainder serves 12 MiB exactly. Only then does 2 MiB need a new
    20 MiB segment."""
    alloc = CachingAllocator()
    a = alloc.malloc(5 * MiB)
    assert a is not None
    assert (alloc.allocated, alloc.reserved) == (5 * MiB, 20 * MiB)
    alloc.free(a)
    assert (alloc.allocated, alloc.reserved) == (0, 20 * MiB)
    assert blocks_of(a) == [(20 * MiB, False)]

    b = alloc.malloc(8 * MiB)
    c = alloc.malloc(12 * MiB)
    assert b is not None and c is not None
    assert b.segment is a.segment and c.segment is a.segment
    assert (alloc.allocated, alloc.reserved) == (20 * MiB, 20 * MiB)
    d = alloc.malloc(2 * MiB)
    assert d is not None and d.segment is not a.segment
    assert alloc.reserved == 40 * MiB


@pytest.mark.parametrize(
    ("request_mib", "charged_mib"),
    [
        (19.5, 20),  # 0.5 MiB would remain: not > 1 MiB, not split
        (19, 20),  # exactly 1 MiB would remain: still not > 1 MiB
        (18.5, 18.5),  # 1.5 MiB remains: split
    ],
)
def test_an_unsplit_remainder_is_charged_to_allocated(
    request_mib: float, charged_mib: float
) -> None:
    """A cached 20 MiB block (from a freed 5 MiB request) serving a larger
    request keeps its remainder when 1 MiB or less would be left over, and the
    whole block counts in memory_allocated()."""
    alloc = CachingAllocator()
    alloc.free(alloc.malloc(5 * MiB))
    block = alloc.malloc(int(request_mib * MiB))
    assert block is not None
    assert block.size == alloc.allocated == int(charged_mib * MiB)
    assert block.requested == alloc.requested == int(request_mib * MiB)
    assert alloc.reserved == 20 * MiB


@pytest.mark.parametrize(
    ("nbytes", "segment", "charged"),
    [
        (11 * MiB, 12 * MiB, 12 * MiB),  # >= 10 MiB: 2 MiB multiple; 1 MiB left, not split
        (13 * MiB, 14 * MiB, 14 * MiB),
        (10 * MiB, 10 * MiB, 10 * MiB),  # kMinLargeAlloc itself is not "below 10 MiB"
        (10 * MiB - 512, 20 * MiB, 10 * MiB - 512),  # below: 20 MiB segment, split
        (41 * MiB - 100, 42 * MiB, 42 * MiB),  # rounds to 41 MiB; 1 MiB left
    ],
)
def test_fresh_large_segments_are_rounded_to_2mib(nbytes: int, segment: int, charged: int) -> None:
    """get_allocation_size rounds requests of 10 MiB and more up to 2 MiB
    multiples; should_split keeps a remainder of at most 1 MiB attached."""
    alloc = CachingAllocator()
    block = alloc.malloc(nbytes)
    assert block is not None
    assert alloc.reserved == segment
    assert alloc.allocated == block.size == charged


def test_free_merges_adjacent_free_blocks() -> None:
    """Three 512 B blocks and the rest of a 2 MiB segment: freeing the middle
    one merges nothing (both neighbours allocated); freeing the first absorbs
    it; freeing the last joins everything back into one 2 MiB block."""
    alloc = CachingAllocator()
    a, b, c = (alloc.malloc(512) for _ in range(3))
    assert a is not None and b is not None and c is not None
    rest = 2 * MiB - 1536
    alloc.free(b)
    assert blocks_of(a) == [(512, True), (512, False), (512, True), (rest, False)]
    alloc.free(a)
    assert blocks_of(c) == [(1024, False), (512, True), (rest, False)]
    alloc.free(c)
    assert blocks_of(c) == [(2 * MiB, False)]
    assert c.address == c.segment.address
    assert (alloc.allocated, alloc.reserved) == (0, 2 * MiB)
    # The merged block serves a whole 1 MiB request without a new segment.
    assert alloc.malloc(1 * MiB) is not None
    assert alloc.reserved == 2 * MiB


def test_best_fit_and_the_address_tie_break() -> None:
    """Cached unsplit segments of 30, 24 and 40 MiB: 23 MiB takes the 24 MiB
    one (the smallest that fits; 1 MiB left, kept whole), 25 MiB the 30 MiB
    one (split: 5 MiB left). Between two cached blocks of the same size the
    lower address wins, whatever the order they were freed in."""
    alloc = CachingAllocator()
    x, y, z = alloc.malloc(30 * MiB), alloc.malloc(24 * MiB), alloc.malloc(40 * MiB)
    assert x is not None and y is not None and z is not None
    for block in (z, x, y):
        alloc.free(block)
    p = alloc.malloc(23 * MiB)
    q = alloc.malloc(25 * MiB)
    assert p is not None and q is not None
    assert (p.address, p.size) == (y.segment.address, 24 * MiB)
    assert (q.address, q.size) == (x.segment.address, 25 * MiB)
    assert alloc.reserved == 94 * MiB

    twins = CachingAllocator()
    u, v = twins.malloc(24 * MiB), twins.malloc(24 * MiB)
    assert u is not None and v is not None and u.address < v.address
    twins.free(u)
    twins.free(v)
    w = twins.malloc(24 * MiB)
    assert w is not None and w.address == u.address


# ------------------------------------------------------------ configuration


def test_roundup_power2_divisions_single_value() -> None:
    """With 4 divisions, 1200 MiB lies in [1024, 2048) MiB whose quarters are
    1024, 1280, 1536, 1792: it rounds to 1280 MiB (and so does its segment).
    Powers of two stay. Rounding starts above 512 B x divisions = 2048 B:
    1200 B still rounds to 1536 B (512 B multiple), 4100 B to 5120 B (the
    quarters of [4096, 8192) B are 1024 B), 5 MiB + 1 B to 6 MiB."""
    config = AllocatorConfig.parse("roundup_power2_divisions:4")
    assert config.roundup_power2_divisions == (4,) * 16
    assert config.round_size(1200 * MiB) == 1280 * MiB
    assert config.round_size(1024 * MiB) == 1024 * MiB
    assert config.round_size(1025 * MiB) == 1280 * MiB
    assert config.round_size(1200) == 1536
    assert config.round_size(4100) == 5120
    assert config.round_size(5 * MiB + 1) == 6 * MiB
    assert AllocatorConfig().round_size(4100) == 4608

    alloc = CachingAllocator(config)
    block = alloc.malloc(1200 * MiB)
    assert block is not None and block.size == 1280 * MiB
    assert alloc.reserved == 1280 * MiB


def test_roundup_power2_divisions_per_interval() -> None:
    """``[256:1,512:2,1024:4,>:8]``: entry i covers [2**i, 2**(i+1)) MiB, the
    first boundary also fills the entries below it, ``>`` the ones after the
    last boundary. 300 MiB: 1 division (512 B rounding); 600 MiB: halves of
    [512, 1024) -> 768 MiB; 1200 MiB: quarters -> 1280 MiB; 2100 MiB: eighths
    of [2048, 4096) -> 2304 MiB."""
    config = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert config.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert config.round_size(300 * MiB) == 300 * MiB
    assert config.round_size(600 * MiB) == 768 * MiB
    assert config.round_size(1200 * MiB) == 1280 * MiB
    assert config.round_size(2100 * MiB) == 2304 * MiB

    # PyTorch's own AllocatorConfig unit test example.
    torch_example = AllocatorConfig.parse(
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]"
    )
    assert [torch_example.divisions_for(n * MiB) for n in (32, 64, 128, 256, 512, 1024, 2048)] == [
        8, 8, 2, 4, 2, 4, 1,
    ]
    assert AllocatorConfig.parse("roundup_power2_divisions:[64:8]").roundup_power2_divisions == (
        (8,) * 7 + (0,) * 9
    )
    # ">" before any boundary starts after entry 0, as in the C++.
    assert AllocatorConfig.parse("roundup_power2_divisions:[>:4]").roundup_power2_divisions == (
        (0,) + (4,) * 15
    )


@pytest.mark.parametrize(
    ("text", "nbytes", "charged"),
    [
        ("", 84 * MiB, 84 * MiB),
        ("roundup_power2_divisions:4", 84 * MiB, 96 * MiB),  # quarters of [64, 128) MiB
        ("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]", 84 * MiB, 88 * MiB),
        ("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]", 400 * MiB, 512 * MiB),
        ("roundup_power2_divisions:[128:1,256:0,512:4]", 268 * MiB, 268 * MiB),  # 0: off
        ("roundup_power2_divisions:[128:1,256:0,512:4]", 520 * MiB, 640 * MiB),
        ("roundup_power2_divisions:1", 1_312_500, 1_312_768),  # 1: 512 B multiples
    ],
)
def test_the_rounding_pytorch_checks_on_gpus(text: str, nbytes: int, charged: int) -> None:
    """The figures of PyTorch's own GPU tests (test_cuda.py: test_allocator_settings,
    test_roundup_power2_divisions_0/_1), which compare active_bytes with a
    power-of-two-division formula: 21M floats (84 MiB), 100M floats (400 MiB),
    67M floats (268 MiB), 130M floats (520 MiB), 21 x 125 x 125 floats."""
    alloc = make(text)
    block = alloc.malloc(nbytes)
    assert block is not None and alloc.active == alloc.allocated == charged


def test_max_split_size_oversize_blocks() -> None:
    """max_split_size_mb:100. 144.5 MiB gets a 146 MiB segment, not split
    (the request is oversize), so 146 MiB is charged. Cached, that block is
    refused to 50 MiB (below max_split_size: new segment), taken by 130 MiB
    (146 < 130 + 20 MiB allowance), refused to 120 MiB (146 >= 140)."""
    alloc = make("max_split_size_mb:100")
    a = alloc.malloc(int(144.5 * MiB))
    assert a is not None and a.size == 146 * MiB and alloc.allocated == 146 * MiB
    alloc.free(a)
    b = alloc.malloc(50 * MiB)
    assert b is not None and b.segment is not a.segment
    assert alloc.reserved == 196 * MiB
    alloc.free(b)
    c = alloc.malloc(130 * MiB)
    assert c is not None and c.segment is a.segment and c.size == 146 * MiB
    alloc.free(c)
    d = alloc.malloc(120 * MiB)
    assert d is not None and d.segment not in (a.segment, b.segment)
    assert alloc.reserved == 316 * MiB

    # Without max_split_size the same 144.5 MiB request is split (1.5 MiB left).
    plain = CachingAllocator()
    e = plain.malloc(int(144.5 * MiB))
    assert e is not None and e.size == int(144.5 * MiB)


def test_max_non_split_rounding_allowance() -> None:
    """max_non_split_rounding_mb:30: a cached 150 MiB block serves an oversize
    request only if 150 < request + 30 MiB: not 120 MiB (150 >= 150), but
    121 MiB, which is charged the whole 150 MiB."""
    alloc = make("max_split_size_mb:100,max_non_split_rounding_mb:30")
    a = alloc.malloc(150 * MiB)
    assert a is not None
    alloc.free(a)
    b = alloc.malloc(120 * MiB)
    assert b is not None and b.segment is not a.segment
    alloc.free(b)
    c = alloc.malloc(121 * MiB)
    assert c is not None and c.segment is a.segment and c.size == 150 * MiB
    assert alloc.reserved == 270 * MiB


# ------------------------------------------------ running out of device memory


def test_release_available_cached_blocks_frees_just_enough_oversize_blocks() -> None:
    """max_split_size_mb:100 on a 400 MiB device; cached: 20 MiB (from 5 MiB),
    120 and 150 MiB. 200 MiB fits no cached block and 290 + 200 > 400: the
    largest oversize blocks go first (150, then 120: 270 >= 200), the 20 MiB
    one stays, and the retry succeeds without freeing the whole cache."""
    alloc = make("max_split_size_mb:100", capacity=400 * MiB)
    small = alloc.malloc(5 * MiB)
    a, b = alloc.malloc(150 * MiB), alloc.malloc(120 * MiB)
    for block in (small, a, b):
        alloc.free(block)
    assert alloc.reserved == 290 * MiB
    c = alloc.malloc(200 * MiB)
    assert c is not None
    assert alloc.reserved == 220 * MiB
    assert alloc.num_alloc_retries == 0
    assert [s.size for s in alloc.segments] == [20 * MiB, 200 * MiB]


def test_release_available_cached_blocks_frees_one_block_that_covers() -> None:
    """Cached 250 MiB (too big for 200 MiB: 250 >= 200 + 20) and 20 MiB on a
    400 MiB device: 270 + 200 > 400, and the smallest oversize block of at
    least 200 MiB (the 250) is freed alone."""
    alloc = make("max_split_size_mb:100", capacity=400 * MiB)
    alloc.free(alloc.malloc(5 * MiB))
    alloc.free(alloc.malloc(250 * MiB))
    assert alloc.malloc(200 * MiB) is not None
    assert alloc.reserved == 220 * MiB and alloc.num_alloc_retries == 0


def test_free_all_cached_blocks_and_retry_then_oom() -> None:
    """100 MiB device, no max_split_size: 70 MiB does not fit next to the
    cached 60 MiB segment; the cache is emptied and the retry succeeds
    (num_alloc_retries 1). Then 40 MiB next to the live 70 MiB cannot be had
    even after emptying the cache: out of memory, the state unchanged."""
    alloc = CachingAllocator(capacity=100 * MiB)
    alloc.free(alloc.malloc(60 * MiB))
    b = alloc.malloc(70 * MiB)
    assert b is not None
    assert (alloc.reserved, alloc.peak_reserved, alloc.num_alloc_retries) == (70 * MiB, 70 * MiB, 1)
    with pytest.raises(OutOfMemoryError, match="Tried to allocate 40.00 MiB"):
        alloc.malloc(40 * MiB)
    assert (alloc.allocated, alloc.reserved) == (70 * MiB, 70 * MiB)
    assert alloc.num_ooms == 1 and alloc.num_alloc_retries == 2


def test_per_process_memory_fraction_caps_reserved() -> None:
    """per_process_memory_fraction:0.5 of a 1000 MiB device allows 500 MiB of
    segments: 600 MiB is out of memory although the device has room."""
    alloc = make("per_process_memory_fraction:0.5", capacity=1000 * MiB)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(600 * MiB)
    assert alloc.malloc(500 * MiB) is not None
    with pytest.raises(ValueError, match="capacity"):
        make("per_process_memory_fraction:0.5")


def test_garbage_collection_frees_the_oldest_cached_blocks() -> None:
    """GC threshold 0.5 of the allowed 500 MiB = 250 MiB. Large-pool
    get_free_block calls: a (1), b (2); a is cached at count 2; c (3), b is
    cached at count 3; d (4) finds nothing with 310 MiB reserved > 250:
    ages a = 2, b = 1, mean 1.5, so only a is freed (100 >= the 60 MiB
    excess), then d's 120 MiB segment is made: 100 + 110 + 120 = 330 MiB."""
    alloc = make(
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5", capacity=1000 * MiB
    )
    a, b = alloc.malloc(100 * MiB), alloc.malloc(100 * MiB)
    assert a is not None and b is not None
    alloc.free(a)
    alloc.malloc(110 * MiB)
    alloc.free(b)
    alloc.malloc(120 * MiB)
    assert alloc.reserved == 330 * MiB
    live = {s.address for s in alloc.segments}
    assert b.segment.address in live and a.segment.address not in live

    # Without a memory fraction there is no allowed maximum, hence no GC.
    no_cap = make("garbage_collection_threshold:0.5", capacity=1000 * MiB)
    a, b = no_cap.malloc(100 * MiB), no_cap.malloc(100 * MiB)
    no_cap.free(a)
    no_cap.malloc(110 * MiB)
    no_cap.free(b)
    no_cap.malloc(120 * MiB)
    assert no_cap.reserved == 430 * MiB


# ------------------------------------------------------- expandable segments


def test_expandable_segments_grow_by_20mib_pages() -> None:
    """expandable_segments:True: one segment per stream and pool, mapped in
    20 MiB pages in the large pool. 5 MiB maps one page (5 used, 15 free);
    30 MiB extends the free 15 MiB with one more page (35 MiB, split: 30 + 5);
    another 5 MiB takes the 5 MiB tail exactly. 40 MiB reserved where
    separate segments would need 50."""
    alloc = make("expandable_segments:True")
    a, b, c = alloc.malloc(5 * MiB), alloc.malloc(30 * MiB), alloc.malloc(5 * MiB)
    assert a is not None and b is not None and c is not None
    assert a.segment is b.segment is c.segment and a.segment.expandable
    assert (b.address, c.address) == (a.address + 5 * MiB, a.address + 35 * MiB)
    assert (alloc.allocated, alloc.reserved) == (40 * MiB, 40 * MiB)

    plain = CachingAllocator()
    for n in (5, 30, 5):
        plain.malloc(n * MiB)
    assert plain.reserved == 50 * MiB


def test_expandable_segments_small_pool_uses_2mib_pages() -> None:
    """Small pool pages are 2 MiB: 512 B maps one; 1 MiB fits the rest; a
    second 1 MiB finds only 1 MiB - 512 B free at the end and maps one more
    page, the block spanning the page boundary (no fragmentation there)."""
    alloc = make("expandable_segments:True")
    a = alloc.malloc(512)
    assert alloc.reserved == 2 * MiB
    alloc.malloc(1 * MiB)
    assert alloc.reserved == 2 * MiB
    c = alloc.malloc(1 * MiB)
    assert a is not None and c is not None and c.segment is a.segment
    assert c.address == a.address + 512 + 1 * MiB
    assert alloc.reserved == 4 * MiB
    assert alloc.allocated == 512 + 2 * MiB


def test_expandable_segments_split_any_remainder() -> None:
    """With expandable segments a remainder of >= 512 B is always split off:
    19.5 MiB is charged 19.5 MiB (20 MiB without them)."""
    alloc = make("expandable_segments:True")
    block = alloc.malloc(int(19.5 * MiB))
    assert block is not None and alloc.allocated == int(19.5 * MiB)
    assert alloc.reserved == 20 * MiB


def test_expandable_segments_empty_cache_unmaps_whole_free_pages() -> None:
    """Pages [0, 60) MiB: a = [0, 5), b = [5, 55), c = [55, 60). With b
    freed, empty_cache unmaps the one page wholly inside [5, 55): [20, 40).
    30 MiB then refills the hole: the free 15 MiB before it, the remapped
    page and the free 15 MiB after it merge into [5, 55). With everything
    freed, empty_cache returns all pages and the segment."""
    alloc = make("expandable_segments:True")
    a, b, c = alloc.malloc(5 * MiB), alloc.malloc(50 * MiB), alloc.malloc(5 * MiB)
    assert a is not None and b is not None and c is not None
    assert alloc.reserved == 60 * MiB
    alloc.free(b)
    alloc.empty_cache()
    assert alloc.reserved == 40 * MiB
    layout = [(blk.size // MiB, blk.allocated, blk.mapped) for blk in a.segment.blocks()][:-1]
    assert layout == [
        (5, True, True),
        (15, False, True),
        (20, False, False),
        (15, False, True),
        (5, True, True),
    ]
    d = alloc.malloc(30 * MiB)
    assert d is not None and d.address == a.address + 5 * MiB
    assert alloc.reserved == 60 * MiB
    for block in (a, c, d):
        alloc.free(block)
    alloc.empty_cache()
    assert alloc.reserved == 0 and alloc.segments == []


def test_expandable_segments_partial_pages_stay_mapped() -> None:
    """[a 0-5)[b 5-35)[free 35-40): with a freed, neither free range holds a
    whole 20 MiB page, so empty_cache keeps all 40 MiB mapped."""
    alloc = make("expandable_segments:True")
    a, b = alloc.malloc(5 * MiB), alloc.malloc(30 * MiB)
    alloc.free(a)
    alloc.empty_cache()
    assert alloc.reserved == 40 * MiB
    alloc.free(b)
    alloc.empty_cache()
    assert alloc.reserved == 0


def test_large_segment_size_mb() -> None:
    """large_segment_size_mb:32 replaces the 20 MiB segment (and expandable
    page) of requests below 10 MiB, and raises the floor of max_split_size_mb."""
    alloc = make("large_segment_size_mb:32", release=(2, 11))
    alloc.malloc(5 * MiB)
    assert alloc.reserved == 32 * MiB
    expandable = make("large_segment_size_mb:32,expandable_segments:True", release=(2, 11))
    expandable.malloc(40 * MiB)
    assert expandable.reserved == 64 * MiB
    with pytest.raises(ValueError, match="max_split_size_mb too small, must be >= 32"):
        AllocatorConfig.parse("max_split_size_mb:24,large_segment_size_mb:32", (2, 11))
    config = AllocatorConfig.parse("large_segment_size_mb:32", (2, 11))
    assert config.max_non_split_rounding_size == 32 * MiB


@pytest.mark.parametrize(
    ("key", "since"),
    [
        ("large_segment_size_mb:32", (2, 11)),
        ("throw_on_cudamalloc_oom:False", (2, 12)),
        ("pinned_free_catch_all:True", (2, 12)),
        ("pinned_max_cached_size_mb:64", (2, 13)),
        ("pinned_max_round_threshold_mb:64", (2, 13)),
        ("expandable_segments_reserve:1", (2, 15)),
        ("expandable_segments_reserve_by_class:[serving:0.25]", (2, 15)),
    ],
)
def test_keys_newer_than_the_release_are_unrecognized_there(key: str, since: tuple[int, int]) -> None:
    """Each release's libc10 parses the keys it knows and stops at the others with
    "Unrecognized key": the release before ``since`` refuses the key, ``since`` takes it."""
    AllocatorConfig.parse(key, since)
    before = (since[0], since[1] - 1)
    with pytest.raises(ValueError, match=f"Unrecognized key '{key.split(':')[0]}'"):
        AllocatorConfig.parse(key, before)


# ------------------------------------------------------- streams and stats


def test_streams_do_not_share_cached_blocks() -> None:
    """A block cached on stream 0 is not reused on stream 1, which gets its
    own 2 MiB segment; stream 0 reuses its own."""
    alloc = CachingAllocator()
    alloc.free(alloc.malloc(1000, stream=0))
    b = alloc.malloc(1000, stream=1)
    assert b is not None and b.stream == 1 and b.segment.stream == 1
    assert alloc.reserved == 4 * MiB
    c = alloc.malloc(1000, stream=0)
    assert c is not None and c.segment is not b.segment
    assert alloc.reserved == 4 * MiB

    expandable = make("expandable_segments:True")
    x, y = expandable.malloc(5 * MiB, stream=0), expandable.malloc(5 * MiB, stream=7)
    assert x is not None and y is not None and x.segment is not y.segment
    assert expandable.reserved == 40 * MiB


def test_peaks_and_reset() -> None:
    """5 MiB (20 MiB segment) then 30 MiB (30 MiB segment): peaks 35 / 50 MiB.
    Freeing keeps the peaks; reset_peaks brings them to the current values;
    empty_cache frees the cached 30 MiB segment (the 20 MiB one is in use)."""
    alloc = CachingAllocator()
    a = alloc.malloc(5 * MiB)
    assert (alloc.peak_allocated, alloc.peak_reserved) == (5 * MiB, 20 * MiB)
    b = alloc.malloc(30 * MiB)
    alloc.free(b)
    assert alloc.allocated == 5 * MiB
    assert (alloc.peak_allocated, alloc.peak_reserved) == (35 * MiB, 50 * MiB)
    alloc.reset_peaks()
    assert (alloc.peak_allocated, alloc.peak_reserved) == (5 * MiB, 50 * MiB)
    alloc.empty_cache()
    assert (alloc.reserved, alloc.peak_reserved) == (20 * MiB, 50 * MiB)
    alloc.reset_peaks()
    assert alloc.peak_reserved == 20 * MiB
    alloc.malloc(10 * MiB)  # from the 15 MiB cached remainder, split
    assert (alloc.peak_allocated, alloc.peak_reserved) == (15 * MiB, 20 * MiB)
    assert alloc.peak_active == alloc.active == 15 * MiB
    assert a is not None


def test_zero_bytes_and_invalid_frees() -> None:
    """Zero bytes: no block, no memory (NativeCachingAllocator::allocate)."""
    alloc = CachingAllocator()
    assert alloc.malloc(0) is None
    alloc.free(None)
    assert (alloc.allocated, alloc.reserved) == (0, 0)
    with pytest.raises(ValueError):
        alloc.malloc(-1)
    block = alloc.malloc(100)
    alloc.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(block)
    other = CachingAllocator().malloc(100)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(other)
    with pytest.raises(OutOfMemoryError, match="1EB"):
        alloc.malloc(1 << 60)


# ------------------------------------------------------------ config parsing


def test_parse_the_documented_example() -> None:
    config = AllocatorConfig.parse(
        " expandable_segments:True, roundup_power2_divisions:4 ,max_split_size_mb:128,"
    )
    assert config.expandable_segments
    assert config.roundup_power2_divisions == (4,) * 16
    assert config.max_split_size == 128 * MiB
    assert config.max_non_split_rounding_size == 20 * MiB
    assert AllocatorConfig.parse("") == AllocatorConfig()
    assert AllocatorConfig().max_split_size == SIZE_MAX
    # Keys of other parts of PyTorch's allocators are accepted and change nothing here.
    assert AllocatorConfig.parse(
        "backend:native,pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
        "release_lock_on_cudamalloc:True,graph_capture_record_stream_reuse:False,"
        "pinned_use_background_threads:True,throw_on_cudamalloc_oom:False,"
        "expandable_segments_reserve_by_class:[serving:0.25]",
        (2, 15),
    ) == AllocatorConfig()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("foo_bar:1", "Unrecognized key 'foo_bar'"),
        ("expandable_segments:True,max_split_mb:64", "Unrecognized key 'max_split_mb'"),
        ("backend:jemalloc", "Unknown allocator backend 'jemalloc'"),
        ("max_split_size_mb:10", "max_split_size_mb too small, must be >= 20"),
        ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb too small"),

        ("roundup_power2_divisions:3", "divisions has to be power of 2"),
        ("roundup_power2_divisions:[64:3]", "power of 2 or 0"),
        ("roundup_power2_divisions:[60:4]", "intervals have to be power of 2"),
        ("roundup_power2_divisions:[64:4", "unexpected end"),
        ("garbage_collection_threshold:1.0", "set it in \\(0.0, 1.0\\)"),
        ("per_process_memory_fraction:1.5", "set it in \\[0.0, 1.0\\]"),
        ("expandable_segments:true", "expects 'True' or 'False'"),
        ("max_split_size_mb", "unexpected end"),
        ("max_split_size_mb:lots", "expects a non-negative integer"),
        ("max_split_size_mb:²", "expects a non-negative integer"),  # a digit, not a decimal one
        ("roundup_power2_divisions:[²:4]", "intervals have to be power of 2"),
        ("max_split_size_mb:128;expandable_segments:True", "expects a non-negative integer"),
        ("pinned_num_register_threads:3", "power of 2"),
    ],
)
def test_parse_errors_name_the_problem(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AllocatorConfig.parse(text)
    with pytest.raises(ValueError, match="large_segment_size_mb must be > 10"):
        AllocatorConfig.parse("large_segment_size_mb:10", (2, 11))


@pytest.mark.parametrize("text", ["backend:cudaMallocAsync", "throw_on_cudamalloc_oom:True"])
def test_unmodelled_settings_are_refused(text: str) -> None:
    with pytest.raises(NotImplementedError, match="not modelled"):
        AllocatorConfig.parse(text, (2, 15))


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """PYTORCH_CUDA_ALLOC_CONF is read before PYTORCH_ALLOC_CONF, as
    AcceleratorAllocatorConfig::instance does."""
    both = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
    }
    assert AllocatorConfig.from_env(both) == AllocatorConfig(expandable_segments=True)
    only_generic = AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"})
    assert only_generic.max_split_size == 64 * MiB
    assert AllocatorConfig.from_env({}) == AllocatorConfig()
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:2")
    assert AllocatorConfig.from_env().roundup_power2_divisions == (2,) * 16


# --------------------------------------------------------- random invariants


def check_invariants(alloc: CachingAllocator, live: dict[int, tuple[Block, int, int]]) -> None:
    """The allocator's bookkeeping agrees with its blocks and segments."""
    assert alloc.allocated == sum(b.size for b, _, _ in live.values())
    assert alloc.requested == sum(b.requested for b, _, _ in live.values())
    assert alloc.allocated == alloc.active <= alloc.reserved
    assert alloc.peak_allocated >= alloc.allocated and alloc.peak_reserved >= alloc.reserved
    for block, nbytes, stream in live.values():
        assert block.allocated and block.mapped and block.requested == nbytes
        assert block.stream == stream and block.size >= alloc.round_size(nbytes)
        assert block.small == (alloc.round_size(nbytes) <= 1 * MiB)
    cached: set[int] = set()
    unmapped: set[int] = set()
    allocated_ids: set[int] = set()
    end = 0
    reserved = 0
    for segment in alloc.segments:
        assert segment.address >= end, "segments overlap"
        end = segment.address + segment.size
        address = segment.address
        mapped = 0
        previous: Block | None = None
        for block in segment.blocks():
            assert block.address == address and block.size > 0 and block.prev is previous
            assert block.segment is segment
            if previous is not None:
                both_free = not previous.allocated and not block.allocated
                assert not (both_free and previous.mapped == block.mapped), "unmerged neighbours"
            if block.mapped:
                mapped += block.size
            if block.allocated:
                allocated_ids.add(id(block))
            elif block.mapped:
                cached.add(id(block))
            else:
                unmapped.add(id(block))
            address += block.size
            previous = block
        assert address == end, "blocks do not cover their segment"
        assert mapped == segment.reserved
        if not segment.expandable:
            assert mapped == segment.size
        reserved += segment.reserved
    assert reserved == alloc.reserved
    assert allocated_ids == {id(b) for b, _, _ in live.values()}
    pools = (alloc._small, alloc._large)
    in_cache = {id(b) for pool in pools for s in pool.free.values() for b in s.blocks.values()}
    in_unmapped = {
        id(b) for pool in pools for s in pool.unmapped.values() for b in s.blocks.values()
    }
    assert cached == in_cache and unmapped == in_unmapped


RANDOM_CONFIGS = [
    ("", None),
    ("expandable_segments:True", None),
    ("max_split_size_mb:64,roundup_power2_divisions:4", None),
    (
        "roundup_power2_divisions:[1:2,64:8,>:4],max_split_size_mb:40,max_non_split_rounding_mb:60",
        900 * MiB,
    ),
    ("expandable_segments:True,roundup_power2_divisions:8", 700 * MiB),
    (
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.8,max_split_size_mb:48",
        800 * MiB,
    ),
    ("", 600 * MiB),
]


@pytest.mark.parametrize(("text", "capacity"), RANDOM_CONFIGS)
def test_random_timelines_keep_the_books(text: str, capacity: int | None) -> None:
    """Random malloc/free sequences on three streams, sizes from bytes to
    hundreds of MiB: every few steps the statistics equal the sums over the
    blocks, blocks tile their segments without overlap, no free neighbours
    are left unmerged, and the cache holds exactly the free blocks. At the
    end, freeing everything leaves nothing allocated, and empty_cache gives
    every byte back."""
    rng = random.Random(f"{text}-{capacity}")
    alloc = make(text, capacity)
    live: dict[int, tuple[Block, int, int]] = {}
    for step in range(1500):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            alloc.free(live.pop(key)[0])
        else:
            kind = rng.random()
            if kind < 0.5:
                nbytes = rng.randint(1, 1 * MiB + 4096)
            elif kind < 0.85:
                nbytes = rng.randint(1 * MiB, 12 * MiB)
            else:
                nbytes = rng.randint(12 * MiB, 160 * MiB)
            stream = rng.choice((0, 0, 1, 2))
            try:
                block = alloc.malloc(nbytes, stream)
            except OutOfMemoryError:
                assert capacity is not None
                block = None
            if block is not None:
                live[step] = (block, nbytes, stream)
        if rng.random() < 0.02:
            alloc.empty_cache()
        if step % 20 == 0:
            check_invariants(alloc, live)
    check_invariants(alloc, live)
    for block, _, _ in live.values():
        alloc.free(block)
    live.clear()
    check_invariants(alloc, live)
    assert alloc.allocated == alloc.requested == 0
    for segment in alloc.segments:
        assert all(not b.allocated for b in segment.blocks())
        if not segment.expandable:
            assert len(list(segment.blocks())) == 1
    alloc.empty_cache()
    check_invariants(alloc, live)
    assert alloc.reserved == 0
    assert all(s.reserved == 0 for s in alloc.segments)


def test_a_long_timeline_replays_quickly() -> None:
    """100k events (mallocs and frees, a working set of about 2000 live
    blocks) stay well within a second or two: the cache is searched by
    bisection, not by scanning."""
    rng = random.Random(7)
    alloc = CachingAllocator()
    live: list[Block] = []
    for _ in range(100_000):
        if len(live) > 2000 or (live and rng.random() < 0.5):
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            nbytes = rng.choice((rng.randint(1, 1 << 20), rng.randint(1 << 20, 64 << 20)))
            block = alloc.malloc(nbytes)
            assert block is not None
            live.append(block)
    check_invariants(alloc, {i: (b, b.requested, b.stream) for i, b in enumerate(live)})


# -- private pools (CUDA graphs) ---------------------------------------------------------


def _freed_then_taken(pool: int) -> int:
    """A 4 KiB forward buffer freed, then another 4 KiB one made in ``pool``: the
    reserved peak of the step through the caching-allocator model."""
    from pytest_torchmem.engine.figures.timeline import Phase, StorageInfo, Timeline, analyze

    t = Timeline()
    first = t.new_storage(StorageInfo(4096, phase=Phase.FORWARD, op="aten.empty.memory_format"))
    second = t.new_storage(StorageInfo(4096, phase=Phase.FORWARD, op="aten.empty.memory_format", pool=pool))
    t.phase(Phase.FORWARD)
    t.alloc(first)
    t.free(first)
    t.alloc(second)
    t.phase(None)
    analysis = analyze(t, [], CachingAllocator())
    assert analysis.reserved_peak is not None
    return analysis.reserved_peak


def test_a_private_pool_takes_no_block_of_the_device() -> None:
    """The device's cached block serves the second request in the same pool (one 2 MiB
    small segment); a private pool (a CUDA graph's) gets a segment of its own."""
    assert _freed_then_taken(pool=0) == 2 * MiB
    assert _freed_then_taken(pool=1) == 2 * 2 * MiB


# -- the C++ constants, read again from the installed torch -------------------------------
# (each release venv of the release suite pins them for its release; tests/torch_sources.py)

#: The header every wheel ships with the caching allocator's size constants.
ALLOCATOR_HEADER = "c10/core/AllocatorConfig.h"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("kMinBlockSize", KMIN_BLOCK_SIZE),
        ("kSmallSize", KSMALL_SIZE),
        ("kSmallBuffer", KSMALL_BUFFER),
        ("kMinLargeAlloc", KMIN_LARGE_ALLOC),
        ("kRoundLarge", KROUND_LARGE),
    ],
)
def test_allocator_size_constant_is_pinned_by_the_installed_header(name: str, value: int) -> None:
    """``constexpr size_t kMinBlockSize = 512;`` (and the others) in the installed torch's
    ``c10/core/AllocatorConfig.h`` is the value the simulator rounds and sizes with."""
    assert header_constant(ALLOCATOR_HEADER, name) == value


def test_large_buffer_is_pinned_by_the_installed_header() -> None:
    """The 20 MiB large segment: ``constexpr size_t kLargeBuffer`` in 2.10, the initial
    ``large_segment_size_{20971520}`` of ``AcceleratorAllocatorConfig`` from 2.11 (where
    ``large_segment_size_mb`` came)."""
    name = "kLargeBuffer" if installed_release()[:2] < (2, 11) else "large_segment_size_"
    assert header_constant(ALLOCATOR_HEADER, name) == KLARGE_BUFFER == 20 * MiB


def test_pinned_register_threads_limit_is_pinned_by_the_installed_header() -> None:
    """``CUDAAllocatorConfig::pinned_max_register_threads()`` returns 128: the parser's
    bound on ``pinned_num_register_threads``."""
    text = header_text("c10/cuda/CUDAAllocatorConfig.h")
    body = re.search(r"pinned_max_register_threads\(\)\s*\{(.*?)\}", text, re.S)
    assert body is not None
    assert re.findall(r"return\s+(\d+)\s*;", body.group(1)) == [str(KPINNED_MAX_REGISTER_THREADS)]
    with pytest.raises(ValueError, match="must be a power of 2 and <= 128, got 256"):
        AllocatorConfig.parse("pinned_num_register_threads:256")


def test_roundup_intervals_are_pinned_by_the_installed_libc10() -> None:
    """``AcceleratorAllocatorConfig::roundup_power2_divisions(size_t)`` (``libc10.so``, in
    CPU and CUDA builds) clamps the interval index to ``kRoundUpPowerOfTwoIntervals - 1``
    (``$0xf``) after taking ``log2(kRoundUpPowerOfTwoStart)`` (``$0x14``, 1 MiB) off."""
    code = disassembly(library("libc10.so"), r"AllocatorConfig24roundup_power2_divisionsEm$")
    found = immediates(code)
    assert KROUNDUP_POWER2_INTERVALS - 1 in found
    assert KROUNDUP_POWER2_START_LOG2 in found
    assert (KROUNDUP_POWER2_INTERVALS, KROUNDUP_POWER2_START_LOG2) == (16, 20)


def test_one_exabyte_refusal_is_pinned_by_the_installed_libc10_cuda() -> None:
    """``NativeCachingAllocator::allocate`` refuses ``size >= one_exa_bytes`` (2**60),
    compiled as ``shr $0x3c`` (a nonzero ``size >> 60``); the simulator refuses the same."""
    code = disassembly(cuda_library("libc10_cuda.so"), r"NativeCachingAllocator8allocateEm$")
    assert re.search(r"shr\s+\$0x3c,", code), "the 1 EB check is compiled otherwise now"
    assert ONE_EXA_BYTES == 1 << 0x3C
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        CachingAllocator().malloc(ONE_EXA_BYTES)
