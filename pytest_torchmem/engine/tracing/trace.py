"""One step of a model on fake tensors, read into a :class:`MemoryReport`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.step.holdings import converted, holdings_of
from pytest_torchmem.engine.user.layouts import sparse_like
from pytest_torchmem.engine.user.model_state import Converted, StandIns, hook_failure
from pytest_torchmem.engine.step.nesting import one_step
from pytest_torchmem.engine.tracing.collector import older_objects_frozen
from pytest_torchmem.engine.parallel.mesh import (
    Parallel,
    applied,
    entered_per_iteration,
    excepthook_kept,
    local_tensors,
    model_copy,
)
from pytest_torchmem.engine.parallel.pipeline import Pipelined
from pytest_torchmem.engine.figures.report import Category, MemoryReport, StepPeaks, Unsupported
from pytest_torchmem.engine.step.built_in import (
    LossFn,
    ModuleTracker,
    NoModules,
    OptimizerFactory,
    QuietProbe,
    module_names,
    run_step,
)
from pytest_torchmem.engine.step.step_function import StepFunction
from pytest_torchmem.engine.figures.stopped import TraceStopped
from pytest_torchmem.engine.figures.timeline import CATEGORY_RANK, Analysis, Phase, Timeline, analyze, highest
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.block_replay import BlockReplay, BlockReplayMiss
from pytest_torchmem.engine.tracing.compiled_program import (
    CompiledCodeMet,
    CompiledModules,
    Following,
    compiled_modules,
    following_compiled,
)
from pytest_torchmem.engine.tracing.devices import DeviceModel
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile
from pytest_torchmem.engine.tracing.compiled_blocks import WarmUpCompiles, replayable_blocks
from pytest_torchmem.engine.tracing.compiled_cuda import CudaProgram
from pytest_torchmem.engine.tracing.devices.cuda.memory_stats import MemorySoFar
from pytest_torchmem.engine.tracing.devices.cuda.profiles import DEFAULT_GPU, PROFILES, GpuProfile
from pytest_torchmem.engine.tracing.fake_limits import first_line
from pytest_torchmem.engine.tracing.layers import FAKE_WORLD, WARM_UP_LAYERS, Scene, entered
from pytest_torchmem.engine.tracing.replay import LoopReplay, replay_enabled
from pytest_torchmem.engine.tracing.rules import TraceContext
from pytest_torchmem.engine.tracing.stops import Stop
from pytest_torchmem.engine.tracing.tracker import Tracker
from pytest_torchmem.engine.tracing.warm_up_runs import warmed_up

if TYPE_CHECKING:
    from pytest_torchmem.engine.step.request import StepRequest

__all__ = ["Trace", "adopt", "fake_empty", "fake_standins", "trace", "trace_ranks", "trace_request", "trace_request_ranks"]

# torch's private names (engine/torch_compat/torch_private.py)
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
FakeTensorMode: Final = private("torch._subclasses.fake_tensor.FakeTensorMode")
no_dispatch: Final = private("torch.utils._mode_utils.no_dispatch")
_get_current_dispatch_mode_stack: Final = private(
    "torch.utils._python_dispatch._get_current_dispatch_mode_stack"
)
_len_torch_function_stack: Final = private("torch._C._len_torch_function_stack")
_get_function_stack_at: Final = private("torch._C._get_function_stack_at")
_pop_torch_function_stack: Final = private("torch._C._pop_torch_function_stack")
_push_on_torch_function_stack: Final = private("torch._C._push_on_torch_function_stack")


@dataclass(frozen=True)
class Trace:
    """One traced step: its report, and the timeline the report was read from."""

    report: MemoryReport
    timeline: Timeline
    #: Storages live before the step (their sids), each once.
    baseline: list[int]
    analysis: Analysis
    device: DeviceModel
    context: TraceContext
    #: What stopped the trace, if it stopped (:func:`trace` then raises): the report is
    #: of the part of the step that ran.
    stop: Stop | None = None
    #: How many ops needed tensor values the trace did not know.
    values_missed: int = 0


def trace(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    device: DeviceModel,
    loss_fn: LossFn | None,
    optimizer: OptimizerFactory | None,
    train: bool,
    keep_output: bool = False,
    gpu: GpuProfile | None = None,
    cpu: CpuProfile | None = None,
    record_frames: bool = False,
    parallel: Parallel | None = None,
    rank: int = 0,
    repeat: int | None = None,
    at_iteration_end: Callable[[int, Tracker], None] | None = None,
    peers: dict[int, Trace] | None = None,
) -> Trace:
    """Trace one step of ``model`` on fake tensors of ``device``: its report and timeline.

    ``gpu`` is the GPU profile the CUDA rules follow (ignored on cpu), ``cpu``
    the CPU profile the CPU rules follow (ignored on cuda; ``None`` there: the
    CPU rules ask the host); ``record_frames`` keeps the user's frames of every
    allocation; ``keep_output`` holds the model's output to the end of the step.
    ``parallel``: the step of rank ``rank`` of that mesh, over a fake process
    group; ``parallel.apply`` runs on a copy of the model holding the stand-ins.

    The compiled regions of the step are followed (their compiled programs run):
    compiled modules are found before the step; a compiled function (or optimizer
    step) is found when the step calls it, and then the step is traced again,
    following it: after a warm-up step that compiles what runs before the optimizer
    step, as for compiled modules; a compiled optimizer step alone is compiled where
    it runs (its optimizer is new in each step).

    A trace that stops raises :class:`~pytest_torchmem.engine.figures.stopped.TraceStopped`,
    with the partial report and this trace; the program's own errors propagate as
    they are. A trace started inside the step of another (or of a measurement) is
    refused (:class:`~pytest_torchmem.engine.step.nesting.NestedStepError`).
    """
    with one_step("tm.estimate()"), excepthook_kept(), older_objects_frozen():
        traced = _traced(
            model,
            args,
            kwargs,
            device=device,
            loss_fn=loss_fn,
            optimizer=optimizer,
            train=train,
            keep_output=keep_output,
            gpu=gpu,
            cpu=cpu,
            record_frames=record_frames,
            parallel=parallel,
            rank=rank,
            repeat=repeat,
            at_iteration_end=at_iteration_end,
            peers=peers,
        )
    if traced.stop is not None:
        stop = traced.stop
        raise TraceStopped(traced.report, stop.entry, stop.advice, trace=traced)
    return traced


def trace_ranks(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, parallel: Parallel, ranks: Sequence[int], **options: Any
) -> dict[int, Trace]:
    """:func:`trace` of each of ``ranks`` of ``parallel`` (``options`` as :func:`trace`
    takes them), by rank: a pipeline's ranks are traced together, once per pipeline, and
    the other stages of a pipeline traced for one of ``ranks`` come with it. A trace that
    stops raises :class:`~pytest_torchmem.engine.figures.stopped.TraceStopped` (the lowest such
    rank's)."""
    traces: dict[int, Trace] = {}
    for rank in ranks:
        if rank not in traces:
            peers: dict[int, Trace] = {}
            traces[rank] = trace(model, args, kwargs, parallel=parallel, rank=rank, peers=peers, **options)
            for peer, traced in sorted(peers.items()):
                if traced.stop is not None:
                    stop = traced.stop
                    raise TraceStopped(traced.report, stop.entry, stop.advice, trace=traced)
                traces.setdefault(peer, traced)
    return traces


def _traced(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    device: DeviceModel,
    loss_fn: LossFn | None,
    optimizer: OptimizerFactory | None,
    train: bool,
    keep_output: bool,
    gpu: GpuProfile | None,
    cpu: CpuProfile | None,
    record_frames: bool,
    parallel: Parallel | None,
    rank: int,
    repeat: int | None = None,
    at_iteration_end: Callable[[int, Tracker], None] | None = None,
    peers: dict[int, Trace] | None = None,
) -> Trace:
    """The trace of :func:`trace`, stopped or not; ``peers`` gets the traces of the
    other ranks of a pipeline, traced with it."""
    from pytest_torchmem.engine.parallel.real_ranks import settle_autograd_threads

    settle_autograd_threads()  # before the first fake mode: measure(parallel=...)'s ranks fork
    # the options of every trace of the step, whichever way it is traced
    options: dict[str, Any] = dict(
        device=device,
        loss_fn=loss_fn,
        optimizer=optimizer,
        train=train,
        keep_output=keep_output,
        gpu=gpu,
        cpu=cpu,
        record_frames=record_frames,
        repeat=repeat,
        at_iteration_end=at_iteration_end,
    )
    if parallel is not None and parallel.pipelined:
        # a rank alone: its peers are traced through their stages' set-up only, and the
        # pipeline again, every rank through the step, where a receive from one of them
        # needed more than its bytes (a value the trace did not know, an object)
        whole = peers is not None

        def pipeline(whole: bool, follow: bool = False, gives_up: bool = True) -> dict[int, Trace] | None:
            how = dict(whole=whole, follow=follow, gives_up=gives_up)
            try:
                return _traced_pipeline(model, args, kwargs, parallel, rank, **how, **options)
            except BlockReplayMiss as miss:
                # a replayed block could not stand for its trace after all (a micro-batch's
                # backward found its parameters holding an earlier one's gradients): the
                # pipeline traced again, every block
                return _traced_pipeline(model, args, kwargs, parallel, rank, blocks_missed=str(miss), **how, **options)

        try:
            group = pipeline(whole)
            if group is None:
                group = pipeline(True)
        except CompiledCodeMet:
            # a stage's forward met a compiled block it could follow: the whole pipeline is
            # traced again, following, every rank through a warm-up step first (where that
            # fails, the blocks run eagerly, listed)
            try:
                group = pipeline(True, follow=True)
            except Exception:
                group = pipeline(True, gives_up=False)
        assert group is not None
        if peers is not None:
            peers.update(group)
        return group[rank]
    # compiled modules run inductor's program (on cuda: built by inductor's cuda backend);
    # so do the compiled functions the step calls (on cuda those of its forward), compiled
    # optimizer steps, and under parallel= the blocks apply compiles (the rank's model is
    # made by apply: its compiled regions are found as the step meets them)
    found = compiled_modules(model) if parallel is None else CompiledModules()

    def once(follow: bool, warm: bool, gives_up: bool = False) -> tuple[Trace | None, Phase | None]:
        try:
            try:
                return _trace(
                    model, args, kwargs, found=found, follow=follow, warm=warm, parallel=parallel, rank=rank,
                    gives_up=gives_up, **options,
                )
            except BlockReplayMiss as miss:
                # a replayed block could not stand for its trace after all: traced again, every block
                return _trace(
                    model, args, kwargs, found=found, follow=follow, warm=warm, parallel=parallel, rank=rank,
                    blocks_missed=str(miss), gives_up=gives_up, **options,
                )
        except CompiledCodeMet as met:
            return None, met.phase

    # (a trace that does not follow gives up where its forward meets a compiled function it
    # could follow: the step is traced again, following, from the start)
    traced, met = once(follow=bool(found), warm=bool(found), gives_up=not found)
    if not found and met is not None:
        traced, _ = once(follow=True, warm=met != Phase.STEP)
    assert traced is not None
    return traced


def _traced_pipeline(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    parallel: Parallel,
    rank: int,
    *,
    whole: bool,
    follow: bool = False,
    gives_up: bool = False,
    **options: Any,
) -> dict[int, Trace] | None:
    """The traces of the ranks of ``rank``'s pipeline, each traced on a thread of its own
    (pipeline_group.py), by rank: every rank's (``whole``), or ``rank``'s alone, its peers
    traced through their set-up only (None where a receive from one of them needed more
    than its bytes). ``follow``: each rank follows the compiled blocks its stage runs,
    built in a warm-up step the ranks run together first; ``gives_up``: a trace that does
    not follow raises :class:`CompiledCodeMet` where it meets one it could follow."""
    from pytest_torchmem.engine.parallel import threads
    from pytest_torchmem.engine.tracing.pipeline_group import (
        PeerGone,
        PipelineGroup,
        PipelinePeerFailed,
        SetUpOnly,
    )

    from pytest_torchmem.engine.torch_compat.torch_release import PIPELINING, torch_minor

    if not PIPELINING[0] <= torch_minor() <= PIPELINING[1]:
        raise NotImplementedError(
            "estimate(parallel=Parallel(schedule=...)) follows the pipelining of torch 2.12 to "
            "2.15 (2.10 and 2.11 keep their process groups where a pipeline's threads cannot "
            "have worlds of their own); measure(parallel=...) runs it on real gloo ranks"
        )
    if parallel.train_context is not None:
        raise NotImplementedError(
            "estimate(parallel=Parallel(schedule=..., train_context=...)) is not followed yet: a "
            "pipeline's ranks are traced on threads of one process, and a train context such "
            "as context_parallel() patches torch for the whole process while it lasts; "
            "measure(parallel=...) runs it on real gloo ranks"
        )
    ranks = parallel.pipeline_peers(rank)
    group = PipelineGroup(ranks, traced=None if whole else [rank])
    traces: dict[int, Trace] = {}
    failures: dict[int, BaseException] = {}

    def run(index: int, peer: int) -> None:
        try:
            with group.running(), one_step("tm.estimate()"):
                traced, _ = _trace(
                    model,
                    args,
                    kwargs,
                    found=CompiledModules(),
                    follow=follow,
                    warm=follow,
                    parallel=parallel,
                    rank=peer,
                    turn=lambda layers: group.layered(index, layers),
                    gives_up=gives_up and not follow,
                    **options,
                )
            traces[peer] = traced
        except SetUpOnly:
            pass
        except BaseException as exc:  # noqa: BLE001 (handed to the calling thread)
            failures[peer] = exc
            group.fail(exc)
        finally:
            group.finished()

    with group.delivering():
        started = [
            threads.start(run, index, peer, name=f"torchmem-pipeline-rank-{peer}") for index, peer in enumerate(ranks)
        ]
        for thread in started:
            thread.join()
    if not whole and (isinstance(group.failed, PeerGone) or (group.answered and _unsure(traces.get(rank)))):
        return None
    if failures:
        first = group.failed
        failure = failures.get(rank)
        raise (first if failure is None or isinstance(failure, PipelinePeerFailed) else failure) or failure
    return traces


def _inner_miss(exc: BaseException) -> BlockReplayMiss | None:
    """The :class:`BlockReplayMiss` ``exc`` was raised from or during, if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, BlockReplayMiss):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _unsure(traced: Trace | None) -> bool:
    """Whether ``traced`` needed a tensor's value it did not know (perhaps one a rank
    traced no further sent as bytes of unknown values)."""
    return traced is not None and traced.values_missed > 0


def trace_request(request: StepRequest, **options: Any) -> Trace:
    """:func:`trace` of ``request``'s step on its device, following the profile its device
    holds, of its rank where it holds a parallel run (:attr:`StepRequest.rank`); the other
    ``options`` as :func:`trace` takes them."""
    return trace(
        request.model,
        request.args,
        request.kwargs,
        parallel=request.parallel,
        rank=request.rank,
        **_request_options(request),
        **options,
    )


def trace_request_ranks(request: StepRequest, *, ranks: Sequence[int], **options: Any) -> dict[int, Trace]:
    """:func:`trace_ranks` of ``ranks`` of ``request``'s parallel run, on its device (as
    :func:`trace_request`)."""
    assert request.parallel is not None
    return trace_ranks(
        request.model,
        request.args,
        request.kwargs,
        parallel=request.parallel,
        ranks=ranks,
        **_request_options(request),
        **options,
    )


def _request_options(request: StepRequest) -> dict[str, Any]:
    """What :func:`trace` takes of ``request``: its device model and profile (resolved by the
    entry point: :func:`~pytest_torchmem.engine.api.with_profiles`), its step's options."""
    from pytest_torchmem.engine.tracing.devices import device_model

    modelled = request.device
    if modelled.profile is None:
        raise ValueError(f"the request's {modelled.kind} device has no profile: resolve it first (with_profiles)")
    return dict(
        device=device_model(modelled.kind),
        loss_fn=request.loss_fn,
        optimizer=request.optimizer,
        train=request.train,
        keep_output=request.keep_output,
        gpu=modelled.gpu,
        cpu=modelled.cpu,
    )


