"""CPU profiles: the facts about a CPU that change what CPU kernels allocate.

ATen and oneDNN pick kernels by the vector ISA the process may use, and size
per-thread buffers by the intra-op thread count; a few oneDNN blockings read
the per-core cache sizes. A :class:`CpuProfile` names all of them, so that the
fake ``cpu`` device models *a* CPU rather than the host: under a named profile
the estimate gives the same bytes on every machine (x86 or not, any core
count). ``None`` (``estimate(..., cpu=None)``) means this host, as the process
runs now: that is what :func:`~pytest_torchmem.measure` sees.

The ISA levels are the ones the rules were verified on, each the pair of
ATen's ``ATEN_CPU_CAPABILITY`` and oneDNN's ``ONEDNN_MAX_CPU_ISA``:

===============  ==================  =======================================
level            ATen capability     oneDNN ISA
===============  ==================  =======================================
``default``      ``DEFAULT``         ``SSE41`` (a CPU without AVX)
``avx2``         ``AVX2``            ``AVX2`` (Haswell .. Zen 3, most CI runners)
``avx512``       ``AVX512``          ``AVX512_CORE`` (Skylake-SP .. Cascade Lake)
``avx512_bf16``  ``AVX512``          ``AVX512_CORE_BF16`` (Cooper Lake, Zen 4/5)
``amx``          ``AVX512``          ``AVX512_CORE_AMX`` (Sapphire Rapids on)
===============  ==================  =======================================

On the two highest levels oneDNN and ATen compute bfloat16 (and, on ``amx``,
float16) with native instructions: brgemm matmuls and packed attention blocks,
whose scratch the rules do not model. Float32 kernels are those of ``avx512``;
a reduced-precision call that takes a native kernel is listed in
``unsupported`` (:attr:`CpuProfile.native_dtypes`).

A profile is written ``"<level>:<threads>"`` (``"avx2:4"``), or built as
``CpuProfile(isa="avx2", threads=4)``, optionally with other cache sizes.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = [
    "CpuProfile",
    "ISA_LEVELS",
    "DEFAULT_CPU",
    "HOST",
    "cpu_profile",
    "host_profile",
    "capped_environment",
    "capped_inductor_cache",
]

_KiB: Final = 1024
_MiB: Final = 1024 * 1024

#: The ISA levels, lowest first.
ISA_LEVELS: Final = ("default", "avx2", "avx512", "avx512_bf16", "amx")

#: Per-core L1 data, L2 and L3 cache bytes of a typical CPU of each level (what
#: oneDNN's ``platform::get_per_core_cache_size`` reads there): a pre-AVX Xeon;
#: AMD EPYC Zen 2/3, the CPU of most hosted CI runners; Skylake-SP; Zen 4;
#: Sapphire Rapids.
_CACHES: Final[dict[str, tuple[int, int, int]]] = {
    "default": (32 * _KiB, 256 * _KiB, 2 * _MiB),
    "avx2": (32 * _KiB, 512 * _KiB, 4 * _MiB),
    "avx512": (32 * _KiB, 1 * _MiB, 1408 * _KiB),
    "avx512_bf16": (32 * _KiB, 1 * _MiB, 4 * _MiB),
    "amx": (48 * _KiB, 2 * _MiB, 1920 * _KiB),
}

#: What the environment variables that cap a process to each level say.
_ATEN_CAPABILITY: Final = {
    "default": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512",
}
_ONEDNN_ISA: Final = {
    "default": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE",
    "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX",
}
#: What ``MKL_ENABLE_INSTRUCTIONS`` caps MKL to on each level (MKL's own dispatch
#: decides the sizes some LAPACK routines ask for, see ``cpu/lapack.py``).
_MKL_ISA: Final = {
    "default": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512",
    "avx512_bf16": "AVX512_E3", "amx": "AVX512_E4",
}
#: The reduced-precision dtypes each level computes natively (oneDNN's
#: ``mkldnn_bf16_device_check``/``mkldnn_fp16_device_check`` past avx512_core).
_NATIVE_DTYPES: Final[dict[str, tuple[str, ...]]] = {
    "avx512_bf16": ("bfloat16",),
    "amx": ("bfloat16", "float16"),
}

#: The profile the pytest plugin models when none is named: cpu snapshot entries
#: recorded anywhere compare on any other machine.
DEFAULT_CPU: Final = "avx2:4"
#: The value that names this host.
HOST: Final = "host"


def _size(nbytes: int) -> str:
    return f"{nbytes // _MiB} MiB" if nbytes % _MiB == 0 else f"{nbytes // _KiB} KiB"


@dataclass(frozen=True)
class CpuProfile:
    """One CPU, as far as what its kernels allocate depends on it.

    ``isa`` is one of :data:`ISA_LEVELS`; ``threads`` the intra-op thread count
    (``torch.get_num_threads()``); ``l1d``, ``l2`` and ``l3`` the per-core cache
    bytes, by default those of a typical CPU of the level.
    """

    isa: str = "avx2"
    threads: int = 4
    l1d: int = field(default=0)
    l2: int = field(default=0)
    l3: int = field(default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.isa, str) or self.isa.lower() not in ISA_LEVELS:
            raise ValueError(
                f"unknown CPU ISA level {self.isa!r}; use one of: {', '.join(ISA_LEVELS)}"
            )
        object.__setattr__(self, "isa", self.isa.lower())
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be a positive int, got {self.threads!r}")
        for name, default in zip(("l1d", "l2", "l3"), _CACHES[self.isa]):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a cache size in bytes, got {value!r}")
            if value == 0:
                object.__setattr__(self, name, default)

    @property
    def level(self) -> int:
        """The level's rank in :data:`ISA_LEVELS` (0: ``default``)."""
        return ISA_LEVELS.index(self.isa)

    @property
    def avx512(self) -> bool:
        """oneDNN may use avx512_core kernels (16-float vectors)."""
        return self.level >= ISA_LEVELS.index("avx512")

    @property
    def avx2(self) -> bool:
        """oneDNN may use avx2 kernels (8-float vectors, FMA)."""
        return self.level >= ISA_LEVELS.index("avx2")

    @property
    def onednn_bf16(self) -> bool:
        """oneDNN computes bfloat16 here (``mkldnn_bf16_device_check``: ideep's
        ``has_bf16_type_support``, avx512_core or avx2_vnni_2)."""
        return self.avx512

    @property
    def native_dtypes(self) -> tuple[str, ...]:
        """The reduced-precision dtypes (``torch.dtype`` names) this CPU computes
        with native instructions: oneDNN's brgemm kernels and ATen's packed
        attention, whose scratch the rules do not model."""
        return _NATIVE_DTYPES.get(self.isa, ())

    @property
    def simd(self) -> int:
        """floats in one vector register of the widest oneDNN f32 kernels."""
        return 16 if self.avx512 else 8 if self.avx2 else 4

    @property
    def aten_capability(self) -> str:
        """What ``torch.backends.cpu.get_cpu_capability()`` says on such a CPU."""
        return _ATEN_CAPABILITY[self.isa].upper()

    @property
    def default_caches(self) -> bool:
        return (self.l1d, self.l2, self.l3) == _CACHES[self.isa]

    def __str__(self) -> str:
        name = f"{self.isa}:{self.threads}"
        if self.default_caches:
            return name
        return f"{name} (L1d {_size(self.l1d)}, L2 {_size(self.l2)}, L3 {_size(self.l3)} per core)"

    def to_json(self) -> dict[str, int | str]:
        """The profile as a JSON object (what a snapshot entry records)."""
        return {"isa": self.isa, "threads": self.threads, "l1d": self.l1d, "l2": self.l2, "l3": self.l3}

    @classmethod
    def from_json(cls, data: dict[str, int | str]) -> CpuProfile:
        return cls(**data)  # type: ignore[arg-type]


