"""CPU profiles (``pytest_torchmem/engine/tracing/devices/cpu/profiles.py``): the fake cpu
device models a named CPU, and under a named profile the figures do not depend on
the host (its ISA, the ATen/oneDNN caps of the process, its thread count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cpu import profiles
from pytest_torchmem.engine.tracing.devices.cpu.profiles import (
    ISA_LEVELS,
    CpuProfile,
    capped_environment,
    cpu_profile,
)
from pytest_torchmem.plugin.markers import CPU_ISA_LEVELS, MarkerError, parse_cpu

ROOT = Path(__file__).resolve().parents[1]
HOST = profiles.host_profile()


# -- the profile as a value ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "isa", "threads"),
    [
        ("avx2:4", "avx2", 4), ("AVX512:16", "avx512", 16), (" default : 1 ", "default", 1),
        ("avx512_bf16:2", "avx512_bf16", 2), ("amx:8", "amx", 8),
    ],
)
def test_profile_text(text: str, isa: str, threads: int) -> None:
    profile = cpu_profile(text)
    assert (profile.isa, profile.threads) == (isa, threads)
    assert str(profile) == f"{isa}:{threads}"
    assert cpu_profile(str(profile)) == profile
    assert CpuProfile.from_json(profile.to_json()) == profile


def test_each_level_has_typical_caches_and_custom_caches_are_named() -> None:
    assert CpuProfile("avx2", 4).l2 == 512 * 1024
    assert CpuProfile("avx512", 4).l2 == 1024 * 1024
    custom = CpuProfile("avx2", 4, l2=2 * 1024 * 1024)
    assert str(custom) == "avx2:4 (L1d 32 KiB, L2 2 MiB, L3 4 MiB per core)"
    assert custom != CpuProfile("avx2", 4)
    assert CpuProfile.from_json(custom.to_json()) == custom


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("avx2", "is not '<level>:<threads>'"),
        ("avx3:4", "unknown CPU ISA level 'avx3'"),
        ("avx2:0", "threads must be a positive int"),
        ("neon:4", "unknown CPU ISA level 'neon'"),
        (4, "cpu must be a profile such as 'avx2:4'"),
    ],
)
def test_bad_profiles_name_the_fix(value: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        cpu_profile(value)  # type: ignore[arg-type]


def test_the_native_levels_are_avx512_but_for_their_reduced_precision() -> None:
    """``avx512_bf16`` and ``amx`` run avx512's float32 kernels (16-float vectors,
    ATen's AVX512 dispatch) and compute bfloat16 (amx: float16 too) natively."""
    for level in ("avx512_bf16", "amx"):
        profile = CpuProfile(level, 4)
        assert profile.avx512 and profile.avx2 and profile.onednn_bf16
        assert (profile.simd, profile.aten_capability) == (16, "AVX512")
    assert CpuProfile("avx512_bf16", 4).native_dtypes == ("bfloat16",)
    assert CpuProfile("amx", 4).native_dtypes == ("bfloat16", "float16")
    assert all(CpuProfile(level, 4).native_dtypes == () for level in ("default", "avx2", "avx512"))
    capped = capped_environment(CpuProfile("amx", 1))
    assert capped.pop("TORCHINDUCTOR_CACHE_DIR").endswith("-capped-amx")
    assert capped == {
        "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E4",
    }


