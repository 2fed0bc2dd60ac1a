"""The constants of PyTorch's CUDA caching allocator that the simulator follows, each with its source.

Every value here is the same in torch 2.10 to 2.15, read from each release's own
files: the headers a wheel ships (``torch/include/c10/core/AllocatorConfig.h``,
CPU and CUDA builds alike) and, for the constants of ``.cpp`` files, the compiled
code of ``libc10.so`` / ``libc10_cuda.so``. ``tests/test_cuda_allocator.py``
(``test_*_is_pinned_*``) reads them again from the installed torch, so a release
that changes one fails there. No torch import: the simulator is pure Python.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "KLARGE_BUFFER",
    "KMB",
    "KMIN_BLOCK_SIZE",
    "KMIN_LARGE_ALLOC",
    "KPINNED_MAX_REGISTER_THREADS",
    "KROUNDUP_POWER2_INTERVALS",
    "KROUNDUP_POWER2_START_LOG2",
    "KROUND_LARGE",
    "KSMALL_BUFFER",
    "KSMALL_SIZE",
    "EXPANDABLE_VA_EXTRA_DIVISOR",
    "ONE_EXA_BYTES",
    "SIZE_MAX",
]

#: ``kMB`` (``c10/core/AllocatorConfig.cpp``): what the ``*_mb`` keys of
#: ``PYTORCH_CUDA_ALLOC_CONF`` multiply their value by.
KMB: Final = 1024 * 1024

#: ``kMinBlockSize`` (``c10/core/AllocatorConfig.h``; used by
#: ``c10/cuda/CUDACachingAllocator.cpp: round_size``): every request is rounded up
#: to a multiple of 512 bytes.
KMIN_BLOCK_SIZE: Final = 512
#: ``kSmallSize`` (``c10/core/AllocatorConfig.h``; ``CUDACachingAllocator.cpp:
#: get_pool``): the largest (rounded) request served by the small pool, 1 MiB.
KSMALL_SIZE: Final = 1 * KMB
#: ``kSmallBuffer`` (``c10/core/AllocatorConfig.h``; ``CUDACachingAllocator.cpp:
#: get_allocation_size``, ``ExpandableSegment``): small-pool segments and small
#: expandable pages, 2 MiB.
KSMALL_BUFFER: Final = 2 * KMB
#: ``kMinLargeAlloc`` (``c10/core/AllocatorConfig.h``; ``CUDACachingAllocator.cpp:
#: get_allocation_size``): requests below 10 MiB get a ``large_segment_size``
#: segment; the floor of ``large_segment_size_mb`` (``AcceleratorAllocatorConfig::
#: parseLargeSegmentSize``).
KMIN_LARGE_ALLOC: Final = 10 * KMB
#: ``kRoundLarge`` (``c10/core/AllocatorConfig.h``; ``CUDACachingAllocator.cpp:
#: get_allocation_size``): larger requests get a segment rounded up to 2 MiB.
KROUND_LARGE: Final = 2 * KMB
#: ``kLargeBuffer``: the default ``large_segment_size``, 20 MiB: a constant of
#: ``c10/core/AllocatorConfig.h`` in 2.10, the initial value of
#: ``AcceleratorAllocatorConfig::large_segment_size_`` (same header) from 2.11;
#: also the default ``max_non_split_rounding_size`` and expandable large page.
KLARGE_BUFFER: Final = 20 * KMB
#: ``std::numeric_limits<size_t>::max()``: the "unlimited" ``max_split_size_``
#: (``c10/core/AllocatorConfig.h``).
SIZE_MAX: Final = (1 << 64) - 1

#: ``kRoundUpPowerOfTwoIntervals`` (``c10/core/AllocatorConfig.cpp``; the clamp
#: ``mov $0xf`` of ``AcceleratorAllocatorConfig::roundup_power2_divisions(size_t)``):
#: one divisions entry per power-of-two interval from 1 MiB (everything below
#: shares entry 0) to 32 GiB and above.
KROUNDUP_POWER2_INTERVALS: Final = 16
#: ``log2(kRoundUpPowerOfTwoStart)`` (``c10/core/AllocatorConfig.cpp``:
#: ``kRoundUpPowerOfTwoStart = 1 MiB``; ``$0x14`` in
#: ``roundup_power2_divisions(size_t)``): the interval of entry 1 starts at 2**20 * 2.
KROUNDUP_POWER2_START_LOG2: Final = 20
#: ``kPinnedMaxRegisterThreads`` (``c10/core/AllocatorConfig.h``/``.cpp``,
#: ``parsePinnedNumRegisterThreads``): the most ``pinned_num_register_threads``.
KPINNED_MAX_REGISTER_THREADS: Final = 128

#: ``one_exa_bytes`` (``c10/cuda/CUDACachingAllocator.cpp:
#: NativeCachingAllocator::malloc``): requests of 1 EB (2**60 bytes) or more are
#: refused with "Tried to allocate more than 1EB memory."
ONE_EXA_BYTES: Final = 1 << 60
#: The virtual address range of an expandable segment is the device memory plus
#: one eighth of it (``c10/cuda/CUDACachingAllocator.cpp: ExpandableSegment``:
#: ``max_handles_ = numSegments(prop.totalGlobalMem + prop.totalGlobalMem / 8)``),
#: "for some cases where we have to unmap pages earlier in the segment to put them
#: at the end"; only a request larger than the device could outgrow it.
EXPANDABLE_VA_EXTRA_DIVISOR: Final = 8
