"""Blocks compiled inside ``Parallel.apply`` (issue 55): DDP, FSDP2 (with and without
``reshard_after_forward``, activation checkpointing around the compiled block,
``fullgraph=True``) and tensor parallel, as large-scale trainers build their ranks
(torchtitan's order: checkpoint, compile each block, then shard).

On cpu the estimate follows inductor's program on the rank and equals
``measure(parallel=...)``, which runs the compiled program in its steady state on real
gloo ranks (a warm-up step first); on cuda there is no GPU to measure, so the compiled
figures are checked against the eager program's, from which they differ where the
programs do (a figure equal to the eager one would be the eager program's, silently).
A pipeline's stages, traced on threads of one process, are followed too: its ranks run
a warm-up step together first.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import pytest
import torch
from fingerprint import fingerprint
from torch import nn

import pytest_torchmem as tm
from following import follows_compiled
from profiled import every_peak
from test_parallel import _a_real_run_equal_to
from test_pipeline import follows_pipelining

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


class Block(nn.Module):
    """A transformer's MLP half: what inductor fuses (the norm, the GELU) differs in
    memory from the eager program."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))) * 0.5)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 32, 64)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # (foreach=False: tensor parallel's rank mixes DTensor and plain parameters, which
    # AdamW's foreach kernels refuse on a GPU, as they do here on the fake one)
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _peaks(report: tm.MemoryReport) -> tuple[int, int, int]:
    return report.forward_peak, report.backward_peak, report.step_peak


def _compiled_entries(report: tm.MemoryReport) -> list[str]:
    return [entry.op for entry in report.unsupported if entry.op.startswith("torch.compile")]


def _recompute_all_but_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    """Selective activation checkpointing's policy, as trainers write it: save the
    matrix products, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """``block`` under ``torch.utils.checkpoint`` inside its own forward (``selective``:
    with the policy above), compiled with it."""

    def __init__(self, block: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.block = block
        self.selective = selective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        if not self.selective:
            return checkpoint(self.block, x, use_reentrant=False)
        contexts = functools.partial(create_selective_checkpoint_contexts, _recompute_all_but_matmuls)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=contexts)


def _blocks(
    model: nn.Sequential,
    *,
    compiled: bool,
    checkpointed: bool = False,
    inside: str | None = None,
    **options: object,
) -> None:
    """Each block checkpointed around (``checkpoint_wrapper``) or inside (``"full"``,
    ``"selective"``), then compiled with ``options``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, block in enumerate(model):
        if checkpointed:
            block = checkpoint_wrapper(block)
        if inside is not None:
            block = Checkpointed(block, selective=inside == "selective")
        if compiled:
            block = torch.compile(block, **options)
        model[index] = block


def _ddp(model: nn.Sequential, mesh: object, compiled: bool = True) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _blocks(model, compiled=compiled)
    return DDP(model)


def _fsdp(
    model: nn.Sequential, mesh: object, compiled: bool = True, reshard: bool = True, **blocks: object
) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    _blocks(model, compiled=compiled, **blocks)
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def _tp(model: nn.Sequential, mesh: object, compiled: bool = True) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    _blocks(model, compiled=compiled)
    return model


#: Each rank's parallelization, its blocks compiled (and the same, eager: ``compiled=False``).
CASES = {
    "DDP": _ddp,
    "FSDP2": _fsdp,
    "FSDP2 kept gathered": functools.partial(_fsdp, reshard=False),
    "FSDP2 checkpointed": functools.partial(_fsdp, checkpointed=True),
    "FSDP2 checkpointed inside": functools.partial(_fsdp, inside="full"),
    "FSDP2 selective checkpointing": functools.partial(_fsdp, inside="selective"),
    "FSDP2 fullgraph": functools.partial(_fsdp, fullgraph=True),
    "FSDP2 dynamic=False": functools.partial(_fsdp, dynamic=False),
    "FSDP2 max-autotune-no-cudagraphs": functools.partial(_fsdp, mode="max-autotune-no-cudagraphs"),
    "TP": _tp,
}
#: The README run's share; the others run in CI's exhaustive run.
QUICK = ("DDP", "FSDP2 checkpointed", "TP")


def _cases(quick: tuple[str, ...] = QUICK) -> list[object]:
    return [
        pytest.param(name, marks=() if name in quick else pytest.mark.exhaustive, id=name) for name in CASES
    ]


def _parallel(name: str, compiled: bool = True) -> tm.Parallel:
    return tm.Parallel({"tp" if name == "TP" else "dp": 2}, functools.partial(CASES[name], compiled=compiled))