_PROFILE_TEXT: Final = re.compile(r"^\s*([a-z0-9_]+)\s*:\s*(\d+)\s*$", re.IGNORECASE)


def cpu_profile(value: str | CpuProfile | None) -> CpuProfile:
    """The profile ``value`` names: ``None`` or ``"host"`` for this host, a string
    such as ``"avx2:4"``, or a :class:`CpuProfile` (returned as is)."""
    if isinstance(value, CpuProfile):
        return value
    if value is None:
        return host_profile()
    if not isinstance(value, str):
        raise TypeError(
            f"cpu must be a profile such as 'avx2:4', 'host' or a CpuProfile, got {value!r}"
        )
    if value.strip().lower() == HOST:
        return host_profile()
    match = _PROFILE_TEXT.match(value)
    if match is None:
        raise ValueError(
            f"cpu profile {value!r} is not '<level>:<threads>'; write e.g. 'avx2:4' "
            f"(levels: {', '.join(ISA_LEVELS)}) or 'host'"
        )
    return CpuProfile(isa=match.group(1), threads=int(match.group(2)))


# -- this host ------------------------------------------------------------------------------------


def host_profile() -> CpuProfile:
    """This process's CPU as its kernels see it now: the ISA level both ATen and
    oneDNN dispatch to (after ``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA``), the
    current intra-op thread count, and the per-core cache sizes.

    Raises ``ValueError`` when ATen and oneDNN are capped to different levels,
    or when the host is not an x86 CPU the rules know.
    """
    import torch

    isa = _host_isa()
    l1d, l2, l3 = _host_caches(isa)
    return CpuProfile(isa=isa, threads=torch.get_num_threads(), l1d=l1d, l2=l2, l3=l3)


