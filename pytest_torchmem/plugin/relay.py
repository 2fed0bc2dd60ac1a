"""Checks across pytest-xdist: workers send what they checked and collected; the controller merges.

The controller alone writes files and reports. A worker sends the checks of each
test with the test's reports (so a worker that crashes loses only the test it was
running, which the controller names), and what it collected through
``config.workeroutput`` at its end. The payload is JSON text: execnet carries it
as is.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any, Final

import pytest

from pytest_torchmem.plugin.fitting import FitRecord
from pytest_torchmem.plugin.leaking import LeakRecord
from pytest_torchmem.plugin.judging import Result
from pytest_torchmem.plugin.ledger import CollectionLedger
from pytest_torchmem.plugin.places import SnapshotPlaces
from pytest_torchmem.plugin.record import CheckRecord
from pytest_torchmem.plugin.snapshots import Entry, Key
from pytest_torchmem.plugin.writing import SnapshotWriter

__all__ = ["REPORT_ATTRIBUTE", "WORKER_KEY", "XdistRelay"]

#: The key of this plugin's data in ``config.workeroutput`` (pytest-xdist).
WORKER_KEY: Final = "torchmem"
#: The attribute of a worker's test report that carries the test's checks to the controller.
REPORT_ATTRIBUTE: Final = "torchmem_checks"


class XdistRelay:
    """Sends a worker's checks to the controller, and merges them there.

    Hooks: ``pytest_runtest_logreport`` (a worker's report takes the checks made
    since the last one; the controller takes them in), ``pytest_testnodedown`` and
    ``pytest_sessionfinish`` (what a worker collected, sent at its end).
    """

    def __init__(
        self,
        config: pytest.Config,
        record: CheckRecord,
        ledger: CollectionLedger,
        writer: SnapshotWriter,
        places: SnapshotPlaces,
    ) -> None:
        self._config: Final = config
        self._record: Final = record
        self._ledger: Final = ledger
        self._writer: Final = writer
        self._places: Final = places
        self._is_worker: Final = hasattr(config, "workerinput")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, None, None]:
        # before pytest-xdist's own hook sends a worker's report on (the ledger's, which
        # notes a passed call, comes first: it is tryfirst)
        if self._is_worker:
            self._send_with(report)
        else:
            sent = getattr(report, REPORT_ATTRIBUTE, None)
            if isinstance(sent, str):
                self.merge(sent)
        return (yield)

    def _send_with(self, report: pytest.TestReport) -> None:
        """Give ``report`` the checks not sent yet; they are then forgotten here."""
        record, ledger = self._record, self._ledger
        if record.results or ledger.completed or record.restarted:
            setattr(report, REPORT_ATTRIBUTE, self.payload(collection=False))
            record.clear()
            ledger.completed = set()

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        output = getattr(node, "workeroutput", {})
        if WORKER_KEY in output:
            self.merge(output[WORKER_KEY])

    def pytest_sessionfinish(self) -> None:
        if self._is_worker:
            self._config.workeroutput[WORKER_KEY] = self.payload()  # type: ignore[attr-defined]

    def payload(self, collection: bool = True) -> str:
        """What a worker sends to the controller; ``collection``: with what it collected
        (sent once, at its end)."""
        record, ledger = self._record, self._ledger
        data: dict[str, Any] = {
            "results": [result.to_json() for result in record.results],
            "writes": {
                path: [[list(key), entry.to_json()] for key, entry in entries.items()]
                for path, entries in record.writes.items()
            },
            "used": [[path, list(key)] for path, key in record.used],
            "completed": [list(test) for test in ledger.completed],
            "views": record.views,
            "fits": [fit.to_json() for fit in record.fits],
            "leaks": [leak.to_json() for leak in record.leaks],
            "restarted": sorted(record.restarted),
            "interrupted": self._writer.interrupted,
        }
        if collection:
            data["known"] = {module: sorted(ids) for module, ids in ledger.known.items()}
            data["narrowed"] = sorted(ledger.narrowed)
        return json.dumps(data)

    def merge(self, payload: str) -> None:
        """Take in what one worker sent."""
        data = json.loads(payload)
        record, ledger = self._record, self._ledger
        if data.get("restarted"):
            record.forget(set(data["restarted"]), self._places.snapshot_file_of)
        record.results.extend(Result.from_json(result) for result in data["results"])
        for path, entries in data["writes"].items():
            target = record.writes.setdefault(path, {})
            for key, entry in entries:
                target[Key(*key)] = Entry.from_json(entry)
        record.used.update((path, Key(*key)) for path, key in data["used"])
        ledger.completed.update((module, test) for module, test in data["completed"])
        for module, ids in data.get("known", {}).items():
            ledger.known.setdefault(module, set()).update(ids)
        ledger.narrowed.update(data.get("narrowed", ()))
        record.views.extend(data["views"])
        record.fits.extend(FitRecord.from_json(fit) for fit in data.get("fits", ()))
        record.leaks.extend(LeakRecord.from_json(leak) for leak in data.get("leaks", ()))
        self._writer.interrupted = self._writer.interrupted or bool(data.get("interrupted"))
