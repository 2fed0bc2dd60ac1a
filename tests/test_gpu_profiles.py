"""GPU profiles of the user's own (issue 27, item 9): ``tm.GpuProfile`` from a GPU's
properties, its checks, the ini table's lines, the profile of a real device, and the
estimate that follows it as it follows a named profile.

Derived figures come from the CUDA C Programming Guide's "Technical Specifications per
Compute Capability" (maximum threads per SM, maximum shared memory per thread block);
cuBLAS's workspace from ``parseChosenWorkspaceSize`` (CublasHandlePool.cpp); the
reduction buffer from Reduce.cuh's ``setReduceConfig`` (as in test_cuda_temporaries.py).
"""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.figures.gpu_profiles import (
    PROFILES,
    GpuProfile,
    GpuProfileError,
    gpu_profile,
    parse_gpu_line,
    parse_gpu_table,
)
from pytest_torchmem.engine.tracing.devices.cuda import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.workspaces import cublas_workspace_size
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, OpCall, TraceContext

GiB = 1 << 30
KiB = 1 << 10
aten = torch.ops.aten


def rtx4070tis(**changes: Any) -> GpuProfile:
    values: dict[str, Any] = dict(memory="16 GiB", compute_capability="8.9", sm_count=66)
    values.update(changes)
    return GpuProfile("RTX4070TiS", **values)


# -- the value ------------------------------------------------------------------------------


def test_a_profile_is_made_from_the_gpus_properties() -> None:
    profile = rtx4070tis()
    assert profile.name == "RTX4070TiS"
    assert profile.memory == 16 * GiB == 17_179_869_184
    assert profile.compute_capability == (8, 9) and profile.sm == 89
    assert profile.sm_count == 66
    # compute capability 8.9 (Ada): 1536 threads per SM, 99 KiB of shared memory per block
    assert profile.max_threads_per_sm == 1536
    assert profile.shared_memory_per_block == 99 * KiB == 101_376
    assert profile.bf16 and profile.device_name == "NVIDIA RTX4070TiS" and str(profile) == "RTX4070TiS"
    # written as a tuple, a float, bytes: the same value
    assert profile == GpuProfile("RTX4070TiS", memory=16 * GiB, compute_capability=(8, 9), sm_count=66)
    assert profile == GpuProfile("RTX4070TiS", memory="16GiB", compute_capability=8.9, sm_count=66)
    assert hash(profile) == hash(rtx4070tis())
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.sm_count = 60  # type: ignore[misc]
    assert dataclasses.replace(profile, sm_count=60).sm_count == 60
    assert not profile.builtin


def test_the_derived_properties_can_be_given() -> None:
    """Next year's GPU: a capability the tables do not list takes 2048 threads and 227 KiB
    unless its own are given."""
    future = GpuProfile("Next", memory="96 GiB", compute_capability="13.0", sm_count=160)
    assert (future.max_threads_per_sm, future.shared_memory_per_block) == (2048, 227 * KiB)
    given = GpuProfile(
        "Next", memory="96 GiB", compute_capability="13.0", sm_count=160,
        max_threads_per_sm=1536, shared_memory_per_block="99 KiB",
    )
    assert (given.max_threads_per_sm, given.shared_memory_per_block) == (1536, 101_376)
    # a device name that says its maker is not said twice
    named = GpuProfile("NVIDIA GeForce RTX 4070 Ti SUPER", memory="16 GiB", compute_capability="8.9", sm_count=66)
    assert named.device_name == "NVIDIA GeForce RTX 4070 Ti SUPER"


