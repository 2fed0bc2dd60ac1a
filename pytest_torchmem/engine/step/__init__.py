"""The step: one training step, as the trace and the real run both run it.

:mod:`.request` validates a step's arguments once (:class:`~.request.StepRequest`);
:mod:`.built_in` is the built-in training step (forward, loss, backward, optimizer);
:mod:`.step_function` is a step the user wrote, and :mod:`.phases` recognises its phases
as it runs; :mod:`.holdings` is what a step holds of the user's; :mod:`.nesting` refuses a
step started inside another; :mod:`.compiling` is the ``compile=`` option.
"""

from typing import Any

from pytest_torchmem.engine import moved_attribute

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    """The names of ``engine/step.py`` (release 0.1.0), now :mod:`.built_in`'s, until the next release."""
    return moved_attribute(__name__, "built_in", name)
