"""Every distinct rank of a parallel run: which rank runs out of memory first, and by how much.

A mesh of hundreds of ranks holds few distinct ones. Along a pipeline's dimension every
stage differs (its own layers, its own place in the schedule), and one trace of a
pipeline gives every stage of it. Along the other dimensions (data parallel, FSDP,
tensor, context, experts) torch splits tensors into chunks (``torch.chunk``: FSDP2's
shards, DTensor's ``Shard``, a sequence's chunks), whose sizes do not grow from the first
coordinate to the last: where the first and the last coordinate hold the same, every
coordinate between does too.

So the search traces rank 0's pipeline, then the pipeline at the far corner, every other
dimension at its last coordinate. Where each stage's trace there is rank 0's, event for
event and byte for byte (:meth:`~pytest_torchmem.engine.figures.timeline.Timeline.digest`), no
size along any dimension shrank at its last coordinate (a size that shrank along one
dimension is not made up by another, whose sizes do not grow either): every rank holds
its stage's figures at rank 0, found with two pipelines' traces. Otherwise the search
traces, for each dimension, the pipeline at its last coordinate (the others at 0); a
dimension whose two ends hold the same is one rank's worth, one whose ends differ is
traced at every coordinate. Ranks whose figures are equal are then one entry, which
lists them.

What the search assumes, and where it would not hold: a program that branches on its
rank's coordinate other than through the sizes torch gives it (``if rank == 3:``) at a
coordinate the search did not trace.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from pytest_torchmem.engine.figures.report import MemoryReport, worst_first
from pytest_torchmem.engine.figures.units import format_bytes

if TYPE_CHECKING:
    from pytest_torchmem.engine.parallel.mesh import Parallel
    from pytest_torchmem.engine.parallel.traced_beside import Beside
    from pytest_torchmem.engine.step.request import StepRequest
    from pytest_torchmem.engine.tracing.trace import Trace

__all__ = ["MAX_TRACED_RANKS", "RankFigures", "TracedRank", "distinct_ranks", "request_ranks", "traced_rank"]

#: At most this many ranks are traced (a pipeline's stages each count): past it, a mesh
#: whose dimensions all differ end to end is refused rather than traced for minutes.
MAX_TRACED_RANKS: Final = 256


class TracedRank(NamedTuple):
    """What the search keeps of a traced rank: its report, and the digest of its timeline
    (:meth:`~pytest_torchmem.engine.figures.timeline.Timeline.digest`)."""

    report: MemoryReport
    digest: bytes


def traced_rank(trace: Trace) -> TracedRank:
    """What the search keeps of ``trace`` (its timeline is let go)."""
    return TracedRank(trace.report, trace.timeline.digest())


@dataclass(frozen=True)
class RankFigures:
    """One distinct rank of a parallel run: the figures of ``rank`` (the one traced), which
    every rank of ``ranks`` holds, and, on the fake cuda device, the room they leave on
    the GPU the estimate followed."""

    rank: int
    ranks: tuple[int, ...]
    coordinates: Mapping[str, int]
    report: MemoryReport
    #: What a step may take of the GPU (its memory less the CUDA context); None on cpu.
    usable: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "coordinates", MappingProxyType(dict(self.coordinates)))

    @property
    def headroom(self) -> int | None:
        """Usable memory less the reserved peak (negative: it does not fit); None on cpu."""
        if self.usable is None or self.report.reserved_peak is None:
            return None
        return self.usable - self.report.reserved_peak

    @property
    def fits(self) -> bool | None:
        """Whether the ranks' step fits the GPU; None on cpu."""
        headroom = self.headroom
        return None if headroom is None else headroom >= 0

    def __str__(self) -> str:
        where = ", ".join(f"{name}={index}" for name, index in self.coordinates.items())
        text = f"rank {self.rank} ({where}; {_ranks_text(self.ranks)}): peak {format_bytes(self.report.peak)}"
        headroom = self.headroom
        if headroom is not None:
            reserved = self.report.reserved_peak
            assert reserved is not None
            room = "to spare" if headroom >= 0 else "over"
            text += f", {format_bytes(reserved)} reserved, {format_bytes(abs(headroom))} {room}"
        return text


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return "1 rank"
    if list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{len(ranks)} ranks: {ranks[0]}-{ranks[-1]}"
    shown = ", ".join(str(rank) for rank in ranks[:8])
    return f"{len(ranks)} ranks: {shown}{', ...' if len(ranks) > 8 else ''}"


def _figures(report: MemoryReport) -> tuple[Any, ...]:
    """What makes two ranks' figures one: every phase's peak, the reserved peak and the
    breakdown at the peak."""
    return (
        report.forward_peak,
        report.backward_peak,
        report.step_peak,
        report.reserved_peak,
        tuple(sorted((str(category), nbytes) for category, nbytes in report.breakdown.items())),
    )


