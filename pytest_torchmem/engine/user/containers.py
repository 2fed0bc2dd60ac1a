"""The tensors inside inputs and outputs as users have them: nested containers of any kind.

A model's inputs and outputs are tensors in containers: tuples and lists,
dicts, a tokenizer's ``BatchEncoding`` (a ``UserDict``), any ``Mapping``,
dataclasses, named tuples, Hugging Face ``ModelOutput`` objects, nested in
each other. :func:`tensors_in` finds every tensor in such a value;
:func:`map_tensors` builds a copy of it with each tensor replaced, leaving the
value itself as it was (the stand-ins of the step are made this way, and the
user's inputs must come out of a check untouched).

Containers are recognised in this order: types ``torch.utils._pytree`` knows
(tuple, list, dict, ``NamedTuple``, ``OrderedDict``, ``defaultdict``,
``deque``, ``ModelOutput`` and any type registered with it), then any other
``Mapping``, then dataclass instances. Anything else is a leaf, passed through
as it is. A container that holds no tensor is passed through too (the same
object), so that a copy is only ever made where a tensor is replaced.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = ["map_tensors", "tensors_in"]

# torch's private names (engine/torch_compat/torch_private.py)
tree_flatten: Final = private("torch.utils._pytree.tree_flatten")
tree_unflatten: Final = private("torch.utils._pytree.tree_unflatten")

#: A dataclass field without a value.
_UNSET: Final = object()


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, in order (depth first; a tensor seen twice is listed twice)."""
    return list(_walk(value, set()))


def _walk(value: Any, active: set[int]) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
        return
    children = _children(value)
    if children is None:
        return
    if id(value) in active:
        raise ValueError(_cycle(value))
    active.add(id(value))
    for child in children:
        yield from _walk(child, active)
    active.discard(id(value))


def map_tensors(
    fn: Callable[[torch.Tensor], Any], value: Any, others: Callable[[Any], Any] | None = None
) -> Any:
    """``value`` with each tensor ``t`` in it replaced by ``fn(t)``, in :func:`tensors_in` order
    (and each other value that is no container by ``others(value)``, where given).

    Containers that hold tensors are rebuilt, never changed in place; a
    container met twice is rebuilt once (the copy keeps the sharing). Raises
    ``ValueError`` for a container that holds itself, and ``TypeError`` for a
    ``Mapping`` or dataclass holding tensors that cannot be rebuilt.
    """
    return _Mapper(fn, others).map(value)


class _Mapper:
    def __init__(self, fn: Callable[[torch.Tensor], Any], others: Callable[[Any], Any] | None = None) -> None:
        self.fn = fn
        self.others = others
        self.done: dict[int, Any] = {}
        self.active: set[int] = set()
        # Containers seen are kept alive, so that their ids stay theirs while mapping.
        self.seen: list[Any] = []

    def map(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.fn(value)
        key = id(value)
        if key in self.done:
            return self.done[key]
        children = _children(value)
        if children is None:
            return value if self.others is None else self.others(value)
        if key in self.active:
            raise ValueError(_cycle(value))
        self.active.add(key)
        self.seen.append(value)
        mapped = [self.map(child) for child in children]
        self.active.discard(key)
        if all(new is old for new, old in zip(mapped, children)):
            result = value  # nothing in it was replaced
        else:
            result = _rebuild(value, mapped)
        self.done[key] = result
        return result


def _cycle(value: Any) -> str:
    return (
        f"the inputs hold a {type(value).__name__} that contains itself; "
        "pass inputs without reference cycles"
    )


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


class _BelowRoot:
    """``is_leaf`` for one level of pytree flattening: every node but the root is a leaf.

    ``tree_flatten`` asks about the root first, then about its children. This
    keeps no reference to the root: ``tree_flatten`` keeps ``is_leaf`` in a
    reference cycle (its recursive helper) that lives until the garbage collector
    runs, and a closure over the root would keep the user's tensors alive with it
    (seen: the model's output held through backward).
    """

    __slots__ = ("asked",)

    def __init__(self) -> None:
        self.asked = False

    def __call__(self, node: Any) -> bool:
        root, self.asked = not self.asked, True
        return not root


#: Containers met at every module call, walked without pytree (the same children).
_PLAIN: Final = (tuple, list)


def _children(value: Any) -> list[Any] | None:
    """The direct children of a container, or None for a leaf."""
    kind = type(value)
    if kind in _PLAIN:
        return list(value)
    if kind is dict:
        return list(value.values())
    leaves, spec = tree_flatten(value, is_leaf=_BelowRoot())
    if not spec.is_leaf():
        return leaves
    if isinstance(value, Mapping):
        return list(value.values())
    if _is_dataclass_instance(value):
        # A field declared with init=False and never set has no attribute: a leaf.
        return [getattr(value, f.name, _UNSET) for f in dataclasses.fields(value)]
    return None


def _rebuild(value: Any, children: list[Any]) -> Any:
    """A copy of the container ``value`` holding ``children`` (in :func:`_children` order)."""
    kind = type(value)
    if kind in _PLAIN:
        return kind(children)
    if kind is dict:
        return dict(zip(value.keys(), children))
    _, spec = tree_flatten(value, is_leaf=_BelowRoot())
    if not spec.is_leaf():
        return tree_unflatten(children, spec)
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, children)
    return _rebuild_dataclass(value, children)


def _rebuild_mapping(value: Mapping[Any, Any], children: list[Any]) -> Mapping[Any, Any]:
    items = dict(zip(value.keys(), children))
    if isinstance(value, UserDict):
        # UserDict.__copy__ copies its ``data`` dict and keeps the other
        # attributes (a BatchEncoding's encodings): the copy is the user's
        # object with other values, the user's object is not touched.
        new = copy.copy(value)
        new.data = items
        return new
    try:
        new = type(value)(items)  # type: ignore[call-arg]
    except Exception as exc:
        raise TypeError(
            f"cannot copy the {type(value).__name__} in the inputs with stand-ins for its "
            f"tensors: {type(value).__name__}(dict) failed ({exc}); pass a dict instead"
        ) from None
    if not isinstance(new, Mapping) or list(new.keys()) != list(items):
        raise TypeError(
            f"cannot copy the {type(value).__name__} in the inputs with stand-ins for its "
            f"tensors: {type(value).__name__}(dict) does not hold the same keys; "
            "pass a dict instead"
        )
    return new


def _rebuild_dataclass(value: Any, children: list[Any]) -> Any:
    new = copy.copy(value)
    if new is value:
        raise TypeError(
            f"cannot copy the dataclass {type(value).__name__} in the inputs with stand-ins "
            "for its tensors: copy.copy() returned the object itself"
        )
    for f, child in zip(dataclasses.fields(value), children):
        if child is not _UNSET:
            # object.__setattr__: frozen dataclasses too; the copy is ours.
            object.__setattr__(new, f.name, child)
    return new
