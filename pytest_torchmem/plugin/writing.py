"""The update's snapshot files, written once at the end by the controller, and those that were not.

Under ``--torchmem-update`` each file gets one locked merge of this run's entries
and loses its unused ones, and is replaced whole or left as it was. A run stopped
anywhere (Ctrl-C, ``pytest.exit``) writes nothing. The checks whose entries were
not written say so (:attr:`Status.NOT_WRITTEN <pytest_torchmem.plugin.judging.Status>`),
and pytest's cache remembers them until a run runs their tests again
(:mod:`~pytest_torchmem.plugin.unwritten`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Final

import pytest

from pytest_torchmem.plugin import unwritten
from pytest_torchmem.plugin.judging import Status
from pytest_torchmem.plugin.ledger import CollectionLedger
from pytest_torchmem.plugin.places import SnapshotPlaces
from pytest_torchmem.plugin.record import CheckRecord, RunLog
from pytest_torchmem.plugin.settings import Settings
from pytest_torchmem.plugin.snapshots import Key, SnapshotError, SnapshotFormatError, write_merged

__all__ = ["SnapshotWriter"]


class SnapshotWriter:
    """Writes the entries of an update run, and keeps account of those it could not write.

    Hooks: ``pytest_keyboard_interrupt`` (a stop that leaves the files as they were),
    ``pytest_sessionfinish`` (after the ledger has judged the unused entries, before
    the reporter: the files, and the record of updates not written).
    """

    def __init__(
        self,
        config: pytest.Config,
        settings: Settings,
        record: CheckRecord,
        ledger: CollectionLedger,
        places: SnapshotPlaces,
        log: RunLog,
    ) -> None:
        self._config: Final = config
        self._settings: Final = settings
        self._record: Final = record
        self._ledger: Final = ledger
        self._places: Final = places
        self._log: Final = log
        self._is_worker: Final = hasattr(config, "workerinput")
        #: True when Ctrl-C or ``pytest.exit()`` stopped the run (here or in a worker).
        self.interrupted = False
        #: The snapshot files an update did not write (as shown), and why.
        self.not_written: dict[str, str] = {}

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """pytest ends the run early.

        Ctrl-C and ``pytest.exit()`` can land anywhere (a check half made): an
        update then writes nothing. A stop that pytest or a plugin makes between two
        tests (``--sw``; ``-x`` and ``--maxfail`` under pytest-xdist) is an exception
        of its own class, raised after a test's end: what the tests that ran checked
        is whole, and is written, as ``-x`` without pytest-xdist (which pytest ends as
        a failed run) always did.
        """
        value = excinfo.value
        if type(value) is KeyboardInterrupt or isinstance(value, pytest.exit.Exception):
            self.interrupted = True

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self._is_worker:
            self.write_snapshots(session)

    def write_snapshots(self, session: pytest.Session) -> None:
        """Write the entries of an update (none where the run was stopped) and drop the
        unused ones; remember the updates not written."""
        if self._settings.update:
            removals = self._ledger.removals
            if self.interrupted:
                # A run stopped anywhere (Ctrl-C, pytest.exit) writes nothing: the files
                # stay as they were rather than hold what a half-made check left.
                if self._record.writes or removals:
                    self._log.errors.append(
                        "torchmem: the run was interrupted: no snapshot file was written; "
                        "rerun with --torchmem-update"
                    )
                self.mark_not_written({*map(Path, self._record.writes), *removals}, "interrupted")
            elif self._write_files(removals):
                session.exitstatus = pytest.ExitCode.INTERRUPTED
        if not self._config.option.collectonly:
            self.remember_unwritten()

    def _write_files(self, removals: dict[Path, list[Key]]) -> bool:
        """Write every pending entry and drop the unused ones, one locked merge per file.

        Each file is replaced whole or left as it was. A file that is not a
        snapshot is replaced by this run's entries. Returns True when Ctrl-C
        stopped the writing (the files not yet written are left as they were).
        """
        display, errors = self._places.display, self._log.errors
        paths = sorted(set(map(Path, self._record.writes)) | set(removals))
        failed: set[Path] = set()
        for index, path in enumerate(paths):
            writes = self._record.writes.get(str(path), {})
            shown = display(path)
            kept: list[str] = []
            try:
                try:
                    changed = write_merged(path, writes, removals.get(path, ()), kept=kept)
                except SnapshotFormatError as exc:
                    if not writes:
                        raise
                    changed = write_merged(path, writes, replace_unreadable=True)
                    shown += f" (replacing a file that was not a snapshot: {exc.reason})"
            except KeyboardInterrupt:
                left = ", ".join(display(later) for later in paths[index:])
                errors.append(
                    f"torchmem: interrupted while writing snapshot files; left as they were: "
                    f"{left}; rerun with --torchmem-update"
                )
                self.mark_not_written(failed, "could not write")
                self.mark_not_written(set(paths[index:]), "interrupted while writing")
                return True
            except SnapshotError as exc:
                errors.append(f"torchmem: could not write {shown}: {exc}")
                failed.add(path)
                continue
            except OSError as exc:
                where = f": {exc.filename}" if exc.filename else ""
                errors.append(
                    f"torchmem: could not write {shown}: {exc.strerror or exc}{where}; the file "
                    f"on disk is unchanged (make {display(path.parent)} writable, then "
                    "rerun with --torchmem-update)"
                )
                failed.add(path)
                continue
            if changed:
                self._log.written.append(shown)
            errors.extend(
                f"torchmem: {shown}: kept the entry {entry}; fix it, or rerun its test with "
                "--torchmem-update"
                for entry in kept
            )
        self.mark_not_written(failed, "could not write")
        return False

    def mark_not_written(self, paths: set[Path], why: str) -> None:
        """The files at ``paths`` were not written (``why``): neither were their entries."""
        shown = {self._places.display(path): why for path in paths}
        self.not_written.update(shown)
        record = self._record
        for view in record.views:  # the HTML report's, made when each check was
            if view.get("file") in shown and view.get("status") in ("new", "updated"):
                view["status"] = Status.NOT_WRITTEN.value
        record.results = [
            dataclasses.replace(result, status=Status.NOT_WRITTEN, not_written=shown[result.file])
            if result.file in shown and result.status in (Status.NEW, Status.UPDATED)
            else result
            for result in record.results
        ]

    def remember_unwritten(self) -> None:
        """Keep the record of updates not written (:mod:`~pytest_torchmem.plugin.unwritten`):
        fail this run for each test of it that this run collected and did not run."""
        results = self._record.results
        now = {
            result.nodeid: result.not_written
            for result in results
            if result.status is Status.NOT_WRITTEN and result.not_written
        }
        earlier = unwritten.load(self._config)
        kept, skipped = unwritten.settle(
            earlier,
            now,
            ran=self._ledger.ran | {result.nodeid for result in results},
            collected=self._ledger.collected,
        )
        for nodeid, why in skipped:
            file, _, test = nodeid.partition("::")
            self._log.errors.append(
                f"torchmem: {nodeid}: its update by an earlier run was not written ({why}), and "
                f"this run did not run it: rerun it with "
                f"{self._places.accept(self._config.rootpath / file, test or None)}"
            )
        if kept != earlier:
            unwritten.save(self._config, kept)
