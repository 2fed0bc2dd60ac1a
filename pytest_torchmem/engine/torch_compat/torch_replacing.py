"""The one mechanism by which the engine replaces a torch attribute at run time.

Each replacement is an entry of :data:`pytest_torchmem.engine.torch_compat.torch_private.PRIVATE`
marked ``replaced`` (what, why, which releases), entered for a block and put back
however the block ends, on exception too:

- :func:`replacing` replaces an attribute (a module's global, a class's attribute,
  an option of a torch config module) or adds one torch lacks (an ``added`` entry);
- :func:`on_this_thread` replaces a function for the tracing thread only (a
  ``thread_scoped`` entry), every other thread getting the original's answers;
- :func:`replacing_for_readers` replaces a module's global for the readers it
  accepts only (a ``by_reader`` entry), the module's own code and every other
  reader reading the original;
- :func:`appending` adds an item to a private list;
- :func:`replacing_item` sets one key of a private dict;
- :func:`swapped`, the core of :func:`replacing`, for an attribute outside torch;
- :func:`in_effect` says which are in effect now (the tests read it).

A path missing from the running torch raises
:class:`~pytest_torchmem.engine.torch_compat.torch_private.TorchPrivateError`, one line that
names it. ``tests/test_torch_replacements.py`` checks that no other module writes
into torch.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pytest_torchmem.engine.torch_compat.private_name import Private
from pytest_torchmem.engine.torch_compat.torch_private import _missing, _resolve, entry

__all__ = [
    "appending",
    "caller_past_scoping",
    "in_effect",
    "on_this_thread",
    "replacing",
    "replacing_for_readers",
    "replacing_item",
    "swapped",
]

#: The tabled paths replaced now, in the order they were entered (by any thread).
_in_effect: list[str] = []


def in_effect() -> tuple[str, ...]:
    """The tabled paths replaced now (:func:`replacing`, :func:`appending`,
    :func:`replacing_item`), in the order they were entered."""
    return tuple(_in_effect)


@contextmanager
def _held(path: str) -> Iterator[None]:
    _in_effect.append(path)
    try:
        yield
    finally:
        for i in range(len(_in_effect) - 1, -1, -1):
            if _in_effect[i] == path:
                del _in_effect[i]
                break


def _replaceable(path: str) -> Private:
    found = entry(path)
    if not found.replaced:
        raise ValueError(f"{path} is not marked replaced=True in PRIVATE")
    return found


@functools.cache
def _config_option(path: str) -> tuple[Any, str] | None:
    """``(config module, option)`` where ``path`` names an option of a torch config module
    (``torch._inductor.config.cpp.simdlen``: ``torch._inductor.config``, ``"cpp.simdlen"``)."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        # (torch.utils._config_module's modules: options kept in _config, set through patch)
        if isinstance(getattr(module, "_config", None), dict) and callable(getattr(module, "patch", None)):
            return module, ".".join(parts[split:])
        return None
    return None


@contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` is ``value`` for the block; yields what ``owner.name`` was (None:
    nothing), put back however the block ends: a class's own attribute (a descriptor,
    a ``staticmethod``) as it was, one it inherits or lacks deleted again.

    The core of :func:`replacing`; called directly only for an attribute outside
    torch (a library's class the traced model uses), which the table does not hold."""
    original = getattr(owner, name, None)
    had_own = name in getattr(owner, "__dict__", {})
    own = owner.__dict__[name] if had_own else None
    setattr(owner, name, value)
    try:
        yield original
    finally:
        if had_own:
            setattr(owner, name, own)
        else:
            delattr(owner, name)


@contextmanager
def replacing(path: str, value: Any) -> Iterator[Any]:
    """Replace the torch attribute at ``path`` (an entry marked ``replaced``) with ``value``
    for the block, yielding the original; it is put back however the block ends.

    ``path`` names a module's global or a class's attribute (:func:`swapped`); an option
    of a torch config module (``torch._inductor.config.force_disable_caches``), set
    through the config's own ``patch``, which puts its state back as it was; or, for an
    entry marked ``added``, an attribute torch lacks, added for the block (None yielded).
    """
    found = _replaceable(path)
    config = _config_option(path)
    if config is not None:
        module, option = config
        try:
            original = functools.reduce(getattr, option.split("."), module)
        except AttributeError as exc:
            raise _missing(path, exc) from None
        with module.patch(option, value), _held(path):
            yield original
        return
    owner_path, _, name = path.rpartition(".")
    try:
        # what is there now (not the value private() keeps): a replacement
        # nested in another's wraps and restores the one it found
        owner = _resolve(owner_path)
        if not found.added:
            getattr(owner, name)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from None
    if found.added and hasattr(owner, name):
        raise ValueError(f"{path} is marked added=True in PRIVATE, but this torch has it: see its entry")
    with swapped(owner, name, value) as original, _held(path):
        yield original


@contextmanager
def appending(path: str, item: Any) -> Iterator[None]:
    """Add ``item`` to the private torch list at ``path`` for the block; it is taken out
    however the block ends. The list object stays the same: modules that bound it by
    name, or add to it later in the block (``torch.distributed.tensor`` adds ``DTensor``
    to the foreach type lists when first imported), keep theirs."""
    _replaceable(path)
    try:
        found = _resolve(path)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from None
    if not isinstance(found, list):
        raise TypeError(f"{path} is a {type(found).__name__}, not a list")
    found.append(item)
    try:
        with _held(path):
            yield
    finally:
        for i in range(len(found) - 1, -1, -1):
            if found[i] is item:
                del found[i]
                break


@contextmanager
def replacing_item(path: str, key: Any, value: Any, *, within: Any = None) -> Iterator[Any]:
    """Set ``key`` of the private torch dict at ``path`` to ``value`` for the block, yielding
    what it held (None: nothing); it is put back, or taken out again, however the block ends.

    ``within``: the dict is that object's attribute of the name ``path`` ends with, for a
    dict every instance of a torch class holds (the entry's path names one instance)."""
    _replaceable(path)
    try:
        container = getattr(within, path.rpartition(".")[2]) if within is not None else _resolve(path)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from None
    if not isinstance(container, dict):
        raise TypeError(f"{path} is a {type(container).__name__}, not a dict")
    had = key in container
    before = container.get(key)
    container[key] = value
    try:
        with _held(path):
            yield before
    finally:
        if had:
            container[key] = before
        else:
            container.pop(key, None)


@contextmanager
def on_this_thread(path: str, answer: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Replace the function at ``path`` (a ``thread_scoped`` entry) for the block: on this
    thread (the tracing thread) it answers ``answer(...)``, on every other one as the
    function it replaced (yielded), which it is put back as however the block ends."""
    thread = threading.get_ident()
    real: list[Callable[..., Any]] = []

    def scoped(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread:
            return answer(*args, **kwargs)
        return real[0](*args, **kwargs)

    if not entry(path).thread_scoped:
        raise ValueError(f"{path} is not marked thread_scoped=True in PRIVATE")
    with replacing(path, scoped) as original:
        real.append(original)
        functools.update_wrapper(scoped, original)
        yield original


def caller_past_scoping(frame: types.FrameType) -> types.FrameType:
    """``frame``, or, where it is one of :func:`on_this_thread`'s wrappers, the first frame
    above them: who called the replaced function, through however many threads'
    replacements of it the call went."""
    while frame.f_code.co_name == "scoped" and frame.f_code.co_filename == __file__ and frame.f_back is not None:
        frame = frame.f_back
    return frame


@contextmanager
def replacing_for_readers(path: str, value: Any, reads_it: Callable[[types.FrameType], bool]) -> Iterator[Any]:
    """Replace the module global at ``path`` (a ``by_reader`` entry) with ``value`` for the
    readers whose frame ``reads_it`` accepts, for the block, yielding the original.

    Every other reader gets the original, and so does the module's own code, which reads
    its globals from its dictionary: the module's dictionary is left alone, and the module
    is given, for the block, a class of its own in which the name is a property that asks
    ``reads_it`` about the frame that looks it up (``module.name``, ``from module import
    name``). A name bound before the block (``from module import name`` at import) is the
    original's, whoever reads it.
    """
    found = _replaceable(path)
    if not found.by_reader:
        raise ValueError(f"{path} is not marked by_reader=True in PRIVATE")
    owner_path, _, name = path.rpartition(".")
    try:
        module = _resolve(owner_path)
        original = vars(module)[name]
    except (ImportError, AttributeError, KeyError) as exc:
        raise _missing(path, exc) from None
    if not isinstance(module, types.ModuleType):
        raise TypeError(f"{owner_path} is a {type(module).__name__}, not a module")

    def read(self: types.ModuleType) -> Any:
        return value if reads_it(sys._getframe(1)) else vars(self)[name]

    outer = type(module)
    reading = type(outer.__name__, (outer,), {name: property(read), "__doc__": outer.__doc__})
    module.__class__ = reading
    try:
        with _held(path):
            yield original
    finally:
        if type(module) is not reading:
            raise RuntimeError(f"{owner_path}'s class was changed inside the replacement of {path}")
        module.__class__ = outer
