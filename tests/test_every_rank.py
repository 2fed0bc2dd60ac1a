"""Every distinct rank of a parallel run: ``tm.every_rank`` and ``Parallel(rank="max")``.

The search (engine/every_rank.py) traces a few ranks and lets each stand for the ranks
that hold the same; these tests check what it says against an estimate of every rank
on its own (the ground truth for the grouping), and the worst rank against real gloo
ranks.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fingerprint import fingerprint
from test_parallel import _a_real_run_equal_to, _adamw, _blocks, _ddp, _fsdp, _tensor_parallel
from test_pipeline import (
    BATCH,
    MICRO_BATCHES,
    WIDTH,
    Layers,
    _Pairs,
    _schedules,
    _sgd,
    _three_dimensional,
    follows_pipelining,
    split,
)
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine import every_rank as every_rank_module
from pytest_torchmem.engine.parallel import real_ranks as distributed, traced_beside
from pytest_torchmem.engine.figures.report import worst_first
from pytest_torchmem.engine.figures.gpu_profiles import CUDA_CONTEXT, gpu_profile

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def _each_rank(model: nn.Module, inputs: object, parallel: tm.Parallel, **options: object) -> list[tm.MemoryReport]:
    """The ground truth: every rank estimated on its own."""
    return [
        tm.estimate(model, inputs, parallel=tm.Parallel(**{**_fields(parallel), "rank": rank}), **options)
        for rank in range(parallel.world)
    ]


def _fields(parallel: tm.Parallel) -> dict[str, object]:
    return {
        "mesh": dict(parallel.mesh),
        "apply": parallel.apply,
        "schedule": parallel.schedule,
        "microbatches": parallel.microbatches,
    }


def _figures(report: tm.MemoryReport) -> tuple[object, ...]:
    return (
        report.forward_peak,
        report.backward_peak,
        report.step_peak,
        report.reserved_peak,
        sorted((str(category), nbytes) for category, nbytes in report.breakdown.items()),
    )


def _agrees_with_each_rank(figures: tuple[tm.RankFigures, ...], each: list[tm.MemoryReport]) -> None:
    """Every rank is in exactly one entry; every rank of an entry holds the entry's figures,
    and ranks of different entries differ; the worst entry first."""
    covered = sorted(rank for entry in figures for rank in entry.ranks)
    assert covered == list(range(len(each)))
    for entry in figures:
        assert entry.rank in entry.ranks
        for rank in entry.ranks:
            assert _figures(each[rank]) == _figures(entry.report), (entry.rank, rank)
    assert len({tuple(map(str, _figures(entry.report))) for entry in figures}) == len(figures)
    assert [worst_first(entry.report) for entry in figures] == sorted(worst_first(entry.report) for entry in figures)


def _counting_traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ranks the search traces in this process, in order (a pipeline's stages each
    count; not those a forked child traced beside it)."""
    traced: list[int] = []
    real = every_rank_module.distinct_ranks

    def counted(parallel, trace, usable=None, beside=None):  # type: ignore[no-untyped-def]
        def counting(ranks):  # type: ignore[no-untyped-def]
            got = trace(ranks)
            traced.extend(sorted(got))
            return got

        return real(parallel, counting, usable, beside)

    monkeypatch.setattr(every_rank_module, "distinct_ranks", counted)
    return traced


# -- the grouping, against every rank estimated on its own ------------------------


def test_data_parallel_ranks_are_one(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _blocks(), torch.randn(8, 64)
    parallel = tm.Parallel(mesh={"dp": 4}, apply=_ddp())
    traced = _counting_traces(monkeypatch)
    figures = tm.every_rank(model, x, optimizer=_adamw, parallel=parallel)
    assert [entry.ranks for entry in figures] == [(0, 1, 2, 3)]
    assert traced == [0, 3]  # rank 0 and the far end of dp, which hold the same
    _agrees_with_each_rank(figures, _each_rank(model, x, parallel, optimizer=_adamw))


def test_uneven_shards_are_told_apart() -> None:
    # FSDP2 over 4 ranks of a block whose first Linear has 5 rows (torch.chunk: 2, 2, 1, 0):
    # the optimizer's state follows each rank's own rows, so ranks 0 and 1 hold the same
    # and 2 and 3 each hold less
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 16)))
    x = torch.randn(4, 16)
    parallel = tm.Parallel(mesh={"dp": 4}, apply=_fsdp())
    before = fingerprint(model, x)
    figures = tm.every_rank(model, x, optimizer=_adamw, parallel=parallel)
    each = _each_rank(model, x, parallel, optimizer=_adamw)
    assert len({tuple(map(str, _figures(report))) for report in each}) > 1  # the case is uneven
    _agrees_with_each_rank(figures, each)
    assert fingerprint(model, x) == before


