"""The user's world: what a step is handed, found, lent stand-ins for the call, left as it was.

A step function's world: :mod:`.reaching` walks what the function can reach;
:mod:`.journal` records each mutable object on the way and puts it back after the call;
:mod:`.standins` makes the stand-ins and lends them to the world for the call;
:mod:`.watching` refuses what the call touches that the walk did not reach;
:mod:`.process` records the process's own state that training code changes.

A model and its data: :mod:`.model_state` swaps a model's tensors for stand-ins and puts
them back; :mod:`.containers` finds the tensors in nested inputs and outputs;
:mod:`.layouts` says where a tensor's memory is; :mod:`.twins` are the built-in step's
copies of optimizers a parameter hook steps; :mod:`.loss` is the loss backpropagated.

The user's code: :mod:`.user_code` finds the frames of the user's code a trace is in;
:mod:`.generated_code` maps inductor's output modules back to the user's lines.
"""

from pytest_torchmem.engine.user.watching import UnfollowedError

__all__ = ["UnfollowedError"]
