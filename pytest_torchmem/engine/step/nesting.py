"""One step at a time on a thread: an estimate or a measurement started inside the step of another is refused.

The step ``estimate`` traces runs on stand-ins, inside the trace's dispatch modes
and replaced torch attributes; the step ``measure`` runs inside the profiler or
with the GPU's peak statistics reset. A second estimate or measurement started
from inside that step (a step function that calls ``tm.measure``) would run its own
step on the first one's stand-ins and under its modes, and the first one's figures
would count the second's: neither would be the step's. It is refused at once, in
one line (:class:`NestedStepError`), and reaches the caller as the step's own
error, never as a stopped trace. Steps run one after another (``fit``'s
estimates, a check's devices) as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["NestedStepError", "one_step"]

_running = threading.local()  # .entry: the entry point whose step runs on this thread


class NestedStepError(RuntimeError):
    """``estimate`` or ``measure`` was called inside the step another one is running."""


@contextmanager
def one_step(entry: str) -> Iterator[None]:
    """The block runs the step of ``entry`` (``"tm.estimate()"``, ``"tm.measure()"``);
    :class:`NestedStepError` where a step already runs on this thread."""
    outer = getattr(_running, "entry", None)
    if outer is not None:
        raise NestedStepError(
            f"{entry} was called inside the step that {outer} is running; one step is "
            f"estimated or measured at a time: call {entry} before or after {outer}, not "
            "from inside its step"
        )
    _running.entry = entry
    try:
        yield
    finally:
        _running.entry = None
