"""What a traced block reads and writes outside its tensors, seen without touching it: the
interpreter's trace function over the frames of the user's code while the block runs.

Block replay stands one block's recorded events in for another's only where both run
the same program. Their structures (modules, attributes, parameters) are compared
beforehand; what a forward reads as it runs is watched here, where nothing the user's
code can look at changes (its classes, its instances and its registries are left as
they are; only ``sys.gettrace()`` sees the watch, and a tracer already set, a debugger's
or coverage's, is still called):

* an attribute the blocks hold different values of (transformers' ``layer_idx``): an
  attribute load of that name on any object (``self.layer_idx``, ``getattr(self,
  "layer_idx")``, a string constant of the name, ``__dict__``, ``vars``); but a load whose
  value goes straight into a call of ``update`` on a local variable, where the function
  called is one ``indexes`` accepts (``cache.update(k, v, self.layer_idx)``: a KV cache's,
  which picks one of its layers by the number: replay_caches.py), is counted apart
  (:attr:`Watch.indexed`; the frame's locals are not looked at, which would keep them);
* a global a function that ran assigns (``global calls; calls += 1``), or a variable of an
  enclosing function it assigns (``nonlocal calls``: a closure's, which outlives the
  call): the block changes state outside itself, and the next call may not do what this
  one did;
* the global plain values (a number, a string, a flag) the functions that ran load, kept
  with their values, so that a replay stands in only while every one is unchanged; a
  global list, dict, set or deque by its length (a block that appends its input to one
  changes it: that is a global assigned).

Attribute reads are seen instruction by instruction (a read in a branch not taken is no
read), in the frames whose code loads a watched name; globals by the frames that ran.
The loop's replay does not trace: it compares the globals of the modules that define the
model's classes at the start of each iteration (:func:`module_globals`).

The frames of torch's, this package's and Python's own code are not watched (they read
no user attribute by its name), only the user's and its libraries'; each code object's
instructions are looked at once.
"""

from __future__ import annotations

import collections
import dataclasses
import dis
import gc
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, Final

from pytest_torchmem.engine.tracing.replay_state import IMMUTABLE
from pytest_torchmem.engine.user.user_code import OWN_DIRS

__all__ = ["Watch", "cell_contents", "module_globals", "unchanged"]

_ATTRIBUTE_LOADS: Final = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})
#: The containers whose length a global's entry keeps (a list a block appends to).
_CONTAINERS: Final = (list, dict, set, collections.deque, bytearray)
_MISSING: Final = object()
#: The files not watched: torch's, this package's and Python's own (a directory's name
#: ends in its separator: torchvision's files are the user's), but packages installed
#: under Python's own directory.
_OWN: Final = tuple(d if d.endswith(".py") else d + os.sep for d in OWN_DIRS)
_PYTHON: Final = tuple(os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "platstdlib"))
_INSTALLED: Final = tuple(os.path.join(d, "") for d in {*site.getsitepackages(), site.getusersitepackages()})


def _not_users(path: str) -> bool:
    """Whether the file at ``path`` is torch's, this package's or Python's own."""
    return path.startswith(_OWN) or (path.startswith(_PYTHON) and not path.startswith(_INSTALLED))


def _entry(scope: dict[str, Any], name: str, value: Any) -> tuple[dict[str, Any], str, Any] | None:
    """A global as :attr:`Watch.globals` keeps it: a plain value by value, a container by
    its length; None for the rest (a builtin, a module, a function, a class, an object)."""
    kind = type(value)
    if kind in IMMUTABLE:
        return (scope, name, value)
    if kind in _CONTAINERS:
        return (scope, name, _Sized(value))
    return None


@dataclasses.dataclass(frozen=True)
class _Code:
    """What one code object's instructions do that a watch looks at (made once)."""

    reads: dict[int, str]  # by offset: an attribute load or a string constant (its name), __dict__, vars
    indexes: dict[int, int]  # by offset: an attribute load passed straight to ``<local>.update(...)``: the call's
    assigns: tuple[str, ...]  # the globals and closures' variables it assigns or deletes, in words
    loads: tuple[str, ...]  # the globals it loads


_NOTHING: Final = _Code({}, {}, (), ())
_CODES: dict[CodeType, _Code] = {}