def _trace(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    found: CompiledModules,
    follow: bool,
    warm: bool,
    device: DeviceModel,
    loss_fn: LossFn | None,
    optimizer: OptimizerFactory | None,
    train: bool,
    keep_output: bool,
    gpu: GpuProfile | None,
    cpu: CpuProfile | None,
    record_frames: bool,
    parallel: Parallel | None,
    rank: int,
    repeat: int | None = None,
    at_iteration_end: Callable[[int, Tracker], None] | None = None,
    turn: Callable[[Any], Any] | None = None,
    blocks_missed: str | None = None,
    gives_up: bool = False,
) -> tuple[Trace, Phase | None]:
    """One trace (see :func:`trace`); ``follow``: follow the compiled regions (``found``,
    and the compiled functions the step calls); ``warm``: build them in a warm-up step
    first (then the traced step has no per-module hooks and no router). Also returns,
    where the trace did not follow, the earliest phase in which the step called a
    compiled function it could have followed (None: none).

    The parts are made first (the stand-ins, the tracker, the router, the compiled
    programs), each given the callbacks it needs; then, inside the compiled programs,
    the warm-up step, and the traced step inside the device's layers (layers.py).

    ``blocks_missed``: why an earlier try's block replay could not stand for the trace
    (block_replay.py): this one traces every block, and says why. ``gives_up``: a trace
    that does not follow raises :class:`CompiledCodeMet` at the first op after its forward
    met a compiled function it could follow.
    """
    context = TraceContext(device.name, gpu=gpu, cpu=cpu)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    where = device.trace_device
    holdings = holdings_of(model, args, kwargs)

    # (the tracker and the compiled programs are made below, once the stand-ins are)
    def hook_failed(hook: Any, exc: Exception) -> None:
        tracker.flag(hook_failure(hook, exc))

    def prepare_optimizer(optimizer: torch.optim.Optimizer, context: TraceContext) -> None:
        following.prepare_optimizer(optimizer)

    with fake_mode:
        host = fake_standins(torch.device("cpu"), fake_mode) if not device.is_cpu else None
        standins = converted(holdings, args, kwargs, fake_standins(where, fake_mode), hook_failed, host)
    step_model = model if parallel is None else model_copy(model, holdings, standins.model)

    def new_tracker(context: TraceContext, **options: Any) -> Tracker:
        return Tracker(
            fake_mode,
            where,
            device.rules,
            context=context,
            aliases=device.aliases,
            wraps_numbers=device.wraps_numbers,
            optimizer_hook=prepare_optimizer,
            **options,
        )

    tracker = new_tracker(
        context,
        record_frames=record_frames,
        # per-module hooks would make dynamo's guards fail in the traced step: no per-module figures
        module_names=() if warm else module_names(step_model),
        # dynamo runs no compiled code while a dispatch mode that does not ignore compile
        # internals is active; the compiled regions left to dynamo in a trace that follows
        # are ours (the watch runs the others eagerly): built in the warm-up, or (a compiled
        # optimizer step, whose optimizer is new in each step) compiled in the step with
        # every mode popped
        runs_compiled_code=follow,
    )
    baseline = adopt(tracker, standins)
    tracker.at_iteration_end = at_iteration_end
    _know_values(tracker, standins)
    modules: Any = NoModules() if warm else ModuleTracker(step_model, tracker)
    # the router (a torch-function mode) picks eager kernels as this device would; a followed
    # compiled program has its kernels picked by inductor, and dynamo's cache entries guard on
    # the torch-function mode stack of the warm-up, which has none (on cuda the program is
    # entered with the router popped: see CudaProgram.around; on cpu the router steps aside
    # for a compiled optimizer step: see _Routing)
    routed = device.router is not None and (not warm or device.is_cuda)
    routing = device.router(context) if device.router is not None and routed else None
    router: Any = _Routing(routing) if routing is not None and follow and not warm else routing
    # on cuda inductor's cuda program is built (AOTAutograd under the router) and entered
    # with no torch-function mode, so the router routes the rest of the step
    cuda_build = (
        CudaProgram(gpu if gpu is not None else PROFILES[DEFAULT_GPU], where, lambda: device.router(context), tracker)
        if follow and device.is_cuda and device.router is not None
        else None
    )
    built_for = cpu if device.is_cpu else None
    program = (
        following_compiled(
            found,
            built_for,
            cuda_build,
            phase=lambda: tracker.phase,
            entering=router.step_aside if isinstance(router, _Routing) else _nothing,
            visible=lambda: _visible(fake_mode, tracker),
        )
        if follow
        else nullcontext(Following(active=False, phase=lambda: tracker.phase))
    )
    replayed: list[str] = []  # what the loop replayed, or why not (the report's)
    # what the blocks replayed, or why not (the report's, before the loop's)
    block_lines: list[str] = [] if blocks_missed is None else [f"blocks traced ({blocks_missed})"]
    replays = parallel is None and not follow and replay_enabled()
    blocks = (
        BlockReplay(tracker, step_model, block_lines, parallel=parallel is not None)
        if not follow and replay_enabled() and blocks_missed is None and not warm
        and isinstance(modules, ModuleTracker) and not isinstance(model, Pipelined)
        else None
    )
    # (following compiled code: the blocks compiled alone replay, where the warm-up found
    # each of their regions built its programs in one block's call (compiled_blocks.py),
    # and eager blocks that run neither inside compiled code nor compiled code inside them)
    replays_compiled = (
        follow and warm and parallel is None and replay_enabled() and blocks_missed is None
        and not isinstance(model, Pipelined)
    )

    def replaying(model: nn.Module, leaves: list[torch.Tensor]) -> LoopReplay:
        return LoopReplay(tracker, model, leaves, replayed)

    with program as following:
        if gives_up and not follow:

            def arm() -> None:  # (the tracker asks at each op once the forward met one)
                if following.met is Phase.FORWARD:
                    tracker.gives_up = following.give_up_if_met

            following.on_met = arm
        # the compiled programs are built in an untracked step of their own, and the traced
        # step finds them in dynamo's cache (AOTAutograd compiles a backward lazily, at its
        # first run: in the traced step it would run under the tracker)
        compiles = WarmUpCompiles(step_model, following.module_regions) if replays_compiled else None
        if warm:
            looped = optimizer is not None or bool(standins.hook_optimizers)

            def warm_up() -> None:
                following.warm_up_started()
                with compiles.counting() if compiles is not None else nullcontext():
                    _warm_up(
                        model,
                        args,
                        kwargs,
                        fake_mode,
                        where,
                        following,
                        # (a tracker of the warm-up's own, whose figures are dropped)
                        new_tracker(TraceContext(device.name, gpu=gpu, cpu=cpu), runs_compiled_code=True),
                        loss_fn=loss_fn,
                        train=train,
                        keep_output=keep_output,
                        looped=looped,
                        repeat=repeat,
                        parallel=parallel,
                        rank=rank,
                        turn=turn,
                    )

            try:
                warmed_up(warm_up)
            except Exception:
                # inductor or dynamo could not build the program (or the model failed, which
                # the traced step shows again): the modules run eagerly there, flagged
                following.abandon()
        if follow:
            following.warm_up_done()
        if compiles is not None and following.active:
            blocks = BlockReplay(
                tracker,
                step_model,
                block_lines,
                compiled=replayable_blocks(compiles, block_lines),
                program_runs=following.program_runs,
                inside_compiled=following.compiled_classes(),
                under_compiled=frozenset(
                    id(module) for compiled in found.followed for module in compiled.module.modules()
                ),
            )
        scene = Scene(
            holdings,
            standins,
            step_model,
            fake_mode,
            following,
            tracker=tracker,
            modules=modules,
            router=router,
            routing=routing,
            parallel=parallel,
            rank=rank,
            gpu=gpu,
            memory=(
                MemorySoFar(tracker.timeline, lambda: baseline, lambda: device.allocator(context), gpu)
                if gpu is not None and device.allocator is not None
                else None
            ),
            blocks=blocks,
        )
        try:
            layered = entered(device.layers, scene)
            with turn(layered) if turn is not None else layered as layers:
                parameters = standins.parameters
                train_context = nullcontext
                if parallel is not None:
                    mesh = layers[FAKE_WORLD.name]
                    step_model, parameters = _apply(tracker, parallel, step_model, mesh, standins)
                    if blocks is not None:
                        blocks.attach(step_model)  # (FSDP2's units: sharded in place)
                    scene.step_model = step_model  # (the copy apply replaced is not held)
                    baseline = _set_up(tracker)
                    train_context = entered_per_iteration(
                        parallel, step_model, mesh, standins.args, standins.kwargs
                    )
                run_step(
                    step_model,
                    standins.args,
                    standins.kwargs,
                    parameters=parameters,
                    inputs=standins.inputs,
                    hook_optimizers=standins.hook_optimizers,
                    optimizers=standins.optimizers,
                    loss_fn=loss_fn,
                    optimizer=optimizer,
                    train=train,
                    probe=tracker,
                    keep_output=keep_output,
                    repeat=repeat,
                    train_context=train_context,
                    replay=replaying if replays else None,
                )
                if blocks is not None:
                    blocks.vouch()
                del train_context
        except Exception as exc:
            if blocks is not None and blocks.replayed and not isinstance(exc, BlockReplayMiss):
                # (what stopped may have stopped because of a replay: traced again without; a
                # miss raised in a replayed backward reaches here wrapped, by autograd or by a
                # pipeline's stage)
                inner = _inner_miss(exc)
                if inner is not None:
                    raise BlockReplayMiss(str(inner)) from exc
                raise BlockReplayMiss(f"the step raised after blocks were replayed ({first_line(exc)})") from exc
            if not tracker.stopped_by(exc):
                raise  # the program's own error
            tracker.set_phase(None)
        del standins, step_model, scene
        for entry in following.not_followed():
            tracker.flag(entry)
        if cuda_build is not None and following.regions:
            for gap in cuda_build.gaps:
                tracker.flag(Unsupported(f"torch.compile on cuda: {gap.what}", gap.why))

    allocator = device.allocator(context) if device.allocator is not None else None
    analysis = analyze(tracker.timeline, baseline, allocator)
    if isinstance(model, StepFunction):
        analysis = analysis.over_the_call()
    forward, backward, step = analysis.phase_peaks
    report = MemoryReport(
        device=device.name,
        forward_peak=forward,
        backward_peak=backward,
        step_peak=step,
        breakdown=analysis.breakdown,
        reserved_peak=analysis.reserved_peak,
        modules=analysis.modules,
        unsupported=(*tracker.unsupported, *_parallel_gaps(device, parallel)),
        profile=_profile_name(device, gpu, cpu),
        first_step=None if analysis.first_step is None else StepPeaks(*analysis.first_step),
        phases=analysis.named,
        iterations=analysis.iterations if isinstance(model, StepFunction) else (),
        replayed=(*block_lines, *replayed),
        # (replays repeat the device's events only: where one replayed, the host's are unknown)
        host_peak=(
            None
            if tracker.host is None or (blocks is not None and blocks.replayed) or any(" replayed from " in line for line in replayed)
            else highest(tracker.host.timeline)
        ),
    )
    traced = Trace(report, tracker.timeline, baseline, analysis, device, context, tracker.stop, tracker.values_missed)
    return traced, following.met


