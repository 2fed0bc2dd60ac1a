"""What a step function reaches of the user's world: found before the call, by a walk.

``tm.estimate(trainer.train_step, (batch,))`` runs code that reaches the user's
objects by many paths: its arguments at any depth (containers, dataclasses,
objects' attributes), the bound ``self``, a ``functools.partial``'s arguments, a
callable object, default values, closures, the globals it and its helpers read
(and the attributes it reads of the user's own modules), the class attributes
of the user's classes. :func:`reach` walks them all, as the function could, and
writes down:

- every **tensor slot**: where a tensor sits (a module's parameter, buffer or
  attribute, a list's item, a dict's value or key, an object's attribute or
  ``__slots__`` member, a closure cell, a default value, a global), with the
  **role** the tensor plays (:class:`Role`: a parameter, an optimizer's state,
  an input, a dataset's data, ...), so that each gets its stand-in for the call;
- every **holder**: each mutable object on the way (dicts, lists, sets, objects'
  ``__dict__``, cells, functions' defaults, the globals read), which
  :mod:`~pytest_torchmem.engine.user.journal` records before the call and puts
  back after it, so that nothing the call writes into them survives it;
- the **modules** (by the path that reaches them first) and **optimizers**, whose
  calls and steps mark the phases of the step.

The walk follows Python's own references and nothing else: it reads ``__dict__``
and ``__slots__`` (never properties or ``__getattr__``), iterates the built-in
containers with their base types' methods (never a subclass's), and reads the
globals of the user's code by the names its bytecode loads as globals. Code
under the interpreter's and the installed packages' directories is the
libraries': their objects are walked, their globals and class attributes are
not (a library's registries are not the user's world). Process machinery
(loggers, threads, streams, modules, pytest) is not walked.
"""

from __future__ import annotations

import collections
import dis
import enum
import functools
import os
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import nn

__all__ = ["ARGUMENTS", "Holder", "Role", "Slot", "World", "reach", "is_library_code"]

#: The holder of the call's own arguments' slots (the call is given copies of them).
ARGUMENTS: Final = object()


class Role(enum.IntEnum):
    """What a tensor is to the step; where one tensor is reached in several roles, the
    strongest (the lowest) is its own."""

    #: A module's parameter, or a parameter an optimizer steps that no module holds.
    PARAMETER = 0
    #: A module's buffer.
    BUFFER = 1
    #: A module's other tensor attributes (and tensors in its other attributes).
    ATTRIBUTE = 2
    #: An optimizer's state.
    STATE = 3
    #: An optimizer's step count, which torch keeps on the host beside parameters on a
    #: GPU (unless the optimizer is ``capturable`` or ``fused``).
    HOST_STATE = 4
    #: A tensor among the arguments, or held by any other object the step reaches
    #: (a trainer's attribute, a closure's, a global, a grad scaler's scale).
    INPUT = 5
    #: A tensor a dataset, data loader or sampler holds: the host's data, which the
    #: step reads (its batches are made in the step); never a stand-in.
    DATA = 6


#: Where a slot's tensor sits: ``parameter``/``buffer``/``attribute`` of a module
#: (``holder`` the module), ``item`` of a dict or list, ``key`` of a dict, ``member``
#: (an object's ``__slots__``), ``cell`` (a closure's), ``default`` (a function's
#: ``__defaults__``), ``partial`` (a ``functools.partial``'s ``args``), ``argument``
#: (of the call itself: ``name`` an index or a keyword).
SLOT_KINDS: Final = (
    "parameter",
    "buffer",
    "attribute",
    "item",
    "key",
    "member",
    "cell",
    "default",
    "partial",
    "argument",
)


@dataclass(slots=True)
class Slot:
    """One place a tensor sits (``value``: the tensor, or a tuple that holds tensors,
    given a copy that holds their stand-ins), the role of the tensors there, and the
    path by which the walk reached it (for messages)."""

    holder: Any
    kind: str
    name: Any
    value: Any
    role: Role
    path: str
    #: 0 for what the call is given (its arguments), 1 for what it reaches otherwise:
    #: the inputs are made in this order.
    rank: int = 1

    @property
    def module(self) -> Any:  # as model_state.Slot names it, for the module kinds
        return self.holder

    @property
    def tensor(self) -> Any:
        return self.value


