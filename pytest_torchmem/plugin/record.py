"""What the run keeps for its end: the record of its checks, and the files written and problems met.

The check runner fills the :class:`CheckRecord`; a pytest-xdist worker's relay
sends it on and the controller's merges it; at the end the snapshot writer writes
its entries and the reporter shows its verdicts. The :class:`RunLog` gathers, in
the order they happen, the lines the summary ends with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pytest_torchmem.plugin.fitting import FitRecord
from pytest_torchmem.plugin.judging import Result
from pytest_torchmem.plugin.leaking import LeakRecord
from pytest_torchmem.plugin.snapshots import Entry, Key

__all__ = ["CheckRecord", "RunLog"]


@dataclass
class CheckRecord:
    """The checks made in this process (or merged from workers), until the end of the run."""

    results: list[Result] = field(default_factory=list)
    #: Snapshot file -> entries to write (``--torchmem-update``).
    writes: dict[str, dict[Key, Entry]] = field(default_factory=dict)
    #: (snapshot file, key) of every check made.
    used: set[tuple[str, Key]] = field(default_factory=set)
    #: What the HTML report shows of each check (JSON-ready; workers send theirs).
    views: list[dict[str, Any]] = field(default_factory=list)
    #: The ``torchmem.fit`` searches of the run (workers send theirs).
    fits: list[FitRecord] = field(default_factory=list)
    #: The leak checks of the run (workers send theirs).
    leaks: list[LeakRecord] = field(default_factory=list)
    #: Tests whose checks began again (a rerun) on this worker: what they checked before
    #: is void, in the controller too.
    restarted: set[str] = field(default_factory=set)

    def add(self, result: Result, file: str, entry: Entry | None) -> None:
        """Record the verdict of one check against the snapshot ``file``; ``entry``: to be
        written there (``--torchmem-update``)."""
        self.results.append(result)
        self.used.add((file, result.key))
        if entry is not None:
            self.writes.setdefault(file, {})[result.key] = entry

    def forget(self, nodeids: set[str], file_of: Callable[[str], str]) -> None:
        """Drop what the tests ``nodeids`` checked (``file_of``: the snapshot file of a node id)."""
        dropped = {
            (file_of(result.nodeid), result.key) for result in self.results if result.nodeid in nodeids
        }
        self.results = [result for result in self.results if result.nodeid not in nodeids]
        for path, key in dropped:
            self.writes.get(path, {}).pop(key, None)
        self.used -= dropped
        self.views = [view for view in self.views if view.get("nodeid") not in nodeids]
        self.fits = [record for record in self.fits if record.nodeid not in nodeids]
        self.leaks = [record for record in self.leaks if record.nodeid not in nodeids]

    def clear(self) -> None:
        """Forget everything (a worker, once it has sent it)."""
        self.results, self.writes, self.used, self.views = [], {}, set(), []
        self.fits = []
        self.leaks = []
        self.restarted = set()


@dataclass
class RunLog:
    """The lines that end the run's summary, in the order they happened."""

    #: The files written (snapshot files, the HTML report), as shown.
    written: list[str] = field(default_factory=list)
    #: Problems that fail the run (files that could not be read or written, lost checks...).
    errors: list[str] = field(default_factory=list)