def test_the_named_profiles_are_values_of_their_properties() -> None:
    assert PROFILES["L4"] == GpuProfile("L4", memory="22565 MiB", compute_capability="8.9", sm_count=58)
    assert PROFILES["H100"] == GpuProfile("H100", memory="81090 MiB", compute_capability=(9, 0), sm_count=132)
    assert all(profile.builtin for profile in PROFILES.values())
    # the same properties under another name are another profile
    assert not dataclasses.replace(PROFILES["H100"], name="MyH100").builtin
    assert PROFILES["H100"].spec == (
        "memory=81090MiB cc=9.0 sms=132 threads_per_sm=2048 shared_per_block=227KiB"
    )


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"name": ""}, "name: a GPU profile needs a name such as 'RTX4070TiS', got ''"),
    ({"name": 4070}, "name: a GPU profile needs a name such as 'RTX4070TiS', got 4070"),
    (
        {"name": "RTX:4070"},
        "name: 'RTX:4070' holds ':', which the ini table and --torchmem-gpu use to separate "
        "properties; name it without them",
    ),
    ({"name": "Current"}, "name: 'current' names this machine's GPU (gpu='current'); call yours otherwise"),
    (
        {"memory": 16},
        "memory: 16 is 16 bytes, less than any GPU has; write the unit, e.g. '16 GiB' "
        "(torch.cuda.get_device_properties().total_memory)",
    ),
    ({"memory": "16 GB/s"}, "memory: unknown unit 'GB/s' in '16 GB/s'; use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB"),
    ({"memory": -1}, "memory: a byte size cannot be negative, got -1"),
    ({"memory": 16.0}, "memory: a byte size must be an int or a string like '512 MiB', got 16.0"),
    (
        {"compute_capability": "8.9.1"},
        "compute_capability: cannot read '8.9.1' as a compute capability; write it as '8.9' "
        "or (8, 9) (torch.cuda.get_device_capability())",
    ),
    (
        {"compute_capability": (8,)},
        "compute_capability: cannot read (8,) as a compute capability; write it as '8.9' "
        "or (8, 9) (torch.cuda.get_device_capability())",
    ),
    (
        {"compute_capability": "6.1"},
        "compute_capability: compute capability 6.1 is not modelled; the rules follow NVIDIA "
        "GPUs of compute capability 7.0 (Volta) and newer",
    ),
    (
        {"compute_capability": "gfx942"},
        "compute_capability: 'gfx942' is an AMD architecture: the fake cuda device models "
        "NVIDIA's CUDA kernels (cuBLAS, cuDNN, flash attention), not an AMD GPU's (ROCm: "
        "hipBLASLt, MIOpen, CK/AOTriton attention, other workspaces); see the GPU-profiles "
        "how-to for what an NVIDIA profile of the same size tells",
    ),
    (
        {"sm_count": 0},
        "sm_count: the number of SMs must be a positive whole number "
        "(torch.cuda.get_device_properties().multi_processor_count), got 0",
    ),
    (
        {"sm_count": True},
        "sm_count: the number of SMs must be a positive whole number "
        "(torch.cuda.get_device_properties().multi_processor_count), got True",
    ),
    (
        {"max_threads_per_sm": 1000},
        "max_threads_per_sm: 1000 is not a multiple of the warp size, 32 "
        "(torch.cuda.get_device_properties().max_threads_per_multi_processor)",
    ),
    (
        {"max_threads_per_sm": -32},
        "max_threads_per_sm: the threads per SM must be a positive whole number "
        "(torch.cuda.get_device_properties().max_threads_per_multi_processor), got -32",
    ),
    ({"shared_memory_per_block": 0}, "shared_memory_per_block: the shared memory per block must be positive, got 0"),
    (
        {"shared_memory_per_block": "lots"},
        "shared_memory_per_block: cannot read 'lots' as a byte size; write e.g. '1.5 GiB', '512 MB' or '4096'",
    ),
]


