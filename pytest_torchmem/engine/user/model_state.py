"""A model's tensors, swapped for stand-ins during a step and put back after.

Both the fake trace (fake tensors) and the real measurement (clones) run the
user's model on tensors of their own: :func:`collect` finds every tensor the
model holds (parameters, buffers, tensor attributes, gradients),
:func:`convert` makes a stand-in for each (tensors that share a storage get
stand-ins that share one), and :func:`substituted` puts the stand-ins in the
model for the duration of a ``with`` block and the originals back after it,
whatever happens inside. The user's model ends as it began.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from pytest_torchmem.engine.user.containers import map_tensors
from pytest_torchmem.engine.user.layouts import parts, sparse_like
from pytest_torchmem.engine.figures.report import Category, Unsupported
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.user.twins import twin

__all__ = [
    "Converted",
    "converter",
    "Slot",
    "ModelTensors",
    "StandIns",
    "collect",
    "convert",
    "HookError",
    "hook_failure",
    "substituted",
]

SlotKind = Literal["parameter", "buffer", "attribute"]

# torch's private names (engine/torch_compat/torch_private.py)
_DisableTorchDispatch = private("torch._C._DisableTorchDispatch")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a model holds a tensor: ``module.<kind>[name]``."""

    module: nn.Module
    kind: SlotKind
    name: str
    tensor: torch.Tensor


@dataclass
class ModelTensors:
    """Every tensor slot of a model, in ``named_modules`` order (shared ones repeated)."""

    slots: list[Slot] = field(default_factory=list)
    #: What the model's modules hold, to be put back after the step (the holders of
    #: :mod:`pytest_torchmem.engine.user.journal`; set by ``holdings.holdings_of``).
    holders: list[Any] = field(default_factory=list)

    def unique(self, kind: SlotKind) -> list[torch.Tensor]:
        seen: set[int] = set()
        found = []
        for slot in self.slots:
            if slot.kind == kind and id(slot.tensor) not in seen:
                seen.add(id(slot.tensor))
                found.append(slot.tensor)
        return found


def collect(model: nn.Module) -> ModelTensors:
    """Find the tensors ``model`` holds, tied ones once per slot."""
    found = ModelTensors()
    for path, module in model.named_modules():
        for name, param in module._parameters.items():
            if isinstance(param, nn.parameter.UninitializedParameter):
                where = f"{path}.{name}" if path else name
                raise ValueError(
                    f"the model's parameter {where} ({type(module).__name__}) is not initialized yet: "
                    "a lazy module makes its parameters at its first forward; run the model once "
                    "on a sample batch (model(batch)) before checking it"
                )
            if param is not None:
                found.slots.append(Slot(module, "parameter", name, param))
        for name, buf in module._buffers.items():
            if buf is not None:
                found.slots.append(Slot(module, "buffer", name, buf))
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not name.startswith("__"):
                found.slots.append(Slot(module, "attribute", name, value))
    return found


@dataclass(frozen=True)
class StandIns:
    """How to make stand-ins on one device.

    ``dense(t)`` makes a stand-in with ``t``'s shape and strides on a storage of
    its own (used when ``t`` spans its whole storage, the common case);
    ``storage(t)`` makes a stand-in for ``t``'s whole storage, which the
    stand-ins of the tensors sharing it then view; ``sparse(t, parts)`` makes
    the stand-in of a sparse tensor from the stand-ins of its parts
    (``layouts.parts``), made as the dense tensors' are.
    """

    device: torch.device
    dense: Callable[[torch.Tensor], torch.Tensor]
    storage: Callable[[torch.Tensor], torch.UntypedStorage]
    #: Turns a fresh stand-in into a parameter: ``(tensor, requires_grad) -> parameter``.
    parameter: Callable[[torch.Tensor, bool], torch.Tensor] = nn.Parameter
    #: ``(sparse tensor, its parts' stand-ins) -> its stand-in``; None: a sparse tensor
    #: like it that holds them (``layouts.sparse_like``).
    sparse: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor] | None = None


def _uninitialized(t: torch.Tensor, make: StandIns) -> torch.Tensor:
    """The stand-in of a lazy module's uninitialized parameter or buffer: uninitialized
    too, on the stand-ins' device, made real (of the shape the module's first forward
    gives it) where the module materializes it. A fake one is a fake tensor of a class
    that is uninitialized until then (torch's cannot wrap one)."""
    new = make.dense(torch.empty(0, dtype=t.dtype))
    if type(new) is torch.Tensor:  # a real one (measure)
        return type(t)(requires_grad=t.requires_grad, device=new.device, dtype=t.dtype)
    new.requires_grad_(t.requires_grad)
    if isinstance(t, nn.Parameter):
        new._is_param = True  # (what makes a fake tensor an nn.Parameter)
    new.__class__ = _uninitialized_class(type(new))
    return new


