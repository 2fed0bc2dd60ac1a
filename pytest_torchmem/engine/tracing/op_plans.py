"""What the tracker knows of each op before it runs it: its schema's facts and the device's rules for it.

An op's plan is worked out at its first call in a trace (:class:`OpPlanner`)
and read at every later one: which rules of the device model replace its
kernel, add its scratch, refuse what the real kernel refuses or run its
composite kernel, which of its arguments it writes, and how its outputs'
values are known. The schema's part (:func:`op_facts`) is the same in every
trace and worked out once per process. The Python numbers a call passes where
the op takes a Tensor (:func:`wrapped_numbers`) cost CPU memory: ATen wraps
each in a 0-dim tensor for the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.rules import (
    CheckRule,
    CompositeRule,
    Formula,
    ImplementationRule,
    OpCall,
    RuleSet,
    ScratchRule,
)
from pytest_torchmem.engine.tracing.values import ValueKind, value_kind

__all__ = ["OpFacts", "OpPlan", "OpPlanner", "number_nbytes", "op_facts", "wrapped_numbers", "written"]

FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")

# Ops through which torch.tensor(...) hands a freshly made real tensor to the
# fake mode, which turns it into a fake constant (its value stays known).
_LIFTS: Final = frozenset(
    {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}
)


@dataclass(frozen=True, slots=True)
class OpFacts:
    """What an op's schema tells the tracker (the same in every trace)."""

    name: str
    localize: bool
    mutable: bool
    tensor_slots: tuple[tuple[int, str], ...]
    written_slots: tuple[tuple[int, str], ...]
    values: ValueKind
    #: Whether its output depends on its arguments' values (``.item()``, ``equal``,
    #: ``nonzero``: the tags ATen gives such ops), however the trace answers it.
    reads_values: bool


def op_facts(func: Any) -> OpFacts:
    """The :class:`OpFacts` of ``func``, worked out once per process."""
    found = _FACTS.get(id(func))
    if found is None or found[0] is not func:
        arguments = func._schema.arguments
        facts = OpFacts(
            name=str(func),
            localize=func not in _LIFTS,
            mutable=func._schema.is_mutable,
            tensor_slots=tuple(
                (i, arg.name) for i, arg in enumerate(arguments) if isinstance(arg.type, torch.TensorType)
            ),
            written_slots=tuple(
                (i, arg.name)
                for i, arg in enumerate(arguments)
                if arg.alias_info is not None and arg.alias_info.is_write
            ),
            values=value_kind(func),
            reads_values=_READS_VALUES.intersection(func.tags) != set(),
        )
        found = _FACTS[id(func)] = (func, facts)
    return found[1]


_READS_VALUES: Final = frozenset((torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape))

#: :func:`op_facts` by ``id(op)``, with the op (which keeps the id its own).
_FACTS: dict[int, tuple[Any, OpFacts]] = {}


@dataclass(frozen=True, slots=True)
class OpPlan:
    """What the tracker needs to know about an op, worked out once per op and trace."""

    #: The op (held, so that its id, the plan's key, stays its own).
    func: Any
    name: str
    localize: bool
    implementation: ImplementationRule | None
    scratch: ScratchRule | None
    mutable: bool
    #: ``(position, name)`` of the arguments the schema types as Tensor.
    tensor_slots: tuple[tuple[int, str], ...]
    #: ``(position, name)`` of the arguments the op writes into.
    written_slots: tuple[tuple[int, str], ...] = ()
    #: Refuses what the real kernel refuses (raises its error), if the op has such a rule.
    check: CheckRule | None = None
    #: Runs the op's composite kernel with the tracker active, if the op has such a rule.
    composite: CompositeRule | None = None
    #: How its outputs' values are known.
    values: ValueKind = ValueKind.OPAQUE
    #: The eager backward formula of the node it makes, if the device replaces it.
    formula: Formula | None = None
    #: Whether it is the op's plan for sparse arguments (see :meth:`OpPlanner.sparse_plan`).
    sparse: bool = False
    #: Whether its output depends on its arguments' values (:attr:`OpFacts.reads_values`).
    reads_values: bool = False


