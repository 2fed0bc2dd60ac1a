"""Memory that grows every iteration: a step run again and again, and what it keeps.

:mod:`.check` runs the leak check (:func:`~.check.leaks`); :mod:`.holders` explains
what holds the growth; :mod:`.report` is what it returns.
"""

from pytest_torchmem.engine.leaks.report import LeakReport, LeakSource

__all__ = ["LeakReport", "LeakSource"]
