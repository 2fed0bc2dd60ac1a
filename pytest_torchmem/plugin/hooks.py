"""pytest hooks of pytest-torchmem: options, the ``memory_budget`` marker, the ``torchmem`` fixture.

Each hook hands off to the run's :class:`~pytest_torchmem.plugin.session.TorchmemSession`,
kept in ``config.stash``. Nothing here imports torch: pytest imports this module
in every run, and the tracer is imported by the first memory check.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Final

import pytest

from pytest_torchmem.plugin import hookspecs
from pytest_torchmem.plugin.markers import MARKER
from pytest_torchmem.plugin.session import TorchmemFixture, TorchmemSession
from pytest_torchmem.plugin.settings import (
    DEFAULT_CPU,
    DEFAULT_DEVICES,
    DEFAULT_GPU,
    MEASURE_MODES,
    STALE_MODES,
    UNUSED_MODES,
)

SESSION_KEY: Final = pytest.StashKey[TorchmemSession]()

_MARKER_HELP: Final = (
    f"{MARKER}(forward=None, backward=None, step=None, peak=None, devices=None, rtol=None, "
    "atol=None, gpu=None, cpu=None, keep_output=None, compile=None, mesh=None, rank=None, "
    "fits=None): memory "
    "caps of the step checked by the torchmem fixture (bytes, or strings such as '512 MiB'), the "
    "devices to trace, the drift allowed from the snapshot, the GPU profile the cuda estimate "
    "follows (e.g. 'A100', a name of the ini option torchmem_gpus, 'current' or a "
    "pytest_torchmem.GpuProfile), the CPU profile the cpu estimate follows (e.g. 'avx512:8', or "
    "'host'), whether the model's output is held through backward (True) or released before it "
    "(False), whether the model is checked as torch.compile runs it (True, or a dict of "
    "torch.compile's mode, dynamic, fullgraph and options), the mesh and rank of a "
    "parallel check, and the GPUs the cuda step must fit (True: its own, or names)."
)


def _session(config: pytest.Config) -> TorchmemSession:
    return config.stash[SESSION_KEY]


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def _option(
    parser: pytest.Parser, name: str, help_text: str, ini_type: str = "string", **kwargs: Any
) -> None:
    """``--torchmem-NAME`` and its ini twin ``torchmem_NAME`` (the command line wins)."""
    dest = "torchmem_" + name.replace("-", "_")
    if ini_type == "bool":
        kwargs.update(action="store_true", default=None)  # None: not given, ask the ini file
    parser.getgroup("torchmem").addoption(f"--torchmem-{name}", dest=dest, help=help_text, **kwargs)
    default = False if ini_type == "bool" else ""
    parser.addini(dest, f"default of --torchmem-{name}", type=ini_type, default=default)  # type: ignore[arg-type]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("torchmem", "memory regression tests of PyTorch models (pytest-torchmem)")
    _option(
        parser,
        "update",
        "Write or refresh the snapshot entries of the selected tests, and drop their unused "
        "entries, instead of comparing.",
        "bool",
    )
    _option(
        parser,
        "devices",
        "Comma-separated devices to trace when a test's marker names none "
        f"(default: {','.join(DEFAULT_DEVICES)}).",
        metavar="NAMES",
    )
    _option(
        parser,
        "rtol",
        "Default relative drift allowed from the snapshot (e.g. 0.02; default 0).",
        metavar="R",
    )
    _option(
        parser,
        "atol",
        "Default absolute drift allowed from the snapshot (bytes, or e.g. '1 MiB'; default 0).",
        metavar="SIZE",
    )
    _option(
        parser,
        "unused",
        "What snapshot entries that no test of this run used do: fail the run (default), warn, "
        "or ignore. Judged only over the tests that ran.",
        choices=UNUSED_MODES,
    )
    _option(parser, "json", "Write a JSON report of every check to PATH.", metavar="PATH")
    _option(
        parser,
        "timeline",
        "Write each check's estimated allocation timeline into DIR, one file per check and "
        "device, in the format of torch.cuda.memory._snapshot() (open it with PyTorch's memory "
        "viewer).",
        metavar="DIR",
    )
    _option(
        parser,
        "html",
        "Write a self-contained HTML report of every check to PATH: memory across the step by "
        "category, the largest tensors at the peak, the comparison with the snapshot.",
        metavar="PATH",
    )
    _option(
        parser,
        "measure",
        "Also run cuda checks on the real GPU and compare with the estimate: auto (default: "
        "where a GPU is present), on or off.",
        choices=MEASURE_MODES,
    )
    _option(
        parser,
        "measure-rtol",
        "Relative difference allowed between the GPU measurement and the estimate (default 0.05).",
        metavar="R",
    )
    _option(
        parser,
        "gpu",
        "The GPU profile the fake cuda device models: a name, e.g. A100, or one of the ini "
        f"option torchmem_gpus, or current for this machine's GPU (default: {DEFAULT_GPU}).",
        metavar="NAME",
    )
    parser.addini(
        "torchmem_gpus",
        "GPU profiles of your own, one per line: NAME: memory=16GiB cc=8.9 sms=66 (optionally "
        "threads_per_sm=... shared_per_block=...); --torchmem-gpu, torchmem_gpu and the marker's "
        "gpu= take their names",
        type="linelist",
        default=[],
    )
    _option(
        parser,
        "cpu",
        "The CPU profile the fake cpu device models: ISA level (default, avx2, avx512, avx512_bf16, amx) and "
        f"intra-op threads, e.g. avx512:8, or host for this machine (default: {DEFAULT_CPU}, "
        "the same bytes on every machine).",
        metavar="PROFILE",
    )
    _option(
        parser,
        "keep-output",
        "Hold the model's output through backward (as `out = model(**batch); "
        "out.loss.backward()` does) in checks that do not say keep_output; by default it is "
        "released before backward, as a loop that keeps only the loss does.",
        "bool",
    )
    _option(
        parser,
        "compile",
        "Check models as torch.compile(model) runs them (inductor's program, in its steady "
        "state) in checks that do not say compile; their entries are keyed '<name> @ compiled'.",
        "bool",
    )
    _option(
        parser,
        "fail-on-improvement",
        "Fail checks whose memory shrank beyond the tolerance, so that snapshots get tightened.",
        "bool",
    )
    _option(
        parser,
        "advise",
        "For a check over its budget or not fitting a GPU its marker's fits= names, estimate "
        "changes that would bring it down (blocks to checkpoint, micro-batches, the optimizer, "
        "autocast) and add them to the failure, each with the figure of the changed step.",
        "bool",
    )
    _option(
        parser,
        "per-torch",
        "Keep one snapshot directory per torch minor release (__torchmem__/torch-2.13/), for a "
        "suite whose CI runs several releases: each release compares with, updates and prunes "
        "its own entries only.",
        "bool",
    )
    _option(
        parser,
        "stale",
        "What a snapshot entry recorded in another environment (torch version, CPU or GPU "
        "profile) does: warn (default: reported, not compared) or fail.",
        choices=STALE_MODES,
    )


class _RunHooks:
    """The hooks whose arguments do not lead to the run's config, bound to one run."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        _session(self.config).logged(report)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: Any, sched: Any) -> None:
        _session(self.config).crashed(crashitem)

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        _session(self.config).stopped(excinfo)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)
    config.stash[SESSION_KEY] = TorchmemSession(config)
    config.pluginmanager.register(_RunHooks(config), "torchmem-run")


