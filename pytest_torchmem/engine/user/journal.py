"""The world as it was: what each holder held before a step function's call, put back after it.

:class:`Journal` records the contents of every holder the walk found
(:mod:`~pytest_torchmem.engine.user.reaching`) before the call, as references
(a dict's items, a list's items, an object's ``__slots__`` members, a cell's
contents, a function's defaults, the globals the code reads, a tensor's
``.grad`` and ``requires_grad``), and :meth:`Journal.restore` puts each back
after it, however the call ended: whatever the call wrote into an object that
existed before it (an attribute set, a buffer registered, a list appended to,
an optimizer's state, a gradient, a hook) is gone, and the stand-ins the call
ran on with it. Objects the call made are not the journal's: they are let go
with the stand-ins, unless a holder kept them, which it no longer does.

The journal must not keep alive what the program lets go of: a holder the
call drops (``scaler._per_optimizer_states = defaultdict(...)`` replaces a dict
the call filled) would die in a real run, and what the call put in it with
it. The journal holds it, to put it back; :meth:`Journal.drain` (at each
checkpoint of the step: :func:`checkpoint`, told by the phase watch) finds the
holders and objects nothing but the journal refers to any more and empties
them, freeing what the call put there as the real run frees it; they get
their contents back with the rest when the call ends.

Each holder is restored with its base type's own methods (an ``OrderedDict``'s
with ``OrderedDict``'s, never a subclass's, which may refuse), and only where
its contents changed. A holder that cannot be restored does not stop the
others: :meth:`restore` puts back all it can, then raises one
:class:`WorldNotRestored` that names each one it could not.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

import torch

from pytest_torchmem.engine.user.reaching import Holder

__all__ = ["Journal", "WorldNotRestored", "active", "checkpoint", "journaling", "refill"]

_MISSING: Final = object()


class WorldNotRestored(RuntimeError):
    """Some of the user's objects could not be put back as they were after the call."""


class Journal:
    """What each holder held (see the module)."""

    def __init__(self, holders: Iterable[Holder], paths: Mapping[int, str] | None = None) -> None:
        #: id() of the user's objects -> the path the walk reached each by (a leak check's names)
        self.paths: Mapping[int, str] = paths or {}
        self._entries: list[tuple[Holder, Any]] = []
        done: set[tuple[str, int, Any]] = set()
        for holder in holders:
            kind, obj, detail = holder
            key = (kind, id(obj), detail)
            if key in done:
                continue
            done.add(key)
            self._entries.append((holder, _record(kind, obj, detail)))
        self._count_own_references()

    def _count_own_references(self) -> None:
        """How many references the journal itself holds to each object it could have to
        drain (its entries' objects, and the objects its records hold), by id."""
        refs: dict[int, int] = {}
        drainable: dict[int, Any] = {}
        for (kind, obj, _), saved in self._entries:
            refs[id(obj)] = refs.get(id(obj), 0) + 1
            if kind in _DRAINED:
                drainable[id(obj)] = obj
            for value in _referenced(kind, saved):
                if type(value) in _NOTHING_HELD:
                    continue  # (never drained: its count is not needed)
                refs[id(value)] = refs.get(id(value), 0) + 1
                if id(value) not in drainable and _has_state(value):
                    drainable[id(value)] = value
        #: what drain() looks at, in the order recorded (entries first): one more reference
        self._drainable = list(drainable.values())
        #: the objects the entries record, by id; what drain() emptied of the others, with
        #: what they held (restore() puts it back)
        self._recorded = {id(obj) for (_, obj, _), _ in self._entries}
        self._emptied: list[tuple[Any, Any]] = []
        for obj in self._drainable:
            refs[id(obj)] += 1
        self._refs = refs

    def drain(self) -> None:
        """Empty every holder and object only the journal still refers to (see the module),
        until none is left."""
        drained: set[int] = self._drained
        while True:
            emptied = False
            for obj in self._drainable:
                if id(obj) in drained or sys.getrefcount(obj) - _OWN_CALL_REFS != self._refs[id(obj)]:
                    continue
                drained.add(id(obj))
                if id(obj) not in self._recorded:  # (no entry of its own puts it back)
                    self._emptied.append((obj, _contents(obj)))
                _empty(obj)
                emptied = True
            if not emptied:
                return

    _drained: set[int]

    def held_now(self) -> Iterator[tuple[str, Any]]:
        """``(path, value)`` of what the recorded containers, objects' attributes and cells
        hold now (a leak check looks for autograd graphs in them)."""
        for (kind, obj, _), _saved in self._entries:
            path = self.paths.get(id(obj), "")
            if kind == "dict":
                for key, value in list(dict.items(obj)):
                    if isinstance(key, str):
                        yield (f"{path}.{key}" if path else key), value
                    else:
                        yield f"{path}[{key!r}]", value
            elif kind == "list":
                for i, value in enumerate(list(list.__iter__(obj))):
                    yield f"{path}[{i}]", value
            elif kind == "cell":
                try:
                    yield path, obj.cell_contents
                except ValueError:
                    pass

    def restore(self) -> None:
        """Put every holder back as it was recorded (see the module)."""
        self._drainable = []
        failed: list[str] = []
        for obj, contents in reversed(self._emptied):
            _refill_emptied(obj, contents)
        self._emptied = []
        for (kind, obj, detail), saved in reversed(self._entries):
            try:
                _restore(kind, obj, detail, saved)
            except Exception as exc:  # noqa: BLE001 - the others are restored all the same
                failed.append(f"{type(obj).__name__} ({kind}): {type(exc).__name__}: {exc}")
        if failed:
            raise WorldNotRestored(
                "pytest-torchmem could not put back as they were: " + "; ".join(failed[:5])
                + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
                + " (please report it, with the step function)"
            )

    def advanced_generators(self) -> list[Any]:
        """The generators and iterators reached before the call that the call advanced
        and that cannot be rewound (a built-in iterator that can is rewound by
        :meth:`restore`)."""
        found = []
        for (kind, obj, _), saved in self._entries:
            if kind == "generator":
                frame = getattr(obj, "gi_frame", None) or getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
                now = None if frame is None else frame.f_lasti
                if now != saved:
                    found.append(obj)
            elif kind == "iterator" and not _same_position(_position(obj), saved):
                found.append(obj)
        return found


