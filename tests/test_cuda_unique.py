"""``unique`` on the fake cuda device: outputs made at the input's size (UniqueCub.cu's
``compute_unique`` resizes them down, keeping the storage), the sorted copy, the inverse's
buffers and cub's storage per CCCL release. Hand counts from ``UniqueCub.cu``
(``UniqueCub::operator()``, ``compute_unique``, ``unique_cuda_template``; the same calls in
every release 2.10-2.15), ATen/cuda/cub.cuh and CCCL's dispatch and tuning headers."""

from __future__ import annotations

from typing import Any

import pytest

import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cuda import CUDA, cub_storage
from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.engine.tracing.rules import Alloc, Free, Inexact, OpCall, Output, TraceContext

from torch_sources import cuda_library, has_function

aten = torch.ops.aten

#: 2.10 (CCCL 2.7: a tile state's raw size), 2.11-2.14 (CCCL 3.0) and 2.15 (CCCL 3.2: the tile
#: state aliased on its own first, 256 bytes more).
RELEASES = [(2, 10), (2, 11), (2, 13), (2, 15)]


@pytest.fixture
def release(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    monkeypatch.setattr(cub_storage, "torch_minor", lambda: request.param)
    return request.param


def unique_steps(x: torch.Tensor, *args: Any, func: Any = aten._unique2.default, gpu: str = "H100") -> list[Any]:
    rule = CUDA.scratch_rule(func)
    assert rule is not None
    return list(rule(OpCall(func, (x, *args), {}, None, TraceContext("cuda", gpu=gpu_profile(gpu)))))


def allocs(steps: list[Any]) -> list[tuple[str, int]]:
    assert not any(isinstance(s, Inexact) for s in steps)
    tags = [s.tag for s in steps if isinstance(s, Alloc)]
    assert sorted(tags) == sorted(s.tag for s in steps if isinstance(s, Free))  # all freed on return
    return [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)]


def _tile_state_8(tiles: int, release: tuple[int, int]) -> int:
    """An 8-byte-descriptor tile state of ``tiles`` (<= 32) tiles, aliased by the dispatch:
    (tiles + 32) x 8 in (256, 512]: 512 + 255 under CCCL 2.7; CCCL 3 aliases it on its own
    first (512 + 255 = 767), then the dispatch again (768 + 255)."""
    assert 1 <= tiles <= 32
    return 512 + 255 if release < (2, 11) else 768 + 255


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_unique_of_int64_sorts_its_keys_and_selects(release: tuple[int, int]) -> None:
    """torch.unique of 4096 int64 (sorted, no inverse, no counts) on an H100:
    UniqueCub: sorted = at::empty(self.sizes()) (32768); radix_sort_keys of 4096 8-byte keys
    over 64 bits: above one SingleTilePolicy tile (256 x 19 scaled for 8-byte items: 9 items,
    2304), onesweep OnesweepPolicyKey64 keys only <384, 30> -> 15 items, tile 5760, one tile:
    bins 8 passes x 256 x 8 = 16384, look-back 1024, alternate keys 32768, counters 32 -> 256,
    plus 255. compute_unique: no inverse (empty({0})), data_out (output 0) and counts
    (empty({0})), length (8 bytes), DeviceSelect::Unique: 8-byte keys, the smallest tile
    128 x 5 = 640 -> 7 tiles, an 8-byte-descriptor tile state (int offsets)."""
    steps = unique_steps(torch.empty(4096, dtype=torch.long, device="meta"), False, False, False)
    assert allocs(steps) == [
        ("unique:sorted", 32768),
        ("unique:sort:temp", 16384 + 1024 + 32768 + 256 + 255),
        ("unique:length", 8),
        ("unique:temp", _tile_state_8(7, release)),
    ]
    outputs = [s.index for s in steps if isinstance(s, Output)]
    assert outputs == [1, 0, 2]  # the inverse is made first, then the values and the counts


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_unique_with_inverse_and_counts(release: tuple[int, int]) -> None:
    """4096 floats, return_inverse and return_counts: the sorted copy (16384); range =
    arange(4096) and sorted_indices (32768 each); radix_sort_pairs<float, int64> (Policy900's
    OnesweepPolicyKey32 for 8-byte values <384, 29> -> 14 items, tile 5376, one tile): bins
    4 x 256 x 8 = 8192, look-back 1024, alternate keys 16384 and values 32768, counters 16 ->
    256, plus 255; range freed. The inverse (output 1), inv_loc_out (int64, 32768) and
    inclusive_sum_truncating's DeviceScan of 4096 ints (the smallest tile 128 x 12 = 1536:
    3 tiles). Then the values and counts (outputs 0 and 2: 16384 and 32768 bytes), length and
    DeviceRunLengthEncode::Encode: 128 x 6 = 768 items a tile, 6 tiles, (6 + 32) x 16 = 608
    -> 768, plus 255 (every release)."""
    steps = unique_steps(torch.empty(4096, device="meta"), False, True, True)
    assert allocs(steps) == [
        ("unique:sorted", 16384),
        ("unique:range", 32768),
        ("unique:sorted_indices", 32768),
        ("unique:sort:temp", 8192 + 1024 + 16384 + 32768 + 256 + 255),
        ("unique:inv_loc_out", 32768),
        ("unique:scan:temp", _tile_state_8(3, release)),
        ("unique:length", 8),
        ("unique:temp", 768 + 255),
    ]


