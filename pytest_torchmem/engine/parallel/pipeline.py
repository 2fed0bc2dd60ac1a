"""A pipeline-parallel rank's step: its stages, its schedule, and the phases of one step.

``Parallel(..., schedule=ScheduleGPipe, microbatches=4)`` asks for a rank of
a pipeline run (``torch.distributed.pipelining``). ``apply(model, mesh)``
returns the rank's ``PipelineStage`` (or several, for a schedule of several
stages per rank), built as the training code builds it; :class:`Pipelined`
holds them and the schedule made over them, and runs one step of the
schedule as the training loops of torchtitan and the pipelining docs run it:
the rank that holds the first stage passes the batch, the one that holds the
last passes the target and a list for the micro-batches' losses, every other
rank passes neither. The schedule splits the batch into micro-batches, runs
their forwards and backwards in its order, sends and receives activations
and gradients between the stages, and leaves the gradients of the rank's
parameters; the built-in step's optimizer then steps them.

The loss of each micro-batch is the step's ``loss_fn`` (or the default
loss) of the last stage's output for it. Phases: the forward phase runs from
the step's start to the first backward of a micro-batch on the rank, the
backward phase from there to the end of the schedule's step (under 1F1B it
holds the steady state's forwards too), then the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from pytest_torchmem.engine.user.loss import check_loss, default_loss
from pytest_torchmem.engine.figures.timeline import Phase
from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = ["Pipelined", "check_schedule"]


def check_schedule(schedule: Any, microbatches: Any, pipeline: str, mesh: Mapping[str, int]) -> None:
    """Refuse, in one line each, a schedule, micro-batch count or mesh a pipeline step cannot run with."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("Parallel(schedule=...) needs torch.distributed, which this build of torch lacks")
    base = private("torch.distributed.pipelining.schedules._PipelineSchedule")
    if not isinstance(schedule, type) or not issubclass(schedule, base):
        raise TypeError(
            "Parallel(schedule=...) takes a schedule class of torch.distributed.pipelining, e.g. "
            f"schedule=ScheduleGPipe or schedule=Schedule1F1B, got {schedule!r}"
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            "Parallel(schedule=...) needs microbatches=, the number of micro-batches each step "
            f"splits the batch into (a positive int), got {microbatches!r}"
        )
    if pipeline not in mesh:
        raise ValueError(
            f"Parallel(schedule=...): the mesh has no pipeline dimension {pipeline!r} "
            f"(it has {', '.join(mesh)}); name it {pipeline!r}, e.g. mesh={{{pipeline!r}: 2, 'dp': 2}}, "
            "or pass pipeline= with its name"
        )


def _is_multi(schedule: type) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(schedule, PipelineScheduleMulti)


