"""The arguments of one step (:func:`~pytest_torchmem.estimate`, :func:`~pytest_torchmem.measure`,
``torchmem.check``), validated once: :class:`StepRequest`."""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import inspect
from dataclasses import dataclass, is_dataclass
from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.figures.modelled_device import ModelledDevice, modelled_device
from pytest_torchmem.engine.step.compiling import CompileOptions, compile_options
from pytest_torchmem.engine.step.built_in import LossFn, OptimizerFactory
from pytest_torchmem.engine.step.step_function import step_function
from pytest_torchmem.engine.torch_compat.torch_private import private, private_name

__all__ = ["StepRequest", "step_request", "as_compiled", "has_compiled_modules"]

#: What ``module.compile()`` sets on a module (engine/torch_compat/torch_private.py).
_COMPILED_CALL: Final = private_name("torch.nn.Module._compiled_call_impl")


@dataclass(frozen=True)
class StepRequest:
    """Validated arguments of :func:`estimate` and :func:`measure`: the one object the
    entry points hand down, holding the device (with its profile, resolved once by the
    entry point) and the parallel rank."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: The device, and the GPU or CPU profile it follows once the entry point resolved it.
    device: ModelledDevice
    loss_fn: LossFn | None
    optimizer: OptimizerFactory | None
    train: bool
    #: Whether the model's output is held through backward (``keep_output=True``).
    keep_output: bool = False
    #: The rank of a parallel run to report (a :class:`~pytest_torchmem.Parallel`), or None.
    parallel: Any = None
    #: ``compile=``: the model is checked as ``torch.compile(model, **options)`` runs it.
    compile: CompileOptions | None = None
    #: The step runs that many times, as a loop calls it (a leak check), or None: once (the
    #: built-in step with an optimizer: a loop of two).
    repeat: int | None = None

    @property
    def rank(self) -> int:
        """The rank traced of :attr:`parallel` (0 without one; not ``"max"``: every rank
        is searched then, :mod:`~pytest_torchmem.engine.every_rank`)."""
        return 0 if self.parallel is None else int(self.parallel.rank)


def step_request(
    entry: str,
    model: Any,
    inputs: Any,
    device: Any,
    loss_fn: Any,
    optimizer: Any,
    train: Any,
    keep_output: Any = False,
    compile: Any = None,
    parallel: Any = None,
) -> StepRequest:
    """The validated request (``device``: a name, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``;
    its profile is the entry point's to resolve, :meth:`ModelledDevice.following`)."""
    if not isinstance(model, nn.Module) and not callable(model):
        raise TypeError(
            f"{entry}() needs an nn.Module or a step function as model, got "
            f"{type(model).__name__}"
        )
    if isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    elif isinstance(inputs, tuple):
        args, kwargs = inputs, {}
    elif isinstance(inputs, Mapping):  # a dict, a tokenizer's BatchEncoding, any Mapping
        bad = [key for key in inputs if not isinstance(key, str)]
        if bad:
            raise TypeError(f"keyword inputs need string keys, got {bad[0]!r}")
        args, kwargs = (), dict(inputs)
    else:
        hint = ""
        if isinstance(inputs, list):
            hint = "; pass a tuple for positional arguments"
        elif is_dataclass(inputs) and not isinstance(inputs, type):
            hint = "; pass (inputs,) to give it to the model as its one positional argument"
        raise TypeError(
            "inputs must be a tensor, a tuple of positional arguments or a mapping (a dict, "
            f"a BatchEncoding) of keyword arguments, got {type(inputs).__name__}{hint}"
        )
    if isinstance(device, torch.device):
        device = str(device)
    modelled = modelled_device(device)
    if isinstance(optimizer, torch.optim.Optimizer):  # it would hold the model's real parameters
        raise TypeError(
            "optimizer must be a factory that makes the optimizer from the parameters it is "
            f"given, not a {type(optimizer).__name__}; "
            "e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    for name, value in (("loss_fn", loss_fn), ("optimizer", optimizer)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    if not isinstance(train, bool):
        raise TypeError(f"train must be True or False, got {train!r}")
    if not isinstance(keep_output, bool):
        raise TypeError(f"keep_output must be True or False, got {keep_output!r}")
    if not isinstance(model, nn.Module):
        _check_takes_inputs(entry, model, args, kwargs)
        _check_function_options(entry, loss_fn, optimizer, train, keep_output, compile)
        return StepRequest(
            step_function(model, args, kwargs), args, kwargs, modelled, None, None, True, parallel=parallel
        )
    compiled = compile_options(compile)
    if compiled is not None and has_compiled_modules(model):
        raise ValueError(
            f"{entry}(compile=...) checks an eager model as torch.compile would run it, and "
            f"this {type(model).__name__} already holds compiled modules (torch.compile, "
            ".compile()); pass it without compile=, or pass the eager model"
        )
    return StepRequest(
        model, args, kwargs, modelled, loss_fn, optimizer, train, keep_output, parallel=parallel, compile=compiled
    )


def _check_takes_inputs(entry: str, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A callable that is not a module runs as a step function on the inputs; one that cannot
    take them is, as a rule, the model's factory (or class) passed in place of the model."""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    if isinstance(function, type) and issubclass(function, nn.Module):
        raise TypeError(
            f"{entry}() got the class {name}, not a model: pass a model made from it, "
            f"{entry}({name}(...), inputs)"
        )
    refusals = []
    # the signature as written, and the wrapper's own: a decorator that supplies arguments
    # of the function it wraps (functools.wraps) takes other inputs than the function
    for follow_wrapped in (True, False):
        try:
            signature = inspect.signature(function, follow_wrapped=follow_wrapped)
        except (TypeError, ValueError):  # no signature to read (a builtin, an extension's callable)
            return
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            refusals.append((signature, exc))
        else:
            return
    signature, exc = refusals[0]
    if not signature.parameters:
        raise TypeError(
            f"{entry}() runs a callable that is not an nn.Module as a step function on the inputs, "
            f"and {name}() takes no arguments: the model's factory was passed instead of the model; "
            f"pass the model it makes, {entry}({name}(), inputs)"
        )
    raise TypeError(
        f"{entry}() runs a callable that is not an nn.Module as a step function on the inputs, "
        f"and {name}{signature} cannot take them ({exc}): pass a step function's arguments as "
        f"its inputs, {entry}({name}, (arg, ...)), or, if {name} makes the model, the model "
        f"it makes, {entry}({name}(...), inputs)"
    )


def _check_function_options(entry: str, loss_fn: Any, optimizer: Any, train: Any, keep_output: Any, compile: Any) -> None:
    """A step function runs as written: the options of the built-in step do not apply."""
    given = [
        name
        for name, value, default in (
            ("loss_fn", loss_fn, None),
            ("optimizer", optimizer, None),
            ("train", train, True),
            ("keep_output", keep_output, False),
            ("compile", compile, None),
        )
        if value is not default
    ]
    if given:
        raise TypeError(
            f"{entry}() of a step function runs the function as written, so "
            f"{', '.join(given)}= (options of a model's built-in step) do not apply; compute "
            "the loss, step the optimizer (passed as an argument) and hold what you like in "
            "the function itself"
        )


def has_compiled_modules(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is compiled as a module
    (``torch.compile(module)``, ``module.compile()``)."""
    optimized_module = private("torch._dynamo.eval_frame.OptimizedModule")  # imports dynamo: here
    return any(
        isinstance(module, optimized_module) or getattr(module, _COMPILED_CALL, None) is not None
        for module in model.modules()
    )


def as_compiled(request: StepRequest) -> StepRequest:
    """``request`` with its model as ``torch.compile(model, **options)`` of ``compile=``
    (an ``OptimizedModule`` around the user's model, which is not changed)."""
    if request.compile is None:
        return request
    if request.parallel is not None:
        raise ValueError(
            "compile= and parallel= together are not supported: compile the model inside "
            "parallel.apply, or check the rank eagerly"
        )
    model = request.model
    had = set(model.__dict__)
    compiled = torch.compile(model, **request.compile.kwargs())
    # torch.compile marks the module it wraps (for nested compiled calls), and a library
    # that wraps torch.compile may note its arguments there (Lightning: _compile_kwargs)
    for name in set(model.__dict__) - had:
        del model.__dict__[name]
    return dataclasses.replace(request, model=compiled)
