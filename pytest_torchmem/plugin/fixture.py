"""The ``torchmem`` fixture's object: what a test calls, ``torchmem.check`` and ``torchmem.fit``.

Each call is handed to the run's :class:`~pytest_torchmem.plugin.checking.CheckRunner`;
making the object begins the test's checks (a rerun's start again from nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest

from pytest_torchmem.plugin.checking import CheckRunner

if TYPE_CHECKING:
    from torch import nn

    from pytest_torchmem.engine.parallel.mesh import Parallel
    from pytest_torchmem.engine.figures.report import MemoryReport
    from pytest_torchmem.engine.step.built_in import LossFn, OptimizerFactory

__all__ = ["TorchmemFixture"]


class TorchmemFixture:
    """The ``torchmem`` fixture: memory checks of the current test."""

    def __init__(self, runner: CheckRunner, item: pytest.Item) -> None:
        self._runner = runner
        self._item = item
        runner.begin(item)

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

        A device whose trace stopped (:class:`~pytest_torchmem.TraceStopped`) has no
        figures: its check fails with where and why, is not compared with the
        snapshot nor written by ``--torchmem-update``, and has no report here.
        """
        __tracebackhide__ = True
        return self._runner.check(
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
        return self._runner.fit(
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
