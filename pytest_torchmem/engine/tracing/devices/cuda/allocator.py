"""A simulator of PyTorch's native CUDA caching allocator: what it hands out, caches and frees.

Pure Python, no torch: it replays ``malloc``/``free`` timelines and reports
what ``torch.cuda.memory_allocated()``/``memory_reserved()`` and their
``max_*`` peaks would read on a real GPU with the native allocator of torch
2.13/2.14 (``c10/cuda/CUDACachingAllocator.cpp``, class
``DeviceCachingAllocator``). Its settings are
:class:`~pytest_torchmem.engine.tracing.devices.cuda.allocator_config.AllocatorConfig`
(``PYTORCH_CUDA_ALLOC_CONF``, parsed per torch release), its constants
(``kMinBlockSize``, ``kSmallSize``, ...) are in
:mod:`~pytest_torchmem.engine.tracing.devices.cuda.allocator_constants`, its blocks,
segments and pools in :mod:`~pytest_torchmem.engine.tracing.devices.cuda.allocator_blocks`.

What is modelled, each after the C++ function named in its docstring:

* request rounding (``round_size``, ``roundup_power2_next_division``,
  ``AcceleratorAllocatorConfig::roundup_power2_divisions``);
* the small (<= 1 MiB) and large pools (``get_pool``) and segment sizes
  (``get_allocation_size``: 2 MiB, ``large_segment_size`` = 20 MiB below
  10 MiB, else a multiple of 2 MiB);
* best fit among the cached blocks of the request's stream, ordered by
  (stream, size, address) (``get_free_block``), with the ``max_split_size``
  and ``max_non_split_rounding_size`` rules for oversize blocks;
* splitting (``should_split``, ``alloc_found_block``) and merging on free
  (``free_block``, ``try_merge_blocks``);
* when a new segment cannot be had: garbage collection
  (``garbage_collect_cached_blocks``), freeing oversize cached blocks
  (``release_available_cached_blocks``), freeing every unsplit cached block
  (``release_cached_blocks``) and retrying, then out of memory;
* expandable segments (``find_expandable_block``, ``map_block``,
  ``try_allocate_expandable_block``, ``unmap_block``, ``release_blocks``);
* the statistics ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``,
  ``requested_bytes`` (aggregate) with their peaks and ``resetPeakStats``;
* settings changed mid-run (``torch.cuda.memory._set_allocator_settings``,
  ``torch.cuda.set_per_process_memory_fraction``).

``tests/test_cuda_conformance.py`` replays the facts PyTorch's own GPU tests
assert about this allocator, with their sources.

The device is a number of bytes (``capacity``, unlimited by default): a new
segment or page fails once the reserved bytes would pass it, or pass
``per_process_memory_fraction`` of it; memory held by the CUDA context or
other processes is the caller's to subtract.

Streams are the caller's to name: ``malloc(nbytes, stream)`` keys the block, and a
freed block returns to its own stream's free blocks (the trace charges FSDP2's
side streams so, see ``engine/parallel/mesh.py``).

Not modelled: CUDA graph private pools and mempools, ``record_stream`` and
its events (so "active" equals "allocated"; FSDP2 and ProcessGroupNCCL of
torch 2.10 to 2.15 record none on CUDA), the free-memory callbacks, IPC,
``backend:cudaMallocAsync``. Addresses are the simulator's own: new segments
get fresh, increasing addresses, which only decide ties between cached
blocks of equal size (the real ``cudaMalloc`` may hand out addresses in
another order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from pytest_torchmem.engine.tracing.devices.cuda.allocator_blocks import (
    Block,
    BlockPool,
    Segment,
    format_size,
)
from pytest_torchmem.engine.tracing.devices.cuda.allocator_config import AllocatorConfig, tokenize
from pytest_torchmem.engine.tracing.devices.cuda.allocator_constants import (
    EXPANDABLE_VA_EXTRA_DIVISOR,
    KLARGE_BUFFER,
    KMIN_BLOCK_SIZE,
    KMIN_LARGE_ALLOC,
    KROUND_LARGE,
    KSMALL_BUFFER,
    KSMALL_SIZE,
    ONE_EXA_BYTES,
    SIZE_MAX,
)

__all__ = [
    "AllocatorConfig",
    "Block",
    "CachingAllocator",
    "OutOfMemoryError",
    "Segment",
    "KMIN_BLOCK_SIZE",
    "KSMALL_SIZE",
    "KSMALL_BUFFER",
    "KMIN_LARGE_ALLOC",
    "KROUND_LARGE",
    "KLARGE_BUFFER",
    "SIZE_MAX",
]

# The simulator's own choices (no C++ counterpart: real addresses are cudaMalloc's).
#: Virtual address space of an expandable segment when no device capacity is
#: given (real: 9/8 of the device memory); larger than any accepted request.
_UNBOUNDED_VA: Final = 1 << 62
#: Alignment of the simulated ``cudaMalloc`` addresses.
_ADDRESS_ALIGN: Final = 2 * 1024 * 1024
#: The first simulated address.
_FIRST_ADDRESS: Final = 1 << 40


class OutOfMemoryError(MemoryError):
    """The simulated device ran out of memory (``torch.OutOfMemoryError``)."""


class CachingAllocator:
    """One device's ``DeviceCachingAllocator``.

    ``capacity`` is the device memory in bytes that ``cudaMalloc``/``cuMemCreate``
    can hand out (``None``: unlimited); it is also the ``totalGlobalMem`` that
    ``per_process_memory_fraction`` and expandable segments' address ranges
    are computed from.
    """

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError("capacity must be positive")
        self._capacity = capacity
        self._allowed: int | None = None
        self._small = BlockPool(small=True)
        self._large = BlockPool(small=False)
        self._active: set[Block] = set()
        self._segments: dict[int, Segment] = {}
        self._next_address = _FIRST_ADDRESS
        self._apply(config if config is not None else AllocatorConfig(), fraction=True)
        # Statistics (aggregate over both pools).
        self._allocated = self._peak_allocated = 0
        self._reserved = self._peak_reserved = 0
        self._active_bytes = self._peak_active = 0
        self._requested = self._peak_requested = 0
        self._num_alloc_retries = 0
        self._num_ooms = 0
        self._num_device_alloc = 0
        self._num_device_free = 0
        #: Called as ``observer(action, segment, address, size)`` each time device
        #: memory is taken or given back, with the actions of the allocator's
        #: ``record_trace``: ``"segment_alloc"``/``"segment_free"`` (``cudaMalloc``/
        #: ``cudaFree``), ``"segment_map"``/``"segment_unmap"`` (pages of expandable
        #: segments; ``address`` and ``size`` are the pages').
        self.observer: Callable[[str, Segment, int, int], None] | None = None

    def _apply(self, cfg: AllocatorConfig, *, fraction: bool) -> None:
        """Take ``cfg`` as the configuration (and its memory fraction, if ``fraction``)."""
        self._config = cfg
        if fraction:
            # The configuration's per_process_memory_fraction: a cap only below 1.
            self._allowed = None
            if cfg.per_process_memory_fraction < 1.0:
                if self._capacity is None:
                    raise ValueError("per_process_memory_fraction < 1 needs the device capacity")
                self._allowed = int(cfg.per_process_memory_fraction * self._capacity)
        self._gc = self._allowed is not None and cfg.garbage_collection_threshold > 0.0
        # Hot-path copies of the configuration.
        self._max_split = cfg.max_split_size
        self._max_non_split_rounding = cfg.max_non_split_rounding_size
        self._expandable = cfg.expandable_segments
        self._uniform_rounding = not any(d > 1 for d in cfg.roundup_power2_divisions)

    # ------------------------------------------------------------ public API

    def set_allocator_settings(self, text: str) -> None:
        """``torch.cuda.memory._set_allocator_settings(text)``: change the settings mid-run.

        As ``AcceleratorAllocatorConfig::parseArgs`` does on each call,
        ``max_split_size_mb``, ``roundup_power2_divisions`` and
        ``garbage_collection_threshold`` go back to their defaults unless
        ``text`` sets them; the other settings (``expandable_segments``,
        ``max_non_split_rounding_mb``, ...) keep their values unless it does.
        Blocks and segments already made stay as they are; while
        ``expandable_segments`` is off, cached blocks of expandable segments
        made before are not handed out (``get_free_block``).
        """
        parsed = AllocatorConfig.parse(text)
        given = set(tokenize(text))
        old = self._config

        def kept(key: str, name: str) -> object:
            return getattr(parsed if key in given else old, name)

        self._apply(
            AllocatorConfig(
                max_split_size=parsed.max_split_size,
                roundup_power2_divisions=parsed.roundup_power2_divisions,
                garbage_collection_threshold=parsed.garbage_collection_threshold,
                max_non_split_rounding_size=kept(  # type: ignore[arg-type]
                    "max_non_split_rounding_mb", "max_non_split_rounding_size"
                ),
                large_segment_size=kept("large_segment_size_mb", "large_segment_size"),  # type: ignore[arg-type]
                expandable_segments=kept("expandable_segments", "expandable_segments"),  # type: ignore[arg-type]
                per_process_memory_fraction=kept(  # type: ignore[arg-type]
                    "per_process_memory_fraction", "per_process_memory_fraction"
                ),
            ),
            fraction="per_process_memory_fraction" in given,
        )

    def set_memory_fraction(self, fraction: float) -> None:
        """``torch.cuda.set_per_process_memory_fraction(fraction)``: cap the reserved
        bytes at ``int(fraction * capacity)`` (``setMemoryFraction``; the cap holds
        even at 1.0, and garbage collection runs under it)."""
        if isinstance(fraction, bool) or not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        if self._capacity is None:
            raise ValueError("a memory fraction needs the device capacity")
        self._allowed = int(fraction * self._capacity)
        self._gc = self._config.garbage_collection_threshold > 0.0


    @property
    def config(self) -> AllocatorConfig:
        return self._config

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def allocated(self) -> int:
        """``memory_allocated()``: the sizes of the blocks handed out."""
        return self._allocated

    @property
    def reserved(self) -> int:
        """``memory_reserved()``: the bytes of all segments (mapped pages)."""
        return self._reserved

    @property
    def active(self) -> int:
        """``active_bytes``: equal to :attr:`allocated` (no ``record_stream`` here)."""
        return self._active_bytes

    @property
    def requested(self) -> int:
        """``requested_bytes``: the unrounded sizes of the live requests."""
        return self._requested

    @property
    def peak_allocated(self) -> int:
        """``max_memory_allocated()``."""
        return self._peak_allocated

    @property
    def peak_reserved(self) -> int:
        """``max_memory_reserved()``."""
        return self._peak_reserved

    @property
    def peak_active(self) -> int:
        return self._peak_active

    @property
    def peak_requested(self) -> int:
        return self._peak_requested

    @property
    def num_alloc_retries(self) -> int:
        """Mallocs that freed every cached block and retried (``num_alloc_retries``)."""
        return self._num_alloc_retries

    @property
    def num_ooms(self) -> int:
        return self._num_ooms

    @property
    def num_device_alloc(self) -> int:
        """``cudaMalloc`` and ``cuMemMap`` calls (``num_device_alloc``)."""
        return self._num_device_alloc

    @property
    def num_device_free(self) -> int:
        """``cudaFree`` and ``cuMemUnmap`` calls (``num_device_free``)."""
        return self._num_device_free

    @property
    def segments(self) -> list[Segment]:
        """The live segments by address."""
        return [self._segments[a] for a in sorted(self._segments)]

    def reset_peaks(self) -> None:
        """``resetPeakStats``: every peak becomes the current value."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved
        self._peak_active = self._active_bytes
        self._peak_requested = self._requested

    def round_size(self, nbytes: int) -> int:
        """The block size a request asks for (see :meth:`AllocatorConfig.round_size`)."""
        return self._config.round_size(nbytes)

    def malloc(self, nbytes: int, stream: int = 0) -> Block | None:
        """``DeviceCachingAllocator::malloc``: a block of at least ``nbytes`` on ``stream``.

        ``None`` for 0 bytes (``NativeCachingAllocator::allocate`` hands out
        no block). Raises :class:`OutOfMemoryError` when neither a cached
        block nor new device memory can be had, after freeing the cache.
        """
        if nbytes <= 0:
            if nbytes == 0:
                return None
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if nbytes >= ONE_EXA_BYTES:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.")
        if self._uniform_rounding and nbytes >= KMIN_BLOCK_SIZE:
            size = (nbytes + KMIN_BLOCK_SIZE - 1) // KMIN_BLOCK_SIZE * KMIN_BLOCK_SIZE
        else:
            size = self._config.round_size(nbytes)
        pool = self._small if size <= KSMALL_SIZE else self._large
        block = self._get_free_block(pool, size, stream)
        if block is None:
            alloc_size = self._config.allocation_size(size)
            if self._gc:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, stream, retry=False)
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, stream, retry=False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc_size, stream, retry=True)
            if block is None:
                self._num_ooms += 1
                limit = (
                    f"{format_size(self._allowed)} allowed; " if self._allowed is not None else ""
                )
                raise OutOfMemoryError(
                    "CUDA out of memory (simulated). "
                    f"Tried to allocate {format_size(alloc_size)}. "
                    f"Device capacity {format_size(self._capacity or 0)}; {limit}"
                    f"{format_size(self._allocated)} allocated, "
                    f"{format_size(self._reserved - self._allocated)} reserved but unallocated."
                )
        return self._alloc_found_block(block, pool, size, nbytes, self._should_split(block, size))

    def free(self, block: Block | None) -> None:
        """``DeviceCachingAllocator::free``: give a block back to the cache."""
        if block is None:
            return
        if block not in self._active:
            raise ValueError(f"{block!r} is not allocated by this allocator")
        block.allocated = False
        self._allocated -= block.size
        self._free_block(block)

    def empty_cache(self) -> None:
        """``emptyCache``: return every unsplit cached block (and free pages) to the device."""
        self._release_cached_blocks()

    # ------------------------------------------------------- search and split

    def _get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """``get_free_block``: the smallest cached block of the stream that fits.

        Expandable segments count a block followed by unmapped space as big as
        it could grow, so a block in the middle is preferred over the one at the
        end. A request below ``max_split_size`` never takes an oversize block;
        an oversize request takes an oversize block only if it wastes less than
        ``max_non_split_rounding_size`` (the ``kLargeBuffer`` allowance).
        """
        if self._gc:
            pool.gc_calls += 1
        ordered = pool.free.get(stream)
        if ordered is None:
            return None
        i = ordered.lower_bound(size)
        n = len(ordered.keys)
        if i == n:
            return None
        block = ordered.at(i)
        if block.segment.expandable:
            if self._expandable:

                def expandable_size(b: Block) -> int:
                    nxt = b.next
                    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

                i += 1
                while block.segment.expandable and i < n:
                    candidate = ordered.at(i)
                    if expandable_size(candidate) >= expandable_size(block):
                        break
                    block = candidate
                    i += 1
            else:  # expandable segments turned off after some were made
                while block.segment.expandable:
                    i += 1
                    if i == n:
                        return None
                    block = ordered.at(i)
        max_split = self._max_split
        if size < max_split and block.size >= max_split:
            return None
        if size >= max_split and block.size >= size + self._max_non_split_rounding:
            return None
        ordered.remove(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        """``should_split``: keep the remainder as a cached block?

        Small pool or expandable segments: if at least 512 bytes remain. Large
        pool: if the request is below ``max_split_size`` and more than 1 MiB
        remains.
        """
        remaining = block.size - size
        if block.small or self._expandable:
            return remaining >= KMIN_BLOCK_SIZE
        return size < self._max_split and remaining > KSMALL_SIZE

    def _alloc_found_block(
        self, block: Block, pool: BlockPool, size: int, requested: int, split: bool
    ) -> Block:
        """``alloc_found_block``: split off the front ``size`` bytes if asked, hand it out."""
        if split:
            remaining = block
            block = Block(size, remaining.address, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                remaining.segment.head = block
            block.next = remaining
            remaining.prev = block
            remaining.address += size
            remaining.size -= size
            pool.insert(remaining)
        block.allocated = True
        block.requested = requested
        self._active.add(block)
        self._allocated += block.size
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        self._active_bytes += block.size
        if self._active_bytes > self._peak_active:
            self._peak_active = self._active_bytes
        self._requested += requested
        if self._requested > self._peak_requested:
            self._peak_requested = self._requested
        return block

    def _free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours, cache the result."""
        pool = self._small if block.small else self._large
        size, requested = block.size, block.requested
        prev, nxt = block.prev, block.next
        self._try_merge_blocks(block, prev, pool)
        self._try_merge_blocks(block, nxt, pool)
        self._active.discard(block)
        pool.insert(block)
        self._active_bytes -= size
        self._requested -= requested

    def _try_merge_blocks(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        """``try_merge_blocks``: absorb a free neighbour in the same mapping state."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                dst.segment.head = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ---------------------------------------------------- new device memory

    def _new_address(self, size: int) -> int:
        address = self._next_address
        end = address + size + _ADDRESS_ALIGN - 1
        self._next_address = end // _ADDRESS_ALIGN * _ADDRESS_ALIGN
        return address

    def _alloc_block(
        self, pool: BlockPool, size: int, alloc_size: int, stream: int, retry: bool
    ) -> Block | None:
        """``alloc_block``: a new segment of ``alloc_size`` (or mapped pages), or ``None``."""
        if retry:
            self._num_alloc_retries += 1
        if self._allowed is not None and self._reserved + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        if self._capacity is not None and self._reserved + alloc_size > self._capacity:
            return None  # cudaMalloc: cudaErrorMemoryAllocation
        segment = Segment(self._new_address(alloc_size), alloc_size, stream, pool.small, False, 0)
        segment.reserved = alloc_size
        block = Block(alloc_size, segment.address, segment)
        segment.head = block
        self._segments[segment.address] = segment
        self._reserved += alloc_size
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        self._num_device_alloc += 1
        if self.observer is not None:
            self.observer("segment_alloc", segment, segment.address, alloc_size)
        return block

    def _release_block(self, block: Block) -> None:
        """``release_block``: ``cudaFree`` a cached, unsplit, non-expandable segment."""
        assert not block.segment.expandable and not block.is_split and not block.allocated
        pool = self._small if block.small else self._large
        pool.remove(block)
        del self._segments[block.segment.address]
        self._reserved -= block.size
        self._num_device_free += 1
        if self.observer is not None:
            self.observer("segment_free", block.segment, block.segment.address, block.size)

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``.

        Once the reserved bytes pass ``garbage_collection_threshold`` of the
        allowed memory, free unsplit large-pool cached segments whose age (the
        pool's ``get_free_block`` calls since they were cached) is at least the
        average, repeatedly, until the excess is reclaimed or nothing is freed.
        """
        assert self._allowed is not None
        threshold = int(self._config.garbage_collection_threshold * self._allowed)
        if self._reserved <= threshold:
            return
        target = self._reserved - threshold
        pool = self._large
        total_age = 0
        count = 0
        for block in pool.cached():
            if not block.is_split:
                total_age += pool.gc_calls - block.gc_base
                count += 1
        if count == 0:
            return
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in pool.cached():
                age = pool.gc_calls - block.gc_base
                if not block.is_split and not block.segment.expandable and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached blocks, just enough.

        Only with a ``max_split_size``: the smallest oversize block of the
        stream that covers the request, else the largest ones downwards until
        their sizes add up to it.
        """
        max_split = self._max_split
        if max_split == SIZE_MAX:
            return False
        ordered = pool.free.get(stream)
        if ordered is None or not ordered.keys:
            return False
        key = max(size, max_split)
        i = ordered.lower_bound(key)
        if i == len(ordered.keys) or ordered.at(i).segment.expandable:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key:
                block = ordered.at(i)
                if block.size < max_split:
                    break
                if not block.segment.expandable:
                    released += block.size
                    self._release_block(block)
                if i == 0:
                    break
                i -= 1
            return released >= key
        self._release_block(ordered.at(i))
        return True

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks`` (default pool, no capture): ``release_blocks``, both pools."""
        self._release_blocks(self._large)
        self._release_blocks(self._small)

    def _release_blocks(self, pool: BlockPool) -> None:
        """``release_blocks``: free unsplit segments, unmap the free pages of expandable ones."""
        to_unmap: list[Block] = []
        for block in pool.cached():
            if block.segment.expandable:
                to_unmap.append(block)
            elif not block.is_split:
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block, pool)
            if not block.mapped and not block.is_split:
                # ``release_expandable_segment``: nothing of it is mapped any more.
                pool.remove_unmapped(block)
                del self._segments[block.segment.address]

    # ------------------------------------------------- expandable segments

    def _try_allocate_expandable_block(
        self, pool: BlockPool, size: int, stream: int
    ) -> Block | None:
        """``try_allocate_expandable_block``: map pages until a free run covers ``size``."""
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map_block(following, min(size - candidate.size, following.size), pool):
                return None
            candidate = following  # it absorbed the old candidate
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block:
        """``find_expandable_block``: the lowest unmapped range (with a free block
        just before it) with room for ``size``; else a new expandable segment.

        Pages are 2 MiB in the small pool and ``large_segment_size`` (20 MiB)
        in the large pool; the address range is 9/8 of the device capacity.
        """
        unmapped = pool.unmapped.get(stream)
        if unmapped is not None:
            for address in unmapped.keys:
                candidate = unmapped.blocks[address]
                if candidate.prev is not None and not candidate.prev.allocated:
                    candidate = candidate.prev
                room = 0
                block: Block | None = candidate
                while room < size and block is not None and not block.allocated:
                    room += block.size
                    block = block.next
                if room >= size:
                    return candidate
        page = KSMALL_BUFFER if pool.small else self._config.large_segment_size
        if self._capacity is None:
            handles = -(-_UNBOUNDED_VA // page)
        else:
            va = self._capacity + self._capacity // EXPANDABLE_VA_EXTRA_DIVISOR
            handles = -(-va // page)
        va_size = handles * page
        segment = Segment(self._new_address(va_size), va_size, stream, pool.small, True, page)
        self._segments[segment.address] = segment
        candidate = Block(va_size, segment.address, segment, mapped=False)
        segment.head = candidate
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: Block, size: int, pool: BlockPool) -> bool:
        """``map_block``: map the pages covering the first ``size`` bytes of an
        unmapped block, merge them with free neighbours, cache the result."""
        segment = to_map.segment
        mapped = -(-size // segment.page) * segment.page
        if self._capacity is not None and self._reserved + mapped > self._capacity:
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.size - mapped, to_map.address + mapped, segment, mapped=False)
            rest.prev = to_map
            rest.next = to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.insert_unmapped(rest)
            to_map.size = mapped
        start = to_map.address
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        segment.reserved += mapped
        self._reserved += mapped
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        self._num_device_alloc += 1
        if self.observer is not None:
            self.observer("segment_map", segment, start, mapped)
        return True

    def _unmap_block(self, block: Block, pool: BlockPool) -> None:
        """``unmap_block``: unmap the whole pages inside a cached expandable block."""
        segment = block.segment
        page = segment.page
        offset = block.address - segment.address
        begin = -(-offset // page)
        end = (offset + block.size) // page
        if begin >= end:
            return
        pool.remove(block)
        start = segment.address + begin * page
        length = (end - begin) * page
        before = start - block.address
        if before > 0:
            head = Block(before, block.address, segment)
            head.prev = block.prev
            head.next = block
            if block.prev is not None:
                block.prev.next = head
            else:
                segment.head = head
            block.prev = head
            pool.insert(head)
        after = block.size - before - length
        if after > 0:
            tail = Block(after, start + length, segment)
            tail.prev = block
            tail.next = block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            pool.insert(tail)
        block.address = start
        block.size = length
        block.mapped = False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        segment.reserved -= length
        self._reserved -= length
        self._num_device_free += 1
        if self.observer is not None:
            self.observer("segment_unmap", segment, start, length)