@functools.cache
def _uninitialized_class(kind: type) -> type:
    """A ``kind`` (a fake tensor's class) that is uninitialized until materialized."""

    def materialize(self: Any, shape: Any, device: Any = None, dtype: Any = None) -> None:
        self.__class__ = kind
        with torch.no_grad():
            self.set_(torch.empty(shape, device=device or self.device, dtype=dtype or self.dtype))

    return type("Uninitialized" + kind.__name__, (nn.parameter.UninitializedTensorMixin, kind), {
        "cls_to_become": kind,
        "materialize": materialize,
        "__module__": __name__,
    })


def _spans_its_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its whole storage with no element stored twice (an
    expanded tensor shares its elements: it is a view of a smaller storage)."""
    if t.storage_offset() != 0 or any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        return False
    span = 0
    if t.numel():
        span = (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()
    return span == t.untyped_storage().nbytes()


def converter(make: StandIns, on_hook_error: HookError | None = None) -> _Converter:
    """A converter of tensors into stand-ins made by ``make``, one per tensor (``t`` -> its
    stand-in, called as ``converter(t)``), sharing storages as the tensors do and carrying
    parameters' hooks; ``.gradients()`` then gives the stand-ins their gradients' stand-ins,
    ``.originals`` maps a stand-in's id to its tensor."""
    return _Converter(make, on_hook_error)


