"""A step function's world on stand-ins: made for its tensors, lent to it for the call, taken back after.

:func:`convert` makes a stand-in (a fake tensor of the traced device, or a real
copy for ``measure``) for every tensor the walk found, once per tensor, in the
order the step charges them (parameters, buffers, module attributes, inputs,
gradients, optimizer state); a dataset's tensors keep their own (the step
reads them; the batches it makes of them are its own). :func:`lent` records
the world (:class:`~pytest_torchmem.engine.user.journal.Journal`, and the
process's own state: :class:`~pytest_torchmem.engine.user.process.ProcessState`), puts each
stand-in where its tensor sits (the user's model, optimizer, trainer, lists,
closures and globals hold the stand-ins: the function sees its world as it is,
each object the one it knows), watches what the step touches
(:mod:`~pytest_torchmem.engine.user.watching`), and, however the call ends,
puts the world back as it was.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import torch

from pytest_torchmem.engine.user.model_state import Converted, HookError, StandIns, converter
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.user.user_code import user_location
from pytest_torchmem.engine.user.journal import Journal, journaling, refill
from pytest_torchmem.engine.user.process import ProcessState
from pytest_torchmem.engine.user.reaching import ARGUMENTS, Role, Slot, World, tensors_of
from pytest_torchmem.engine.user.watching import UnfollowedError, watching

__all__ = ["convert", "lent"]

# torch's private names (engine/torch_compat/torch_private.py)
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")


def convert(
    world: World,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    make: StandIns,
    on_hook_error: HookError | None = None,
    host: StandIns | None = None,
) -> Converted:
    """The stand-ins of ``world``'s tensors (see the module), and the call's arguments
    holding them; ``host`` makes those of tensors the device keeps on its host (an
    optimizer's step counts beside a GPU's parameters), where the device is not the host."""
    roles = world.roles()
    convert_one = converter(make, on_hook_error)
    on_host = converter(host) if host is not None else convert_one
    made: dict[int, torch.Tensor] = {}
    groups: dict[Role, list[torch.Tensor]] = {role: [] for role in Role}
    # what the call is given first, then what it reaches otherwise, each in the walk's order
    order = sorted(range(len(world.slots)), key=lambda i: (world.slots[i].rank, i))
    for role in (Role.PARAMETER, Role.BUFFER, Role.ATTRIBUTE, Role.INPUT, Role.STATE, Role.HOST_STATE):
        for i in order:
            for t in tensors_of(world.slots[i].value):
                if id(t) in made or roles[id(t)] != role:
                    continue
                if role == Role.INPUT and not t.is_leaf:  # an intermediate result: its stand-in is a leaf
                    new = convert_one(t.detach().requires_grad_(t.requires_grad))
                elif role == Role.HOST_STATE:
                    new = on_host(t)
                else:
                    new = convert_one(t)
                made[id(t)] = new
                groups[role].append(new)
    convert_one.gradients()
    originals = {**on_host.originals, **convert_one.originals}
    for new in made.values():
        _carry_attributes(originals[id(new)], new, made)

    def standin(value: Any) -> Any:
        return _standin_value(value, made)

    return Converted(
        model=made,
        args=tuple(standin(a) for a in args),
        kwargs={key: standin(value) for key, value in kwargs.items()},
        parameters=groups[Role.PARAMETER],
        buffers=groups[Role.BUFFER],
        attributes=groups[Role.ATTRIBUTE],
        inputs=groups[Role.INPUT],
        originals=originals,
        optimizers=list(world.optimizers),
        sparse_parts=convert_one.sparse_parts,
        state=groups[Role.STATE] + groups[Role.HOST_STATE],
    )


def _carry_attributes(original: torch.Tensor, new: torch.Tensor, made: dict[int, torch.Tensor]) -> None:
    """The attributes code set on the user's tensor (``param.no_decay = True``), on its
    stand-in too (tensors among them as their stand-ins)."""
    try:
        own = object.__getattribute__(original, "__dict__")
    except AttributeError:
        return
    if not own:
        return
    mine = vars(new)
    for name, value in own.items():
        if name not in mine:
            mine[name] = _standin_value(value, made)


def _standin_value(value: Any, made: dict[int, torch.Tensor]) -> Any:
    """``value`` as the call sees it: a tensor's stand-in, a tuple holding stand-ins (the
    same tuple where it holds none), anything else itself."""
    if isinstance(value, torch.Tensor):
        return made.get(id(value), value)
    if isinstance(value, (tuple, frozenset)) and type(value) is not torch.Size:
        items = [_standin_value(item, made) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        if isinstance(value, frozenset):
            return frozenset(items)
        if hasattr(type(value), "_make"):  # a named tuple
            return type(value)._make(items)
        try:
            return type(value)(items)
        except TypeError:
            return tuple(items)
    return value


@contextmanager
def lent(world: World, made: dict[int, torch.Tensor], *, watch_calls: bool = True) -> Iterator[None]:
    """The world holds the stand-ins ``made`` (id of a tensor -> its stand-in) for the
    block, watched; as it was after it (see the module). ``watch_calls``: watch the
    modules the step calls too (not where it runs compiled code: dynamo would trace
    the watch's global hook, and run the region eagerly)."""
    process = ProcessState()
    journal = Journal(world.holders, world.paths)
    ours = {id(t) for t in made.values()}
    failed = False
    try:
        _put(world.slots, made)
        optimizers = {id(o) for o in world.optimizers}
        world.release()

        def is_ours(t: torch.Tensor) -> bool:
            return type(t) is FakeTensor or id(t) in ours

        with journaling(journal), watching(world.module_ids, optimizers, is_ours, user_location, calls=watch_calls):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        try:
            journal.restore()
        except Exception:
            if not failed:
                raise
        finally:
            process.restore()
    advanced = journal.advanced_generators()
    if advanced:
        raise UnfollowedError(
            f"the step advanced {len(advanced)} generator(s) or iterator(s) it was given "
            f"({', '.join(type(g).__name__ for g in advanced[:3])}), which cannot be rewound: "
            "the user's iterator has moved on; pass what it iterates (a DataLoader, a list), "
            "not an iterator over it"
        )


def _put(slots: list[Slot], made: dict[int, torch.Tensor]) -> None:
    """Each slot holds its value's stand-in (dicts keyed by tensors rekeyed once, last)."""
    rekeyed: dict[int, dict[Any, Any]] = {}
    for slot in slots:
        if slot.kind == "key":
            rekeyed[id(slot.holder)] = slot.holder
            continue
        if slot.holder is ARGUMENTS:
            continue
        new = _standin_value(slot.value, made)
        if new is slot.value:
            continue
        _set(slot, new)
    for holder in rekeyed.values():
        refill(holder, [(_standin_value(key, made), value) for key, value in dict.items(holder)])


def _set(slot: Slot, new: Any) -> None:
    holder, kind, name = slot.holder, slot.kind, slot.name
    if kind == "parameter":
        holder._parameters[name] = new
    elif kind == "buffer":
        holder._buffers[name] = new
    elif kind == "attribute":
        holder.__dict__[name] = new
    elif kind == "item":
        if isinstance(holder, collections.OrderedDict):
            collections.OrderedDict.__setitem__(holder, name, new)
        elif isinstance(holder, dict):
            dict.__setitem__(holder, name, new)
        elif isinstance(holder, list):
            list.__setitem__(holder, name, new)
        elif isinstance(holder, set):
            set.discard(holder, slot.value)
            set.add(holder, new)
        elif isinstance(holder, collections.deque):
            index = next(i for i, item in enumerate(holder) if item is slot.value)
            holder[index] = new
    elif kind == "member":
        for cls in type(holder).__mro__:
            if name in cls.__dict__:
                cls.__dict__[name].__set__(holder, new)
                break
    elif kind == "cell":
        holder.cell_contents = new
    elif kind == "default":
        defaults = list(holder.__defaults__)
        defaults[name] = new
        holder.__defaults__ = tuple(defaults)
    elif kind == "partial":
        func, args, keywords, attributes = holder.__reduce__()[2]
        args = tuple(new if i == name else a for i, a in enumerate(args))
        holder.__setstate__((func, args, keywords, attributes))
