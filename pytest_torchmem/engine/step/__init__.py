"""The step: one training step, as the trace and the real run both run it.

:mod:`.request` validates a step's arguments once (:class:`~.request.StepRequest`);
:mod:`.built_in` is the built-in training step (forward, loss, backward, optimizer);
:mod:`.step_function` is a step the user wrote, and :mod:`.phases` recognises its phases
as it runs; :mod:`.holdings` is what a step holds of the user's; :mod:`.nesting` refuses a
step started inside another; :mod:`.compiling` is the ``compile=`` option.
"""

__all__: list[str] = []
