"""What a step holds of the user's: the model's tensors (the built-in step) or a step function's world.

The trace and the measurement run the step on stand-ins of the user's tensors,
made and lent the same way for both kinds of step: :func:`holdings_of` finds
what the step holds (:func:`~pytest_torchmem.engine.user.model_state.collect` of a
model, the :class:`~pytest_torchmem.engine.user.reaching.World` a step
function reaches), :func:`converted` makes the stand-ins, :func:`lend` puts them
in place for the step and the originals back after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Union

from torch import nn

from pytest_torchmem.engine.user.model_state import Converted, HookError, ModelTensors, StandIns, collect, convert, substituted
from pytest_torchmem.engine.step.step_function import StepFunction
from pytest_torchmem.engine.user import standins as world_standins
from pytest_torchmem.engine.user.journal import Journal
from pytest_torchmem.engine.user.reaching import World, model_holders

__all__ = ["Holdings", "converted", "holdings_of", "lend"]

Holdings = Union[ModelTensors, World]


def holdings_of(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Holdings:
    """The tensors of a model, or the world of a step function called on ``args`` and
    ``kwargs`` (walked afresh: a run lends it stand-ins, then lets go of it)."""
    if isinstance(model, StepFunction):
        return model.reach(args, kwargs)
    tensors = collect(model)
    # what its modules hold: a forward may write into it (a list it appends activations to)
    tensors.holders = model_holders(model)
    return tensors


def converted(
    holdings: Holdings,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    make: StandIns,
    on_hook_error: HookError | None = None,
    host: StandIns | None = None,
) -> Converted:
    """Stand-ins made by ``make`` for what the step holds and for its inputs (``host``: of
    what a GPU keeps on its host, a step function's optimizers' step counts)."""
    if isinstance(holdings, World):
        return world_standins.convert(holdings, args, kwargs, make, on_hook_error, host)
    return convert(holdings, args, kwargs, make, on_hook_error)


def lend(holdings: Holdings, standins: Converted, *, compiled: bool = False) -> AbstractContextManager[None]:
    """The stand-ins in the places of the user's tensors for the block; the originals
    back after it. ``compiled``: the step runs compiled code (a step function's world is
    then not watched for modules it calls: dynamo would trace the watch)."""
    if isinstance(holdings, World):
        return world_standins.lent(holdings, standins.model, watch_calls=not compiled)
    return _model_lent(holdings, standins.model)


@contextmanager
def _model_lent(holdings: ModelTensors, model_standins: dict[int, Any]) -> Iterator[None]:
    """The built-in step's stand-ins in the model's slots for the block; after it, the
    originals back, and whatever the step wrote into what the modules held before it."""
    journal = Journal(holdings.holders)
    try:
        with substituted(holdings, model_standins):
            yield
    finally:
        journal.restore()
