"""Hook specifications of pytest-torchmem, for ``conftest.py`` files and plugins.

Implement them like any pytest hook, in a ``conftest.py`` or a plugin; a hook
in a ``conftest.py`` applies to the tests under that directory only::

    # conftest.py
    import dataclasses
    import torch
    from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc

    def pytest_torchmem_add_rules(device, rules):
        if device == "cpu":
            @rules.scratch(torch.ops.aten.tanh.default)
            def _tanh(call):
                return [OUTPUTS, Alloc("lookup table", 4096)]

    def pytest_torchmem_adjust_report(item, device, name, report):
        if device == "cuda":  # the CUDA context is not part of the step
            return dataclasses.replace(report, forward_peak=report.forward_peak + 2**20)
        return None
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_torchmem.engine.figures.report import MemoryReport
    from pytest_torchmem.engine.tracing.rules import RuleSet

__all__ = ["pytest_torchmem_add_rules", "pytest_torchmem_adjust_report"]

hookspec = pytest.hookspec  # pytest's own marker for hook specifications


@hookspec
def pytest_torchmem_add_rules(device: str, rules: RuleSet) -> None:
    """Add per-op rules to the device model ``device`` (``"cpu"``, ``"cuda"``).

    ``rules`` is this test session's own copy of the device's
    :class:`~pytest_torchmem.engine.tracing.rules.RuleSet`: register scratch rules,
    implementations or fallbacks on it with its decorators
    (``@rules.scratch(op)``...). The device's built-in rules are never changed,
    and an op that already has a rule of the same kind is refused
    (``ValueError``), as for built-in rules.

    Called once per device and per set of ``conftest.py`` files that apply,
    before the first trace on that device that these files govern.
    """


@hookspec(firstresult=True)
def pytest_torchmem_adjust_report(
    item: pytest.Item, device: str, name: str, report: MemoryReport
) -> MemoryReport | None:
    """Adjust the estimate of one check on one device before it is judged.

    ``item`` is the test, ``name`` the check's name (``"default"`` unless
    ``torchmem.check(..., name=...)`` says otherwise). Return a new
    :class:`~pytest_torchmem.engine.figures.report.MemoryReport` (e.g. made with
    ``dataclasses.replace``) to use it instead, or ``None`` to keep the
    estimate. The first implementation that returns a report wins. The
    adjusted report is what is compared, written to the snapshot and
    returned by ``torchmem.check``.
    """
