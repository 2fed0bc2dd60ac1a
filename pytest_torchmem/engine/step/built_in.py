"""The training step, written once and run by both the fake trace and the real measurement.

Estimate and measurement agree byte for byte only if they run the same Python
program: same calls, same references held and dropped at the same points. So
both run :func:`run_step`, and learn about its progress through a
:class:`Probe` (phase changes, module entries and exits, which tensors ended
up as gradients and optimizer state).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Final, Protocol

import torch
from torch import nn

from pytest_torchmem.engine.user.containers import tensors_in
from pytest_torchmem.engine.user.loss import check_loss, default_loss
from pytest_torchmem.engine.parallel.mesh import local_tensors
from pytest_torchmem.engine.step.phases import naming_phases
from pytest_torchmem.engine.parallel.pipeline import Pipelined
from pytest_torchmem.engine.figures.report import ROOT_NAME, Category
from pytest_torchmem.engine.step.step_function import StepFunction, run_function
from pytest_torchmem.engine.figures.timeline import Phase
from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = [
    "LossFn",
    "ModuleTracker",
    "NoModules",
    "OptimizerFactory",
    "Probe",
    "QuietProbe",
    "Replay",
    "ReplayFactory",
    "StepArgumentError",
    "hook_once",
    "module_names",
    "run_step",
]

# torch's private names (engine/torch_compat/torch_private.py), bound once: the module hooks run at every call.
tree_leaves: Final = private("torch.utils._pytree.tree_leaves")
_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")

LossFn = Callable[[Any], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

#: Name of the model itself in per-module figures.


class StepArgumentError(TypeError):
    """An argument of the built-in step that turns out wrong only as the step runs (what
    the optimizer factory makes): the caller's to fix, in one line."""


class Probe(Protocol):
    """What the step reports as it runs."""

    def set_phase(self, phase: Phase | None, iteration: int = 1) -> None: ...

    def enter_module(self, index: int) -> None: ...

    def exit_module(self, index: int) -> None: ...

    def name_phase(self, name: str, begin: bool) -> None: ...

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...

    def assign_role(self, category: Category, tensors: Iterable[torch.Tensor]) -> None: ...

    def iteration_done(self, iteration: int) -> None: ...


class Replay(Protocol):
    """Replays a loop iteration's forward and backward, and its optimizer step
    (tracing/replay.py, tracing/optimizer_replay.py): the step asks it before running
    them, and tells it when it ran them."""

    def begin(self, iteration: int) -> tuple[Any, Any] | None:
        """``(loss, held output)`` where ``iteration``'s forward and backward were
        replayed (the leaves' gradients set), else None: the step runs them."""
        ...

    def end(self, iteration: int, loss: Any, held: Any) -> None:
        """``iteration``'s forward and backward ran: the step keeps ``loss`` and ``held``."""
        ...

    def begin_step(self, iteration: int, optimizer: torch.optim.Optimizer) -> bool:
        """True where ``iteration``'s optimizer step was replayed, else the step runs it."""
        ...

    def end_step(self, iteration: int, optimizer: torch.optim.Optimizer) -> None:
        """``iteration``'s optimizer step ran."""
        ...


#: Makes the :class:`Replay` of a loop: ``(model, leaves whose .grad the step reads)``.
ReplayFactory = Callable[[nn.Module, list[torch.Tensor]], Replay]


class QuietProbe:
    """A probe that listens to nothing (a step run only for its side effects: a warm-up)."""

    def set_phase(self, phase: Phase | None, iteration: int = 1) -> None:
        pass

    def enter_module(self, index: int) -> None:
        pass

    def exit_module(self, index: int) -> None:
        pass

    def name_phase(self, name: str, begin: bool) -> None:
        pass

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def assign_role(self, category: Category, tensors: Iterable[torch.Tensor]) -> None:
        pass

    def iteration_done(self, iteration: int) -> None:
        pass


