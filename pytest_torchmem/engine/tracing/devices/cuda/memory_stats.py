"""``torch.cuda``'s memory statistics as the program reads them in a fake cuda trace.

Training loops log ``torch.cuda.max_memory_allocated()``, reset the peak between
phases, and size their batches or their ``device_map`` from
``torch.cuda.mem_get_info()``. On the fake cuda device the program reads the
trace's own figures at the moment it asks, as the caching allocator of the
profile's GPU would report them: :class:`MemorySoFar` replays the step's
storages so far through the caching allocator's simulator (the one the
report's figures come from), honouring the program's own
``reset_peak_memory_stats()`` calls where they were made.

* ``memory_allocated()`` / ``memory_reserved()``: the live blocks and segments now;
* ``max_memory_allocated()`` / ``max_memory_reserved()``: their peaks since the
  step began, or since the program last reset them;
* ``memory_stats()``: those, and ``active_bytes`` and ``requested_bytes``, as
  ``"<stat>.all.current"`` and ``"<stat>.all.peak"``, with ``num_alloc_retries``,
  ``num_ooms``, ``num_device_alloc`` and ``num_device_free``;
* ``mem_get_info()``: ``(free, total)``, ``total`` the profile's memory and
  ``free`` what a step may take of it (less the CUDA context) less what is
  reserved now.

Not modelled: ``empty_cache()`` releasing the cached segments (the reserved
figures are those of a run that does not call it), and the allocation counts
(``allocation.*``, ``segment.*``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile, usable_memory
from pytest_torchmem.engine.figures.timeline import Timeline, replay

__all__ = ["MemorySoFar"]


class MemorySoFar:
    """The caching allocator's statistics of a trace under way (see the module).

    ``baseline()``: the storages alive when the step began (it may change once, when
    ``parallel=``'s ``apply`` has run); ``allocator()``: a fresh allocator simulator."""

    def __init__(
        self, timeline: Timeline, baseline: Callable[[], list[int]], allocator: Callable[[], Any], profile: GpuProfile
    ) -> None:
        self._timeline = timeline
        self._baseline = baseline
        self._allocator = allocator
        self._profile = profile
        #: Where the program reset the peaks: the number of events there were then.
        self._resets: list[int] = []

    def now(self) -> Any:
        """The allocator simulator after the step's events so far."""
        allocator = self._allocator()
        resets = iter(self._resets)
        at = next(resets, None)
        for charge in replay(self._timeline, self._baseline(), allocator):
            while at is not None and charge.index >= at:
                allocator.reset_peaks()
                at = next(resets, None)
        while at is not None:
            allocator.reset_peaks()
            at = next(resets, None)
        return allocator

    def reset_peaks(self, device: Any = None) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: the peaks start again from here."""
        self._resets.append(len(self._timeline.events))

    def memory_allocated(self, device: Any = None) -> int:
        return int(self.now().allocated)

    def max_memory_allocated(self, device: Any = None) -> int:
        return int(self.now().peak_allocated)

    def memory_reserved(self, device: Any = None) -> int:
        return int(self.now().reserved)

    def max_memory_reserved(self, device: Any = None) -> int:
        return int(self.now().peak_reserved)

    def memory_stats(self, device: Any = None) -> OrderedDict[str, int]:
        allocator = self.now()
        stats: dict[str, int] = {}
        for name, current, peak in (
            ("active_bytes", allocator.active, allocator.peak_active),
            ("allocated_bytes", allocator.allocated, allocator.peak_allocated),
            ("requested_bytes", allocator.requested, allocator.peak_requested),
            ("reserved_bytes", allocator.reserved, allocator.peak_reserved),
        ):
            stats[f"{name}.all.current"] = int(current)
            stats[f"{name}.all.peak"] = int(peak)
        stats["num_alloc_retries"] = int(allocator.num_alloc_retries)
        stats["num_ooms"] = int(allocator.num_ooms)
        stats["num_device_alloc"] = int(allocator.num_device_alloc)
        stats["num_device_free"] = int(allocator.num_device_free)
        return OrderedDict(sorted(stats.items()))

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return max(usable_memory(self._profile) - int(self.now().reserved), 0), int(self._profile.memory)
