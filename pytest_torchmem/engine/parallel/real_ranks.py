"""Real ranks on this machine: gloo processes that each run one function.

``measure(parallel=...)`` is the ground truth for the estimate of a rank, so
the ranks are real processes talking through gloo. They are forked from the
calling process: nothing is pickled (the model, the inputs and a closure
``apply`` reach every rank as they are) and no interpreter starts again, which
keeps a measurement's start cheap. Each rank leaves with ``os._exit``, so the
parent's pytest session, atexit hooks and buffers are never run twice.

A forked process cannot run ``backward()`` once its parent has started
autograd's device threads (``torch/csrc/autograd/engine.cpp``,
``Engine::start_device_threads`` registers a fork handler that marks every
child; its ``initialize_device_threads_pool`` then refuses each backward with
"Unable to handle autograd's threading in combination with fork-based
multiprocessing", in every release 2.10 to 2.15). They start at a process's
first backward when a device other than the CPU reports devices: a GPU, or, on
a CUDA build of torch with no GPU, the fake CUDA device guard that
``FakeTensorMode.__enter__`` installs (``torch._C._ensureCUDADeviceGuardSet``,
eight devices). :func:`settle_autograd_threads` runs the process's first
backward before any fake mode, so that on a machine without a GPU they never
start; where they have started all the same (a GPU, a backward after someone
else's fake mode), the ranks start as fresh interpreters (``spawn``) and the
step's arguments travel pickled.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Final, NoReturn

import torch

from pytest_torchmem.engine.parallel import threads
from pytest_torchmem.engine.parallel.mesh import Parallel
from pytest_torchmem.engine.torch_compat.torch_private import COLLECTIVES, COMPILED_COLLECTIVES, private

__all__ = [
    "MAX_REAL_RANKS",
    "FreedOnThisThread",
    "READY",
    "collectives_completed_here",
    "forked_child",
    "ready_after_fork",
    "run_ranks",
    "settle_autograd_threads",
]

# torch's private names (engine/torch_compat/torch_private.py)
TorchDispatchMode: Final = private("torch.utils._python_dispatch.TorchDispatchMode")
tree_leaves: Final = private("torch.utils._pytree.tree_leaves")

#: The most processes ``measure(parallel=...)`` starts on one machine.
MAX_REAL_RANKS: Final = 4
#: Seconds a rank may take before the run is given up.
TIMEOUT: Final = 600
#: Seconds a rank waits in a collective for the others (one that failed never comes).
COLLECTIVE_TIMEOUT: Final = 120
#: Seconds the ranks may take to form their mesh's groups (gloo gives up on a peer after
#: ``COLLECTIVE_TIMEOUT``); past it they are started again.
JOIN_TIMEOUT: Final = COLLECTIVE_TIMEOUT + 60
#: Seconds a forked rank may take to multiply two small matrices and run one backward
#: (milliseconds, on a busy machine seconds); past it the rank is stuck (see ``_rank_main``).
READY_TIMEOUT: Final = 60
#: How many times the ranks are forked before they are started fresh (``spawn``), and
#: started where their group did not form.
FORK_ATTEMPTS: Final = 3
#: Seconds :meth:`FreedOnThisThread.drain` and :func:`collectives_completed_here` wait
#: for gloo's threads to let go of a tensor.
DRAIN_TIMEOUT: Final = 10.0


#: The refusal a forked process meets in ``backward()`` once its parent started autograd's
#: device threads (``Engine::initialize_device_threads_pool``, engine.cpp).
_FORKED_AUTOGRAD: Final = "autograd's threading in combination with fork-based multiprocessing"
#: A forked child's first message once it is ready (:func:`forked_child`).
READY: Final = "ready"
#: A rank's message once every group of its mesh has formed (:func:`_rank_main`).
JOINED: Final = "joined"
#: The parent's marks of a rank that did not get ready, and of a rank that failed or
#: ended before its groups formed (never sent by a rank).
_STALLED: Final = "stalled"
_UNJOINED: Final = "unjoined"


def _probe_blas() -> None:
    """A rank's first GEMM (MKL's allocator), before it joins the group: where it never
    returns, the parent sees the rank not ready and forks the ranks again."""
    a = torch.ones(128, 128)
    torch.mm(a, a)


def _compile_on_this_thread() -> None:
    """Have inductor compile this forked child's kernels on the calling thread
    (``compile_threads = 1``, TORCHINDUCTOR_COMPILE_THREADS's setting; not part of the
    keys of inductor's caches). Inductor resets its process pools in a forked child but
    not its pool of threads (``AsyncCompile.pool``, 2.10-2.15): a parent that compiled a
    C++ kernel left the child an executor whose threads it does not have."""
    if "torch._inductor.config" in sys.modules:  # (else the child makes its own pool)
        sys.modules["torch._inductor.config"].compile_threads = 1


def ready_after_fork() -> str | None:
    """Ready a forked child to run a step: its kernels on one thread, its first matrix
    product and its first backward. Returns why it cannot run backward (its parent had
    started autograd's device threads), or None.

    A forked child cannot use the OpenMP thread pool of a parent that ran parallel
    regions (GNU OpenMP then waits forever for threads the child does not have). Nor
    inductor's pool of compile threads: the child inherits the parent's executor
    without its threads, and its first new C++ kernel waits forever
    (:func:`_compile_on_this_thread`). A child forked while another thread of the
    parent held a lock of MKL's never returns from its first matrix product: its
    parent, told nothing, lets it go.
    """
    torch.set_num_threads(1)
    _compile_on_this_thread()
    _probe_blas()
    try:
        one = torch.zeros((), requires_grad=True)
        with torch.enable_grad():
            (one * 1).backward()
    except RuntimeError as exc:
        if _FORKED_AUTOGRAD not in str(exc):
            raise
        return str(exc)
    return None


_settled = False


def settle_autograd_threads() -> None:
    """Run this process's first ``backward()`` now, on one CPU element, if none ran yet.

    Autograd starts its device threads once, at a process's first backward, for
    the devices that report a count then (``Engine::start_device_threads``,
    engine.cpp); from then on a forked child cannot run backward. On a
    machine without a GPU only the fake CUDA guard that ``FakeTensorMode``
    installs on a CUDA build reports devices: run before any fake mode (the
    estimate's, dynamo's), this first backward finds none, and the forked
    ranks of a later ``measure(parallel=...)`` run their backward. Where a GPU
    reports devices, the threads start here as they would at the first
    backward anyway.
    """
    global _settled
    if _settled:
        return
    _settled = True
    one = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        (one * 1).backward()


def run_ranks(parallel: Parallel, body: Callable[[Any], str]) -> list[str]:
    """Run ``body(mesh)`` on every rank of ``parallel`` as a gloo process; their results by rank.

    The ranks are forked; where this process's autograd can no longer fork
    (see the module's docstring) they are spawned, and ``body`` (with all it
    holds) must pickle. Ranks whose groups did not form (a rank killed as it
    joined, a connection of gloo's refused) are started again, all of them,
    up to :data:`FORK_ATTEMPTS` times: no step has run yet, nothing is measured
    twice.
    """
    import multiprocessing

    import torch.distributed as dist

    world = parallel.world
    if world > MAX_REAL_RANKS:
        raise ValueError(
            f"measure(parallel=...) runs each rank as a process on this machine, at most "
            f"{MAX_REAL_RANKS}; the mesh {parallel.key} has {world} ranks. Measure a smaller "
            "mesh, and use estimate(parallel=...) for this one"
        )
    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("measure(parallel=...) needs torch.distributed with gloo, which this torch lacks")
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods:
        for _ in range(FORK_ATTEMPTS):
            results, exitcodes = _started(multiprocessing.get_context("fork"), parallel, body, READY_TIMEOUT)
            if not _marked(results, _STALLED, _UNJOINED):
                break
        stalled = _marked(results, _STALLED)
        if not stalled and not _marked(results, "forked-autograd"):
            return _collected(results, exitcodes)
        why = (
            f"its forked ranks did not start in {FORK_ATTEMPTS} tries (a lock of MKL's held by "
            "another thread of this process as it forked)"
            if stalled
            else "this process has started autograd's device threads (a backward with a GPU "
            "present, or after a FakeTensorMode on a CUDA build of torch), and a forked process "
            "cannot run backward after that"
        )
    else:
        why = "this system cannot fork"
    try:
        import pickle

        pickle.dumps(body)
    except Exception as exc:
        raise RuntimeError(
            f"measure(parallel=...) starts its ranks as fresh processes here: {why}. The model, "
            "the inputs, loss_fn, optimizer and apply then travel pickled, and they do not "
            f"pickle: {type(exc).__name__}: {exc}. Define the functions at module level "
            "(functools.partial binds their options), or call measure(parallel=...) before any "
            "backward in this process"
        ) from exc
    # (a fresh interpreter imports torch before it is ready: the whole run's time)
    for _ in range(FORK_ATTEMPTS):
        results, exitcodes = _started(multiprocessing.get_context("spawn"), parallel, body, TIMEOUT)
        if not _marked(results, _UNJOINED):
            break
    return _collected(results, exitcodes)


def _marked(results: list[tuple[str, str] | None], *marks: str) -> bool:
    return any(result is not None and result[0] in marks for result in results)


def _started(
    context: Any, parallel: Parallel, body: Callable[[Any], str], ready_timeout: float
) -> tuple[list[tuple[str, str] | None], list[int | None]]:
    """Start the ranks in ``context`` and wait for them: each one's result and exit code
    (a rank not ready within ``ready_timeout`` seconds: ``"stalled"``; the first rank
    that failed or ended before its groups formed: ``"unjoined"``)."""
    world = parallel.world
    forked = context.get_start_method() == "fork"
    with tempfile.TemporaryDirectory(prefix="torchmem-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        pipes = []
        processes = []
        with threads.forking() if forked else contextlib.nullcontext():
            for rank in range(world):
                receive, send = context.Pipe(duplex=False)
                process = context.Process(
                    target=_rank_main, args=(parallel, rank, store, body, send), daemon=True
                )
                process.start()
                send.close()
                pipes.append(receive)
                processes.append(process)
        results: list[tuple[str, str] | None] = [None] * world
        try:
            # each rank first says it is ready (its probe ran) before it joins the group
            for rank, receive in enumerate(pipes):
                if not receive.poll(ready_timeout):
                    results[rank] = (_STALLED, f"rank {rank} did not start within {ready_timeout} s")
                    break
                results[rank] = _received(receive)
                if results[rank] is None or results[rank][0] != READY:  # type: ignore[index]
                    break  # (forked-autograd: every rank meets it before it joins the group)
            else:
                # then each rank says its groups formed (a rank that failed to join leaves
                # the others waiting for it: they are killed and started again)
                unjoined = _first_unjoined(pipes, processes)
                if unjoined is not None:
                    rank, why = unjoined
                    results[rank] = (_UNJOINED, why)
                else:
                    results = [_received(receive) if receive.poll(TIMEOUT) else None for receive in pipes]
        finally:
            # ranks that answered exit on their own (a few seconds in all to do so); ranks
            # that stalled, or a run cut short, are killed at once
            answered = all(
                result is not None and result[0] not in (_STALLED, _UNJOINED, READY) for result in results
            )
            deadline = time.monotonic() + (5 if answered else 0)
            for process in processes:
                process.join(max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    process.kill()
                    process.join()
    return results, [process.exitcode for process in processes]


def _first_unjoined(pipes: list[Any], processes: list[Any]) -> tuple[int, str] | None:
    """Wait until every rank says its groups formed: None; or the rank that failed or
    ended before, and why (its traceback, or how it ended).

    Where one rank ended and another failed, the one that ended is named: its peers'
    errors follow from it (gloo's connection to it closed), and a busy parent can
    find both at once, the peer's error on the lower rank's pipe."""
    from multiprocessing.connection import wait

    pending = {receive: rank for rank, receive in enumerate(pipes)}
    deadline = time.monotonic() + JOIN_TIMEOUT
    while pending:
        ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            rank = min(pending.values())
            return rank, f"rank {rank} did not join its groups within {JOIN_TIMEOUT} s"
        failed: dict[int, tuple[str, str] | None] = {}
        for receive in ready:
            rank = pending.pop(receive)
            message = _received(receive)
            if message is None or message[0] != JOINED:
                failed[rank] = message
        if failed:
            for receive, rank in pending.items():  # (a rank that ended meanwhile)
                if processes[rank].exitcode is not None:
                    message = _received(receive) if receive.poll() else None
                    if message is None or message[0] != JOINED:
                        failed[rank] = message
            ended = sorted(rank for rank, message in failed.items() if message is None)
            if ended:
                return ended[0], _ended(ended[0], processes[ended[0]])
            rank = min(failed)
            return rank, failed[rank][1]  # type: ignore[index]
    return None


def _ended(rank: int, process: Any) -> str:
    """Why ``rank`` sent nothing: its exit, as far as it is known."""
    process.join(5)
    code = process.exitcode
    if code is None:
        return f"rank {rank} closed its pipe as it joined its groups"
    if code < 0:
        import signal

        name = signal.Signals(-code).name
        killed = " (the system's out-of-memory killer sends it)" if name == "SIGKILL" else ""
        return f"rank {rank} was killed by {name}{killed} as it joined its groups"
    return f"rank {rank} ended with exit code {code} as it joined its groups"


def _received(receive: Any) -> tuple[str, str] | None:
    """A rank's next message, or None where it closed its end without one."""
    try:
        return receive.recv()  # type: ignore[no-any-return]
    except EOFError:
        return None


def _collected(results: list[tuple[str, str] | None], exitcodes: list[int | None]) -> list[str]:
    unjoined = [(rank, result[1]) for rank, result in enumerate(results) if _marked([result], _UNJOINED)]
    if unjoined:  # (the other ranks were killed waiting for it)
        rank, why = unjoined[0]
        raise RuntimeError(
            f"measure(parallel=...) could not form the mesh's process groups in {FORK_ATTEMPTS} "
            f"tries; the last time, rank {rank}:\n{why}"
        )
    failures = []
    for rank, result in enumerate(results):
        if result is None:
            code = exitcodes[rank]
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            failures.append(f"rank {rank}: the process ended with no result ({how})")
        elif result[0] != "ok":
            failures.append(f"rank {rank}:\n{result[1]}")
    if failures:
        raise RuntimeError("measure(parallel=...) failed on a rank:\n" + "\n".join(failures))
    return [result[1] for result in results if result is not None]


def forked_child(send: Any, work: Callable[[], Any]) -> NoReturn:
    """A forked child's life: get ready (:func:`ready_after_fork`) and say so, send
    ``("ok", work())`` or the error, and leave with ``os._exit`` (the parent's pytest
    session, atexit hooks and buffers are never run twice).

    Its messages on ``send``: ``(READY, "")``, or ``("forked-autograd", why)`` where its
    parent's autograd cannot fork; then ``("ok", result)`` or ``("error", traceback)``.
    """
    code = 0
    try:
        refused = ready_after_fork()
        if refused is not None:
            send.send(("forked-autograd", refused))
        else:
            send.send((READY, ""))
            send.send(("ok", work()))
    except BaseException:  # noqa: BLE001 (everything goes back to the parent; nothing escapes the fork)
        code = 1
        with contextlib.suppress(Exception):  # the parent reports the missing result
            send.send(("error", traceback.format_exc()))
    finally:
        send.close()
        os._exit(code)


def _rank_main(parallel: Parallel, rank: int, store: str, body: Callable[[Any], str], send: Any) -> None:
    """One rank (:func:`forked_child`): join the group, run ``body``, and leave.

    Before it joins the group it gets ready (its kernels on one thread, as every
    rank of a real launch is its own fresh process anyway; two small matrices
    multiplied; one backward), then says so: a forked rank whose parent's
    autograd cannot fork says so (``"forked-autograd"``), and is started again
    fresh; one that never gets ready (forked while another thread of the parent
    held a lock of MKL's: its first GEMM spins forever) is killed with the others
    and forked again. Once every group of its mesh has formed on every rank (a
    barrier of them all) it says so too (``"joined"``); where one rank fails
    before that (killed as it joined, gloo's connection to a peer refused), the
    others are killed and all start again: nothing of the step has run.
    """

    def joined() -> str:
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        with _one_gloo_worker():
            dist.init_process_group(
                "gloo",
                store=dist.FileStore(store, parallel.world),
                rank=rank,
                world_size=parallel.world,
                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT),
            )
            # (a rank that fails leaves its group as it is: os._exit ends it, where gloo's
            # shutdown could wait for the peer it lost and its error never be sent)
            mesh = init_device_mesh("cpu", parallel.sizes, mesh_dim_names=parallel.names)
            # (a rank's groups can form on its side first: without the barrier it could run a
            # step without collectives and leave while a peer still joins, whose gloo then
            # fails on the connection it closed, and the rank that failed is not the cause)
            dist.barrier()
            send.send((JOINED, ""))
            result = body(mesh)
            dist.destroy_process_group()
            return result

    forked_child(send, joined)


@contextlib.contextmanager
def _one_gloo_worker() -> Iterator[None]:
    """Every gloo group made in the block runs its work items on one worker thread.

    A gloo worker completes a work item's future, then lets go of the item (and
    of the tensors it holds) and only then takes the next one from the queue
    (``ProcessGroupGloo::runLoop``). With two workers (gloo's default) the rank's
    thread can go on from a completed all-reduce while the worker that ran it,
    descheduled on a busy machine, still holds it: when DDP's bucket rebuild
    then drops the first step's bucket, the worker frees it later, unseen by
    the profiler (its memory reporting is per thread), and the measured loop
    counts the bucket to the end of the step (66,304 B high on a 2-core CI
    runner). With one worker, the rebuild's own broadcast of the new bucket
    order runs after that worker let go of every earlier item, so the bucket's
    last reference is the reducer's, dropped on the rank's thread, seen. Work
    items from one thread run in the order they were issued either way.
    """
    from datetime import timedelta

    from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

    gloo = private("torch.distributed.distributed_c10d.ProcessGroupGloo")

    class OneWorker(gloo):  # type: ignore[misc,valid-type]  # isinstance checks still hold
        def __init__(self, store: Any, rank: int, size: int, timeout: Any = timedelta(minutes=30), **_: Any) -> None:
            options = gloo._Options()
            options._devices = [gloo.create_default_device()]
            options._threads = 1
            options._timeout = timeout
            if _.get("enable_reconfigure"):  # torch 2.15's reconfigurable groups
                options.enable_reconfigure = True
            super().__init__(store, rank, size, options)

    with replacing("torch.distributed.distributed_c10d.ProcessGroupGloo", OneWorker):
        yield


class FreedOnThisThread(TorchDispatchMode):
    """Make every tensor a collective touched die on the measured thread.

    A gloo collective runs on one of the process group's worker threads, and
    the work item that holds its tensors is released there once it has run.
    When that release is a tensor's last reference (the flat buffer of DDP's
    first broadcast of the module states; a gradient bucket whose reducer was
    dropped while its last all-reduce was being let go), the tensor is freed on
    the worker thread, where the profiler, whose memory reporting is per
    thread, does not see it: the measurement then counts, or not, a buffer
    that is gone, as the threads' timing falls. Under this mode every tensor
    of a ``c10d`` op is held until nothing but the hold refers to it from C++
    (the program's Python references keep it alive as before), and dropped
    at the next op on this thread: a free the worker thread would have made
    unseen is made here, seen, before the next allocation of the step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._held:
            self._let_go()
        result = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self._held.extend(t for t in tree_leaves((args, kwargs, result)) if isinstance(t, torch.Tensor))
        return result

    def _let_go(self) -> None:
        # the hold's own reference is the Python object's: a second is C++'s (gloo's, a reducer's)
        self._held = [t for t in self._held if t._use_count() > 1]

    def drain(self) -> None:
        """Let go of every held tensor here, waiting (briefly) for gloo's threads to."""
        deadline = time.monotonic() + DRAIN_TIMEOUT
        self._let_go()
        while self._held and time.monotonic() < deadline:
            time.sleep(0.0005)
            self._let_go()
        self._held = []


def _let_go_by_gloo(tensors: list[torch.Tensor], counts: list[int]) -> None:
    """Wait (briefly) until no tensor has more C++ references than ``counts`` says."""
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while any(t._use_count() > n for t, n in zip(tensors, counts)) and time.monotonic() < deadline:
        time.sleep(0.0002)


def _completed_here(collective: Callable[..., Any]) -> Callable[..., Any]:
    _create_work_from_future = private("torch._C._distributed_c10d._create_work_from_future")

    @functools.wraps(collective)
    def run(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        counts = [t._use_count() for t in tensors]
        work = collective(*args, **kwargs)
        if work is None:  # async_op=False: done, but a gloo thread may still hold its tensors
            _let_go_by_gloo(tensors, counts)
            return None
        work.wait()
        del work  # gloo's work item now dies on its thread, holding no last reference
        _let_go_by_gloo(tensors, counts)
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return _create_work_from_future(done)

    return run


def _functional_completed_here(wrap: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """``_functional_collectives._maybe_wrap_tensor``, the tensor of a functional
    collective's op waited for first, and let go of by gloo's thread."""
    wait_tensor = private("torch.distributed._functional_collectives.wait_tensor")

    def completed(tensor: torch.Tensor) -> Any:
        wait_tensor(tensor)  # done, unregistered: the wrapper's own wait later does nothing
        _let_go_by_gloo([tensor], [1])  # the op's output: held by its Python object alone
        return wrap(tensor)

    return completed


def _compiled_collective_completed_here(
    collective: Callable[..., Any], wait: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[..., Any]:
    """A functional collective as inductor's program issues it, waited for there, and
    its tensors let go of by gloo's thread before it returns.

    The program hands the collective a view of its buffer made for the call
    (``reinterpret_tensor(buf8, ...)``) and waits, later, on another: gloo's work
    item holds the first, whose storage is the buffer's, and the wait's view is
    held by nothing else. So the wait alone cannot tell whether gloo's thread
    still holds the buffer; where it did when the program dropped it (about one
    real run in three of a compiled tensor-parallel block on two cores), the
    buffer was freed on that thread, unseen, and counted to the end of the step.
    Here the views the collective got are the ones waited on: the program's own
    drop of the buffer is then the last, seen. Its later wait finds no work and
    does nothing."""

    def completed(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        counts = [t._use_count() for t in tensors]
        result = collective(*args, **kwargs)
        made = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        for tensor in made:
            wait(tensor)
        given = {id(t) for t in tensors}
        fresh = [t for t in made if id(t) not in given]  # (the op's own: held by its Python object)
        _let_go_by_gloo(tensors + fresh, counts + [1] * len(fresh))
        return result

    return completed


def _compiled_wait_completed_here(
    wait: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The wait a compiled program (inductor's code) calls on a functional collective's
    buffer, which then waits for gloo's thread to let go of the tensor it is given.

    A collective of :data:`COMPILED_COLLECTIVES` has completed where it was issued
    (:func:`_compiled_collective_completed_here`), so its wait finds no work; this
    serves the program's other waits (its point-to-point ``isend``/``irecv``), where
    the tensor waited on is the one gloo's work item holds only when the program
    passes the buffer itself, not a view of it made for the call."""

    def completed(tensor: torch.Tensor) -> torch.Tensor:
        out = wait(tensor)
        _let_go_by_gloo([tensor], [1])  # (the program's buffer: held by its Python object)
        return out

    return completed


#: What inductor's programs call to wait for a functional collective.
_COMPILED_WAIT: Final = "torch.ops._c10d_functional.wait_tensor.default"


@contextlib.contextmanager
def collectives_completed_here() -> Iterator[None]:
    """Run every collective Python code calls to completion where it is called.

    The estimate's schedule on a rank: a collective completes when it is issued,
    and its buffers die when the program drops them. On real gloo ranks a
    collective runs on a worker thread that holds its tensors until it lets go
    of the work item, at a time of its own; when that is after the program
    dropped them (FSDP2's all-gather output, once copied out), they are freed
    on that thread, unseen by the profiler (its memory reporting is per
    thread), and counted to the end of the step. Under this block
    ``torch.distributed``'s collectives wait for their work and for gloo's
    thread to let go of their tensors before they return (a completed work
    item, when one was asked for), so the program's own drop is the last and
    is seen. A functional collective (DTensor's redistributions, ``loss_parallel``'s
    all-reduces of each token's maximum and sum) is waited for where its op
    returns, before it is wrapped; one an inductor program issues, where it is
    issued (:func:`_compiled_collective_completed_here`). Collectives issued from
    C++ are not affected, but for DDP's bucket rebuild
    (:func:`_rebuild_freed_here`); its reducer's all-reduces write into buckets
    the reducer holds.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

    path = "torch._C._distributed_c10d.Reducer._rebuild_buckets"
    rebuild = private(path)

    def rebuild_buckets(reducer: Any) -> bool:  # a method: a function, not a partial
        return _rebuild_freed_here(rebuild, reducer)

    with contextlib.ExitStack() as replaced:
        for module in (dist, distributed_c10d):
            for name in COLLECTIVES:
                original = getattr(module, name, None)
                if original is not None:
                    replaced.enter_context(replacing(f"{module.__name__}.{name}", _completed_here(original)))
        replaced.enter_context(replacing(path, rebuild_buckets))
        wrap = "torch.distributed._functional_collectives._maybe_wrap_tensor"
        replaced.enter_context(replacing(wrap, _functional_completed_here(private(wrap))))
        # inductor's programs issue and wait for their functional collectives through these
        # names (read as they run; inductor reads them too as it builds one, which therefore
        # happens outside this block: in the warm-up step)
        wait = private(_COMPILED_WAIT)
        replaced.enter_context(replacing(_COMPILED_WAIT, _compiled_wait_completed_here(wait)))
        for name in COMPILED_COLLECTIVES:
            issued = f"torch.ops._c10d_functional.{name}.default"
            replaced.enter_context(replacing(issued, _compiled_collective_completed_here(private(issued), wait)))
        yield


def _rebuild_freed_here(rebuild: Callable[[Any], bool], reducer: Any) -> bool:
    """DDP's bucket rebuild (the first forward of a loop's second step), its temporaries
    freed on this thread.

    The reducer broadcasts the new bucket order from rank 0 in integer tensors it
    makes for the purpose and drops when the rebuild is done; gloo's worker thread
    may let go of the broadcast's work item after that, and free one unseen (counted
    to the end of the step, as the threads' timing falls). Held here, they die at
    the rebuild's next op, or when it returns.
    """
    with FreedOnThisThread() as frees:
        rebuilt = bool(rebuild(reducer))
        frees.drain()
    return rebuilt
