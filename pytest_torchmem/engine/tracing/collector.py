"""Python's garbage collector while a step is traced: the objects that lived before the
trace are kept out of its passes.

A trace makes hundreds of thousands of short-lived objects (fake tensors and their
metadata, dynamo's and inductor's graphs, the journal's records of the user's
objects), and their count starts the collector's full passes, each of which walks
every object of the process: torch's, transformers', the test session's (400,000 to
600,000 objects, a tenth to a third of a second a pass on a Llama-3-8B-shaped step
here, a sixth of its eager estimate). Frozen (``gc.freeze``), the objects that were
there before the trace are left out of every pass until it ends, and what the trace
makes is collected as before: a cycle of the trace's own objects (a fake tensor's,
an autograd graph's) is freed when it was, at the pass that finds it. A search of
every object (a leak's holders: ``gc.get_objects``, ``gc.get_referrers``, which do
not see frozen objects) lifts the freeze for its length (:func:`every_object_in_sight`).

What the step's own code could see of it: ``gc.get_freeze_count()`` is not 0, and
``gc.get_objects()`` and ``gc.get_referrers()`` leave the older objects out, as does a
``gc.collect()`` in the step (it collects the trace's objects, and no cycle that was
garbage before the call). None of them is what the figures follow: the step runs on
stand-ins the trace made, and the user's own objects are put back after it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["every_object_in_sight", "older_objects_frozen"]

#: Whether the objects frozen now were frozen by :func:`older_objects_frozen`.
_frozen_by_a_trace = False


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """The objects alive when the block begins frozen out of the collector's passes
    until it ends. Where objects are frozen already (by the user's process, or by an
    enclosing trace), the block leaves them as they are and freezes nothing."""
    global _frozen_by_a_trace
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _frozen_by_a_trace = True
    try:
        yield
    finally:
        _frozen_by_a_trace = False
        gc.unfreeze()


@contextlib.contextmanager
def every_object_in_sight() -> Iterator[None]:
    """Lift a trace's freeze in the block, for a search of every object of the process;
    after it, every object then alive is frozen to the end of the trace. Objects frozen
    by the user's process stay as they are (and out of sight, as without a trace)."""
    if not _frozen_by_a_trace:
        yield
        return
    gc.unfreeze()
    try:
        yield
    finally:
        gc.freeze()
