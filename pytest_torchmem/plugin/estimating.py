"""One check's figures on one device: its estimate, GPU measurement, room on GPUs, snapshot entry.

The device's built-in rules are copied once per set of ``pytest_torchmem_add_rules``
implementations (a ``conftest.py`` may add its own); ``pytest_torchmem_adjust_report``
may change each report, which must stay whole bytes. The tracer is imported by the
first estimate: nothing here imports torch before.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

import pytest

from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile
from pytest_torchmem.engine.figures.modelled_device import ModelledDevice
from pytest_torchmem.engine.figures.stopped import TraceStopped
from pytest_torchmem.plugin import releases
from pytest_torchmem.plugin.headroom import Room, room
from pytest_torchmem.plugin.settings import Settings, gpu_present
from pytest_torchmem.plugin.snapshots import Entry

if TYPE_CHECKING:
    from pytest_torchmem.engine.figures.report import MemoryReport
    from pytest_torchmem.engine.step.request import StepRequest
    from pytest_torchmem.engine.tracing.rules import RuleSet
    from pytest_torchmem.engine.tracing.trace import Trace

__all__ = ["DeviceFigures", "Estimator", "device_environment", "not_measured"]

def device_environment(device: ModelledDevice, keep_output: bool = False, loop: bool = False) -> dict[str, Any]:
    """What the figures on ``device`` depend on besides the model: recorded in each entry.

    The CPU rules follow the CPU profile (``device.cpu``: its full name, with cache sizes
    where they are not the level's), the CUDA rules the GPU profile (its name, and
    for a profile that is not one of the named ones its properties, ``gpu_memory``,
    ``gpu_cc``, ``gpu_sms``, ...: a line of the ini table changed since is noticed)
    and the caching allocator's configuration; both follow the torch version. An entry
    recorded where any of these differ is stale: its bytes are not compared.
    ``keep_output=True`` is recorded too (only then, so that entries made with the
    default stay as they were): an entry made with the other setting measured
    another step, and is never compared with this one. So is ``loop``: the figures are
    a training loop's (``"figures": "training loop"``), which one step's are not.
    """
    environment: dict[str, Any] = {"torch": releases.torch_version()}
    if keep_output:
        environment["keep_output"] = True
    if loop:
        environment["figures"] = "training loop"
    if device.is_cuda:
        gpu = device.gpu
        assert gpu is not None
        environment["gpu"] = gpu.name
        if not gpu.builtin:
            environment.update({f"gpu_{key}": value for key, value in gpu.properties().items()})
        alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").strip()
        if alloc_conf:  # recorded only when set, so that the default leaves no trace
            environment["cuda_alloc_conf"] = alloc_conf
    else:
        environment["cpu"] = str(device.cpu)
    return environment


@dataclass(frozen=True)
class DeviceFigures:
    """What one check found on one device."""

    #: The estimate, as the hooks adjusted it.
    report: MemoryReport
    #: The trace it was read from (for the timeline and the HTML report).
    trace: Trace
    #: The snapshot entry it makes: the figures, their environment, the GPU measurement.
    entry: Entry
    #: A cuda check's room on the GPU it follows, then on each other GPU ``fits=`` names.
    rooms: tuple[Room, ...]
    #: The trace stopped (there or on a GPU ``fits=`` names): no figures, ``report`` and
    #: ``entry`` are of the part of the step that ran, ``trace`` that part's.
    stopped: TraceStopped | None = None
    #: Why the run, which measures cuda checks on this machine's GPU, did not measure this
    #: one (:func:`not_measured`), or None.
    unmeasured: str | None = None


class Estimator:
    """The estimates of one run's checks, with the run's rules, hooks and GPU."""

    def __init__(self, settings: Settings) -> None:
        self._settings: Final = settings
        self._rules: dict[tuple[str, tuple[int, ...]], RuleSet] = {}
        self._measuring: bool | None = None

    def figures(
        self,
        item: pytest.Item,
        request: StepRequest,
        name: str,
        fits: tuple[GpuProfile, ...] | Literal[True] | None,
    ) -> DeviceFigures:
        """The figures of check ``name`` of ``item`` on the request's device: estimated,
        measured on the GPU where the run measures (but see :func:`not_measured`), and the room on
        the GPUs ``fits`` names; or, where a trace stopped, what it left
        (:attr:`DeviceFigures.stopped`), nothing measured."""
        device = request.device
        try:
            report, traced = self.estimate(item, request, name)
            rooms = self.rooms(item, request, name, report, fits)
        except TraceStopped as stop:
            environment = device_environment(device, request.keep_output)
            partial = Entry.from_report(stop.report, environment)
            return DeviceFigures(stop.report, stop.trace, partial, (), stop)
        measured = None
        unmeasured = None
        if device.is_cuda and device.gpu is not None and self.measures(device.gpu):
            unmeasured = not_measured(request)
            if unmeasured is None:
                # What measure(device="cuda") does: the step on the real GPU, from
                # the state measuring/runs.py defines (empty caches, no cuBLAS workspace).
                from pytest_torchmem.engine.measuring.runs import measure_step

                measured = measure_step(request)
        environment = device_environment(device, request.keep_output, loop=report.first_step is not None)
        entry = Entry.from_report(report, environment, measured)
        return DeviceFigures(report, traced, entry, rooms, unmeasured=unmeasured)

    def estimate(self, item: pytest.Item, request: StepRequest, name: str) -> tuple[MemoryReport, Trace]:
        """The estimate on the request's device with this run's rules, as the hooks adjust
        it, and the trace it was read from (a parallel request: of its rank; ``"max"``: the
        worst of the distinct ranks, :mod:`~pytest_torchmem.engine.every_rank`)."""
        from pytest_torchmem.engine.every_rank import TracedRank, distinct_ranks, traced_rank
        from pytest_torchmem.engine.figures.report import MemoryReport
        from pytest_torchmem.engine.tracing.devices import device_model
        from pytest_torchmem.engine.tracing.trace import Trace, trace, trace_ranks

        device = request.device
        parallel = request.parallel
        options: dict[str, Any] = dict(
            device=dataclasses.replace(device_model(device.kind), rules=self.rules(item, device.kind)),
            loss_fn=request.loss_fn,
            optimizer=request.optimizer,
            train=request.train,
            keep_output=request.keep_output,
            gpu=device.gpu,
            cpu=device.cpu,
            record_frames=self._settings.record_frames,
        )
        if parallel is not None and parallel.rank == "max":
            traces: dict[int, Trace] = {}

            def traced_ranks(ranks: Any) -> dict[int, TracedRank]:
                got = trace_ranks(request.model, request.args, request.kwargs, parallel=parallel, ranks=ranks, **options)
                traces.update(got)
                return {rank: traced_rank(one) for rank, one in got.items()}

            traced = traces[distinct_ranks(parallel, traced_ranks)[0].rank]
        else:
            traced = trace(request.model, request.args, request.kwargs, parallel=parallel, rank=request.rank, **options)
        adjusted = item.ihook.pytest_torchmem_adjust_report(
            item=item, device=device.kind, name=name, report=traced.report
        )
        if adjusted is None:
            return traced.report, traced
        if not isinstance(adjusted, MemoryReport):
            pytest.fail(
                "torchmem: pytest_torchmem_adjust_report must return a MemoryReport or None, "
                f"got {type(adjusted).__name__}",
                pytrace=False,
            )
        try:
            return _whole_bytes(adjusted), traced
        except ValueError as exc:
            pytest.fail(f"torchmem: pytest_torchmem_adjust_report returned {exc}", pytrace=False)

    def rooms(
        self,
        item: pytest.Item,
        request: StepRequest,
        name: str,
        report: MemoryReport,
        fits: tuple[GpuProfile, ...] | Literal[True] | None,
    ) -> tuple[Room, ...]:
        """A cuda check's room on the GPU it follows, then on each other GPU that ``fits=``
        names (estimated on it: its kernels and workspaces are its own)."""
        gpu = request.device.gpu
        if not request.device.is_cuda or gpu is None or report.reserved_peak is None:
            return ()
        named = () if fits is None or fits is True else fits
        rooms = [room(gpu, report.reserved_peak, required=fits is True or gpu in named)]
        for other in named:
            if other != gpu:
                on_other = dataclasses.replace(request, device=request.device.following(gpu=other))
                other_report, _ = self.estimate(item, on_other, name)
                assert other_report.reserved_peak is not None
                rooms.append(room(other, other_report.reserved_peak, required=True))
        return tuple(rooms)

    def rules(self, item: pytest.Item, device: str) -> RuleSet:
        """This run's rules for ``device`` under the ``conftest.py`` files of ``item``.

        Each distinct set of ``pytest_torchmem_add_rules`` implementations gets
        its own copy of the device's built-in rules, filled once.
        """
        hook = item.ihook.pytest_torchmem_add_rules
        cache_key = (device, tuple(id(impl.plugin) for impl in hook.get_hookimpls()))
        rules = self._rules.get(cache_key)
        if rules is None:
            from pytest_torchmem.engine.tracing.devices import device_model

            rules = device_model(device).rules.copy()
            hook(device=device, rules=rules)
            self._rules[cache_key] = rules
        return rules

    def measuring(self) -> bool:
        """Whether ``cuda`` checks also run the step on the real GPU."""
        if self._measuring is None:
            mode = self._settings.measure
            self._measuring = mode == "on" or (mode == "auto" and gpu_present())
        return self._measuring

    def measures(self, gpu: GpuProfile) -> bool:
        """Whether a ``cuda`` check that follows ``gpu`` runs its step on the real GPU:
        where :meth:`measuring`, and this machine's GPU runs kernels as ``gpu`` says
        (:meth:`GpuProfile.runs_like`). A check that follows another GPU (an L4's
        estimate on an H100 machine) is not compared with this one's measurement."""
        here = self._this_gpu if self.measuring() else None
        return here is not None and gpu.runs_like(here)

    @functools.cached_property
    def _this_gpu(self) -> GpuProfile | None:
        """This machine's GPU, or None where it has no profile (a ROCm GPU: the fake
        GPU is NVIDIA's)."""
        from pytest_torchmem.engine.figures.gpu_profiles import GpuProfileError

        try:
            return GpuProfile.from_device()
        except GpuProfileError:
            return None