def _nothing() -> None:
    return None


class _Routing:
    """The router of a step whose compiled optimizer step is followed: it steps aside
    (leaves the torch-function mode stack) before dynamo traces that code, which would
    trace the router too; the CPU router routes nothing an optimizer step calls."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.aside = False

    def __enter__(self) -> _Routing:
        self.router.__enter__()
        return self

    def step_aside(self) -> None:
        stack = _len_torch_function_stack()
        if not self.aside and stack and _get_function_stack_at(stack - 1) is self.router:
            _pop_torch_function_stack()
            self.aside = True

    def __exit__(self, *exc: object) -> Any:
        if self.aside:
            _push_on_torch_function_stack(self.router)
            self.aside = False
        return self.router.__exit__(*exc)


@contextmanager
def _visible(fake_mode: FakeTensorMode, tracker: Tracker) -> Iterator[None]:
    """The trace's modes again where dynamo popped them (else nothing changes)."""
    if any(mode is tracker for mode in _get_current_dispatch_mode_stack()):
        yield
        return
    with fake_mode, tracker:
        yield


class _WarmUpProbe(QuietProbe):
    """The warm-up's probe: it keeps the phase the step is in (a compiled region is
    followed or not by the phase it is met in)."""

    phase: Phase | None = None

    def set_phase(self, phase: Phase | None, iteration: int = 1) -> None:
        self.phase = phase


