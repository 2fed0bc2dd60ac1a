"""GPU profiles: the facts about a GPU that change what CUDA kernels allocate.

The fake ``cuda`` device is traced without a GPU, so the rules that depend on
the GPU read it from a profile, chosen with ``estimate(..., gpu=...)``,
``@pytest.mark.memory_budget(gpu=...)``, ``--torchmem-gpu`` or the
``torchmem_gpu`` ini option (the default is :data:`DEFAULT_GPU`). A profile
is a value, :class:`GpuProfile`, made of the properties the rules read:

==============================  ===============================================================
property                        what reads it
==============================  ===============================================================
``memory``                      ``total_memory`` as the program sees it (``get_device_properties``)
``compute_capability``          cuBLAS's default workspace size; which attention backend
                                runs (flash, memory-efficient, cuDNN) and its limits;
                                cuDNN convolution in bfloat16; ``is_bf16_supported()`` and
                                autocast's bfloat16 (8.0 and up)
``sm_count``                    reduction kernels' grids (their staging buffers),
                                flash attention's split-KV buffers and its deterministic
                                backward's accumulators, layer norm's backward
``max_threads_per_sm``          reduction kernels' grids; inductor's launch heuristics
``shared_memory_per_block``     inductor's template heuristics (``sharedMemPerBlockOptin``)
==============================  ===============================================================

The last two follow from the compute capability (the CUDA C Programming
Guide's "Technical Specifications per Compute Capability"); a capability the
tables do not list takes 2048 threads and 227 KiB, unless given. Warp size
(32) and registers per SM (65536) are the same on every NVIDIA GPU the rules
model.

The named profiles (:data:`PROFILES`) are such values; any other GPU is
described with its properties, in Python (``GpuProfile("RTX4070TiS",
memory="16 GiB", compute_capability="8.9", sm_count=66)``), or as a line
``RTX4070TiS: memory=16GiB cc=8.9 sms=66`` (:func:`parse_gpu_line`: the
``torchmem_gpus`` ini option). ``"current"`` is the GPU of this machine
(:meth:`GpuProfile.from_device`).

The rules model NVIDIA's CUDA kernels (cuBLAS, cuDNN, flash attention):
an AMD GPU (ROCm: hipBLASLt, MIOpen, CK/AOTriton attention) is not modelled,
and its properties (a ``gfx`` architecture) are refused.

Nothing here imports torch (but :meth:`GpuProfile.from_device`): the pytest
plugin reads the ini file's profiles in every run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from pytest_torchmem.engine.figures.units import parse_bytes

__all__ = [
    "CUDA_CONTEXT",
    "CURRENT",
    "DEFAULT_GPU",
    "GpuProfile",
    "GpuProfileError",
    "PROFILES",
    "gpu_profile",
    "parse_gpu_line",
    "parse_gpu_table",
    "usable_memory",
]

_KiB: Final = 1 << 10
_MiB: Final = 1 << 20
_GiB: Final = 1 << 30

#: The value that names this machine's GPU.
CURRENT: Final = "current"

#: ``cudaDeviceProp::maxThreadsPerMultiProcessor`` by compute capability (CUDA C
#: Programming Guide, "Technical Specifications per Compute Capability").
_THREADS_PER_SM: Final[Mapping[tuple[int, int], int]] = {
    (7, 0): 2048,
    (7, 2): 2048,
    (7, 5): 1024,
    (8, 0): 2048,
    (8, 6): 1536,
    (8, 7): 2048,
    (8, 9): 1536,
    (9, 0): 2048,
    (10, 0): 2048,
    (10, 3): 2048,
    (12, 0): 1536,
    (12, 1): 1536,
}
#: ``cudaDeviceProp::sharedMemPerBlockOptin`` by compute capability (the same table:
#: "Maximum amount of shared memory per thread block", 1 KiB less than per SM).
_SHARED_PER_BLOCK: Final[Mapping[tuple[int, int], int]] = {
    (7, 0): 96 * _KiB,
    (7, 5): 64 * _KiB,
    (8, 0): 163 * _KiB,
    (8, 6): 99 * _KiB,
    (8, 7): 163 * _KiB,
    (8, 9): 99 * _KiB,
    (9, 0): 227 * _KiB,
    (10, 0): 227 * _KiB,
    (10, 3): 227 * _KiB,
    (12, 0): 99 * _KiB,
    (12, 1): 99 * _KiB,
}
#: What a capability the tables do not list takes (Hopper's and Blackwell's values).
_DEFAULT_THREADS_PER_SM: Final = 2048
_DEFAULT_SHARED_PER_BLOCK: Final = 227 * _KiB
#: The oldest compute capability the rules follow.
_OLDEST: Final = (7, 0)
#: A GPU's memory below this is a forgotten unit (``memory=16``: 16 bytes).
_SMALLEST_MEMORY: Final = _GiB

_NOT_NVIDIA: Final = (
    "the fake cuda device models NVIDIA's CUDA kernels (cuBLAS, cuDNN, flash attention), "
    "not an AMD GPU's (ROCm: hipBLASLt, MIOpen, CK/AOTriton attention, other workspaces); "
    "see the GPU-profiles how-to for what an NVIDIA profile of the same size tells"
)
_EXAMPLE: Final = "GpuProfile('RTX4070TiS', memory='16 GiB', compute_capability='8.9', sm_count=66)"


class GpuProfileError(ValueError):
    """A GPU profile that cannot be made: the message names the property and the fix."""


def _bytes(value: Any, field: str, what: str) -> int:
    try:
        nbytes = parse_bytes(value)
    except (TypeError, ValueError) as exc:
        raise GpuProfileError(f"{field}: {exc}") from None
    if nbytes <= 0:
        raise GpuProfileError(f"{field}: {what} must be positive, got {value!r}")
    return nbytes


def _memory(value: Any, field: str) -> int:
    nbytes = _bytes(value, field, "the GPU's memory")
    if nbytes < _SMALLEST_MEMORY:
        raise GpuProfileError(
            f"{field}: {value!r} is {nbytes} bytes, less than any GPU has; "
            "write the unit, e.g. '16 GiB' (torch.cuda.get_device_properties().total_memory)"
        )
    return nbytes


def _count(value: Any, field: str, what: str, source: str) -> int:
    if isinstance(value, str) and value.strip().isdecimal():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GpuProfileError(
            f"{field}: {what} must be a positive whole number ({source}), got {value!r}"
        )
    return value


def _capability(value: Any, field: str) -> tuple[int, int]:
    """``(major, minor)`` from ``(8, 9)``, ``"8.9"`` or ``8.9``."""
    text = None
    if isinstance(value, str):
        text = value.strip()
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        if all(isinstance(part, int) and not isinstance(part, bool) for part in value):
            text = f"{value[0]}.{value[1]}"
    if text is not None and text.lower().startswith("gfx"):
        raise GpuProfileError(f"{field}: {value!r} is an AMD architecture: {_NOT_NVIDIA}")
    match = re.fullmatch(r"([0-9]+)\.([0-9]+)", text or "")
    if match is None:
        raise GpuProfileError(
            f"{field}: cannot read {value!r} as a compute capability; write it as '8.9' or "
            "(8, 9) (torch.cuda.get_device_capability())"
        )
    capability = (int(match.group(1)), int(match.group(2)))
    if capability < _OLDEST:
        raise GpuProfileError(
            f"{field}: compute capability {capability[0]}.{capability[1]} is not modelled; the "
            "rules follow NVIDIA GPUs of compute capability 7.0 (Volta) and newer"
        )
    return capability


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise GpuProfileError(f"name: a GPU profile needs a name such as 'RTX4070TiS', got {value!r}")
    name = value.strip()
    bad = sorted({char for char in name if char in ":=," or not char.isprintable()})
    if bad:
        raise GpuProfileError(
            f"name: {value!r} holds {', '.join(map(repr, bad))}, which the ini table and "
            "--torchmem-gpu use to separate properties; name it without them"
        )
    if name.lower() == CURRENT:
        raise GpuProfileError(
            f"name: {CURRENT!r} names this machine's GPU (gpu='current'); call yours otherwise"
        )
    return name


def _exact_size(nbytes: int) -> str:
    """``16GiB``: the largest binary unit that divides ``nbytes`` (read back by parse_bytes)."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", _GiB), ("MiB", _MiB), ("KiB", _KiB)):
        if nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