#: A mutable object the journal records: ``(kind, object, detail)`` where kind is
#: ``dict``, ``list``, ``set``, ``deque``, ``members`` (detail: the slot names),
#: ``cell``, ``function`` (its defaults), ``globals`` (detail: the names read),
#: ``partial``, ``class`` (detail: the attribute names), ``type`` (an object's class),
#: ``tensor`` (its ``.grad``, ``requires_grad``), ``generator`` and ``iterator`` (their
#: positions: an iterator over a list is rewound, a generator cannot be).
Holder = tuple[str, Any, Any]


@dataclass
class World:
    """What :func:`reach` found (see the module)."""

    slots: list[Slot] = field(default_factory=list)
    holders: list[Holder] = field(default_factory=list)
    #: The modules reached, by the path that reached each first (submodules not listed).
    modules: dict[str, nn.Module] = field(default_factory=dict)
    #: id() of every module reached, submodules included.
    module_ids: set[int] = field(default_factory=set)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    #: Every object walked, kept alive (and its id its own) while the world is used.
    objects: list[Any] = field(default_factory=list)
    #: id() of each object walked (a container, an object, its ``__dict__``, a cell) -> the
    #: path that reached it first, as the user's code names it (``trainer.losses``): what a
    #: leak check says holds what grows. (Ids only: valid while the world is lent.)
    paths: dict[int, str] = field(default_factory=dict)

    def release(self) -> None:
        """Let go of what the walk holds (the journal holds what it needs): from here on
        the world keeps nothing of the user's alive that the program lets go of."""
        self.slots = []
        self.holders = []
        self.objects = []
        self.modules = {}

    def roles(self) -> dict[int, Role]:
        """Each tensor's role (by id): the strongest it is reached in."""
        found: dict[int, Role] = {}
        for slot in self.slots:
            for t in tensors_of(slot.value):
                role = found.get(id(t))
                if role is None or slot.role < role:
                    found[id(t)] = slot.role
        return found


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a slot's value: itself, or those in its (nested) tuple."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, frozenset)):
        for item in value:
            yield from tensors_of(item)


# -- what is the library's and what the user's -----------------------------------------


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    dirs |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    dirs.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # ours
    return tuple(sorted(os.path.join(os.path.abspath(d), "") for d in dirs))


_LIBRARY_DIRS: Final = _library_dirs()