def _warm_up(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fake_mode: FakeTensorMode,
    where: torch.device,
    following: Following,
    tracker: Tracker,
    *,
    loss_fn: LossFn | None,
    train: bool,
    keep_output: bool,
    looped: bool,
    repeat: int | None = None,
    parallel: Parallel | None = None,
    rank: int = 0,
    turn: Callable[[Any], Any] | None = None,
) -> None:
    """One step on fresh fake stand-ins, in which dynamo and our backend compile the
    followed modules and the compiled functions the step calls (the optimizer is left
    out: the traced step makes a new one, whose compiled step is compiled anew).
    ``looped``: the traced step runs as a training loop, and so does this one, running
    the compiled code as often; ``repeat``: as often as a leak check runs it.

    Under ``parallel``, the step runs on a copy of the model that ``apply`` parallelizes
    over the rank's fake process group, as the traced step's is: the blocks ``apply``
    compiles are built here, and the traced step's ``apply`` (another copy) finds them in
    dynamo's cache.

    The program must take the branches here that it takes in the traced step, or what is
    compiled here is not what runs there: ``tracker`` (a tracker of its own, whose figures
    are dropped) knows the values the traced step's knows, so that an op that reads them
    (a mask's ``.item()`` outside the compiled regions) runs as it does there."""
    holdings = holdings_of(model, args, kwargs)  # (the traced step's were lent there, and let go of)
    with fake_mode:
        copies = converted(holdings, args, kwargs, fake_standins(where, fake_mode))
    probe = _WarmUpProbe()
    traced_phase, following.phase = following.phase, lambda: probe.phase
    adopt(tracker, copies)
    _know_values(tracker, copies)
    step_model = model if parallel is None else model_copy(model, holdings, copies.model)
    scene = Scene(holdings, copies, step_model, fake_mode, following, tracker=tracker, parallel=parallel, rank=rank)
    try:
        layered = entered(WARM_UP_LAYERS, scene)
        # (a pipeline's ranks enter their layers in turn: ``turn``, as in the traced step)
        with turn(layered) if turn is not None else layered as layers:
            parameters = copies.parameters
            train_context = nullcontext
            if parallel is not None:
                mesh = layers[FAKE_WORLD.name]
                step_model, parameters = _apply(tracker, parallel, step_model, mesh, copies)
                train_context = entered_per_iteration(parallel, step_model, mesh, copies.args, copies.kwargs)
            run_step(
                step_model,
                copies.args,
                copies.kwargs,
                parameters=parameters,
                inputs=copies.inputs,
                loss_fn=loss_fn,
                optimizer=None,
                train=train,
                probe=probe,
                keep_output=keep_output,
                loop=looped,
                optimizers=copies.optimizers,
                repeat=repeat,
                train_context=train_context,
            )
    finally:
        following.phase = traced_phase  # (the traced step's phases again)


