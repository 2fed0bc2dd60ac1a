"""The per-op rule registry.

A device model describes, per aten op, what the fake trace cannot see:

* **scratch rules** say which buffers a kernel takes from the allocator and
  gives back before it returns (the CPU mm's operand copies, cuDNN
  workspaces): a list of :class:`Alloc` and :class:`Free` steps around the
  :data:`OUTPUTS` marker;
* **implementations** replace the fake kernel of an op whose meta kernel is
  missing or wrong for the device: they return the op's outputs, made with
  other (fake) ops;
* **fallbacks** stand in for an op whose output depends on tensor values
  (``nonzero``, ``.item()``), which fake tensors cannot run: where the trace
  knows the values that decide the output (:meth:`OpCall.value`) they return
  the exact outputs and no reason; otherwise the largest possible outputs and
  a reason, and the op is listed in the report's ``unsupported``;
* **formulas** replace the backward formula of an op whose eager algorithm the
  trace cannot take (``cumprod_backward`` picks it by tensor values, and by
  ``areAnyTensorSubclassLike``, which fake tensors always are): the node's
  formula runs unrecorded, then the rule's Python replica of the eager formula
  runs through the trace, and its gradients replace the node's;
* **checks** refuse, before the fake kernel runs, the arguments the device's
  real kernel refuses (operands of two dtypes for a matrix product), raising
  what the real kernel raises, with its message: the estimate fails where the
  step would;
* **composites** run an op's composite kernel with the trace watching, for
  ops whose fake kernel runs that composite out of the trace's sight (a
  ``CompositeExplicitAutograd`` op with no meta kernel): the ops it calls are
  traced, and charged, one by one;
* **sparse rules** replace the fake kernel of a call with a sparse argument
  (a COO tensor: its memory is in its parts, ``engine/user/layouts.py``): the
  fake kernel does not know how many elements a sparse result specifies
  (it makes none), so the rule makes the result's parts as the device's
  kernel does, with dense ops the trace records (``call.default()`` where
  the fake kernel is right: a part's accessor, a constructor). A call with a
  sparse argument and no such rule runs its fake kernel and is listed in
  ``unsupported``; a call on a compressed sparse tensor (CSR, ...) with no
  rule stops the trace, listed.

Adding an op is one decorated function::

    @CPU.scratch(aten.mm.default)
    def _mm(call: OpCall) -> Steps:
        return [OUTPUTS, Alloc("a", 4096)]

A rule for an op that already has one is refused (:class:`ValueError`), so
that no rule silently shadows another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = [
    "Alloc",
    "Free",
    "Keep",
    "Inexact",
    "Output",
    "OUTPUTS",
    "TraceContext",
    "OpCall",
    "RuleSet",
    "ScratchRule",
    "ImplementationRule",
    "FallbackRule",
    "CheckRule",
    "CompositeRule",
    "Formula",
    "FormulaCall",
    "REPLICA",
    "Steps",
]

# torch's private names (engine/torch_compat/torch_private.py)
OpOverload: Final = private("torch._ops.OpOverload")
OpOverloadPacket: Final = private("torch._ops.OpOverloadPacket")


@dataclass(frozen=True, slots=True)
class Alloc:
    """The kernel takes ``nbytes`` from the allocator, named ``tag`` until freed."""

    tag: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Free:
    """The kernel gives back the buffer named ``tag``."""

    tag: str


@dataclass(frozen=True, slots=True)
class Keep:
    """The kernel takes ``nbytes`` that outlive the call (a library's cached
    workspace): live from here to the end of the step."""

    tag: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Inexact:
    """The rule knows it does not model this call fully: the estimate lists the op
    (with ``reason`` and the user's source line) in ``unsupported``."""

    reason: str


@dataclass(frozen=True, slots=True)
class Output:
    """The kernel makes the op's output ``index`` here; the others are made at
    :data:`OUTPUTS` (or after the last step). For kernels that make their outputs
    one by one with scratch in between (a convolution's input gradient, then its
    weight gradient)."""

    index: int


@dataclass
class TraceContext:
    """What rules may read about the trace they run in, and keep state in."""

    #: The modelled device: ``"cpu"`` or ``"cuda"``.
    device: str
    #: The GPU profile (:class:`~pytest_torchmem.engine.tracing.devices.cuda.profiles.GpuProfile`) on cuda.
    gpu: Any = None
    #: The CPU profile (:class:`~pytest_torchmem.engine.tracing.devices.cpu.profiles.CpuProfile`) on cpu.
    cpu: Any = None
    #: Per-trace state of rules (e.g. which library workspaces exist already).
    memo: dict[str, Any] = field(default_factory=dict)
    #: The values the trace knows (:class:`~pytest_torchmem.engine.tracing.values.KnownValues`).
    values: Any = None
    #: The trace's dispatch mode: ``with context.tracer.decomposed():`` runs ops
    #: through the trace (recorded, composites decomposed), from inside a rule;
    #: ``context.tracer.fake_kernel(op, args, kwargs)`` runs an op's own fake kernel.
    tracer: Any = None


class _Outputs:
    __slots__ = ()

    def __repr__(self) -> str:
        return "OUTPUTS"


#: Where, among a scratch rule's steps, the op's outputs are allocated.
OUTPUTS: Final = _Outputs()

Step: TypeAlias = "Alloc | Free | Keep | Inexact | Output | _Outputs"
Steps: TypeAlias = Sequence[Step]


@dataclass(frozen=True, slots=True)
class OpCall:
    """One call of an op in the trace, as a rule sees it (fake tensors)."""

    func: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: The op's outputs (``None`` for implementation rules, which make them).
    out: Any = None
    #: The trace this call belongs to.
    context: TraceContext | None = None

    def default(self) -> Any:
        """The op's own kernel on the call's arguments, as if no rule were registered
        (in a trace: the fake kernel, run directly by the trace's fake mode)."""
        tracer = self.context.tracer if self.context is not None else None
        if tracer is not None:
            return tracer.fake_kernel(self.func, self.args, self.kwargs)
        return self.func(*self.args, **self.kwargs)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """The argument at position ``index``, or given by keyword as ``name``, else ``default``."""
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)

    @property
    def gpu(self) -> Any:
        """The GPU profile the call's trace models (None outside one, or on cpu)."""
        return self.context.gpu if self.context is not None else None

    def value(self, t: Any) -> torch.Tensor | None:
        """The real value of the fake tensor ``t`` where the trace knows it (a small
        tensor computed from the step's real inputs), else ``None``. Read only."""
        values = self.context.values if self.context is not None else None
        return None if values is None else values.of(t)


