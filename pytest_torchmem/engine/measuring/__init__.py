"""Real runs: the memory one step really takes, on the CPU, on a GPU or on each rank.

:mod:`.runs` runs and reads the step (``measure``); :mod:`.cpu_profiler` runs the
PyTorch profiler as a CPU measurement needs it, and :mod:`.profiler_events` reads its
allocator events into a timeline.
"""

from typing import Any

from pytest_torchmem.engine import moved_attribute

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    """The names of ``engine/measuring.py`` (release 0.1.0), now :mod:`.runs`'s, until the next release."""
    return moved_attribute(__name__, "runs", name)
