"""The fixture's checks: each traced, judged and recorded, its verdict carried to the test's report.

A check reads the test's ``memory_budget`` marks (validated at collection), claims
its entry's name, has its figures made on each device
(:mod:`~pytest_torchmem.plugin.estimating`), judges them against the snapshot entry
and the budgets (:mod:`~pytest_torchmem.plugin.judging`) and records the verdict for
the end of the run. A failed check does not stop its test: its message waits for the
report that ends the test's checks (:mod:`~pytest_torchmem.plugin.outcomes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pytest

from pytest_torchmem.engine.figures.modelled_device import CPU, modelled_device, names_cuda
from pytest_torchmem.engine.figures.units import format_bytes
from pytest_torchmem.plugin.advising import advice_lines
from pytest_torchmem.plugin.estimating import Estimator
from pytest_torchmem.plugin.fitting import FitRecord
from pytest_torchmem.plugin.judging import Result, judge, stopped
from pytest_torchmem.plugin.leaking import LeakRecord
from pytest_torchmem.plugin.markers import MARKER, MarkerError, MarkerSpec, parse_gpu, parse_marker
from pytest_torchmem.plugin.messages import failure_message
from pytest_torchmem.plugin.outcomes import PendingVerdicts
from pytest_torchmem.plugin.places import SnapshotPlaces, module_test_id
from pytest_torchmem.plugin.record import CheckRecord, RunLog
from pytest_torchmem.plugin.settings import Settings, known_devices
from pytest_torchmem.plugin.snapshots import (
    NAME_SEPARATOR,
    Key,
    SnapshotError,
    SnapshotFile,
    SnapshotFormatError,
)

if TYPE_CHECKING:
    from torch import nn

    from pytest_torchmem.engine.parallel.mesh import Parallel
    from pytest_torchmem.engine.figures.report import MemoryReport
    from pytest_torchmem.engine.step.built_in import LossFn, OptimizerFactory
    from pytest_torchmem.engine.tracing.trace import Trace

__all__ = ["DEFAULT_NAME", "CheckRunner", "TorchmemWarning"]

#: The name of a check made without ``name=``.
DEFAULT_NAME: Final = "default"

#: The test's marker spec, and the marks it was read from.
_SPEC_KEY: Final = pytest.StashKey[tuple[tuple[Any, ...], MarkerSpec]]()


class TorchmemWarning(pytest.PytestWarning):
    """A suspicious use of pytest-torchmem that does not stop the run."""


def _raised_by_the_engine(exc: BaseException) -> bool:
    """Whether the engine's own code raised ``exc`` (the module of the last frame of its
    traceback), not torch's or the user's called from it."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).startswith("pytest_torchmem.engine.")