@dataclass(frozen=True, init=False)
class GpuProfile:
    """One NVIDIA GPU, as far as what its kernels allocate depends on it.

    ``name`` names it in reports and snapshot entries. ``memory`` is the
    device memory (``total_memory``): bytes, or a string such as ``"16 GiB"``.
    ``compute_capability`` is ``(major, minor)``, also written ``"8.9"``
    (``torch.cuda.get_device_capability()``), 7.0 or newer. ``sm_count`` is
    the number of streaming multiprocessors (``multi_processor_count``).
    ``max_threads_per_sm`` and ``shared_memory_per_block`` (the opt-in
    maximum) follow from the compute capability unless given.

    Every value is checked: a bad one raises :class:`GpuProfileError` (a
    ``ValueError``) naming the property and the fix.
    """

    name: str
    #: Device memory in bytes (``total_memory``).
    memory: int
    #: ``(major, minor)``, e.g. ``(9, 0)`` for Hopper.
    compute_capability: tuple[int, int]
    #: Streaming multiprocessors (``multi_processor_count``).
    sm_count: int
    #: ``maxThreadsPerMultiProcessor``.
    max_threads_per_sm: int
    #: ``sharedMemPerBlockOptin`` in bytes.
    shared_memory_per_block: int

    def __init__(
        self,
        name: str,
        *,
        memory: int | str,
        compute_capability: tuple[int, int] | str | float,
        sm_count: int,
        max_threads_per_sm: int | None = None,
        shared_memory_per_block: int | str | None = None,
    ) -> None:
        checked_name = _name(name)
        checked_memory = _memory(memory, "memory")
        capability = _capability(compute_capability, "compute_capability")
        sms = "torch.cuda.get_device_properties().multi_processor_count"
        values = {
            "name": checked_name,
            "memory": checked_memory,
            "compute_capability": capability,
            "sm_count": _count(sm_count, "sm_count", "the number of SMs", sms),
            "max_threads_per_sm": _threads(max_threads_per_sm, capability, "max_threads_per_sm"),
            "shared_memory_per_block": _shared(
                shared_memory_per_block, capability, "shared_memory_per_block"
            ),
        }
        for field, value in values.items():
            object.__setattr__(self, field, value)

    @property
    def sm(self) -> int:
        """``major * 10 + minor``: 90 for Hopper, 80 for A100."""
        major, minor = self.compute_capability
        return major * 10 + minor

    @property
    def bf16(self) -> bool:
        """Whether the GPU computes bfloat16 (compute capability 8.0 and up): what
        ``torch.cuda.is_bf16_supported()`` and autocast answer."""
        return self.compute_capability >= (8, 0)

    @property
    def device_name(self) -> str:
        """What ``torch.cuda.get_device_name()`` answers: ``"NVIDIA H100"``."""
        return self.name if self.name.upper().startswith("NVIDIA") else f"NVIDIA {self.name}"

    def runs_like(self, other: GpuProfile) -> bool:
        """Whether ``other`` runs a step's kernels as this GPU does: the same compute
        capability, SMs, threads per SM and shared memory per block, which is all the
        fake cuda device chooses kernels and workspaces by (the memory sets the room
        left only). A measurement on ``other`` is the ground truth of an estimate
        that follows this profile only where it does."""
        return (
            self.compute_capability == other.compute_capability
            and self.sm_count == other.sm_count
            and self.max_threads_per_sm == other.max_threads_per_sm
            and self.shared_memory_per_block == other.shared_memory_per_block
        )

    @property
    def builtin(self) -> bool:
        """Whether this is one of the named :data:`PROFILES`, property for property."""
        return PROFILES.get(self.name) == self

    def properties(self) -> dict[str, int | str]:
        """The properties by their ini keys (``{"memory": "16GiB", "cc": "8.9", "sms": 66,
        "threads_per_sm": 1536, "shared_per_block": "99KiB"}``): what a snapshot entry
        made with a profile not among :data:`PROFILES` records (``gpu_sms``, ...)."""
        major, minor = self.compute_capability
        return {
            "memory": _exact_size(self.memory),
            "cc": f"{major}.{minor}",
            "sms": self.sm_count,
            "threads_per_sm": self.max_threads_per_sm,
            "shared_per_block": _exact_size(self.shared_memory_per_block),
        }

    @property
    def spec(self) -> str:
        """The properties as a line of the ini table writes them, after ``NAME:``
        (``memory=16GiB cc=8.9 sms=66 threads_per_sm=1536 shared_per_block=99KiB``)."""
        return " ".join(f"{key}={value}" for key, value in self.properties().items())

    def __str__(self) -> str:
        return self.name

    @classmethod
    def from_properties(cls, properties: Any, name: str | None = None) -> GpuProfile:
        """The profile of the GPU ``properties`` describes (what
        ``torch.cuda.get_device_properties`` returns, or any object with its
        ``name``, ``major``, ``minor``, ``multi_processor_count`` and
        ``total_memory``; ``max_threads_per_multi_processor`` and
        ``shared_memory_per_block_optin`` where present). ``name`` replaces the
        device's name."""
        arch = str(getattr(properties, "gcnArchName", "") or "")
        if arch.lower().startswith("gfx"):
            raise GpuProfileError(f"this GPU is an AMD {arch.split(':')[0]}: {_NOT_NVIDIA}")
        missing = [
            attribute
            for attribute in ("name", "major", "minor", "multi_processor_count", "total_memory")
            if not hasattr(properties, attribute)
        ]
        if missing:
            raise GpuProfileError(
                f"the device properties lack {', '.join(missing)}; pass what "
                "torch.cuda.get_device_properties() returns"
            )
        return cls(
            properties.name if name is None else name,
            memory=properties.total_memory,
            compute_capability=(properties.major, properties.minor),
            sm_count=properties.multi_processor_count,
            max_threads_per_sm=getattr(properties, "max_threads_per_multi_processor", None) or None,
            shared_memory_per_block=getattr(properties, "shared_memory_per_block_optin", None) or None,
        )

    @classmethod
    def from_device(cls, device: Any = None, name: str | None = None) -> GpuProfile:
        """The profile of a GPU of this machine (``device``: an index, ``"cuda:1"``
        or a ``torch.device``; None: the current one), read from
        ``torch.cuda.get_device_properties``."""
        import torch

        if torch.version.hip is not None:
            raise GpuProfileError(f"this torch runs on ROCm: {_NOT_NVIDIA}")
        if not torch.cuda.is_available():
            raise GpuProfileError(
                f"{CURRENT!r} is this machine's GPU, and torch.cuda.is_available() is False "
                "here; name a profile instead ('H100', or yours by its properties: "
                f"{_EXAMPLE} or the ini option torchmem_gpus)"
            )
        if device is None:
            device = torch.cuda.current_device()
        return cls.from_properties(torch.cuda.get_device_properties(device), name)


