"""The ``memory_budget`` marker and the option values it shares: parsing and validation.

A test's marks become one :class:`MarkerSpec` (closer marks override farther
ones, key by key); a malformed value is a :class:`MarkerError` that names it and
says how to write it. The options of the run (``--torchmem-rtol``, ``--torchmem-gpu``,
...) are read by the same functions. Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pytest_torchmem.engine.step.compiling import CompileOptions, compile_options
from pytest_torchmem.engine.figures.gpu_profiles import PROFILES, GpuProfile, gpu_profile
from pytest_torchmem.engine.figures.units import parse_bytes
from pytest_torchmem.plugin.judging import Tolerance

__all__ = [
    "BUDGETS",
    "CPU_ISA_LEVELS",
    "MARKER",
    "MarkerError",
    "MarkerSpec",
    "parse_compile",
    "parse_cpu",
    "parse_devices",
    "parse_fits",
    "parse_gpu",
    "parse_marker",
    "parse_mesh",
    "parse_rtol",
    "parse_size",
]

#: The figures a ``memory_budget`` marker can cap.
BUDGETS: Final = ("forward", "backward", "step", "peak")
_MARKER_KEYS: Final = (
    *BUDGETS, "devices", "rtol", "atol", "gpu", "cpu", "keep_output", "compile", "mesh", "rank", "fits", "leak"
)
#: The ISA levels of CPU profiles: ``tracing.devices.cpu.profiles.ISA_LEVELS``, spelled
#: out so that reading options and markers needs no torch (a test checks that the two agree).
CPU_ISA_LEVELS: Final = ("default", "avx2", "avx512", "avx512_bf16", "amx")
#: The marker of budgets and per-test settings.
MARKER: Final = "memory_budget"


class MarkerError(ValueError):
    """A malformed ``memory_budget`` marker."""


@dataclass(frozen=True)
class MarkerSpec:
    """What the ``memory_budget`` markers of a test say (None: not said)."""

    budgets: Mapping[str, int] = field(default_factory=dict)
    devices: tuple[str, ...] | None = None
    rtol: float | None = None
    atol: int | None = None
    #: The GPU profile the ``cuda`` estimate follows.
    gpu: GpuProfile | None = None
    #: The CPU profile the ``cpu`` estimate follows (``"avx2:4"``, or ``"host"``).
    cpu: str | None = None
    #: Whether the model's output is held through backward (``keep_output``).
    keep_output: bool | None = None
    #: ``compile=``: the options to check the model compiled with, or False (eager).
    compile: CompileOptions | Literal[False] | None = None
    #: The mesh of ``torchmem.check(parallel=...)``, in place of the Parallel's own.
    mesh: Mapping[str, int] | None = None
    #: The rank of ``torchmem.check(parallel=...)`` (an int or ``"max"``), in place of its own.
    rank: int | str | None = None
    #: ``fits=``: the GPUs the cuda step must fit (``True``: the one it follows); None: not asked.
    fits: tuple[GpuProfile, ...] | Literal[True] | None = None
    #: ``leak=``: the growth per iteration a leak check allows (None: no leak check asked).
    leak: int | None = None

    def tolerance(self, default: Tolerance) -> Tolerance:
        return Tolerance(
            default.rtol if self.rtol is None else self.rtol,
            default.atol if self.atol is None else self.atol,
        )


def parse_rtol(value: Any, where: str) -> float:
    """A relative tolerance: a number >= 0 (``0.02`` is 2 %)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise MarkerError(
                f"{where}: cannot read {value!r} as a relative tolerance; write e.g. 0.02"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MarkerError(
            f"{where}: a relative tolerance must be a number such as 0.02, got {value!r}"
        )
    if value < 0:
        raise MarkerError(f"{where}: a relative tolerance cannot be negative, got {value!r}")
    return float(value)


def parse_size(value: Any, where: str) -> int:
    """A byte size (``parse_bytes``), with ``where`` in the error."""
    try:
        return parse_bytes(value)
    except (TypeError, ValueError) as exc:
        raise MarkerError(f"{where}: {exc}") from None


def parse_devices(value: Any, valid: Iterable[str], where: str) -> tuple[str, ...]:
    """Device names: a string (``"cpu"`` or ``"cpu,cuda"``) or a sequence of strings."""
    valid = tuple(valid)
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(part, str) for part in value):
        names = [part.strip() for part in value]
    else:
        raise MarkerError(
            f"{where}: devices must be a name or a tuple of names such as ('cpu',), got {value!r}"
        )
    if not names or any(not name for name in names):
        raise MarkerError(f"{where}: devices must name at least one device, got {value!r}")
    for name in names:
        if name not in valid:
            raise MarkerError(
                f"{where}: device {name!r} is not modelled; use one of: {', '.join(valid)}"
            )
    return tuple(dict.fromkeys(names))


