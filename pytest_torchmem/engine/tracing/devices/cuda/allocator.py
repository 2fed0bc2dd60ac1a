"""A simulator of PyTorch's native CUDA caching allocator.

Pure Python, no torch: it replays ``malloc``/``free`` timelines and reports
what ``torch.cuda.memory_allocated()``/``memory_reserved()`` and their
``max_*`` peaks would read on a real GPU with the native allocator of torch
2.13/2.14 (``c10/cuda/CUDACachingAllocator.cpp``, class
``DeviceCachingAllocator``; configuration in ``c10/core/AllocatorConfig.cpp``
and ``c10/cuda/CUDAAllocatorConfig.cpp``).

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
side streams so, see ``engine/parallel.py``).

Not modelled: CUDA graph private pools and mempools, ``record_stream`` and
its events (so "active" equals "allocated"; FSDP2 and ProcessGroupNCCL of
torch 2.10 to 2.15 record none on CUDA), the free-memory callbacks, IPC,
``backend:cudaMallocAsync``. Addresses are the simulator's own: new segments
get fresh, increasing addresses, which only decide ties between cached
blocks of equal size (the real ``cudaMalloc`` may hand out addresses in
another order).
"""

from __future__ import annotations

import os
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from pytest_torchmem.engine.torch_release import torch_minor

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

_MiB: Final = 1024 * 1024

#: ``kMinBlockSize``: every request is rounded up to a multiple of 512 bytes.
KMIN_BLOCK_SIZE: Final = 512
#: ``kSmallSize``: the largest (rounded) request served by the small pool.
KSMALL_SIZE: Final = 1 * _MiB
#: ``kSmallBuffer``: small-pool segments (and small expandable pages).
KSMALL_BUFFER: Final = 2 * _MiB
#: ``kMinLargeAlloc``: requests below it get a ``large_segment_size`` segment.
KMIN_LARGE_ALLOC: Final = 10 * _MiB
#: ``kRoundLarge``: larger requests get a segment rounded up to 2 MiB.
KROUND_LARGE: Final = 2 * _MiB
#: ``kLargeBuffer``: the default ``large_segment_size`` (20 MiB).
KLARGE_BUFFER: Final = 20 * _MiB
#: ``std::numeric_limits<size_t>::max()``: "unlimited" ``max_split_size``.
SIZE_MAX: Final = (1 << 64) - 1

#: ``kRoundUpPowerOfTwoIntervals``: one divisions entry per power-of-two
#: interval from 1 MiB (everything below shares entry 0) to 64 GiB.
_ROUNDUP_INTERVALS: Final = 16
#: ``NativeCachingAllocator::allocate`` refuses requests of 1 EB or more.
_ONE_EB: Final = 1 << 60
#: Virtual address space of an expandable segment when no device capacity is
#: given (real: 9/8 of the device memory); larger than any accepted request.
_UNBOUNDED_VA: Final = 1 << 62
#: Alignment of the simulated ``cudaMalloc`` addresses.
_ADDRESS_ALIGN: Final = 2 * _MiB

_ENV_VARS: Final = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


class OutOfMemoryError(MemoryError):
    """The simulated device ran out of memory (``torch.OutOfMemoryError``)."""