class NoModules:
    """Stands for the per-module hooks where they would break compiled regions
    (dynamo guards on hooks: its compiled code would not run)."""

    names: dict[int, str] = {}

    def __enter__(self) -> NoModules:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class ModuleTracker:
    """Tells the probe when each of the model's modules runs, forward and backward.

    Forward: global module hooks (removed on exit). Backward: a module's backward
    starts when the gradient of one of its outputs is complete and ends when the
    gradient of one of its inputs is; the hooks hold no gradient.
    """

    def __init__(self, model: nn.Module, probe: Probe) -> None:
        self.probe = probe
        #: Each module's index, by its id, beside a weak reference to it: a module the
        #: step drops (a pipeline stage keeps its share of the layers) frees its id for
        #: a new module, perhaps another rank's (the hooks are global: a pipeline's ranks
        #: trace on threads of one process)
        self._index: dict[int, tuple[weakref.ref[nn.Module], int]] = {}
        #: The modules' names, by the index the probe is told (as :func:`module_names`).
        self.names: list[str] = []
        for name, module in model.named_modules():
            if id(module) not in self._index:
                self._index[id(module)] = (weakref.ref(module), len(self._index))
                self.names.append(name or ROOT_NAME)
        self._handles: list[Any] = []

    def __enter__(self) -> ModuleTracker:
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._before),
            nn.modules.module.register_module_forward_hook(self._after, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _indexed(self, module: nn.Module) -> int | None:
        found = self._index.get(id(module))
        return found[1] if found is not None and found[0]() is module else None

    # The hooks are this package's code: they run without torch-function modes
    # (a device's router would see every tensor query they make).

    def _before(self, module: nn.Module, args: Any) -> None:
        index = self._indexed(module)
        if index is None:
            return
        with _DisableTorchFunction():
            self.probe.enter_module(index)
            if torch.is_grad_enabled():
                _hook_once(args, self.probe.exit_module, index)

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        index = self._indexed(module)
        if index is None:
            return
        with _DisableTorchFunction():
            self.probe.exit_module(index)
            if torch.is_grad_enabled():
                _hook_once(output, self.probe.enter_module, index)


def module_names(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s modules, each module once (the model itself:
    :data:`ROOT_NAME`), in the order of the indices :class:`ModuleTracker` reports."""
    names: list[str] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if id(module) not in seen:
            seen.add(id(module))
            names.append(name or ROOT_NAME)
    return names


class _Once:
    """A tensor hook that calls ``fn(index)`` the first time one of the tensors it is
    registered on gets its gradient (one small object, not a closure and its cells:
    a step registers hundreds)."""

    __slots__ = ("fn", "index")

    def __init__(self, fn: Callable[[int], None], index: int) -> None:
        self.fn: Callable[[int], None] | None = fn
        self.index = index

    def __call__(self, _grad: torch.Tensor) -> None:
        fn = self.fn
        if fn is not None:
            self.fn = None
            with _DisableTorchFunction():
                fn(self.index)


def _hook_once(value: Any, fn: Callable[[int], None], index: int) -> None:
    """Call ``fn(index)`` once, when the first gradient of a tensor in ``value`` is complete."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            value.register_hook(_Once(fn, index))
        return
    if type(value) is tuple:
        for v in value:
            if not isinstance(v, torch.Tensor):
                found: Any = tensors_in(value)
                break
        else:
            found = value  # a module's usual arguments: no containers to walk
    else:
        found = tensors_in(value)
    hook = None
    for t in found:
        if t.requires_grad:
            if hook is None:
                hook = _Once(fn, index)
            t.register_hook(hook)


#: (what block_replay.py registers where the module hooks would have)
hook_once: Final = _hook_once


def _call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return model(*args, **kwargs)


def run_step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, probe: Probe, **options: Any) -> None:
    """Run one step of ``model`` and report its progress to ``probe`` (see :func:`_run_step`
    for the options); the user's own phases (``tm.phase(name)``) are told to it too."""
    with naming_phases(probe):
        _run_step(model, args, kwargs, probe=probe, **options)


def _run_step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    parameters: list[torch.Tensor],
    inputs: list[torch.Tensor],
    loss_fn: LossFn | None,
    optimizer: OptimizerFactory | None,
    train: bool,
    probe: Probe,
    keep_output: bool = False,
    hook_optimizers: Sequence[torch.optim.Optimizer] = (),
    loop: bool | None = None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    repeat: int | None = None,
    train_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    replay: ReplayFactory | None = None,
) -> None:
    """Run one step of ``model`` and report its progress to ``probe``.

    ``parameters`` are the leaves the optimizer gets; ``inputs`` the input
    tensors (their ``.grad`` counts as gradients). ``keep_output``: the model's
    output is held to the end of the step, as ``out = model(**batch);
    out.loss.backward(); opt.step()`` holds ``out``; else it is dropped once
    the loss is taken from it, before backward. ``hook_optimizers`` are stepped
    by parameter hooks during backward (an optimizer step fused into it): their
    state is optimizer state.

    A training step with an optimizer (``optimizer``, or ``hook_optimizers``) runs
    as a loop of :data:`LOOP_ITERATIONS` iterations on the same inputs, each one the
    step as a ``train_step(batch)`` function runs it (what an iteration made and did
    not hand to the model or the optimizer is released when it ends): the first
    creates the optimizer's state, the second is the loop's steady state, which
    every later iteration repeats. ``probe`` is told each phase's iteration.
    ``loop`` says whether to loop regardless (a warm-up step that compiles, without
    the optimizer, runs the compiled code as often as the traced step will).

    A :class:`~pytest_torchmem.engine.step.step_function.StepFunction` is the user's own
    step: its function runs on ``args`` and ``kwargs`` (``optimizers``: the user's own
    among them, holding the stand-ins), its phases recognised as they come.

    ``repeat``: the step runs that many times, as a loop calls it (a leak check: the
    function called again, or the built-in step's iteration run again, on the same
    objects), and ``probe.iteration_done(i)`` is told as each ends.

    ``train_context()`` makes the context each iteration's forward and backward run in
    (``Parallel(train_context=...)``: context parallel); an input it leaves reshaped
    comes back whole to the next iteration, as the loop's next batch would.

    ``replay(model, leaves)``: where the step runs as a loop, a :class:`Replay` that may
    stand in for the later iterations' forward and backward (an estimate's: the first
    iteration's events again).
    """
    if isinstance(model, StepFunction):
        run_function(
            model, args, kwargs, leaves=[*parameters, *inputs], optimizers=optimizers, probe=probe, repeat=repeat
        )
        return
    if not train and isinstance(model, Pipelined):
        raise StepArgumentError(
            "train=False with Parallel(schedule=...) is not supported yet: a pipeline rank's "
            "step is its schedule's training step; check the forward of one stage without schedule="
        )
    iteration_context = _keeping_the_batch_whole(train_context, inputs)
    if not train:
        probe.set_phase(Phase.FORWARD)
        for iteration in range(1, (repeat or 1) + 1):
            with torch.no_grad(), iteration_context():
                output = _call(model, args, kwargs)
                if loss_fn is not None:
                    loss_fn(output)
                del output
            if repeat is not None:
                probe.iteration_done(iteration)
        probe.set_phase(None)
        return

    trainable = [p for p in parameters if p.requires_grad]
    opt = None
    if optimizer is not None:
        opt = optimizer(trainable)
        if not isinstance(opt, torch.optim.Optimizer):
            raise StepArgumentError(
                "optimizer must be a callable that takes the parameters and returns a "
                f"torch.optim.Optimizer, got {type(opt).__name__} back; "
                "e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
            )
        _check_steps_without_closure(opt)
        probe.prepare_optimizer(opt)

    if loop is None:
        loop = opt is not None or bool(hook_optimizers) or repeat is not None
    # each iteration's batch comes with the gradients the inputs had (none, as a rule):
    # the gradient of an input that requires grad is the batch's, not the loop's
    batch_grads = [t.grad for t in inputs] if loop else []
    iterations = repeat if repeat is not None else (LOOP_ITERATIONS if loop else 1)
    replayer = replay(model, trainable + inputs) if replay is not None and iterations > 1 else None
    for iteration in range(1, iterations + 1):
        if iteration > 1:
            for t, grad in zip(inputs, batch_grads):
                t.grad = grad
        _train_iteration(
            model,
            args,
            kwargs,
            trainable,
            inputs,
            loss_fn,
            opt,
            hook_optimizers,
            probe,
            keep_output,
            iteration,
            iteration_context,
            replayer,
        )
        if repeat is not None:
            probe.iteration_done(iteration)
    probe.set_phase(None)
    del opt, batch_grads, replayer


