"""How the verdict of a test's checks reaches pytest: the report that ends them fails.

A failed check does not stop its test (its later checks run, and are reported).
Its message waits here until pytest makes the report of the phase that ends the
test's checks, and fails that report, however the phase ended:

- setup: a setup that passed keeps the messages for the call; one that failed or
  was skipped (the body will not run) takes them: an error at setup;
- call: takes them, whether the body returned, called ``pytest.skip`` or
  ``pytest.xfail``, raised, or failed or passed under an ``xfail`` marker. A
  memory check is judged against its snapshot entry and its budgets, which only
  ``--torchmem-update`` and the ``memory_budget`` marker change: skipping the test,
  or expecting it to fail, does not excuse it;
- teardown: takes those made since (a check in a fixture's teardown): an error at
  teardown.

The report is changed before pytest and its plugins see it (the exit status,
``-x``, ``--sw``, ``--lf``, junitxml, a pytest-xdist worker sending it on). A
report that had failed already keeps its own failure, with the verdict in a
section of its own; any other becomes a failure whose message is the verdict, then
how the test itself ended.
"""

from __future__ import annotations

from typing import Any, Final

import pytest

__all__ = ["PendingVerdicts", "fail_report"]

#: What follows the way a test ended, in the message of a report turned failed.
_JUDGED: Final = "its memory checks are judged all the same"


class PendingVerdicts:
    """The messages of failed checks, by test, until a report of the test takes them."""

    def __init__(self) -> None:
        self._messages: dict[str, list[str]] = {}

    def add(self, nodeid: str, message: str) -> None:
        self._messages.setdefault(nodeid, []).append(message)

    def forget(self, nodeid: str) -> None:
        """A new run of the test (a rerun) begins: what its earlier run checked is void."""
        self._messages.pop(nodeid, None)

    def settle(self, item: pytest.Item, report: pytest.TestReport, call: pytest.CallInfo[Any]) -> None:
        """Fail ``report`` with the messages waiting for its test, unless it is a setup
        that passed (the call, which follows, takes them)."""
        if report.when == "setup" and report.passed:
            return
        messages = self._messages.pop(item.nodeid, None)
        if messages:
            fail_report(item, report, call, "\n\n".join(messages))


def fail_report(
    item: pytest.Item, report: pytest.TestReport, call: pytest.CallInfo[Any], message: str
) -> None:
    """Make ``report`` a failure that says ``message`` (see the module's docstring)."""
    if report.failed:
        _add_section(report, message)
        return
    ended = _how_it_ended(report, call)
    if ended is not None:
        message += f"\n{ended}; {_JUDGED}"
    report.longrepr = _failure(item, message)
    report.outcome = "failed"
    if hasattr(report, "wasxfail"):  # else pytest counts it as an expected failure
        del report.wasxfail


def _how_it_ended(report: pytest.TestReport, call: pytest.CallInfo[Any]) -> str | None:
    """How a report that passed or was skipped ended, in words; None for a plain pass."""
    reason = getattr(report, "wasxfail", None)
    if reason is not None:
        if report.passed:
            return f"the test passed, although marked xfail ({reason})"
        if call.excinfo is not None and isinstance(call.excinfo.value, pytest.xfail.Exception):
            return f"the test then called pytest.xfail ({reason})"
        return f"the test failed as its xfail marker expects ({reason})"
    if report.skipped:
        longrepr = report.longrepr
        said = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        return f"the test then skipped ({said})"
    return None


def _failure(item: pytest.Item, message: str) -> Any:
    """The failure ``pytest.fail(message, pytrace=False)`` would have made here: its short
    summary line (``FAILED ... - Failed: torchmem: ...``) and its message, no traceback."""
    try:
        raise pytest.fail.Exception(message, pytrace=False)
    except pytest.fail.Exception:
        excinfo = pytest.ExceptionInfo.from_current()
    return item.repr_failure(excinfo)


def _add_section(report: pytest.TestReport, message: str) -> None:
    """The verdict beside the test's own failure, which stays first."""
    longrepr = report.longrepr
    if hasattr(longrepr, "addsection"):  # a traceback (pytest's ExceptionRepr)
        longrepr.addsection("torchmem", message)
    else:  # a message, a doctest's failure: text
        report.longrepr = f"{longrepr}\n\n{message}" if longrepr else message
