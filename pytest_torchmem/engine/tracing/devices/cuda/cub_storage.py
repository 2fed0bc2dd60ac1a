"""cub's temporary storage: the bytes a cub device algorithm asks the caching allocator for.

ATen's ``CUB_WRAPPER`` (``ATen/cuda/cub.cuh``) asks a cub algorithm for its
``temp_storage_bytes`` with a null pointer, allocates that many bytes through the
caching allocator, runs the algorithm and frees them. How many bytes cub asks for
depends on the algorithm's tuning policy for the GPU's architecture and on the
CCCL (cub) release that compiled the torch wheel: the CUDA toolkit of PyPI's
Linux build (:data:`CUB_OF_RELEASE`).

Read from CCCL's headers as each toolkit ships them (PyPI's ``nvidia-cuda-cccl-cu12``
12.8.90, ``nvidia-cuda-cccl`` 13.0.85 and 13.2.86, the ``cccl`` pins of the
``cuda-toolkit`` each torch wheel requires):

* ``AliasTemporaries`` (``cub/util_temporary_storage.cuh``; ``alias_temporaries``
  in 3.2): every part rounded up to 256 bytes, plus 255 bytes of base alignment.
* ``DispatchRadixSort`` (``cub/device/dispatch/dispatch_radix_sort.cuh``): 1 byte
  when the items fit one tile of ``SingleTilePolicy``; otherwise (onesweep, every
  policy from sm70 for keys of 4 bytes or more) the bins (passes x 256 x
  ``sizeof(OffsetT)``), the look-back (tiles x 256 x 4), the alternate keys and
  values (none when one pass suffices) and the counters (passes x 4). ``OffsetT``
  is ``unsigned long long``: ATen passes the item count as ``int64_t``
  (``choose_offset_t``; the kernels' names in each wheel say ``y``).
* ``ScanTileState::AllocationSize`` (``cub/agent/single_pass_scan_operators.cuh``):
  ``(tiles + 32)`` tile descriptors of 16 bytes (8-byte values) or 8 bytes (4-byte
  ones). CCCL 3 sizes them through ``tile_state_allocation_size``, its own
  ``AliasTemporaries`` (rounded to 256, plus 255), which the dispatch then aligns
  again: a single-pass scan (``DeviceScan``, ``DeviceSelect::UniqueByKey``) asks
  256 bytes more under CCCL 3 than under CCCL 2.7. The scan-by-key tile state
  (``ReduceByKeyScanTileState``, one 16-byte word of key, value and status) keeps
  the raw formula in both.

Tile sizes (threads x items per thread, after cub's ``RegBoundScaling``) enter
the sort's look-back and the scans' tile counts. Those of the radix sort are
read from the policies; a scan's tile state is padded by 32 descriptors, so its
bytes do not depend on the tile size until the scan spans more than 16 tiles
(8-byte values) or 32 (4-byte ones): :data:`SCAN_TILE_ITEMS` is the smallest
tile the candidate policies have, the bound up to which the figure is exact.
"""

from __future__ import annotations

import math
from typing import Any, Final

from pytest_torchmem.engine.torch_compat.torch_release import of_release, torch_minor

__all__ = [
    "CUB_ALIGN",
    "CUB_OF_RELEASE",
    "SCAN_TILE_ITEMS",
    "alias_temporaries",
    "cub_version",
    "exclusive_scan_bytes",
    "inclusive_scan_int_bytes",
    "run_length_encode_bytes",
    "policy_arch",
    "radix_sort_pairs_bytes",
    "scan_by_key_bytes",
    "select_unique_bytes",
    "unique_by_key_bytes",
]

#: ``CUB_VERSION`` of the CCCL that compiled each release's PyPI Linux wheel: 2.10.0+cu128
#: (CUDA 12.8: CCCL 2.7.0; its kernels are ``DeviceRadixSortPolicy<...>::Policy900``),
#: 2.11 to 2.14 +cu130 (CUDA 13.0: CCCL 3.0.1), 2.15.0+cu132 (CUDA 13.2: CCCL 3.2.0; its
#: kernels are ``detail::radix::policy_hub<...>::Policy1000``). A CPU build models its
#: release's CUDA wheel.
CUB_OF_RELEASE: Final = {
    (2, 10): 200700,
    (2, 11): 300001,
    (2, 12): 300001,
    (2, 13): 300001,
    (2, 14): 300001,
    (2, 15): 300200,
}

