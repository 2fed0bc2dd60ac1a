"""The engine's threads and the forks that follow them (``pytest_torchmem/engine/threads.py``).

A thread's ``join()`` returns before the operating system's thread has run its
native destructors; MKL frees the thread's buffers there under a lock, and a
process forked in that moment waits forever in its first GEMM. CI met it as a
``measure(parallel=...)`` rank that never answered after a pipeline's estimate
(tests/test_every_rank.py, stop 46).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from test_pipeline import BATCH, MICRO_BATCHES, WIDTH, Layers, _schedules, _sgd, follows_pipelining, split

import pytest_torchmem as tm
from pytest_torchmem.engine import threads

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks and /proc/self/task: Linux")

#: Seconds a forked child's one GEMM may take before it counts as hung (it takes milliseconds).
CHILD_TIMEOUT = 120.0
FORKS = 20


def _gemm() -> None:
    a = torch.randn(64, 64)
    (a @ a).sum()


def _forked_gemm_finishes() -> bool:
    """Fork; the child runs one GEMM and leaves. Whether it left within the timeout.

    The child runs on one thread, as a rank of ``measure(parallel=...)`` does (distributed.py:
    GNU OpenMP's pool of the parent is not the child's)."""
    pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)
            _gemm()
        finally:
            os._exit(0)
    deadline = time.monotonic() + CHILD_TIMEOUT
    delay = 0.001
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return False


@linux_only
def test_a_fork_right_after_an_engine_thread_ran_gemms_does_not_hang() -> None:
    # Without the wait, 46 of 100 such forks hung on the 2.13 CPU wheel (2 cores).
    _gemm()  # the calling thread's MKL is set up before any fork, as in a trace
    for _ in range(FORKS):
        threads.start(_gemm, name="torchmem-test-gemm").join()
        threads.wait_until_gone()
        assert _forked_gemm_finishes()


@linux_only
def test_the_wait_returns_once_the_thread_is_gone() -> None:
    ids: list[int] = []
    import threading

    threads.start(lambda: ids.append(threading.get_native_id())).join()
    threads.wait_until_gone()
    assert not os.path.exists(f"/proc/self/task/{ids[0]}")
    started = time.monotonic()
    threads.wait_until_gone()  # nothing left to wait for: at once
    assert time.monotonic() - started < 1.0


def test_an_error_in_the_thread_still_ends_it(capsys: pytest.CaptureFixture[str]) -> None:
    def fails() -> None:
        raise ValueError("the thread's own error")

    thread = threads.start(fails)
    thread.join()
    assert not thread.is_alive()
    threads.wait_until_gone()


@follows_pipelining
def test_a_pipelines_threads_are_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    names: list[str | None] = []
    real = threads.start

    def counted(target, *args, name=None):  # type: ignore[no-untyped-def]
        names.append(name)
        return real(target, *args, name=name)

    monkeypatch.setattr(threads, "start", counted)
    parallel = tm.Parallel(mesh={"pp": 2}, apply=split, rank=1, schedule=_schedules()["1F1B"], microbatches=MICRO_BATCHES)
    tm.estimate(Layers(), (torch.randn(BATCH, WIDTH),), optimizer=_sgd, parallel=parallel)
    assert {"torchmem-pipeline-rank-0", "torchmem-pipeline-rank-1"} <= set(names)