@pytest.mark.parametrize(("changes", "message"), BAD_VALUES, ids=lambda v: str(v)[:40])
def test_a_bad_property_is_refused_naming_it_and_the_fix(changes: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = dict(name="X", memory="16 GiB", compute_capability="8.9", sm_count=66)
    values.update(changes)
    name = values.pop("name")
    with pytest.raises(GpuProfileError) as error:
        GpuProfile(name, **values)
    assert str(error.value) == message
    assert isinstance(error.value, ValueError)


# -- the ini table's lines -----------------------------------------------------------------


def test_a_line_of_the_ini_table_reads_back_as_the_profile() -> None:
    profile = rtx4070tis()
    assert parse_gpu_line("RTX4070TiS: memory=16GiB cc=8.9 sms=66") == profile
    assert parse_gpu_line("  RTX4070TiS :memory = 16 GiB  cc=8.9   sms=66 ") == profile
    # the Python argument names are read too
    assert parse_gpu_line("RTX4070TiS: memory=16GiB compute_capability=8.9 sm_count=66") == profile
    assert parse_gpu_line(f"RTX4070TiS: {profile.spec}") == profile
    assert profile.spec == "memory=16GiB cc=8.9 sms=66 threads_per_sm=1536 shared_per_block=99KiB"
    odd = GpuProfile("Odd", memory=16 * GiB + 512, compute_capability="8.9", sm_count=66)
    assert odd.properties()["memory"] == "17179869696"
    assert parse_gpu_line(f"Odd: {odd.spec}") == odd


BAD_LINES: list[tuple[str, str]] = [
    (
        "RTX4070TiS memory=16GiB",
        "cannot read 'RTX4070TiS memory=16GiB' as a GPU profile: write NAME: memory=... cc=... "
        "sms=..., e.g. 'RTX4070TiS: memory=16GiB cc=8.9 sms=66'",
    ),
    (
        "G: 16GiB cc=8.9 sms=66",
        "GPU profile 'G': cannot read '16GiB'; write key=value pairs, e.g. "
        "'RTX4070TiS: memory=16GiB cc=8.9 sms=66'",
    ),
    (
        "G: memory=16GiB cc=8.9",
        "GPU profile 'G': missing sms=; a profile needs memory, cc and sms, e.g. "
        "'RTX4070TiS: memory=16GiB cc=8.9 sms=66'",
    ),
    (
        "G: memory=16GiB cc=8.9 sms=66 vendor=amd",
        "GPU profile 'G': unknown property 'vendor'; a line takes memory, cc, sms, "
        "threads_per_sm, shared_per_block (e.g. 'RTX4070TiS: memory=16GiB cc=8.9 sms=66')",
    ),
    ("G: memory=16GiB cc=8.9 sms=66 sm_count=60", "GPU profile 'G': sm_count is given twice"),
    ("G: memory= cc=8.9 sms=66", "GPU profile 'G': memory= has no value"),
    (
        "G: memory=16 cc=8.9 sms=66",
        "GPU profile 'G': memory: '16' is 16 bytes, less than any GPU has; write the unit, "
        "e.g. '16 GiB' (torch.cuda.get_device_properties().total_memory)",
    ),
    (
        "G: memory=16GiB cc=nine sms=66",
        "GPU profile 'G': cc: cannot read 'nine' as a compute capability; write it as '8.9' or "
        "(8, 9) (torch.cuda.get_device_capability())",
    ),
    (
        "MI300X: memory=192GiB cc=gfx942 sms=304",
        "GPU profile 'MI300X': cc: 'gfx942' is an AMD architecture: the fake cuda device models "
        "NVIDIA's CUDA kernels (cuBLAS, cuDNN, flash attention), not an AMD GPU's (ROCm: "
        "hipBLASLt, MIOpen, CK/AOTriton attention, other workspaces); see the GPU-profiles "
        "how-to for what an NVIDIA profile of the same size tells",
    ),
    (
        "G: memory=16GiB cc=8.9 sms=sixty",
        "GPU profile 'G': sms: the number of SMs must be a positive whole number "
        "(torch.cuda.get_device_properties().multi_processor_count), got 'sixty'",
    ),
    (
        "G: memory=16GiB cc=8.9 sms=66 threads_per_sm=1500",
        "GPU profile 'G': threads_per_sm: 1500 is not a multiple of the warp size, 32 "
        "(torch.cuda.get_device_properties().max_threads_per_multi_processor)",
    ),
    (
        "G: memory=16GiB cc=8.9 sms=66 shared_per_block=0",
        "GPU profile 'G': shared_per_block: the shared memory per block must be positive, got '0'",
    ),
    (
        "current: memory=16GiB cc=8.9 sms=66",
        "GPU profile 'current': name: 'current' names this machine's GPU (gpu='current'); "
        "call yours otherwise",
    ),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES, ids=[line for line, _ in BAD_LINES])
def test_a_bad_line_is_refused_naming_its_key(line: str, message: str) -> None:
    with pytest.raises(GpuProfileError) as error:
        parse_gpu_line(line)
    assert str(error.value) == message


def test_the_ini_table() -> None:
    table = parse_gpu_table(
        ["", "# our desktops", "RTX4070TiS: memory=16GiB cc=8.9 sms=66", "Mine: memory=12GiB cc=8.6 sms=28"]
    )
    assert list(table) == ["RTX4070TiS", "Mine"] and table["RTX4070TiS"] == rtx4070tis()
    with pytest.raises(GpuProfileError, match=r"^GPU profile 'h100': H100 is a named profile; give yours another name$"):
        parse_gpu_table(["h100: memory=80GiB cc=9.0 sms=132"])
    with pytest.raises(GpuProfileError, match=r"^GPU profile 'mine': Mine is defined twice; give yours another name$"):
        parse_gpu_table(["Mine: memory=12GiB cc=8.6 sms=28", "mine: memory=12GiB cc=8.6 sms=30"])


def test_gpu_profile_resolves_names_lines_and_values() -> None:
    custom = {"RTX4070TiS": rtx4070tis()}
    assert gpu_profile(None) is PROFILES["H100"]
    assert gpu_profile("l40s") is PROFILES["L40S"]
    assert gpu_profile("rtx4070tis", custom) is custom["RTX4070TiS"]
    assert gpu_profile("RTX4070TiS: memory=16GiB cc=8.9 sms=66") == rtx4070tis()
    assert gpu_profile(custom["RTX4070TiS"]) is custom["RTX4070TiS"]
    with pytest.raises(ValueError) as error:
        gpu_profile("RTX4070TiS")
    assert str(error.value) == (
        f"unknown GPU 'RTX4070TiS'; known GPUs: {', '.join(PROFILES)}; describe another by its "
        "properties (GpuProfile('RTX4070TiS', memory='16 GiB', compute_capability='8.9', "
        "sm_count=66)), or use 'current' for this machine's GPU"
    )
    with pytest.raises(TypeError, match=r"^gpu must be a GPU name such as 'H100', 'current' or a GpuProfile"):
        gpu_profile(4070)  # type: ignore[arg-type]


# -- the GPU of this machine -------------------------------------------------------------------


def test_a_profile_from_device_properties() -> None:
    """What ``torch.cuda.get_device_properties`` gives (fed here: no GPU needed)."""
    properties = SimpleNamespace(
        name="NVIDIA GeForce RTX 4070 Ti SUPER",
        major=8,
        minor=9,
        multi_processor_count=66,
        total_memory=16376 * (1 << 20),
        max_threads_per_multi_processor=1536,
        gcnArchName="NVIDIA does not have gcnArchName",
        warp_size=32,
    )
    profile = GpuProfile.from_properties(properties)
    assert profile == GpuProfile(
        "NVIDIA GeForce RTX 4070 Ti SUPER", memory="16376 MiB", compute_capability=(8, 9), sm_count=66
    )
    assert profile.spec == "memory=16376MiB cc=8.9 sms=66 threads_per_sm=1536 shared_per_block=99KiB"
    assert GpuProfile.from_properties(properties, name="RTX4070TiS").name == "RTX4070TiS"
    # what the device reports wins over the tables
    odd = SimpleNamespace(**{**vars(properties), "max_threads_per_multi_processor": 1024,
                             "shared_memory_per_block_optin": 64 * KiB})
    assert GpuProfile.from_properties(odd).max_threads_per_sm == 1024
    assert GpuProfile.from_properties(odd).shared_memory_per_block == 64 * KiB


def test_an_amd_device_and_incomplete_properties_are_refused() -> None:
    mi300x = SimpleNamespace(
        name="AMD Instinct MI300X", major=9, minor=4, multi_processor_count=304,
        total_memory=192 * GiB, gcnArchName="gfx942:sramecc+:xnack-",
    )
    with pytest.raises(GpuProfileError) as error:
        GpuProfile.from_properties(mi300x)
    assert str(error.value) == (
        "this GPU is an AMD gfx942: the fake cuda device models NVIDIA's CUDA kernels (cuBLAS, "
        "cuDNN, flash attention), not an AMD GPU's (ROCm: hipBLASLt, MIOpen, CK/AOTriton "
        "attention, other workspaces); see the GPU-profiles how-to for what an NVIDIA profile "
        "of the same size tells"
    )
    with pytest.raises(GpuProfileError) as error:
        GpuProfile.from_properties(SimpleNamespace(name="G", major=8, minor=9))
    assert str(error.value) == (
        "the device properties lack multi_processor_count, total_memory; pass what "
        "torch.cuda.get_device_properties() returns"
    )


def test_from_device_reads_the_current_or_the_named_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The glue around ``get_device_properties`` (a GPU machine runs the real one below)."""
    asked: list[Any] = []

    def properties(device: Any) -> Any:
        asked.append(device)
        return SimpleNamespace(name="NVIDIA L4", major=8, minor=9, multi_processor_count=58, total_memory=22565 * 2**20)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert GpuProfile.from_device() == dataclasses.replace(PROFILES["L4"], name="NVIDIA L4")
    assert GpuProfile.from_device("cuda:1", name="L4") == PROFILES["L4"]
    assert gpu_profile("current").name == "NVIDIA L4"
    assert asked == [3, "cuda:1", 3]
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    with pytest.raises(GpuProfileError, match=r"^this torch runs on ROCm: the fake cuda device models NVIDIA's"):
        GpuProfile.from_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_current_without_a_gpu_says_so() -> None:
    message = (
        "'current' is this machine's GPU, and torch.cuda.is_available() is False here; name a "
        "profile instead ('H100', or yours by its properties: GpuProfile('RTX4070TiS', "
        "memory='16 GiB', compute_capability='8.9', sm_count=66) or the ini option torchmem_gpus)"
    )
    with pytest.raises(GpuProfileError) as error:
        tm.estimate(nn.Linear(2, 2), torch.randn(1, 2), device="cuda", gpu="current")
    assert str(error.value) == message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_current_is_the_gpu_of_this_machine() -> None:
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    profile = GpuProfile.from_device()
    assert profile.name == properties.name and profile.memory == properties.total_memory
    assert profile.compute_capability == (properties.major, properties.minor)
    assert profile.sm_count == properties.multi_processor_count
    assert profile.max_threads_per_sm == properties.max_threads_per_multi_processor


# -- the estimate follows it -------------------------------------------------------------------


class _Block(nn.Module):
    """Matmuls (cuBLAS's workspace by capability), attention (the backend by capability),
    layer norm and reductions (grids by SM count)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.layer(x))
        return h.sum(dim=1).norm() + h.var(dim=-1).sum()


@pytest.mark.parametrize("name", list(PROFILES))
def test_a_profile_with_a_named_ones_properties_gives_its_bytes(name: str) -> None:
    named = PROFILES[name]
    mine = GpuProfile(
        "Mine", memory=named.memory, compute_capability=named.compute_capability, sm_count=named.sm_count
    )
    x = torch.randn(4, 32, 64)

    def estimate(gpu: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        optimizer = lambda params: torch.optim.AdamW(params)  # noqa: E731
        return tm.estimate(_Block(), x, device="cuda", gpu=gpu, optimizer=optimizer).to_dict()

    expected, got = estimate(name), estimate(mine)
    assert (expected.pop("profile"), got.pop("profile")) == (name, "Mine")
    assert got == expected


def test_compute_capability_sizes_cublas_workspace_as_for_the_named_gpus() -> None:
    """``parseChosenWorkspaceSize``: 8.9 takes ``:4096:2:16:8`` = 2 x 4 MiB + 8 x 16 KiB =
    8,519,680 B on every supported release; 9.0 takes 8 x 4 MiB = 32 MiB."""
    ada, hopper = rtx4070tis(), rtx4070tis(compute_capability="9.0")
    assert cublas_workspace_size(ada) == 2 * 4096 * KiB + 8 * 16 * KiB == 8_519_680
    assert cublas_workspace_size(hopper) == 8 * 4096 * KiB == 33_554_432
    model, x = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)), torch.randn(16, 64)

    def workspace(gpu: Any) -> int:
        return tm.estimate(model, x, device="cuda", gpu=gpu).breakdown[tm.Category.WORKSPACE]

    moved = workspace(hopper) - workspace(ada)
    # the peak holds one cuBLAS workspace per thread that ran a matmul (the main thread, the
    # autograd engine's) where the release caches them, else the call's own
    assert moved > 0 and moved % (33_554_432 - 8_519_680) == 0
    assert moved == workspace("H100") - workspace("L4")