#: ``AliasTemporaries``' ``ALIGN_BYTES``.
CUB_ALIGN: Final = 256
#: ``TILE_STATUS_PADDING`` (``warp_threads``): tile descriptors before the first tile's.
_TILE_STATUS_PADDING: Final = 32
#: ``ONESWEEP_RADIX_BITS`` of every policy: 256 digits.
_ONESWEEP_RADIX_BITS: Final = 8
#: ``SingleTilePolicy`` of every policy from sm70: ``AgentRadixSortDownsweepPolicy<256, 19, DominantT>``.
_SINGLE_TILE: Final = (256, 19)
#: The smallest scan tile of the candidate policies (the default ``AgentScanPolicy<128, 15>``
#: under ``MemBoundScaling`` for 8-byte values: 128 x 7): a single-pass scan's tile state
#: is exact up to 16 such tiles.
SCAN_TILE_ITEMS: Final = 128 * 7
#: ``DeviceSelect::UniqueByKey``'s tile for 8-byte keys and values (``tuning_unique_by_key.cuh``,
#: the same in 2.7, 3.0 and 3.2): sm90 448 x 11, sm80 192 x 7.
_UNIQUE_BY_KEY_TILE: Final = {900: 448 * 11, 800: 192 * 7}


def cub_version(release: tuple[int, int] | None = None) -> int:
    """``CUB_VERSION`` modelled for torch ``release`` (the installed one by default);
    outside the window, that of the nearest release in it."""
    return of_release(CUB_OF_RELEASE, torch_minor() if release is None else release)


