"""Pipeline parallel: ``Parallel(schedule=..., microbatches=...)``, one rank of a
``torch.distributed.pipelining`` run.

The estimate traces the ranks of the rank's pipeline on threads of their own,
their sends and receives delivered (engine/tracing/pipeline_group.py): the
rank's own through the step, the others through the first step's set-up; the
ground truth is ``measure(parallel=...)``: the ranks as real gloo processes
running the same schedule. Figures are compared byte for byte, every rank,
every phase.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fingerprint import fingerprint
from test_parallel import _a_real_run_equal_to, _peaks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import PIPELINING, torch_minor

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

#: The releases whose pipelining the estimate follows; it refuses the others
#: (test_other_releases_are_refused).
FOLLOWED = PIPELINING[0] <= torch_minor() <= PIPELINING[1]
follows_pipelining = pytest.mark.skipif(not FOLLOWED, reason="the estimate follows the pipelining of torch 2.12 to 2.15")

WIDTH = 64
BATCH = 16
MICRO_BATCHES = 4


def _schedules() -> dict[str, type]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


class Layers(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def split(model: Layers, mesh: object, data_parallel: bool = False) -> object:
    """The rank's stage, as a training script builds it: its share of the layers, wrapped
    in DDP over the data-parallel dimension where there is one."""
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"]  # type: ignore[index]
    stage, stages = pp.get_local_rank(), pp.size()
    per = len(model.layers) // stages
    model.layers = nn.ModuleList(list(model.layers)[stage * per : (stage + 1) * per])
    module: nn.Module = model
    if data_parallel:
        module = DDP(model, process_group=mesh["dp"].get_group())  # type: ignore[index]
    device = torch.device("cuda" if mesh.device_type == "meta" else "cpu")  # type: ignore[attr-defined]
    return PipelineStage(module, stage, stages, device, group=pp.get_group())


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@follows_pipelining
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_two_stages_equal_real_gloo_ranks(schedule: str) -> None:
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    before = fingerprint(model, x)
    for rank in (0, 1):
        parallel = tm.Parallel(
            mesh={"pp": 2}, apply=split, rank=rank, schedule=_schedules()[schedule], microbatches=MICRO_BATCHES
        )
        estimated = tm.estimate(model, (x,), optimizer=_sgd, parallel=parallel)
        # peaks, every phase (the breakdown of a real run: see the closing note of issue 39)
        _a_real_run_equal_to(estimated, lambda: tm.measure(model, (x,), optimizer=_sgd, parallel=parallel))
    assert fingerprint(model, x) == before


class _Counted(nn.Module):
    """A stage's module that counts its forwards, by stage index."""

    calls: dict[int, int] = {}

    def __init__(self, module: nn.Module, stage: int) -> None:
        super().__init__()
        self.module, self.stage = module, stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Counted.calls[self.stage] = _Counted.calls.get(self.stage, 0) + 1
        return self.module(x)


def _counted_split(model: Layers, mesh: object) -> object:
    from torch.distributed.pipelining import PipelineStage

    stage = split(model, mesh)
    return PipelineStage(  # type: ignore[attr-defined]
        _Counted(stage.submod, stage.stage_index), stage.stage_index, stage.num_stages, stage.device, group=stage.group  # type: ignore[attr-defined]
    )


@follows_pipelining
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_rank_alone_traces_its_peers_through_their_set_up_only(device: str) -> None:
    """A rank's estimate traces its own stage through the step, and each other stage
    only as far as the first step's set-up (the metadata its neighbours need): after
    that, what a peer would send is the receive buffer's bytes. Its figures are those
    of the whole pipeline traced (every_rank traces every stage through the step)."""
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    before = fingerprint(model, x)
    parallel = functools.partial(
        tm.Parallel, mesh={"pp": 2}, apply=_counted_split, schedule=_schedules()["1F1B"], microbatches=MICRO_BATCHES
    )
    whole = {entry.rank: entry.report for entry in tm.every_rank(model, (x,), device=device, optimizer=_sgd, parallel=parallel())}
    for rank in (0, 1):
        _Counted.calls.clear()
        alone = tm.estimate(model, (x,), device=device, optimizer=_sgd, parallel=parallel(rank=rank))
        peer = 1 - rank
        # the set-up's metadata inference runs a stage's forward once; two steps, one per
        # micro-batch each, run the rank's own
        assert _Counted.calls == {rank: 1 + 2 * MICRO_BATCHES, peer: 1}, _Counted.calls
        assert alone == whole[rank]
    assert fingerprint(model, x) == before