#: The holders drain() empties itself (an object's ``__dict__`` is a dict holder).
_DRAINED: Final = frozenset({"dict", "list", "set", "deque"})
#: The references sys.getrefcount sees in drain() beyond the journal's: its argument and
#: the loop's variable.
_OWN_CALL_REFS: Final = 2


def _referenced(kind: str, saved: Any) -> Iterator[Any]:
    """The objects a record holds a reference of its own to."""
    if kind == "dict":
        for key, value in saved:
            yield key
            yield value
    elif kind in ("list", "set", "members", "globals", "class"):
        yield from saved
    elif kind == "deque":
        yield from saved[0]
    elif kind == "cell":
        yield saved
    elif kind == "function":
        yield from saved


#: Values that hold nothing the call could put there (most of what records hold).
_NOTHING_HELD: Final = frozenset({type(None), bool, int, float, str, bytes, torch.dtype, torch.device})

#: Objects with attributes that drain() leaves alone: code, classes, tensors.
_NOT_DRAINED: Final = (
    type,
    torch.Tensor,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    functools.partial,
)


def _has_state(value: Any) -> bool:
    """Whether emptying ``value`` could free something: a container, or an object with
    attributes (not code, a class or a tensor)."""
    if isinstance(value, (dict, list, set, collections.deque)):
        return True
    if isinstance(value, _NOT_DRAINED):
        return False
    try:
        return type(object.__getattribute__(value, "__dict__")) is dict
    except AttributeError:
        return False


def _empty(obj: Any) -> None:
    """Let go of what ``obj`` holds (its contents come back with :meth:`Journal.restore`)."""
    if isinstance(obj, dict):
        refill(obj, [])
    elif isinstance(obj, list):
        list.clear(obj)
    elif isinstance(obj, set):
        set.clear(obj)
    elif isinstance(obj, collections.deque):
        collections.deque.clear(obj)
    else:
        try:
            own = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return
        if type(own) is dict:
            refill(own, [])


def _contents(obj: Any) -> Any:
    """What :func:`_empty` lets go of in ``obj``."""
    if isinstance(obj, dict):
        return list(dict.items(obj))
    if isinstance(obj, (list, set, collections.deque)):
        return list(obj)
    return list(object.__getattribute__(obj, "__dict__").items())


def _refill_emptied(obj: Any, contents: Any) -> None:
    """``obj``, emptied by :func:`_empty`, holding ``contents`` again."""
    if isinstance(obj, dict):
        refill(obj, contents)
    elif isinstance(obj, list):
        list.__setitem__(obj, slice(None), contents)
    elif isinstance(obj, set):
        set.update(obj, contents)
    elif isinstance(obj, collections.deque):
        collections.deque.extend(obj, contents)
    else:
        refill(object.__getattribute__(obj, "__dict__"), contents)


# -- the journal of the call on this thread, told when the step reaches a checkpoint ----------

_active = threading.local()


@contextmanager
def journaling(journal: Journal) -> Iterator[None]:
    """``journal`` is drained at each :func:`checkpoint` on this thread within the block."""
    stack = getattr(_active, "journals", None)
    if stack is None:
        stack = _active.journals = []
    journal._drained = set()
    stack.append(journal)
    try:
        yield
    finally:
        stack.pop()


def active() -> Journal | None:
    """The innermost journal of this thread (a step function's world being lent), or None."""
    stack = getattr(_active, "journals", None)
    return stack[-1] if stack else None


def checkpoint() -> None:
    """A point of the step where what the program let go of must be let go of: the
    innermost journal of this thread drains (see :meth:`Journal.drain`)."""
    stack = getattr(_active, "journals", None)
    if stack:
        stack[-1].drain()


