"""What a step function touches that the walk did not reach: refused where it is touched.

The walk (:mod:`~pytest_torchmem.engine.user.reaching`) follows every path
Python's references give; code can still reach an object by a path no walk
sees (a library's registry, ``sys.modules``, ``gc``). torch tells what the
step touches: a module's forward pre-hooks and an optimizer's step pre-hooks
fire globally, for every module and optimizer. :func:`watching` listens, on the
tracing thread, while the step runs: a module called, or an optimizer
stepped, that the walk did not reach and the step did not make (construct or
copy: the constructors and ``__setstate__`` of ``nn.Module`` and
``torch.optim.Optimizer`` tell), and that holds a tensor without a stand-in,
is refused with :class:`UnfollowedError`, one line naming it and the fix,
before it runs: the user's own tensors are never stepped, nor given fake
gradients. (The tracker refuses a tensor that requires grad reaching an op
without a stand-in, likewise: :func:`unfollowed_tensor`.)
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

__all__ = ["UnfollowedError", "unfollowed_tensor", "watching"]

_FIX = (
    "pass it to the function as an argument (tm.estimate(step, (model, batch, opt))), or "
    "hold it where the function's code reaches it: an argument, self, a closure, a default, "
    "or a global its code reads"
)


class UnfollowedError(TypeError):
    """The step uses an object of the user's that pytest-torchmem cannot follow: it would
    act on the user's own tensors instead of stand-ins."""


def unfollowed_tensor(t: torch.Tensor, where: str) -> UnfollowedError:
    """The error for a tensor that requires grad reaching an op of the step without a stand-in."""
    kind = "parameter" if isinstance(t, nn.Parameter) else "tensor that requires grad"
    return UnfollowedError(
        f"the step uses a {kind} of shape {tuple(t.shape)} ({t.dtype}){f' at {where}' if where else ''} "
        "that pytest-torchmem did not reach, so it has no stand-in and backward would write "
        f"its gradient into the real one; {_FIX}"
    )


@contextmanager
def watching(
    module_ids: set[int],
    optimizer_ids: set[int],
    ours: Callable[[torch.Tensor], bool],
    where: Callable[[], str],
    *,
    calls: bool = True,
) -> Iterator[None]:
    """Refuse, on this thread while the block runs, a module called (``calls``: where
    no compiled code runs, which a global forward hook would make dynamo run eagerly) or
    an optimizer stepped that is neither reached (``module_ids``, ``optimizer_ids``) nor
    made in the block, and that holds a tensor not ``ours`` (see the module); ``where()``
    says where the user's code is."""
    thread = threading.get_ident()
    born: weakref.WeakSet[Any] = weakref.WeakSet()

    def recording(real: list[Callable[..., Any]]) -> Callable[..., Any]:
        def made(self: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                born.add(self)
            return real[0](self, *args, **kwargs)

        return made

    def module_called(module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # (dynamo traces global hooks: nothing to trace here)
            return
        if threading.get_ident() != thread or id(module) in module_ids or module in born:
            return
        # (its submodules' too: the outermost module the walk missed is the one named)
        held = [*module.parameters(), *module.buffers()]
        if any(not ours(t) for t in held):
            raise UnfollowedError(
                f"the step calls a {type(module).__qualname__} module{_at(where())} that "
                "pytest-torchmem's walk of what the function reaches did not find, so its "
                f"tensors have no stand-ins; {_FIX}"
            )

    def optimizer_stepping(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != thread or id(optimizer) in optimizer_ids or optimizer in born:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(not ours(p) for p in params):
            raise UnfollowedError(
                f"the step steps a {type(optimizer).__qualname__} optimizer{_at(where())} that "
                "pytest-torchmem's walk of what the function reaches did not find, so it would "
                f"step the real parameters; {_FIX}"
            )

    # (a replayed block's inner modules are not called: each was, in the traced block it replays)
    module_called.REPLAY_NEUTRAL = True  # type: ignore[attr-defined]

    with ExitStack() as stack:
        for path in (
            "torch.nn.modules.module.Module.__init__",
            "torch.nn.modules.module.Module.__setstate__",
            "torch.optim.optimizer.Optimizer.__init__",
            "torch.optim.optimizer.Optimizer.__setstate__",
        ):
            real: list[Callable[..., Any]] = []
            made = recording(real)
            real.append(stack.enter_context(replacing(path, made)))
            functools.update_wrapper(made, real[0])
        # (run as it is in a compiled optimizer step, outside its graphs: see phases.py)
        handles = [register_optimizer_step_pre_hook(torch.compiler.disable(optimizer_stepping))]
        if calls:
            handles.append(nn.modules.module.register_module_forward_pre_hook(module_called))
        for handle in handles:
            stack.callback(handle.remove)
        yield


def _at(where: str) -> str:
    return f" (at {where})" if where else ""
