"""Leak checks of the fixture's checks: ``memory_budget(leak=...)`` and ``--torchmem-leaks``.

A check whose test's marker says ``leak=`` (the growth allowed per iteration), or any
check of a run with ``--torchmem-leaks`` (0 B allowed where the marker says nothing),
also runs its step as a loop runs it (:func:`pytest_torchmem.leaks`) on each of its
devices. Each becomes a :class:`LeakRecord`: shown in the run's summary, the JSON and
HTML reports, and, where it grows by more than allowed, the test's failure, with what
holds the growth and the fix. A leak is not a figure a snapshot accepts: as a
``fits=`` GPU, ``--torchmem-update`` does not lift it. On cuda, segments that grow
while the memory held does not (fragmentation) are a warning of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_torchmem.engine.figures.units import format_bytes

__all__ = ["LeakRecord", "leak_lines"]


@dataclass(frozen=True)
class LeakRecord:
    """One check's leak check on one device."""

    nodeid: str
    name: str
    device: str
    #: What is held after each iteration, and before the first.
    held: tuple[int, ...]
    baseline: int
    per_iteration: int
    steady_from: int | None
    #: The growth allowed per iteration (``memory_budget(leak=...)``; 0 under ``--torchmem-leaks``).
    allowed: int
    #: What holds the growth (:class:`~pytest_torchmem.LeakSource` as dicts), largest first.
    sources: tuple[Mapping[str, Any], ...] = ()
    reserved: tuple[int, ...] = ()
    reserved_per_iteration: int | None = None
    #: The growth per iteration measured on this machine's GPU, where one ran it.
    measured_per_iteration: int | None = None

    @classmethod
    def of(cls, nodeid: str, name: str, report: Any, allowed: int, measured: Any = None) -> LeakRecord:
        """The record of a :class:`~pytest_torchmem.LeakReport` (``measured``: the GPU's)."""
        return cls(
            nodeid=nodeid,
            name=name,
            device=report.device,
            held=report.held,
            baseline=report.baseline,
            per_iteration=report.per_iteration,
            steady_from=report.steady_from,
            allowed=allowed,
            sources=tuple(vars(source) if not isinstance(source, Mapping) else source for source in report.sources),
            reserved=report.reserved,
            reserved_per_iteration=report.reserved_per_iteration,
            measured_per_iteration=None if measured is None else measured.per_iteration,
        )

    @property
    def grows(self) -> int:
        """The growth per iteration the verdict reads: the larger of the estimate's and,
        where a GPU ran it, the measured one."""
        return max(self.per_iteration, self.measured_per_iteration or 0)

    @property
    def leaks(self) -> bool:
        """It grows by more than allowed: the test fails."""
        return self.grows > self.allowed

    @property
    def fragmentation(self) -> bool:
        """On cuda: the segments grow while what is held does not."""
        return bool(self.reserved_per_iteration) and self.per_iteration <= 0

    def line(self) -> str:
        """``test[default, cpu]: 8.50 KiB per iteration (allowed 0 B): leaks``."""
        figure = f"{format_bytes(self.per_iteration)} per iteration"
        if self.measured_per_iteration is not None:
            figure += f" (measured on the GPU: {format_bytes(self.measured_per_iteration)})"
        if self.steady_from is None:
            figure += f" (no steady state in {len(self.held)} iterations)"
        verdict = "leaks" if self.leaks else "no leak" if self.grows <= 0 else "within the allowance"
        line = f"{self.nodeid}[{self.name}, {self.device}]: {figure}, allowed {format_bytes(self.allowed)}: {verdict}"
        if self.fragmentation:
            line += f"; reserved grows {format_bytes(self.reserved_per_iteration or 0)} per iteration (fragmentation)"
        return line

    def failure(self) -> str:
        """The test's failure message: what grows, by how much, what holds it, and the fix."""
        held = ", ".join(format_bytes(nbytes) for nbytes in self.held)
        steady = (
            f"steady from iteration {self.steady_from}"
            if self.steady_from is not None
            else "still changing at the last"
        )
        lines = [
            f"torchmem: {self.nodeid} [{self.name}] leaks on {self.device}: "
            f"{format_bytes(self.grows)} more is held after every iteration, "
            f"{format_bytes(self.allowed)} allowed (memory_budget(leak=...))",
            f"  held after iterations 1-{len(self.held)}: {held} ({steady}; "
            f"{format_bytes(self.baseline)} before the first)",
        ]
        if self.measured_per_iteration is not None:
            lines.append(f"  measured on this machine's GPU: {format_bytes(self.measured_per_iteration)} per iteration")
        fixes: list[str] = []
        for source in self.sources:
            holder = source.get("held_by") or "nothing the step reaches (torch, a library)"
            where = f" made at {source['made_at']}" if source.get("made_at") else ""
            op = f" by {source['op']}" if source.get("op") else ""
            lines.append(
                f"  {format_bytes(source['bytes'])} per iteration: {source['tensors']} tensor(s){where}{op}, "
                f"held by {holder}" + (f" ({source['how']})" if source.get("how") not in (None, "", "unknown") else "")
            )
            if source.get("fix") and source["fix"] not in fixes:
                fixes.append(source["fix"])
        lines += [f"  fix: {fix}" for fix in fixes]
        lines.append(
            "  a leak is not accepted by --torchmem-update; allow growth with "
            "@pytest.mark.memory_budget(leak=...) only where it is meant to grow"
        )
        return "\n".join(lines)

    def warning(self) -> str:
        """The fragmentation warning."""
        reserved = ", ".join(format_bytes(nbytes) for nbytes in self.reserved)
        return (
            f"torchmem: {self.nodeid} [{self.name}] on cuda: the caching allocator's segments grow "
            f"{format_bytes(self.reserved_per_iteration or 0)} per iteration ({reserved}) while what is "
            "held after each does not: fragmentation (blocks it keeps are too small for what each "
            "iteration asks: pad batches to a few fixed sizes, or set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "nodeid": self.nodeid,
            "name": self.name,
            "device": self.device,
            "held": list(self.held),
            "baseline": self.baseline,
            "per_iteration": self.per_iteration,
            "steady_from": self.steady_from,
            "allowed": self.allowed,
            "sources": [dict(source) for source in self.sources],
            "reserved": list(self.reserved),
            "reserved_per_iteration": self.reserved_per_iteration,
            "measured_per_iteration": self.measured_per_iteration,
            "leaks": self.leaks,
            "fragmentation": self.fragmentation,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LeakRecord:
        fields = {key: data[key] for key in cls.__dataclass_fields__ if key in data}
        fields["held"] = tuple(fields["held"])
        fields["reserved"] = tuple(fields.get("reserved", ()))
        fields["sources"] = tuple(fields.get("sources", ()))
        return cls(**fields)


def leak_lines(records: Iterable[LeakRecord]) -> list[str]:
    """The summary's lines of the run's leak checks."""
    return [f"leak: {record.line()}" for record in sorted(records, key=lambda r: (r.nodeid, r.name, r.device))]