def test_each_capped_level_compiles_into_an_inductor_cache_of_its_own(monkeypatch) -> None:
    """Inductor's cache keys do not include ATEN_CPU_CAPABILITY: a program cached by an
    uncapped process and loaded by an AVX2-capped one computed wrong values on an
    AVX512 host (and the other way round crashed), so capped processes never share it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/my-cache")
    dirs = {level: capped_environment(CpuProfile(level, 1))["TORCHINDUCTOR_CACHE_DIR"] for level in ISA_LEVELS}
    assert dirs["avx2"] == "/tmp/my-cache-capped-avx2"
    assert len(set(dirs.values())) == len(ISA_LEVELS)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", dirs["avx2"])  # a capped process caps again
    assert capped_environment(CpuProfile("default", 1))["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/my-cache-capped-default"


@pytest.mark.parametrize(
    ("cap", "level"),
    [
        ("SSE41", "default"), ("AVX2", "avx2"), ("AVX512_CORE", "avx512"), ("AVX512_CORE_VNNI", "avx512"),
        ("AVX512_CORE_BF16", "avx512_bf16"), ("AVX512_CORE_AMX", "amx"), ("", None), ("ALL", None),
    ],
)
def test_onednn_caps_lower_the_hosts_level(monkeypatch: pytest.MonkeyPatch, cap: str, level: str | None) -> None:
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "")
    hardware = profiles._onednn_level()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    expected = hardware if level is None else min(hardware, level, key=profiles.ISA_LEVELS.index)
    assert profiles._onednn_level() == expected


def test_a_onednn_cap_the_rules_do_not_know_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AVX10_1_512`` (avx512_core_fp16 without AMX) computes float16 natively but
    not as ``amx`` does; no level models it."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX10_1_512")
    with pytest.raises(ValueError, match="ONEDNN_MAX_CPU_ISA=AVX10_1_512 is not a level the CPU rules know"):
        profiles._onednn_level()


def test_a_native_level_lists_its_reduced_precision_matmuls() -> None:
    """Under ``amx`` a bfloat16 or float16 Linear is flagged, a float32 one is not;
    under ``avx512_bf16`` only the bfloat16 one."""
    for dtype, flagged in ((torch.float32, ()), (torch.bfloat16, ("amx", "avx512_bf16")), (torch.float16, ("amx",))):
        model = nn.Linear(64, 64, dtype=dtype)
        x = torch.randn(32, 64, dtype=dtype)
        for level in ("avx512", "avx512_bf16", "amx"):
            unsupported = tm.estimate(model, x, cpu=f"{level}:2").unsupported
            assert bool(unsupported) == (level in flagged), (dtype, level, unsupported)
            assert all("(native instructions)" in u.reason and level in u.reason for u in unsupported)


def test_none_and_host_are_this_process_as_it_runs_now(threads: int) -> None:
    assert cpu_profile(None) == cpu_profile("host") == profiles.host_profile()
    assert profiles.host_profile().threads == threads == torch.get_num_threads()


def test_the_plugin_spells_the_levels_and_default_as_the_profiles_do() -> None:
    from pytest_torchmem.plugin.settings import DEFAULT_CPU

    assert CPU_ISA_LEVELS == profiles.ISA_LEVELS
    assert DEFAULT_CPU == profiles.DEFAULT_CPU
    assert parse_cpu("AVX512: 8", "here") == "avx512:8"
    assert parse_cpu("Host", "here") == "host"
    with pytest.raises(MarkerError, match=r"here: cannot read 'avx2' as a CPU profile; write"):
        parse_cpu("avx2", "here")


def test_estimate_names_its_profile_and_measure_the_host() -> None:
    model, x = nn.Linear(8, 4), torch.randn(2, 8)
    assert tm.estimate(model, x, cpu="default:1").profile == "default:1"
    assert tm.estimate(model, x).profile == str(profiles.host_profile())
    assert tm.estimate(model, x, device="cuda").profile == "H100"
    assert tm.measure(model, x).profile == str(profiles.host_profile())
    with pytest.raises(ValueError, match=r"cpu='avx2:4' applies to device='cpu' only"):
        tm.estimate(model, x, device="cuda", cpu="avx2:4")


def test_the_host_level_follows_the_caps_of_the_process() -> None:
    """ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA cap what the host profile says;
    capping them to different levels is refused with the fix."""
    code = "from pytest_torchmem.engine.tracing.devices.cpu.profiles import host_profile as h; print(h().isa)"
    for profile in (CpuProfile("default", 1), CpuProfile("avx2", 1)):
        if profiles.ISA_LEVELS.index(profile.isa) > profiles.ISA_LEVELS.index(HOST.isa):
            continue
        env = {**os.environ, **capped_environment(profile)}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.stdout.strip() == profile.isa, done.stderr
    mixed = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    if HOST.avx2:
        done = subprocess.run([sys.executable, "-c", code], env=mixed, capture_output=True, text=True)
        assert done.returncode != 0
        assert "cap both, e.g. ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41" in done.stderr


# -- portability: the same bytes on every host -----------------------------------------------------

_PORTABLE = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    import pytest_torchmem as tm

    torch.set_num_threads(int(sys.argv[1]))
    torch.manual_seed(0)
    block = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 5, padding=2, groups=16), nn.Conv2d(16, 24, 1, stride=2),
        nn.Flatten(), nn.Linear(24 * 8 * 8, 10),
    )
    cl = block.to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 16, 16)
    out = {}
    for profile in ("default:1", "avx2:4", "avx512:8"):
        for name, model, inputs in (("nchw", block, x), ("cl", cl, x.contiguous(memory_format=torch.channels_last))):
            report = tm.estimate(model, inputs, cpu=profile, optimizer=lambda p: torch.optim.AdamW(p))
            out[f"{profile}/{name}"] = [report.phase_peaks(), len(report.unsupported)]
    print(json.dumps(out, sort_keys=True))
    """
)


def test_a_named_profile_gives_the_same_bytes_under_any_caps_and_thread_count() -> None:
    """One estimate per profile, run in processes capped to each level this host can
    run (at 1 intra-op thread; the lowest and the highest level at 3 too): the bytes are
    identical, and differ between profiles (so the profile, not the host, decides them)."""
    runs = []
    levels = profiles.ISA_LEVELS[: profiles.ISA_LEVELS.index(HOST.isa) + 1]
    for level in levels:
        env = {**os.environ, **capped_environment(CpuProfile(level, 1))}
        for threads in (1, 3) if level in (levels[0], levels[-1]) else (1,):
            done = subprocess.run(
                [sys.executable, "-c", _PORTABLE, str(threads)],
                env=env, capture_output=True, text=True, cwd=ROOT, timeout=300,
            )
            assert done.returncode == 0, done.stderr
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert len(runs) >= 2
    assert all(run == runs[0] for run in runs[1:])
    first = runs[0]
    assert len({json.dumps(first[f"{p}/cl"]) for p in ("default:1", "avx2:4", "avx512:8")}) == 3