def test_sm_count_and_threads_per_sm_size_a_reduction_buffer() -> None:
    """sum() of 2**24 floats (test_cuda_temporaries.py): ctas_per_output = max(min(SMs x
    (threads per SM / 512), 2048), 128) blocks, one float of the buffer each. 66 SMs of 1536
    threads: 66 x 3 = 198 blocks, 792 B; with 1024 threads per SM, 66 x 2 = 132, 528 B; 30 SMs
    of 1024 threads: 60, under 128: 128 blocks, 512 B."""
    x = torch.empty(1 << 24, device="meta")
    for profile, nbytes in (
        (rtx4070tis(), 792),
        (rtx4070tis(max_threads_per_sm=1024), 528),
        (rtx4070tis(max_threads_per_sm=1024, sm_count=30), 512),
    ):
        call = OpCall(
            aten.sum.default, (x,), {}, torch.empty((), device="meta"), TraceContext("cuda", gpu=profile)
        )
        rule = CUDA.scratch_rule(aten.sum.default)
        assert rule is not None
        assert list(rule(call)) == [
            OUTPUTS, Alloc("reduce:buffer", nbytes), Alloc("reduce:semaphores", 4)
        ], profile


#: What a model's forward saw, kept where an estimate does not put it back (it leaves the
#: user's model as it was, the attributes its forward writes included).
_SEEN = threading.local()