def test_a_two_dimensional_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    # data parallel over tensor parallel: every rank holds the same, found with 2 traces
    # (rank 0 and the far corner, rank 3, which traces as rank 0 does, byte for byte)
    def apply(model: nn.Module, mesh: object) -> nn.Module:
        model = _tensor_parallel(model, mesh["tp"])  # type: ignore[index]
        return model

    model, x = _blocks(), torch.randn(8, 64)
    parallel = tm.Parallel(mesh={"dp": 2, "tp": 2}, apply=apply)
    traced = _counting_traces(monkeypatch)
    figures = tm.every_rank(model, x, optimizer=_adamw, parallel=parallel)
    assert traced == [0, 3]
    assert [entry.ranks for entry in figures] == [(0, 1, 2, 3)]
    _agrees_with_each_rank(figures, _each_rank(model, x, parallel, optimizer=_adamw))


def test_a_far_corner_that_differs_traces_each_dimensions_far_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # FSDP2 over dp (4) of a block whose first Linear has 5 rows, the tp dimension (2)
    # unused: the far corner (rank 7) holds less than rank 0, so each dimension's far end
    # is traced (dp's, rank 6; tp's, rank 1), and dp, whose ends differ, at every coordinate
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 16)))
    x = torch.randn(4, 16)

    def apply(model: nn.Module, mesh: object) -> nn.Module:
        return _fsdp()(model, mesh["dp"])  # type: ignore[index]

    parallel = tm.Parallel(mesh={"dp": 4, "tp": 2}, apply=apply)
    before = fingerprint(model, x)
    traced = _counting_traces(monkeypatch)
    figures = tm.every_rank(model, x, optimizer=_adamw, parallel=parallel)
    assert traced == [0, 7, 6, 1, 2, 4]
    each = _each_rank(model, x, parallel, optimizer=_adamw)
    assert len({tuple(map(str, _figures(report))) for report in each}) > 1  # the case is uneven
    _agrees_with_each_rank(figures, each)
    assert fingerprint(model, x) == before


