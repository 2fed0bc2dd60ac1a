"""A bounded memo for rules: values worked out from a key that alone decides them.

A model repeats a few geometries layer after layer, so rules keep what they
worked out for a geometry; the memo forgets everything at once when full, so a
long session of varied models cannot grow it without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["BoundedMemo"]

V = TypeVar("V")


class BoundedMemo(Generic[V]):
    """``key -> value``, at most ``limit`` entries (then cleared)."""

    __slots__ = ("_values", "_limit")

    def __init__(self, limit: int = 4096) -> None:
        self._values: dict[Hashable, V] = {}
        self._limit = limit

    def get(self, key: Hashable, work_out: Callable[[], V]) -> V:
        """The value kept for ``key``, else ``work_out()``, kept. Raises ``TypeError``
        for an unhashable key (the caller works the value out itself)."""
        value = self._values.get(key)
        if value is None:
            if len(self._values) >= self._limit:
                self._values.clear()
            value = self._values[key] = work_out()
        return value
