"""A KV cache a replayed block writes to: transformers' ``Cache``, whose ``update(key,
value, layer_idx)`` a decoder layer calls with its number.

A decoder layer trained with ``use_cache=True`` (transformers' default) reads its
``layer_idx`` for one thing: to tell the cache it was handed which of its layers keeps
its keys and values. Its program is the same on every layer where the layers of the cache
it writes to are alike; what differs is where its keys and values are left. Block replay
replays such a layer (block_replay.py) where:

* each read of the number is an argument of a call of ``update`` on a local variable
  (``cache.update(k, v, self.layer_idx, ...)``), seen in the instructions, and the object
  called is one of these caches, its ``update`` transformers' own, not offloading
  (:func:`known`; replay_watch.py's ``Watch`` sees the read);
* the cache is an argument of the block's call, and the cache layer the block's number
  picks holds, before the call, what the template's held (:func:`slot_state`, part of the
  call's signature);
* the traced call changed nothing of the cache but that layer's attributes
  (:func:`snapshot`, :func:`written`): plain values, and tensors the block made; or, of a
  cache made without its layers (``DynamicCache()``), added that layer at the end of the
  list, as its ``update`` does, and set its attributes.

A replayed call sets the same attributes on its own layer (added first as the cache's
``update`` adds it, where the template's was: :func:`layer`): the plain values as
recorded, the tensors as new fake tensors on the replayed storages (block_replay.py),
held by the cache as the program's are.
"""

from __future__ import annotations

import sys
from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.replay_state import IMMUTABLE

__all__ = ["Snapshot", "known", "layer", "slot_state", "update_code", "written"]

#: The cache's ``update`` transformers defines: ``self.layers[layer_idx].update(...)``, the
#: number used for nothing else but growing the list of layers (where none were made) and
#: offloading (the neighbours' layers moved: not replayed, :func:`known`).
_UPDATES: Final = frozenset({("transformers.cache_utils", "Cache.update")})
_MISSING: Final = object()


def known(obj: Any) -> bool:
    """Whether ``obj`` is a transformers cache whose ``update`` only picks one of its
    layers by the number given (the layer a call fills must be transformers' own too:
    :func:`written`)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None or not isinstance(obj, cache_utils.Cache):
        return False
    update = getattr(type(obj), "update", None)
    if (getattr(update, "__module__", None), getattr(update, "__qualname__", None)) not in _UPDATES:
        return False
    if getattr(obj, "offloading", False):
        return False
    return type(getattr(obj, "layers", None)) is list


def update_code(code: Any) -> bool:
    """Whether ``code`` is the code of the cache's ``update`` :func:`known` accepts."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    update = getattr(getattr(cache_utils, "Cache", None), "update", None)
    return code is getattr(update, "__code__", None)


def _state(value: Any) -> Any:
    if type(value) in IMMUTABLE:
        return value
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, type(value), value.dtype, tuple(value.shape), tuple(value.stride()),
                value.storage_offset(), value.device, value.requires_grad)
    return (type(value), id(value))


def slot_state(cache: Any, index: Any) -> Any:
    """What the layer of ``cache`` at ``index`` holds, as a value equal between layers a
    call treats alike: its class and attributes (plain values by value, tensors by
    layout, the rest by identity); where there is none yet, how far past the end of the
    list it is and the class the cache adds (``layer_class_to_replicate``); None where
    ``index`` is no index."""
    layers = cache.layers
    if type(index) is not int or index < 0:
        return None
    if index >= len(layers):
        return ("added", index - len(layers), getattr(cache, "layer_class_to_replicate", None))
    each = layers[index]
    return (type(each), tuple((k, _state(v)) for k, v in vars(each).items()))


def layer(cache: Any, index: int) -> Any:
    """The layer of ``cache`` at ``index``, added at the end of its list first where the
    cache adds its layers as they are filled (as its ``update`` does)."""
    layers = cache.layers
    if index == len(layers) and getattr(cache, "layer_class_to_replicate", None) is not None:
        layers.append(cache.layer_class_to_replicate())
    return layers[index]


class Snapshot:
    """A cache's attributes and its layers' before a call (shallow: by identity)."""

    __slots__ = ("cache", "layers", "own", "slots")

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.own = dict(vars(cache))
        self.layers = list(cache.layers)
        self.slots = [dict(vars(layer)) for layer in self.layers]


def written(before: Snapshot) -> tuple[int, tuple[tuple[str, Any], ...]] | str | None:
    """What a call changed of the cache ``before`` was taken of: ``(index, ((attribute,
    new value), ...))`` where it changed the attributes of one layer only (set, not
    deleted), or added that one at the end of a cache that adds its layers as they are
    filled (compared with a new one); None where it changed nothing; or why not, in
    words."""
    cache = before.cache
    now = vars(cache)
    if now.keys() != before.own.keys() or any(now[k] is not v for k, v in before.own.items()):
        return "a block changed its KV cache's own attributes"
    layers = cache.layers
    grown = len(layers) - len(before.layers)
    if grown not in (0, 1) or any(a is not b for a, b in zip(layers, before.layers)):
        return "a block changed its KV cache's layers"
    olds = list(before.slots)
    if grown:
        made = getattr(cache, "layer_class_to_replicate", None)
        if made is None or type(layers[-1]) is not made:
            return "a block changed its KV cache's layers"
        olds.append(vars(made()))
    changed = []
    for index, (each, old) in enumerate(zip(layers, olds)):
        new = vars(each)
        if old.keys() - new.keys():
            return "a block deleted an attribute of its KV cache's layer"
        added = grown and index == len(layers) - 1
        if added:
            diffs = tuple((k, v) for k, v in new.items() if k not in old or _state(old[k]) != _state(v))
        else:
            diffs = tuple((k, v) for k, v in new.items() if old.get(k, _MISSING) is not v)
        if diffs or added:
            changed.append((index, diffs))
    if not changed:
        return None
    if len(changed) != 1:
        return f"a block changed {len(changed)} layers of its KV cache"
    index, _ = changed[0]
    if getattr(type(layers[index]).update, "__module__", None) != "transformers.cache_utils":
        return "a block filled a KV cache layer whose update is not transformers'"
    return changed[0]