def pytest_unconfigure(config: pytest.Config) -> None:
    if SESSION_KEY in config.stash:
        del config.stash[SESSION_KEY]
    run_hooks = config.pluginmanager.get_plugin("torchmem-run")
    if run_hooks is not None:
        config.pluginmanager.unregister(run_hooks)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return _session(config).header()


def pytest_itemcollected(item: pytest.Item) -> None:
    _session(item.config).collected(item)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    # innermost: sees what the collector made before --lf filters it
    report = yield
    _session(collector.config).made(collector, report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(
    collector: pytest.Collector, name: str, obj: object
) -> Generator[None, Any, Any]:
    made = yield
    _session(collector.config).validate(collector, made)
    return made


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield
    _session(item.config).called(item)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # outermost: sees the report as the xfail marker left it
    report = yield
    _session(item.config).finished(item, report, call)
    return report


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    _session(node.config).worker_down(node)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _session(session.config).finish(session)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    _session(config).write_summary(terminalreporter)


@pytest.fixture
def torchmem(request: pytest.FixtureRequest) -> TorchmemFixture:
    """Memory checks of this test: ``torchmem.check(model, inputs, ...)``."""
    __tracebackhide__ = True
    _session(request.config).require_supported_torch()
    return TorchmemFixture(_session(request.config), request.node)