class OpPlanner:
    """The plans of one trace's ops, from the device's ``rules``, made at each op's first call.

    ``unfollowed_sparse(call)`` runs a call with a sparse argument that no rule of
    the device follows (the tracker's: it lists or stops the trace).
    """

    def __init__(self, rules: RuleSet, unfollowed_sparse: Callable[[OpCall], Any]) -> None:
        self.rules: Final = rules
        self._unfollowed_sparse = unfollowed_sparse
        self._plans: dict[int, OpPlan] = {}  # id(op) -> plan
        self._sparse_plans: dict[int, OpPlan] = {}  # id(op) -> its plan for sparse arguments

    def plan(self, func: Any) -> OpPlan:
        """``func``'s plan in this trace."""
        # Keyed by id: an OpOverload hashes in Python, a cost paid on every op; the
        # plan holds its op, so the id stays its own while the plan exists.
        plan = self._plans.get(id(func))
        if plan is None:
            facts = op_facts(func)
            rules = self.rules
            plan = self._plans[id(func)] = OpPlan(
                func=func,
                name=facts.name,
                localize=facts.localize,
                implementation=rules.implementation_rule(func),
                scratch=rules.scratch_rule(func),
                check=rules.check_rule(func),
                composite=rules.composite_rule(func),
                mutable=facts.mutable,
                tensor_slots=facts.tensor_slots,
                written_slots=facts.written_slots,
                values=facts.values,
                formula=rules.formula_rule(func),
                reads_values=facts.reads_values,
            )
        return plan

    def sparse_plan(self, plan: OpPlan) -> OpPlan:
        """``plan`` for a call with a sparse argument: the device's sparse rule makes its
        outputs (the dense rules' scratch, checks and composites are for dense
        arguments); without one, ``unfollowed_sparse`` (see rules.py)."""
        found = self._sparse_plans.get(id(plan.func))
        if found is None:
            rule = self.rules.sparse_rule(plan.func)
            found = self._sparse_plans[id(plan.func)] = dataclasses.replace(
                plan,
                implementation=rule if rule is not None else self._unfollowed_sparse,
                scratch=None,
                check=None,
                composite=None,
                formula=None,
                sparse=True,
            )
        return found


def written(plan: OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments ``plan``'s op writes into."""
    return tuple(
        args[index] if index < len(args) else kwargs.get(name) for index, name in plan.written_slots
    )


# -- Python numbers passed where an op takes a Tensor --------------------------------------

# The 0-dim tensor ATen wraps a Python number in for the call (``scalar_to_tensor`` in
# aten/src/ATen/ScalarOps.h, marked a wrapped number): a bool as torch.bool, an int as
# torch.int64, a float as torch.float64, a complex as torch.complex128. Autograd saves
# that tensor where a node saves the argument (``DivBackward0._saved_other``), which
# tests/test_torch_constants.py reads on the running torch.
#: Bytes of a wrapped bool (``torch.bool``).
WRAPPED_BOOL_NBYTES: Final = 1
#: Bytes of a wrapped complex (``torch.complex128``).
WRAPPED_COMPLEX_NBYTES: Final = 16
#: Bytes of a wrapped int or float (``torch.int64``, ``torch.float64``).
WRAPPED_NUMBER_NBYTES: Final = 8


def number_nbytes(value: Any) -> int:
    """Bytes of the 0-dim tensor ATen wraps the Python number ``value`` in (0 if not one)."""
    if isinstance(value, bool):
        return WRAPPED_BOOL_NBYTES
    if isinstance(value, complex):
        return WRAPPED_COMPLEX_NBYTES
    if isinstance(value, (int, float)):
        return WRAPPED_NUMBER_NBYTES
    return 0


def wrapped_numbers(plan: OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(slot name, value)`` of the Python numbers passed where the op takes a Tensor.

    Eager PyTorch wraps such a number in a 0-dim CPU tensor (int64, double,
    complex128 or bool) for the duration of the call.
    """
    found = []
    for index, name in plan.tensor_slots:
        value = args[index] if index < len(args) else kwargs.get(name)
        # (mostly a fake tensor, told apart by its type alone)
        if type(value) is not FakeTensor and number_nbytes(value):
            found.append((name, value))
    return found