def _format_size(nbytes: int) -> str:
    """Like ``c10::CachingAllocator::format_size``."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1048576:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1073741824:
        return f"{nbytes / 1048576:.2f} MiB"
    return f"{nbytes / 1073741824:.2f} GiB"


def _is_power_of_2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """The allocator settings of ``PYTORCH_CUDA_ALLOC_CONF`` that shape memory.

    Sizes are in bytes. ``roundup_power2_divisions`` has one entry per
    power-of-two size interval, as ``AcceleratorAllocatorConfig`` stores it:
    entry 0 for sizes below 2 MiB, entry ``i`` for ``[2**(20+i), 2**(21+i))``,
    entry 15 for 32 GiB and above; 0 or 1 means no power-of-two rounding.
    ``per_process_memory_fraction`` caps the reserved bytes at that fraction
    of the device capacity (``setMemoryFraction``); garbage collection only
    runs when such a cap exists, as in the C++.

    Build one with :meth:`parse` (the environment variable's syntax) or
    :meth:`from_env`; constructing it directly skips the parser's checks on
    the relations between fields, and then ``max_non_split_rounding_size``
    does not follow ``large_segment_size`` by itself.
    """

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = KLARGE_BUFFER
    large_segment_size: int = KLARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * _ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0

    def __post_init__(self) -> None:
        divisions = tuple(self.roundup_power2_divisions)
        if len(divisions) != _ROUNDUP_INTERVALS:
            raise ValueError(
                f"roundup_power2_divisions needs {_ROUNDUP_INTERVALS} entries, got {len(divisions)}"
            )
        if any(d != 0 and not _is_power_of_2(d) for d in divisions):
            raise ValueError(f"roundup_power2_divisions must be powers of 2 or 0: {divisions}")
        object.__setattr__(self, "roundup_power2_divisions", divisions)
        for name in ("max_split_size", "max_non_split_rounding_size", "large_segment_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise ValueError("garbage_collection_threshold must be in [0.0, 1.0)")
        if not 0.0 <= self.per_process_memory_fraction <= 1.0:
            raise ValueError("per_process_memory_fraction must be in [0.0, 1.0]")

    @classmethod
    def parse(cls, text: str, release: tuple[int, int] | None = None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string, e.g. ``"expandable_segments:True"``.

        Follows ``AcceleratorAllocatorConfig::parseArgs`` (with its first pass
        for ``large_segment_size_mb``) and ``CUDAAllocatorConfig::parseArgs``:
        the same tokens (``,`` ``:`` ``[`` ``]``, whitespace dropped), the same
        value checks. Keys of the pinned-memory allocator,
        ``release_lock_on_cudamalloc``, ``graph_capture_record_stream_reuse``
        and ``expandable_segments_reserve[_by_class]`` are accepted and ignored
        (they do not change the figures modelled here); an unknown key raises
        :class:`ValueError` naming it; settings the simulator does not model
        (``backend:cudaMallocAsync``, ``throw_on_cudamalloc_oom:True``) raise
        :class:`NotImplementedError`. A key newer than torch ``release`` (the
        installed one by default) is unknown there: ``large_segment_size_mb``
        came in 2.11, ``throw_on_cudamalloc_oom`` and ``pinned_free_catch_all``
        in 2.12, ``pinned_max_*`` in 2.13, ``expandable_segments_reserve[_by_class]``
        in 2.15.
        """
        return _Parser(text, release).parse()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllocatorConfig:
        """The configuration PyTorch would read from the environment.

        The first of ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF``
        and ``PYTORCH_ALLOC_CONF`` that is set wins, in that order
        (``AcceleratorAllocatorConfig::instance``); none set: the defaults.
        """
        env = os.environ if environ is None else environ
        for name in _ENV_VARS:
            value = env.get(name)
            if value is not None:
                return cls.parse(value)
        return cls()

    def divisions_for(self, size: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``."""
        index = size.bit_length() - 1 - 20
        if index < 0:
            index = 0
        elif index >= _ROUNDUP_INTERVALS:
            index = _ROUNDUP_INTERVALS - 1
        return self.roundup_power2_divisions[index]

    def round_size(self, size: int) -> int:
        """The block size a request of ``size`` bytes asks for (``round_size``).

        Below 512 bytes: 512. Else, when the size's interval has more than one
        division and ``size > 512 * divisions``, the next of the ``divisions``
        equal steps between the surrounding powers of two
        (``roundup_power2_next_division``); otherwise the next multiple of 512.
        """
        if size < KMIN_BLOCK_SIZE:
            return KMIN_BLOCK_SIZE
        divisions = self.divisions_for(size)
        if divisions > 1 and size > KMIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(size, divisions)
        return (size + KMIN_BLOCK_SIZE - 1) // KMIN_BLOCK_SIZE * KMIN_BLOCK_SIZE

    def allocation_size(self, size: int) -> int:
        """The size of the segment made for a rounded request (``get_allocation_size``)."""
        if size <= KSMALL_SIZE:
            return KSMALL_BUFFER
        if size < KMIN_LARGE_ALLOC:
            return self.large_segment_size
        return (size + KROUND_LARGE - 1) // KROUND_LARGE * KROUND_LARGE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``DeviceCachingAllocator::roundup_power2_next_division``."""
    if _is_power_of_2(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    # ``63 - countLeadingZeros(divisions)``: floor(log2(divisions)).
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


# Keys read by the parsers and not affecting device memory: name -> kind of value.
_IGNORED_KEYS: Final[Mapping[str, str]] = {
    "pinned_use_background_threads": "bool",
    "pinned_max_round_threshold_mb": "size",
    "pinned_max_cached_size_mb": "size",
    "release_lock_on_cudamalloc": "bool",
    "release_lock_on_hipmalloc": "bool",
    "pinned_use_cuda_host_register": "bool",
    "pinned_use_hip_host_register": "bool",
    "graph_capture_record_stream_reuse": "bool",
    "pinned_free_catch_all": "bool",
    "pinned_num_register_threads": "threads",
    "pinned_reserve_segment_size_mb": "positive",
    # 2.15: the virtual address range of expandable segments, which only
    # matters when a request outgrows it (their values are not checked).
    "expandable_segments_reserve": "any",
    "expandable_segments_reserve_by_class": "any",
}
#: Keys that not every release of the window parses: key -> the first release that
#: does (read from each release's ``libc10.so``/``libc10_cuda.so``); an earlier
#: release stops at them with "Unrecognized key", and so does :meth:`AllocatorConfig.parse`.
_KEY_SINCE: Final[Mapping[str, tuple[int, int]]] = {
    "large_segment_size_mb": (2, 11),
    "throw_on_cudamalloc_oom": (2, 12),
    "pinned_free_catch_all": (2, 12),
    "pinned_max_round_threshold_mb": (2, 13),
    "pinned_max_cached_size_mb": (2, 13),
    "expandable_segments_reserve": (2, 15),
    "expandable_segments_reserve_by_class": (2, 15),
}


_MODELLED_KEYS: Final = frozenset(
    {
        "large_segment_size_mb",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "per_process_memory_fraction",
        "backend",
        "throw_on_cudamalloc_oom",
    }
)


def _tokenize(text: str) -> list[str]:
    """``ConfigTokenizer``: split on ``, : [ ]`` (kept as tokens), drop whitespace."""
    tokens: list[str] = []
    buffer: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buffer:
                tokens.append("".join(buffer))
                buffer.clear()
            tokens.append(ch)
        elif not ch.isspace():
            buffer.append(ch)
    if buffer:
        tokens.append("".join(buffer))
    return tokens


class _Parser:
    """One parse of a configuration string; see :meth:`AllocatorConfig.parse`."""

    def __init__(self, text: str, release: tuple[int, int] | None = None) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.release = release

    def check_release(self) -> None:
        """Refuse a key the release does not parse yet (:data:`_KEY_SINCE`), as it does."""
        keys = [t for t in self.tokens if t in _KEY_SINCE]
        if not keys:
            return
        release = torch_minor() if self.release is None else self.release
        for key in keys:
            if release < _KEY_SINCE[key]:
                major, minor = release
                raise self.error(
                    f"Unrecognized key {key!r} in CUDA allocator config "
                    f"(torch {major}.{minor} does not know it)"
                )

    def error(self, message: str) -> ValueError:
        return ValueError(f"PYTORCH_CUDA_ALLOC_CONF={self.text!r}: {message}")

    def token(self, i: int) -> str:
        if i >= len(self.tokens):
            raise self.error("unexpected end of the configuration")
        return self.tokens[i]

    def expect(self, i: int, token: str) -> None:
        if self.token(i) != token:
            raise self.error(f"expected {token!r} but got {self.token(i)!r}")

    def size(self, i: int, key: str) -> int:
        token = self.token(i)
        if not token.isdecimal():
            raise self.error(f"{key} expects a non-negative integer, got {token!r}")
        return int(token)

    def boolean(self, i: int, key: str) -> bool:
        token = self.token(i)
        if token not in ("True", "False"):
            raise self.error(f"{key} expects 'True' or 'False', got {token!r}")
        return token == "True"

    def number(self, i: int, key: str) -> float:
        token = self.token(i)
        try:
            return float(token)
        except ValueError:
            raise self.error(f"{key} expects a number, got {token!r}") from None

    def skip_value(self, i: int) -> int:
        """``ConfigTokenizer::skipKey``: the index of the key's last value token."""
        self.expect(i + 1, ":")
        i += 2
        if self.token(i) != "[":
            return i
        while self.token(i) != "]":
            i += 1
        return i

    def parse(self) -> AllocatorConfig:
        self.check_release()
        tokens = self.tokens
        # First pass, as in AcceleratorAllocatorConfig::parseArgs: the large
        # segment size bounds max_split_size_mb and max_non_split_rounding_mb
        # and is their default.
        large_segment = KLARGE_BUFFER
        i = 0
        while i < len(tokens):
            if tokens[i] == "large_segment_size_mb":
                self.expect(i + 1, ":")
                value = self.size(i + 2, "large_segment_size_mb")
                if value <= KMIN_LARGE_ALLOC // _MiB:
                    raise self.error(
                        "CachingAllocator option large_segment_size_mb must be > "
                        f"{KMIN_LARGE_ALLOC // _MiB} MB, got {value}"
                    )
                large_segment = min(value, SIZE_MAX // _MiB) * _MiB
                i += 2
            i += 1
        max_split = SIZE_MAX
        max_non_split_rounding = large_segment
        divisions = [0] * _ROUNDUP_INTERVALS
        gc_threshold = 0.0
        expandable = False
        fraction = 1.0

        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key == "large_segment_size_mb":
                i = self.skip_value(i)
            elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                self.expect(i + 1, ":")
                i += 2
                value = self.size(i, key)
                if value < large_segment // _MiB:
                    raise self.error(
                        f"CachingAllocator option {key} too small, must be >= "
                        f"{large_segment // _MiB}, got {value}"
                    )
                value = min(value, SIZE_MAX // _MiB) * _MiB
                if key == "max_split_size_mb":
                    max_split = value
                else:
                    max_non_split_rounding = value
            elif key == "garbage_collection_threshold":
                self.expect(i + 1, ":")
                i += 2
                gc_threshold = self.number(i, key)
                if not 0.0 < gc_threshold < 1.0:
                    raise self.error(
                        "garbage_collection_threshold is invalid, set it in (0.0, 1.0), "
                        f"got {gc_threshold}"
                    )
            elif key == "roundup_power2_divisions":
                i = self.parse_divisions(i, divisions)
            elif key == "expandable_segments":
                self.expect(i + 1, ":")
                i += 2
                expandable = self.boolean(i, key)
            elif key == "per_process_memory_fraction":
                self.expect(i + 1, ":")
                i += 2
                fraction = self.number(i, key)
                if not 0.0 <= fraction <= 1.0:
                    raise self.error(
                        "per_process_memory_fraction is invalid, set it in [0.0, 1.0], "
                        f"got {fraction}"
                    )
            elif key == "backend":
                self.expect(i + 1, ":")
                i += 2
                backend = self.token(i)
                if backend == "cudaMallocAsync":
                    raise NotImplementedError(
                        "backend:cudaMallocAsync is not modelled: the simulator follows the "
                        "native caching allocator only (backend:native)"
                    )
                if backend != "native":
                    raise self.error(
                        f"Unknown allocator backend {backend!r}, "
                        "options are native and cudaMallocAsync"
                    )
            elif key == "throw_on_cudamalloc_oom":
                self.expect(i + 1, ":")
                i += 2
                if self.boolean(i, key):
                    raise NotImplementedError(
                        "throw_on_cudamalloc_oom:True is not modelled by the simulator"
                    )
            elif key in _IGNORED_KEYS:
                self.expect(i + 1, ":")
                i += 2
                kind = _IGNORED_KEYS[key]
                if kind == "any":
                    i = self.skip_value(i - 2)
                elif kind == "bool":
                    self.boolean(i, key)
                else:
                    value = self.size(i, key)
                    if kind == "threads" and not (_is_power_of_2(value) and value <= 128):
                        raise self.error(f"{key} must be a power of 2 and <= 128, got {value}")
                    if kind == "positive" and value <= 0:
                        raise self.error(f"{key} must be greater than 0")
            else:
                known = ", ".join(sorted(_MODELLED_KEYS | set(_IGNORED_KEYS)))
                raise self.error(
                    f"Unrecognized key {key!r} in CUDA allocator config (known: {known})"
                )
            if i + 1 < len(tokens):
                self.expect(i + 1, ",")
                i += 1
            i += 1
        return AllocatorConfig(
            max_split_size=max_split,
            max_non_split_rounding_size=max_non_split_rounding,
            large_segment_size=large_segment,
            roundup_power2_divisions=tuple(divisions),
            garbage_collection_threshold=gc_threshold,
            expandable_segments=expandable,
            per_process_memory_fraction=fraction,
        )

    def parse_divisions(self, i: int, divisions: list[int]) -> int:
        """``AcceleratorAllocatorConfig::parseRoundUpPower2Divisions``.

        ``[b1:d1,b2:d2,...,>:dn]``: boundary ``b`` (MiB, a power of two) sets
        the entry of the interval starting at ``b`` MiB (clamped to the 16
        entries); the first pair also fills every entry below it; ``>`` fills
        the entries after the last boundary. A bare value fills all entries.
        """
        self.expect(i + 1, ":")
        i += 2
        if self.token(i) != "[":
            value = self.size(i, "roundup_power2_divisions")
            if not _is_power_of_2(value):
                raise self.error(f"For roundups, the divisions has to be power of 2, got {value}")
            divisions[:] = [value] * _ROUNDUP_INTERVALS
            return i
        first = True
        last_index = 0
        i += 1
        while self.token(i) != "]":
            boundary = self.token(i)
            self.expect(i + 1, ":")
            i += 2
            value = self.size(i, "roundup_power2_divisions")
            if value != 0 and not _is_power_of_2(value):
                raise self.error(
                    "For roundups, the divisions has to be power of 2 or 0 to disable roundup, "
                    f"got {value}"
                )
            if boundary == ">":
                divisions[last_index + 1 :] = [value] * (_ROUNDUP_INTERVALS - last_index - 1)
            else:
                if not boundary.isdecimal() or not _is_power_of_2(int(boundary)):
                    raise self.error(
                        f"For roundups, the intervals have to be power of 2, got {boundary!r}"
                    )
                index = min(int(boundary).bit_length() - 1, _ROUNDUP_INTERVALS - 1)
                if first:
                    divisions[:index] = [value] * index
                    first = False
                divisions[index] = value
                last_index = index
            if self.token(i + 1) != "]":
                self.expect(i + 1, ",")
                i += 1
            i += 1
        return i


# --------------------------------------------------------------------------
# Blocks, segments, pools
# --------------------------------------------------------------------------


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
            f"reserved {_format_size(self.reserved)}>"
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
        size = _format_size(self.size)
        return f"<block {state} {size} at {self.address:#x} stream={self.stream}>"


class _SizeOrdered:
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


class _AddressOrdered:
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


class _BlockPool:
    """``BlockPool``: cached (``blocks``) and unmapped blocks, split by stream."""

    __slots__ = ("small", "free", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: dict[int, _SizeOrdered] = {}
        self.unmapped: dict[int, _AddressOrdered] = {}
        #: ``get_free_blocks_call_count``.
        self.gc_calls = 0

    def insert(self, block: Block) -> None:
        """``BlockPool::insert_into_blocks``."""
        block.gc_base = self.gc_calls
        ordered = self.free.get(block.stream)
        if ordered is None:
            ordered = self.free[block.stream] = _SizeOrdered()
        ordered.add(block)

    def remove(self, block: Block) -> None:
        self.free[block.stream].remove(block)

    def insert_unmapped(self, block: Block) -> None:
        ordered = self.unmapped.get(block.stream)
        if ordered is None:
            ordered = self.unmapped[block.stream] = _AddressOrdered()
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


# --------------------------------------------------------------------------
# The allocator
# --------------------------------------------------------------------------


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
        self._small = _BlockPool(small=True)
        self._large = _BlockPool(small=False)
        self._active: set[Block] = set()
        self._segments: dict[int, Segment] = {}
        self._next_address = 1 << 40
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
        given = set(_tokenize(text))
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
        if nbytes >= _ONE_EB:
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
                    f"{_format_size(self._allowed)} allowed; " if self._allowed is not None else ""
                )
                raise OutOfMemoryError(
                    "CUDA out of memory (simulated). "
                    f"Tried to allocate {_format_size(alloc_size)}. "
                    f"Device capacity {_format_size(self._capacity or 0)}; {limit}"
                    f"{_format_size(self._allocated)} allocated, "
                    f"{_format_size(self._reserved - self._allocated)} reserved but unallocated."
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

    def _get_free_block(self, pool: _BlockPool, size: int, stream: int) -> Block | None:
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
        self, block: Block, pool: _BlockPool, size: int, requested: int, split: bool
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

    def _try_merge_blocks(self, dst: Block, src: Block | None, pool: _BlockPool) -> int:
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
        self, pool: _BlockPool, size: int, alloc_size: int, stream: int, retry: bool
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

    def _release_available_cached_blocks(self, pool: _BlockPool, size: int, stream: int) -> bool:
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

    def _release_blocks(self, pool: _BlockPool) -> None:
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
        self, pool: _BlockPool, size: int, stream: int
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

    def _find_expandable_block(self, pool: _BlockPool, size: int, stream: int) -> Block:
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
            handles = -(-(self._capacity + self._capacity // 8) // page)
        va_size = handles * page
        segment = Segment(self._new_address(va_size), va_size, stream, pool.small, True, page)
        self._segments[segment.address] = segment
        candidate = Block(va_size, segment.address, segment, mapped=False)
        segment.head = candidate
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: Block, size: int, pool: _BlockPool) -> bool:
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

    def _unmap_block(self, block: Block, pool: _BlockPool) -> None:
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