class CheckRunner:
    """Runs the checks of the ``torchmem`` fixture, and fails the reports their verdicts end.

    Hooks: ``pytest_pycollect_makeitem`` (a malformed marker fails the collection),
    ``pytest_runtest_call`` (a marker on a test without the fixture is warned about),
    ``pytest_runtest_makereport`` (the report that ends a test's checks fails with
    their messages).
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
        self._estimator: Final = Estimator(settings)
        #: The snapshot files read by checks, by path.
        self._snapshots: dict[Path, SnapshotFile] = {}
        #: Test -> the entry names its checks claimed.
        self._names: dict[str, set[str]] = {}
        #: Tests that made a ``torchmem`` fixture.
        self._began: set[str] = set()
        #: The messages of failed checks, until a report of their test takes them.
        self._verdicts: Final = PendingVerdicts()

    # -- the marker -----------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_pycollect_makeitem(self, collector: pytest.Collector) -> Generator[None, Any, Any]:
        made = yield
        self.read_markers(collector, made)
        return made

    def read_markers(self, collector: pytest.Collector, made: Any) -> None:
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
                    parse_marker(marks, known_devices(), self._settings.gpu_table()),
                )
            except MarkerError as exc:
                raise collector.CollectError(f"{item.nodeid}: {exc}") from None

    def marker_spec(self, item: pytest.Item) -> MarkerSpec:
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
                spec = parse_marker(ordered, known_devices(), self._settings.gpu_table())
            except MarkerError as exc:
                pytest.fail(f"{item.nodeid}: {exc}", pytrace=False)
            item.stash[_SPEC_KEY] = (tuple(marks), spec)
        return spec

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        yield
        self.warn_unused_marker(item)

    def warn_unused_marker(self, item: pytest.Item) -> None:
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

    # -- the verdicts reach the report ----------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        # outermost: sees the report as the xfail marker left it
        report = yield
        self._verdicts.settle(item, report, call)
        return report

    # -- the fixture ----------------------------------------------------------------

    def require_supported_torch(self) -> None:
        """Fail the test asking for the ``torchmem`` fixture (an error at setup, one line)
        where the installed torch is outside the supported window."""
        __tracebackhide__ = True
        from pytest_torchmem.engine.torch_compat.torch_release import TorchReleaseError, require_supported_torch

        try:
            require_supported_torch()
        except TorchReleaseError as exc:
            problem = str(exc)
        else:
            return
        pytest.fail(f"torchmem: {problem}", pytrace=False)

    def begin(self, item: pytest.Item) -> None:
        """A new run of ``item`` begins (its ``torchmem`` fixture is made).

        A rerun (pytest-rerunfailures) checks again from the start: what the
        earlier run checked is forgotten, here and, for a worker, in the controller.
        """
        self._began.add(item.nodeid)
        self._verdicts.forget(item.nodeid)
        if item.nodeid in self._names:
            self._record.forget({item.nodeid}, self._places.snapshot_file_of)
            del self._names[item.nodeid]
            if self._is_worker:
                self._record.restarted.add(item.nodeid)

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
        """``torchmem.check`` (:class:`~pytest_torchmem.plugin.fixture.TorchmemFixture`)."""
        __tracebackhide__ = True
        from torch import nn

        from pytest_torchmem.engine.api import check_parallel
        from pytest_torchmem.engine.step.request import as_compiled, step_request
        from pytest_torchmem.engine.step.built_in import StepArgumentError

        settings = self._settings
        spec = self.marker_spec(item)
        check_parallel(parallel)
        parallel = _marked_parallel(item, spec, parallel)
        # the settings' keep_output and compile are the built-in step's: a step function
        # runs as written
        builtin = isinstance(model, nn.Module)
        if keep_output is None:
            keep_output = spec.keep_output if spec.keep_output is not None else builtin and settings.keep_output
        if compile is None and builtin:
            compile = settings.compile if spec.compile is None else spec.compile
        try:
            request = step_request(
                "torchmem.check", model, inputs, CPU, loss_fn, optimizer, train, keep_output, compile, parallel
            )
        except (TypeError, ValueError) as exc:
            if not _raised_by_the_engine(exc):  # torch's or the user's: its traceback whole
                raise
            # the arguments, refused in one line: shown at the test's call, not in the
            # engine's validation (this frame is hidden)
            raise exc.with_traceback(None) from None
        check_parallel(parallel, request.model)
        name, entry_name = self._claim(
            item,
            name,
            compiled="" if request.compile is None else request.compile.key,
            mesh="" if parallel is None else f"{parallel.key} rank={parallel.rank}",
        )
        request = as_compiled(request)
        devices = spec.devices or settings.devices
        gpu = spec.gpu or settings.gpu
        cpu = _cpu_profile(spec.cpu or settings.cpu)
        path = self._places.snapshot_file(item.path)
        snapshot = self._snapshot_to_check(path)
        if isinstance(snapshot, str):  # failed outside the except: no chained traceback
            pytest.fail(snapshot, pytrace=False)
        reports: dict[str, MemoryReport] = {}
        results: list[Result] = []
        stopped_on: set[str] = set()
        for device in devices:
            # the request on this device, following the run's GPU or CPU profile (resolved once)
            on_device = dataclasses.replace(request, device=modelled_device(device, gpu, cpu))
            try:
                figures = self._estimator.figures(item, on_device, name, spec.fits)
            except StepArgumentError as exc:  # as the arguments above: at the test's call
                raise TypeError(str(exc)) from None
            if figures.unmeasured is not None:
                item.warn(TorchmemWarning(f"torchmem: {item.nodeid} [{entry_name}] on {device}: {figures.unmeasured}"))
            key = Key(module_test_id(item), entry_name, device)
            common: dict[str, Any] = {
                "nodeid": item.nodeid,
                "key": key,
                "file": self._places.display(path),
                "accept": self._places.accept_command(item),
                "snapshot": snapshot.get(key),
                "tolerance": spec.tolerance(settings.tolerance),
                "budgets": spec.budgets,
                "update": settings.update,
                "release": self._places.release(),
            }
            if figures.stopped is not None:
                # no figures: not compared, not written (the entry there, if any, stays)
                stopped_on.add(device)
                why = self._places.locations(str(figures.stopped))
                result = stopped(partial=figures.entry, why=why, **common)
            else:
                result = judge(
                    estimate=figures.entry,
                    fail_on_improvement=settings.fail_on_improvement,
                    measure_rtol=settings.measure_rtol,
                    fail_on_stale=settings.stale == "fail",
                    rooms=figures.rooms,
                    **common,
                )
                reports[device] = figures.report
            if result.failed and settings.advise and result.stopped is None:
                advice = advice_lines(on_device, result)
                result = dataclasses.replace(result, advice=tuple(map(self._places.locations, advice)))
            write = settings.update and result.stopped is None
            self._record.add(result, str(path), figures.entry if write else None)
            _record_properties(item, result)
            if figures.trace is not None:
                self._export(result, figures.trace)
            results.append(result)
        if any(result.failed for result in results):
            # The test goes on (its later checks run too); the report that ends them fails.
            self._verdicts.add(item.nodeid, failure_message(results, self._config.get_verbosity()))
        allowed = spec.leak if spec.leak is not None else 0 if settings.leaks else None
        if allowed is not None:
            if parallel is not None:
                if spec.leak is not None:
                    pytest.fail(
                        f"torchmem: {item.nodeid}: memory_budget(leak=...) does not check parallel= "
                        "checks yet; check the step's leaks without parallel= (one process's step "
                        "leaks as each rank's does)",
                        pytrace=False,
                    )
            else:
                devices_left = [device for device in devices if device not in stopped_on]
                self._check_leaks(item, request, entry_name, devices_left, gpu, cpu, allowed)
        return reports

    def _check_leaks(
        self, item: pytest.Item, request: Any, name: str, devices: list[str], gpu: Any, cpu: Any, allowed: int
    ) -> None:
        """The check's leak check on each of ``devices`` (:mod:`~pytest_torchmem.plugin.leaking`),
        recorded; the test fails where it grows by more than ``allowed`` per iteration."""
        from pytest_torchmem.engine.leaks.check import leak_check
        from pytest_torchmem.engine.figures.stopped import TraceStopped

        for device in devices:
            on_device = dataclasses.replace(request, device=modelled_device(device, gpu, cpu))
            try:
                report = leak_check(on_device)
            except TraceStopped as exc:
                why = self._places.locations(str(exc))
                self._verdicts.add(item.nodeid, f"torchmem: the leak check of {name!r} on {device} stopped: {why}")
                continue
            measured = None
            if on_device.device.is_cuda and self._estimator.measures(gpu):
                measured = leak_check(on_device, measure=True)
            record = LeakRecord.of(item.nodeid, name, report, allowed, measured)
            self._record.leaks.append(record)
            for view in self._record.views:
                if view.get("nodeid") == item.nodeid and view.get("name") == name and view.get("device") == device:
                    view["leak"] = record.to_json()
            if record.leaks:
                self._verdicts.add(item.nodeid, self._places.locations(record.failure()))
            elif record.fragmentation:
                item.warn(TorchmemWarning(record.warning()))

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

    def _snapshot_to_check(self, path: Path) -> SnapshotFile | str:
        """The snapshot file checks compare with (read once), or why it cannot be read."""
        try:
            snapshot = self._snapshots.get(path)
            if snapshot is None:
                snapshot = self._snapshots[path] = SnapshotFile.load(path)
            return snapshot
        except SnapshotFormatError as exc:
            if not self._settings.update:
                return str(exc)
            # --torchmem-update replaces a file that is not a snapshot: nothing to compare.
            snapshot = self._snapshots[path] = SnapshotFile(path)
            return snapshot
        except SnapshotError as exc:
            return str(exc)

    def _export(self, result: Result, traced: Trace) -> None:
        """Keep what ``--torchmem-timeline`` and ``--torchmem-html`` ask for of one check."""
        if self._settings.timeline_dir is not None:
            from pytest_torchmem.plugin.exports.memory_viz import write_timeline

            try:
                write_timeline(self._settings.timeline_dir, result, traced)
            except OSError as exc:
                self._log.errors.append(f"torchmem: could not write a timeline: {exc}")
        if self._settings.html_path is not None:
            from pytest_torchmem.plugin.exports.html_report import check_view

            self._record.views.append(check_view(result, traced, root=self._config.invocation_params.dir))

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
        from pytest_torchmem.engine.fit.search import fit

        if at_least is not None and (isinstance(at_least, bool) or not isinstance(at_least, int) or at_least < 1):
            raise TypeError(f"torchmem.fit(at_least=...) takes a positive int, got {at_least!r}")
        on_cuda = device is None or names_cuda(device)
        profile = None
        if on_cuda and (budget is None or gpu is not None):
            if gpu is not None:
                profile = parse_gpu(gpu, self._settings.gpu_table(), "torchmem.fit(gpu=...)")
            else:
                profile = self.marker_spec(item).gpu or self._settings.gpu
        plugins = self._config.pluginmanager
        terminal = None if self._is_worker else plugins.get_plugin("terminalreporter")
        capture = plugins.get_plugin("capturemanager")

        def progress(probe: Any) -> None:
            if terminal is None or self._config.get_verbosity() < 0:
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
        self._record.fits.append(record)
        if record.short:
            self._verdicts.add(item.nodeid, record.failure())
        return found


def _cpu_profile(name: str) -> Any:
    """The :class:`~pytest_torchmem.CpuProfile` ``name`` says (``"host"``: this machine now)."""
    __tracebackhide__ = True
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import cpu_profile

    try:
        return cpu_profile(name)
    except ValueError as exc:  # "host" on a machine no profile describes
        pytest.fail(f"torchmem: cpu profile {name!r}: {exc}", pytrace=False)


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
    try:
        # (a pipeline's schedule and micro-batches kept)
        return dataclasses.replace(
            parallel,
            mesh=dict(parallel.mesh) if spec.mesh is None else spec.mesh,
            rank=parallel.rank if spec.rank is None else spec.rank,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        pytest.fail(f"{item.nodeid}: @pytest.mark.{MARKER}: {exc}", pytrace=False)


def _record_properties(item: pytest.Item, result: Result) -> None:
    """The figures as junitxml properties (what the ``record_property`` fixture does)."""
    prefix = f"torchmem.{result.key.name}.{result.key.device}"
    if result.stopped is not None:  # no figures
        item.user_properties.append((f"{prefix}.status", result.status.value))
        return
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