def distinct_ranks(
    parallel: Parallel,
    traced: Callable[[Sequence[int]], Mapping[int, TracedRank]],
    usable: int | None = None,
    beside: bool = False,
) -> tuple[RankFigures, ...]:
    """The distinct ranks of ``parallel``'s mesh, worst first (:func:`~pytest_torchmem.engine.figures.report.worst_first`; equal
    ones by rank). ``traced(ranks)`` traces each of ``ranks`` (and may trace more: a
    pipeline's other stages); with ``beside``, the far corner's in a forked child
    (:mod:`~pytest_torchmem.engine.parallel.traced_beside`) while this process traces rank 0's."""
    pipeline = parallel.pipeline if parallel.pipelined else None
    others = [name for name in parallel.names if name != pipeline and parallel.mesh[name] > 1]
    stages = range(parallel.mesh[pipeline]) if pipeline is not None else range(1)
    traces: dict[int, TracedRank] = {}

    def rank(coordinates: Mapping[str, int], stage: int) -> int:
        at = {name: coordinates.get(name, 0) for name in parallel.names}
        if pipeline is not None:
            at[pipeline] = stage
        return parallel.rank_at(at)

    def trace(coordinates: Mapping[str, int]) -> None:
        wanted = [one for one in (rank(coordinates, stage) for stage in stages) if one not in traces]
        if len(traces) + len(wanted) > MAX_TRACED_RANKS:
            raise ValueError(
                f"the mesh {parallel.key} has ranks that differ along every dimension: telling "
                f"them apart would trace more than {MAX_TRACED_RANKS} ranks; estimate the ranks "
                "you need with Parallel(rank=...)"
            )
        if wanted:
            traces.update(traced(wanted))

    def same(coordinates: Mapping[str, int], alike: Callable[[TracedRank], Any]) -> bool:
        return all(alike(traces[rank({}, stage)]) == alike(traces[rank(coordinates, stage)]) for stage in stages)

    # rank 0's pipeline, then the far corner's: where it traced as rank 0's, no dimension
    # differs; else each dimension's far end
    differing: list[str] = []
    corner = {name: parallel.mesh[name] - 1 for name in others}
    with _beside(traced, [rank(corner, stage) for stage in stages], beside and len(others) > 1) as aside:
        trace({})
        if aside is not None:
            traces.update(aside.result() or {})
    if len(others) > 1:
        trace(corner)  # (what the child did not trace)
    if len(others) < 2 or not same(corner, lambda one: one.digest):
        for name in others:
            end = {name: parallel.mesh[name] - 1}
            trace(end)
            if not same(end, lambda one: _figures(one.report)):
                differing.append(name)
    # every coordinate of the dimensions whose ends differ; each traced rank stands for
    # the ranks that differ from it only along the others
    stands_for: dict[int, list[int]] = {}
    every = [parallel.coordinates(one) for one in range(parallel.world)]
    for values in itertools.product(*(range(parallel.mesh[name]) for name in differing)):
        fixed = dict(zip(differing, values, strict=True))
        trace(fixed)
        for stage in stages:
            mine = rank(fixed, stage)
            stands_for[mine] = [
                one
                for one, at in enumerate(every)
                if all(at[name] == index for name, index in fixed.items())
                and (pipeline is None or at[pipeline] == stage)
            ]
    # ranks of equal figures are one entry
    merged: dict[tuple[Any, ...], list[int]] = {}
    for traced_rank in sorted(stands_for):
        merged.setdefault(_figures(traces[traced_rank].report), []).append(traced_rank)
    entries = []
    for traced_ranks in merged.values():
        first = traced_ranks[0]
        ranks = sorted(one for traced_rank in traced_ranks for one in stands_for[traced_rank])
        report = traces[first].report
        entries.append(RankFigures(first, tuple(ranks), parallel.coordinates(first), report, usable))
    return tuple(sorted(entries, key=lambda entry: (*worst_first(entry.report), entry.rank)))


def _beside(
    traced: Callable[[Sequence[int]], Mapping[int, TracedRank]], ranks: list[int], forks: bool
) -> contextlib.AbstractContextManager[Beside[Mapping[int, TracedRank]] | None]:
    """``traced(ranks)`` in a child forked now, where ``forks`` (None otherwise); the child is
    let go when the block ends, whatever it has done by then."""
    if not forks or 2 * len(ranks) > MAX_TRACED_RANKS:  # (refused by the search, in this process)
        return contextlib.nullcontext()
    from pytest_torchmem.engine.parallel.traced_beside import Beside

    return Beside(lambda: traced(ranks))


def request_ranks(request: StepRequest) -> tuple[RankFigures, ...]:
    """The distinct ranks of a checked step request's parallel run, on its device and the
    profile it follows (resolved by the entry point; on cpu the host's as this process runs:
    a forked child runs one thread), as :func:`~pytest_torchmem.engine.api.every_rank`
    returns them."""
    from pytest_torchmem.engine.figures.gpu_profiles import usable_memory
    from pytest_torchmem.engine.parallel.traced_beside import beside_enabled
    from pytest_torchmem.engine.tracing.trace import trace_request_ranks

    parallel = request.parallel
    assert parallel is not None
    profile = request.device.gpu

    def traced(ranks: Sequence[int]) -> dict[int, TracedRank]:
        traces = trace_request_ranks(request, ranks=ranks)
        return {rank: traced_rank(one) for rank, one in traces.items()}

    # a pipeline's trace is the search's unit of time: one beside another where two cores are
    beside = parallel.pipelined and beside_enabled()
    return distinct_ranks(parallel, traced, usable_memory(profile) if profile is not None else None, beside)