def _threads(value: Any, capability: tuple[int, int], field: str) -> int:
    if value is None:
        return _THREADS_PER_SM.get(capability, _DEFAULT_THREADS_PER_SM)
    source = "torch.cuda.get_device_properties().max_threads_per_multi_processor"
    threads = _count(value, field, "the threads per SM", source)
    if threads % 32:
        raise GpuProfileError(f"{field}: {threads} is not a multiple of the warp size, 32 ({source})")
    return threads


def _shared(value: Any, capability: tuple[int, int], field: str) -> int:
    if value is None:
        return _SHARED_PER_BLOCK.get(capability, _DEFAULT_SHARED_PER_BLOCK)
    return _bytes(value, field, "the shared memory per block")


def _named(name: str, compute_capability: tuple[int, int], sm_count: int, memory: int) -> GpuProfile:
    return GpuProfile(name, memory=memory, compute_capability=compute_capability, sm_count=sm_count)


#: The named profiles. ``memory`` is what ``torch.cuda.get_device_properties().total_memory``
#: reports on a recent driver (published readings of ``_CudaDeviceProperties``, in MiB),
#: less than the card's nominal size: ECC and the driver hold some back. Where no such
#: reading was found (A100 80GB, L4) it is ``nvidia-smi``'s total less the 469 MiB the
#: same drivers hold back on the H100 (81,559 to 81,090 MiB) and the L4 (23,034 MiB
#: total, 469 MiB reserved at idle). A driver of another release holds back a few MiB
#: more or less: ``gpu="current"`` reads the device itself.
PROFILES: Final[Mapping[str, GpuProfile]] = {
    profile.name: profile
    for profile in (
        _named("V100", (7, 0), 80, 32_510 * _MiB),  # Tesla V100-PCIE-32GB
        _named("T4", (7, 5), 40, 15_095 * _MiB),  # Tesla T4 (15,079 to 15,109 MiB seen)
        _named("A100", (8, 0), 108, 81_451 * _MiB),  # A100-SXM4-80GB: 81,920 - 469
        _named("A100-40GB", (8, 0), 108, 40_536 * _MiB),  # A100-SXM4-40GB
        _named("A10G", (8, 6), 80, 22_587 * _MiB),
        _named("RTX4090", (8, 9), 128, 24_563 * _MiB),  # GeForce RTX 4090
        _named("L4", (8, 9), 58, 22_565 * _MiB),  # 23,034 - 469
        _named("L40S", (8, 9), 142, 45_589 * _MiB),
        _named("H100", (9, 0), 132, 81_090 * _MiB),  # H100 80GB HBM3 (81,082 to 81,090 MiB seen)
        _named("H200", (9, 0), 132, 143_156 * _MiB),
        _named("B200", (10, 0), 148, 182_642 * _MiB),  # 182,631 to 182,642 MiB seen
    )
}