def _apply(
    tracker: Tracker, parallel: Parallel, model: nn.Module, mesh: Any, standins: Converted
) -> tuple[nn.Module, list[torch.Tensor]]:
    """Parallelize the model copy; what ``apply`` leaves alive joins the baseline's roles.

    The stand-ins' own references to the model's tensors are dropped, so that
    tensors ``apply`` replaces (sharded parameters) are freed as they are in a
    real run.
    """
    first = len(tracker.timeline.storages)
    parallel_model = applied(parallel, model, mesh)
    standins.model.clear()
    standins.parameters = standins.buffers = standins.attributes = []
    parameters = list(parallel_model.parameters())
    for sid in tracker.live_since(first):
        tracker.timeline.assign_role(sid, Category.GRADIENTS)
    tracker.assign_role(Category.PARAMETERS, local_tensors(parameters))
    tracker.assign_role(Category.BUFFERS, local_tensors(parallel_model.buffers()))
    return parallel_model, parameters


def _set_up(tracker: Tracker) -> list[int]:
    """The step starts here, after ``apply``: the storages alive now are its baseline,
    parameters first, then buffers, inputs, gradients (DDP's buckets), as a step
    without ``parallel=`` starts from its model's tensors.

    What ``apply`` made and freed on the way (the unsharded parameters ``fully_shard``
    copied its shards from) is not replayed: on cuda, the caching allocator starts
    empty with these storages, as in a run that builds the model on the meta device,
    shards it and then makes the shards (``to_empty``). A model moved to the GPU whole
    before ``fully_shard`` leaves its freed blocks cached too, reserved but not
    counted here.
    """
    timeline = tracker.timeline
    timeline.step_start = len(timeline.events)
    alive = tracker.live_since(0)
    return sorted(alive, key=lambda sid: (CATEGORY_RANK[timeline.category_of(sid)], sid))