def _check_steps_without_closure(opt: torch.optim.Optimizer) -> None:
    """The built-in step calls ``opt.step()``: an optimizer whose step needs a closure
    (``torch.optim.LBFGS``) is refused before the step runs, with the way to check it."""
    try:  # through torch's wrappers of every step (profiling hooks, no_grad): as written
        signature = inspect.signature(opt.step)
    except (TypeError, ValueError):  # no signature to read: let its step say
        return
    try:
        signature.bind()
    except TypeError:
        pass
    else:
        return
    name = type(opt).__name__
    made = f"torch.optim.{name}" if getattr(torch.optim, name, None) is type(opt) else name
    raise StepArgumentError(
        f"{name}.step() needs a closure that recomputes the loss, and the built-in step "
        "(optimizer=) calls step() without one: check a step function that gives it one, "
        "in place of the model with the optimizer among its arguments, "
        "tm.estimate(train_step, (model, inputs, opt)) or torchmem.check(train_step, "
        f"(model, inputs, opt)) where opt = {made}(model.parameters()) and "
        "train_step(model, inputs, opt) calls opt.step(closure), closure() zeroing the "
        "gradients, running forward and backward and returning the loss "
        '(docs/howto/step-function.md, "An optimizer that needs a closure")'
    )


#: The iterations of a training loop a step with an optimizer runs: the first (which
#: creates the optimizer's state) and the steady state.
LOOP_ITERATIONS: Final = 2