def not_measured(request: StepRequest) -> str | None:
    """Why a cuda check that the run would measure on this machine's GPU is not measured
    there, or None: a parallel check is one rank of a run that this process does not start
    (``measure(parallel=...)`` runs gloo ranks on the CPU), and the step unsharded on the GPU
    is another step."""
    if request.parallel is not None:
        return (
            "a parallel= check is not measured on this machine's GPU: it is one rank of a "
            "parallel run, and the step unsharded would be another step; its estimate is "
            "compared with the snapshot and the budgets only"
        )
    return None


def _whole_bytes(report: MemoryReport) -> MemoryReport:
    """``report`` with every figure a plain ``int``; ValueError naming one that is no byte count.

    A hook may compute figures with numpy (``numpy.int64`` is taken as the
    integer it is); a float, a bool or a negative figure is refused before it
    reaches a snapshot file.
    """
    import operator

    def whole(value: Any, where: str) -> int:
        try:
            if isinstance(value, bool):
                raise TypeError
            number = operator.index(value)
        except TypeError:
            raise ValueError(
                f"a report whose {where} is {value!r} ({type(value).__name__}): figures are "
                "whole numbers of bytes; round them with int(...)"
            ) from None
        if number < 0:
            raise ValueError(f"a report whose {where} is negative ({number} B)")
        return number

    return dataclasses.replace(
        report,
        forward_peak=whole(report.forward_peak, "forward_peak"),
        backward_peak=whole(report.backward_peak, "backward_peak"),
        step_peak=whole(report.step_peak, "step_peak"),
        reserved_peak=None
        if report.reserved_peak is None
        else whole(report.reserved_peak, "reserved_peak"),
        breakdown={
            category: whole(value, f"breakdown[{str(category.value)!r}]")
            for category, value in report.breakdown.items()
        },
        modules={
            name: dataclasses.replace(
                peak,
                forward=whole(peak.forward, f"modules[{name!r}].forward"),
                backward=whole(peak.backward, f"modules[{name!r}].backward"),
            )
            for name, peak in report.modules.items()
        },
        first_step=None
        if report.first_step is None
        else dataclasses.replace(
            report.first_step,
            forward=whole(report.first_step.forward, "first_step.forward"),
            backward=whole(report.first_step.backward, "first_step.backward"),
            step=whole(report.first_step.step, "first_step.step"),
        ),
    )