#: The GPU modelled when none is named.
DEFAULT_GPU: Final = "H100"


def _lookup(name: str, profiles: Iterable[GpuProfile]) -> GpuProfile | None:
    wanted = name.strip().lower()
    return next((profile for profile in profiles if profile.name.lower() == wanted), None)


def gpu_profile(
    value: str | GpuProfile | None, custom: Mapping[str, GpuProfile] | None = None
) -> GpuProfile:
    """The profile ``value`` names: a :class:`GpuProfile` (returned as is), None
    (:data:`DEFAULT_GPU`), a name among :data:`PROFILES` or ``custom``
    (case-insensitive), ``"current"`` (this machine's GPU), or a profile written as
    a line of the ini table (``"RTX4070TiS: memory=16GiB cc=8.9 sms=66"``)."""
    if isinstance(value, GpuProfile):
        return value
    if value is None:
        return PROFILES[DEFAULT_GPU]
    if not isinstance(value, str):
        raise TypeError(
            f"gpu must be a GPU name such as 'H100', 'current' or a GpuProfile "
            f"({_EXAMPLE}), got {value!r}"
        )
    if value.strip().lower() == CURRENT:
        return GpuProfile.from_device()
    if ":" in value:
        return parse_gpu_line(value)
    found = _lookup(value, [*PROFILES.values(), *(custom or {}).values()])
    if found is None:
        known = [*PROFILES, *(custom or {})]
        raise ValueError(
            f"unknown GPU {value!r}; known GPUs: {', '.join(known)}; describe another by its "
            f"properties ({_EXAMPLE}), or use 'current' for this machine's GPU"
        )
    return found


