"""Which tests the run collected, narrowed to and ran, and which snapshot entries none of them used.

A deselected test (``-k``, ``--lf``) is not a deleted one: every test a module
made is known, before any plugin filters it. An entry is unused when its test
is gone, or when its test's call passed without making it; only the tests that
ran are judged (``file.py::test_x`` narrows the judgment to the tests named). A
pytest-xdist worker that crashed lost the checks of the test it was running: the
run says so.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any, Final

import pytest

from pytest_torchmem.plugin.places import SnapshotPlaces, module_test_id
from pytest_torchmem.plugin.record import CheckRecord, RunLog
from pytest_torchmem.plugin.settings import Settings
from pytest_torchmem.plugin.snapshots import (
    Key,
    SnapshotError,
    SnapshotFile,
    SnapshotFormatError,
    module_of,
    unused_keys,
)
from pytest_torchmem.plugin.summary import Unused

__all__ = ["CollectionLedger"]


class CollectionLedger:
    """The tests of one run (collected, named, ran, passed, lost) and the entries they left unused.

    Hooks: ``pytest_make_collect_report`` and ``pytest_itemcollected`` (what was
    collected), ``pytest_runtest_logreport`` (what ran, and passed),
    ``pytest_handlecrashitem`` (what a crashed worker lost), ``pytest_sessionfinish``
    (first: the unused entries, which the snapshot writer removes and the reporter
    shows).
    """

    def __init__(
        self,
        config: pytest.Config,
        settings: Settings,
        record: CheckRecord,
        places: SnapshotPlaces,
        log: RunLog,
    ) -> None:
        self._config: Final = config
        self._settings: Final = settings
        self._record: Final = record
        self._places: Final = places
        self._log: Final = log
        self._is_worker: Final = hasattr(config, "workerinput")
        #: Module -> the test ids collected in it, selected or not.
        self.known: dict[str, set[str]] = {}
        #: Modules of which only some tests were collected (``file.py::test_x`` arguments).
        self.narrowed: set[str] = set()
        #: (module, test id) of every test whose call passed.
        self.completed: set[tuple[str, str]] = set()
        #: Node ids of the tests that made a report in this run (they ran, in part at least).
        self.ran: set[str] = set()
        #: Tests that a crashed pytest-xdist worker was running: their checks are lost.
        self.lost: list[str] = []
        #: The entries no test of the run used (judged at its end).
        self.unused: list[Unused] = []
        #: The unused entries by snapshot file, for the snapshot writer to remove.
        self.removals: dict[Path, list[Key]] = {}
        self._targets = self._node_targets(config)
        #: The tests this process collected: node id -> (module, test id).
        self._collected_ids: dict[str, tuple[str, str]] = {}

    @staticmethod
    def _node_targets(config: pytest.Config) -> set[str] | None:
        """Files named with ``::`` on the command line (None: some could not be resolved)."""
        targets: set[str] = set()
        for arg in config.args:
            if "::" not in arg:
                continue
            path = Path(config.invocation_params.dir, arg.split("::", 1)[0])
            if not path.is_file():
                return None
            targets.add(str(path.resolve()))
        return targets

    # -- collection -----------------------------------------------------------------

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        self.note_collected(item)

    def note_collected(self, item: pytest.Item) -> None:
        """Remember every collected test id: a deselected test is not a deleted one."""
        module = str(item.path)
        test = module_test_id(item)
        self.known.setdefault(module, set()).add(test)
        self._collected_ids[item.nodeid] = (module, test)
        if self._targets is None or str(item.path.resolve()) in self._targets:
            self.narrowed.add(module)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        # innermost: sees what the collector made before --lf filters it
        report = yield
        self.note_made(collector, report)
        return report

    def note_made(self, collector: pytest.Collector, report: pytest.CollectReport) -> None:
        """Remember the tests a module or class made, before any plugin filters them.

        ``--lf`` drops the tests that passed last time from the collector's
        report (they never reach ``pytest_itemcollected``): they are not deleted
        tests, and their snapshot entries are not unused.
        """
        if not report.passed or not isinstance(collector, (pytest.Module, pytest.Class)):
            return
        items = [node for node in report.result if isinstance(node, pytest.Item)]
        if items:
            self.known.setdefault(str(collector.path), set()).update(map(module_test_id, items))

    def collected(self, nodeid: str) -> bool:
        """Whether this run collected the test ``nodeid`` (selected or not)."""
        file, _, test = nodeid.partition("::")
        return test in self.known.get(str(self._config.rootpath / file), set())

    # -- running --------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, None, None]:
        # before the relay sends a worker's report on: what passed goes with it
        self.note_ran(report)
        return (yield)

    def note_ran(self, report: pytest.TestReport) -> None:
        """Note the test of ``report`` as run, and as passed where its call passed (only the
        entries of a test whose call passed can be judged unused).

        The report is as the check runner left it: a call whose checks failed failed. A
        test this process did not collect (a pytest-xdist controller's, sent by a worker)
        is noted as passed by the worker that ran it.
        """
        self.ran.add(report.nodeid)
        if report.when == "call" and report.passed and report.nodeid in self._collected_ids:
            self.completed.add(self._collected_ids[report.nodeid])

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: Any, sched: Any) -> None:
        """A pytest-xdist worker died while it ran ``crashitem``: the checks it made there are lost."""
        self.lost.append(crashitem)

    # -- the end --------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self) -> None:
        # first: the snapshot writer removes the unused entries, the reporter shows them
        if self._is_worker:
            return
        self.removals = self.judge_unused()
        self._report_lost()

    def judge_unused(self) -> dict[Path, list[Key]]:
        """The entries no test of this run used, by snapshot file (also kept in :attr:`unused`)."""
        settings = self._settings
        if settings.unused == "ignore" or self._config.option.collectonly:
            return {}
        completed: dict[str, set[str]] = {}
        for module, test in self.completed:
            completed.setdefault(module, set()).add(test)
        devices = set(settings.devices) if settings.devices_given else None
        # a Python module's doctests are collected under --doctest-modules only
        doctest_modules = bool(self._config.getoption("doctestmodules", False))
        found: dict[Path, list[Key]] = {}
        for path in sorted(self._snapshot_files()):
            if not path.is_file():
                continue
            try:
                # An update keeps a malformed entry it does not rewrite, and says so.
                snapshot = SnapshotFile.load(path, keep_malformed=settings.update)
            except SnapshotFormatError as exc:
                if not (settings.update and str(path) in self._record.writes):  # else replaced
                    self._log.errors.append(str(exc))
                continue
            except SnapshotError as exc:
                self._log.errors.append(str(exc))
                continue
            module = str(module_of(path))
            if not module_of(path).exists():
                keys = snapshot.keys()
            else:
                keys = unused_keys(
                    snapshot,
                    completed=completed.get(module, set()),
                    used={key for file, key in self._record.used if file == str(path)},
                    known=None if module in self.narrowed else self.known.get(module, set()),
                    devices=devices,
                    doctests=not module.endswith(".py") or doctest_modules,
                )
            if keys:
                found[path] = keys
                self.unused.extend(Unused(self._places.display(path), key) for key in keys)
        return found

    def _snapshot_files(self) -> set[Path]:
        """The files to judge: those of collected modules, and orphans beside them."""
        modules = set(self.known) | {module for module, _ in self.completed}
        # Only this run's directory: another release's files are that release's to judge.
        files = {self._places.snapshot_file(Path(module)) for module in modules}
        for folder in {path.parent for path in files}:
            if folder.is_dir():
                files.update(path for path in folder.glob("*.json") if not module_of(path).exists())
        return files

    def _report_lost(self) -> None:
        for nodeid in self.lost:
            self._log.errors.append(
                f"torchmem: a pytest-xdist worker crashed while running {nodeid}: the checks it "
                "made there are lost"
                + (
                    "; its snapshot entries are left as they were: rerun it with --torchmem-update"
                    if self._settings.update
                    else ""
                )
            )
