"""Parsing and validating the caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``), per torch release.

:class:`AllocatorConfig` holds the settings that shape device memory, with the
request rounding and segment sizes that follow from them; :meth:`AllocatorConfig.parse`
reads the environment variable's syntax as ``AcceleratorAllocatorConfig::parseArgs``
(``c10/core/AllocatorConfig.cpp``) and ``CUDAAllocatorConfig::parseArgs``
(``c10/cuda/CUDAAllocatorConfig.cpp``) do, refusing a key the torch release in
question does not know yet (:data:`KEY_SINCE`). No torch import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cuda.allocator_constants import (
    KLARGE_BUFFER,
    KMB,
    KMIN_BLOCK_SIZE,
    KMIN_LARGE_ALLOC,
    KPINNED_MAX_REGISTER_THREADS,
    KROUND_LARGE,
    KROUNDUP_POWER2_INTERVALS,
    KROUNDUP_POWER2_START_LOG2,
    KSMALL_BUFFER,
    KSMALL_SIZE,
    SIZE_MAX,
)

__all__ = ["ENV_VARS", "KEY_SINCE", "AllocatorConfig", "tokenize"]

#: The variables ``AcceleratorAllocatorConfig::instance`` reads, the first set one winning.
ENV_VARS: Final = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _is_power_of_2(value: int) -> bool:
    """``llvm::isPowerOf2_64``."""
    return value > 0 and value & (value - 1) == 0


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
    roundup_power2_divisions: tuple[int, ...] = (0,) * KROUNDUP_POWER2_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0

    def __post_init__(self) -> None:
        divisions = tuple(self.roundup_power2_divisions)
        if len(divisions) != KROUNDUP_POWER2_INTERVALS:
            raise ValueError(
                f"roundup_power2_divisions needs {KROUNDUP_POWER2_INTERVALS} entries, got {len(divisions)}"
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
        for name in ENV_VARS:
            value = env.get(name)
            if value is not None:
                return cls.parse(value)
        return cls()

    def divisions_for(self, size: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``."""
        index = size.bit_length() - 1 - KROUNDUP_POWER2_START_LOG2
        if index < 0:
            index = 0
        elif index >= KROUNDUP_POWER2_INTERVALS:
            index = KROUNDUP_POWER2_INTERVALS - 1
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
KEY_SINCE: Final[Mapping[str, tuple[int, int]]] = {
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


def tokenize(text: str) -> list[str]:
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
        self.tokens = tokenize(text)
        self.release = release

    def check_release(self) -> None:
        """Refuse a key the release does not parse yet (:data:`KEY_SINCE`), as it does."""
        keys = [t for t in self.tokens if t in KEY_SINCE]
        if not keys:
            return
        release = torch_minor() if self.release is None else self.release
        for key in keys:
            if release < KEY_SINCE[key]:
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
                if value <= KMIN_LARGE_ALLOC // KMB:
                    raise self.error(
                        "CachingAllocator option large_segment_size_mb must be > "
                        f"{KMIN_LARGE_ALLOC // KMB} MB, got {value}"
                    )
                large_segment = min(value, SIZE_MAX // KMB) * KMB
                i += 2
            i += 1
        max_split = SIZE_MAX
        max_non_split_rounding = large_segment
        divisions = [0] * KROUNDUP_POWER2_INTERVALS
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
                if value < large_segment // KMB:
                    raise self.error(
                        f"CachingAllocator option {key} too small, must be >= "
                        f"{large_segment // KMB}, got {value}"
                    )
                value = min(value, SIZE_MAX // KMB) * KMB
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
                    limit = KPINNED_MAX_REGISTER_THREADS
                    if kind == "threads" and not (_is_power_of_2(value) and value <= limit):
                        raise self.error(f"{key} must be a power of 2 and <= {limit}, got {value}")
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
            divisions[:] = [value] * KROUNDUP_POWER2_INTERVALS
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
                divisions[last_index + 1 :] = [value] * (KROUNDUP_POWER2_INTERVALS - last_index - 1)
            else:
                if not boundary.isdecimal() or not _is_power_of_2(int(boundary)):
                    raise self.error(
                        f"For roundups, the intervals have to be power of 2, got {boundary!r}"
                    )
                index = min(int(boundary).bit_length() - 1, KROUNDUP_POWER2_INTERVALS - 1)
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