class _Sees(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    @property
    def seen(self) -> dict[str, Any]:
        return _SEEN.value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        properties = torch.cuda.get_device_properties(0)
        _SEEN.value = {
            "name": torch.cuda.get_device_name(),
            "capability": torch.cuda.get_device_capability(),
            "sms": properties.multi_processor_count,
            "memory": properties.total_memory,
            "threads": properties.max_threads_per_multi_processor,
            "bf16": torch.cuda.is_bf16_supported(),
        }
        return self.linear(x)


def test_the_program_sees_the_profiles_gpu() -> None:
    model = _Sees()
    tm.estimate(model, torch.randn(2, 8), device="cuda", gpu=rtx4070tis(), train=False)
    assert model.seen == {
        "name": "NVIDIA RTX4070TiS", "capability": (8, 9), "sms": 66, "memory": 16 * GiB,
        "threads": 1536, "bf16": True,
    }
    turing = GpuProfile("NVIDIA GeForce RTX 2080", memory="8 GiB", compute_capability="7.5", sm_count=46)
    tm.estimate(model, torch.randn(2, 8), device="cuda", gpu=turing, train=False)
    assert model.seen == {
        "name": "NVIDIA GeForce RTX 2080", "capability": (7, 5), "sms": 46, "memory": 8 * GiB,
        "threads": 1024, "bf16": False,
    }


def test_gpu_profile_applies_to_cuda_only() -> None:
    with pytest.raises(ValueError, match=r"^gpu=GpuProfile\(name='RTX4070TiS'.* applies to device='cuda' only"):
        tm.estimate(nn.Linear(2, 2), torch.randn(1, 2), gpu=rtx4070tis())



# -- which checks a GPU measures -----------------------------------------------------


def test_a_gpu_runs_like_a_profile_of_its_kernel_properties_memory_aside() -> None:
    h100 = gpu_profile("H100")
    read = GpuProfile("NVIDIA H100 80GB HBM3", memory=81_559 * 2**20, compute_capability=(9, 0), sm_count=132)
    assert h100.runs_like(read) and read.runs_like(h100)  # the driver's memory differs: the kernels do not
    assert h100.runs_like(gpu_profile("H200"))  # the same chip with more memory
    assert not h100.runs_like(gpu_profile("L4"))
    assert not gpu_profile("L4").runs_like(gpu_profile("RTX4090"))  # cc 8.9 both, 58 SMs against 128
    fewer_threads = GpuProfile("H100", memory="80GiB", compute_capability=(9, 0), sm_count=132, max_threads_per_sm=1024)
    assert not h100.runs_like(fewer_threads)


@pytest.mark.parametrize("here, followed, measured", [("H100", "H100", True), ("H100", "L4", False), ("L4", "L4", True)])
def test_the_plugin_measures_only_the_checks_that_follow_this_gpu(
    here: str, followed: str, measured: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on an H100 (stop 47): checks that followed an L4 and a custom profile were
    compared with the H100's measurement and failed as mismatches."""
    from pytest_torchmem.plugin.estimating import Estimator
    from pytest_torchmem.plugin.settings import Settings

    monkeypatch.setattr(GpuProfile, "from_device", classmethod(lambda cls, device=None, name=None: gpu_profile(here)))
    assert Estimator(Settings(measure="on")).measures(gpu_profile(followed)) is measured
    assert Estimator(Settings(measure="off")).measures(gpu_profile(followed)) is False


def test_a_gpu_without_a_profile_measures_no_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU the fake device does not model (ROCm: from_device refuses it) is not taken
    for any profile's ground truth."""
    from pytest_torchmem.plugin.estimating import Estimator
    from pytest_torchmem.plugin.settings import Settings

    def refused(cls, device=None, name=None):  # type: ignore[no-untyped-def]
        raise GpuProfileError("this torch runs on ROCm")

    monkeypatch.setattr(GpuProfile, "from_device", classmethod(refused))
    assert Estimator(Settings(measure="on")).measures(gpu_profile("H100")) is False
