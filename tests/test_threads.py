"""The engine's threads and the forks that follow them (``engine/parallel/threads.py``, ``engine/parallel/real_ranks.py``).

A thread's ``join()`` returns before the operating system's thread has run its
native destructors; MKL frees the thread's buffers there under a spin lock of its
own (``mm_account_ptr_by_tid``), and a process forked while any thread holds it
spins forever in its first GEMM. CI met it as a ``measure(parallel=...)`` rank
that never answered after a pipeline's estimate (tests/test_every_rank.py, stop
46); a raw fork after the wait still hung once in a README run (another thread
of the worker held the lock), so a forked rank proves it can multiply matrices
before it joins the group, and the ranks are forked again where one cannot.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from test_pipeline import BATCH, MICRO_BATCHES, WIDTH, Layers, _schedules, _sgd, follows_pipelining, split

import pytest_torchmem as tm
from pytest_torchmem.engine.parallel import real_ranks as distributed, threads

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks and /proc/self/task: Linux")
gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)


@linux_only
def test_the_wait_returns_once_the_thread_is_gone() -> None:
    ids: list[int] = []
    threads.start(lambda: ids.append(threading.get_native_id())).join()
    threads.wait_until_gone()
    assert not os.path.exists(f"/proc/self/task/{ids[0]}")
    threads.before_fork()  # nothing left to wait for; MKL's buffers given back
    assert torch.mm(torch.ones(64, 64), torch.ones(64, 64))[0, 0].item() == 64.0  # MKL works on


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_error_in_the_thread_still_ends_it() -> None:
    def fails() -> None:
        raise ValueError("the thread's own error")

    thread = threads.start(fails)
    thread.join()
    assert not thread.is_alive()
    threads.wait_until_gone()


def _rank(mesh: object) -> str:
    return str(torch.distributed.get_rank())


@linux_only
@gloo
def test_ranks_that_do_not_get_ready_are_forked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first fork's ranks hang where MKL's lock would hold them (in their first
    GEMM, before the group); they are killed and forked again, and the run's result
    is the second fork's."""
    forks: list[int] = []
    real_before_fork = threads.before_fork

    def counted() -> None:
        forks.append(1)
        real_before_fork()

    def stuck_on_the_first_fork() -> None:
        if len(forks) == 1:  # (the child's copy of the parent's count at its fork)
            threading.Event().wait()

    monkeypatch.setattr(threads, "before_fork", counted)
    monkeypatch.setattr(distributed, "_probe_blas", stuck_on_the_first_fork)
    monkeypatch.setattr(distributed, "READY_TIMEOUT", 10)
    parallel = tm.Parallel({"dp": 2}, lambda model, mesh: model)
    assert distributed.run_ranks(parallel, _rank) == ["0", "1"]
    assert len(forks) >= 2  # (a third where the machine was too busy to start the second in time)


@linux_only
@gloo
def test_ranks_that_never_get_ready_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fork stalls: the ranks start fresh (spawn), and a body that does not
    pickle is refused with the reason."""
    monkeypatch.setattr(distributed, "_probe_blas", lambda: threading.Event().wait())
    monkeypatch.setattr(distributed, "READY_TIMEOUT", 1)  # (they never get ready: no wait is long enough)
    monkeypatch.setattr(distributed, "FORK_ATTEMPTS", 1)
    parallel = tm.Parallel({"dp": 2}, lambda model, mesh: model)
    with pytest.raises(RuntimeError, match=r"did not start in 1 tries .*do not pickle"):
        distributed.run_ranks(parallel, lambda mesh: "unpicklable")


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