class _Tokens(nn.Module):
    """An embedding, then a head over the sequence trimmed to its longest run of tokens
    (a value: the largest token id, as a length)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.head = nn.Embedding(32, 16), nn.Linear(16, 16)


class _Embed(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embedding(tokens), tokens


class _Trimmed(nn.Module):
    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(h[:, : int(tokens.max().item()) + 1])


def _tokens_split(model: _Tokens, mesh: object) -> object:
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"]  # type: ignore[index]
    stage = pp.get_local_rank()
    module = _Embed(model.embedding) if stage == 0 else _Trimmed(model.head)
    return PipelineStage(module, stage, 2, torch.device("cpu"), group=pp.get_group())


@follows_pipelining
def test_a_value_a_peer_sends_traces_the_whole_pipeline() -> None:
    """The last stage sizes its output by a value the first stage sends (the token ids
    it received): traced alone, its peer's bytes have no values, and the pipeline is
    traced again, every rank through the step, where the value is the one sent.
    (Traced alone, it took the length as 1: 9,288 B in forward where real ranks hold
    13,896.) torch 2.12 refuses the program, whose first stage sends a tensor that
    needs no gradient: the estimate raises its error, as the real rank does."""
    from torch.distributed.pipelining._utils import PipeliningMetadataError

    model, x = _Tokens(), torch.randint(0, 5, (8, 12))
    before = fingerprint(model, x)
    parallel = tm.Parallel(mesh={"pp": 2}, apply=_tokens_split, rank=1, schedule=_schedules()["GPipe"], microbatches=2)
    if torch_minor() < (2, 13):
        with pytest.raises(PipeliningMetadataError, match="expecting to send gradients to stage 0"):
            tm.estimate(model, (x,), optimizer=_sgd, parallel=parallel)
    else:
        estimated = tm.estimate(model, (x,), optimizer=_sgd, parallel=parallel)
        _a_real_run_equal_to(estimated, lambda: tm.measure(model, (x,), optimizer=_sgd, parallel=parallel))
    assert fingerprint(model, x) == before


def split_in_two(model: Layers, mesh: object, v_shape: bool = False) -> list[object]:
    """Two stages per rank of four, as a script of several stages per rank builds them:
    each stage a new module of its share of the layers (the model it was given is
    dropped, the layers of the other ranks' stages with it). Looped: stages ``rank``
    and ``rank + ranks``; V-shaped (zero-bubble V, DualPipeV): ``rank`` and
    ``2 ranks - 1 - rank``."""
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"]  # type: ignore[index]
    rank, ranks = pp.get_local_rank(), pp.size()
    stages, per = 2 * ranks, len(model.layers) // (2 * ranks)
    mine = (rank, 2 * ranks - 1 - rank) if v_shape else (rank, rank + ranks)
    return [
        PipelineStage(
            nn.Sequential(*[nn.Sequential(layer, nn.ReLU()) for layer in list(model.layers)[i * per : (i + 1) * per]]),
            i,
            stages,
            torch.device("cpu"),
            group=pp.get_group(),
        )
        for i in mine
    ]


@follows_pipelining
@pytest.mark.parametrize(
    "schedule",
    [
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
        "ScheduleDualPipeV",
    ],
)
def test_several_stages_per_rank_equal_real_gloo_ranks(schedule: str) -> None:
    """Schedules of two stages per rank (pp=2, four stages, eight layers, four
    micro-batches): each rank, every phase, equal to real gloo ranks; the zero-bubble
    schedules split each backward into its input's and its weights' gradients."""
    import torch.distributed.pipelining as pipelining

    made = getattr(pipelining, schedule, None)
    if made is None:
        pytest.skip(f"this torch has no {schedule}")
    model, x = Layers(8), torch.randn(BATCH, WIDTH)
    before = fingerprint(model, x)
    apply = functools.partial(split_in_two, v_shape=schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"))
    for rank in (0, 1):
        parallel = tm.Parallel(mesh={"pp": 2}, apply=apply, rank=rank, schedule=made, microbatches=MICRO_BATCHES)
        estimated = tm.estimate(model, (x,), optimizer=_sgd, parallel=parallel)
        _a_real_run_equal_to(estimated, lambda: tm.measure(model, (x,), optimizer=_sgd, parallel=parallel))
    assert fingerprint(model, x) == before


@follows_pipelining
def test_pipeline_by_data_parallel_equals_real_gloo_ranks() -> None:
    """pp=2 × dp=2, 1F1B, each stage in DDP over its data-parallel group, AdamW."""
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    before = fingerprint(model, x)
    apply = functools.partial(split, data_parallel=True)
    for rank in range(4):
        parallel = tm.Parallel(
            mesh={"pp": 2, "dp": 2}, apply=apply, rank=rank, schedule=_schedules()["1F1B"], microbatches=4
        )
        adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
        estimated = tm.estimate(model, (x,), optimizer=adamw, parallel=parallel)
        _a_real_run_equal_to(estimated, lambda: tm.measure(model, (x,), optimizer=adamw, parallel=parallel))
        # DDP's one "module in forward" (ranks' forwards interleave on threads): as it was,
        # else every later torch.compile splits its graphs for a rank's fake DDP module
        assert DDP._get_active_ddp_module() is None
    assert fingerprint(model, x) == before


@follows_pipelining
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_1f1b_holds_fewer_micro_batches_than_gpipe(device: str) -> None:
    """By hand: stage 0 of two, four micro-batches of 4 × 64 fp32. Each of its two layers
    keeps its ReLU's output (1,024 B) for backward until the micro-batch's backward: GPipe
    runs all four forwards first, 1F1B two (the stages' count less the rank) before its
    first backward, so the first stage's forward peak is 2 × 2 × 1,024 B lower; on cuda
    each 1,024 B is a 1,024 B block of the caching allocator (a multiple of 512)."""
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    peaks = {
        name: tm.estimate(
            model,
            (x,),
            device=device,
            optimizer=_sgd,
            parallel=tm.Parallel(mesh={"pp": 2}, apply=split, rank=0, schedule=schedule, microbatches=4),
        ).forward_peak
        for name, schedule in _schedules().items()
    }
    assert peaks["GPipe"] - peaks["1F1B"] == (4 - 2) * 2 * 1024


@follows_pipelining
def test_the_stages_worlds_leave_the_processs_excepthook() -> None:
    """Each stage's fake world (a thread each) replaces ``sys.excepthook``, in any order;
    the estimate puts the process's own back."""
    hook = sys.excepthook
    parallel = tm.Parallel(mesh={"pp": 2}, apply=split, rank=0, schedule=_schedules()["1F1B"], microbatches=4)
    tm.estimate(Layers(), (torch.randn(BATCH, WIDTH),), optimizer=_sgd, parallel=parallel)
    assert sys.excepthook is hook


@follows_pipelining
def test_a_1f1b_stage_on_cuda_by_hand() -> None:
    """Rank 0 of two under 1F1B, four micro-batches of 4 × 64 fp32, on the fake H100, its
    forward peak (the loop's second iteration) block by block: micro-batches 0 and 1 are
    in flight (1F1B runs stages - rank = 2 forwards before its first backward), each
    holding its two ReLU outputs for backward, and the peak comes as micro-batch 1's
    second ReLU is made, before its layer's addmm output is freed. Every tensor of
    1,024 B is a 1,024 B block (a multiple of 512), a bias of 256 B one of 512 B."""
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    parallel = tm.Parallel(mesh={"pp": 2}, apply=split, rank=0, schedule=_schedules()["1F1B"], microbatches=4)
    report = tm.estimate(model, (x,), device="cuda", optimizer=_sgd, parallel=parallel)
    block = 1024  # one micro-batch's activation: 4 × 64 fp32
    parameters = 2 * (WIDTH * WIDTH * 4 + 512)  # the stage's two layers
    batch = BATCH * WIDTH * 4  # the batch the schedule splits (its micro-batches are views)
    if torch_minor() < (2, 15):
        # cuBLAS's workspace (torch's default on sm90: 4,096 KiB × 8), one per handle (the
        # forward's thread, autograd's device thread), each cached from the first iteration;
        # cuBLASLt's addmm runs in it (unified workspaces)
        workspaces = 2 * 8 * 4096 * 1024
        # the stage's buffers for the gradients stage 1 sends, one per micro-batch, made
        # when the stage is set up
        grad_receives = 4 * block
    else:
        # 2.15 caches no cuBLAS workspace (TORCH_CUBLAS_WORKSPACE_CACHE unset: each call
        # takes its own and gives it back) and keeps cuBLASLt's apart: the forward thread's
        # addmm holds its 1,024 KiB; a gradient's buffer is made when it is received
        workspaces = 1024 * 1024
        grad_receives = 0
    micro_batch_0 = 2 * block  # its two ReLU outputs
    micro_batch_1 = 2 * block + block  # its two ReLU outputs, and layer 1's addmm output
    assert report.forward_peak == parameters + batch + workspaces + grad_receives + micro_batch_0 + micro_batch_1


@follows_pipelining
def test_every_stage_on_the_fake_cuda_device() -> None:
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    before = fingerprint(model, x)
    reports = [
        tm.estimate(
            model,
            (x,),
            device="cuda",
            optimizer=_sgd,
            parallel=tm.Parallel(
                mesh={"pp": 2, "dp": 2},
                apply=functools.partial(split, data_parallel=True),
                rank=rank,
                schedule=_schedules()["1F1B"],
                microbatches=4,
            ),
        )
        for rank in range(4)
    ]
    # ranks that differ only by their data-parallel coordinate hold the same
    assert _peaks(reports[0]) == _peaks(reports[1])
    assert _peaks(reports[2]) == _peaks(reports[3])
    assert fingerprint(model, x) == before


def _three_dimensional(model: Layers, mesh: object) -> object:
    """torchtitan's 3-D rank: the stage's layers tensor-parallel over "tp" (column-wise),
    sharded with FSDP2 over "dp", in a pipeline stage over "pp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    pp = mesh["pp"]  # type: ignore[index]
    stage, stages = pp.get_local_rank(), pp.size()
    model.layers = nn.ModuleList(list(model.layers)[stage * 2 : stage * 2 + 2])
    parallelize_module(model, mesh["tp"], {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})  # type: ignore[index]
    fully_shard(model, mesh=mesh["dp"])  # type: ignore[index]
    return PipelineStage(model, stage, stages, torch.device("cpu"), group=pp.get_group())


class _Pairs(Layers):
    """Layers whose ReLU sits between a column- and a row-wise pair (as a tensor-parallel
    MLP has it): the pair's inner activation is sharded, its output whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for first, second in zip(self.layers[::2], self.layers[1::2], strict=True):
            x = x + second(torch.relu(first(x)))
        return x


@follows_pipelining
@pytest.mark.parametrize("rank", [0, 3])
def test_pipeline_by_fsdp_by_tensor_parallel_equals_gloo_ranks(rank: int) -> None:
    """pp=2 × dp=1 × tp=2: FSDP2 of tensor-parallel parameters makes a mesh of its own
    (the meshes concatenated) from the mesh's integer tensors, bookkeeping that was held
    as 256 B of buffers. The first step's forward equals a real run's (gloo's
    threads may hold a buffer a little longer in it too, never less: the estimate is the
    lowest any run shows, as for FSDP2 in test_parallel)."""
    model, x = _Pairs(), torch.randn(BATCH, WIDTH)
    parallel = tm.Parallel(
        mesh={"pp": 2, "dp": 1, "tp": 2}, apply=_three_dimensional, rank=rank, schedule=_schedules()["1F1B"], microbatches=4
    )
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    estimated = tm.estimate(model, (x,), optimizer=adamw, parallel=parallel)
    assert estimated.breakdown[tm.Category.BUFFERS] == 0 and estimated.first_step is not None
    real = _first_forwards_in_a_fresh_process(rank, estimated.first_step.forward)
    assert all(one >= estimated.first_step.forward for one in real), real
    assert real[-1] == estimated.first_step.forward, real


def _first_forwards_in_a_fresh_process(rank: int, estimated: int, runs: int = 4) -> list[int]:
    """The first forward of up to ``runs`` real runs of the 3-D rank, until one equals
    ``estimated``: measured by an interpreter of its own (tensor parallel's functional
    collectives in ranks forked from a test process that made other process groups
    before could not resolve their group by name)."""
    code = f"""
import functools, json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import torch
import pytest_torchmem as tm
from test_pipeline import BATCH, WIDTH, _Pairs, _schedules, _three_dimensional

parallel = tm.Parallel(mesh={{"pp": 2, "dp": 1, "tp": 2}}, apply=_three_dimensional, rank={rank},
                       schedule=_schedules()["1F1B"], microbatches=4)
real = []
for _ in range({runs}):
    measured = tm.measure(_Pairs(), (torch.randn(BATCH, WIDTH),), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), parallel=parallel)
    real.append(measured.first_step.forward)
    if real[-1] == {estimated}:
        break
print(json.dumps(real))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@follows_pipelining
def test_a_rank_is_estimated_the_same_in_every_run() -> None:
    """The ranks' threads interleave differently from run to run, and a rank's figures do
    not follow: what a rank sends leaves its trace as it is sent (its copy, in the mailbox
    until the receiving thread takes it, was charged to the sender, first step 1,024 B
    higher in about one run in six)."""
    model, x = Layers(), torch.randn(BATCH, WIDTH)
    parallel = tm.Parallel(
        mesh={"pp": 2}, apply=split, rank=0, schedule=_schedules()["1F1B"], microbatches=MICRO_BATCHES
    )
    reports = [tm.estimate(model, (x,), optimizer=_sgd, parallel=parallel) for _ in range(8)]
    assert all(report == reports[0] for report in reports)
    assert sum(reports[0].breakdown.values()) == reports[0].peak


# -- what is refused, in one line ----------------------------------------------------


def test_a_schedule_must_be_a_pipelining_schedule_class() -> None:
    with pytest.raises(TypeError, match="schedule class of torch.distributed.pipelining"):
        tm.Parallel(mesh={"pp": 2}, apply=split, schedule="1F1B", microbatches=4)


def test_a_schedule_needs_its_micro_batches() -> None:
    with pytest.raises(ValueError, match="needs microbatches="):
        tm.Parallel(mesh={"pp": 2}, apply=split, schedule=_schedules()["GPipe"])
    with pytest.raises(ValueError, match="pass the schedule too"):
        tm.Parallel(mesh={"pp": 2}, apply=split, microbatches=4)


def test_the_mesh_needs_a_pipeline_dimension() -> None:
    with pytest.raises(ValueError, match="no pipeline dimension 'pp'"):
        tm.Parallel(mesh={"dp": 2}, apply=split, schedule=_schedules()["GPipe"], microbatches=4)


@follows_pipelining
def test_apply_must_return_a_stage() -> None:
    parallel = tm.Parallel(
        mesh={"pp": 2}, apply=lambda model, mesh: model, schedule=_schedules()["GPipe"], microbatches=4
    )
    with pytest.raises(TypeError, match="must return the rank's pipeline stage"):
        tm.estimate(Layers(), (torch.randn(BATCH, WIDTH),), optimizer=_sgd, parallel=parallel)


def test_ranks_that_wait_for_each_other_are_reported() -> None:
    """Two ranks each receive before they send: the group says so instead of hanging."""
    import threading

    from pytest_torchmem.engine.tracing.pipeline_group import PipelineDeadlock, PipelineGroup, PipelinePeerFailed

    group = PipelineGroup([0, 1])
    raised: list[BaseException] = []

    def rank(me: int) -> None:
        try:
            group.take(1 - me, me)
        except (PipelineDeadlock, PipelinePeerFailed) as exc:
            raised.append(exc)
        finally:
            group.finished()

    threads = [threading.Thread(target=rank, args=(me,)) for me in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(raised) == 2
    assert any(isinstance(exc, PipelineDeadlock) and "a message from rank" in str(exc) for exc in raised)


@follows_pipelining
def test_the_stages_threads_trace_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline's ranks are traced on threads of one process, one thread at a time (run
    side by side, each op handed the interpreter's lock to another thread): no two of
    them are inside an op's dispatch at once, and the figures are those of the rank
    traced alone."""
    import threading

    from pytest_torchmem.engine.tracing.tracker import Tracker

    dispatch = Tracker.__torch_dispatch__
    lock, inside, most = threading.Lock(), set(), [0]
    local = threading.local()

    def counted(self: Tracker, func: object, types: object, args: object = (), kwargs: object = None) -> object:
        depth = getattr(local, "depth", 0)
        if depth == 0:
            with lock:
                inside.add(threading.get_ident())
                most[0] = max(most[0], len(inside))
        local.depth = depth + 1
        try:
            return dispatch(self, func, types, args, kwargs)
        finally:
            local.depth = depth
            if depth == 0:
                with lock:
                    inside.discard(threading.get_ident())

    model, x = Layers(), torch.randn(BATCH, WIDTH)
    parallel = functools.partial(
        tm.Parallel, mesh={"pp": 4}, apply=split, schedule=_schedules()["1F1B"], microbatches=8
    )
    before = fingerprint(model, x)
    alone = tm.estimate(model, (x,), device="cuda", optimizer=_sgd, parallel=parallel(rank=2))
    monkeypatch.setattr(Tracker, "__torch_dispatch__", counted)
    figures = tm.every_rank(model, (x,), device="cuda", optimizer=_sgd, parallel=parallel())
    assert most[0] == 1
    assert [entry.report for entry in figures if 2 in entry.ranks] == [alone]
    assert fingerprint(model, x) == before


@pytest.mark.skipif(FOLLOWED, reason="this release's pipelining is followed")
def test_other_releases_are_refused() -> None:
    parallel = tm.Parallel(mesh={"pp": 2}, apply=split, schedule=_schedules()["GPipe"], microbatches=4)
    with pytest.raises(NotImplementedError, match="follows the pipelining of torch 2.12 to 2.15"):
        tm.estimate(Layers(), (torch.randn(BATCH, WIDTH),), optimizer=_sgd, parallel=parallel)