class _Converter:
    """Converts tensors one by one; tensors that share a storage share the new one."""

    def __init__(self, make: StandIns, on_hook_error: HookError | None = None) -> None:
        self.make = make
        self.on_hook_error = on_hook_error
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.with_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.keyed = _KeyedByParameter()
        #: id(stand-in) -> the tensor it stands in for.
        self.originals: dict[int, torch.Tensor] = {}
        #: id(a sparse tensor's stand-in) -> (stand-in, original) of its parts.
        self.sparse_parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def gradients(self) -> None:
        """Give the stand-ins the stand-ins of their originals' ``.grad``, after
        everything else: stand-ins are made in the order the trace charges them."""
        for original, new in self.with_grads:
            new.grad = self(original.grad)  # type: ignore[arg-type]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        done = self.tensors.get(id(t))
        if done is not None:
            return done
        if nn.parameter.is_lazy(t):
            new = self.tensors[id(t)] = _uninitialized(t, self.make)
            self.originals[id(new)] = t
            return new
        if t.layout is torch.strided:
            new = self._dense(t)
        else:
            new = self._sparse(t)
        if isinstance(t, nn.Parameter):
            new = self.make.parameter(new, t.requires_grad)
            if new.requires_grad:
                _carry_hooks(t, new, self.on_hook_error, self.keyed)
        elif t.requires_grad:
            new.requires_grad_(True)
        self.tensors[id(t)] = new
        self.originals[id(new)] = t
        if t.grad is not None and new.requires_grad:
            self.with_grads.append((t, new))
        return new

    def _dense(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        storage = self.storages.get(key)
        if storage is None and _spans_its_storage(t):
            new = self.make.dense(t)
            self.storages[key] = new.untyped_storage()
        else:
            if storage is None:
                storage = self.storages[key] = self.make.storage(t)
            new = torch.empty(0, dtype=t.dtype, device=self.make.device)
            new.set_(storage, t.storage_offset(), t.shape, t.stride())
        return new

    def _sparse(self, t: torch.Tensor) -> torch.Tensor:
        """A sparse tensor's stand-in; its parts' stand-ins share storages as dense
        tensors' do (a sparse gradient's indices that view the input's, say)."""
        with _DisableTorchDispatch():  # the user's tensor's own parts, whatever mode is on
            held = parts(t)
        if not held:
            raise ValueError(
                f"a tensor of layout {t.layout} holds memory the engine cannot see; "
                "convert it (to_dense()) before the step"
            )
        made: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in held:
            new = self.tensors[id(p)] = self._dense(p)
            self.originals[id(new)] = p  # (which holds the part: no other takes its id)
            made.append((new, p))
        new_parts = tuple(new for new, _ in made)
        if self.make.sparse is None:
            new = sparse_like(t, new_parts, self.make.device)
        else:
            new = self.make.sparse(t, new_parts)
        self.sparse_parts[id(new)] = made
        return new


#: Told a parameter hook that raised on a stand-in: ``(hook, exception)``.
HookError = Callable[[Callable[..., Any], Exception], None]


def _tables_of(hook: Callable[..., Any], original: torch.Tensor) -> list[dict[Any, Any]]:
    """The dicts ``hook`` reaches by name (its closure, the globals it reads) that
    hold ``original`` as a key: where a hook looks its parameter up."""
    code = getattr(hook, "__code__", None)
    if code is None:
        return []
    reached: list[Any] = []
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            reached.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    names = getattr(hook, "__globals__", {})
    reached += [names[name] for name in code.co_names if name in names]
    tables: list[dict[Any, Any]] = []
    for value in reached:
        # By identity: ``in`` compares a tensor with a key of equal hash (an int id).
        if isinstance(value, dict) and not any(value is t for t in tables):
            if any(key is original for key in value):
                tables.append(value)
    return tables


class _KeyedByParameter:
    """Per-parameter dicts (the PyTorch tutorial's ``{p: optimizer}`` for an
    optimizer step fused into backward) seen from the step's stand-ins.

    A hook gets the stand-in, not the model's parameter, so a lookup by the
    parameter would fail. For each dict a hook reads that holds its parameter,
    :meth:`add` prepares the stand-in's twin of the parameter's value: a copy
    of an optimizer that steps the stand-ins (its own state: the user's
    optimizer is not touched), the stand-in of a tensor, or the value itself.
    :meth:`bound` puts them in the dict under the stand-in for the hook's call
    only, and takes them out after it, whatever happens.
    """

    def __init__(self) -> None:
        self.twins: dict[int, list[tuple[dict[Any, Any], Any]]] = {}
        self.pending: list[tuple[Callable[..., Any], torch.Tensor, torch.Tensor]] = []

    def add(self, hook: Callable[..., Any], original: torch.Tensor, standin: torch.Tensor) -> None:
        self.pending.append((hook, original, standin))

    def prepare(self, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Make the twins, once every tensor of the model has its stand-in."""
        for hook, original, standin in self.pending:
            twins = self.twins.setdefault(id(standin), [])
            for table in _tables_of(hook, original):
                if not any(table is seen for seen, _ in twins):
                    twins.append((table, twin(table[original], convert)))
        self.pending.clear()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The twins that are optimizers: their state is optimizer state."""
        found: dict[int, torch.optim.Optimizer] = {}
        for twins in self.twins.values():
            for _, twin in twins:
                if isinstance(twin, torch.optim.Optimizer):
                    found.setdefault(id(twin), twin)
        return list(found.values())

    @contextmanager
    def bound(self, standin: torch.Tensor) -> Iterator[None]:
        added: list[dict[Any, Any]] = []
        try:
            for table, twin in self.twins.get(id(standin), ()):
                if standin not in table:
                    table[standin] = twin
                    added.append(table)
            yield
        finally:
            for table in added:
                table.pop(standin, None)


def _carry_hooks(
    original: torch.Tensor,
    standin: torch.Tensor,
    on_error: HookError | None,
    keyed: _KeyedByParameter,
) -> None:
    """Register ``original``'s tensor hooks (``register_hook``) and post-accumulate-grad
    hooks (``register_post_accumulate_grad_hook``: the optimizer step fused into
    backward) on its stand-in, so that the step runs them as eager runs them.

    A hook gets the stand-in, not the model's parameter: one that looks the
    parameter up in a dict it reads (a dict of per-parameter optimizers keyed
    by it) finds the stand-in's twin there (:class:`_KeyedByParameter`). One
    that fails on the stand-in all the same raises; with ``on_error`` its
    exception is told there instead of ending the step.
    """

    def guarded(hook: Callable[..., Any]) -> Callable[..., Any]:
        keyed.add(hook, original, standin)

        def run(argument: Any) -> Any:
            with keyed.bound(standin):
                if on_error is None:
                    return hook(argument)
                try:
                    return hook(argument)
                except Exception as exc:  # noqa: BLE001 - told, not raised (see above)
                    on_error(hook, exc)
                    return None

        return run

    for hook in list((original._backward_hooks or {}).values()):
        standin.register_hook(guarded(hook))
    for hook in list((getattr(original, "_post_accumulate_grad_hooks", None) or {}).values()):
        standin.register_post_accumulate_grad_hook(guarded(hook))


def hook_failure(hook: Callable[..., Any], exc: Exception) -> Unsupported:
    """What a report says of a parameter hook that raised on the step's stand-in."""
    code = getattr(hook, "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    name = getattr(hook, "__qualname__", repr(hook))
    return Unsupported(
        f"parameter hook {name}",
        f"it raised {type(exc).__name__} on the step's stand-in of the parameter "
        "(a hook that finds the model's parameter other than in a dict it reads "
        "cannot run on the stand-in); its effect is not in these figures",
        where,
    )


@dataclass
class Converted:
    """Stand-ins for a model's tensors and for the step's inputs."""

    model: dict[int, torch.Tensor]  # id(original) -> stand-in
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    parameters: list[torch.Tensor]
    buffers: list[torch.Tensor]
    attributes: list[torch.Tensor]
    inputs: list[torch.Tensor]
    #: Optimizers that parameter hooks step (twins of the user's: see _KeyedByParameter).
    hook_optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    #: id(stand-in) -> the tensor it stands in for.
    originals: dict[int, torch.Tensor] = field(default_factory=dict)
    #: A step function's optimizers (the user's, holding the stand-ins while it runs).
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    #: id(a sparse tensor's stand-in) -> (stand-in, original) of its parts.
    sparse_parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    #: The stand-ins of the optimizers' state (a step function's optimizers hold them while
    #: it runs; a twin's state is read from the twin).
    state: list[torch.Tensor] = field(default_factory=list)

    @property
    def gradients(self) -> list[torch.Tensor]:
        return [t.grad for t in self.parameters + self.inputs if t.grad is not None]

    def baseline_groups(self) -> tuple[tuple[Category, list[torch.Tensor]], ...]:
        """The tensors live before the step, by category (a storage in several counts in
        the first)."""
        state = self.state or [
            value
            for optimizer in self.optimizers
            for entries in optimizer.state.values()
            for value in entries.values()
            if isinstance(value, torch.Tensor)
        ]
        return (
            (Category.PARAMETERS, self.parameters),
            (Category.BUFFERS, self.buffers + self.attributes),
            (Category.INPUTS, self.inputs),
            (Category.GRADIENTS, self.gradients),
            (Category.OPTIMIZER_STATE, state),
        )


def convert(
    model_tensors: ModelTensors,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    make: StandIns,
    on_hook_error: HookError | None = None,
) -> Converted:
    """Make stand-ins for the model's tensors and the inputs' tensors; the parameters'
    hooks are carried to their stand-ins (see :func:`_carry_hooks`)."""
    convert_one = _Converter(make, on_hook_error)
    parameters = [convert_one(t) for t in model_tensors.unique("parameter")]
    buffers = [convert_one(t) for t in model_tensors.unique("buffer")]
    attributes = [convert_one(t) for t in model_tensors.unique("attribute")]
    inputs: list[torch.Tensor] = []

    def convert_input(t: torch.Tensor) -> torch.Tensor:
        if not t.is_leaf:  # an intermediate result: its stand-in is a leaf
            t = t.detach().requires_grad_(t.requires_grad)
        new = convert_one(t)
        inputs.append(new)
        return new

    # Every tensor in the inputs' containers (dicts, BatchEncodings, dataclasses,
    # named tuples, ...), in copies of those containers: the user's stay as they are.
    new_args, new_kwargs = map_tensors(convert_input, (args, kwargs))
    convert_one.gradients()
    convert_one.keyed.prepare(convert_one)
    return Converted(
        model=dict(convert_one.tensors),
        args=new_args,
        kwargs=new_kwargs,
        parameters=parameters,
        buffers=buffers,
        attributes=attributes,
        inputs=inputs,
        hook_optimizers=convert_one.keyed.optimizers(),
        originals=convert_one.originals,
        sparse_parts=convert_one.sparse_parts,
    )


@contextmanager
def substituted(model_tensors: ModelTensors, standins: dict[int, torch.Tensor]) -> Iterator[None]:
    """Put the stand-ins in the model's slots; put the originals back on exit."""
    done: list[Slot] = []
    try:
        for slot in model_tensors.slots:
            _put(slot, standins[id(slot.tensor)])
            done.append(slot)
        yield
    finally:
        for slot in reversed(done):
            _put(slot, slot.tensor)


def _put(slot: Slot, tensor: torch.Tensor) -> None:
    if slot.kind == "parameter":
        slot.module._parameters[slot.name] = tensor  # type: ignore[assignment]
    elif slot.kind == "buffer":
        slot.module._buffers[slot.name] = tensor
    else:
        slot.module.__dict__[slot.name] = tensor
