"""Op coverage: PyTorch's OpInfo database through ``estimate``, checked against ``measure``.

    python benchmarks/opinfo.py                              # float32 and bfloat16, 3 samples per op
    python benchmarks/opinfo.py --op 'nn.functional.*' --limit-samples 10
    python benchmarks/opinfo.py --device cuda                # estimate on the fake cuda device only
    python benchmarks/opinfo.py --json opinfo.json --jobs 2
    python benchmarks/opinfo.py --profiles default:1,avx2:2,host   # one table row per CPU profile

Every OpInfo of ``torch.testing._internal.common_methods_invocations.op_db``
(it needs the ``expecttest`` package) that supports the dtype on CPU gives its
first ``--limit-samples`` CPU samples (``requires_grad`` where the op supports
autograd); each sample becomes a one-op model (``tests/opinfo_harness.py``)
whose step is estimated and, on cpu, measured. An op is

* **traced** when ``estimate`` returned a report for every sample,
* **exact** when every sample's forward, backward and step peaks equal ``measure``'s,
* **flagged** when an estimate lists ``unsupported`` ops (an upper bound, or a stopped trace),
* **inexact** when traced, unflagged and different,
* **raised** when ``estimate`` raised what the real step did not (a tracer failure).

Not counted: samples whose real op raises (OpInfo samples meant for other
devices or dtypes, ops with no CPU kernel, a backward with no kernel for the
dtype: "measure failed"; with ``--device cuda``, where nothing is measured,
the real CPU step is the reference), and samples that cannot be a step's
input (sparse or non-CPU tensors: "skipped"). An op with no sample left is
excluded from the denominators. Ops run in worker
processes, so that an op that crashes or hangs the interpreter is reported,
not fatal.

``--profiles`` runs the whole benchmark once per CPU profile (``level:threads``;
``host`` is this machine as it is): each in worker processes capped with
``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA`` to the level and running at the
profile's intra-op thread count, so that a faster host stands for the machines
below it; the summary then has one row per profile and dtype.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import selectors
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from opinfo_harness import DTYPES, OpResult, Outcome, SampleResult

#: Outcomes that say nothing about the estimator, excluded from the denominators.
EXCLUDED = (Outcome.MEASURE_FAILED, Outcome.SKIPPED)


# -- worker: runs ops sent on stdin, one JSON line back per op ---------------------------


def _worker(limit: int, device: str, threads: int | None) -> int:
    warnings.filterwarnings("ignore")
    from opinfo_harness import op_infos, op_name, run_op

    if threads:
        import torch

        torch.set_num_threads(threads)

    # The answers go to the parent on the original stdout; whatever else the ops or
    # torch print goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    ops = {op_name(op): op for op in op_infos()}
    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        name, dtype = line.split()
        result = run_op(ops[name], DTYPES[dtype], limit=limit, device=device)
        print(json.dumps(result.to_dict()), file=answers, flush=True)
    return 0


@dataclass
class _Worker:
    process: subprocess.Popen[str]
    task: tuple[str, str] | None = None
    started: float = 0.0
    buffer: str = ""
    ready: bool = False


def _start(limit: int, device: str, profile: str | None) -> _Worker:
    command = [sys.executable, __file__, "--worker", "--limit-samples", str(limit), "--device", device]
    env = None
    if profile is not None and profile != "host":
        from pytest_torchmem.engine.tracing.devices.cpu.profiles import capped_environment, cpu_profile

        named = cpu_profile(profile)
        env = {**os.environ, **capped_environment(named)}
        command += ["--threads", str(named.threads)]
    process = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        bufsize=1,
    )
    return _Worker(process)


def _failed(task: tuple[str, str], why: str) -> OpResult:
    return OpResult(task[0], task[1], [SampleResult(Outcome.RAISED, error=why)])


@dataclass
class _Pool:
    """Worker processes that take one (op, dtype) at a time; a worker that dies or
    runs past ``timeout`` on an op is replaced, and the op reported as raised."""

    jobs: int
    limit: int
    device: str
    timeout: float
    profile: str | None = None
    workers: list[_Worker] = field(default_factory=list)

    def run(self, tasks: list[tuple[str, str]], progress: bool) -> list[OpResult]:
        pending = list(reversed(tasks))
        results: list[OpResult] = []
        selector = selectors.DefaultSelector()
        self.workers = [self._spawn(selector) for _ in range(min(self.jobs, len(tasks)))]
        try:
            while pending or any(w.task for w in self.workers):
                for worker in self.workers:
                    if worker.ready and worker.task is None and pending:
                        worker.task = pending.pop()
                        worker.started = time.monotonic()
                        assert worker.process.stdin is not None
                        worker.process.stdin.write(" ".join(worker.task) + "\n")
                        worker.process.stdin.flush()
                for key, _ in selector.select(timeout=1.0):
                    worker = key.data
                    chunk = os.read(key.fd, 1 << 16).decode()
                    if not chunk:
                        self._replace(worker, selector, results, "the worker process died")
                        continue
                    worker.buffer += chunk
                    while "\n" in worker.buffer:
                        line, worker.buffer = worker.buffer.split("\n", 1)
                        if line == "ready":
                            worker.ready = True
                        elif worker.task is not None:
                            results.append(OpResult.from_dict(json.loads(line)))
                            if progress:
                                _progress(results[-1], len(results), len(tasks))
                            worker.task = None
                now = time.monotonic()
                for worker in list(self.workers):
                    if worker.task is not None and now - worker.started > self.timeout:
                        self._replace(
                            worker, selector, results, f"timed out after {self.timeout:g} s"
                        )
        finally:
            for worker in self.workers:
                _stop(worker)
        return results

    def _spawn(self, selector: selectors.BaseSelector) -> _Worker:
        worker = _start(self.limit, self.device, self.profile)
        assert worker.process.stdout is not None
        selector.register(worker.process.stdout, selectors.EVENT_READ, worker)
        return worker

    def _replace(
        self, worker: _Worker, selector: selectors.BaseSelector, results: list[OpResult], why: str
    ) -> None:
        assert worker.process.stdout is not None
        selector.unregister(worker.process.stdout)
        _stop(worker)
        if worker.task is not None:
            code = worker.process.returncode
            results.append(_failed(worker.task, f"{why} (exit code {code})" if code else why))
        self.workers[self.workers.index(worker)] = self._spawn(selector)


def _stop(worker: _Worker) -> None:
    if worker.process.poll() is None:
        worker.process.kill()
    worker.process.wait()


def _progress(result: OpResult, done: int, total: int) -> None:
    print(
        f"[{done}/{total}] {result.dtype:9s} {result.outcome.value:15s} {result.op}",
        file=sys.stderr,
    )


# -- the tables -----------------------------------------------------------------------


def _percent(part: int, whole: int) -> str:
    return f"{part} ({part / whole:.1%})" if whole else str(part)


def summary_rows(results: list[OpResult]) -> list[list[Any]]:
    """One row per dtype: ops run, excluded, and the outcomes of the rest."""
    rows = []
    for dtype in sorted({r.dtype for r in results}, key=lambda d: list(DTYPES).index(d)):
        counts = Counter(r.outcome for r in results if r.dtype == dtype)
        total = sum(counts.values())
        excluded = sum(counts[o] for o in EXCLUDED)
        counted = total - excluded
        traced = counted - counts[Outcome.RAISED]
        rows.append(
            [
                dtype,
                total,
                excluded,
                counted,
                _percent(traced, counted),
                _percent(counts[Outcome.EXACT], counted),
                _percent(counts[Outcome.INEXACT], counted),
                _percent(counts[Outcome.FLAGGED], counted),
                _percent(counts[Outcome.TRACED], counted),
                _percent(counts[Outcome.RAISED], counted),
            ]
        )
    return rows


SUMMARY_HEADERS = [
    "dtype",
    "ops run",
    "excluded",
    "counted",
    "traced",
    "exact",
    "inexact",
    "flagged",
    "traced, not measured",
    "raised",
]


def _relative(sample: SampleResult) -> tuple[float, str]:
    worst, where = 0.0, ""
    for phase in ("forward", "backward", "step"):
        e, m = sample.estimate.get(phase, 0), sample.measure.get(phase, 0)
        if e != m:
            error = abs(e - m) / m if m else float("inf")
            if error >= worst:
                worst, where = (
                    error,
                    f"{phase} {e} vs {m} B ({(e - m) / m:+.1%})" if m else f"{phase} {e} vs 0 B",
                )
    return worst, where


def inexact_rows(results: list[OpResult], count: int) -> list[list[Any]]:
    found = []
    for result in results:
        if result.outcome is not Outcome.INEXACT:
            continue
        sample = max(
            (s for s in result.samples if s.outcome is Outcome.INEXACT),
            key=lambda s: _relative(s)[0],
        )
        error, where = _relative(sample)
        found.append((error, result.dtype, result.op, where))
    found.sort(key=lambda row: -row[0])
    return [[op, dtype, where] for _, dtype, op, where in found[:count]]


def _other_rows(results: list[OpResult], outcome: Outcome) -> list[list[Any]]:
    rows = []
    for result in results:
        if result.outcome is outcome:
            sample = next(s for s in result.samples if s.outcome is outcome)
            text = sample.error or "; ".join(sample.unsupported)
            rows.append([result.op, result.dtype, text[:160]])
    return rows


def _tasks(dtypes: list[str], patterns: list[str]) -> tuple[list[tuple[str, str]], int]:
    """(op, dtype) pairs to run, and how many pairs the OpInfos say are unsupported on CPU."""
    from opinfo_harness import op_infos, op_name, supports

    tasks, unsupported = [], 0
    for op in op_infos():
        name = op_name(op)
        if patterns and not any(
            fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(op.name, p) for p in patterns
        ):
            continue
        for dtype in dtypes:
            if supports(op, DTYPES[dtype]):
                tasks.append((name, dtype))
            else:
                unsupported += 1
    return tasks, unsupported


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtype",
        action="append",
        choices=sorted(DTYPES),
        help="dtype to run (repeatable; default: float32 and bfloat16)",
    )
    parser.add_argument("--op", action="append", default=[], help="op name or glob (repeatable)")
    parser.add_argument("--limit-samples", type=int, default=3, help="samples per op (default 3)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--json", type=Path, help="write every op's per-sample results here")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: estimate and measure; cuda: estimate on the fake cuda device only",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per op (default 300)")
    parser.add_argument("--top", type=int, default=25, help="inexact ops listed (default 25)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--profiles",
        help="comma-separated CPU profiles to run under, e.g. default:1,avx2:2,host (capped workers)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        return _worker(options.limit_samples, options.device, options.threads)

    dtypes = options.dtype or ["float32", "bfloat16"]
    profiles: list[str | None] = [None]
    if options.profiles:
        from pytest_torchmem.engine.tracing.devices.cpu.profiles import cpu_profile

        profiles = [p.strip() for p in options.profiles.split(",") if p.strip()]
        for profile in profiles:
            if profile != "host":
                cpu_profile(profile)  # a bad name fails here, before any worker starts
    start = time.perf_counter()
    tasks, not_supported = _tasks(dtypes, options.op)
    if not tasks:
        print("no OpInfo matches", options.op, file=sys.stderr)
        return 2
    by_profile: dict[str | None, list[OpResult]] = {}
    for profile in profiles:
        pool = _Pool(options.jobs, options.limit_samples, options.device, options.timeout, profile)
        by_profile[profile] = sorted(
            pool.run(tasks, progress=not options.quiet), key=lambda r: (r.dtype, r.op)
        )
    seconds = time.perf_counter() - start

    import torch

    threads = "each profile's threads" if options.profiles else f"{torch.get_num_threads()} threads"
    print(
        f"OpInfo coverage on {options.device}: torch {torch.__version__}, "
        f"{len({op for op, _ in tasks})} ops, up to {options.limit_samples} samples each, "
        f"{threads}, {seconds:.0f} s"
    )
    if options.profiles:
        from pytest_torchmem.engine.tracing.devices.cpu.profiles import host_profile

        host = host_profile()
        label = {p: f"host ({host.isa}:{host.threads})" if p == "host" else p for p in by_profile}
        rows = [[label[p], *row] for p, results in by_profile.items() for row in summary_rows(results)]
        print(tabulate(rows, headers=["profile", *SUMMARY_HEADERS]))
    else:
        print(tabulate(summary_rows(by_profile[None]), headers=SUMMARY_HEADERS))
    print(
        f"\nops run: OpInfos that list the dtype for CPU ({not_supported} op-dtype pairs that "
        "do not are not run). excluded: every sample's real op (on cuda: its CPU step) raised, "
        "or the sample cannot be an input (sparse, non-CPU tensors). Percentages are of the "
        "counted ops; traced = exact + inexact + flagged (+ traced, not measured on cuda)."
    )
    for profile, results in by_profile.items():
        _details(results, options.top, f" on {profile}" if profile else "")
    if options.json:
        data = {
            "torch": torch.__version__,
            "device": options.device,
            "dtypes": dtypes,
            "limit_samples": options.limit_samples,
            "threads": torch.get_num_threads(),
            "profiles": [
                {
                    "profile": profile or "host",
                    "summary": [dict(zip(SUMMARY_HEADERS, row)) for row in summary_rows(results)],
                    "results": [r.to_dict() for r in results],
                }
                for profile, results in by_profile.items()
            ],
        }
        if not options.profiles:  # the layout of a single run, as before
            data.update(data.pop("profiles")[0])
            del data["profile"]
        options.json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    raised = sum(r.outcome is Outcome.RAISED for results in by_profile.values() for r in results)
    return 1 if raised else 0


def _details(results: list[OpResult], top: int, where: str) -> None:
    """The raised, flagged and largest inexact ops of one run."""
    for outcome, title in (
        (Outcome.RAISED, "Raised"),
        (Outcome.FLAGGED, "Flagged (in unsupported)"),
    ):
        rows = _other_rows(results, outcome)
        if rows:
            print(f"\n{title}{where}:")
            print(tabulate(rows, headers=["op", "dtype", "first"]))
    rows = inexact_rows(results, top)
    if rows:
        print(f"\nLargest inexact{where} (relative error of the worst phase, worst sample; top {top}):")
        print(tabulate(rows, headers=["op", "dtype", "worst phase"]))


if __name__ == "__main__":
    raise SystemExit(main())