# -- the ini table -------------------------------------------------------------------------

#: The keys of a profile line, each with the ``GpuProfile`` argument it gives.
_KEYS: Final[Mapping[str, str]] = {
    "memory": "memory",
    "cc": "compute_capability",
    "sms": "sm_count",
    "threads_per_sm": "max_threads_per_sm",
    "shared_per_block": "shared_memory_per_block",
}
#: The ``GpuProfile`` argument names are read too.
_ALIASES: Final[Mapping[str, str]] = {**_KEYS, **{field: field for field in _KEYS.values()}}
_REQUIRED: Final = ("memory", "cc", "sms")
_KEY: Final = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")
_LINE_EXAMPLE: Final = "'RTX4070TiS: memory=16GiB cc=8.9 sms=66'"


def parse_gpu_line(line: str) -> GpuProfile:
    """A profile written ``NAME: memory=16GiB cc=8.9 sms=66`` (optionally
    ``threads_per_sm=1536 shared_per_block=99KiB``; a value may hold spaces,
    ``memory=16 GiB``). Raises :class:`GpuProfileError` naming the key."""
    name, colon, rest = line.partition(":")
    if not colon:
        raise GpuProfileError(
            f"cannot read {line!r} as a GPU profile: write NAME: memory=... cc=... sms=..., "
            f"e.g. {_LINE_EXAMPLE}"
        )
    keys = list(_KEY.finditer(rest))
    before = rest[: keys[0].start()] if keys else rest
    if before.strip():
        raise GpuProfileError(
            f"GPU profile {name.strip()!r}: cannot read {before.strip()!r}; write key=value "
            f"pairs, e.g. {_LINE_EXAMPLE}"
        )
    given: dict[str, str] = {}
    for index, match in enumerate(keys):
        end = keys[index + 1].start() if index + 1 < len(keys) else len(rest)
        key, value = match.group(1).lower(), rest[match.end() : end].strip()
        field = _ALIASES.get(key)
        if field is None:
            raise GpuProfileError(
                f"GPU profile {name.strip()!r}: unknown property {key!r}; a line takes "
                f"{', '.join(_KEYS)} (e.g. {_LINE_EXAMPLE})"
            )
        if field in given:
            raise GpuProfileError(f"GPU profile {name.strip()!r}: {key} is given twice")
        if not value:
            raise GpuProfileError(f"GPU profile {name.strip()!r}: {key}= has no value")
        given[field] = value
    missing = [key for key in _REQUIRED if _KEYS[key] not in given]
    if missing:
        raise GpuProfileError(
            f"GPU profile {name.strip()!r}: missing {', '.join(f'{key}=' for key in missing)}; "
            f"a profile needs memory, cc and sms, e.g. {_LINE_EXAMPLE}"
        )
    short = {field: key for key, field in _KEYS.items()}
    try:
        return GpuProfile(name, **given)  # type: ignore[arg-type]
    except GpuProfileError as exc:
        # name the key as the line writes it
        message = str(exc)
        field, _, detail = message.partition(": ")
        key = short.get(field, field)
        raise GpuProfileError(f"GPU profile {name.strip()!r}: {key}: {detail}") from None


