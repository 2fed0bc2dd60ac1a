"""What keeps a leaking step's growth alive: the user's list, dict, attribute, closure, or an autograd graph.

At the end of a repeated step's last iteration (while the user's world still holds
the stand-ins), :func:`explain` looks at the storages an iteration made that
outlived the next one (what a steady leak leaves behind every iteration), finds
the tensors that view them, and follows Python's references back from each to
the first object the user's code names (the paths the world's walk found:
``trainer.losses``, ``train_step's history``, ``model.cache``). A storage that
nothing Python can see holds (torch's autograd graph keeps the tensors it saves
in C++) is looked for in the graphs of the tensors the user's objects hold (a
running total ``total = total + loss`` keeps every iteration's graph, and the
activations each saved). Each group becomes a
:class:`~pytest_torchmem.engine.leaks.report.LeakSource`, with the fix where the
pattern is a known one.
"""

from __future__ import annotations

import gc
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import torch
from torch.nn.parameter import UninitializedTensorMixin

from pytest_torchmem.engine.leaks.report import LeakSource
from pytest_torchmem.engine.figures.timeline import StorageInfo, Timeline
from pytest_torchmem.engine.tracing.collector import every_object_in_sight

__all__ = ["explain"]

#: How far back from a tensor the search follows references (a list in a dict in an
#: object's attributes is three).
_DEPTH: Final = 6

_FIXES: Final = {
    "graph": (
        "{held_by} is a tensor whose autograd graph reaches back through every iteration, and "
        "the activations each saved (a running total of the loss that nothing calls backward "
        "on, an evaluation without torch.no_grad()): accumulate loss.item() or loss.detach(), "
        "or evaluate under torch.no_grad()"
    ),
    "kept graph": (
        "{held_by} gains tensors every iteration, each with its autograd graph and the "
        "activations it saved: keep .detach()ed tensors (or numbers: .item()), or run it "
        "under torch.no_grad()"
    ),
    "list": (
        "{held_by} gains tensors every iteration: keep numbers (.item()) or detached copies "
        "you clear once used, not the tensors themselves"
    ),
    "dict": (
        "{held_by} gains an entry every iteration (a cache keyed by something new each step): "
        "key it by what repeats, bound it, or clear it"
    ),
    "optimizer": (
        "{held_by} gains parameters every iteration (add_param_group), and the optimizer keeps "
        "each one and its state: add the group once, or build a new optimizer when the "
        "parameters change"
    ),
    "closure": "{held_by} gains tensors every iteration: keep numbers (.item()), or clear it",
    "attribute": "{held_by} holds more every iteration: keep what one iteration needs, or clear it",
}


def explain(
    timeline: Timeline,
    sids: Iterable[int],
    storage_of: Any,
    paths: Mapping[int, str],
    roots: Iterable[tuple[str, Any]],
    size: Callable[[int], int] = int,
) -> list[LeakSource]:
    """The sources of the storages ``sids`` (made by one iteration, alive after the
    next): ``storage_of(sid)`` gives a storage's object; ``paths`` names the user's
    objects by id; ``roots`` are ``(path, value)`` of what the user's objects hold now
    (the tensors among them whose autograd graphs to search); ``size(nbytes)`` is what a
    storage of ``nbytes`` costs the device (on cuda: the caching allocator's block)."""
    wanted = {}
    for sid in sids:
        storage = storage_of(sid)
        if storage is not None:
            wanted[storage._cdata] = sid
    if not wanted:
        return []
    with every_object_in_sight():  # (the trace's older objects are out of the collector's sight)
        return _explained(timeline, wanted, paths, roots, size)