@functools.lru_cache(maxsize=4096)
def is_library_code(filename: str) -> bool:
    """Whether ``filename`` is the interpreter's, an installed package's or this
    package's code (``<frozen ...>`` too); the rest is the user's."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS) or "site-packages" in filename


@functools.lru_cache(maxsize=4096)
def _is_user_class(cls: type) -> bool:
    module = sys.modules.get(getattr(cls, "__module__", "") or "")
    filename = getattr(module, "__file__", None)
    return filename is not None and not is_library_code(filename)


# -- what is not walked ------------------------------------------------------------------

#: Values with nothing of the user's inside.
_ATOMS: Final = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    range,
    slice,
    type(Ellipsis),
    type(NotImplemented),
    torch.dtype,
    torch.device,
    torch.Size,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    types.ModuleType,
    types.CodeType,
    types.FrameType,
    types.TracebackType,
    weakref.ProxyType,
    weakref.CallableProxyType,
    property,
    staticmethod,
    classmethod,
)

#: The atoms met most (a module's flags and sizes), told apart by type alone.
_PLAIN_ATOMS: Final = frozenset({type(None), bool, int, float, str})

#: The process's machinery: objects of types from these modules are not walked (a
#: logger reaches every logger of the process, a thread its frames).
_MACHINERY: Final = (
    "logging",
    "threading",
    "_thread",
    "io",
    "_io",
    "socket",
    "ssl",
    "select",
    "selectors",
    "asyncio",
    "concurrent",
    "multiprocessing",
    "subprocess",
    "importlib",
    "typing",
    "re",
    "warnings",
    "abc",
    "inspect",
    "ast",
    "tokenize",
    "pytest",
    "_pytest",
    "pluggy",
    "pytest_torchmem",
    "numpy",
    "unittest.mock",
    "torch._C",
    "torch._dynamo",
    "torch._inductor",
    "torch._subclasses",
    "torch.fx",
    "torch.utils.hooks",
    "torch.distributed",
    "torch.jit",
    "tokenizers",
    "pyarrow",
)


@functools.lru_cache(maxsize=4096)
def _is_machinery(cls: type) -> bool:
    module = getattr(cls, "__module__", None) or ""
    return module.split(".", 1)[0] in _MACHINERY or module.startswith(_MACHINERY)


def _data_types() -> tuple[type, ...]:
    from torch.utils import data

    found: list[type] = [data.Dataset, data.IterableDataset, data.DataLoader, data.Sampler]
    iterator = getattr(data.dataloader, "_BaseDataLoaderIter", None)
    if isinstance(iterator, type):
        found.append(iterator)
    return tuple(found)


# -- globals, by the names the bytecode loads --------------------------------------------

_GLOBAL_OPS: Final = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


@functools.lru_cache(maxsize=4096)
def global_names(code: types.CodeType) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The global names ``code`` (and the code nested in it) reads or writes, each with
    the attribute names read of it right after (``mylib.CACHE``: ``("mylib", ("CACHE",))``)."""
    found: dict[str, set[str]] = {}
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname in _GLOBAL_OPS and isinstance(ins.argval, str):
            attrs = found.setdefault(ins.argval, set())
            following = instructions[i + 1] if i + 1 < len(instructions) else None
            if following is not None and following.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                attrs.add(str(following.argval))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            for name, attrs in global_names(const):
                found.setdefault(name, set()).update(attrs)
    return tuple((name, tuple(sorted(attrs))) for name, attrs in found.items())


# -- the walk ------------------------------------------------------------------------------

#: How deep the walk goes (nested containers and objects); beyond it, nothing is walked.
_DEPTH: Final = 120