def parse_gpu(value: Any, custom: Mapping[str, GpuProfile], where: str) -> GpuProfile:
    """The GPU profile ``value`` names: a name among the named profiles or ``custom``
    (the ``torchmem_gpus`` ini table; case-insensitive), ``"current"`` (this machine's
    GPU), a profile line (``"RTX4070TiS: memory=16GiB cc=8.9 sms=66"``) or a
    :class:`~pytest_torchmem.GpuProfile`."""
    known = ", ".join([*PROFILES, *custom])
    fix = (
        "describe another in the ini option torchmem_gpus (NAME: memory=16GiB cc=8.9 sms=66), "
        "or use 'current' for this machine's GPU"
    )
    if not isinstance(value, (str, GpuProfile)):
        raise MarkerError(
            f"{where}: a GPU profile is a name such as 'A100' or a tm.GpuProfile, got {value!r}; "
            f"known profiles: {known}"
        )
    try:
        return gpu_profile(value, custom)
    except ValueError as exc:
        if isinstance(value, str) and ":" not in value and value.strip().lower() != "current":
            raise MarkerError(
                f"{where}: unknown GPU profile {value!r}; known profiles: {known}; {fix}"
            ) from None
        raise MarkerError(f"{where}: {exc}") from None


def parse_cpu(value: Any, where: str) -> str:
    """A CPU profile: ``"<ISA level>:<intra-op threads>"`` (``"avx2:4"``) or ``"host"``,
    normalised (lower case, no spaces)."""
    fix = (
        f"write '<level>:<threads>' such as 'avx2:4' (levels: {', '.join(CPU_ISA_LEVELS)}), "
        "or 'host' for this machine"
    )
    if not isinstance(value, str):
        raise MarkerError(f"{where}: a CPU profile is a string; {fix}, got {value!r}")
    text = value.strip().lower()
    if text == "host":
        return text
    level, sep, threads = text.partition(":")
    level, threads = level.strip(), threads.strip()
    if not sep or level not in CPU_ISA_LEVELS or not threads.isdecimal() or int(threads) < 1:
        raise MarkerError(f"{where}: cannot read {value!r} as a CPU profile; {fix}")
    return f"{level}:{int(threads)}"


