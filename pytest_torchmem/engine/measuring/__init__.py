"""Real runs: the memory one step really takes, on the CPU, on a GPU or on each rank.

:mod:`.runs` runs and reads the step (``measure``); :mod:`.cpu_profiler` runs the
PyTorch profiler as a CPU measurement needs it, and :mod:`.profiler_events` reads its
allocator events into a timeline.
"""

__all__: list[str] = []
