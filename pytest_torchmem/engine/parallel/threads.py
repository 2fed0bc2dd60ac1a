"""The engine's own threads, and a fork that waits until those that ended are gone.

A thread's ``join()`` returns once its Python state is released; the thread
of the operating system still runs its native thread-local destructors after
that. MKL's memory manager frees the thread's buffers there, under a lock of
its own (its per-thread accounting, ``mm_account_ptr_by_tid``). A process
forked in that moment has the lock held and nobody to release it: its first
GEMM waits forever. The engine's threads run real GEMMs (the values a trace
computes on small tensors, ``tracing/values.py``), and ``measure(parallel=...)``
forks its ranks right after an estimate has ended its pipeline's threads: in
a loop that forked right after such a thread's join, 46 of 100 children hung
(torch 2.13's CPU wheel, 2 cores); none once the fork waited.

Every thread the engine starts goes through :func:`start`, which records its
id in the operating system; :func:`before_fork` waits until each of them that
has ended is gone from ``/proc/self/task``, then has MKL give back its cached
buffers (``mkl_serv_free_buffers``, which takes the same locks: it waits for a
thread of anyone's that holds one). Another thread can still take such a lock
in the moment before the fork; ``measure(parallel=...)`` therefore has each
forked rank multiply two matrices before it joins the group, and forks the
ranks again where one never gets that far (``real_ranks.py``).

A forked child shares its parent's memory until it writes to a page. Python's
collector writes to every object it scans: a child's first full collection
copies every page of the parent's objects (660 MB of a 1.6 GB parent, each of
four ranks). :func:`forking` moves the parent's objects out of the collector's
reach (``gc.freeze``) while the children are forked, so a child's collections
scan only its own objects and the parent's pages stay shared.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

__all__ = ["before_fork", "forking", "start", "wait_until_gone"]

#: Seconds :func:`wait_until_gone` waits for an ended thread to leave.
GONE_TIMEOUT: Final = 10.0

_lock = threading.Lock()
_ended: set[int] = set()  # native ids of the engine's threads whose run() has returned


def start(target: Callable[..., Any], *args: Any, name: str | None = None) -> threading.Thread:
    """Start a daemon thread running ``target(*args)``; its native id is kept until
    :func:`wait_until_gone` has seen it leave."""

    def run() -> None:
        native = threading.get_native_id()
        try:
            target(*args)
        finally:
            with _lock:
                _ended.add(native)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def wait_until_gone(timeout: float = GONE_TIMEOUT) -> None:
    """Return once every engine thread that has ended has left the process (its
    ``/proc/self/task`` entry is gone), or after ``timeout`` seconds. Where the
    system has no ``/proc`` nothing is waited for."""
    if not os.path.isdir("/proc/self/task"):
        with _lock:
            _ended.clear()
        return
    deadline = time.monotonic() + timeout
    delay = 0.0001
    while True:
        with _lock:
            _ended.difference_update([tid for tid in _ended if not os.path.exists(f"/proc/self/task/{tid}")])
            if not _ended:
                return
            if time.monotonic() >= deadline:
                # a native id taken again by a live thread of someone else's: not ours to wait for
                _ended.clear()
                return
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def before_fork() -> None:
    """Make this process as safe to fork as it can be made: the engine's ended
    threads gone (:func:`wait_until_gone`), MKL's cached buffers given back."""
    wait_until_gone()
    free = _mkl_free_buffers()
    if free is not None:
        free()


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Fork children in the block: :func:`before_fork` first, and this process's objects
    frozen out of the collector's reach (``gc.freeze``) until the block ends, so that the
    children's collections leave the pages they share with this process unwritten. A
    process that froze its objects itself keeps them frozen as they were."""
    before_fork()
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@functools.cache
def _mkl_free_buffers() -> Any:
    """MKL's ``mkl_serv_free_buffers`` as torch's CPU library exports it (x86 builds
    link MKL statically), or None where it has none."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(path).mkl_serv_free_buffers
    except (OSError, AttributeError):
        return None
