"""What the run says about its checks: header, JSON and HTML reports, summary, exit status.

The lines and the JSON data are made by :mod:`~pytest_torchmem.plugin.summary`
and the HTML page by :mod:`~pytest_torchmem.plugin.exports.html_report`; the reporter
writes them once, at the end of the run, in the process that is not a
pytest-xdist worker (which sends its checks on instead).
"""

from __future__ import annotations

import json
import platform
from typing import Any, Final

import pytest

from pytest_torchmem.engine.torch_compat.torch_release import release_problem
from pytest_torchmem.plugin import releases
from pytest_torchmem.plugin.fitting import fit_lines
from pytest_torchmem.plugin.leaking import leak_lines
from pytest_torchmem.plugin.ledger import CollectionLedger
from pytest_torchmem.plugin.places import SnapshotPlaces
from pytest_torchmem.plugin.record import CheckRecord, RunLog
from pytest_torchmem.plugin.settings import Settings
from pytest_torchmem.plugin.snapshots import SNAPSHOT_DIR, atomic_write
from pytest_torchmem.plugin.summary import (
    json_report,
    stale_lines,
    table_lines,
    totals,
    totals_line,
    unused_lines,
)
from pytest_torchmem.plugin.writing import SnapshotWriter

__all__ = ["Reporter"]


class Reporter:
    """The run's header, reports, summary and exit status.

    Hooks: ``pytest_sessionfinish`` (last: the JSON and HTML reports, then the exit
    status). The header and the summary are asked for by ``hooks.py``'s own
    ``pytest_report_header`` and ``pytest_terminal_summary``: lines that other plugins
    print beside them keep their order only from the entry point's hooks (pluggy
    calls a plugin registered later first).
    """

    def __init__(
        self,
        config: pytest.Config,
        settings: Settings,
        record: CheckRecord,
        ledger: CollectionLedger,
        writer: SnapshotWriter,
        places: SnapshotPlaces,
        log: RunLog,
    ) -> None:
        self._config: Final = config
        self._settings: Final = settings
        self._record: Final = record
        self._ledger: Final = ledger
        self._writer: Final = writer
        self._places: Final = places
        self._log: Final = log
        self._is_worker: Final = hasattr(config, "workerinput")

    # -- the header -----------------------------------------------------------------

    def header_lines(self) -> list[str]:
        """``torchmem: compare, devices cpu,cuda, ...``: how this run checks, and a torch
        release outside the supported window."""
        settings = self._settings
        mode = "update" if settings.update else "compare"
        lines = [
            f"torchmem: {mode}, devices {','.join(settings.devices)}, {settings.tolerance}, "
            f"gpu profile {settings.gpu}{'' if settings.gpu.builtin else f' ({settings.gpu.spec})'}, "
            f"cpu profile {settings.cpu}"
            + (", keep_output" if settings.keep_output else "")
            + (", compile" if settings.compile else "")
            + (self._per_torch_header() if settings.per_torch else "")
        ]
        version = releases.torch_version()
        problem = None if version is None else release_problem(version)
        if problem is not None:
            lines.append(f"torchmem: {problem}")
        return lines

    def _per_torch_header(self) -> str:
        """``, snapshots of torch 2.13 (__torchmem__/torch-2.13)``: where this run's entries are."""
        release = releases.running_release()
        if release is None:
            return ""
        return f", snapshots of torch {release} ({SNAPSHOT_DIR}/{release.directory})"

    # -- the end --------------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # last: after the ledger (unused entries) and the snapshot writer (files, statuses)
        if not self._is_worker:
            self.write_reports()
            self.set_exit_status(session)

    def write_reports(self) -> None:
        """The checks in order (test, name, device), then the JSON and HTML reports."""
        self._record.results.sort(key=lambda r: (r.nodeid, r.key.name, r.key.device))
        self.write_json()
        self.write_html()

    def environment(self) -> dict[str, Any]:
        """Where the run's figures were made: versions, platform, profiles, the GPU measured on."""
        import torch

        from pytest_torchmem import __version__

        return {
            "pytest_torchmem": __version__,
            "torch": releases.torch_version(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "gpu_profile": self._settings.gpu.name,
            "cpu_profile": self._settings.cpu,
            "cpu_threads": torch.get_num_threads(),
            "cpu_isa": torch.backends.cpu.get_cpu_capability(),
            # The GPU the cuda checks were measured on (--torchmem-measure), if any.
            "measured_on": torch.cuda.get_device_name() if self._measured() else None,
        }

    def _measured(self) -> bool:
        """Whether any check of the run (in this process or a worker) was measured on a GPU."""
        return any(result.estimate.measured is not None for result in self._record.results)

    def write_json(self) -> None:
        """``--torchmem-json``: every check, unused entry and fit search of the run."""
        path = self._settings.json_path
        if path is None:
            return
        report = json_report(
            self._record.results,
            self._ledger.unused,
            environment=self.environment(),
            settings={**self._settings.to_json(), "measured_on_gpu": self._measured()},
        )
        report["fits"] = [fit.to_json() for fit in self._record.fits]
        report["leaks"] = [leak.to_json() for leak in self._record.leaks]
        try:
            atomic_write(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            self._log.errors.append(f"torchmem: could not write the JSON report {path}: {exc}")

    def write_html(self) -> None:
        """``--torchmem-html``: the page of every check's view."""
        path = self._settings.html_path
        if path is None:
            return
        from pytest_torchmem.plugin.exports.html_report import write_report

        try:
            write_report(path, self._record.views, environment=self.environment())
        except OSError as exc:
            self._log.errors.append(f"torchmem: could not write the HTML report {path}: {exc}")
        else:
            self._log.written.append(self._places.display(path))

    def set_exit_status(self, session: pytest.Session) -> None:
        """Fail a run that passed where a problem was met or an unused entry fails it."""
        failing = self._log.errors or (
            self._ledger.unused and self._settings.unused == "fail" and not self._settings.update
        )
        if failing and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    # -- the summary ----------------------------------------------------------------

    def write_summary(self, terminal: pytest.TerminalReporter) -> None:
        """The summary's lines, under a ``torchmem`` rule, where there are any."""
        lines = self.summary_lines()
        if lines:
            terminal.write_sep("-", "torchmem")
            for line in lines:
                terminal.write_line(line)

    def summary_lines(self) -> list[str]:
        """The terminal summary: the table, unused entries, files written, the totals."""
        record, unused, log = self._record, self._ledger.unused, self._log
        if self._is_worker or not (record.results or unused or log.errors or record.fits or record.leaks):
            return []
        settings = self._settings
        verbosity = self._config.get_verbosity()
        leaks = {(leak.nodeid, leak.name, leak.device): leak for leak in record.leaks}
        lines = table_lines(record.results, verbosity=verbosity, gpu=settings.gpu.name, leaks=leaks)
        lines += stale_lines(record.results, mode=settings.stale)
        lines += unused_lines(
            unused,
            mode=settings.unused,
            update=settings.update,
            not_written=self._writer.not_written,
        )
        lines += fit_lines(record.fits)
        lines += leak_lines(record.leaks)
        lines += [f"wrote {path}" for path in log.written]
        lines += log.errors
        lines.append(totals_line(totals(record.results, unused)))
        return lines
