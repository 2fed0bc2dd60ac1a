"""The phases of a step function, recognised as it runs: :class:`PhaseWatch`.

A step function (``tm.estimate(train_step, (model, batch, opt))``) is the
user's own code: its forward, backward and optimizer steps are wherever it
calls them. They are recognised from torch's own entry points, as the
function calls them:

- a **forward** begins when a module is called from outside any other module,
  outside backward and outside an optimizer step (hooks on the modules the
  function reaches, none inside a compiled region: dynamo would trace them into
  the compiled program, and guard on them);
- a **backward** begins when ``torch.autograd.backward`` (``loss.backward()``)
  or ``torch.autograd.grad`` is called (a call from inside a backward, a
  checkpoint's recomputation, is part of it);
- an optimizer **step** begins when ``optimizer.step()`` is called (global
  optimizer hooks), outside backward (an optimizer stepped by a parameter hook
  is part of backward).

A phase lasts until the next one begins: the loss, computed after the model's
forward, belongs to the forward; gradient clipping after ``backward()`` to the
backward; ``zero_grad`` after ``step()`` to the step. The function's call
begins in a forward. A forward that begins after a backward or a step of the
same iteration begins the next iteration, so a loop of steps, or gradient
accumulation over micro-batches, is numbered as it ran.

The user names phases of their own with :func:`phase` (``with
tm.phase("generate"): ...``): each gets its peak, beside these.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ContextDecorator, ExitStack, contextmanager
from typing import Any, Final

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from pytest_torchmem.engine.parallel.mesh import local_tensors
from pytest_torchmem.engine.figures.report import Category
from pytest_torchmem.engine.figures.timeline import Phase
from pytest_torchmem.engine.torch_compat.torch_private import private, private_name
from pytest_torchmem.engine.torch_compat.torch_replacing import replacing
from pytest_torchmem.engine.user.journal import checkpoint

__all__ = ["PhaseWatch", "hooked_modules", "naming_phases", "phase"]

# torch's private names (engine/torch_compat/torch_private.py)
_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")
_TracingContext: Final = private("torch._guards.TracingContext")


class PhaseWatch:
    """Tells ``probe`` the phases of a step function while it runs (see the module).

    ``modules``: those the function reaches, whose calls begin a forward (see
    :func:`hooked_modules`); ``leaves``: the tensors whose ``.grad`` are gradients
    (the stand-ins of the parameters and of the inputs); ``optimizers``: those the
    function was given (twins stepping the stand-ins). After each backward the
    gradients, and after each optimizer step that optimizer's state, are told to
    ``probe``.
    """

    #: Its module hooks count the depth of module calls, a pre-hook and a hook a call: a
    #: replayed block (block_replay.py) skips its inner modules' pairs together.
    REPLAY_NEUTRAL: Final = True

    def __init__(
        self,
        probe: Any,
        modules: Sequence[nn.Module],
        leaves: Sequence[torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> None:
        self.probe = probe
        self.hooked = hooked_modules(modules)
        self.leaves = list(leaves)
        self.prepared: set[int] = set()
        for optimizer in optimizers:
            self._prepare(optimizer)
        self.phase = Phase.FORWARD
        self.iteration = 1
        #: whether the iteration has had a backward or a step (a forward then begins the next)
        self.trained = False
        self.modules = 0  # depth of module calls
        self.backwards = 0  # depth of backward calls
        self.steps = 0  # depth of optimizer steps

    def __deepcopy__(self, memo: dict[int, Any]) -> PhaseWatch:
        # its hooks sit on the user's modules: a module the step deep-copies (an EMA's
        # copy) keeps them, telling this watch, as a copy keeps the user's own hooks
        return self

    def __copy__(self) -> PhaseWatch:
        return self

    @contextmanager
    def watching(self) -> Iterator[PhaseWatch]:
        with ExitStack() as stack:
            stack.enter_context(replacing("torch.autograd.backward", self._backward(torch.autograd.backward)))
            stack.enter_context(replacing("torch.autograd.grad", self._backward(torch.autograd.grad)))
            # (dynamo traces global hooks into a compiled optimizer step: these run as
            # they are, outside its graphs, whose ops are then those of a real run's step)
            handles = [
                register_optimizer_step_pre_hook(torch.compiler.disable(self._stepping)),
                register_optimizer_step_post_hook(torch.compiler.disable(self._stepped)),
            ]
            for module in self.hooked:
                handles.append(module.register_forward_pre_hook(self._module_called))
                handles.append(module.register_forward_hook(self._module_returned, always_call=True))
            for handle in handles:
                stack.callback(handle.remove)
            self.probe.set_phase(Phase.FORWARD, 1)
            yield self
            self.probe.set_phase(None)

    def _begin(self, phase: Phase) -> None:
        checkpoint()  # what the program let go of since, the journal lets go of too
        if phase == Phase.FORWARD and self.trained:
            self.iteration += 1
            self.trained = False
        elif phase != Phase.FORWARD:
            self.trained = True
        if phase != self.phase:
            self.phase = phase
            with _DisableTorchFunction():
                self.probe.set_phase(phase, self.iteration)

    # module calls: only the outermost, outside backward and optimizer steps, begin a forward

    def _module_called(self, module: nn.Module, args: Any) -> None:
        if self.modules == 0 and self.backwards == 0 and self.steps == 0 and self.phase != Phase.FORWARD:
            self._begin(Phase.FORWARD)
        self.modules += 1

    def _module_returned(self, module: nn.Module, args: Any, output: Any) -> None:
        self.modules = max(0, self.modules - 1)

    def _backward(self, run: Callable[..., Any]) -> Callable[..., Any]:
        def backward(*args: Any, **kwargs: Any) -> Any:
            if self.backwards or self.steps or _TracingContext.try_get() is not None:
                # (AOTAutograd traces a compiled region's joint graph with autograd.grad
                # while dynamo compiles the region in the forward: no backward of the step)
                return run(*args, **kwargs)
            self._begin(Phase.BACKWARD)
            self.backwards += 1
            try:
                return run(*args, **kwargs)
            finally:
                self.backwards -= 1
                checkpoint()
                with _DisableTorchFunction():
                    self.probe.assign_role(
                        Category.GRADIENTS, local_tensors(t.grad for t in self.leaves if t.grad is not None)
                    )

        backward.__wrapped__ = run  # type: ignore[attr-defined]
        return backward

    def _prepare(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self.prepared:
            self.prepared.add(id(optimizer))
            self.probe.prepare_optimizer(optimizer)

    def _stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        self._prepare(optimizer)  # one the function made: its first step
        outermost = self.backwards == 0 and self.steps == 0
        self.steps += 1
        # (the hooks get step's own arguments: the optimizer first, then the closure)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if outermost and callable(closure):
            # optimizer.step(closure) (LBFGS, Lightning's automatic optimization) runs the
            # forward and backward in the closure: they are phases of their own, and the
            # step begins when the closure returns
            return _closure_args(args, kwargs, self._watched_closure(closure))
        if outermost:
            self._begin(Phase.STEP)
        return None

    def _watched_closure(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            depth, self.steps = self.steps, 0
            try:
                return closure(*args, **kwargs)
            finally:
                self.steps = depth
                self._begin(Phase.STEP)

        return watched

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        checkpoint()
        self.steps = max(0, self.steps - 1)
        with _DisableTorchFunction():
            self.probe.assign_role(
                Category.OPTIMIZER_STATE,
                local_tensors(
                    v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
                ),
            )


def _closure_args(args: Any, kwargs: Any, closure: Callable[..., Any]) -> tuple[Any, Any]:
    """``optimizer.step``'s arguments with ``closure`` in the place of its own."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


