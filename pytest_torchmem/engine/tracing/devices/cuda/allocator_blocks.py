"""The caching allocator's bookkeeping: segments, their blocks, and the per-stream pools of free blocks.

The data structures of ``c10/cuda/CUDACachingAllocator.cpp`` (``Block``,
``ExpandableSegment``'s ranges, ``BlockPool`` with its ``BlockComparatorSize``
order), without the policy: :class:`~pytest_torchmem.engine.tracing.devices.cuda.allocator.CachingAllocator`
decides what is split, merged, cached and released.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator

__all__ = ["AddressOrdered", "Block", "BlockPool", "Segment", "SizeOrdered", "format_size"]


def format_size(nbytes: int) -> str:
    """Like ``c10::CachingAllocator::format_size``."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1048576:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1073741824:
        return f"{nbytes / 1048576:.2f} MiB"
    return f"{nbytes / 1073741824:.2f} GiB"


class Segment:
    """Device memory the allocator holds: one ``cudaMalloc``, or one expandable segment.

    ``reserved`` is the bytes it counts in ``memory_reserved()``: the whole
    ``size`` for a ``cudaMalloc`` segment, the mapped pages for an expandable
    one (whose ``size`` is its virtual address range).
    """

    __slots__ = ("address", "size", "stream", "small", "expandable", "page", "reserved", "head")

    def __init__(
        self, address: int, size: int, stream: int, small: bool, expandable: bool, page: int
    ) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.small = small
        self.expandable = expandable
        #: Granularity of mapping (expandable segments; 0 otherwise).
        self.page = page
        self.reserved = 0
        #: The block at the lowest address.
        self.head: Block | None = None

    def blocks(self) -> Iterator[Block]:
        """The segment's blocks by address (unmapped ranges included)."""
        block = self.head
        while block is not None:
            yield block
            block = block.next

    def __repr__(self) -> str:
        kind = "expandable" if self.expandable else "segment"
        pool = "small" if self.small else "large"
        return (
            f"<{kind} {pool} stream={self.stream} at {self.address:#x}: "
            f"reserved {format_size(self.reserved)}>"
        )


class Block:
    """A range of a segment: handed out by :meth:`CachingAllocator.malloc`, cached, or unmapped.

    ``size`` is what the block charges to ``memory_allocated()`` while it is
    handed out (the rounded request, or more when the block was not split);
    ``requested`` the bytes asked for.
    """

    __slots__ = (
        "size",
        "requested",
        "address",
        "stream",
        "small",
        "segment",
        "allocated",
        "mapped",
        "prev",
        "next",
        "gc_base",
    )

    def __init__(self, size: int, address: int, segment: Segment, mapped: bool = True) -> None:
        self.size = size
        self.requested = 0
        self.address = address
        self.stream = segment.stream
        self.small = segment.small
        self.segment = segment
        self.allocated = False
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        #: ``gc_count_base``: the pool's ``get_free_block`` count when cached.
        self.gc_base = 0

    @property
    def is_split(self) -> bool:
        """``Block::is_split``: it shares its segment with other blocks."""
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        size = format_size(self.size)
        return f"<block {state} {size} at {self.address:#x} stream={self.stream}>"


class SizeOrdered:
    """The cached blocks of one pool and stream, ordered by (size, address)."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        insort(self.keys, (block.size, block.address))
        self.blocks[block.address] = block

    def remove(self, block: Block) -> None:
        key = (block.size, block.address)
        i = bisect_left(self.keys, key)
        assert self.keys[i] == key, "block is not cached"
        del self.keys[i]
        del self.blocks[block.address]

    def lower_bound(self, size: int) -> int:
        return bisect_left(self.keys, (size, -1))

    def at(self, i: int) -> Block:
        return self.blocks[self.keys[i][1]]


class AddressOrdered:
    """The unmapped blocks of one pool and stream, ordered by address."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        insort(self.keys, block.address)
        self.blocks[block.address] = block

    def remove(self, block: Block) -> None:
        i = bisect_left(self.keys, block.address)
        assert self.keys[i] == block.address, "block is not unmapped"
        del self.keys[i]
        del self.blocks[block.address]


class BlockPool:
    """``BlockPool``: cached (``blocks``) and unmapped blocks, split by stream."""

    __slots__ = ("small", "free", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: dict[int, SizeOrdered] = {}
        self.unmapped: dict[int, AddressOrdered] = {}
        #: ``get_free_blocks_call_count``.
        self.gc_calls = 0

    def insert(self, block: Block) -> None:
        """``BlockPool::insert_into_blocks``."""
        block.gc_base = self.gc_calls
        ordered = self.free.get(block.stream)
        if ordered is None:
            ordered = self.free[block.stream] = SizeOrdered()
        ordered.add(block)

    def remove(self, block: Block) -> None:
        self.free[block.stream].remove(block)

    def insert_unmapped(self, block: Block) -> None:
        ordered = self.unmapped.get(block.stream)
        if ordered is None:
            ordered = self.unmapped[block.stream] = AddressOrdered()
        ordered.add(block)

    def remove_unmapped(self, block: Block) -> None:
        self.unmapped[block.stream].remove(block)

    def cached(self) -> list[Block]:
        """Every cached block in ``BlockComparatorSize`` order (stream, size, address)."""
        result: list[Block] = []
        for stream in sorted(self.free):
            ordered = self.free[stream]
            result.extend(ordered.blocks[address] for _, address in ordered.keys)
        return result
