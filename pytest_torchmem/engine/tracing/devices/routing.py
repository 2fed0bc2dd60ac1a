"""What the device routers share: the calls inside torch's Python-level functions.

A torch-function mode sees a Python-level torch function (``F.layer_norm``,
``torch.functional.einsum``) as one call; the ops its body calls reach the
mode only if the body runs with the mode active. :class:`BodyRouting` runs
such bodies so, once per entry.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Final

from pytest_torchmem.engine.torch_compat.torch_private import present, private
from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

__all__ = ["COMPOSITE_MODULES", "BodyRouting", "routed_unpacking"]

# torch's private names (engine/torch_compat/torch_private.py)
_get_current_function_mode_stack: Final = private("torch.overrides._get_current_function_mode_stack")

#: Modules whose Python functions run with the router active: their bodies call
#: what the routers route (``F.multi_head_attention_forward`` calls ``dropout``
#: and ``scaled_dot_product_attention``). Tensor's Python methods
#: (``torch._tensor``) only forward to one op, which the router already saw.
COMPOSITE_MODULES: Final = frozenset({"torch.nn.functional", "torch.functional"})


class BodyRouting:
    """A mixin for a ``TorchFunctionMode`` that routes the calls inside torch's
    Python-level functions too. The mode's ``__init__`` sets ``_running`` to an
    empty set."""

    #: Python functions outside :data:`COMPOSITE_MODULES` whose body runs with the mode active.
    run_inside: ClassVar[frozenset[Any]] = frozenset()
    _running: set[Any]

    def runs_body(self, func: Any) -> bool:
        """Whether ``func``'s body is to run with the mode active now."""
        return (
            type(func) is types.FunctionType
            and (func.__module__ in COMPOSITE_MODULES or func in self.run_inside)
            and func not in self._running
        )

    def run_body(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        """Run ``func``'s body with the mode active. A Python override of a Tensor
        method (``Tensor.unflatten`` calling ``super().unflatten``) comes back to
        the mode under the same name from its C binding: that second entry runs
        plainly, as without the mode."""
        self._running.add(func)
        try:
            with self:  # type: ignore[attr-defined]
                return _redispatch(func, types_, args, kwargs)
        finally:
            self._running.discard(func)


def _redispatch(func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
    """Call ``func`` skipping its own ``__torch_function__`` check (one hop), so that
    its body runs and the ops it calls reach the active modes."""
    if present("torch.overrides.redispatch_function"):  # 2.13 on
        return private("torch.overrides.redispatch_function")(func, types_, args, kwargs)
    return _without_first_hop(func)(*args, **(kwargs or {}))


#: The names a Python-level torch function checks before it hands itself to the
#: modes (``if has_torch_function_variadic(...): return handle_torch_function(...)``).
_HOP_CHECKS: Final = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_hopless: dict[Any, Any] = {}


def _without_first_hop(func: types.FunctionType) -> types.FunctionType:
    """``func`` whose own checks for ``__torch_function__`` answer False: what
    ``torch.overrides.redispatch_function`` (2.13 on) does, for 2.10 to 2.12. The
    copy reads its module's globals but for the checks; the functions it calls
    keep theirs, so their own dispatch is untouched."""
    copy = _hopless.get(func)
    if copy is None:
        module_globals = dict(func.__globals__)
        for name in _HOP_CHECKS:
            if name in module_globals:
                module_globals[name] = _never
        copy = types.FunctionType(
            func.__code__, module_globals, func.__name__, func.__defaults__, func.__closure__
        )
        copy.__kwdefaults__ = func.__kwdefaults__
        _hopless[func] = copy
    return copy


def _never(*args: Any) -> bool:
    return False


@contextmanager
def routed_unpacking(mode: Any) -> Iterator[None]:
    """Keep the torch-function ``mode`` routing in what autograd runs from a saved
    tensor's unpack hook, in backward.

    Autograd runs backward without the torch-function modes of the forward (the
    step's ``backward()`` runs inside the router's own handler, the router popped),
    so a router routes the forward and not what backward's unpack hooks do:

    * non-reentrant checkpointing's recomputation: a fake cuda forward saves the
      efficient-attention and ``native_dropout`` outputs while the recomputation
      takes the math and ``bernoulli_`` paths, and checkpointing refuses the
      mismatch (``CheckpointError``), where a GPU recomputes the same kernels; the
      recomputation opens ``torch.utils.checkpoint._recomputation_hook``;
    * the program's own saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``:
      activation offloading brings each tensor back to the GPU there, ``.to("cuda")``,
      which the router places on the traced device), pushed through
      ``torch._C._autograd._push_saved_tensors_default_hooks``.

    While this context is active both re-enter ``mode`` (where it is not on the stack
    already).
    """
    real_hook: Any = None
    real_push: Any = None

    @contextmanager
    def routing() -> Iterator[None]:
        if mode in _get_current_function_mode_stack():
            yield
        else:
            with mode:
                yield

    @contextmanager
    def recomputing(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with real_hook(*args, **kwargs) as hook, routing():
            yield hook

    def push(pack_hook: Any, unpack_hook: Any) -> Any:
        def unpack(packed: Any) -> Any:
            with routing():
                return unpack_hook(packed)

        return real_push(pack_hook, unpack)

    with (
        replacing("torch.utils.checkpoint._recomputation_hook", recomputing) as real_hook,
        replacing("torch._C._autograd._push_saved_tensors_default_hooks", push) as real_push,
    ):
        yield