#: What ``parallel=`` does not model on the fake cuda device.
NCCL_GAP: Final = Unsupported(
    "parallel= on cuda: NCCL",
    "collectives are charged as in-place kernels through the caching allocator, each "
    "allocation to the stream current when it is made (FSDP2's all-gather and "
    "reduce-scatter streams keep their cached blocks apart, as on a GPU); NCCL's own "
    "buffers, which it allocates outside the caching allocator, are not modelled",
)


def _parallel_gaps(device: DeviceModel, parallel: Parallel | None) -> tuple[Unsupported, ...]:
    return (NCCL_GAP,) if parallel is not None and device.is_cuda else ()


def _profile_name(device: DeviceModel, gpu: GpuProfile | None, cpu: CpuProfile | None) -> str | None:
    profile = gpu if device.is_cuda else cpu
    return str(profile) if profile is not None else None


def fake_standins(where: torch.device, fake_mode: FakeTensorMode) -> StandIns:
    """Fake stand-ins on ``where`` (use them with ``fake_mode`` active)."""

    def sparse(t: torch.Tensor, new_parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if t.layout is torch.sparse_coo:
            return sparse_like(t, new_parts, where)
        # fake tensors have no constructor of compressed sparse tensors: a meta one, faked,
        # holding parts of its own (a storage they share with another tensor is not shared)
        with no_dispatch():
            meta_parts = tuple(
                torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta") for p in new_parts
            )
            meta = sparse_like(t, meta_parts, torch.device("meta"))
        return FakeTensor(fake_mode, meta, where)

    return StandIns(
        where,
        dense=lambda t: fake_empty(fake_mode, t.shape, t.stride(), t.dtype, where),
        storage=lambda t: torch.empty(
            t.untyped_storage().nbytes(), dtype=torch.uint8, device=where
        ).untyped_storage(),
        parameter=_fake_parameter,
        sparse=sparse,
    )


def fake_empty(
    fake_mode: FakeTensorMode, shape: Any, stride: Any, dtype: torch.dtype, where: torch.device
) -> torch.Tensor:
    """``torch.empty_strided(shape, stride, dtype=dtype, device=where)`` under ``fake_mode``,
    made as the fake mode makes a factory's output (a meta tensor wrapped in a
    ``FakeTensor`` of ``where``) without the trip through its dispatch: a model's
    stand-ins are hundreds of them, each ~50 us that way."""
    with no_dispatch():
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, meta, where)


