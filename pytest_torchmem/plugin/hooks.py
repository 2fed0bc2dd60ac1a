"""pytest's entry point: the options, the marker, the fixture, the plugin objects each run registers.

``pytest_configure`` makes one object per job and registers each with pytest's
plugin manager for the hooks it serves (as pytest's own ``LFPlugin`` and
``TerminalReporter`` are); ``pytest_unconfigure`` unregisters them. The run's
objects are kept in ``config.stash``:

- :class:`~pytest_torchmem.plugin.checking.CheckRunner`: the fixture's checks, and the
  reports their verdicts fail;
- :class:`~pytest_torchmem.plugin.ledger.CollectionLedger`: the tests collected and
  run, the snapshot entries none of them used;
- :class:`~pytest_torchmem.plugin.relay.XdistRelay`: the checks of pytest-xdist
  workers, sent to the controller;
- :class:`~pytest_torchmem.plugin.writing.SnapshotWriter`: the snapshot files of an
  update, and the record of those not written;
- :class:`~pytest_torchmem.plugin.reporting.Reporter`: the header, the JSON and HTML
  reports, the terminal summary, the exit status.

At the end of the run the ledger goes first (``tryfirst``: the unused entries), the
reporter last (``trylast``: the reports, then the exit status), the snapshot writer
between them. The header and the summary stay hooks of this module, which ask the
reporter for their lines: where pluggy calls them among other plugins' hooks places
the lines among theirs. Nothing here imports torch: pytest imports this module in
every run, and the tracer is imported by the first memory check.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Final

import pytest

from pytest_torchmem.plugin import hookspecs
from pytest_torchmem.plugin.checking import CheckRunner
from pytest_torchmem.plugin.fixture import TorchmemFixture
from pytest_torchmem.plugin.ledger import CollectionLedger
from pytest_torchmem.plugin.markers import MARKER
from pytest_torchmem.plugin.places import SnapshotPlaces
from pytest_torchmem.plugin.record import CheckRecord, RunLog
from pytest_torchmem.plugin.relay import XdistRelay
from pytest_torchmem.plugin.reporting import Reporter
from pytest_torchmem.plugin.settings import (
    DEFAULT_CPU,
    DEFAULT_DEVICES,
    DEFAULT_GPU,
    MEASURE_MODES,
    STALE_MODES,
    UNUSED_MODES,
    Settings,
)
from pytest_torchmem.plugin.writing import SnapshotWriter

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


#: torch's warning as it is imported where numpy is not installed
#: (torch/csrc/utils/tensor_numpy.cpp): nothing a project without numpy can act on, in the
#: warnings summary of every run. A filter of the run's (``-W`` on the command line wins).
NUMPY_WARNING_FILTER: Final = "ignore:Failed to initialize NumPy:UserWarning"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    # outside pytest's own wrapper of this hook, which applies the filters to the first
    # conftests' imports (a conftest that imports torch)
    early_config.addinivalue_line("filterwarnings", NUMPY_WARNING_FILTER)
    return (yield)


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
        "leaks",
        "Also check every check's step for leaks: run it as a loop runs it and fail the test "
        "where more is held after every iteration than its marker's leak= allows (0 B "
        "unless it says), naming what holds the growth.",
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


@dataclass(frozen=True)
class TorchmemPlugins:
    """The plugin objects of one run, each registered for the hooks it serves."""

    runner: CheckRunner
    ledger: CollectionLedger
    relay: XdistRelay
    writer: SnapshotWriter
    reporter: Reporter

    def named(self) -> dict[str, object]:
        """Each object by the name it is registered under."""
        return {
            "torchmem-checks": self.runner,
            "torchmem-ledger": self.ledger,
            "torchmem-xdist": self.relay,
            "torchmem-snapshots": self.writer,
            "torchmem-report": self.reporter,
        }


PLUGINS_KEY: Final = pytest.StashKey[TorchmemPlugins]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)
    settings = Settings.from_config(config)
    places = SnapshotPlaces(config, settings)
    record, log = CheckRecord(), RunLog()
    ledger = CollectionLedger(config, settings, record, places, log)
    writer = SnapshotWriter(config, settings, record, ledger, places, log)
    plugins = TorchmemPlugins(
        runner=CheckRunner(config, settings, record, places, log),
        ledger=ledger,
        relay=XdistRelay(config, record, ledger, writer, places),
        writer=writer,
        reporter=Reporter(config, settings, record, ledger, writer, places, log),
    )
    config.stash[PLUGINS_KEY] = plugins
    for name, plugin in plugins.named().items():
        config.pluginmanager.register(plugin, name)


def pytest_unconfigure(config: pytest.Config) -> None:
    plugins = config.stash.get(PLUGINS_KEY, None)
    if plugins is None:
        return
    for plugin in plugins.named().values():
        if config.pluginmanager.is_registered(plugin):
            config.pluginmanager.unregister(plugin)
    del config.stash[PLUGINS_KEY]


def _plugins(config: pytest.Config) -> TorchmemPlugins:
    return config.stash[PLUGINS_KEY]


# The header's and the summary's lines take their place among other plugins' by the
# order pluggy calls their hooks in: these two stay the entry point's, as they were.


def pytest_report_header(config: pytest.Config) -> list[str]:
    return _plugins(config).reporter.header_lines()


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    _plugins(config).reporter.write_summary(terminalreporter)


@pytest.fixture
def torchmem(request: pytest.FixtureRequest) -> TorchmemFixture:
    """Memory checks of this test: ``torchmem.check(model, inputs, ...)``."""
    __tracebackhide__ = True
    runner = _plugins(request.config).runner
    runner.require_supported_torch()
    return TorchmemFixture(runner, request.node)