@follows_compiled
@pytest.mark.parametrize("name", _cases())
def test_blocks_compiled_inside_apply_are_followed_and_equal_measure(name: str) -> None:
    model, x = _model(), _input()
    before = fingerprint(model, x)
    estimated = tm.estimate(model, x, optimizer=_adamw, parallel=_parallel(name))
    # (a real run that differs holds a collective's buffer past it: gloo's thread let go late)
    measured = _a_real_run_equal_to(estimated, lambda: tm.measure(model, x, optimizer=_adamw, parallel=_parallel(name)))
    eager = tm.estimate(model, x, optimizer=_adamw, parallel=_parallel(name, compiled=False))
    assert _compiled_entries(estimated) == [] and measured.unsupported == ()
    assert estimated.forward_peak != eager.forward_peak  # (the real run ran the compiled program)
    assert fingerprint(model, x) == before


@follows_compiled
@pytest.mark.exhaustive
def test_a_compiled_tensor_parallel_rank_measures_the_estimate_every_run() -> None:
    """Inductor's program hands its all-reduce a view of the buffer made for the call,
    and waits on another view: ``measure`` waits for gloo's thread to let go of the
    first, so the buffer dies where the program drops it, seen, in every real run
    (before, about one real run in three counted it, freed unseen on gloo's thread,
    to the end of the step: 32,768 B high)."""
    model, x = _model(), _input()
    estimated = tm.estimate(model, x, optimizer=_adamw, parallel=_parallel("TP"))
    runs = [_peaks(tm.measure(model, x, optimizer=_adamw, parallel=_parallel("TP"))) for _ in range(4)]
    assert runs == [_peaks(estimated)] * 4


@follows_compiled
@pytest.mark.parametrize("name", _cases(quick=("FSDP2", "DDP")))
def test_blocks_compiled_inside_apply_are_followed_on_cuda(name: str) -> None:
    """No GPU to measure: followed (no ``torch.compile`` entry), and what the compiled
    program holds at its peak differs from what the eager one holds, as on cpu (on a
    GPU this small model's peaks are cuBLAS's workspaces, and under tensor parallel the
    compiled forward's peak is the eager one's: the activation inductor fuses away is
    the size of the copy its functional all-reduce makes)."""
    model, x = _model(), _input()
    compiled = tm.estimate(model, x, device="cuda", optimizer=_adamw, parallel=_parallel(name))
    eager = tm.estimate(model, x, device="cuda", optimizer=_adamw, parallel=_parallel(name, compiled=False))
    # (on a GPU inductor times its Triton templates against ATen's kernels: what it would
    # choose is listed, as for any compiled model on cuda)
    autotuned = ["torch.compile on cuda: max-autotune"] if "max-autotune" in name else []
    assert _compiled_entries(compiled) == autotuned
    assert compiled.breakdown != eager.breakdown


def _pipeline_stage(
    model: nn.Sequential,
    mesh: object,
    compiled: bool = True,
    compiled_stages: tuple[int, ...] | None = None,
    **options: object,
) -> object:
    """The rank's stage of the pipeline (its block), compiled with ``options`` (on the
    stages of ``compiled_stages`` only, where given)."""
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"]  # type: ignore[index]
    stage, stages = pp.get_local_rank(), pp.size()
    kept = nn.Sequential(model[stage])
    _blocks(kept, compiled=compiled and (compiled_stages is None or stage in compiled_stages), **options)
    device = torch.device("cuda" if mesh.device_type == "meta" else "cpu")  # type: ignore[attr-defined]
    return PipelineStage(kept, stage, stages, device, group=pp.get_group())


def _pipeline(apply: object = _pipeline_stage, rank: int = 0) -> tm.Parallel:
    from torch.distributed.pipelining import ScheduleGPipe

    return tm.Parallel(mesh={"pp": 2}, apply=apply, rank=rank, schedule=ScheduleGPipe, microbatches=2)


@follows_compiled
@pytest.mark.parametrize("compiled_stages", [(0, 1), (0,), (1,)], ids=["both stages", "the first", "the last"])
def test_a_pipelines_compiled_blocks_are_followed_and_equal_measure(compiled_stages: tuple[int, ...]) -> None:
    """A pipeline's ranks are traced on threads of one process. Where a stage's forward
    meets a compiled block it could follow, the whole pipeline is traced again,
    following: the ranks run a warm-up step together (their layers entered in stage
    order, as for the traced step), which builds each stage's programs. Each rank's
    figures are ``measure(parallel=...)``'s, byte for byte, which runs the compiled
    program after a warm-up step on real gloo ranks (all of them warmed up where any
    stage compiles: a rank that ran one step less would leave its peers waiting); a stage
    that compiles nothing keeps its eager figures, and the whole pipeline traced
    (``every_rank``) gives each rank's own."""
    model, x = _model(), _input()
    before = fingerprint(model, x)
    compiled = _pipeline(functools.partial(_pipeline_stage, compiled_stages=compiled_stages))
    eager = _pipeline(functools.partial(_pipeline_stage, compiled=False))
    every = {figures.rank: figures.report for figures in tm.every_rank(model, x, optimizer=_adamw, parallel=compiled)}
    for rank in (0, 1):
        estimated = tm.estimate(model, x, optimizer=_adamw, parallel=dataclasses.replace(compiled, rank=rank))
        measured = tm.measure(model, x, optimizer=_adamw, parallel=dataclasses.replace(compiled, rank=rank))
        eagerly = tm.estimate(model, x, optimizer=_adamw, parallel=dataclasses.replace(eager, rank=rank))
        assert estimated.unsupported == () and measured.unsupported == ()
        assert every_peak(estimated) == every_peak(measured), rank
        assert every[rank] == estimated
        # (inductor fuses the norm and the GELU: the compiled forward is lower)
        assert (estimated.forward_peak < eagerly.forward_peak) == (rank in compiled_stages), rank
    assert fingerprint(model, x) == before