def _fake_parameter(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """Mark a fresh fake tensor as a parameter, as ``nn.Parameter`` does for tensor
    subclasses (``isinstance(t, nn.Parameter)`` holds), without its ``detach()``."""
    t.requires_grad_(requires_grad)
    # nn.Parameter's isinstance check reads _is_param (engine/torch_compat/torch_private.py:
    # torch.nn.parameter._ParameterMeta.__instancecheck__)
    t._is_param = True  # type: ignore[attr-defined]
    return t


def _know_values(tracker: Tracker, standins: Converted) -> None:
    """The trace knows the values of the step's tensors that :func:`_originals` lists
    (a function of its own: a list of them held while the step runs would keep the
    stand-ins the program drops alive, as FSDP2 drops the whole parameters it shards)."""
    inputs, others = _originals(standins)
    tracker.values.adopt(inputs, inputs=True)
    tracker.values.adopt(others)


def _originals(standins: Converted) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(stand-in, original)`` of the step's tensors whose values the trace may know:
    the inputs', then the others': the optimizers' one-element state (the step counts
    their Python code reads: an optimizer that stepped before the call divides by a
    function of its count), buffers, attributes, parameters, gradients and the rest of
    the optimizers' state (the shadows' room is bounded)."""
    state = dict(standins.baseline_groups())[Category.OPTIMIZER_STATE]
    others = (
        [t for t in state if t.numel() <= 1],
        standins.buffers,
        standins.attributes,
        standins.parameters,
        standins.gradients,
        [t for t in state if t.numel() > 1],
    )
    return _pairs(standins, (standins.inputs,)), _pairs(standins, others)


def _pairs(standins: Converted, groups: Sequence[Sequence[torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pairs = []
    for group in groups:
        for t in group:
            if t.layout is not torch.strided:  # a sparse tensor's values are its parts'
                pairs += standins.sparse_parts.get(id(t), ())
                continue
            original = standins.originals.get(id(t))
            if original is not None:
                pairs.append((t, original))
    return pairs


def adopt(tracker: Tracker, standins: Converted) -> list[int]:
    """Register the storages live before the step; return them, each once."""
    baseline: list[int] = []
    seen: set[int] = set()
    for category, tensors in standins.baseline_groups():
        for tensor in tensors:
            if type(tensor) is FakeTensor and tensor.fake_device != tracker.device:
                continue  # on the host (an optimizer's step count beside a GPU's parameters)
            if nn.parameter.is_lazy(tensor):
                continue  # a lazy module's: it holds nothing until the step materializes it
            for sid in tracker.adopt(tensor, category):
                if sid not in seen:
                    seen.add(sid)
                    baseline.append(sid)
    return baseline