def parse_marker(
    marks: Sequence[Any], valid_devices: Iterable[str], gpus: Mapping[str, GpuProfile] | None = None
) -> MarkerSpec:
    """Read the ``memory_budget`` marks of a test, closest first (as ``iter_markers`` gives).

    A closer mark (the function's) overrides a farther one (its class's or
    module's) key by key. ``gpus`` are the GPU profiles of the ini table, by name
    (the named profiles are always known). Raises
    :class:`MarkerError` naming the bad value.
    """
    merged: dict[str, Any] = {}
    for mark in reversed(list(marks)):
        if mark.args:
            raise MarkerError(
                f"@pytest.mark.{MARKER} takes keyword arguments only "
                f"({', '.join(_MARKER_KEYS)}), got positional {mark.args!r}"
            )
        unknown = sorted(set(mark.kwargs) - set(_MARKER_KEYS))
        if unknown:
            raise MarkerError(
                f"@pytest.mark.{MARKER} does not know {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(_MARKER_KEYS)}"
            )
        merged.update(mark.kwargs)
    budgets = {
        phase: parse_size(merged[phase], f"{MARKER}({phase}={merged[phase]!r})")
        for phase in BUDGETS
        if merged.get(phase) is not None
    }
    devices = None
    if merged.get("devices") is not None:
        devices = parse_devices(
            merged["devices"], valid_devices, f"{MARKER}(devices={merged['devices']!r})"
        )
    rtol = None
    if merged.get("rtol") is not None:
        rtol = parse_rtol(merged["rtol"], f"{MARKER}(rtol={merged['rtol']!r})")
    atol = None
    if merged.get("atol") is not None:
        atol = parse_size(merged["atol"], f"{MARKER}(atol={merged['atol']!r})")
    gpu = None
    if merged.get("gpu") is not None:
        gpu = parse_gpu(merged["gpu"], gpus or {}, f"{MARKER}(gpu={merged['gpu']!r})")
    cpu = None
    if merged.get("cpu") is not None:
        cpu = parse_cpu(merged["cpu"], f"{MARKER}(cpu={merged['cpu']!r})")
    keep_output = merged.get("keep_output")
    if keep_output is not None and not isinstance(keep_output, bool):
        raise MarkerError(
            f"{MARKER}(keep_output={keep_output!r}): keep_output must be True or False"
        )
    compile = merged.get("compile")
    if compile is not None:
        compile = parse_compile(compile, f"{MARKER}(compile={compile!r})") or False
    mesh = merged.get("mesh")
    if mesh is not None:
        mesh = parse_mesh(mesh, f"{MARKER}(mesh={mesh!r})")
    rank = merged.get("rank")
    if rank is not None and rank != "max" and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise MarkerError(f"{MARKER}(rank={rank!r}): rank must be a rank number (0, 1, ...) or 'max'")
    fits = None
    if merged.get("fits") is not None:
        fits = parse_fits(merged["fits"], gpus or {}, f"{MARKER}(fits={merged['fits']!r})")
    leak = None
    if merged.get("leak") is not None:
        leak = parse_size(merged["leak"], f"{MARKER}(leak={merged['leak']!r})")
    return MarkerSpec(
        leak=leak,
        budgets=budgets,
        devices=devices,
        rtol=rtol,
        atol=atol,
        gpu=gpu,
        cpu=cpu,
        keep_output=keep_output,
        compile=compile,
        mesh=mesh,
        rank=rank,
        fits=fits,
    )


def parse_fits(
    value: Any, custom: Mapping[str, GpuProfile], where: str
) -> tuple[GpuProfile, ...] | Literal[True] | None:
    """``fits=``: ``True`` (the GPU the check follows), ``False`` (not asked: None), a GPU
    (as ``gpu=`` takes one) or a list or tuple of them."""
    if value is True:
        return True
    if value is False:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise MarkerError(f"{where}: fits= names at least one GPU, or is True (the check's GPU)")
    profiles = tuple(parse_gpu(one, custom, where) for one in values)
    return tuple(dict.fromkeys(profiles))


def parse_compile(value: Any, where: str) -> CompileOptions | None:
    """``compile=`` (:func:`~pytest_torchmem.engine.step.compiling.compile_options`): None for
    an eager check."""
    try:
        return compile_options(value, where)
    except (TypeError, ValueError) as exc:
        raise MarkerError(str(exc)) from None


def parse_mesh(value: Any, where: str) -> dict[str, int]:
    """A mesh as the marker takes it: dimension names to positive sizes, ``{"dp": 8}``."""
    if not isinstance(value, Mapping) or not value:
        raise MarkerError(f"{where}: mesh must be a dict of dimension names to sizes, e.g. mesh={{'dp': 8}}")
    for name, size in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise MarkerError(f"{where}: dimension names must be identifiers such as 'dp', got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MarkerError(f"{where}: the size of dimension {name!r} must be a positive int, got {size!r}")
    return dict(value)

