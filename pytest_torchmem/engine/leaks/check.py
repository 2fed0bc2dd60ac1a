"""A leak check: a step run again and again, the memory it holds after each iteration, and what grows.

:func:`leaks` runs a step (the built-in one, or a step function: called again on
the same objects, as a loop calls it) for several iterations, traced on fake
tensors (or, with ``measure=True``, for real), and reads what is live after
each one. The growth of the first iterations is what they make once and keep
(an optimizer's state, a scaler's scale, a lazy module, a cache that fills);
from the iteration on which the growth no longer changes (the steady state) it
is the step's growth per iteration: 0, or a leak. With no ``iterations`` given,
the step runs 4 times (the third and fourth iterations' growths decide the
steady state), and 8 where that is not enough. In the trace, what the last
iterations leave behind is explained (:mod:`.holders`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile
from pytest_torchmem.engine.leaks.report import LeakReport, LeakSource
from pytest_torchmem.engine.torch_compat.torch_release import require_supported_torch

if TYPE_CHECKING:
    from pytest_torchmem.engine.step.request import StepRequest
    from pytest_torchmem.engine.tracing.devices import DeviceModel
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile
    from pytest_torchmem.engine.tracing.tracker import Tracker

__all__ = ["leak_check", "leaks", "steady_state"]

#: The iterations a leak check runs unless told: the fewest that show a steady state
#: (two iterations past the first whose growths agree), then, where they do not, more.
DEFAULT_ITERATIONS: Final = (4, 8)


def leaks(
    model: Any,
    inputs: Any,
    *,
    device: str = "cpu",
    iterations: int | None = None,
    measure: bool = False,
    loss_fn: Any = None,
    optimizer: Any = None,
    train: bool = True,
    keep_output: bool = False,
    gpu: str | GpuProfile | None = None,
    cpu: str | CpuProfile | None = None,
) -> LeakReport:
    """Run a step ``iterations`` times (as :func:`~pytest_torchmem.estimate` runs one) and
    report the memory it holds after each, its growth per iteration in the steady state,
    and what holds the growth (see the module).

    ``model`` is a model (its built-in step: forward, loss, backward and, with
    ``optimizer``, the optimizer's step, each iteration) or a step function, called
    ``iterations`` times on ``inputs`` (the same objects each time: what one call keeps
    in them, the next finds there); ``iterations`` at least 3 (None: 4, then 8 where
    that shows no steady state). ``measure=True`` runs it for real instead (on cpu the
    profiler's allocator events, on cuda ``torch.cuda``'s statistics), on copies.
    """
    require_supported_torch()
    from pytest_torchmem.engine.step.request import step_request

    if iterations is not None and (not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 3):
        raise ValueError(
            f"iterations must be an int of at least 3 (the first iteration makes what it makes "
            f"once; two more show whether the growth is steady), got {iterations!r}"
        )
    request = step_request("leaks", model, inputs, device, loss_fn, optimizer, train, keep_output)
    if measure and (gpu is not None or cpu is not None):
        raise ValueError("leaks(measure=True) measures this machine: gpu= and cpu= apply to the estimate only")
    if not measure:
        from pytest_torchmem.engine.api import with_profiles

        request = with_profiles(request, gpu, cpu)
    return leak_check(request, iterations, measure=measure)


def leak_check(request: StepRequest, iterations: int | None = None, *, measure: bool = False) -> LeakReport:
    """:func:`leaks` of a request made (the plugin's checks make theirs): estimated on its
    device, following the profile it holds, or (``measure``) measured on this machine."""
    counts = (iterations,) if iterations is not None else DEFAULT_ITERATIONS
    report: LeakReport | None = None
    for count in counts:
        repeated = dataclasses.replace(request, repeat=count)
        report = _measured(repeated) if measure else _estimated(repeated)
        if report.steady_from is not None:
            break
    assert report is not None
    return report


def steady_state(baseline: int, held: tuple[int, ...]) -> tuple[int | None, int]:
    """``(steady_from, per_iteration)``: the first iteration (from 2) from which every
    iteration's growth is the same, at least the last two, and that growth; ``(None,
    last growth)`` where the last two differ."""
    growth = [after - before for before, after in zip((baseline, *held[:-1]), held)]
    if len(growth) < 3 or growth[-1] != growth[-2]:
        return None, growth[-1] if growth else 0
    first = len(growth) - 1
    while first > 1 and growth[first - 1] == growth[-1]:
        first -= 1
    return first + 1, growth[-1]


def _estimated(request: StepRequest) -> LeakReport:
    from pytest_torchmem.engine.tracing.devices import device_model
    from pytest_torchmem.engine.tracing.trace import trace_request

    device = device_model(request.device.kind)
    explained = _Explainer(request, device)
    traced = trace_request(request, record_frames=True, repeat=request.repeat, at_iteration_end=explained)
    return _report(
        request,
        list(traced.analysis.marks),
        traced.analysis.baseline,
        traced.report.profile,
        explained.sources,
        traced.report.unsupported,
        measured=False,
        replayed=traced.report.replayed,
    )


def _measured(request: StepRequest) -> LeakReport:
    from pytest_torchmem.engine.measuring.runs import measure_held

    marks, baseline, profile = measure_held(request)
    return _report(request, marks, baseline, profile, (), (), measured=True)


def _report(
    request: StepRequest,
    marks: list[tuple[int, int, int | None]],
    baseline: int,
    profile: str | None,
    sources: tuple[LeakSource, ...],
    unsupported: tuple[Any, ...],
    *,
    measured: bool,
    replayed: tuple[str, ...] = (),
) -> LeakReport:
    held = tuple(live for _, live, _ in marks)
    steady_from, per_iteration = steady_state(baseline, held)
    reserved = tuple(r for _, _, r in marks if r is not None)
    reserved_growth = None
    if request.device.is_cuda and len(reserved) >= 2:
        reserved_growth = reserved[-1] - reserved[-2]
    return LeakReport(
        device=request.device.kind,
        iterations=len(held),
        baseline=baseline,
        held=held,
        steady_from=steady_from,
        per_iteration=per_iteration,
        sources=sources if per_iteration > 0 else (),
        reserved=reserved,
        reserved_per_iteration=reserved_growth,
        profile=profile,
        unsupported=unsupported,
        measured=measured,
        replayed=replayed,
    )


class _Explainer:
    """Told the end of each iteration of the trace: notes where each iteration's storages
    begin, and at the last one explains what the one before it left behind."""

    def __init__(self, request: StepRequest, device: DeviceModel) -> None:
        self.device = device
        self.last = request.repeat or 1
        self.firsts: list[int] = []
        self.sources: tuple[LeakSource, ...] = ()
        self.paths, self.roots = _builtin_names(request)

    def __call__(self, iteration: int, tracker: Tracker) -> None:
        from pytest_torchmem.engine.leaks.holders import explain
        from pytest_torchmem.engine.user.journal import active

        self.firsts.append(len(tracker.timeline.storages))
        if iteration != self.last or len(self.firsts) < 3:
            return
        # made in the iteration before the last (it began where the one before it ended),
        # still live now: what a steady leak leaves behind every iteration
        begin, end = self.firsts[-3], self.firsts[-2]
        live = [sid for sid in tracker.live_since(begin) if sid < end]
        journal = active()
        paths = journal.paths if journal is not None else self.paths
        roots = list(journal.held_now()) if journal is not None else self.roots()
        allocator = self.device.allocator(tracker.context) if self.device.allocator is not None else None
        size = allocator.round_size if allocator is not None else int
        self.sources = tuple(explain(tracker.timeline, live, tracker.ledger.storage, paths, roots, size))


def _builtin_names(request: StepRequest) -> tuple[dict[int, str], Callable[[], list[tuple[str, Any]]]]:
    """For the built-in step: the model's modules by name (where a module keeps what grows),
    and what their attributes hold (the roots of graphs)."""
    from torch import nn

    model = request.model
    model = getattr(model, "_orig_mod", model)  # (a compiled model's names are its module's)
    modules = list(model.named_modules()) if isinstance(model, nn.Module) else []
    paths = {}
    for name, module in modules:
        paths.setdefault(id(module), name or "model")
        paths.setdefault(id(module.__dict__), name or "model")

    def roots() -> list[tuple[str, Any]]:
        return [
            (f"{name or 'model'}.{key}", value)
            for name, module in modules
            for key, value in list(vars(module).items())
            if not key.startswith("_")
        ]

    return paths, roots