@follows_pipelining
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_stage_of_a_pipeline(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    before = fingerprint(model, x)
    parallel = tm.Parallel(
        mesh={"pp": 2, "dp": 2},
        apply=functools.partial(split, data_parallel=True),
        schedule=_schedules()["1F1B"],
        microbatches=MICRO_BATCHES,
    )
    traced = _counting_traces(monkeypatch)
    figures = tm.every_rank(model, (x,), device=device, optimizer=_sgd, parallel=parallel)
    # one trace of rank 0's pipeline gives both stages, one of the far end of dp gives the others
    assert traced == [0, 2, 1, 3]
    assert sorted(entry.ranks for entry in figures) == [(0, 1), (2, 3)]
    _agrees_with_each_rank(figures, _each_rank(model, (x,), parallel, device=device, optimizer=_sgd))
    assert fingerprint(model, x) == before


def _three_dimensional_pipeline() -> tuple[nn.Module, torch.Tensor, tm.Parallel]:
    model, x = _Pairs(), torch.randn(BATCH, WIDTH)
    parallel = tm.Parallel(
        mesh={"pp": 2, "dp": 2, "tp": 2}, apply=_three_dimensional, schedule=_schedules()["1F1B"], microbatches=4
    )
    return model, x, parallel


@follows_pipelining
def test_the_far_corners_pipeline_is_traced_beside_rank_0s(monkeypatch: pytest.MonkeyPatch) -> None:
    # pp 2 x dp 2 x tp 2 (torchtitan's 3-D rank): this process traces rank 0's pipeline
    # (ranks 0 and 4), a child forked for it the far corner's (dp 1, tp 1: ranks 3 and 7),
    # and the figures are those of the search alone
    enabled = traced_beside.beside_enabled
    monkeypatch.setattr(traced_beside, "beside_enabled", lambda: True)  # (a one-core machine too)
    model, x, parallel = _three_dimensional_pipeline()
    before = fingerprint(model, x)
    here = _counting_traces(monkeypatch)
    figures = tm.every_rank(model, (x,), optimizer=_adamw, parallel=parallel)
    assert here == [0, 4]
    assert fingerprint(model, x) == before
    monkeypatch.setattr(traced_beside, "beside_enabled", enabled)
    monkeypatch.setenv(traced_beside.ENV, "0")  # turned off
    here.clear()
    alone = tm.every_rank(model, (x,), optimizer=_adamw, parallel=parallel)
    assert here == [0, 4, 3, 7]
    assert figures == alone
    assert sorted(entry.ranks for entry in figures) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def _refused() -> str:
    return "Unable to handle autograd's threading in combination with fork-based multiprocessing"


def _dies() -> str:
    os._exit(3)


def _raises() -> str:
    raise RuntimeError("a lock this child never gets")


@follows_pipelining
@pytest.mark.parametrize("child", [_refused, _dies, _raises], ids=["autograd refused", "dies", "raises"])
def test_a_child_that_cannot_trace_leaves_the_pipeline_to_this_process(
    child: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(traced_beside, "beside_enabled", lambda: True)
    monkeypatch.setattr(distributed, "ready_after_fork", child)  # (what the forked child runs first)
    model, x, parallel = _three_dimensional_pipeline()
    here = _counting_traces(monkeypatch)
    figures = tm.every_rank(model, (x,), optimizer=_adamw, parallel=parallel)
    assert here == [0, 4, 3, 7]
    assert sorted(entry.ranks for entry in figures) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def _fails_at_rank_0s_coordinates(model: nn.Module, mesh: object) -> object:
    if mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0:  # type: ignore[index]
        raise RuntimeError("no stage at dp=0, tp=0")
    return _three_dimensional(model, mesh)  # type: ignore[arg-type]


@follows_pipelining
def test_where_rank_0s_trace_fails_the_child_beside_it_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traced_beside, "beside_enabled", lambda: True)
    model, x, parallel = _three_dimensional_pipeline()
    parallel = tm.Parallel(**{**_fields(parallel), "apply": _fails_at_rank_0s_coordinates})
    with pytest.raises(Exception, match="no stage at dp=0, tp=0"):
        tm.every_rank(model, (x,), optimizer=_adamw, parallel=parallel)
    assert multiprocessing.active_children() == []  # (the corner's child, which could trace)


# -- the worst rank ------------------------------------------------------------------


@follows_pipelining
def test_the_worst_rank_is_the_worst_of_real_gloo_ranks() -> None:
    # 1F1B: the last stage holds the loss's micro-batches; estimate(rank="max") is its rank,
    # and measure(rank="max") (every real rank, the worst kept) equals it
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    parallel = tm.Parallel(
        mesh={"pp": 2}, apply=split, rank="max", schedule=_schedules()["1F1B"], microbatches=MICRO_BATCHES
    )
    worst = tm.estimate(model, (x,), optimizer=_sgd, parallel=parallel)
    figures = tm.every_rank(model, (x,), optimizer=_sgd, parallel=parallel)
    assert worst == figures[0].report
    assert worst.peak == max(entry.report.peak for entry in figures)
    _a_real_run_equal_to(worst, lambda: tm.measure(model, (x,), optimizer=_sgd, parallel=parallel))


def test_headroom_on_the_gpu_followed() -> None:
    model, x = _blocks(), torch.randn(8, 64)
    parallel = tm.Parallel(mesh={"tp": 2}, apply=_tensor_parallel)
    figures = tm.every_rank(model, x, device="cuda", gpu="T4", optimizer=_adamw, parallel=parallel)
    entry = figures[0]
    usable = gpu_profile("T4").memory - CUDA_CONTEXT
    assert entry.usable == usable
    assert entry.report.reserved_peak is not None
    assert entry.headroom == usable - entry.report.reserved_peak
    assert entry.fits is True
    assert str(entry).startswith("rank 0 (tp=0; 2 ranks: 0-1): peak ")
    assert "to spare" in str(entry)
    cpu = tm.every_rank(model, x, optimizer=_adamw, parallel=parallel)[0]
    assert cpu.usable is None and cpu.headroom is None and cpu.fits is None


# -- refused ---------------------------------------------------------------------------


def test_every_rank_needs_a_parallel() -> None:
    with pytest.raises(TypeError, match=r"every_rank\(\) needs parallel=tm.Parallel"):
        tm.every_rank(_blocks(), torch.randn(8, 64), parallel=None)  # type: ignore[arg-type]


def test_too_many_differing_ranks_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(every_rank_module, "MAX_TRACED_RANKS", 3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 16)))
    with pytest.raises(ValueError, match=r"would trace more than 3 ranks; estimate the ranks you need"):
        tm.every_rank(model, torch.randn(4, 16), optimizer=_adamw, parallel=tm.Parallel(mesh={"dp": 4}, apply=_fsdp()))