class _Walker:
    def __init__(self) -> None:
        self.world = World()
        self.seen: set[int] = set()
        #: id(tuple) -> whether it holds tensors (tuples are values, walked once each).
        self.tuples: dict[int, bool] = {}
        #: (id of a globals dict, name) already walked
        self.globals_seen: set[tuple[int, str]] = set()
        self.data_types = _data_types()
        self.rank = 1

    # -- entry points ------------------------------------------------------------------

    def call(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str]) -> None:
        """The function and what it is called with; ``names``: the arguments' names."""
        self.rank = 0
        for i, value in enumerate(args):
            self.value(value, ARGUMENTS, "argument", i, Role.INPUT, names[i] if i < len(names) else f"args[{i}]", 0)
        for key, value in kwargs.items():
            self.value(value, ARGUMENTS, "argument", key, Role.INPUT, key, 0)
        self.rank = 1
        self.value(function, None, "", None, Role.INPUT, "", 0)

    # -- one value in one place ---------------------------------------------------------

    def value(self, v: Any, holder: Any, kind: str, name: Any, role: Role, path: str, depth: int) -> None:
        """Walk ``v``, found at ``holder``'s ``kind``/``name``; record its slot if it is a
        tensor or a tuple that holds one."""
        if type(v) in _PLAIN_ATOMS:
            return
        if isinstance(v, torch.Tensor):
            if holder is not None:
                self.world.slots.append(Slot(holder, kind, name, v, role, path, self.rank))
            self.tensor(v, role, path, depth)
            return
        if isinstance(v, (tuple, frozenset)) and type(v) is not torch.Size:
            if self.immutable(v, role, path, depth) and holder is not None:
                self.world.slots.append(Slot(holder, kind, name, v, role, path, self.rank))
            return
        self.object(v, role, path, depth)

    def immutable(self, v: Any, role: Role, path: str, depth: int) -> bool:
        """Walk a tuple (or frozenset); whether it holds tensors (then a copy holding their
        stand-ins takes its place for the call)."""
        known = self.tuples.get(id(v))
        if known is not None:
            return known
        self.tuples[id(v)] = False
        self.world.objects.append(v)
        holds = False
        if depth < _DEPTH:
            for i, item in enumerate(v):
                if isinstance(item, torch.Tensor):
                    self.tensor(item, role, f"{path}[{i}]", depth + 1)
                    holds = True
                elif isinstance(item, (tuple, frozenset)) and type(item) is not torch.Size:
                    holds = self.immutable(item, role, f"{path}[{i}]", depth + 1) or holds
                else:
                    self.object(item, role, f"{path}[{i}]", depth + 1)
        self.tuples[id(v)] = holds
        return holds

    def tensor(self, t: torch.Tensor, role: Role, path: str, depth: int) -> None:
        """A tensor's own Python state (its ``.grad``, ``requires_grad``, attributes set on
        it, its hooks' closures)."""
        if id(t) in self.seen:
            return
        self.seen.add(id(t))
        self.world.objects.append(t)
        self.world.holders.append(("tensor", t, None))
        attributes = _own_dict(t)
        if attributes:
            self.dict(attributes, role, path, depth)
        for hooks in (getattr(t, "_backward_hooks", None), getattr(t, "_post_accumulate_grad_hooks", None)):
            if hooks:
                for hook in list(hooks.values()):
                    self.object(hook, Role.INPUT, f"{path} hook", depth + 1)

    def object(self, v: Any, role: Role, path: str, depth: int) -> None:
        if isinstance(v, _ATOMS) or id(v) in self.seen or depth >= _DEPTH:
            return
        if isinstance(v, type):
            if _is_user_class(v):
                self.seen.add(id(v))
                self.world.objects.append(v)
                self.user_class(v, depth)
            return
        kind = type(v)
        if _is_machinery(kind) and not isinstance(v, (nn.Module, torch.optim.Optimizer)):
            return
        self.seen.add(id(v))
        self.world.objects.append(v)
        self.world.paths.setdefault(id(v), path)
        if isinstance(v, nn.Module):
            self.module(v, path, depth, top=True)
        elif isinstance(v, torch.optim.Optimizer):
            self.optimizer(v, path, depth)
        elif isinstance(v, dict):
            self.dict(v, role, path, depth)
            if kind is not dict:  # (a ModelOutput holds its fields as attributes too)
                self.attributes(v, role, path, depth)
        elif isinstance(v, list):
            self.world.holders.append(("list", v, None))
            for i, item in enumerate(list.__iter__(v)):
                self.value(item, v, "item", i, role, f"{path}[{i}]", depth + 1)
            if kind is not list:
                self.attributes(v, role, path, depth)
        elif isinstance(v, (set, collections.deque)):
            self.world.holders.append(("set" if isinstance(v, set) else "deque", v, None))
            for item in list(v):
                if isinstance(item, torch.Tensor):
                    self.world.slots.append(Slot(v, "item", item, item, role, path, self.rank))
                    self.tensor(item, role, path, depth + 1)
                else:
                    self.value(item, None, "", None, role, path, depth + 1)
        elif isinstance(v, types.FunctionType):
            self.function(v, path, depth)
        elif isinstance(v, types.MethodType):
            self.value(v.__self__, None, "", None, role, _join(path, "__self__") if path else "self", depth + 1)
            self.value(v.__func__, None, "", None, role, path, depth + 1)
        elif isinstance(v, functools.partial):
            self.partial(v, role, path, depth)
        elif isinstance(v, types.BuiltinMethodType):
            owner = getattr(v, "__self__", None)
            if owner is not None and not isinstance(owner, types.ModuleType):
                self.value(owner, None, "", None, role, path, depth + 1)
        elif isinstance(v, weakref.ref):
            referent = v()
            if referent is not None and not isinstance(referent, torch.Tensor):
                self.value(referent, None, "", None, role, path, depth + 1)
        elif isinstance(v, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
            frame = getattr(v, "gi_frame", None) or getattr(v, "cr_frame", None) or getattr(v, "ag_frame", None)
            self.world.holders.append(("generator", v, None if frame is None else frame.f_lasti))
        elif hasattr(kind, "__next__") and _own_dict(v) is None:
            # a built-in iterator (over a list, a range, a zip): its position, to rewind
            self.world.holders.append(("iterator", v, None))
            try:
                state = v.__reduce__()
            except Exception:  # noqa: BLE001 - an iterator that does not say where it is
                state = ()
            for part in state[1:2]:
                self.value(part, None, "", None, role, path, depth + 1)
        else:
            if isinstance(v, self.data_types):
                role = Role.DATA
            self.attributes(v, role, path, depth)
            call = getattr(kind, "__call__", None)
            if isinstance(call, types.FunctionType):
                self.object(call, role, path, depth + 1)
        for cls in kind.__mro__:
            if cls is not object and id(cls) not in self.seen and _is_user_class(cls):
                self.object(cls, Role.INPUT, f"{cls.__qualname__}", depth + 1)

    def dict(self, d: dict[Any, Any], role: Role, path: str, depth: int) -> None:
        if id(d) not in self.seen:
            self.seen.add(id(d))
            self.world.objects.append(d)
            self.world.paths.setdefault(id(d), path)
        self.world.holders.append(("dict", d, None))
        if not d:
            return  # (a module's hooks, mostly)
        for key, item in list(dict.items(d)):
            if isinstance(key, torch.Tensor):
                self.world.slots.append(Slot(d, "key", key, key, role, f"{path} key", self.rank))
                self.tensor(key, role, f"{path} key", depth + 1)
            elif isinstance(key, tuple) and self.immutable(key, role, f"{path} key", depth + 1):
                self.world.slots.append(Slot(d, "key", key, key, role, f"{path} key", self.rank))
            self.value(item, d, "item", key, role, f"{path}[{key!r}]" if not isinstance(key, str) else _join(path, key), depth + 1)

    def attributes(self, v: Any, role: Role, path: str, depth: int) -> None:
        """An object's attributes: its ``__dict__`` and ``__slots__`` members."""
        attributes = _own_dict(v)
        if attributes is not None:
            self.world.holders.append(("type", v, None))
            self.dict(attributes, role, path, depth)
        self.members(v, role, path, depth)

    def members(self, v: Any, role: Role, path: str, depth: int) -> None:
        """An object's ``__slots__`` members."""
        names = [
            name
            for cls in type(v).__mro__
            for name in _slot_names(cls)
            if name not in ("__dict__", "__weakref__")
        ]
        if not names:
            return
        self.world.holders.append(("members", v, tuple(names)))
        for name in names:
            try:
                item = object.__getattribute__(v, name)
            except AttributeError:
                continue
            self.value(item, v, "member", name, role, _join(path, name), depth + 1)

    def module(self, m: nn.Module, path: str, depth: int, top: bool) -> None:
        """A module: its parameters, buffers and submodules, and its other attributes."""
        world = self.world
        if top and id(m) not in world.module_ids:
            world.modules.setdefault(path or "module", m)
        world.module_ids.add(id(m))
        world.paths.setdefault(id(m), path)
        attributes = m.__dict__
        world.paths.setdefault(id(attributes), path)
        world.holders.append(("type", m, None))  # (a parametrization makes it a subclass)
        world.holders.append(("dict", attributes, None))
        for name, value in list(attributes.items()):
            if name in ("_parameters", "_buffers") and isinstance(value, dict):
                world.holders.append(("dict", value, None))
                kind, role = ("parameter", Role.PARAMETER) if name == "_parameters" else ("buffer", Role.BUFFER)
                for key, t in list(value.items()):
                    if isinstance(t, torch.Tensor):
                        world.slots.append(Slot(m, kind, key, t, role, _join(path, key), self.rank))
                        self.tensor(t, role, _join(path, key), depth + 1)
            elif name == "_modules" and isinstance(value, dict):
                world.holders.append(("dict", value, None))
                for key, sub in list(value.items()):
                    if isinstance(sub, nn.Module) and id(sub) not in self.seen:
                        world.paths.setdefault(id(sub.__dict__), _join(path, key))
                        self.seen.add(id(sub))
                        world.objects.append(sub)
                        self.module(sub, _join(path, key), depth + 1, top=False)
            elif isinstance(value, torch.Tensor):
                if not name.startswith("__"):
                    world.slots.append(Slot(m, "attribute", name, value, Role.ATTRIBUTE, _join(path, name), self.rank))
                self.tensor(value, Role.ATTRIBUTE, _join(path, name), depth + 1)
            else:
                # tensors in a module's containers are its own; in other objects, inputs
                role = Role.ATTRIBUTE if isinstance(value, (list, tuple, dict)) else Role.INPUT
                self.value(value, attributes, "item", name, role, _join(path, name), depth + 1)

    def optimizer(self, opt: torch.optim.Optimizer, path: str, depth: int) -> None:
        world = self.world
        world.optimizers.append(opt)
        attributes = opt.__dict__
        world.holders.append(("dict", attributes, None))
        for name, value in list(attributes.items()):
            where = _join(path, name)
            if name == "state" and isinstance(value, dict):
                world.holders.append(("dict", value, None))
                self.seen.add(id(value))
                on_host = not any(group.get("capturable") or group.get("fused") for group in opt.param_groups)
                for key, entries in list(dict.items(value)):
                    if isinstance(key, torch.Tensor):
                        world.slots.append(Slot(value, "key", key, key, Role.PARAMETER, f"{where} key", self.rank))
                        self.tensor(key, Role.PARAMETER, where, depth + 1)
                    if not isinstance(entries, dict) or id(entries) in self.seen:
                        self.value(entries, value, "item", key, Role.STATE, where, depth + 1)
                        continue
                    self.seen.add(id(entries))
                    world.objects.append(entries)
                    world.holders.append(("dict", entries, None))
                    for entry, item in list(dict.items(entries)):
                        host = on_host and entry == "step" and isinstance(item, torch.Tensor) and item.dim() == 0
                        role = Role.HOST_STATE if host else Role.STATE
                        self.value(item, entries, "item", entry, role, f"{where}[{entry!r}]", depth + 2)
            elif name == "param_groups" and isinstance(value, list):
                world.holders.append(("list", value, None))
                self.seen.add(id(value))
                for i, group in enumerate(value):
                    if not isinstance(group, dict):
                        continue
                    self.seen.add(id(group))
                    world.holders.append(("dict", group, None))
                    for key, item in list(group.items()):
                        group_role = Role.PARAMETER if key == "params" else Role.INPUT
                        self.value(item, group, "item", key, group_role, f"{where}[{i}][{key!r}]", depth + 2)
            else:
                self.value(value, attributes, "item", name, Role.INPUT, where, depth + 1)

    def function(self, f: types.FunctionType, path: str, depth: int) -> None:
        world = self.world
        name = f.__qualname__
        world.holders.append(("function", f, None))
        for i, default in enumerate(f.__defaults__ or ()):
            self.value(default, f, "default", i, Role.INPUT, f"{name} default {i}", depth + 1)
        if f.__kwdefaults__:
            self.dict(f.__kwdefaults__, Role.INPUT, f"{name} default", depth + 1)
        for var, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            if id(cell) in self.seen:
                continue
            self.seen.add(id(cell))
            world.objects.append(cell)
            world.paths.setdefault(id(cell), f"{name}'s {var}")
            world.holders.append(("cell", cell, None))
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.value(contents, cell, "cell", var, Role.INPUT, f"{name}'s {var}", depth + 1)
        attributes = _own_dict(f)
        if attributes:
            self.dict(attributes, Role.INPUT, name, depth + 1)
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            self.value(wrapped, None, "", None, Role.INPUT, path, depth + 1)
        if is_library_code(f.__code__.co_filename):
            return
        space = f.__globals__
        for global_name, attrs in global_names(f.__code__):
            if global_name not in space:
                continue
            found = space[global_name]
            self.globals(space, global_name, Role.INPUT, depth)
            if isinstance(found, types.ModuleType) and attrs:
                filename = getattr(found, "__file__", None)
                if filename is not None and not is_library_code(filename):
                    for attr in attrs:
                        if attr in found.__dict__:
                            self.globals(found.__dict__, attr, Role.INPUT, depth, prefix=f"{found.__name__}.")

    def globals(self, space: dict[str, Any], name: str, role: Role, depth: int, prefix: str = "") -> None:
        key = (id(space), name)
        if key in self.globals_seen:
            return
        self.globals_seen.add(key)
        self.world.holders.append(("globals", space, (name,)))
        self.world.paths.setdefault(id(space), space.get("__name__", "") or "globals")
        self.value(space[name], space, "item", name, role, prefix + name, depth + 1)

    def partial(self, p: functools.partial, role: Role, path: str, depth: int) -> None:  # type: ignore[type-arg]
        self.world.holders.append(("partial", p, None))
        self.value(p.func, None, "", None, role, path, depth + 1)
        for i, arg in enumerate(p.args):
            self.value(arg, p, "partial", i, role, f"{path} argument {i}", depth + 1)
        if p.keywords:
            self.dict(p.keywords, role, path, depth + 1)
        attributes = _own_dict(p)
        if attributes:
            self.dict(attributes, role, path, depth + 1)

    def user_class(self, cls: type, depth: int) -> None:
        names = tuple(
            name
            for name, value in vars(cls).items()
            if not (name.startswith("__") and name.endswith("__")) and not isinstance(value, (property, types.MemberDescriptorType, types.GetSetDescriptorType))
        )
        self.world.holders.append(("class", cls, names))
        for name in names:
            value = vars(cls)[name]
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            self.value(value, None, "", None, Role.INPUT, f"{cls.__qualname__}.{name}", depth + 1)


def _join(path: str, name: Any) -> str:
    return f"{path}.{name}" if path else str(name)


def _own_dict(v: Any) -> dict[str, Any] | None:
    try:
        found = object.__getattribute__(v, "__dict__")
    except (AttributeError, TypeError):
        return None
    return found if type(found) is dict else None


@functools.lru_cache(maxsize=1024)
def _slot_names(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    if isinstance(slots, str):
        slots = (slots,)
    return tuple(name for name in slots if isinstance(name, str) and isinstance(cls.__dict__.get(name), types.MemberDescriptorType))


def model_holders(model: nn.Module) -> list[Holder]:
    """What the built-in step's model holds that its forward may write into: each module's
    class and attributes, and the lists, dicts, sets and deques among them (a list it
    appends activations to, its hooks' dicts), two levels deep. (A step function's world
    is walked whole; a model's own attributes are what a forward writes, and walking them
    alone keeps an estimate's cost.)"""
    holders: list[Holder] = []
    seen: set[int] = set()

    def container(value: Any, depth: int) -> None:
        kind = _CONTAINER_KINDS.get(type(value)) or next(
            (kind for base, kind in _CONTAINER_KINDS.items() if isinstance(value, base)), None
        )
        if kind is None or id(value) in seen:
            return
        seen.add(id(value))
        holders.append((kind, value, None))
        if depth < 2:
            items = value.values() if isinstance(value, dict) else value
            for item in list(items):
                container(item, depth + 1)

    internals = _module_internals()
    for module in model.modules():
        holders.append(("type", module, None))
        holders.append(("dict", module.__dict__, None))
        for name, value in list(module.__dict__.items()):
            if name in internals and not value:
                continue  # (an empty hooks dict: torch's own, and what the engine hooks it puts back)
            if not isinstance(value, (torch.Tensor, nn.Module)):
                container(value, 1)
    return holders


@functools.cache
def _module_internals() -> frozenset[str]:
    """The attributes every module has (its hooks' dicts, ...), but its parameters',
    buffers' and submodules' dicts (a forward may register one)."""
    return frozenset(nn.Module().__dict__) - {"_parameters", "_buffers", "_modules"}


#: The containers :func:`model_holders` records, by the journal's kind.
_CONTAINER_KINDS: Final = {dict: "dict", list: "list", set: "set", collections.deque: "deque"}


def reach(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str]) -> World:
    """Walk what ``function(*args, **kwargs)`` can reach (see the module); ``names``: the
    names the function gives its positional arguments."""
    walker = _Walker()
    walker.call(function, args, kwargs, names)
    return walker.world