def _record(kind: str, obj: Any, detail: Any) -> Any:
    if kind == "dict":
        return list(dict.items(obj))
    if kind == "list":
        return list(list.__iter__(obj))
    if kind == "set":
        return list(obj)
    if kind == "deque":
        return (list(obj), obj.maxlen)
    if kind == "members":
        return [_member(obj, name) for name in detail]
    if kind == "cell":
        try:
            return obj.cell_contents
        except ValueError:
            return _MISSING
    if kind == "function":
        return (obj.__defaults__, obj.__kwdefaults__, obj.__code__)
    if kind == "globals":
        return [obj.get(name, _MISSING) for name in detail]
    if kind == "partial":
        return obj.__reduce__()[2]
    if kind == "class":
        return [vars(obj).get(name, _MISSING) for name in detail]
    if kind == "tensor":
        return (obj.grad if obj.is_leaf else _MISSING, obj.requires_grad)
    if kind == "generator":
        return detail
    if kind == "type":
        return type(obj)
    if kind == "iterator":
        return _position(obj)
    raise ValueError(f"unknown holder kind {kind!r}")


def _position(iterator: Any) -> Any:
    """Where a built-in iterator is (its ``__reduce__``), or None where it does not say."""
    try:
        return iterator.__reduce__()
    except Exception:  # noqa: BLE001
        return None


def _same_position(a: Any, b: Any) -> bool:
    """Whether two ``__reduce__`` results are the same position: the same objects, and
    equal numbers."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_position(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float, str, bytes)) and type(a) is type(b):
        return a == b
    return a is b


def _member(obj: Any, name: str) -> Any:
    try:
        return object.__getattribute__(obj, name)
    except AttributeError:
        return _MISSING


def _same(now: list[Any], saved: list[Any]) -> bool:
    return len(now) == len(saved) and all(a is b for a, b in zip(now, saved))


def refill(holder: dict[Any, Any], items: list[tuple[Any, Any]]) -> None:
    """``holder`` holding ``items``, in order, through its base type's own methods (an
    ``OrderedDict``'s keep their order; a subclass's methods, which may refuse, are not
    called)."""
    if isinstance(holder, collections.OrderedDict):
        collections.OrderedDict.clear(holder)
        for key, value in items:
            collections.OrderedDict.__setitem__(holder, key, value)
    else:
        dict.clear(holder)
        dict.update(holder, items)


def _restore(kind: str, obj: Any, detail: Any, saved: Any) -> None:
    if kind == "dict":
        now = list(dict.items(obj))
        if len(now) == len(saved) and all(a is c and b is d for (a, b), (c, d) in zip(now, saved)):
            return
        refill(obj, saved)
    elif kind == "list":
        if not _same(list(list.__iter__(obj)), saved):
            list.__setitem__(obj, slice(None), saved)
    elif kind == "set":
        if set(map(id, obj)) != set(map(id, saved)):
            set.clear(obj)
            set.update(obj, saved)
    elif kind == "deque":
        items, _ = saved
        if not _same(list(obj), items):
            collections.deque.clear(obj)
            collections.deque.extend(obj, items)
    elif kind == "members":
        for name, value in zip(detail, saved):
            if _member(obj, name) is value:
                continue
            descriptor = _descriptor(type(obj), name)
            if value is _MISSING:
                descriptor.__delete__(obj)
            else:
                descriptor.__set__(obj, value)
    elif kind == "cell":
        if saved is _MISSING:
            try:
                del obj.cell_contents
            except ValueError:
                pass
        elif _cell(obj) is not saved:
            obj.cell_contents = saved
    elif kind == "function":
        defaults, kwdefaults, code = saved
        if obj.__defaults__ is not defaults:
            obj.__defaults__ = defaults
        if obj.__kwdefaults__ is not kwdefaults:
            obj.__kwdefaults__ = kwdefaults
        if obj.__code__ is not code:
            obj.__code__ = code
    elif kind == "globals":
        for name, value in zip(detail, saved):
            if value is _MISSING:
                obj.pop(name, None)
            elif obj.get(name, _MISSING) is not value:
                obj[name] = value
    elif kind == "partial":
        func, args, keywords, attributes = obj.__reduce__()[2]
        if not (func is saved[0] and _same(list(args), list(saved[1])) and keywords is saved[2] and attributes is saved[3]):
            obj.__setstate__(saved)
    elif kind == "class":
        for name, value in zip(detail, saved):
            now = vars(obj).get(name, _MISSING)
            if now is value:
                continue
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
    elif kind == "tensor":
        grad, requires_grad = saved
        _restore_tensor(obj, grad, requires_grad)
    elif kind == "type":
        if type(obj) is not saved:
            object.__setattr__(obj, "__class__", saved)
    elif kind == "iterator":
        now = _position(obj)
        if not _same_position(now, saved) and isinstance(saved, tuple) and len(saved) > 2 and saved[2] is not None:
            setstate = getattr(obj, "__setstate__", None)
            if setstate is not None and _same_position(now[:2], saved[:2]):
                setstate(saved[2])  # rewound (a list's, a range's iterator)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


def _descriptor(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(name)


def _restore_tensor(t: torch.Tensor, grad: Any, requires_grad: bool) -> None:
    if grad is not _MISSING and t.grad is not grad:
        t.grad = grad
    if t.is_leaf and t.requires_grad != requires_grad:
        t.requires_grad_(requires_grad)