# -- the command line ------------------------------------------------------------------

FACTORY = """
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import pytest_torchmem as tm


def tensor_parallel(model, mesh):
    return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    parallel = tm.Parallel(mesh={"dp": 2, "tp": 2}, apply=tensor_parallel)
    return model, lambda batch: torch.randn(batch, 64), {"parallel": parallel, "optimizer": torch.optim.AdamW}


def replicated():
    with torch.device("meta"):
        model = nn.Linear(65536, 65536, bias=False)
    parallel = tm.Parallel(mesh={"dp": 2}, apply=lambda model, mesh: model)
    return model, lambda rows: torch.randn(rows, 65536, device="meta"), {"parallel": parallel, "train": False}


def no_parallel():
    model = nn.Linear(4, 4)
    return model, lambda batch: torch.randn(batch, 4)
"""


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(FACTORY)
    return subprocess.run(
        [sys.executable, "-m", "pytest_torchmem", "ranks", *args], cwd=tmp_path, capture_output=True, text=True, check=False
    )


def test_the_command_line_lists_what_every_rank_gives(tmp_path: Path) -> None:
    result = _cli(tmp_path, "train.py:factory", "--size", "8", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    x = torch.randn(8, 64)
    figures = tm.every_rank(
        model, x, device="cuda", optimizer=torch.optim.AdamW, parallel=tm.Parallel(mesh={"dp": 2, "tp": 2}, apply=_tp_one)
    )
    assert [(row["rank"], row["ranks"], row["peak"], row["reserved_peak"], row["headroom"]) for row in rows] == [
        (entry.rank, list(entry.ranks), entry.report.peak, entry.report.reserved_peak, entry.headroom) for entry in figures
    ]
    assert rows[0]["coordinates"] == {"dp": 0, "tp": 0} and rows[0]["fits"] is True


def _tp_one(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})  # type: ignore[index]


def test_the_command_line_exits_1_where_a_rank_does_not_fit(tmp_path: Path) -> None:
    # a 16 GiB weight on every rank of a T4 (15 GiB less the CUDA context)
    result = _cli(tmp_path, "train.py:replicated", "--size", "1", "--gpu", "T4")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["rank", "coordinates", "stands", "for", "forward", "backward", "step", "peak", "reserved", "headroom", "fits"]
    assert lines[2].split()[:3] == ["0", "dp=0", "0-1"] and lines[2].split()[-1] == "no"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.py:no_parallel", "--size", "2"], "ranks needs the options to hold parallel=tm.Parallel(mesh=..., apply=...), got none"),
        (["train.py:factory", "--size", "2", "--device", "cpu", "--gpu", "T4"], "--gpu is for --device cuda"),
        (["train.py:factory", "--size", "0"], "--size must be a positive integer"),
    ],
)
def test_bad_command_lines_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = _cli(tmp_path, *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