def _explained(
    timeline: Timeline,
    wanted: dict[int, int],
    paths: Mapping[int, str],
    roots: Iterable[tuple[str, Any]],
    size: Callable[[int], int],
) -> list[LeakSource]:
    """:func:`explain` of the storages ``wanted`` (their objects' ``_cdata`` -> sid)."""
    viewing: dict[int, list[torch.Tensor]] = defaultdict(list)
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), UninitializedTensorMixin):
            # (issubclass, not isinstance: some objects' __class__ warns)
            try:
                key = obj.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):
                continue
            if key in wanted:
                viewing[wanted[key]].append(obj)
    graphs = _saved_by_graphs(roots, set(wanted))
    groups: dict[tuple[str, str, str, str, str], list[int]] = defaultdict(list)
    holders = _holders([viewing.get(sid, []) for sid in wanted.values()], paths)
    for (key, sid), (held_by, how) in zip(wanted.items(), holders):
        if not held_by and key in graphs:
            root = graphs[key]
            # (a tensor in a list: each iteration appended one, with its graph)
            container = _without_index(root)
            held_by, how = (container, "kept graph") if container != root else (root, "graph")
        info = timeline.storages[sid]
        groups[(held_by, how, _made_at(info), info.op, _module(timeline, info))].append(sid)
    del viewing
    sources = []
    for (held_by, how, made_at, op, module), members in groups.items():
        fix = _FIXES.get(how, "").format(held_by=held_by) if held_by else ""
        sources.append(
            LeakSource(
                bytes=sum(size(timeline.storages[sid].nbytes) for sid in members),
                tensors=len(members),
                made_at=made_at,
                op=op,
                module=module,
                held_by=held_by,
                how=how if held_by else "unknown",
                fix=fix,
            )
        )
    return sorted(sources, key=lambda source: -source.bytes)


def _without_index(path: str) -> str:
    """``history`` for ``history[2]`` (an item of a list a step appends to), else ``path``."""
    if path.endswith("]") and "[" in path:
        inside = path[path.rindex("[") + 1 : -1]
        if inside.isdigit():
            return path[: path.rindex("[")]
    return path


def _made_at(info: StorageInfo) -> str:
    if not info.frames:
        return ""
    frame = info.frames[0]
    return f"{frame.filename}:{frame.line} in {frame.name}"


def _module(timeline: Timeline, info: StorageInfo) -> str:
    return timeline.module_names[info.module] if 0 <= info.module < len(timeline.module_names) else ""


def _holders(groups: list[list[torch.Tensor]], paths: Mapping[int, str]) -> list[tuple[str, str]]:
    """For each group of tensors, the first of the user's objects that holds one of them,
    through Python's references, and how: ``(path, how)``, or ``("", "")``.

    Each group is searched breadth first, up to :data:`_DEPTH` references back, as if
    alone; the groups go up one level together, so that the heap is scanned once a level
    (``gc.get_referrers`` of every object of the level) rather than once an object (each
    scan is as long as the heap: a process that ran many tests holds millions of
    objects)."""
    found: list[tuple[str, str]] = [("", "")] * len(groups)
    #: The search's own containers, which hold what it looks at (no holders of the user's).
    own = {id(groups), *(id(tensors) for tensors in groups)}

    def ours(container: Any) -> Any:
        own.add(id(container))
        return container

    # each search: its group's index, its level's objects, the ids it has seen, and, by
    # id, what each object it reached was reached from
    searches = [
        (index, ours(list(tensors)), {id(t) for t in tensors}, ours({}))
        for index, tensors in enumerate(groups)
        if tensors
    ]
    for _ in range(_DEPTH):
        if not searches:
            break
        level = ours([obj for search in searches for obj in search[1]])
        wanted = {id(obj) for obj in level}
        referrers = ours(gc.get_referrers(*level))
        #: id(object) -> the objects that refer to it, in the order of the heap
        holding: dict[int, list[Any]] = ours({})
        for holder in referrers:
            if id(holder) in own:
                continue
            for held in {id(held) for held in gc.get_referents(holder)} & wanted:
                entry = holding.get(held)
                if entry is None:
                    entry = holding[held] = ours([])
                entry.append(holder)
        del referrers
        still = []
        for index, objects, seen, below in searches:
            after = ours([])
            named = None
            for obj in objects:
                for holder in holding.get(id(obj), ()):
                    if id(holder) in seen or id(holder) in own or _is_frame_or_ours(holder):
                        continue
                    seen.add(id(holder))
                    below[id(holder)] = obj
                    path = paths.get(id(holder))
                    if path is not None:
                        named = _named(holder, path, below)
                        break
                    after.append(holder)
                if named is not None:
                    break
            if named is not None:
                found[index] = named
            elif after:
                still.append((index, after, seen, below))
        searches = still
        del level, holding
    return found