def hooked_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """``modules`` and their submodules, each once, but none that runs inside a compiled
    region: a compiled module's wrapper (``torch.compile(module)``) is hooked, what it
    wraps is not; a module compiled in place (``module.compile()``) and its submodules
    are not (a call of one begins a forward only through a module around it)."""
    optimized = private("torch._dynamo.eval_frame.OptimizedModule")
    compiled_call = private_name("torch.nn.Module._compiled_call_impl")
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = list(reversed(modules))
    while stack:
        module = stack.pop()
        if id(module) in seen or getattr(module, compiled_call, None) is not None:
            continue
        seen.add(id(module))
        found.append(module)
        if not isinstance(module, optimized):
            stack.extend(reversed(list(module.children())))
    return found


_naming = threading.local()  # .probes: the probes of the steps running on this thread


class phase(ContextDecorator):  # noqa: N801 - the public tm.phase, a function before
    """Name a phase of your own step: ``with tm.phase("generate"): ...``.

    While :func:`~pytest_torchmem.estimate` or :func:`~pytest_torchmem.measure` runs
    the step, the report's ``phases[name]`` is the highest memory reached inside the
    block (the live bytes when it begins included): the highest of its runs where
    the block runs several times, and the outermost where blocks of one name nest.
    Phases of different names may nest or overlap; the forward, backward and step
    phases go on being recognised inside them. Outside a check, it does nothing:
    the code that names its phases runs as it did.

    One object may be entered again (``p = tm.phase("x")``, then ``with p:`` in a
    loop, or nested), on any thread, and decorate a function (``@tm.phase("x")``).
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"tm.phase() takes the phase's name, a non-empty string; got {name!r}")
        self.name: Final = name
        # the probe told of each entry not yet left, innermost last, per thread
        self._entered: Final = threading.local()

    def __repr__(self) -> str:
        return f"tm.phase({self.name!r})"

    def __enter__(self) -> None:
        probes = getattr(_naming, "probes", None)
        probe = probes[-1] if probes else None
        entered = self._entered.__dict__.setdefault("probes", [])
        entered.append(probe)
        if probe is not None:
            with _DisableTorchFunction():
                probe.name_phase(self.name, True)

    def __exit__(self, *exc: object) -> None:
        probe = self._entered.probes.pop()
        if probe is not None:
            with _DisableTorchFunction():
                probe.name_phase(self.name, False)


@contextmanager
def naming_phases(probe: Any) -> Iterator[None]:
    """:func:`phase` tells ``probe`` within the block (on this thread)."""
    probes = getattr(_naming, "probes", None)
    if probes is None:
        probes = _naming.probes = []
    probes.append(probe)
    try:
        yield
    finally:
        probes.pop()