def _code(code: CodeType) -> _Code:
    found = _CODES.get(code)
    if found is None:
        if _not_users(code.co_filename):
            found = _NOTHING
        else:
            reads: dict[int, str] = {}
            assigns: dict[str, None] = {}
            loads: dict[str, None] = {}
            for instruction in dis.get_instructions(code):
                name, argval = instruction.opname, instruction.argval
                if name in _ATTRIBUTE_LOADS:
                    reads[instruction.offset] = argval
                elif name == "LOAD_CONST" and type(argval) is str and argval != "__dict__":
                    # (getattr's name; not "__dict__" by name: object.__getattribute__(self,
                    # "__dict__") is how a class's own attribute lookup reads its instance)
                    reads[instruction.offset] = argval
                elif name in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                    assigns[f"the global {argval}"] = None
                elif name in ("STORE_DEREF", "DELETE_DEREF") and argval in code.co_freevars:
                    # (a nonlocal: the cell is the enclosing function's, kept by the closure)
                    assigns[f"the variable {argval} of a closure"] = None
                elif name in ("LOAD_GLOBAL", "LOAD_NAME"):
                    loads[argval] = None
                    if argval == "vars":
                        reads[instruction.offset] = argval
            found = _Code(reads, _update_arguments(code), tuple(assigns), tuple(loads))
        _CODES[code] = found
    return found


#: Instructions that push one value (or two) and do nothing else; and those that push none.
_PUSH_ONE: Final = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_CONST", "LOAD_SMALL_INT",
                              "LOAD_DEREF"})