def _named(holder: Any, path: str, below: Mapping[int, Any]) -> tuple[str, str]:
    """How ``holder`` (the user's object at ``path``) holds what the search came from
    (``below``: each object on the way, to what it holds)."""
    held = below[id(holder)]
    try:
        attributes = object.__getattribute__(holder, "__dict__")
    except AttributeError:
        attributes = None
    if isinstance(holder, torch.optim.Optimizer):  # its state and param groups, by the parameter
        return f"{path}.param_groups", "optimizer"
    if (path.endswith(".state") and isinstance(holder, defaultdict)) or (
        path.endswith(".param_groups") and isinstance(holder, list)
    ):  # an optimizer's (its state is a defaultdict keyed by the parameter)
        return path.rsplit(".", 1)[0] + ".param_groups", "optimizer"
    if held is attributes and not isinstance(holder, type):  # one of its attributes
        holder, held = held, below.get(id(held))
    if isinstance(holder, (list, deque)):
        return path, "list"
    if isinstance(holder, dict):
        for key, value in dict.items(holder):
            if value is held and isinstance(key, str) and not key.startswith("_"):
                name = f"{path}.{key}" if path else key
                return name, "list" if isinstance(held, (list, deque)) else "dict" if isinstance(held, dict) else "attribute"
        return path, "dict"
    if type(holder).__name__ == "cell":
        return path, "list" if isinstance(held, (list, deque)) else "closure"
    return path, "attribute"


def _is_frame_or_ours(obj: Any) -> bool:
    """A frame (the search's own, the trace's), or an object of this package or torch's
    machinery, which are no holders of the user's."""
    kind = type(obj)
    if kind.__name__ == "frame":
        return True
    module = getattr(kind, "__module__", "") or ""
    return module.startswith(("pytest_torchmem", "torch._subclasses", "torch.utils._python_dispatch"))


def _saved_by_graphs(roots: Iterable[tuple[str, Any]], wanted: set[int]) -> dict[int, str]:
    """Storage key -> the path of the held tensor whose autograd graph saved it, for the
    ``wanted`` storages."""
    found: dict[int, str] = {}
    for path, value in roots:
        if not isinstance(value, torch.Tensor) or value.grad_fn is None:
            continue
        for key in _saved_storages(value.grad_fn):
            if key in wanted and key not in found:
                found[key] = path
    return found


def _saved_storages(node: Any) -> Iterable[int]:
    """The storage keys of every tensor the autograd graph from ``node`` saved."""
    # (the nodes are kept, not only their ids: a release whose node objects are made as
    # they are read would give a freed one's id to the next)
    stack, seen = [node], {}
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen[id(current)] = current
        for name in dir(current):
            if not name.startswith("_saved_"):
                continue
            try:
                saved = getattr(current, name)
            except Exception:  # noqa: BLE001 - freed already, or not a tensor's
                continue
            for t in saved if isinstance(saved, (tuple, list)) else (saved,):
                if isinstance(t, torch.Tensor):
                    try:
                        yield t.untyped_storage()._cdata
                    except (RuntimeError, NotImplementedError):
                        pass
        stack.extend(next_node for next_node, _ in getattr(current, "next_functions", ()) or ())