def _train_iteration(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trainable: list[torch.Tensor],
    inputs: list[torch.Tensor],
    loss_fn: LossFn | None,
    opt: torch.optim.Optimizer | None,
    hook_optimizers: Sequence[torch.optim.Optimizer],
    probe: Probe,
    keep_output: bool,
    iteration: int,
    train_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    replay: Replay | None = None,
) -> None:
    """One iteration of the training loop: forward, loss, backward (in ``train_context()``),
    the optimizer step and ``zero_grad(set_to_none=True)``; its locals (the loss, the output
    it holds) die on return. ``replay`` may stand in for the forward and backward, and
    for the optimizer step."""
    probe.set_phase(Phase.FORWARD, iteration)
    replayed = replay.begin(iteration) if replay is not None else None
    if replayed is not None:
        loss, held = replayed
    else:
        loss, held = _forward_backward(model, args, kwargs, loss_fn, probe, keep_output, iteration, train_context)
        if replay is not None:
            replay.end(iteration, loss, held)
    del replayed
    probe.assign_role(
        Category.GRADIENTS,
        local_tensors(t.grad for t in trainable + inputs if t.grad is not None),
    )
    _assign_optimizer_state(probe, hook_optimizers)

    if opt is not None:
        probe.set_phase(Phase.STEP, iteration)
        if replay is None or not replay.begin_step(iteration, opt):
            opt.step()
            if replay is not None:
                replay.end_step(iteration, opt)
        _assign_optimizer_state(probe, [opt])
        opt.zero_grad(set_to_none=True)
    del loss, held


def _forward_backward(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: LossFn | None,
    probe: Probe,
    keep_output: bool,
    iteration: int,
    train_context: Callable[[], AbstractContextManager[Any]],
) -> tuple[Any, Any]:
    """An iteration's forward, loss and backward (in ``train_context()``): ``(loss, the
    output held)``, what the iteration keeps of them."""
    with train_context():
        if isinstance(model, Pipelined):
            # the schedule runs the rank's forwards and backwards, its losses held to the end
            return None, model.run(args, kwargs, loss_fn, probe, iteration)
        output = _call(model, args, kwargs)
        loss = (loss_fn or default_loss)(output)
        held = output if keep_output else None
        del output
        check_loss(loss)

        probe.set_phase(Phase.BACKWARD, iteration)
        loss.backward()
    return loss, held


def _keeping_the_batch_whole(
    train_context: Callable[[], AbstractContextManager[Any]], inputs: Sequence[torch.Tensor]
) -> Callable[[], AbstractContextManager[Any]]:
    """``train_context``, after whose block the inputs have their shapes again: a context
    that shards the batch in place and keeps it sharded (context parallel's
    ``no_restore_buffers``) leaves the next iteration the whole batch, as the loop's next
    one is (its storage is the batch's still: ``resize_`` to a shard keeps the storage).
    Without a train context nothing reshapes the inputs: it is returned as it is."""
    if train_context is nullcontext:
        return train_context

    @contextmanager
    def context() -> Iterator[None]:
        strided = [t for t in inputs if t.layout is torch.strided]  # (a sparse batch: not resized)
        layouts = [(t.size(), t.stride(), t.storage_offset()) for t in strided]
        try:
            with train_context():
                yield
        finally:
            with torch.no_grad():
                for t, (size, stride, offset) in zip(strided, layouts):
                    if (t.size(), t.stride(), t.storage_offset()) != (size, stride, offset):
                        t.as_strided_(size, stride, offset)

    return context


def _assign_optimizer_state(probe: Probe, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    probe.assign_role(
        Category.OPTIMIZER_STATE,
        local_tensors(
            v
            for opt in optimizers
            for state in opt.state.values()
            for v in tree_leaves(state)
            if isinstance(v, torch.Tensor)
        ),
    )