class Pipelined(nn.Module):
    """A rank's pipeline stages and the schedule over them: the module the built-in step
    runs under ``Parallel(schedule=...)``. Its parameters are the stages' submodules'."""

    def __init__(self, stages: list[Any], schedule: type, microbatches: int, applied: Any = None) -> None:
        super().__init__()
        self.stages = nn.ModuleList([stage.submod for stage in stages])
        self._stages = stages
        #: what ``apply`` returned: the rank's stage, or its list of stages
        self.applied: Any = applied if applied is not None else stages
        self._microbatches = microbatches
        self._loss: Callable[[Any], torch.Tensor] | None = None
        made = stages if _is_multi(schedule) else stages[0]
        self._schedule = schedule(made, microbatches, loss_fn=self._micro_batch_loss)

    @classmethod
    def of(cls, applied: Any, parallel: Any) -> Pipelined:
        """The stages ``apply`` returned, checked, with the schedule ``parallel`` names."""
        stage_base = private("torch.distributed.pipelining.stage._PipelineStageBase")
        stages = list(applied) if isinstance(applied, (list, tuple)) else [applied]
        schedule = parallel.schedule
        if not stages or not all(isinstance(s, stage_base) for s in stages):
            raise TypeError(
                "Parallel(apply=...) with schedule= must return the rank's pipeline stage, "
                "a torch.distributed.pipelining.PipelineStage (or a list of them for a schedule "
                f"of several stages per rank), got {type(applied).__name__}; end it with "
                "'return PipelineStage(stage_module, stage_index, num_stages, device, "
                "group=mesh[\"pp\"].get_group())'"
            )
        if len(stages) > 1 and not _is_multi(schedule):
            raise ValueError(
                f"{schedule.__name__} runs one stage per rank, and apply returned {len(stages)}; "
                "return one stage, or use a schedule of several stages per rank "
                "(ScheduleInterleaved1F1B, ScheduleLoopedBFS)"
            )
        return cls(stages, schedule, int(parallel.microbatches), applied)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a pipeline rank runs its schedule's step, not a forward (Pipelined.run)")

    def _micro_batch_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = (self._loss or default_loss)(output)
        check_loss(loss)
        return loss

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self._stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self._stages)

    def run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loss_fn: Callable[[Any], torch.Tensor] | None,
        probe: Any,
        iteration: int,
    ) -> list[Any]:
        """One step of the schedule, its phases told to ``probe``: the micro-batches' losses
        (a list the training loop holds to the end of the iteration; empty but on the rank
        of the last stage)."""
        self._loss = loss_fn
        started: list[bool] = []
        # (a trace's probe numbers the micro-batches' forwards, each a graph of its own, and
        # knows the stages' set-up, whose forward and backward run in the forward phase:
        # block_replay.py groups the blocks' calls by them)
        new_forward = getattr(probe, "new_forward", None)

        def first_backward(stage: Any) -> Callable[..., Any]:
            backward = type(stage).backward_one_chunk.__get__(stage)

            def run(*a: Any, **k: Any) -> Any:
                if not started:
                    started.append(True)
                    probe.set_phase(Phase.BACKWARD, iteration)
                return backward(*a, **k)

            return run

        def numbered(method: Any) -> Callable[..., Any]:
            def run(*a: Any, **k: Any) -> Any:
                new_forward()
                return method(*a, **k)

            return run

        def setting_up(method: Any, forward: bool) -> Callable[..., Any]:
            def run(*a: Any, **k: Any) -> Any:
                if forward:
                    new_forward()
                probe.setting_up = True
                try:
                    return method(*a, **k)
                finally:
                    probe.setting_up = False

            return run

        probe.set_phase(Phase.FORWARD, iteration)
        wrapped = ["backward_one_chunk"]
        if new_forward is not None:
            wrapped += ["forward_one_chunk", "_prepare_forward_infra", "_prepare_backward_infra"]
        for stage in self._stages:
            stage.backward_one_chunk = first_backward(stage)
            if new_forward is not None:
                cls = type(stage)
                stage.forward_one_chunk = numbered(cls.forward_one_chunk.__get__(stage))
                stage._prepare_forward_infra = setting_up(cls._prepare_forward_infra.__get__(stage), True)
                stage._prepare_backward_infra = setting_up(cls._prepare_backward_infra.__get__(stage), False)
        losses: list[Any] = []
        try:
            step_args = args if self.has_first else ()
            step_kwargs = kwargs if self.has_first else {}
            options: dict[str, Any] = {}
            if self.has_last:
                options = {"target": self._target(), "losses": losses}
            output = self._schedule.step(*step_args, **options, **step_kwargs)
            del output
        finally:
            for stage in self._stages:
                for name in wrapped:
                    stage.__dict__.pop(name, None)
        if not started:
            probe.set_phase(Phase.BACKWARD, iteration)
        return losses

    def _target(self) -> torch.Tensor:
        """The target the schedule splits for the loss: empty (no bytes), one row per
        micro-batch; the loss is ``loss_fn`` of the output alone."""
        return torch.empty((self._microbatches, 0), device=self._stages[-1].device)