#: Set (in ``Node.metadata``) while a node's :class:`Formula` replica runs.
REPLICA: Final = "torchmem_replica"


@dataclass(frozen=True, slots=True)
class FormulaCall:
    """One run of a backward node whose formula a :class:`Formula` replaces."""

    #: The autograd node (``CumprodBackward0``).
    node: Any
    #: Its incoming gradients (``grads``; ``grad`` is ``grads[0]``).
    grads: tuple[Any, ...]
    #: Which of its gradients the engine asked for (``task_should_compute_output``).
    needed: tuple[bool, ...]
    context: TraceContext | None = None

    def saved(self, name: str) -> Any:
        """The node's saved ``name`` (``self``, ``result``, ``dim``)."""
        value = getattr(self.node, f"_saved_{name}")
        values = self.context.values if self.context is not None else None
        if values is not None and isinstance(value, torch.Tensor):
            values.alias(value)  # an output saved by autograd is a new tensor on its storage
        return value


@dataclass(frozen=True)
class Formula:
    """A backward formula run as eagerly: ``backward`` returns the node's gradients."""

    #: The autograd node the forward op makes.
    node: str
    backward: Callable[[FormulaCall], Sequence[Any]]
    #: The saved tensors the replica reads (``_saved_<name>``): with unpack hooks
    #: (a checkpoint's) the node's own formula runs instead.
    saved: tuple[str, ...] = ()
    #: Whether the replica applies to this run (the node's own formula runs otherwise).
    applies: Callable[[FormulaCall], bool] = lambda call: True


ScratchRule: TypeAlias = Callable[[OpCall], "Steps | None"]
ImplementationRule: TypeAlias = Callable[[OpCall], Any]
#: Returns ``(outputs, reason)``; the reason is ``None`` where the outputs are exact.
FallbackRule: TypeAlias = Callable[[OpCall], "tuple[Any, str | None]"]
#: Raises what the device's real kernel raises for arguments it refuses; returns None otherwise.
CheckRule: TypeAlias = Callable[[OpCall], None]
#: Runs the op's composite kernel (with the tracker active); returns the outputs.
CompositeRule: TypeAlias = Callable[[OpCall], Any]

#: An op to register a rule for; None stands for an op this torch release does not
#: have (``torch_private.private_op``), for which nothing is registered.
OpLike: TypeAlias = "OpOverload | OpOverloadPacket | None"


def _overloads(ops: Iterable[OpLike]) -> list[OpOverload]:
    found: list[OpOverload] = []
    for op in ops:
        if op is None:
            continue
        if isinstance(op, OpOverloadPacket):
            found.extend(getattr(op, name) for name in op.overloads())
        elif isinstance(op, OpOverload):
            found.append(op)
        else:
            raise TypeError(f"a rule is registered for aten ops, got {op!r}")
    return found


