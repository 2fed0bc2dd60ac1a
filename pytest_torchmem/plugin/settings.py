"""The run's options, read from the command line or their ini twins and validated: :class:`Settings`.

Each option ``--torchmem-NAME`` has an ini twin ``torchmem_NAME``; the command line
wins. A bad value is a usage error that names the option and the fix. Nothing
here imports torch (:func:`known_devices` and ``--torchmem-measure=on`` do, when
asked).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from pytest_torchmem.engine.figures.gpu_profiles import (
    DEFAULT_GPU,
    PROFILES,
    GpuProfile,
    GpuProfileError,
    parse_gpu_table,
)
from pytest_torchmem.plugin.judging import Tolerance
from pytest_torchmem.plugin.markers import (
    MarkerError,
    parse_cpu,
    parse_devices,
    parse_gpu,
    parse_rtol,
    parse_size,
)

__all__ = [
    "DEFAULT_CPU",
    "DEFAULT_DEVICES",
    "DEFAULT_GPU",
    "MEASURE_MODES",
    "STALE_MODES",
    "UNUSED_MODES",
    "Settings",
    "gpu_present",
    "known_devices",
]

#: The devices traced when neither the marker nor ``--torchmem-devices`` names any:
#: both fake devices (DESIGN.md).
DEFAULT_DEVICES: Final[tuple[str, ...]] = ("cpu", "cuda")
#: The CPU profile modelled when neither the marker nor ``--torchmem-cpu`` names one: a
#: fixed profile, so that cpu entries recorded on any machine compare on any other.
#: ``tracing.devices.cpu.profiles.DEFAULT_CPU``, spelled out so that the report header
#: needs no torch (a test checks that the two agree). The GPU profile modelled when
#: neither the marker nor ``--torchmem-gpu`` names one is ``gpu_profiles.DEFAULT_GPU``.
DEFAULT_CPU: Final = "avx2:4"

UNUSED_MODES: Final = ("fail", "warn", "ignore")
MEASURE_MODES: Final = ("auto", "on", "off")
STALE_MODES: Final = ("warn", "fail")


def _option(config: pytest.Config, name: str) -> tuple[Any, str]:
    """The value of option ``name`` (command line first, then ini) and where it came from."""
    value = config.getoption(name)
    if value is not None:
        return value, "--" + name.replace("_", "-")
    try:
        value = config.getini(name)
    except (ValueError, pytest.UsageError) as exc:
        value = _native_ini_value(config, name)
        if value is None:
            hint = "write true or false" if name in _FLAGS else "write it as a string"
            raise pytest.UsageError(f"ini option {name}: {exc}; {hint}") from None
    if value in ("", None):
        return None, ""
    return value, f"ini option {name}"


#: The options that are flags (``--torchmem-update``): their ini twins are booleans.
_FLAGS: Final = frozenset(
    {
        "torchmem_update",
        "torchmem_fail_on_improvement",
        "torchmem_keep_output",
        "torchmem_compile",
        "torchmem_per_torch",
    }
)


def _native_ini_value(config: pytest.Config, name: str) -> Any:
    """A value that a native TOML table (``[tool.pytest]``, pytest 9) gives as a number,
    a boolean or a list, in the form the option is read in; None if it has no such form.

    ``torchmem_rtol = 0.05`` reads as ``"0.05"``, ``torchmem_devices = ["cpu",
    "cuda"]`` as ``"cpu,cuda"``, ``torchmem_update = true`` as True.
    """
    raw = getattr(config, "_inicfg", {}).get(name)
    value = getattr(raw, "value", None)
    if isinstance(value, bool):
        return value if name in _FLAGS else None
    if name in _FLAGS:
        return None
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return ",".join(value)
    return None


@dataclass(frozen=True)
class Settings:
    """The options of the run, resolved and validated."""

    update: bool = False
    devices: tuple[str, ...] = DEFAULT_DEVICES
    #: True when ``--torchmem-devices`` narrowed the devices on the command line.
    devices_given: bool = False
    tolerance: Tolerance = Tolerance()
    unused: str = "fail"
    json_path: Path | None = None
    #: ``--torchmem-timeline``: where each check's timeline goes, for torch's memory viewer.
    timeline_dir: Path | None = None
    #: ``--torchmem-html``: the HTML report.
    html_path: Path | None = None
    measure: str = "auto"
    measure_rtol: float = 0.05
    gpu: GpuProfile = PROFILES[DEFAULT_GPU]
    #: The GPU profiles of the ``torchmem_gpus`` ini table.
    gpus: tuple[GpuProfile, ...] = ()
    #: ``"avx2:4"``-style profile, or ``"host"``.
    cpu: str = DEFAULT_CPU
    fail_on_improvement: bool = False
    stale: str = "warn"
    #: ``--torchmem-keep-output``: hold the model's output through backward by default.
    keep_output: bool = False
    #: ``--torchmem-compile``: check models as ``torch.compile(model)`` runs them by default.
    compile: bool = False
    #: ``--torchmem-per-torch``: one snapshot directory per torch release.
    per_torch: bool = False
    #: True when ``--torchmem-per-torch`` was given on the command line (not the ini file):
    #: the command that accepts a change must say it too.
    per_torch_given: bool = False
    #: ``--torchmem-advise``: a check over its budget or GPU estimates what would fit.
    advise: bool = False
    #: ``--torchmem-leaks``: every check is also a leak check (0 B allowed unless its marker
    #: says ``leak=``).
    leaks: bool = False

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        """Read every option (command line, else its ini twin); bad values are usage errors."""
        values: dict[str, Any] = {}
        try:
            values["update"] = bool(_option(config, "torchmem_update")[0])
            values["fail_on_improvement"] = bool(_option(config, "torchmem_fail_on_improvement")[0])
            values["keep_output"] = bool(_option(config, "torchmem_keep_output")[0])
            values["compile"] = bool(_option(config, "torchmem_compile")[0])
            values["advise"] = bool(_option(config, "torchmem_advise")[0])
            values["leaks"] = bool(_option(config, "torchmem_leaks")[0])
            per_torch, source = _option(config, "torchmem_per_torch")
            values["per_torch"] = bool(per_torch)
            values["per_torch_given"] = bool(per_torch) and source.startswith("--")
            devices, source = _option(config, "torchmem_devices")
            if devices is not None:
                values["devices"] = parse_devices(devices, known_devices(), source)
                values["devices_given"] = source.startswith("--")
            table = _gpu_table(config)
            values["gpus"] = tuple(table.values())
            gpu, source = _option(config, "torchmem_gpu")
            if gpu is not None:
                values["gpu"] = parse_gpu(gpu, table, source)
            cpu, source = _option(config, "torchmem_cpu")
            if cpu is not None:
                values["cpu"] = parse_cpu(cpu, source)
            rtol, rtol_source = _option(config, "torchmem_rtol")
            atol, atol_source = _option(config, "torchmem_atol")
            values["tolerance"] = Tolerance(
                0.0 if rtol is None else parse_rtol(rtol, rtol_source),
                0 if atol is None else parse_size(atol, atol_source),
            )
            measure_rtol, source = _option(config, "torchmem_measure_rtol")
            if measure_rtol is not None:
                values["measure_rtol"] = parse_rtol(measure_rtol, source)
        except MarkerError as exc:
            raise pytest.UsageError(str(exc)) from None
        modes = (("unused", UNUSED_MODES), ("measure", MEASURE_MODES), ("stale", STALE_MODES))
        for name, choices in modes:
            value, source = _option(config, f"torchmem_{name}")
            if value is None:
                continue
            if value not in choices:
                raise pytest.UsageError(
                    f"{source}: expected one of {', '.join(choices)}, got {value!r}"
                )
            values[name] = value
        for option, field_name in (
            ("torchmem_json", "json_path"),
            ("torchmem_timeline", "timeline_dir"),
            ("torchmem_html", "html_path"),
        ):
            path, source = _option(config, option)
            if path is not None:
                base = config.invocation_params.dir if source.startswith("--") else _ini_dir(config)
                values[field_name] = base / path
        settings = cls(**values)
        if settings.measure == "on" and not gpu_present():
            raise pytest.UsageError(
                "--torchmem-measure=on compares the estimate with a real GPU run, and "
                "torch.cuda.is_available() is False here; use auto or off"
            )
        return settings

    @property
    def record_frames(self) -> bool:
        """Whether the trace keeps the user's frames of each allocation (for the exports)."""
        return self.timeline_dir is not None or self.html_path is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "update": self.update,
            "devices": list(self.devices),
            "rtol": self.tolerance.rtol,
            "atol": self.tolerance.atol,
            "unused": self.unused,
            "measure": self.measure,
            "measure_rtol": self.measure_rtol,
            "gpu_profile": self.gpu.name,
            **({} if self.gpu.builtin else {"gpu_properties": self.gpu.spec}),
            "cpu_profile": self.cpu,
            "fail_on_improvement": self.fail_on_improvement,
            "stale": self.stale,
            "keep_output": self.keep_output,
            "compile": self.compile,
            "per_torch": self.per_torch,
            "leaks": self.leaks,
        }

    def gpu_table(self) -> dict[str, GpuProfile]:
        """The GPU profiles of the ini table, by name."""
        return {profile.name: profile for profile in self.gpus}


def known_devices() -> tuple[str, ...]:
    """The modelled devices (importing the device models imports torch)."""
    from pytest_torchmem.engine.tracing.devices import DEVICES

    return tuple(DEVICES)


def _gpu_table(config: pytest.Config) -> dict[str, GpuProfile]:
    """The GPU profiles of the ``torchmem_gpus`` ini option, by name (one per line,
    ``NAME: memory=16GiB cc=8.9 sms=66``)."""
    try:
        lines = config.getini("torchmem_gpus")
    except (ValueError, pytest.UsageError) as exc:
        raise pytest.UsageError(
            f"ini option torchmem_gpus: {exc}; write one profile per line, "
            "NAME: memory=16GiB cc=8.9 sms=66"
        ) from None
    try:
        return parse_gpu_table(lines if isinstance(lines, list) else str(lines).splitlines())
    except GpuProfileError as exc:
        raise MarkerError(f"ini option torchmem_gpus: {exc}") from None


def gpu_present() -> bool:
    """Whether a GPU is here (imports torch)."""
    import torch

    return torch.cuda.is_available()


def _ini_dir(config: pytest.Config) -> Path:
    return config.inipath.parent if config.inipath is not None else config.rootpath

