"""The state of one pytest run, kept in ``config.stash``: settings, results, pending writes.

The plugin's hooks hand everything to :class:`TorchmemSession`. Checks run in
the process that runs the test (a pytest-xdist worker or the only process);
snapshot files are written once, at the end, by the process that is not a
worker. A worker sends the checks of each test with the test's reports (so a
worker that crashes loses only the test it was running, which the controller
names), and what it collected through ``config.workeroutput`` at its end.

This module does not import torch: pytest loads the plugin in every run, and a
run that checks no memory (``pytest --help``, another project's tests, the
xdist controller) should not pay for it. The tracer is imported by the first
check.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
import json
import os
import platform
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pytest

from pytest_torchmem.engine.torch_release import release_problem
from pytest_torchmem.engine.units import format_bytes
from pytest_torchmem.plugin import releases, unwritten
from pytest_torchmem.plugin.advising import advice_lines
from pytest_torchmem.plugin.fitting import FitRecord, fit_lines
from pytest_torchmem.plugin.estimating import Estimator
from pytest_torchmem.plugin.outcomes import PendingVerdicts
from pytest_torchmem.plugin.releases import Release
from pytest_torchmem.plugin.settings import Settings, known_devices
from pytest_torchmem.plugin.snapshots import (
    NAME_SEPARATOR,
    SNAPSHOT_DIR,
    Entry,
    Key,
    SnapshotError,
    SnapshotFile,
    SnapshotFormatError,
    atomic_write,
    is_doctest,
    module_of,
    snapshot_path,
    unused_keys,
    write_merged,
)
from pytest_torchmem.plugin.summary import (
    Unused,
    json_report,
    stale_lines,
    table_lines,
    totals,
    totals_line,
    unused_lines,
)
from pytest_torchmem.plugin.judging import Result, Status, judge
from pytest_torchmem.plugin.markers import MARKER, MarkerError, MarkerSpec, parse_gpu, parse_marker
from pytest_torchmem.plugin.messages import failure_message

if TYPE_CHECKING:
    from torch import nn

    from pytest_torchmem.engine.parallel import Parallel
    from pytest_torchmem.engine.report import MemoryReport
    from pytest_torchmem.engine.step import LossFn, OptimizerFactory
    from pytest_torchmem.engine.tracing.trace import Trace

__all__ = [
    "DEFAULT_NAME",
    "TorchmemSession",
    "TorchmemFixture",
    "TorchmemWarning",
]

#: The name of a check made without ``name=``.
DEFAULT_NAME: Final = "default"
#: The key of this plugin's data in ``config.workeroutput`` (pytest-xdist).
WORKER_KEY: Final = "torchmem"
#: The attribute of a worker's test report that carries the test's checks to the controller.
REPORT_ATTRIBUTE: Final = "torchmem_checks"

#: The test's marker spec, and the marks it was read from.
_SPEC_KEY: Final = pytest.StashKey[tuple[tuple[Any, ...], MarkerSpec]]()

class TorchmemWarning(pytest.PytestWarning):
    """A suspicious use of pytest-torchmem that does not stop the run."""


def _cpu_profile(name: str) -> Any:
    """The :class:`~pytest_torchmem.CpuProfile` ``name`` says (``"host"``: this machine now)."""
    __tracebackhide__ = True
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import cpu_profile

    try:
        return cpu_profile(name)
    except ValueError as exc:  # "host" on a machine no profile describes
        pytest.fail(f"torchmem: cpu profile {name!r}: {exc}", pytrace=False)


def module_test_id(item: pytest.Item) -> str:
    """The test's id inside its module: the node id after the file (``TestA::test_b[1]``)."""
    return item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name


def _quote(target: str) -> str:
    if any(char in target for char in '"$`\\!'):
        return shlex.quote(target)
    return f'"{target}"'