def _sharded_pipeline_stage(model: nn.Sequential, mesh: object, compiled: bool = True) -> object:
    """torchtitan's order on a pipeline's rank: the stage's block compiled, then sharded
    with FSDP2 over "dp", in a stage over "pp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"]  # type: ignore[index]
    kept = nn.Sequential(model[pp.get_local_rank()])
    _blocks(kept, compiled=compiled)
    fully_shard(kept[0], mesh=mesh["dp"])  # type: ignore[index]
    fully_shard(kept, mesh=mesh["dp"])  # type: ignore[index]
    return PipelineStage(kept, pp.get_local_rank(), pp.size(), torch.device("cpu"), group=pp.get_group())


@follows_compiled
def test_a_sharded_pipelines_compiled_blocks_are_followed_and_equal_measure() -> None:
    """pp=2 × dp=2, each stage's block compiled and sharded with FSDP2: the last stage's
    rank's figures are ``measure(parallel=...)``'s, and differ from the eager program's."""
    from torch.distributed.pipelining import Schedule1F1B

    model, x = _model(), _input()
    compiled, eager = (
        tm.Parallel(mesh={"pp": 2, "dp": 2}, apply=apply, rank=3, schedule=Schedule1F1B, microbatches=2)
        for apply in (_sharded_pipeline_stage, functools.partial(_sharded_pipeline_stage, compiled=False))
    )
    estimated = tm.estimate(model, x, optimizer=_adamw, parallel=compiled)
    measured = tm.measure(model, x, optimizer=_adamw, parallel=compiled)
    assert estimated.unsupported == () and measured.unsupported == ()
    assert every_peak(estimated) == every_peak(measured)
    assert every_peak(estimated) != every_peak(tm.estimate(model, x, optimizer=_adamw, parallel=eager))


def _two_stages_per_rank(model: nn.Sequential, mesh: object, compiled: bool = True) -> list[object]:
    """Stages ``rank`` and ``rank + 2`` of four (looped, as interleaved schedules place
    them), each a block of its own, compiled."""
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"]  # type: ignore[index]
    rank, ranks = pp.get_local_rank(), pp.size()
    stages = []
    for index in (rank, rank + ranks):
        kept = nn.Sequential(model[index])
        _blocks(kept, compiled=compiled)
        stages.append(PipelineStage(kept, index, 2 * ranks, torch.device("cpu"), group=pp.get_group()))
    return stages


