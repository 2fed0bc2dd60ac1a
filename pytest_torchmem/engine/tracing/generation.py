"""Hugging Face transformers' generation loop under the trace: beams go on to the end.

``model.generate(...)`` decides when to stop from values: a greedy or sampling
loop from ``unfinished_sequences.max() == 0``, a beam search from
``_beam_search_has_unfinished_sequences`` (can a running beam still beat the
finished ones, is a beam still open, can one continue). The trace knows the
values that follow from the prompt and the lengths (``values.py``: the
max-length criterion, and through an absorbing ``|`` or ``&`` the decisions it
settles), not the ones that follow from the logits: the generated tokens, the
beams' scores. For the greedy loop the unknown decision is read as "not
finished" (``.item()`` of an unknown boolean is ``False``), and it runs on
until the max-length criterion settles it. A beam search asks the opposite
question ("still unfinished?"), and ``False`` would end it after one token;
under :func:`beams_run_on` an undecided answer is taken as ``True``: the beams
run on until the stopping criteria say every one must stop, the length a beam
search reaches when no sequence ends early, the most memory it can take.

Where a criterion depends on the generated tokens (an end-of-sequence token is
set), a real run may end earlier: the estimate is then an upper bound, and
says so in ``unsupported``. Without one (``eos_token_id=None``), the run's
length is the max length and the estimate is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.figures.report import Unsupported
from pytest_torchmem.engine.torch_compat.torch_replacing import swapped

__all__ = ["beams_run_on"]

_DECISION: Final = "_beam_search_has_unfinished_sequences"
_RUNS_ON: Final = Unsupported(
    f"transformers: GenerationMixin.{_DECISION}",
    "whether a beam search stops before its max length depends on the generated tokens "
    "(an end-of-sequence token is set): the beams were taken to run to the max length, "
    "an upper bound",
)


@contextmanager
def beams_run_on(tracker: Any, model: nn.Module) -> Iterator[None]:
    """Within the block, a beam search of transformers whose stop the trace cannot
    decide goes on (see the module's docstring): for the generation classes of
    ``model``'s modules (found through their classes, not by import: a test run may
    hold two copies of transformers' modules)."""
    owners = {
        owner
        for module in model.modules()
        for owner in type(module).__mro__
        if isinstance(owner.__dict__.get(_DECISION), staticmethod)
    }
    # (the block outlives the model it was given: parallel='s apply may replace it, and
    # what only it held dies then, as in a real run)
    del model
    with ExitStack() as stack:
        for owner in owners:
            stack.enter_context(_going_on(tracker, owner))
        yield


@contextmanager
def _going_on(tracker: Any, owner: type) -> Iterator[None]:
    """``owner``'s decision replaced for the block (transformers' class, not torch's: not
    an entry of torch's table, but put back by the same mechanism, torch_private.swapped)."""
    decide = owner.__dict__[_DECISION].__func__

    def has_unfinished(*args: Any, **kwargs: Any) -> Any:
        answer = decide(*args, **kwargs)
        values = tracker.values
        if isinstance(answer, torch.Tensor) and values.of(answer) is None:
            values.assume(answer, True)
            hits = args[2] if len(args) > 2 else kwargs.get("next_token_hits_stopping_criteria")
            if values.of(hits) is None:
                tracker.flag(_RUNS_ON)
        return answer

    with swapped(owner, _DECISION, staticmethod(has_unfinished)):
        yield
