"""Real runs: the memory one step really takes, on the CPU, on a GPU, or on each rank of a parallel run.

``measure(device="cpu")`` runs the step under ``torch.profiler`` with
``profile_memory=True`` and reads every allocation and free of the CPU
allocator from its event tree: the step marks its phases, module entries and
exits and roles, and :mod:`~pytest_torchmem.engine.measuring.profiler_events` turns the
events into the same :class:`~pytest_torchmem.engine.figures.timeline.Timeline` the fake
trace writes, read by the same :func:`~pytest_torchmem.engine.figures.timeline.analyze`.

``measure(device="cuda")`` reads ``torch.cuda``'s peak statistics, reset at
each phase boundary.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.measuring.cpu_profiler import allocator_events
from pytest_torchmem.engine.user.layouts import parts
from pytest_torchmem.engine.step.holdings import converted, holdings_of, lend
from pytest_torchmem.engine.user.model_state import Converted, HookError, StandIns, hook_failure
from pytest_torchmem.engine.parallel.real_ranks import FreedOnThisThread, collectives_completed_here
from pytest_torchmem.engine.step.nesting import one_step
from pytest_torchmem.engine.parallel.mesh import applied, entered_per_iteration, local_tensors, model_copy
from pytest_torchmem.engine.figures.report import Category, MemoryReport, StepPeaks, Unsupported, worst_first
from pytest_torchmem.engine.step.step_function import StepFunction
from pytest_torchmem.engine.step.built_in import ModuleTracker, NoModules, QuietProbe, run_step
from pytest_torchmem.engine.measuring.profiler_events import MarkingProbe, read_events
from pytest_torchmem.engine.figures.timeline import Phase, StorageInfo, Timeline, analyze
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.compiled import (
    CacheRegions,
    isolating,
    measured_eager_reason,
    region_of,
    watch_compiled,
)
from pytest_torchmem.engine.tracing.devices.cpu.profiles import host_profile
from pytest_torchmem.engine.tracing.imports import imports_outside_the_step

from pytest_torchmem.engine.step.request import has_compiled_modules

if TYPE_CHECKING:
    from pytest_torchmem.engine.parallel.mesh import Parallel
    from pytest_torchmem.engine.step.request import StepRequest

__all__ = ["measure_held", "measure_step"]

#: The profiler's name for a region of code compiled by dynamo.
_COMPILED_REGION: Final = "Torch-Compiled Region"
#: Why measure's own dynamo cache entries are invalidated when it returns.
_MEASURED_REGION: Final = "pytest-torchmem: compiled for one measurement"


def _copies(device: torch.device) -> StandIns:
    """Stand-ins that are real copies on ``device``, made before the profiler starts."""

    def real(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            raise ValueError(
                "measure() runs the step for real, but the model or inputs hold meta "
                "tensors; use estimate() for a model built on the meta device"
            )
        return t

    def dense(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(real(t))

    def storage(t: torch.Tensor) -> torch.UntypedStorage:
        source = real(t).untyped_storage()
        copy = torch.empty(source.nbytes(), dtype=torch.uint8, device=device).untyped_storage()
        copy.copy_(source)
        return copy

    return StandIns(device, dense, storage)


def measure_step(request: StepRequest) -> MemoryReport:
    """Run ``request``'s step for real on its device and report its memory.

    A model with compiled regions (compiled modules, compiled functions called
    in ``forward``, a compiled optimizer step) is measured on cpu in its steady
    state: one warm-up step, which compiles, outside the measurement, then the
    measured step (from fresh copies of the model's tensors: the optimizer's
    first step), without per-module hooks, which would make dynamo fall back
    to eager code (``modules`` is then empty). Compiled functions are found
    when the step calls them: the step is then measured again, after a
    warm-up. A compiled optimizer step compiles in the measured step all the
    same (its optimizer is new there, and dynamo compiles a step per
    optimizer): what dynamo allocates and frees while it compiles is not
    counted, what it makes and leaves (the optimizer's state) is. A compiled
    region that did not run as compiled code in the measured step (any
    compiled region on cuda) is listed in ``unsupported``. A measurement started
    inside the step of another (or of an estimate) is refused
    (:class:`~pytest_torchmem.engine.step.nesting.NestedStepError`).
    """
    with one_step("tm.measure()"):
        return _measured(request)


def _measured(request: StepRequest) -> MemoryReport:
    """The report of :func:`measure_step`."""
    # the step draws from the process's generators (dropout, a data loader's seed): they
    # are the user's, and are as they were after (the estimate draws from copies)
    devices = [torch.cuda.current_device()] if request.device.is_cuda and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        if request.parallel is not None:
            return _measure_ranks(request)  # (each rank watches its own compiled regions)
        if request.device.is_cuda:
            return _measured_cuda(request)
        return _measured_cpu(request)


def _measured_cuda(request: StepRequest) -> MemoryReport:
    """The report of one step on the GPU; every compiled region it entered is listed
    (the steady state of compiled code is measured on the CPU only)."""
    seen = _Seen()
    hooks: list[Unsupported] = []
    with CacheRegions(_MEASURED_REGION) as cache, watch_compiled(seen.noted, _isolated(seen, cache)):
        report = _measure_cuda(request, _noting(hooks))
    return _listing(report, [*hooks, *seen.regions])


def _measured_cpu(request: StepRequest, mesh: Any = None) -> MemoryReport:
    """The report of one step on the CPU (under ``request.parallel``: this rank's, on its
    ``mesh``), compiled regions in their steady state: where the step meets one before
    its optimizer step and no warm-up ran, it is measured again after one, in a cache
    region of its own (the optimizer steps compiled there stay apart); a region whose
    compiled code did not run in the measured step is listed."""
    seen = _Seen()
    hooks: list[Unsupported] = []
    hook_failed = _noting(hooks)
    with CacheRegions(_MEASURED_REGION) as cache, watch_compiled(seen.noted, _isolated(seen, cache)):
        warm = has_compiled_modules(request.model)
        measured: tuple[MemoryReport, bool] | None
        try:
            measured = _measure_cpu(request, hook_failed, mesh, warm=warm, seen=seen)
        except _CompiledByApply:
            measured = None
        if measured is None:
            # (every rank's apply compiles alike: all of them start again, warmed up; outside
            # the handler, so that nothing compiled then carries its exception as context)
            warm = True
            measured = _measure_cpu(request, hook_failed, mesh, warm=warm, seen=seen)
        report, compiled_ran = measured
        if seen.before_step and not warm:
            seen.regions.clear()
            hooks.clear()
            cache.new()
            report, compiled_ran = _measure_cpu(request, hook_failed, mesh, warm=True, seen=seen)
    return _listing(report, [*hooks, *(() if compiled_ran else seen.regions)])


def _on_any_stage(parallel: Parallel, compiled: bool) -> bool:
    """Whether ``apply`` compiled modules on this rank, or, in a pipeline (whose ranks'
    stages differ: one may compile its blocks, another not), on any rank: every rank
    then starts again warmed up, so that all run the same steps (a rank that ran one step
    less would leave its peers waiting for the messages of the last)."""
    if not parallel.pipelined:
        return compiled  # (every rank's apply compiles alike)
    import torch.distributed as dist

    flag = torch.tensor([int(compiled)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class _CompiledByApply(Exception):
    """``parallel.apply`` compiled modules of the rank's model, and the measurement was not
    warmed up: it starts again after a warm-up step (the measured step's per-module hooks
    would break the compiled regions' graphs, or fail them under activation checkpointing)."""


def _noting(hooks: list[Unsupported]) -> HookError:
    """A hook error handler that lists each failing hook once in ``hooks``."""

    def hook_failed(hook: Any, exc: Exception) -> None:
        entry = hook_failure(hook, exc)
        if entry not in hooks:
            hooks.append(entry)

    return hook_failed


def _listing(report: MemoryReport, flagged: list[Unsupported]) -> MemoryReport:
    """``report`` with ``flagged`` added to its ``unsupported`` entries."""
    if not flagged:
        return report
    return dataclasses.replace(report, unsupported=(*report.unsupported, *flagged))


def _isolated(seen: _Seen, cache: CacheRegions) -> Callable[[Any, Any], Any]:
    """The watch's redirect of a measurement: each compiled region runs compiled in the
    measurement's cache region (``cache.current``), noted in ``seen``."""

    def isolated(callback: Any, wrapper_frame: Any) -> Any:
        if not isolating():
            # no cache region of our own (before torch 2.13): compiled here, the region would
            # add to the user's own cache; it runs eagerly, listed (the watch notes it)
            return None
        set_eval_frame_isolate_recompiles_id = private(
            "torch._C._dynamo.eval_frame.set_eval_frame_isolate_recompiles_id"
        )
        seen.noted(*region_of(wrapper_frame))
        # compile_wrapper set the user's region and puts back the one before it on exit
        set_eval_frame_isolate_recompiles_id(cache.current)
        return callback

    return isolated


def measure_held(request: StepRequest) -> tuple[list[tuple[int, int, int | None]], int, str | None]:
    """A repeated step (``request.repeat``) run for real: ``(iteration, live bytes, reserved
    bytes or None)`` as each iteration ends, the bytes live as the step starts, and the
    machine measured (a leak check's counterpart of the trace)."""
    devices = [torch.cuda.current_device()] if request.device.is_cuda and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        if request.device.is_cuda:
            held: list[tuple[int, int]] = []
            report = _measure_cuda(request, held=held)
            (_, base), *ends = held
            return [(i, a, r) for i, (a, r) in enumerate(ends, 1)], base, report.profile
        _, timeline, baseline = profile_cpu_step(request)
    base = sum(timeline.storages[sid].nbytes for sid in baseline)
    return list(analyze(timeline, baseline).marks), base, _host_profile_name()


@dataclass
class _Seen:
    """The compiled regions a measurement entered (as ``unsupported`` entries, should
    their compiled code not run), and whether one was entered before the optimizer step
    (compiled there, inside the measured step, unless a warm-up step compiled it)."""

    regions: list[Unsupported] = field(default_factory=list)
    before_step: bool = False
    #: the phase of the step being run (told by its probe)
    phase: Phase | None = None

    def noted(self, name: str, location: str) -> None:
        entry = Unsupported(f"torch.compile: {name}", measured_eager_reason(), location)
        if entry not in self.regions:
            self.regions.append(entry)
        if self.phase != Phase.STEP:
            self.before_step = True


def _host_profile_name() -> str | None:
    """This host's CPU profile (``"avx2:2"``), or None where it is no level the
    rules model (a non-x86 CPU, ATen and oneDNN capped to different levels)."""
    try:
        return str(host_profile())
    except ValueError:
        return None


def _measure_cpu(
    request: StepRequest,
    on_hook_error: HookError | None = None,
    mesh: Any = None,
    *,
    warm: bool | None = None,
    seen: _Seen | None = None,
) -> tuple[MemoryReport, bool]:
    """The report, and whether compiled code ran in the measured step (``warm``, ``seen``:
    see :func:`profile_cpu_step`)."""
    profile = _host_profile_name()
    prof, timeline, baseline = profile_cpu_step(request, on_hook_error, mesh, warm=warm, seen=seen)
    analysis = analyze(timeline, baseline)
    if isinstance(request.model, StepFunction):
        analysis = analysis.over_the_call()
    forward, backward, step = analysis.phase_peaks
    return MemoryReport(
        device="cpu",
        forward_peak=forward,
        backward_peak=backward,
        step_peak=step,
        breakdown=analysis.breakdown,
        modules=analysis.modules,
        profile=profile,
        first_step=None if analysis.first_step is None else StepPeaks(*analysis.first_step),
        phases=analysis.named,
        iterations=analysis.iterations if isinstance(request.model, StepFunction) else (),
    ), _ran_compiled_code(prof)


def _ran_compiled_code(prof: Any) -> bool:
    """Whether the profiled step ran code that dynamo compiled."""
    stack = list(prof.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name.startswith(_COMPILED_REGION):
            return True
        stack.extend(node.children)
    return False


def profile_cpu_step(
    request: StepRequest,
    on_hook_error: HookError | None = None,
    mesh: Any = None,
    *,
    warm: bool | None = None,
    seen: _Seen | None = None,
) -> tuple[Any, Timeline, list[int]]:
    """Run the step on the CPU under the profiler: ``(profiler, timeline, baseline sids)``.

    With ``warm`` (None: where the model has compiled modules) one warm-up step runs
    first, and the measured step has no per-module hooks (see :func:`measure_step`);
    ``seen`` is told the phase the measured step is in.
    Under ``request.parallel``, ``mesh`` is the real device mesh of this rank:
    ``apply`` runs under the profiler on a copy of the model that holds the
    copies, and what it leaves alive counts from the start of the step.
    """
    device = torch.device("cpu")
    compiled = has_compiled_modules(request.model) if warm is None else warm
    if compiled:
        _warm_up(request, device, on_hook_error, mesh)
    holdings = holdings_of(request.model, request.args, request.kwargs)
    parallel = request.parallel
    profiler = ExitStack()
    # The stand-ins are made under the profiler: the allocator then knows their sizes,
    # and a free of one in the step is seen (a sparse gradient's parts, which an
    # accumulation replaces; under parallel=, what apply replaces); what is allocated
    # before the step's first mark is not read. They are let go after it stopped (see
    # engine/measuring/cpu_profiler.py).
    prof = profiler.enter_context(allocator_events())
    with torch.no_grad():
        standins = converted(holdings, request.args, request.kwargs, _copies(device), on_hook_error)
    timeline = Timeline()
    by_ptr: dict[int, int] = {}
    baseline: list[int] = []
    for category, tensors in standins.baseline_groups():
        for t in (part for tensor in tensors if not nn.parameter.is_lazy(tensor) for part in parts(tensor)):
            storage = t.untyped_storage()
            if storage.data_ptr() in by_ptr or storage.nbytes() == 0:
                continue
            sid = timeline.new_storage(StorageInfo(storage.nbytes(), category))
            by_ptr[storage.data_ptr()] = sid
            baseline.append(sid)

    probe = MarkingProbe(seen=seen)
    step_model = request.model
    if parallel is not None:
        step_model = model_copy(request.model, holdings, standins.model)
    modules: Any = NoModules() if compiled else ModuleTracker(step_model, probe)
    timeline.module_names = modules.names
    with profiler:
        parameters = standins.parameters
        train_context = nullcontext
        if parallel is not None:
            probe.set_phase(None)  # the events of apply are read from here
            # what apply's collectives made dies on this thread, in sight (not in the step:
            # a dispatch mode there changes what the step allocates)
            with FreedOnThisThread() as frees:
                step_model = applied(parallel, step_model, mesh)
                standins.model.clear()
                compiled_here = not compiled and _on_any_stage(parallel, has_compiled_modules(step_model))
                frees.drain()
            if compiled_here:
                raise _CompiledByApply
            standins.parameters = standins.buffers = standins.attributes = []
            parameters = list(step_model.parameters())
            probe.settle()
            probe.assign_role(Category.PARAMETERS, local_tensors(parameters))
            probe.assign_role(Category.BUFFERS, local_tensors(step_model.buffers()))
            train_context = entered_per_iteration(parallel, step_model, mesh, standins.args, standins.kwargs)
        if parallel is None:
            # read from here: what the step makes before its forward (an optimizer whose
            # constructor makes its state: Adagrad's sums) counts, as the estimate counts it
            probe.set_phase(None)
        with (
            imports_outside_the_step(),
            lend(holdings, standins, compiled=compiled) if parallel is None else collectives_completed_here(),
            modules,
        ):
            _run(request, standins, probe, step_model, parameters, train_context)
        del step_model, parameters, train_context
        if parallel is not None:
            # DDP's reducer sits in reference cycles: freed here, seen freed (see _free_released)
            gc.collect()
    del standins
    read_events(prof, timeline, by_ptr, probe)
    return prof, timeline, baseline


def _run(
    request: StepRequest,
    standins: Converted,
    probe: Any,
    model: nn.Module | None = None,
    parameters: list[torch.Tensor] | None = None,
    train_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> None:
    """``request``'s step on ``standins`` (which the model holds now), told to ``probe``;
    under ``parallel=``, of ``model`` (what ``apply`` returned) and its ``parameters``,
    each iteration in ``train_context``."""
    run_step(
        request.model if model is None else model,
        standins.args,
        standins.kwargs,
        parameters=standins.parameters if parameters is None else parameters,
        inputs=standins.inputs,
        hook_optimizers=standins.hook_optimizers,
        optimizers=standins.optimizers,
        loss_fn=request.loss_fn,
        optimizer=request.optimizer,
        train=request.train,
        probe=probe,
        keep_output=request.keep_output,
        repeat=request.repeat,
        train_context=train_context,
    )


def _warm_up(
    request: StepRequest,
    device: torch.device,
    on_hook_error: HookError | None = None,
    mesh: Any = None,
) -> None:
    """One step of a compiled model on copies of its tensors, unmeasured: it compiles.

    Without the optimizer: the measured step makes a new one, and a compiled step of
    it compiles there all the same (dynamo compiles a step per optimizer). Under
    ``request.parallel``, on a copy of the model that ``apply`` parallelizes on
    ``mesh``, as the measured step's is (the blocks it compiles compile here)."""
    with torch.no_grad():
        holdings = holdings_of(request.model, request.args, request.kwargs)
        copies = converted(holdings, request.args, request.kwargs, _copies(device), on_hook_error)
    warm_up = dataclasses.replace(request, optimizer=None, repeat=None)
    parallel = request.parallel
    if parallel is None:
        with lend(holdings, copies, compiled=True):
            _run(warm_up, copies, QuietProbe())
        return
    model = applied(parallel, model_copy(request.model, holdings, copies.model), mesh)
    copies.model.clear()
    train_context = entered_per_iteration(parallel, model, mesh, copies.args, copies.kwargs)
    # (without collectives_completed_here: inductor, building the programs here, reads the
    # name of the wait it replaces)
    _run(warm_up, copies, QuietProbe(), model, list(model.parameters()), train_context)


def _measure_cuda(
    request: StepRequest, on_hook_error: HookError | None = None, held: list[tuple[int, int]] | None = None
) -> MemoryReport:
    """One step on the GPU, from a defined state.

    The state: the caching allocator holds no cached blocks
    (``empty_cache()``), no cuBLAS workspaces exist
    (``torch._C._cuda_clearCublasWorkspaces()``), then the model's tensors and
    the inputs are copied to the GPU (parameters, buffers, tensor attributes,
    inputs, then gradients, the order the estimate charges them), peaks are
    reset, and the step runs. Memory the process held before (the user's own
    tensors, anything else) is subtracted from every figure.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "measure(device='cuda') runs the step on a GPU, and torch.cuda.is_available() "
            "is False here; use estimate(device='cuda') to predict it"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    # the workspaces first: each is a block of the caching allocator, cached once
    # freed, and empty_cache() then gives its segment back (the other way round, the
    # step ran in the last measurement's workspaces' segments: on an H100, a reserved
    # peak 32 to 64 MiB low, 0 B for a small model)
    private("torch._C._cuda_clearCublasWorkspaces")()
    torch.cuda.empty_cache()
    held_allocated = torch.cuda.memory_allocated(device)
    held_reserved = torch.cuda.memory_reserved(device)
    holdings = holdings_of(request.model, request.args, request.kwargs)
    with torch.no_grad():
        standins = converted(holdings, request.args, request.kwargs, _copies(device), on_hook_error, _copies(torch.device("cpu")))
    probe = _CudaPeakProbe(device)
    modules = ModuleTracker(request.model, probe)
    torch.cuda.synchronize(device)
    if held is not None:  # (a leak check: what is live as the step starts)
        held.append((0, torch.cuda.memory_allocated(device) - held_allocated))
    torch.cuda.reset_peak_memory_stats(device)
    with imports_outside_the_step(), lend(holdings, standins), modules:
        _run(request, standins, probe)
    del standins
    if held is not None:  # (a leak check: what each iteration left, less what was held before)
        held.extend((max(a - held_allocated, 0), max(r - held_reserved, 0)) for a, r in probe.held)

    def own(nbytes: int) -> int:
        return max(nbytes - held_allocated, 0) if nbytes else 0

    forward, backward, step = (own(nbytes) for nbytes in probe.iteration_peaks(probe.iterations))
    first = None
    iterations: tuple[StepPeaks, ...] = ()
    if isinstance(request.model, StepFunction):  # its call's highest of each phase
        iterations = tuple(
            StepPeaks(*(own(nbytes) for nbytes in probe.iteration_peaks(i))) for i in range(1, probe.iterations + 1)
        )
        forward, backward, step = (
            max(getattr(it, phase) for it in iterations) for phase in ("forward", "backward", "step")
        )
    elif probe.iterations > 1:
        first = StepPeaks(*(own(nbytes) for nbytes in probe.iteration_peaks(1)))
    return MemoryReport(
        device="cuda",
        forward_peak=forward,
        backward_peak=backward,
        step_peak=step,
        reserved_peak=max(probe.reserved - held_reserved, 0),
        profile=torch.cuda.get_device_name(device),
        first_step=first,
        iterations=iterations,
    )


class _CudaPeakProbe(QuietProbe):
    """Reads and resets the CUDA peak statistics at each phase boundary (and listens
    to nothing else)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phase: tuple[Phase, int] | None = None
        #: each iteration's peak of each phase, by (phase, iteration)
        self.peaks: dict[tuple[Phase, int], int] = {}
        self.reserved = 0
        #: (allocated, reserved) as each iteration of a repeated step ends (a leak check)
        self.held: list[tuple[int, int]] = []

    def set_phase(self, phase: Phase | None, iteration: int = 1) -> None:
        torch.cuda.synchronize(self.device)
        if self.phase is not None:  # a phase met again in its iteration keeps its highest
            reading = torch.cuda.max_memory_allocated(self.device)
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), reading)
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        self.phase = None if phase is None else (phase, iteration)

    def iteration_done(self, iteration: int) -> None:
        torch.cuda.synchronize(self.device)
        self.held.append(
            (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
        )

    def iteration_peaks(self, iteration: int) -> tuple[int, int, int]:
        """The forward, backward and step peaks of one iteration of the loop."""
        return (
            self.peaks.get((Phase.FORWARD, iteration), 0),
            self.peaks.get((Phase.BACKWARD, iteration), 0),
            self.peaks.get((Phase.STEP, iteration), 0),
        )

    @property
    def iterations(self) -> int:
        return max((iteration for _, iteration in self.peaks), default=1)


def _measure_ranks(request: StepRequest) -> MemoryReport:
    """Run every rank of ``request.parallel`` as a real gloo process on this machine.

    The ranks are forked from this process (so the model, the inputs and
    ``apply`` reach them as they are, closures included; see
    :mod:`~pytest_torchmem.engine.parallel.real_ranks` for where they are spawned
    instead), meet through a file store, and each measures its own step as
    ``measure`` does; the report is the asked rank's (``"max"``: the worst,
    :func:`~pytest_torchmem.engine.figures.report.worst_first`).
    """
    from pytest_torchmem.engine.parallel.real_ranks import run_ranks

    parallel = request.parallel
    assert parallel is not None
    if not request.device.is_cpu:
        raise ValueError(
            "measure(parallel=...) runs the ranks as gloo processes on the CPU; "
            f"device={request.device.kind!r} is not supported, use device='cpu'"
        )
    reports = run_ranks(parallel, functools.partial(_rank_report, request))
    parsed = [MemoryReport.from_json(text) for text in reports]
    if parallel.rank == "max":
        return min(parsed, key=worst_first)
    return parsed[int(parallel.rank)]


def _rank_report(request: StepRequest, mesh: Any) -> str:
    """One rank's report, as JSON: its step measured on ``mesh`` as :func:`_measured_cpu`
    measures it (compiled blocks that ``apply`` made in their steady state; the hooks that
    failed listed in ``unsupported``; a module-level function: it pickles, for spawned
    ranks). Every rank meets the same compiled regions, so all of them measure again
    after a warm-up, together."""
    return _measured_cpu(request, mesh).to_json()