class RuleSet:
    """The rules of one device model, keyed by op overload."""

    def __init__(self, device: str) -> None:
        self.device: Final = device
        self._scratch: dict[OpOverload, ScratchRule] = {}
        self._implementations: dict[OpOverload, ImplementationRule] = {}
        self._fallbacks: dict[OpOverload, FallbackRule] = {}
        self._checks: dict[OpOverload, CheckRule] = {}
        self._composites: dict[OpOverload, CompositeRule] = {}
        self._formulas: dict[OpOverload, Formula] = {}
        self._sparse: dict[OpOverload, ImplementationRule] = {}

    def __repr__(self) -> str:
        return (
            f"RuleSet({self.device!r}, {len(self._scratch)} scratch rules, "
            f"{len(self._implementations)} implementations, {len(self._fallbacks)} fallbacks)"
        )

    def scratch(self, *ops: OpLike) -> Callable[[ScratchRule], ScratchRule]:
        """Register a scratch rule for ``ops`` (overloads or whole packets)."""
        return self._register(self._scratch, "scratch", ops)

    def implementation(self, *ops: OpLike) -> Callable[[ImplementationRule], ImplementationRule]:
        """Register an implementation that replaces the fake kernel of ``ops``."""
        return self._register(self._implementations, "implementation", ops)

    def fallback(self, *ops: OpLike) -> Callable[[FallbackRule], FallbackRule]:
        """Register a stand-in for value-dependent ``ops`` that fake tensors cannot run."""
        return self._register(self._fallbacks, "fallback", ops)

    def formula(
        self, *ops: OpLike, node: str, saved: tuple[str, ...] = (), applies: Any = None
    ) -> Callable[[Callable[[FormulaCall], Sequence[Any]]], Callable[[FormulaCall], Sequence[Any]]]:
        """Register the eager backward formula of the ``node`` that ``ops`` make."""
        register = self._register(self._formulas, "formula", ops)

        def decorate(backward: Callable[[FormulaCall], Sequence[Any]]) -> Any:
            extra = {} if applies is None else {"applies": applies}
            register(Formula(node, backward, saved, **extra))
            return backward

        return decorate

    def formula_rule(self, func: OpOverload) -> Formula | None:
        return self._formulas.get(func)

    def check(self, *ops: OpLike) -> Callable[[CheckRule], CheckRule]:
        """Register a check of the arguments of ``ops`` that raises as the real kernel does."""
        return self._register(self._checks, "check", ops)

    def composite(self, *ops: OpLike) -> Callable[[CompositeRule], CompositeRule]:
        """Register a function that runs ``ops``' composite kernel with the trace
        watching: the ops the composite calls are traced one by one."""
        return self._register(self._composites, "composite", ops)

    def sparse(self, *ops: OpLike) -> Callable[[ImplementationRule], ImplementationRule]:
        """Register what ``ops`` make, and allocate, when an argument is a sparse tensor."""
        return self._register(self._sparse, "sparse", ops)

    def sparse_rule(self, func: OpOverload) -> ImplementationRule | None:
        return self._sparse.get(func)

    def composite_rule(self, func: OpOverload) -> CompositeRule | None:
        return self._composites.get(func)

    def check_rule(self, func: OpOverload) -> CheckRule | None:
        return self._checks.get(func)

    def scratch_rule(self, func: OpOverload) -> ScratchRule | None:
        return self._scratch.get(func)

    def implementation_rule(self, func: OpOverload) -> ImplementationRule | None:
        return self._implementations.get(func)

    def fallback_rule(self, func: OpOverload) -> FallbackRule | None:
        return self._fallbacks.get(func)

    def ops(self) -> dict[str, list[str]]:
        """The registered ops by kind, for documentation and tests."""
        return {
            "scratch": sorted(str(op) for op in self._scratch),
            "implementation": sorted(str(op) for op in self._implementations),
            "fallback": sorted(str(op) for op in self._fallbacks),
            "check": sorted(str(op) for op in self._checks),
            "composite": sorted(str(op) for op in self._composites),
            "formula": sorted(str(op) for op in self._formulas),
            "sparse": sorted(str(op) for op in self._sparse),
        }

    def copy(self, device: str | None = None) -> RuleSet:
        """A copy (for ``device``) that can take more rules without changing this one."""
        other = RuleSet(device or self.device)
        other._scratch.update(self._scratch)
        other._implementations.update(self._implementations)
        other._fallbacks.update(self._fallbacks)
        other._checks.update(self._checks)
        other._composites.update(self._composites)
        other._formulas.update(self._formulas)
        other._sparse.update(self._sparse)
        return other

    def _register(
        self, table: dict[OpOverload, Any], kind: str, ops: Sequence[OpLike]
    ) -> Callable[[Any], Any]:
        if not ops:
            raise ValueError(f"a {kind} rule needs at least one op")
        overloads = _overloads(ops)

        def decorate(rule: Any) -> Any:
            for op in overloads:
                if op in table:
                    raise ValueError(
                        f"{self.device}: {op} already has a {kind} rule "
                        f"({getattr(table[op], 'backward', table[op]).__qualname__}); "
                        "remove it before adding another"
                    )
            for op in overloads:
                table[op] = rule
            return rule

        return decorate


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of a dense, contiguous tensor with ``t``'s shape and dtype."""
    return t.numel() * t.element_size()
