"""The PyTorch profiler as ``measure(device="cpu")`` runs it: allocator events, no chatter.

Started and stopped as torch runs it, the profiler writes lines of its own to
the process's standard error, which a measurement must not add to a test
run's output (issue 27, item 10):

- ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start`` and
  ``... profiler_stop``: kineto's trace markers, written by its logger at
  ``LoggerOutputType::USDT``, the highest severity it has, so that the
  ``ERROR`` threshold torch sets (``suppressLibkinetoLogMessages``) lets them
  through, on every build (torch 2.12 writes them from
  ``ActivityProfilerController.cpp``);
- ``ERROR:... DeviceProperties.cpp:50] gpuGetDeviceCount failed with code 35``:
  on a CUDA build of torch without a GPU, kineto asks the CUDA runtime for
  the devices' properties once per process, when the first trace stops;
- ``[W... CPUAllocator.cpp:245] Memory block of unknown size was allocated
  before the profiling started ...``: c10's ``LOG(WARNING)`` (once in 1000),
  when memory allocated before the profiler started is freed while it runs;
- ``UserWarning: Warning: Profiler clears events at the end of each cycle``
  (torch 2.10 to 2.12): ``torch.profiler.profile`` warns at every start.

No switch scopes these to one measurement: kineto reads ``KINETO_LOG_LEVEL``
once, at its first start in the process, and c10 reads ``TORCH_CPP_LOG_LEVEL``
once, when torch is imported; either, set, would stay set for the rest of the
process, and would hide the user's own messages of those kinds from then on.
So, for each: the profiler's backend, ``torch.autograd.profiler.profile``, is
used directly (the front end's warning is its own); the measurement copies
the model's tensors and the inputs with the profiler running and lets the
copies go after it stopped, so the allocator knows the size of every block
of the measurement's that the step frees (the warning was about those
copies; it still comes where the user's code frees, inside the step, memory
it allocated before the measurement began); and the two calls that write
kineto's lines, start and stop, run with file descriptor 2 sent to a
temporary file, whose lines are written back to it afterwards, less those
above. The step itself runs with standard error as it was: whatever the
user's code writes there is neither held back nor lost.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import torch

__all__ = ["NOISE", "allocator_events", "stderr_without"]

#: The lines the profiler writes when it starts and stops (see the module's docstring).
NOISE: Final = re.compile(
    rb"^(?:USDT:.*\] profiler_(?:start|stop)"
    rb"|.*\] gpuGetDeviceCount failed with code \d+"
    rb"|\[W.*CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the "
    rb"profiling started.*"
    rb")\r?$"
)


@contextmanager
def allocator_events() -> Iterator[Any]:
    """Profile the block, memory included; yields the profiler (``kineto_results`` after
    the block). Started and stopped with the lines of :data:`NOISE` left out of
    standard error."""
    prof = torch.autograd.profiler.profile(use_kineto=True, use_cpu=True, profile_memory=True)
    with stderr_without(NOISE):
        prof.__enter__()
    try:
        yield prof
    finally:
        with stderr_without(NOISE):
            prof.__exit__(None, None, None)


@contextmanager
def stderr_without(noise: re.Pattern[bytes]) -> Iterator[None]:
    """Run the block with file descriptor 2 written to a temporary file; then write its
    lines back to descriptor 2, less those that ``noise`` matches. Where descriptor 2
    cannot be duplicated (closed), the block runs as it is."""
    _flush_stderr()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                _flush_stderr()
                os.dup2(saved, 2)
                held.seek(0)
                kept = [line for line in held.read().splitlines(keepends=True) if not noise.match(line)]
                _write_all(2, b"".join(kept))
    finally:
        os.close(saved)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _flush_stderr() -> None:
    """Write out what Python holds for standard error (it goes to descriptor 2 as it was
    when it was written)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed, or a stream of the user's that cannot
            pass
