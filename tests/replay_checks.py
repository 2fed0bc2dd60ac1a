"""What the replay tests check of each run (tests/test_replay.py, tests/test_block_replay.py):
a check run replayed and traced, the user's objects left as they were by both, and every
figure the same."""

from __future__ import annotations

from typing import Any

import pytest

from fingerprint import fingerprint

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.replay import ENV

__all__ = ["both", "same_figures"]


def both(monkeypatch: pytest.MonkeyPatch, make: Any, check: Any = tm.estimate, **options: Any) -> tuple[Any, Any]:
    """``check`` (the estimate, or ``tm.leaks``) with replay (the default) and with every
    iteration and block traced, each of a fresh ``make()``; the user's objects left as they
    were by both (their fingerprints, and every module's attributes: the blocks' forwards
    a replay sets for the step)."""
    reports = []
    for replay in ("1", "0"):
        monkeypatch.setenv(ENV, replay)
        model, inputs = make()
        before = fingerprint(model, inputs)
        attributes = [dict(m.__dict__) for m in model.modules()]
        reports.append(check(model, inputs, **options))
        assert fingerprint(model, inputs) == before
        assert [dict(m.__dict__) for m in model.modules()] == attributes
    monkeypatch.setenv(ENV, "1")
    return reports[0], reports[1]


def same_figures(replayed: tm.MemoryReport, traced: tm.MemoryReport) -> None:
    a, b = replayed.to_dict(), traced.to_dict()
    a.pop("replayed"), b.pop("replayed")
    a.pop("host_peak"), b.pop("host_peak")  # (cuda's host memory: not known where the trace replayed)
    assert a == b  # every figure, the breakdown, per-module peaks, first step, unsupported
