"""A trace that stopped: :class:`TraceStopped`, the error an estimate raises, carrying its partial report.

A figure is a whole trace. Where the trace cannot go on (an op fake tensors
cannot run and no rule models, a value the trace does not know that changed the
program's path), the figures of the step so far are no estimate of the step:
``estimate`` raises :class:`TraceStopped` instead, with the report of what ran
before the stop for those who want it. An approximation (an op listed in
``unsupported``, the trace went on) is a figure, and is returned.

This module does not import torch: the plugin catches the error without it.
"""

from __future__ import annotations

from typing import Any, Final

from pytest_torchmem.engine.figures.report import MemoryReport, Unsupported

__all__ = ["STOPPED_HERE", "TraceStopped"]

#: How the reason of the entry that stopped a trace ends, in its report's ``unsupported``.
STOPPED_HERE: Final = "; the trace stopped here"


class TraceStopped(RuntimeError):
    """The trace of the step stopped before its end: there is no estimate.

    ``entry``: what stopped it (``op``, ``reason``, ``location``: the line of
    your code that was running, ``file:line``); ``advice``: what to do;
    ``report``: the partial report of the step up to the stop (its figures are
    of the part that ran, not of the step), whose ``unsupported`` ends with
    ``entry``. The message is one line: where, what, and what to do.
    """

    def __init__(self, report: MemoryReport, entry: Unsupported, advice: str, *, trace: Any = None) -> None:
        super().__init__(report, entry, advice)
        self.report: Final = report
        self.entry: Final = entry
        self.advice: Final = advice
        #: The engine's trace of the partial step (its timeline), for the plugin's reports.
        self.trace: Final = trace

    def __reduce__(self) -> Any:
        # (a report's mappings are read-only proxies, which do not pickle: its JSON form does)
        return (_rebuilt, (type(self), self.report.to_dict(), self.entry, self.advice))

    def __str__(self) -> str:
        at = f" at {self.entry.location}" if self.entry.location else ""
        reason = self.entry.reason.removesuffix(STOPPED_HERE)
        return f"the trace stopped{at} in {self.entry.op}: {reason}; {self.advice}"


def _rebuilt(cls: type[TraceStopped], report: dict[str, Any], entry: Unsupported, advice: str) -> TraceStopped:
    """A pickled :class:`TraceStopped` again (without its trace)."""
    return cls(MemoryReport.from_dict(report), entry, advice)