@follows_compiled
@pytest.mark.exhaustive
def test_an_interleaved_pipelines_compiled_blocks_are_followed_and_equal_measure() -> None:
    """Two stages per rank (``ScheduleInterleaved1F1B``, four stages, four micro-batches),
    every stage's block compiled: each rank's figures are ``measure(parallel=...)``'s
    and differ from the eager program's."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    torch.manual_seed(0)
    model, x = nn.Sequential(*(Block() for _ in range(4))), _input()
    before = fingerprint(model, x)
    for rank in (0, 1):
        compiled, eager = (
            tm.Parallel(mesh={"pp": 2}, apply=apply, rank=rank, schedule=ScheduleInterleaved1F1B, microbatches=4)
            for apply in (_two_stages_per_rank, functools.partial(_two_stages_per_rank, compiled=False))
        )
        estimated = tm.estimate(model, x, optimizer=_adamw, parallel=compiled)
        measured = _a_real_run_equal_to(estimated, lambda: tm.measure(model, x, optimizer=_adamw, parallel=compiled))
        assert estimated.unsupported == () and measured.unsupported == ()
        assert every_peak(estimated) != every_peak(tm.estimate(model, x, optimizer=_adamw, parallel=eager)), rank
    assert fingerprint(model, x) == before


@follows_compiled
def test_a_pipelines_compiled_blocks_are_followed_on_cuda() -> None:
    """On the fake cuda device each rank follows inductor's cuda program of its stage's
    block: nothing is listed (but what any parallel run on cuda lists), and its figures
    differ from the eager program's (a figure equal to it would be the eager program's)."""
    model, x = _model(), _input()
    eager = _pipeline(functools.partial(_pipeline_stage, compiled=False))
    every = {
        figures.rank: figures.report
        for figures in tm.every_rank(model, x, device="cuda", optimizer=_adamw, parallel=_pipeline())
    }
    for rank in (0, 1):
        estimated = tm.estimate(model, x, device="cuda", optimizer=_adamw, parallel=_pipeline(rank=rank))
        eagerly = tm.estimate(
            model, x, device="cuda", optimizer=_adamw, parallel=dataclasses.replace(eager, rank=rank)
        )
        assert _compiled_entries(estimated) == []
        assert [entry.op for entry in estimated.unsupported] == [entry.op for entry in eagerly.unsupported]
        # (the forward's peak: lower than the eager one on 2.13; on 2.15, where a cuBLAS
        # call takes a workspace of its own, higher: the compiled forward holds one there)
        assert every_peak(estimated) != every_peak(eagerly)
        assert every[rank] == estimated


@follows_pipelining
@pytest.mark.parametrize("compiled_stage", [0, 1])
def test_each_pipeline_stage_lists_its_own_compiled_blocks(compiled_stage: int) -> None:
    """The stages of a pipeline are traced on threads of one process, each inside its own
    watch of compiled regions: a block one stage compiles and the trace cannot follow (a
    backend other than inductor's) is listed in that rank's report, never in another's.
    (Before, the watch entered last took every thread's regions: with the first stage
    compiled, its rank's eager figures were given with nothing listed, and the other rank
    listed a block it does not have.)"""
    model, x = _model(), _input()
    before = fingerprint(model, x)
    parallel = _pipeline(functools.partial(_pipeline_stage, compiled_stages=(compiled_stage,), backend="aot_eager"))
    # every rank traced together (the whole pipeline), and each rank alone (its peers
    # traced through their set-up only)
    every = tm.every_rank(model, x, optimizer=_adamw, parallel=parallel)
    together = {figures.rank: _compiled_entries(figures.report) for figures in every}
    alone = {
        rank: _compiled_entries(
            tm.estimate(model, x, optimizer=_adamw, parallel=dataclasses.replace(parallel, rank=rank))
        )
        for rank in (0, 1)
    }
    expected = {rank: ["torch.compile: Block.forward"] if rank == compiled_stage else [] for rank in (0, 1)}
    assert together == expected
    assert alone == expected
    assert fingerprint(model, x) == before


def test_blocks_compiled_inside_apply_are_listed_where_torch_cannot_follow_them() -> None:
    """On torch 2.10 to 2.12 (no dynamo cache regions of our own) no compiled region is
    followed: each block runs eagerly, listed, in the estimate and in ``measure``; from
    2.13 both follow them (above)."""
    from pytest_torchmem.engine.tracing.compiled import following_blocked

    model, x = _model(), _input()
    estimated = tm.estimate(model, x, optimizer=_adamw, parallel=_parallel("FSDP2"))
    eager = tm.estimate(model, x, optimizer=_adamw, parallel=_parallel("FSDP2", compiled=False))
    if following_blocked() is None:
        assert _compiled_entries(estimated) == [] and _peaks(estimated) != _peaks(eager)
        return
    assert _compiled_entries(estimated) == ["torch.compile: Block.forward"]
    assert _peaks(estimated) == _peaks(eager)
    measured = tm.measure(model, x, optimizer=_adamw, parallel=_parallel("FSDP2"))
    assert [entry.op for entry in measured.unsupported] == ["torch.compile: Block.forward"]


class _Scaled(nn.Module):
    """A block no other test compiles (its kernels are new to every process)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * 7.25 - x.square()


def _compiled_replicas(model: nn.Module, mesh: object) -> nn.Module:
    return torch.compile(model)


@follows_compiled
def test_ranks_compile_new_kernels_after_their_parent_compiled_with_its_thread_pool(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent that compiled a C++ kernel with inductor's pool of compile threads forks
    ranks that inherit the executor without its threads: a rank's first new kernel
    waited for it forever (CI: each such rank killed after ``TIMEOUT``). A fresh cache
    directory makes every kernel new."""
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(3, 24)
    before = fingerprint(model, x)
    with config.patch(compile_threads=2):
        torch.compile(lambda a: torch.cos(a) * 3.5 + a)(torch.randn(5))  # (the parent's pool)
        measured = tm.measure(model, x, parallel=tm.Parallel({"dp": 2}, _compiled_replicas))
    assert measured.unsupported == ()  # (a region whose compiled code did not run is listed)
    assert fingerprint(model, x) == before