@pytest.mark.parametrize("release", RELEASES, indirect=True)
def test_unique_consecutive_neither_sorts_nor_scatters(release: tuple[int, int]) -> None:
    """unique_consecutive of 4096 int32 with the inverse: sorted = self (no copy, no sort);
    inv_loc = at::empty({num_inp}, kInt) (16384) scanned into the inverse; the select by
    DeviceSelect::Unique of 4-byte keys (128 x 10 = 1280: 4 tiles)."""
    x = torch.empty(4096, dtype=torch.int32, device="meta")
    steps = unique_steps(x, True, False, None, func=aten.unique_consecutive.default)
    assert allocs(steps) == [
        ("unique:inv_loc", 16384),
        ("unique:scan:temp", _tile_state_8(3, release)),
        ("unique:length", 8),
        ("unique:temp", _tile_state_8(4, release)),
    ]


def test_unique_of_a_transposed_input_copies_it() -> None:
    """unique_cuda_template takes self.expect_contiguous(): a transposed 64 x 64 float input
    is copied (16384), held to the end."""
    x = torch.empty(64, 64, device="meta").t()
    assert allocs(unique_steps(x, False, False, func=aten._unique.default))[0] == ("unique:self.contiguous()", 16384)


def test_unique_flags_what_is_not_modelled() -> None:
    """Half keys past one SingleTilePolicy tile (256 x 19 for 2-byte keys: 4864) take cub's
    small-key radix sort tuning, bool inputs cub's DeviceReduce (not modelled): listed; a
    select past 32 tiles of its smallest policy is listed too."""
    half = torch.empty(4865, dtype=torch.float16, device="meta")
    flags = torch.empty(4096, dtype=torch.bool, device="meta")
    for x in (half, flags):
        assert any(isinstance(s, Inexact) for s in unique_steps(x, False, False, False))
    one_tile = unique_steps(torch.empty(4864, dtype=torch.float16, device="meta"), False, False, False)
    assert ("unique:sort:temp", 1) in allocs(one_tile)
    for n, listed in ((32 * 640, False), (32 * 640 + 1, True)):
        steps = unique_steps(torch.empty(n, dtype=torch.long, device="meta"), False, False, False)
        assert any(isinstance(s, Inexact) for s in steps) is listed


class _Unique(nn.Module):
    """torch.unique of token ids, its outputs held while a tensor sized by the unique count
    (1000 floats per distinct id) is made."""

    def forward(self, x: torch.Tensor) -> Any:
        values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
        per_id = torch.ones(values.shape[0] * 1000, device=x.device)
        return values, inverse, counts, per_id


def test_unique_estimate_holds_full_size_outputs() -> None:
    """4096 int64 ids with 100 distinct values, on an H100, forward only. In the op: the
    input (32768), sorted, range and sorted_indices (32768 each) and radix_sort_pairs<int64,
    int64>'s storage: OnesweepPolicyKey64 for 8-byte values <384, 24> -> 12 items, tile 4608,
    one tile: bins 16384, look-back 1024, alternate keys and values 32768 each, counters 32 ->
    256, plus 255 = 83455 (an 83456-byte block): 214528 at the sort. After it, the values,
    inverse and counts hold 32768 bytes each (made at 4096 elements, resized to 100: the
    storage stays), and per_id is 100 x 1000 floats (400000 bytes, a 400384-byte block):
    32768 + 3 x 32768 + 400384 = 531456, the peak; the trace knows the ids, so the estimate
    is complete. (Charged at the unique count, as before, the outputs held 1024 + 32768 +
    1024 bytes.)"""
    ids = torch.arange(4096) % 100
    report = tm.estimate(_Unique(), ids, device="cuda", gpu="H100", train=False, loss_fn=lambda out: out[3][0])
    assert report.forward_peak == 32768 + 3 * 32768 + 400384
    assert report.unsupported == ()


def test_unique_estimate_without_values_is_listed() -> None:
    """Ids on the meta device: their values are unknown, so the unique count is: the
    common fallback takes every element as distinct, and the call is listed."""
    ids = torch.empty(4096, dtype=torch.long, device="meta")
    report = tm.estimate(_Unique(), ids, device="cuda", gpu="H100", train=False, loss_fn=lambda out: out[3][0])
    assert [u.op for u in report.unsupported] == ["aten._unique2.default"]


def test_unique_calls_are_pinned_by_the_installed_library() -> None:
    """The cub algorithms UniqueCub.cu instantiates in the wheel: DeviceRunLengthEncode's
    reduce-by-key kernel of float keys with int64 lengths over a ReduceByKeyScanTileState<
    long, int, true> (one 16-byte word), DeviceSelect::Unique's sweep of float keys over a
    ScanTileState<int, true>, and the inclusive scan of int into int64 over a
    ScanTileState<int, true> (the accumulator is the input's int)."""
    path = cuda_library("libtorch_cuda.so")
    rle = r"(rle6encode10policy_hub|run_length_encode_policy_hub)IlfE.*ReduceByKeyScanTileStateIliLb1EE"
    assert has_function(path, r"DeviceReduceByKeyKernel.*" + rle)
    assert has_function(path, r"DeviceSelectSweepKernel.*policy_hubIfNS0_8NullTypeEi.*ScanTileStateIiLb1EE")
    assert has_function(path, r"DeviceScanKernel.*PKiPlNS0_13ScanTileStateIiLb1EE")
