"""CI's speed gate (benchmarks/gate.py, issue 56): what it compares and when it fails. The
timing itself runs in CI's own section, never as a timed test."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("gate", Path(__file__).resolve().parents[1] / "benchmarks" / "gate.py")
assert _SPEC is not None and _SPEC.loader is not None
gate = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gate)  # (by its path: benchmarks/ never on sys.path, where its names shadow tests')
RECORDED, SLACK, verdict = gate.RECORDED, gate.SLACK, gate.verdict

RATIOS = {"7B": 3.0, "70B": 20.0}


def test_a_ratio_within_the_slack_passes_and_one_beyond_it_fails_naming_it() -> None:
    recorded = {"x86_64 avx2 2 cores": {"7B": 3.0, "70B": 20.0}}
    assert verdict({"7B": 3.0 * SLACK, "70B": 19.0}, recorded, "x86_64 avx2 2 cores") == ("x86_64 avx2 2 cores", {})
    against, slower = verdict({"7B": 3.0 * SLACK * 1.01, "70B": 20.0}, recorded, "x86_64 avx2 2 cores")
    assert list(slower) == ["7B"] and slower["7B"].startswith("+26%")


def test_another_class_is_compared_with_the_first_recorded_and_an_unrecorded_estimate_fails() -> None:
    recorded = {"x86_64 avx2 2 cores": {"7B": 3.0}, "x86_64 avx512 2 cores": {"7B": 1.0, "70B": 1.0}}
    against, slower = verdict(RATIOS, recorded, "aarch64 none 8 cores")
    assert against == "x86_64 avx2 2 cores"
    assert slower == {"70B": "not recorded"}
    assert verdict(RATIOS, {}, "x86_64 avx2 2 cores") == (None, {})


def test_the_recorded_figures_cover_every_estimate_the_gate_times() -> None:
    recorded = json.loads(RECORDED.read_text())
    for ratios in recorded.values():
        assert set(ratios) == {"7B", "7B no cache", "70B", "70B no cache"}
        assert all(ratio > 0 for ratio in ratios.values())
