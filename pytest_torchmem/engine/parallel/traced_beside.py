"""A pipeline traced in a process forked beside this one, on a core of its own.

``every_rank``'s search (:mod:`~pytest_torchmem.engine.every_rank`) traces rank 0's
pipeline and the far corner's: two traces that do not depend on each other, each of them
most of the search's time (a minute and a half apiece for the 405B shape of
``benchmarks/ranks.py``). A trace runs on one core (a pipeline's threads take turns:
``tracing/pipeline_group.py``). Where this process may run on a second core, the
corner's pipeline is traced in a child forked for it while this process traces rank 0's.

The child is this process as it forked: nothing travels pickled on the way there (the
model, the inputs, a closure ``apply`` reach it as they are); its figures come back
pickled. Before it traces it readies itself as ``measure(parallel=...)``'s forked ranks
do (:func:`~pytest_torchmem.engine.parallel.real_ranks.forked_child`): its kernels on one
thread, one matrix product and one backward. Where it is not ready within
:data:`READY_TIMEOUT`, cannot run backward in a forked process, fails in any way, dies,
or takes more than :data:`SLOWER` times this process's own trace and
:data:`GRACE` seconds more, it is let go and the pipeline is traced here, after rank 0's,
as without it: the figures are the same either way, only later.

``TORCHMEM_BESIDE=0`` turns it off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

from pytest_torchmem.engine.parallel import threads
from pytest_torchmem.engine.parallel.real_ranks import READY, forked_child

__all__ = ["ENV", "Beside", "beside_enabled"]

T = TypeVar("T")

#: The environment variable that turns tracing beside off (``0``).
ENV: Final = "TORCHMEM_BESIDE"
#: Seconds the child may take to get ready (one matrix product and one backward).
READY_TIMEOUT: Final = 60.0
#: How many times this process's own trace the child may take, ...
SLOWER: Final = 3.0
#: ... and how many seconds more, before it is let go.
GRACE: Final = 60.0


def beside_enabled() -> bool:
    """Whether a trace may run in a forked child: the system forks, this process may run
    on two cores or more, and ``TORCHMEM_BESIDE`` is not ``0``."""
    import multiprocessing

    if os.environ.get(ENV, "1").strip() == "0" or "fork" not in multiprocessing.get_all_start_methods():
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2


class Beside(Generic[T]):
    """``work()`` running in a child forked now; :meth:`result` waits for what it returned.
    A context manager: the child is let go when the block ends."""

    def __init__(self, work: Callable[[], T]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=forked_child, args=(send, work), daemon=True)
        with threads.forking():
            self._process.start()
        send.close()
        self._started = time.monotonic()

    def __enter__(self) -> Beside[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.let_go()  # (a child not asked for its result, its caller's trace failed: killed)

    def result(self) -> T | None:
        """What ``work()`` returned in the child, or None where it did not (the caller
        then does the work itself). Called once this process's own trace has ended: its
        time sets how long the child may still take."""
        own = time.monotonic() - self._started
        try:
            if not self._receive.poll(READY_TIMEOUT) or _message(self._receive)[0] != READY:
                return None
            if not self._receive.poll(SLOWER * own + GRACE):
                return None
            kind, payload = _message(self._receive)
            return payload if kind == "ok" else None
        finally:
            self.let_go()

    def let_go(self) -> None:
        """Leave the child: given a few seconds to end where it is ending, else killed."""
        if self._receive.closed:
            return
        self._receive.close()
        self._process.join(5 if self._process.exitcode is None else 0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _message(receive: Any) -> tuple[str, Any]:
    try:
        return receive.recv()  # type: ignore[no-any-return]
    except (EOFError, OSError):  # it ended with no message (killed, out of memory)
        return ("ended", None)
