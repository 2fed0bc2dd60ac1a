"""``--torchmem-advise``: what would bring a failing check within its budget or GPU.

For a check over a ``memory_budget`` or not fitting a GPU that ``fits=`` names,
:func:`advice_lines` asks :func:`pytest_torchmem.advise` for the changes that bring
the step down, each an estimate of the changed step, and gives them as lines of the
failure message. Against a GPU the reserved peak must fit its usable memory; against
budgets, the step's peak must stay within the smallest budget it broke (a phase's
budget is then met too). The built-in step of a module only: a step function is the
user's own code, and compiled or parallel checks are advised on no changed step yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_torchmem.engine.step.request import StepRequest
    from pytest_torchmem.plugin.judging import Result

__all__ = ["advice_lines"]


def advice_lines(request: StepRequest, result: Result) -> tuple[str, ...]:
    """The failure message's lines of advice for ``result`` of ``request`` (on the device,
    following the profile, that ``result`` was estimated on), or none where it did not
    break a budget or a ``fits=`` GPU."""
    target: dict[str, Any] = {}
    unfit = [room for room in result.rooms if room.unfit]
    breaches = [breach for breach in result.breaches if breach.source == "estimate"]
    if unfit:
        assert unfit[0].profile is not None  # (a room this process made)
        target["gpu"] = unfit[0].profile
    elif breaches:
        target["budget"] = min(breach.limit for breach in breaches)
        if request.device.is_cuda:
            target["gpu"] = request.device.gpu
    else:
        return ()
    why = _not_advised(request)
    if why is not None:
        return (f"no advice (--torchmem-advise): {why}",)
    from pytest_torchmem.engine.fit.advice import advise
    from pytest_torchmem.engine.figures.stopped import TraceStopped

    options: dict[str, Any] = {
        "loss_fn": request.loss_fn,
        "optimizer": request.optimizer,
        "train": request.train,
        "keep_output": request.keep_output,
    }
    if request.device.is_cpu:
        options["cpu"] = request.device.cpu
    inputs: Any = request.kwargs if request.kwargs else request.args
    try:
        advice = advise(request.model, inputs, device=request.device.kind, **target, **options)
    except TraceStopped as stop:  # (advise traces with the built-in rules, not the conftests')
        return (f"no advice (--torchmem-advise): {stop}",)
    head = (
        f"what would bring it within {advice.target} (--torchmem-advise; each figure the "
        f"changed step's estimate, its {'reserved peak' if advice.figure == 'reserved' else 'peak'}):"
    )
    if not advice.suggestions:
        return (head, "  no change that was tried brings it down")
    return (head, *(f"  {suggestion}" for suggestion in advice.suggestions))


def _not_advised(request: StepRequest) -> str | None:
    """Why the check's step cannot be advised on, or None."""
    from torch import nn

    from pytest_torchmem.engine.step.step_function import StepFunction

    if isinstance(request.model, StepFunction) or not isinstance(request.model, nn.Module):
        return "a step function is your own code: the advice changes a module's built-in step"
    if request.parallel is not None:
        return "the advice does not change parallel steps yet"
    if request.compile is not None:
        return "the advice does not change compiled steps yet"
    if request.args and request.kwargs:
        return "the advice takes positional or keyword inputs, not both"
    return None