def parse_gpu_table(lines: Iterable[str]) -> dict[str, GpuProfile]:
    """The profiles of the ``torchmem_gpus`` ini option, one per line (blank lines and
    ``#`` comments skipped), by name. A name is given once and is not one of
    :data:`PROFILES`."""
    found: dict[str, GpuProfile] = {}
    for line in lines:
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        profile = parse_gpu_line(text)
        clash = _lookup(profile.name, [*PROFILES.values(), *found.values()])
        if clash is not None:
            where = "a named profile" if clash.name in PROFILES else "defined twice"
            raise GpuProfileError(
                f"GPU profile {profile.name!r}: {clash.name} is {where}; give yours another name"
            )
        found[profile.name] = profile
    return found


#: Device memory a process loses before its first tensor: the CUDA context (the
#: driver's per-process state, the kernels of torch's CUDA libraries as they load)
#: is not allocated through the caching allocator, and is not modelled; this much
#: is held back from a GPU's memory when asking whether a step fits. Measured
#: contexts of torch on recent drivers with lazy module loading (CUDA 11.7+'s
#: default) are 300 to 600 MiB; set ``GpuProfile``'s memory to what your
#: ``torch.cuda.mem_get_info()`` reports free at start-up to be exact.
CUDA_CONTEXT: Final = 512 << 20


def usable_memory(profile: GpuProfile) -> int:
    """What a step may take of the GPU ``profile``: its memory less :data:`CUDA_CONTEXT`."""
    return max(profile.memory - CUDA_CONTEXT, 0)