@functools.lru_cache(maxsize=1)
def _host_isa() -> str:
    import torch

    capability = torch.backends.cpu.get_cpu_capability().upper()
    aten = {"DEFAULT": "default", "AVX2": "avx2", "AVX512": "avx512"}.get(capability)
    if aten is None:
        raise ValueError(
            f"this host's CPU ({capability}) is not an x86 level the CPU rules know; "
            f"name a profile instead (cpu='{DEFAULT_CPU}'), which gives the same bytes on any host"
        )
    onednn = _onednn_level()
    # ATen's dispatch stops at AVX512; the levels above it differ in oneDNN only.
    if onednn == "avx" or min(ISA_LEVELS.index(onednn), ISA_LEVELS.index("avx512")) != ISA_LEVELS.index(aten):
        lower = "default" if onednn == "avx" else min(aten, onednn, key=ISA_LEVELS.index)
        raise ValueError(
            f"this process runs ATen's {aten} kernels (ATEN_CPU_CAPABILITY) and oneDNN's "
            f"{onednn} ones (ONEDNN_MAX_CPU_ISA): the CPU rules model one level for both; "
            f"cap both, e.g. ATEN_CPU_CAPABILITY={_ATEN_CAPABILITY[lower]} "
            f"ONEDNN_MAX_CPU_ISA={_ONEDNN_ISA[lower]}, or name a profile"
        )
    return onednn


#: ``ONEDNN_MAX_CPU_ISA`` values (oneDNN's ``cpu_isa_t`` names) -> the level they cap to.
_ONEDNN_CAPS: Final = {
    "SSE41": "default", "AVX": "avx", "AVX2": "avx2", "AVX2_VNNI": "avx2",
    "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX512_CORE_AMX": "amx", "AVX10_1_512_AMX": "amx",
}


def _onednn_level() -> str:
    """The level of the oneDNN kernels this process may use: the CPU's, capped by
    ``ONEDNN_MAX_CPU_ISA`` (or its older name ``DNNL_MAX_CPU_ISA``); ``"avx"``
    for AVX without AVX2, which no level models."""
    if private("torch.cpu._is_amx_tile_supported")():
        level = "amx"
    elif private("torch.cpu._is_avx512_bf16_supported")():
        level = "avx512_bf16"
    elif private("torch.cpu._is_avx512_supported")():
        level = "avx512"
    elif private("torch.cpu._is_avx2_supported")():
        level = "avx2"
    else:
        level = "default"
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap in ("", "ALL", "DEFAULT"):
        return level
    capped = _ONEDNN_CAPS.get(cap)
    if capped is None:
        raise ValueError(
            f"ONEDNN_MAX_CPU_ISA={cap} is not a level the CPU rules know; cap to one of "
            f"{', '.join(sorted(_ONEDNN_CAPS))} or name a profile (cpu='{DEFAULT_CPU}')"
        )
    if capped == "avx":
        return "avx" if level != "default" else level
    return min(level, capped, key=ISA_LEVELS.index)


def _host_caches(isa: str) -> tuple[int, int, int]:
    """Per-core L1d, L2 and L3 bytes: each cache's size over the logical CPUs that
    share it (sysfs), or the level's typical sizes where sysfs does not say."""
    found = _sysfs_caches()
    return tuple(found.get(level, default) for level, default in zip((1, 2, 3), _CACHES[isa]))  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def _sysfs_caches() -> dict[int, int]:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    found: dict[int, int] = {}
    try:
        for index in sorted(base.glob("index*")):
            if (index / "type").read_text().strip() not in ("Unified", "Data"):
                continue
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip().upper()
            scale = {"K": _KiB, "M": _MiB}.get(size[-1:], 1)
            nbytes = int(size.rstrip("KM")) * scale
            shared = _count_cpus((index / "shared_cpu_list").read_text().strip())
            found[level] = nbytes // max(1, shared)
    except (OSError, ValueError):
        return {}
    return found


def _count_cpus(cpu_list: str) -> int:
    count = 0
    for part in cpu_list.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi) - int(lo) + 1 if hi else 1
    return count


def capped_environment(profile: CpuProfile) -> dict[str, str]:
    """The environment variables that make a process on a faster host dispatch as
    ``profile``'s level does (for ground truth from ``measure`` in a subprocess):
    ATen's kernels, oneDNN's and MKL's (on an Intel host; MKL ignores the cap
    elsewhere), and an inductor cache of the level's own (:func:`capped_inductor_cache`)."""
    return {
        "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[profile.isa],
        "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[profile.isa],
        "MKL_ENABLE_INSTRUCTIONS": _MKL_ISA[profile.isa],
        "TORCHINDUCTOR_CACHE_DIR": capped_inductor_cache(profile.isa),
    }


_CAPPED_CACHE: Final = "-capped-"


def capped_inductor_cache(isa: str) -> str:
    """Inductor's on-disk cache for processes capped to the level ``isa``.

    Inductor's cache keys (torch 2.13) do not include ``ATEN_CPU_CAPABILITY``, by
    which it picks the vector ISA of the kernels it builds: a process capped to
    another level than the one that filled the cache loads those programs and
    computes wrong values or crashes (seen: AVX2-capped after an uncapped compile on
    an AVX512 host). Each capped level therefore gets a cache directory of its own,
    beside the one in use (``TORCHINDUCTOR_CACHE_DIR`` or inductor's default)."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if base is None:
        base = private("torch._inductor.runtime.cache_dir_utils.default_cache_dir")()
    base = base.split(_CAPPED_CACHE)[0]
    return f"{base}{_CAPPED_CACHE}{isa}"