def _marked_parallel(item: pytest.Item, spec: MarkerSpec, parallel: Parallel | None) -> Parallel | None:
    """``parallel`` with the marker's ``mesh=`` and ``rank=`` in place of its own."""
    if spec.mesh is None and spec.rank is None:
        return parallel
    if parallel is None:
        pytest.fail(
            f"{item.nodeid}: @pytest.mark.{MARKER}(mesh=..., rank=...) applies to "
            "torchmem.check(..., parallel=tm.Parallel(mesh=..., apply=fn)); this check "
            "has no parallel=, so say how the model is parallelized there",
            pytrace=False,
        )
    from pytest_torchmem.engine.parallel import Parallel

    try:
        return Parallel(
            mesh=parallel.mesh if spec.mesh is None else spec.mesh,
            apply=parallel.apply,
            rank=parallel.rank if spec.rank is None else spec.rank,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        pytest.fail(f"{item.nodeid}: @pytest.mark.{MARKER}: {exc}", pytrace=False)


class TorchmemSession:
    """Everything one pytest run knows about its memory checks."""

    def __init__(self, config: pytest.Config) -> None:
        self.config: Final = config
        self.settings: Final = Settings.from_config(config)
        self.is_worker: Final = hasattr(config, "workerinput")
        self.results: list[Result] = []
        #: Snapshot file -> entries to write (``--torchmem-update``).
        self.writes: dict[str, dict[Key, Entry]] = {}
        #: (snapshot file, key) of every check made.
        self.used: set[tuple[str, Key]] = set()
        #: (module, test id) of every test whose call passed.
        self.completed: set[tuple[str, str]] = set()
        #: Module -> the test ids collected in it, selected or not.
        self.known: dict[str, set[str]] = {}
        #: Modules of which only some tests were collected (``file.py::test_x`` arguments).
        self.narrowed: set[str] = set()
        #: Tests whose checks began again (a rerun): what they checked before is void.
        self.restarted: set[str] = set()
        #: Tests that a crashed pytest-xdist worker was running: their checks are lost.
        self.lost: list[str] = []
        #: Node ids of the tests that made a report in this run (they ran, in part at least).
        self.ran: set[str] = set()
        #: True when Ctrl-C or ``pytest.exit()`` stopped the run (here or in a worker).
        self.interrupted = False
        #: The snapshot files an update did not write (as shown), and why.
        self.not_written: dict[str, str] = {}
        self.unused: list[Unused] = []
        self.written: list[str] = []
        self.errors: list[str] = []
        #: What the HTML report shows of each check (JSON-ready; workers send theirs).
        self.views: list[dict[str, Any]] = []
        #: The ``torchmem.fit`` searches of the run (workers send theirs).
        self.fits: list[FitRecord] = []
        self._targets = self._node_targets(config)
        self._snapshots: dict[Path, SnapshotFile] = {}
        #: The release whose snapshot directory this run uses (read at its first use).
        self._release: Release | None = None
        self._names: dict[str, set[str]] = {}
        #: Tests that made a ``torchmem`` fixture.
        self._began: set[str] = set()
        #: The messages of failed checks, until a report of their test takes them.
        self.verdicts: Final = PendingVerdicts()
        self._estimator: Final = Estimator(self.settings)

    # -- collection -----------------------------------------------------------------

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

    def collected(self, item: pytest.Item) -> None:
        """Remember every collected test id: a deselected test is not a deleted one."""
        module = str(item.path)
        self.known.setdefault(module, set()).add(module_test_id(item))
        if self._targets is None or str(item.path.resolve()) in self._targets:
            self.narrowed.add(module)

    def made(self, collector: pytest.Collector, report: pytest.CollectReport) -> None:
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

    def validate(self, collector: pytest.Collector, made: Any) -> None:
        """Read the ``memory_budget`` markers of the tests just made from a test function.

        A malformed marker fails the collection of the module (as a malformed
        ``parametrize`` does), with a message that names the bad value; this
        works alike under pytest-xdist, whose workers collect.
        """
        items = made if isinstance(made, list) else [made]
        for item in items:
            if not isinstance(item, pytest.Item):
                continue
            marks = list(item.iter_markers(MARKER))
            if not marks:
                continue
            try:
                item.stash[_SPEC_KEY] = (
                    tuple(marks),
                    parse_marker(marks, known_devices(), self.settings.gpu_table()),
                )
            except MarkerError as exc:
                raise collector.CollectError(f"{item.nodeid}: {exc}") from None

    def called(self, item: pytest.Item) -> None:
        """The test's body returned: warn about a marker that had no effect.

        The warning is judged after the call, not at collection, so that a test
        that gets the fixture through ``request.getfixturevalue("torchmem")`` (or
        a fixture of its own that does) is not warned.
        """
        if item.nodeid not in self._began and any(True for _ in item.iter_markers(MARKER)):
            item.warn(
                TorchmemWarning(
                    f"@pytest.mark.{MARKER} has no effect on {item.nodeid}: "
                    "the test does not use the torchmem fixture"
                )
            )

    def spec(self, item: pytest.Item) -> MarkerSpec:
        """The test's marker spec, read again when marks were added since collection.

        A mark added later (``item.add_marker`` in ``pytest_collection_modifyitems``)
        overrides, key by key, the marks the test had when it was collected.
        """
        __tracebackhide__ = True
        marks = list(item.iter_markers(MARKER))
        read, spec = item.stash.get(_SPEC_KEY, ((), None))
        if spec is None or list(read) != marks:
            added = [mark for mark in marks if not any(mark is old for old in read)]
            ordered = [*reversed(added), *(mark for mark in marks if mark not in added)]
            try:
                spec = parse_marker(ordered, known_devices(), self.settings.gpu_table())
            except MarkerError as exc:
                pytest.fail(f"{item.nodeid}: {exc}", pytrace=False)
            item.stash[_SPEC_KEY] = (tuple(marks), spec)
        return spec

    # -- running --------------------------------------------------------------------

    def finished(
        self, item: pytest.Item, report: pytest.TestReport, call: pytest.CallInfo[Any]
    ) -> None:
        """A report of ``item`` is made: fail it if it ends checks that failed
        (:mod:`~pytest_torchmem.plugin.outcomes`); note the tests whose call passed
        (only their entries can be judged unused).

        A pytest-xdist worker sends what the test checked with its reports, so
        that the controller has every check made before a worker crash.
        """
        self.verdicts.settle(item, report, call)
        if report.when == "call" and report.passed:
            self.completed.add((str(item.path), module_test_id(item)))
        if self.is_worker and (self.results or self.completed or self.restarted):
            setattr(report, REPORT_ATTRIBUTE, self._take())

    def logged(self, report: pytest.TestReport) -> None:
        """Take in the checks a pytest-xdist worker sent with a test's report."""
        self.ran.add(report.nodeid)
        sent = getattr(report, REPORT_ATTRIBUTE, None)
        if not self.is_worker and isinstance(sent, str):
            self.merge(sent)

    def stopped(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """pytest ends the run early (``pytest_keyboard_interrupt``).

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

    def crashed(self, nodeid: str) -> None:
        """A pytest-xdist worker died while it ran ``nodeid``: the checks it made there are lost."""
        self.lost.append(nodeid)

    def begin(self, item: pytest.Item) -> None:
        """A new run of ``item`` begins (its ``torchmem`` fixture is made).

        A rerun (pytest-rerunfailures) checks again from the start: what the
        earlier run checked is forgotten, here and, for a worker, in the controller.
        """
        self._began.add(item.nodeid)
        self.verdicts.forget(item.nodeid)
        if item.nodeid in self._names:
            self._forget({item.nodeid})
            if self.is_worker:
                self.restarted.add(item.nodeid)

    def _forget(self, nodeids: set[str]) -> None:
        root = self.config.rootpath
        dropped = {
            (str(self.snapshot_file(root / result.nodeid.split("::", 1)[0])), result.key)
            for result in self.results
            if result.nodeid in nodeids
        }
        self.results = [result for result in self.results if result.nodeid not in nodeids]
        for path, key in dropped:
            self.writes.get(path, {}).pop(key, None)
        self.used -= dropped
        self.views = [view for view in self.views if view.get("nodeid") not in nodeids]
        self.fits = [record for record in self.fits if record.nodeid not in nodeids]
        for nodeid in nodeids:
            self._names.pop(nodeid, None)

    def _claim(
        self, item: pytest.Item, name: str | None, compiled: str, mesh: str
    ) -> tuple[str, str]:
        """The check's name (``name``, or the default one) and its entry's, claimed.

        The entry's name is the check's, then the parts the check adds, each after
        :data:`~pytest_torchmem.plugin.snapshots.NAME_SEPARATOR`: ``compiled`` (a
        compiled check's options: it has an entry beside the eager check of the same
        name) and ``mesh`` (a parallel check's mesh and rank: each has an entry of its
        own). A name holding the separator could spell another check's entry, so it is
        refused; a name claimed twice with the same parts is one entry twice.
        """
        __tracebackhide__ = True
        if name is None:
            name = DEFAULT_NAME
        elif not isinstance(name, str) or not name.strip():
            raise TypeError(f"torchmem.check(name=...) must be a non-empty string, got {name!r}")
        elif NAME_SEPARATOR in name:
            raise ValueError(
                f"torchmem.check(name={name!r}): a name cannot hold {NAME_SEPARATOR!r}, which "
                "separates the parts of an entry's key that the check adds "
                f"({NAME_SEPARATOR + 'compiled'!r}, {NAME_SEPARATOR + 'dp=8 rank=0'!r}); "
                f"name it e.g. {name.replace(NAME_SEPARATOR, '-')!r}"
            )
        entry = name + "".join(NAME_SEPARATOR + part for part in (compiled, mesh) if part)
        names = self._names.setdefault(item.nodeid, set())  # (begin() empties it for a rerun)
        if entry in names:
            hint = "" if name != DEFAULT_NAME else " without a name"
            alike = [
                *(["compiled alike"] if compiled else []),
                *([f"on the same mesh and rank, {mesh}"] if mesh else []),
            ]
            how = f" ({', '.join(alike)})" if alike else ""
            raise ValueError(
                f"torchmem.check was called twice{hint} as {name!r}{how} in {item.nodeid}; "
                "pass name=... to tell several checks in one test apart"
            )
        names.add(entry)
        return name, entry

    def release(self) -> Release | None:
        """The torch release whose snapshot directory this run reads and writes
        (``torchmem_per_torch``), or None: one directory for every release."""
        if not self.settings.per_torch:
            return None
        if self._release is None:
            release = releases.running_release()
            if release is None:
                raise pytest.UsageError(
                    f"--torchmem-per-torch (ini torchmem_per_torch): cannot tell the release of "
                    f"the installed torch ({releases.torch_version()!r})"
                )
            self._release = release
        return self._release

    def snapshot_file(self, module: Path) -> Path:
        """The snapshot file this run uses for the test module at ``module``."""
        return snapshot_path(module, self.release())

    def _snapshot(self, path: Path) -> SnapshotFile:
        snapshot = self._snapshots.get(path)
        if snapshot is None:
            snapshot = self._snapshots[path] = SnapshotFile.load(path)
        return snapshot

    def _snapshot_to_check(self, path: Path) -> SnapshotFile | str:
        """The snapshot file checks compare with, or why it cannot be read."""
        try:
            return self._snapshot(path)
        except SnapshotFormatError as exc:
            if not self.settings.update:
                return str(exc)
            # --torchmem-update replaces a file that is not a snapshot: nothing to compare.
            snapshot = self._snapshots[path] = SnapshotFile(path)
            return snapshot
        except SnapshotError as exc:
            return str(exc)

    def display(self, path: Path) -> str:
        """``path`` as the user sees it: relative to where pytest was started."""
        try:
            return Path(os.path.relpath(path, self.config.invocation_params.dir)).as_posix()
        except ValueError:  # another drive on Windows
            return str(path)

    @property
    def _doctest_modules(self) -> bool:
        """Whether this run collects the doctests of Python modules (``--doctest-modules``)."""
        return bool(self.config.getoption("doctestmodules", False))

    def accept_command(self, item: pytest.Item) -> str:
        return self._accept(item.path, module_test_id(item) if "::" in item.nodeid else None)

    def _accept(self, path: Path, test: str | None) -> str:
        """The command that updates the entries of ``test`` (a test id) in the file at ``path``."""
        target = self.display(path)
        if test is not None:
            target += "::" + test
        # Where the entry goes: an update without the option would write another file.
        options = " --torchmem-per-torch" if self.settings.per_torch_given else ""
        # A module's doctest is collected (and found by its node id) with the option only.
        if (
            path.suffix == ".py"
            and test is not None
            and is_doctest(test)
            and "--doctest-modules" in self.config.invocation_params.args
        ):
            options += " --doctest-modules"
        return f"pytest --torchmem-update{options} {_quote(target)}"

    def check(
        self,
        item: pytest.Item,
        model: nn.Module,
        inputs: Any,
        *,
        loss_fn: LossFn | None,
        optimizer: OptimizerFactory | None,
        train: bool,
        name: str | None,
        keep_output: bool | None = None,
        compile: Any = None,
        parallel: Parallel | None = None,
    ) -> dict[str, MemoryReport]:
        __tracebackhide__ = True
        from torch import nn

        from pytest_torchmem.engine.api import _check_parallel
        from pytest_torchmem.engine.request import as_compiled, step_request

        spec = self.spec(item)
        _check_parallel(parallel)
        parallel = _marked_parallel(item, spec, parallel)
        # the settings' keep_output and compile are the built-in step's: a step function
        # runs as written
        builtin = isinstance(model, nn.Module)
        if keep_output is None:
            keep_output = spec.keep_output if spec.keep_output is not None else builtin and self.settings.keep_output
        if compile is None and builtin:
            compile = self.settings.compile if spec.compile is None else spec.compile
        request = step_request(
            "torchmem.check", model, inputs, "cpu", loss_fn, optimizer, train, keep_output, compile
        )
        _check_parallel(parallel, request.model)
        name, entry_name = self._claim(
            item,
            name,
            compiled="" if request.compile is None else request.compile.key,
            mesh="" if parallel is None else f"{parallel.key} rank={parallel.rank}",
        )
        request = as_compiled(request, parallel)
        devices = spec.devices or self.settings.devices
        gpu = spec.gpu or self.settings.gpu
        cpu = _cpu_profile(spec.cpu or self.settings.cpu)
        path = self.snapshot_file(item.path)
        snapshot = self._snapshot_to_check(path)
        if isinstance(snapshot, str):  # failed outside the except: no chained traceback
            pytest.fail(snapshot, pytrace=False)
        reports: dict[str, MemoryReport] = {}
        results: list[Result] = []
        for device in devices:
            figures = self._estimator.figures(
                item, request, device, name, gpu, cpu, parallel, spec.fits
            )
            report, traced, entry = figures.report, figures.trace, figures.entry
            key = Key(module_test_id(item), entry_name, device)
            result = judge(
                nodeid=item.nodeid,
                key=key,
                file=self.display(path),
                accept=self.accept_command(item),
                estimate=entry,
                snapshot=snapshot.get(key),
                tolerance=spec.tolerance(self.settings.tolerance),
                budgets=spec.budgets,
                update=self.settings.update,
                fail_on_improvement=self.settings.fail_on_improvement,
                measure_rtol=self.settings.measure_rtol,
                fail_on_stale=self.settings.stale == "fail",
                release=self.release(),
                rooms=figures.rooms,
            )
            if result.failed and self.settings.advise:
                result = dataclasses.replace(result, advice=advice_lines(request, result, gpu, cpu, self.settings.gpus))
            self.results.append(result)
            self.used.add((str(path), key))
            if self.settings.update:
                self.writes.setdefault(str(path), {})[key] = entry
            _record_properties(item, result)
            self._export(result, traced)
            reports[device] = report
            results.append(result)
        if any(result.failed for result in results):
            # The test goes on (its later checks run too); the report that ends them fails.
            self.verdicts.add(item.nodeid, failure_message(results, self.config.get_verbosity()))
        return reports

    def fit(
        self,
        item: pytest.Item,
        model: Any,
        inputs_for: Any,
        *,
        gpu: Any,
        budget: Any,
        device: str | None,
        sizes: Any,
        at_least: int | None,
        size_name: str,
        options: dict[str, Any],
    ) -> Any:
        """``torchmem.fit``: :func:`pytest_torchmem.fit` against the test's GPU (``gpu``, else
        the marker's, else the run's) or ``budget``, a progress line per estimate on the
        terminal; the test fails, as a failed check does, below ``at_least``."""
        from pytest_torchmem.engine.fitting import fit

        if at_least is not None and (isinstance(at_least, bool) or not isinstance(at_least, int) or at_least < 1):
            raise TypeError(f"torchmem.fit(at_least=...) takes a positive int, got {at_least!r}")
        on_cuda = device is None or str(device).startswith("cuda")
        profile = None
        if on_cuda and (budget is None or gpu is not None):
            if gpu is not None:
                profile = parse_gpu(gpu, self.settings.gpu_table(), "torchmem.fit(gpu=...)")
            else:
                profile = self.spec(item).gpu or self.settings.gpu
        plugins = self.config.pluginmanager
        terminal = None if self.is_worker else plugins.get_plugin("terminalreporter")
        capture = plugins.get_plugin("capturemanager")

        def progress(probe: Any) -> None:
            if terminal is None or self.config.get_verbosity() < 0:
                return
            verdict = "fits" if probe.fits else "does not fit"
            line = f"torchmem fit: {size_name} {probe.size}: {format_bytes(probe.nbytes)}, {verdict}"
            # the test's output is captured: the line goes past it, as live logging does
            with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
                terminal.write_line(line)

        found = fit(
            model,
            inputs_for,
            sizes=sizes,
            budget=budget,
            gpu=profile,
            device=device,
            size_name=size_name,
            progress=progress,
            **options,
        )
        record = FitRecord.of(item.nodeid, found, at_least)
        self.fits.append(record)
        if record.short:
            self.verdicts.add(item.nodeid, record.failure())
        return found

    def _export(self, result: Result, traced: Trace) -> None:
        """Keep what ``--torchmem-timeline`` and ``--torchmem-html`` ask for of one check."""
        if self.settings.timeline_dir is not None:
            from pytest_torchmem.exports.memory_viz import write_timeline

            try:
                write_timeline(self.settings.timeline_dir, result, traced)
            except OSError as exc:
                self.errors.append(f"torchmem: could not write a timeline: {exc}")
        if self.settings.html_path is not None:
            from pytest_torchmem.exports.html_report import check_view

            self.views.append(check_view(result, traced, root=self.config.invocation_params.dir))

    # -- pytest-xdist ---------------------------------------------------------------

    def payload(self, collection: bool = True) -> str:
        """What a worker sends to the controller (JSON text: execnet carries it as is);
        ``collection``: with what it collected (sent once, at its end)."""
        data: dict[str, Any] = {
            "results": [result.to_json() for result in self.results],
            "writes": {
                path: [[list(key), entry.to_json()] for key, entry in entries.items()]
                for path, entries in self.writes.items()
            },
            "used": [[path, list(key)] for path, key in self.used],
            "completed": [list(test) for test in self.completed],
            "views": self.views,
            "fits": [record.to_json() for record in self.fits],
            "restarted": sorted(self.restarted),
            "interrupted": self.interrupted,
        }
        if collection:
            data["known"] = {module: sorted(ids) for module, ids in self.known.items()}
            data["narrowed"] = sorted(self.narrowed)
        return json.dumps(data)

    def _take(self) -> str:
        """The worker's checks not sent yet, as a payload; they are then forgotten here."""
        payload = self.payload(collection=False)
        self.results, self.writes, self.used, self.views = [], {}, set(), []
        self.fits = []
        self.completed, self.restarted = set(), set()
        return payload

    def merge(self, payload: str) -> None:
        """Take in what one worker sent."""
        data = json.loads(payload)
        if data.get("restarted"):
            self._forget(set(data["restarted"]))
        self.results.extend(Result.from_json(result) for result in data["results"])
        for path, entries in data["writes"].items():
            target = self.writes.setdefault(path, {})
            for key, entry in entries:
                target[Key(*key)] = Entry.from_json(entry)
        self.used.update((path, Key(*key)) for path, key in data["used"])
        self.completed.update((module, test) for module, test in data["completed"])
        for module, ids in data.get("known", {}).items():
            self.known.setdefault(module, set()).update(ids)
        self.narrowed.update(data.get("narrowed", ()))
        self.views.extend(data["views"])
        self.fits.extend(FitRecord.from_json(record) for record in data.get("fits", ()))
        self.interrupted = self.interrupted or bool(data.get("interrupted"))

    def worker_down(self, node: Any) -> None:
        output = getattr(node, "workeroutput", {})
        if WORKER_KEY in output:
            self.merge(output[WORKER_KEY])

    # -- the end --------------------------------------------------------------------

    def finish(self, session: pytest.Session) -> None:
        """Send the results (worker); or judge unused entries, write files, set the exit status."""
        if self.is_worker:
            self.config.workeroutput[WORKER_KEY] = self.payload()  # type: ignore[attr-defined]
            return
        self.results.sort(key=lambda r: (r.nodeid, r.key.name, r.key.device))
        removals = self._find_unused()
        for nodeid in self.lost:
            self.errors.append(
                f"torchmem: a pytest-xdist worker crashed while running {nodeid}: the checks it "
                "made there are lost"
                + (
                    "; its snapshot entries are left as they were: rerun it with --torchmem-update"
                    if self.settings.update
                    else ""
                )
            )
        if self.settings.update:
            if self.interrupted:
                # A run stopped anywhere (Ctrl-C, pytest.exit) writes nothing: the files
                # stay as they were rather than hold what a half-made check left.
                if self.writes or removals:
                    self.errors.append(
                        "torchmem: the run was interrupted: no snapshot file was written; "
                        "rerun with --torchmem-update"
                    )
                self._left({*map(Path, self.writes), *removals}, "interrupted")
            elif self._flush(removals):
                session.exitstatus = pytest.ExitCode.INTERRUPTED
        if not self.config.option.collectonly:
            self._remember_unwritten()
        self._write_json()
        self._write_html()
        failing = self.errors or (
            self.unused and self.settings.unused == "fail" and not self.settings.update
        )
        if failing and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _snapshot_files(self) -> set[Path]:
        """The files to judge: those of collected modules, and orphans beside them."""
        modules = set(self.known) | {module for module, _ in self.completed}
        # Only this run's directory: another release's files are that release's to judge.
        files = {self.snapshot_file(Path(module)) for module in modules}
        for folder in {path.parent for path in files}:
            if folder.is_dir():
                files.update(path for path in folder.glob("*.json") if not module_of(path).exists())
        return files

    def _find_unused(self) -> dict[Path, list[Key]]:
        if self.settings.unused == "ignore" or self.config.option.collectonly:
            return {}
        completed: dict[str, set[str]] = {}
        for module, test in self.completed:
            completed.setdefault(module, set()).add(test)
        devices = set(self.settings.devices) if self.settings.devices_given else None
        found: dict[Path, list[Key]] = {}
        for path in sorted(self._snapshot_files()):
            if not path.is_file():
                continue
            try:
                # An update keeps a malformed entry it does not rewrite, and says so.
                snapshot = SnapshotFile.load(path, keep_malformed=self.settings.update)
            except SnapshotFormatError as exc:
                if not (self.settings.update and str(path) in self.writes):  # else replaced
                    self.errors.append(str(exc))
                continue
            except SnapshotError as exc:
                self.errors.append(str(exc))
                continue
            module = str(module_of(path))
            if not module_of(path).exists():
                keys = snapshot.keys()
            else:
                keys = unused_keys(
                    snapshot,
                    completed=completed.get(module, set()),
                    used={key for file, key in self.used if file == str(path)},
                    known=None if module in self.narrowed else self.known.get(module, set()),
                    devices=devices,
                    # a Python module's doctests are collected under --doctest-modules only
                    doctests=not module.endswith(".py") or self._doctest_modules,
                )
            if keys:
                found[path] = keys
                self.unused.extend(Unused(self.display(path), key) for key in keys)
        return found

    def _flush(self, removals: dict[Path, list[Key]]) -> bool:
        """Write every pending entry and drop the unused ones, one locked merge per file.

        Each file is replaced whole or left as it was. A file that is not a
        snapshot is replaced by this run's entries. Returns True when Ctrl-C
        stopped the writing (the files not yet written are left as they were).
        """
        paths = sorted(set(map(Path, self.writes)) | set(removals))
        failed: set[str] = set()
        for index, path in enumerate(paths):
            writes = self.writes.get(str(path), {})
            shown = self.display(path)
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
                left = ", ".join(self.display(later) for later in paths[index:])
                self.errors.append(
                    f"torchmem: interrupted while writing snapshot files; left as they were: "
                    f"{left}; rerun with --torchmem-update"
                )
                self._left(failed, "could not write")
                self._left(set(paths[index:]), "interrupted while writing")
                return True
            except SnapshotError as exc:
                self.errors.append(f"torchmem: could not write {shown}: {exc}")
                failed.add(path)
                continue
            except OSError as exc:
                where = f": {exc.filename}" if exc.filename else ""
                self.errors.append(
                    f"torchmem: could not write {shown}: {exc.strerror or exc}{where}; the file "
                    f"on disk is unchanged (make {self.display(path.parent)} writable, then "
                    "rerun with --torchmem-update)"
                )
                failed.add(path)
                continue
            if changed:
                self.written.append(shown)
            self.errors.extend(
                f"torchmem: {shown}: kept the entry {entry}; fix it, or rerun its test with "
                "--torchmem-update"
                for entry in kept
            )
        self._left(failed, "could not write")
        return False

    def _left(self, paths: set[Path], why: str) -> None:
        """The files at ``paths`` were not written (``why``): neither were their entries."""
        shown = {self.display(path): why for path in paths}
        self.not_written.update(shown)
        for view in self.views:  # the HTML report's, made when each check was
            if view.get("file") in shown and view.get("status") in ("new", "updated"):
                view["status"] = Status.NOT_WRITTEN.value
        self.results = [
            dataclasses.replace(result, status=Status.NOT_WRITTEN, not_written=shown[result.file])
            if result.file in shown and result.status in (Status.NEW, Status.UPDATED)
            else result
            for result in self.results
        ]

    def _remember_unwritten(self) -> None:
        """Keep the record of updates not written (:mod:`~pytest_torchmem.plugin.unwritten`):
        fail this run for each test of it that this run collected and did not run."""
        now = {
            result.nodeid: result.not_written
            for result in self.results
            if result.status is Status.NOT_WRITTEN and result.not_written
        }
        earlier = unwritten.load(self.config)
        kept, skipped = unwritten.settle(
            earlier,
            now,
            ran=self.ran | {result.nodeid for result in self.results},
            collected=self._collected,
        )
        for nodeid, why in skipped:
            file, _, test = nodeid.partition("::")
            self.errors.append(
                f"torchmem: {nodeid}: its update by an earlier run was not written ({why}), and "
                f"this run did not run it: rerun it with "
                f"{self._accept(self.config.rootpath / file, test or None)}"
            )
        if kept != earlier:
            unwritten.save(self.config, kept)

    def _collected(self, nodeid: str) -> bool:
        """Whether this run collected the test ``nodeid`` (selected or not)."""
        file, _, test = nodeid.partition("::")
        return test in self.known.get(str(self.config.rootpath / file), set())

    def environment(self) -> dict[str, Any]:
        import torch

        from pytest_torchmem import __version__

        return {
            "pytest_torchmem": __version__,
            "torch": releases.torch_version(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "gpu_profile": self.settings.gpu.name,
            "cpu_profile": self.settings.cpu,
            "cpu_threads": torch.get_num_threads(),
            "cpu_isa": torch.backends.cpu.get_cpu_capability(),
            # The GPU the cuda checks were measured on (--torchmem-measure), if any.
            "measured_on": torch.cuda.get_device_name() if self._measured() else None,
        }

    def _measured(self) -> bool:
        """Whether any check of the run (in this process or a worker) was measured on a GPU."""
        return any(result.estimate.measured is not None for result in self.results)

    def _write_json(self) -> None:
        path = self.settings.json_path
        if path is None:
            return
        report = json_report(
            self.results,
            self.unused,
            environment=self.environment(),
            settings={**self.settings.to_json(), "measured_on_gpu": self._measured()},
        )
        report["fits"] = [record.to_json() for record in self.fits]
        try:
            atomic_write(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            self.errors.append(f"torchmem: could not write the JSON report {path}: {exc}")

    def _write_html(self) -> None:
        path = self.settings.html_path
        if path is None:
            return
        from pytest_torchmem.exports.html_report import write_report

        try:
            write_report(path, self.views, environment=self.environment())
        except OSError as exc:
            self.errors.append(f"torchmem: could not write the HTML report {path}: {exc}")
        else:
            self.written.append(self.display(path))

    # -- reporting ------------------------------------------------------------------

    def header(self) -> list[str]:
        settings = self.settings
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

    def require_supported_torch(self) -> None:
        """Fail the test asking for the ``torchmem`` fixture (an error at setup, one line)
        where the installed torch is outside the supported window."""
        __tracebackhide__ = True
        from pytest_torchmem.engine.torch_release import TorchReleaseError, require_supported_torch

        try:
            require_supported_torch()
        except TorchReleaseError as exc:
            problem = str(exc)
        else:
            return
        pytest.fail(f"torchmem: {problem}", pytrace=False)

    def summary_lines(self) -> list[str]:
        """The terminal summary: the table, unused entries, files written, the totals."""
        if self.is_worker or not (self.results or self.unused or self.errors or self.fits):
            return []
        verbosity = self.config.get_verbosity()
        lines = table_lines(self.results, verbosity=verbosity, gpu=self.settings.gpu.name)
        lines += stale_lines(self.results, mode=self.settings.stale)
        lines += unused_lines(
            self.unused,
            mode=self.settings.unused,
            update=self.settings.update,
            not_written=self.not_written,
        )
        lines += fit_lines(self.fits)
        lines += [f"wrote {path}" for path in self.written]
        lines += self.errors
        lines.append(totals_line(totals(self.results, self.unused)))
        return lines

    def write_summary(self, terminal: pytest.TerminalReporter) -> None:
        lines = self.summary_lines()
        if lines:
            terminal.write_sep("-", "torchmem")
            for line in lines:
                terminal.write_line(line)


def _record_properties(item: pytest.Item, result: Result) -> None:
    """The figures as junitxml properties (what the ``record_property`` fixture does)."""
    prefix = f"torchmem.{result.key.name}.{result.key.device}"
    entry = result.estimate
    figures: list[tuple[str, object]] = [
        ("forward_peak", entry.forward_peak),
        ("backward_peak", entry.backward_peak),
        ("step_peak", entry.step_peak),
        ("peak", entry.peak),
    ]
    if entry.first_step is not None:
        figures.append(("first_step_peak", max(entry.first_step)))
    if entry.reserved_peak is not None:
        figures.append(("reserved_peak", entry.reserved_peak))
    if result.snapshot is not None:
        figures.append(("snapshot_peak", result.snapshot.peak))
    figures.append(("status", result.status.value))
    item.user_properties.extend((f"{prefix}.{name}", value) for name, value in figures)


class TorchmemFixture:
    """The ``torchmem`` fixture: memory checks of the current test."""

    def __init__(self, session: TorchmemSession, item: pytest.Item) -> None:
        self._session = session
        self._item = item
        session.begin(item)

    def __repr__(self) -> str:
        return f"<torchmem fixture of {self._item.nodeid}>"

    def check(
        self,
        model: nn.Module,
        inputs: Any,
        *,
        loss_fn: LossFn | None = None,
        optimizer: OptimizerFactory | None = None,
        train: bool = True,
        name: str | None = None,
        keep_output: bool | None = None,
        compile: bool | Mapping[str, Any] | None = None,
        parallel: Parallel | None = None,
    ) -> dict[str, MemoryReport]:
        """Trace one step of ``model`` on each device and check it; return the reports by device.

        The estimate on each device (the marker's ``devices``, else
        ``--torchmem-devices``) is compared with the snapshot entry of this
        test, check ``name`` and device, and with the marker's budgets; the
        test fails with a message that says what moved and how to accept it,
        however the test then ends (:mod:`~pytest_torchmem.plugin.outcomes`).
        ``name`` tells several checks in one test apart (any text without
        ``" @ "``, which separates a name from the parts of the entry's key that
        ``compile`` and ``parallel`` add). Under
        ``--torchmem-update`` the entries are written at the end of the run.
        ``keep_output`` (``estimate``'s): ``None`` takes the marker's
        ``keep_output``, else ``--torchmem-keep-output`` (ini
        ``torchmem_keep_output``), else ``False``; an entry recorded with the
        other setting fails until it is re-recorded.
        ``compile`` (``estimate``'s): ``None`` takes the marker's ``compile``, else
        ``--torchmem-compile`` (ini ``torchmem_compile``: ``True``), else ``False``
        (eager); a compiled check's entry is keyed ``"<name> @ compiled"`` (with
        the options given), beside the eager check of the same name.
        ``parallel`` (``estimate``'s): the memory of one rank; the marker's
        ``mesh=`` and ``rank=`` take the place of its own, and each mesh and
        rank has an entry of its own.
        """
        __tracebackhide__ = True
        return self._session.check(
            self._item,
            model,
            inputs,
            loss_fn=loss_fn,
            optimizer=optimizer,
            train=train,
            name=name,
            keep_output=keep_output,
            compile=compile,
            parallel=parallel,
        )

    def fit(
        self,
        model: Any,
        inputs_for: Any,
        *,
        gpu: Any = None,
        budget: int | str | None = None,
        device: str | None = None,
        sizes: Any = range(1, 4097),
        at_least: int | None = None,
        size_name: str = "size",
        **options: Any,
    ) -> Any:
        """The largest of ``sizes`` whose step of ``model`` on ``inputs_for(size)`` fits the
        test's GPU (``gpu``, else the marker's ``gpu``, else ``--torchmem-gpu``), or
        ``budget``: :func:`pytest_torchmem.fit`, with a progress line per estimate on
        the terminal. The answer (a :class:`~pytest_torchmem.Fit`) is returned and shown in
        the run's summary and JSON report; below ``at_least`` the test fails, however it
        then ends. ``options`` are :func:`~pytest_torchmem.estimate`'s."""
        __tracebackhide__ = True
        return self._session.fit(
            self._item,
            model,
            inputs_for,
            gpu=gpu,
            budget=budget,
            device=device,
            sizes=sizes,
            at_least=at_least,
            size_name=size_name,
            options=options,
        )
