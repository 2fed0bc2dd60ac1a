"""What decides the program a block's call runs, as values equal between calls that run
the same one (block_replay.py groups a list's calls by them): the lists that hold blocks
(:func:`block_lists`); a block's structure, its modules' classes and attributes, its
parameters' and buffers' layouts, its hooks (:func:`block_structure`); a call's arguments
(:func:`arguments_key`) and the saved-tensor hooks it runs under (:func:`saving_hooks`);
the plain attributes a list's blocks hold different values of (:func:`free_places`,
masked as :data:`DIFFERS`); what a traced call left in the KV caches it was given
(:func:`cache_writes`, replay_caches.py); and what differs between two calls, in words
(:func:`difference`).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.torch_compat.torch_private import private, private_name
from pytest_torchmem.engine.tracing import replay_caches
from pytest_torchmem.engine.tracing.block_parallel import COMPOSABLE_STATE, parallel_style_hook
from pytest_torchmem.engine.tracing.replay_state import neutral
from pytest_torchmem.engine.tracing.replay_watch import cell_contents

__all__ = [
    "COMPILED_CALL", "DIFFERS", "HOOK_DICTS", "MIN_BLOCKS", "NUMBERS", "PLAIN", "arguments_key", "block_lists",
    "block_number", "block_structure", "cache_writes", "compiled_call_name", "difference", "free_names",
    "free_places", "masked", "saving_hooks", "value_key",
]

FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
_top_saved_tensors_hooks: Final = private("torch._C._autograd._top_saved_tensors_default_hooks")
_STRIDED: Final = torch.strided
#: Where ``module.compile()`` keeps a module's compiled callable (an instance attribute).
COMPILED_CALL: Final = private_name("torch.nn.Module._compiled_call_impl")
#: What ``torch.compile(module)``'s wrapper (an ``OptimizedModule``) holds beside its
#: compiled ``forward``, one of each per ``torch.compile`` call (``_opt_mod_attributes``
#: in ``torch/_dynamo/eval_frame.py``): its dynamo context, its module's forward, its own
#: ``id`` and the function the context sets on it.
_WRAPPER_ATTRIBUTES: Final = frozenset(
    {"dynamo_ctx", "_torchdynamo_orig_callable", "_torchdynamo_wrapper_id", "get_compiler_config"}
)


def compiled_call_name(block: nn.Module) -> str | None:
    """The instance attribute that holds ``block``'s own compiled callable: ``module.compile()``'s
    ``_compiled_call_impl``, or the ``forward`` of ``torch.compile(module)``'s wrapper (but a
    lazy module's, whose ``forward`` checks its initialization first); None where ``block``
    is not compiled alone."""
    if block.__dict__.get(COMPILED_CALL) is not None:
        return COMPILED_CALL
    if (
        "dynamo_ctx" in block.__dict__ and "forward" in block.__dict__ and "_forward" not in block.__dict__
        and isinstance(block, private("torch._dynamo.eval_frame.OptimizedModule"))
    ):
        return "forward"
    return None

#: The fewest elements of one class a list must have for its blocks to be replayed: two
#: traced to make the template, three traced at the end for the backward, one replayed.
MIN_BLOCKS: Final = 6
PLAIN: Final = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.layout)


#: The attribute types whose values may differ between blocks replayed alike, if never read.
NUMBERS: Final = (int, float, bool, str, type(None))


def block_lists(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """The ``nn.ModuleList`` and ``nn.Sequential`` of ``model`` with at least
    :data:`MIN_BLOCKS` distinct elements of one class, each with those elements."""
    found = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in container._modules.values():
            if child is not None:
                by_class.setdefault(type(child), []).append(child)
        found.extend(
            (container, same_class)
            for same_class in by_class.values()
            if len(same_class) >= MIN_BLOCKS and len({id(b) for b in same_class}) == len(same_class)
        )
    return found


#: A module's hook dicts (``nn.Module.__init__``'s), which run outside its ``forward``.
HOOK_DICTS: Final = frozenset({
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook",
})


#: A module's state-dict hooks, which a step never runs (FSDP2 puts its own on the
#: modules holding parameters).
_STATE_DICT_HOOKS: Final = frozenset({
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
})


def value_key(value: Any, depth: int = 0, within: dict[int, str] | None = None) -> Any:
    """``value`` as a value equal between blocks that run the same program with it: plain
    values by value, tensors by layout, small containers by their items; a function by its
    code, defaults and what it closes over, a bound method by its function and object, a
    partial by its parts (the per-instance closures a fine-tuning library's layers hold);
    a module of the block (``within``: the block's modules by id) by its place in the
    block; the rest by identity."""
    kind = type(value)
    if kind in PLAIN or isinstance(value, PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.dtype, tuple(value.shape), tuple(value.stride()), value.requires_grad)
    if within is not None and id(value) in within:
        return (nn.Module, within[id(value)])
    if kind in (list, tuple, set, frozenset, dict) or isinstance(value, dict):
        if depth > 2 or len(value) > 32:
            return (kind, id(value), len(value))
        items = value.items() if isinstance(value, dict) else value
        if kind in (set, frozenset):
            items = sorted(items, key=repr)
        return (kind, tuple(value_key(v, depth + 1, within) for v in items))
    if depth <= 2 and kind in _CALLABLES:
        deeper = functools.partial(value_key, depth=depth + 1, within=within)
        if kind is types.FunctionType:
            cells = tuple(deeper(cell_contents(cell, _EMPTY)) for cell in value.__closure__ or ())
            return (kind, value.__code__, id(value.__globals__), deeper(value.__defaults__),
                    deeper(value.__kwdefaults__), cells)
        if kind is types.MethodType:
            return (kind, deeper(value.__func__), deeper(value.__self__))
        return (kind, deeper(value.func), deeper(value.args), deeper(value.keywords))
    if depth == 0 and not isinstance(value, nn.Module) and type(getattr(value, "__dict__", None)) is dict:
        # (an object the blocks share, a config: what it holds of plain values, which the
        # program may change between the blocks' calls)
        return (kind, id(value), tuple((k, v) for k, v in vars(value).items() if type(v) in PLAIN))
    return (kind, id(value))


#: The callables :func:`value_key` takes by their parts.
_CALLABLES: Final = (types.FunctionType, types.MethodType, functools.partial)


#: What a closure's cell not yet filled holds, to :func:`value_key`.
_EMPTY: Final = object()


def saving_hooks() -> Any:
    """The saved-tensor hooks a call runs under (a checkpoint, ``save_on_cpu``, an
    offloader the caller put around it), as a value equal between calls under hooks that
    do the same: their functions' code and the plain values they close over."""
    hooks = _top_saved_tensors_hooks(False)
    if hooks is None:
        return None
    out = []
    for hook in hooks:
        function = getattr(hook, "__func__", hook)
        code = getattr(function, "__code__", None)
        if code is None:
            out.append((type(hook), id(hook)))
            continue
        cells = (cell_contents(cell, _EMPTY) for cell in function.__closure__ or ())
        out.append((code, tuple(value if type(value) in PLAIN else type(value) for value in cells)))
    return tuple(out)


def _class_attributes(cls: type) -> tuple[Any, ...]:
    """The plain values and containers ``cls`` and its bases up to ``nn.Module`` hold (a
    class-level list a block appends to, a class-level counter)."""
    out = []
    for base in cls.__mro__:
        if base is nn.Module or base is object:
            break
        for name, value in vars(base).items():
            if type(value) in PLAIN or type(value) in (list, dict, set):
                out.append((name, value_key(value, 1)))
    return tuple(out)


def block_structure(block: nn.Module, unit: bool, compiled: bool = False) -> tuple[Any, ...]:
    """``block``'s modules' classes and attributes, as a value equal between blocks that
    dispatch the same ops: parameters and buffers by layout, the rest by value (``unit``:
    the block is an FSDP2 unit, whose own hooks and state are left out; ``compiled``: the
    block is compiled alone, its compiled callable (and a ``torch.compile`` wrapper's
    context) left out, its program told apart by its region)."""
    out: list[Any] = []
    modules = list(block.modules())
    within = {id(module): place for place, module in enumerate(modules)}  # (by place: one walk)
    for module in modules:
        out.append(("class", type(module)))
        out.append(("class attributes", _class_attributes(type(module))))
        # (the engine's own neutral hooks, by their handles' ids: the hooks' dicts and those
        # that say how each is called)
        skipped = {key for hooks in (module._forward_pre_hooks, module._forward_hooks) for key, hook in hooks.items()
                   if neutral(hook)}
        for name, value in module.__dict__.items():
            if module is block and (
                name == "forward" or (compiled and (name == COMPILED_CALL or name in _WRAPPER_ATTRIBUTES))
            ):
                continue
            if name in _STATE_DICT_HOOKS:
                continue
            if unit and module is block and (name in HOOK_DICTS or name.startswith(COMPOSABLE_STATE)):
                continue  # (FSDP2's own, alike on every unit but for the ids: :func:`fsdp_state`)
            if name in HOOK_DICTS and value and isinstance(value, dict):
                # (tensor parallel's hooks, by what they do: their handles' ids differ)
                hooks = tuple(
                    parallel_style_hook(hook) or (type(hook), id(hook)) for key, hook in value.items()
                    if key not in skipped
                )
                # (none left: as an empty dict of hooks is)
                out.append(("hooks", name, hooks) if hooks else ("attribute", name, value_key(type(value)())))
            elif name in ("_parameters", "_buffers"):
                out.append((name, tuple(
                    (key, None if t is None else (t.dtype, tuple(t.shape), tuple(t.stride()), t.requires_grad,
                                                  t.grad is None, t.layout))
                    for key, t in value.items()
                )))
            elif name == "_modules":
                out.append((name, tuple(value)))
            else:
                out.append(("attribute", name, value_key(value, within=within)))
    return tuple(out)


class _FreeValue:
    """Stands for a plain attribute's value where blocks hold different ones."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<differs>"


DIFFERS: Final = _FreeValue()


def free_places(structures: list[tuple[Any, ...]]) -> frozenset[int]:
    """The places of the plain attributes (numbers, strings, booleans) that blocks of one
    class hold different values of, where their structures are otherwise alike in length
    and names (transformers' ``layer_idx``)."""
    first = structures[0]
    if any(len(s) != len(first) for s in structures):
        return frozenset()
    places = set()
    for place, entry in enumerate(first):
        if entry[0] != "attribute" or type(entry[2]) not in NUMBERS:
            continue
        if all(s[place][:2] == entry[:2] and type(s[place][2]) in NUMBERS for s in structures) and any(
            s[place] != entry for s in structures
        ):
            places.add(place)
    return frozenset(places)


def block_number(structure: tuple[Any, ...], free: frozenset[int], name: str) -> int | None:
    """The value ``structure`` holds of the attribute ``name`` at its places ``free``, where
    every such place holds one int (a decoder layer's ``layer_idx``, in it and its
    attention), else None."""
    values = {structure[place][2] for place in free if structure[place][1] == name}
    if len(values) != 1:
        return None
    [value] = values
    return value if type(value) is int else None


def cache_writes(
    indexed: dict[str, int],
    snapshots: list[replay_caches.Snapshot],
    leaves: list[Any],
    structure: tuple[Any, ...],
    free: frozenset[int],
) -> tuple[tuple[int, str, tuple[tuple[str, Any], ...]], ...] | str:
    """What a traced call left in the KV caches it was given (``snapshots``, taken before
    it): for each cache it handed one of its numbers (``indexed``, by the attribute's name:
    :class:`Watch`), the attributes it set on the layer its number picks; or why it cannot
    be replayed, in words. A cache it changed without one is one it changed otherwise."""
    if len(indexed) > 1 or any(count != 1 for count in indexed.values()) or len(snapshots) > 1 and indexed:
        return "a block handed its numbers to KV caches more than once"
    out = []
    for snapshot in snapshots:
        name = next(iter(indexed), None)
        found = replay_caches.written(snapshot)
        if found is None:
            if name is not None:
                return "a block handed its number to its KV cache, which kept nothing"
            continue
        if isinstance(found, str):
            return found
        if name is None:
            return "a block changed a layer of its KV cache without its number"
        index, attributes = found
        if block_number(structure, free, name) != index:
            return f"a block changed a layer of its KV cache other than its {name} picks"
        position = next(i for i, leaf in enumerate(leaves) if leaf is snapshot.cache)
        out.append((position, name, attributes))
    return tuple(out)


def masked(structure: tuple[Any, ...], free: frozenset[int]) -> tuple[Any, ...]:
    if not free:
        return structure
    return tuple((e[0], e[1], DIFFERS) if place in free else e for place, e in enumerate(structure))


def free_names(structure: tuple[Any, ...], free: frozenset[int]) -> frozenset[str]:
    """The names of the attributes at the places ``free`` of ``structure``."""
    return frozenset(structure[place][1] for place in free)


def difference(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    """What differs between two calls' signatures (or two blocks' structures: ``(None,
    structure)``), in words."""
    if a[1] != b[1]:
        for x, y in zip(a[1], b[1]):
            if x != y:
                if x[0] == "attribute":
                    return f"their attribute {x[1]}"
                return {
                    "_parameters": "their parameters' layouts",
                    "_buffers": "their buffers' layouts",
                    "class attributes": "their classes' attributes",
                }.get(x[0], "their modules")
        return "their modules"
    if a[2] != b[2] or a[3] != b[3]:
        return "their arguments' layouts"
    if a[4] != b[4]:
        return "torch's switches or the saved-tensor hooks they run under"
    return "the layers of the KV cache they are given" if a[7] != b[7] else "the step's phase"


def arguments_key(leaves: list[Any]) -> tuple[Any, ...]:
    """A call's arguments as a value: tensors by layout, autograd state and which share a
    storage; the rest by value. (Whether the trace knows a tensor's values is not part of
    it: a replayed block's outputs carry none, and where an op needs them the trace runs
    again without replay: :meth:`BlockReplay.vouch`.)"""
    out: list[Any] = []
    storages: dict[int, int] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if type(leaf) is not FakeTensor or leaf.layout is not _STRIDED:
                out.append((type(leaf), id(leaf)))
                continue
            key = leaf.untyped_storage()._cdata
            out.append((
                leaf.dtype, tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset(),
                leaf.untyped_storage().nbytes(), leaf.fake_device, leaf.requires_grad, leaf.grad_fn is None,
                storages.setdefault(key, len(storages)),
            ))
        else:
            out.append(value_key(leaf))
    return tuple(out)
