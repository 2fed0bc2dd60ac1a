"""Real ranks on this machine: forked gloo processes that each run one function.

``measure(parallel=...)`` is the ground truth for the estimate of a rank, so
the ranks are real processes talking through gloo. They are forked from the
calling process: nothing is pickled (the model, the inputs and a closure
``apply`` reach every rank as they are) and no interpreter starts again, which
keeps a measurement's start cheap. Each rank leaves with ``os._exit``, so the
parent's pytest session, atexit hooks and buffers are never run twice.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any, Final

from pytest_torchmem.engine.parallel import Parallel

__all__ = ["MAX_REAL_RANKS", "run_ranks"]

#: The most processes ``measure(parallel=...)`` starts on one machine.
MAX_REAL_RANKS: Final = 4
#: Seconds a rank may take before the run is given up.
TIMEOUT: Final = 600
#: Seconds a rank waits in a collective for the others (one that failed never comes).
COLLECTIVE_TIMEOUT: Final = 120


def run_ranks(parallel: Parallel, body: Callable[[Any], str]) -> list[str]:
    """Run ``body(mesh)`` on every rank of ``parallel`` as a gloo process; their results by rank."""
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
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError("measure(parallel=...) forks its ranks, and this platform cannot fork")
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="torchmem-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        pipes = []
        processes = []
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
            for rank, receive in enumerate(pipes):
                if receive.poll(TIMEOUT):
                    try:
                        results[rank] = receive.recv()
                    except EOFError:
                        results[rank] = None
        finally:
            for process in processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join()
    failures = []
    for rank, result in enumerate(results):
        if result is None:
            code = processes[rank].exitcode
            failures.append(f"rank {rank}: the process ended with no result (exit code {code})")
        elif result[0] == "error":
            failures.append(f"rank {rank}:\n{result[1]}")
    if failures:
        raise RuntimeError("measure(parallel=...) failed on a rank:\n" + "\n".join(failures))
    return [result[1] for result in results if result is not None]


def _rank_main(parallel: Parallel, rank: int, store: str, body: Callable[[Any], str], send: Any) -> None:
    """One rank: join the group, run ``body``, send its result or error, and leave.

    The rank runs its kernels on one thread: a forked child cannot use the
    OpenMP thread pool of a parent that ran parallel regions (GNU OpenMP then
    waits forever for threads the child does not have), and every rank of a
    real launch is its own fresh process anyway.
    """
    code = 0
    try:
        import torch

        torch.set_num_threads(1)
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, parallel.world),
            rank=rank,
            world_size=parallel.world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT),
        )
        try:
            mesh = init_device_mesh("cpu", parallel.sizes, mesh_dim_names=parallel.names)
            send.send(("ok", body(mesh)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (everything goes back to the parent; nothing escapes the fork)
        code = 1
        with contextlib.suppress(Exception):  # the parent reports the missing result
            send.send(("error", traceback.format_exc()))
    finally:
        send.close()
        os._exit(code)
