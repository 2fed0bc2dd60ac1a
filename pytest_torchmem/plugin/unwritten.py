"""Updates that were not written, remembered from one run to the next (pytest's cache).

An update run that Ctrl-C stops (during its tests or while it writes), or one
whose snapshot file cannot be written, leaves the entries as they were and says
so. A later run that does not run such a test (``--sw`` going on from the test
after it, ``--lf``, ``-k``) would say nothing about it, and could exit 0 with the
update never written. The record makes every such run fail, naming the test and
the command that writes its entries, until a run runs the test again (which
writes or compares its entries). A run that does not collect the test (another
module) keeps the record and says nothing.

The record is ``{node id: why}`` under the cache key :data:`CACHE_KEY`; where
pytest's cache is off (``-p no:cacheprovider``, which turns ``--sw`` and ``--lf``
off too) there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from typing import Final

import pytest

__all__ = ["CACHE_KEY", "load", "save", "settle"]

#: Where pytest's cache keeps the record.
CACHE_KEY: Final = "torchmem/unwritten"


def load(config: pytest.Config) -> dict[str, str]:
    """The record the last run left (empty without pytest's cache, or if unreadable)."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return {}
    value = cache.get(CACHE_KEY, {})
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def save(config: pytest.Config, record: Mapping[str, str]) -> None:
    cache = getattr(config, "cache", None)
    if cache is not None:
        cache.set(CACHE_KEY, dict(sorted(record.items())))


def settle(
    earlier: Mapping[str, str],
    now: Mapping[str, str],
    *,
    ran: Set[str],
    collected: Callable[[str], bool],
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The record to keep, and the tests of ``earlier`` this run collected but did not
    run (node id, why its update was not written): each fails the run.

    A test that ran (``ran``) is done with: this run wrote or compared its entries;
    ``now`` holds the updates this run did not write.
    """
    kept: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    for nodeid, why in sorted(earlier.items()):
        if nodeid in ran:
            continue
        kept[nodeid] = why
        if collected(nodeid):
            skipped.append((nodeid, why))
    kept.update(now)
    return kept, skipped