def _align(nbytes: int) -> int:
    return -(-nbytes // CUB_ALIGN) * CUB_ALIGN


def alias_temporaries(*sizes: int) -> int:
    """``AliasTemporaries``' total: each part rounded up to 256 bytes, plus 255."""
    return sum(_align(size) for size in sizes) + CUB_ALIGN - 1


def policy_arch(gpu: Any) -> int:
    """The cub policy a GPU runs: 900 from compute capability 9.0 (sm90 and sm100 share
    the large-key sort policy), 800 for 8.x, 700 below."""
    major = gpu.compute_capability[0] if gpu is not None else 9  # no profile: the default H100
    return 900 if major >= 9 else 800 if major == 8 else 700


def _reg_bound(threads: int, items: int, dominant: int) -> int:
    """``RegBoundScaling``: the tile of a policy nominal for 4-byte items."""
    scaled_items = max(1, items * 4 // max(4, dominant))
    scaled_threads = min(threads, ((1024 * 48) // (dominant * scaled_items) + 31) // 32 * 32)
    return scaled_threads * scaled_items


def _onesweep_nominal(arch: int, key_size: int, value_size: int) -> tuple[int, int]:
    """The onesweep policy's nominal (threads, items) for keys of 4 or 8 bytes with values,
    ``OffsetT`` of 8 bytes (``tuning_radix_sort.cuh``; ``dispatch_radix_sort.cuh`` in 2.7)."""
    if arch >= 900:  # OnesweepPolicyKey32 / OnesweepPolicyKey64
        if key_size == 4:
            return 384, (17 if value_size < 8 else 29)
        return 384, (30 if value_size < 8 else 24)
    if arch >= 800:
        return 384, (17 if key_size == 4 else 21)
    return 256, (46 if key_size == 4 and value_size == 4 else 23)


def radix_sort_pairs_bytes(n: int, key_size: int, value_size: int, bits: int, gpu: Any = None) -> int:
    """``DeviceRadixSort::SortPairs`` (not double-buffered) of ``n`` pairs over ``bits``
    key bits on ``gpu``'s policy."""
    if n == 0:
        return 1
    dominant = max(key_size, value_size)
    if n <= _reg_bound(*_SINGLE_TILE, dominant):
        return 1  # InvokeSingleTile
    tile = _reg_bound(*_onesweep_nominal(policy_arch(gpu), key_size, value_size), dominant)
    passes = math.ceil(bits / _ONESWEEP_RADIX_BITS)
    offset_size = 8  # choose_offset_t<int64_t>
    return alias_temporaries(
        passes * 256 * offset_size,  # bins
        math.ceil(n / tile) * 256 * 4,  # lookback
        0 if passes <= 1 else n * key_size,  # extra key buffer
        0 if passes <= 1 else n * value_size,  # extra value buffer
        passes * 4,  # counters
    )


def _tile_state_bytes(tiles: int, word: int, version: int) -> int:
    """``ScanTileState<T, true>::AllocationSize``: raw in CCCL 2.7, its own aliased
    blob from CCCL 3."""
    raw = (tiles + _TILE_STATUS_PADDING) * word
    return raw if version < 300000 else alias_temporaries(raw, 0, 0)


def _tile_word(value_size: int) -> int:
    """``ScanTileState``'s ``TxnWord``: 16 bytes for 8-byte values, 8 for 4-byte ones."""
    return 16 if value_size == 8 else 8


def exclusive_scan_bytes(n: int, accum_size: int, version: int | None = None) -> int:
    """``DeviceScan::ExclusiveScan`` of ``n`` items accumulated in ``accum_size`` bytes."""
    version = cub_version() if version is None else version
    tiles = math.ceil(n / SCAN_TILE_ITEMS)
    return alias_temporaries(_tile_state_bytes(tiles, _tile_word(accum_size), version))


def unique_by_key_bytes(n: int, gpu: Any = None, version: int | None = None) -> int:
    """``DeviceSelect::UniqueByKey`` of ``n`` items (``OffsetT`` of 8 bytes: a 16-byte
    tile descriptor), and no virtual shared memory (the tuned agents fit)."""
    version = cub_version() if version is None else version
    tile = _UNIQUE_BY_KEY_TILE[900 if policy_arch(gpu) >= 900 else 800]
    tiles = math.ceil(n / tile)
    return alias_temporaries(_tile_state_bytes(tiles, 16, version), 0)


def scan_by_key_bytes(n: int, key_size: int) -> int:
    """``DeviceScan::InclusiveSumByKey``/``InclusiveScanByKey`` of ``n`` items: the
    ``ReduceByKeyScanTileState`` (one 16-byte word per descriptor, raw in every
    release) and a key per tile plus one."""
    tiles = math.ceil(n / SCAN_TILE_ITEMS)
    return alias_temporaries((tiles + _TILE_STATUS_PADDING) * 16, key_size * (tiles + 1))


#: ``DeviceRunLengthEncode::Encode`` with 8-byte lengths (ATen's counts are ``int64_t``): every
#: release's policies for sm80, sm86, sm90 and sm100 are tuned for 4-byte lengths only, so the
#: default ``AgentReduceByKeyPolicy<128, 6>`` runs (``tuning_run_length_encode.cuh``: six items
#: per thread wherever key and length fit 8 bytes each).
RLE_TILE_ITEMS: Final = 128 * 6
#: The smallest tile ``DeviceSelect::Unique`` may run with, by key size: the default policy's
#: ``128 x min(10, max(1, 40 / sizeof(key)))`` (``tuning_select_if.cuh``; every tuned tile of
#: 2.7, 3.0 and 3.2 for these key sizes is larger). Its tile state (8-byte descriptors, the
#: per-partition offset being ``int``) does not depend on the tile size up to 32 tiles.
SELECT_TILE_ITEMS: Final = {1: 128 * 10, 2: 128 * 10, 4: 128 * 10, 8: 128 * 5}
#: The smallest tile of ``DeviceScan``'s policies for a 4-byte accumulator (``Policy500``'s
#: ``AgentScanPolicy<128, 12>``; sm90 128 x 24, sm80 320 x 12, the others 128 x 15).
SCAN_INT_TILE_ITEMS: Final = 128 * 12
#: Tiles up to which a tile state of 8-byte descriptors keeps its size: 32 padding descriptors
#: and up to 32 tiles fill 512 bytes, one 256-byte alignment step more than the padding alone.
FLAT_TILES_8: Final = 32


def run_length_encode_bytes(n: int) -> int:
    """``DeviceRunLengthEncode::Encode`` of ``n`` items with ``int64_t`` counts
    (``DispatchReduceByKey``, every release): one ``ReduceByKeyScanTileState<int64_t, int,
    true>`` of 16-byte descriptors, raw, through ``AliasTemporaries``."""
    tiles = math.ceil(n / RLE_TILE_ITEMS)
    return alias_temporaries((tiles + _TILE_STATUS_PADDING) * 16)


def select_unique_bytes(n: int, key_size: int, version: int | None = None) -> tuple[int, bool]:
    """``DeviceSelect::Unique`` of ``n`` keys (``DispatchSelectIf``: the tile state, no virtual
    shared memory, no streaming below ``INT_MAX`` items), and whether the figure is exact
    whatever the GPU's policy (the smallest candidate tile spans at most 32 tiles)."""
    version = cub_version() if version is None else version
    tiles = math.ceil(n / SELECT_TILE_ITEMS[key_size])
    return alias_temporaries(_tile_state_bytes(tiles, 8, version)), tiles <= FLAT_TILES_8


def inclusive_scan_int_bytes(n: int, version: int | None = None) -> tuple[int, bool]:
    """``DeviceScan::InclusiveScan`` of ``n`` ``int`` items into ``int64_t`` (ATen's
    ``inclusive_sum_truncating``: the accumulator is the input's ``int``, 8-byte descriptors),
    and whether the figure is exact whatever the GPU's policy."""
    version = cub_version() if version is None else version
    tiles = math.ceil(n / SCAN_INT_TILE_ITEMS)
    return alias_temporaries(_tile_state_bytes(tiles, 8, version)), tiles <= FLAT_TILES_8