_PUSH_TWO: Final = frozenset({"LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
_PUSH_NONE: Final = frozenset({"KW_NAMES", "PRECALL", "NOP"})
_LOCALS: Final = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"})


def _pushes(instruction: dis.Instruction) -> int | None:
    name = instruction.opname
    return 1 if name in _PUSH_ONE else 2 if name in _PUSH_TWO else 0 if name in _PUSH_NONE else None


def _update_arguments(code: CodeType) -> dict[int, int]:
    """The attribute loads of ``code`` whose value is an argument of a call of ``update``
    on a local variable, and nothing else (``cache.update(k, v, self.layer_idx, kwargs=kw)``:
    between the method and the call only loads of locals and constants), by offset: the
    call's offset."""
    ops = list(dis.get_instructions(code))
    found: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.opname != "LOAD_ATTR" or i < 3 or _pushes(ops[i - 1]) != 1:
            continue
        after, j = 0, i + 1
        while j < len(ops) and (pushed := _pushes(ops[j])) is not None:
            after, j = after + pushed, j + 1
        if j == len(ops) or ops[j].opname not in ("CALL", "CALL_KW") or ops[j].arg is None:
            continue
        if ops[j].opname == "CALL_KW":
            after -= 1  # (the keywords' names, a constant)
        before = ops[j].arg - 1 - after  # the arguments before this one
        if after < 0 or before < 0:
            continue
        k = i - 2
        while before > 0 and k >= 0 and (pushed := _pushes(ops[k])):
            before, k = before - pushed, k - 1
        method = ops[k] if k >= 1 and before == 0 else None
        if (
            method is not None
            and method.opname in ("LOAD_METHOD", "LOAD_ATTR")
            and method.argval == "update"
            and ops[k - 1].opname in _LOCALS
        ):
            found[op.offset] = ops[j].offset
    return found


class Watch:
    """While entered, watches the user's frames (see the module): :attr:`read` is the
    first of ``names`` read (instruction by instruction, in the frames whose code loads
    one), :attr:`indexed` how many reads of each of ``names`` went straight into a call of
    ``update`` whose code ``indexes`` accepts, :attr:`wrote` the first global or closure's variable a frame that ran assigns
    (or a global container whose length changed), in words, :attr:`globals` the plain
    globals and containers the frames that ran load, with their values as each frame
    began."""

    def __init__(self, names: frozenset[str] = frozenset(), indexes: Callable[[CodeType], bool] | None = None) -> None:
        self.names = names
        self._reads = names | {"__dict__", "vars"} if names else names
        self._indexes = indexes
        self.read: str | None = None
        self.indexed: dict[str, int] = {}
        #: a read handed to ``update``, until the function called is seen: (name, the call's offset)
        self._pending: tuple[str, int] | None = None
        self.wrote: str | None = None
        #: (the globals' dict, the name, the value read) of each plain global loaded
        self.globals: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = {}
        self._before: Callable[..., Any] | None = None
        self._asides: set[Any] = set()  # the garbage collector's callbacks' code
        self._aside = 0  # how deep in one (or in a finalizer) the program is

    def __enter__(self) -> Watch:
        self._asides = {getattr(getattr(cb, "__func__", cb), "__code__", None) for cb in gc.callbacks}
        self._aside = 0
        self._before = before = sys.gettrace()
        if before is not None:
            sys.settrace(self._call)
            return self
        # (the common case, called for every frame of the step: torch's own at once)
        known, nothing, call = _CODES.get, _NOTHING, self._call

        def first(frame: FrameType, event: str, arg: Any) -> Any:
            if known(frame.f_code) is nothing and self._pending is None:
                return None
            return call(frame, event, arg)

        sys.settrace(first)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._before)
        if self.wrote is None:
            changed = unchanged(tuple(self.globals.values()))
            self.wrote = None if changed is None else f"the global {changed}"

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        before = self._before
        theirs = before(frame, event, arg) if before is not None else None
        if self._aside:
            return theirs
        if self._pending is not None:
            # (the function a read was handed to: a KV cache's update, or a read)
            name, self._pending = self._pending[0], None
            if self._indexes is not None and self._indexes(frame.f_code):
                self.indexed[name] = self.indexed.get(name, 0) + 1
            elif self.read is None:
                self.read = name
        code = _code(frame.f_code)
        if code is _NOTHING:
            return theirs
        if frame.f_code in self._asides or frame.f_code.co_name == "__del__":
            # (a garbage collector's callback or a finalizer, run wherever the collector
            # ran: not the program's code; neither is what it calls)
            self._aside += 1

            def aside(frame: FrameType, event: str, arg: Any) -> Any:
                nonlocal theirs
                if event == "return":
                    self._aside -= 1
                if theirs is not None:
                    theirs = theirs(frame, event, arg)
                return aside

            return aside
        if code.assigns and self.wrote is None:
            self.wrote = code.assigns[0]
        if code.loads:
            scope = frame.f_globals
            for name in code.loads:
                key = (id(scope), name)
                if key not in self.globals:
                    entry = _entry(scope, name, scope.get(name, _MISSING))
                    if entry is not None:
                        self.globals[key] = entry
        reads, watched = code.reads, self._reads
        if self.read is not None or not watched or watched.isdisjoint(reads.values()):
            return theirs
        frame.f_trace_opcodes = True
        sites = code.indexes if self._indexes is not None else {}

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            nonlocal theirs
            if event == "opcode":
                offset = frame.f_lasti
                pending = self._pending
                if pending is not None and offset > pending[1]:
                    # (the call ran no Python function: not a KV cache's update)
                    self._pending = None
                    self.read = self.read or pending[0]
                name = reads.get(offset)
                if name is not None and name in watched and self.read is None:
                    call = sites.get(offset)
                    if call is not None and name in self.names:
                        self._pending = (name, call)
                        return local
                    self.read = name if name in self.names else f"{name} (every attribute)"
            elif theirs is not None:
                theirs = theirs(frame, event, arg)
            return local

        return local


class _Sized:
    """A global container as it was read: the object and its length."""

    __slots__ = ("container", "length")

    def __init__(self, container: Any) -> None:
        self.container = container
        self.length = len(container)

    def __eq__(self, other: object) -> bool:
        return other is self.container and len(self.container) == self.length

    __hash__ = None  # type: ignore[assignment]


def unchanged(reads: tuple[tuple[dict[str, Any], str, Any], ...]) -> str | None:
    """The first of the globals ``reads`` (:attr:`Watch.globals`) whose value changed since
    it was read (a container: another object, or another length), or None."""
    for scope, name, value in reads:
        now = scope.get(name, _MISSING)
        if now is not value and not value == now:
            return name
    return None


def module_globals(model: Any) -> tuple[tuple[dict[str, Any], str, Any], ...]:
    """The plain globals and global containers of the modules that define ``model``'s
    classes (and their bases, torch's and Python's own left out), as :attr:`Watch.globals`
    holds them, and the variables of the closures among them: what the loop's replay
    compares at the start of each iteration (a counter the forward steps, a flag it sets),
    at the cost of a look at those modules' globals."""
    modules: dict[str, None] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            modules[cls.__module__] = None
    found = []
    for name in modules:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if module is None or path is None or _not_users(path):
            continue
        scope = vars(module)
        for key, value in scope.items():
            if key.startswith("__"):
                continue
            entry = _entry(scope, key, value)
            if entry is not None:
                found.append(entry)
            elif type(value) is types.FunctionType and value.__closure__:
                # (a closure made at import, its variables stepped by ``nonlocal``: a counter)
                for name, cell in zip(value.__code__.co_freevars, value.__closure__):
                    cells = _Cell(cell)
                    entry = _entry(cells, f"{key}'s variable {name}", cells.get(name, _MISSING))
                    if entry is not None:
                        found.append(entry)
    return tuple(found)


def cell_contents(cell: Any, default: Any = None) -> Any:
    """What a closure's ``cell`` holds, ``default`` where it is not yet filled."""
    try:
        return cell.cell_contents
    except ValueError:
        return default


class _Cell:
    """A closure's variable, read as :func:`unchanged` reads a global from its scope."""

    __slots__ = ("cell",)

    def __init__(self, cell: Any) -> None:
        self.cell = cell

    def get(self, name: str, default: Any) -> Any:
        return cell_contents(self.cell, default)
