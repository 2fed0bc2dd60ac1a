"""The GPU census (``benchmarks/gpu_census.py``, issue 57 item 2), replayed without a GPU.

Each record under ``tests/data/gpu_census`` is one GPU's census at one torch release:
OpInfo's samples and the zoo's models measured on that GPU, with the estimate made
there. Here every recorded case's estimate is made again on the fake cuda device
following the recorded GPU's profile: it must equal the measurement where the record
says exact, and the recorded estimate otherwise (an estimate that became the
measurement passes too; re-record then). The script's ``--fake`` mode (everything but
the GPU) is run here too, so that the script cannot rot between GPU sessions.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
# by its path: benchmarks/ is never on sys.path, where its names would shadow tests'
_SPEC = importlib.util.spec_from_file_location("gpu_census", ROOT / "benchmarks" / "gpu_census.py")
assert _SPEC is not None and _SPEC.loader is not None
census = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(census)

#: The cases of each record the default run replays (the first of each kind that the
#: record holds, exact ones first); the exhaustive run replays them all.
QUICK = 6


def recorded() -> list[Path]:
    """This torch release's records."""
    return sorted(census.DATA.glob(f"*-torch-{census.release()}.json"))


def _require_records() -> list[Path]:
    paths = recorded()
    if not paths:
        others = sorted(p.name for p in census.DATA.glob("*.json")) if census.DATA.is_dir() else []
        pytest.skip(
            f"no GPU census recorded for torch {census.release()} under tests/data/gpu_census "
            f"({', '.join(others) or 'no record at all'}); a GPU session records one with "
            "python benchmarks/gpu_census.py"
        )
    return paths


def _load(path: Path) -> dict[str, Any]:
    record = json.loads(path.read_text(encoding="utf-8"))
    assert record["schema"] == census.SCHEMA, path
    assert record["release"] == census.release(), path
    return record


def _quick(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    picked: list[dict[str, Any]] = []
    for kind in ("op", "model"):
        of_kind = [e for e in entries if e["kind"] == kind]
        picked += sorted(of_kind, key=lambda e: not e.get("exact"))[: QUICK // 2]
    return picked


def replay_record(record: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """The disagreements of ``entries`` (of ``record``) made again here."""
    cases = census.cases_by_id({**record, "cases": entries})
    gpu = record["gpu"]["line"]
    return [why for entry in entries if (why := census.replay(entry, cases.get(entry["id"]), gpu))]


def test_the_first_recorded_cases_replay_to_the_record() -> None:
    for path in _require_records():
        record = _load(path)
        failures = replay_record(record, _quick(record["cases"]))
        assert not failures, f"{path.name}:\n" + "\n".join(failures)


def test_every_recorded_case_replays_to_the_record() -> None:
    """Every case of every record of this release (CI's exhaustive run)."""
    for path in _require_records():
        record = _load(path)
        failures = replay_record(record, record["cases"])
        assert not failures, f"{path.name}: {len(failures)} of {len(record['cases'])}:\n" + "\n".join(failures)


# -- the script without a GPU ----------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_record(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("census")
    code = census.main(
        ["--fake", "--out", str(out), "--gpu", "A100", "--ops", "abs,topk,unique,nonzero", "--models", "mlp",
         "--dtypes", "float32,bfloat16"]
    )
    assert code == 0
    (path,) = out.glob("*.json")
    assert path.name == f"a100-torch-{census.release()}.json"
    return _load(path)


def test_the_fake_census_records_the_estimates_beside_a_placeholder(fake_record: dict[str, Any]) -> None:
    assert fake_record["fake"] is True and fake_record["stopped"] is None
    assert fake_record["gpu"]["line"].startswith("A100: ") and "sms=108" in fake_record["gpu"]["line"]
    ids = [entry["id"] for entry in fake_record["cases"]]
    assert ids == [
        "op:abs:float32:0", "op:abs:bfloat16:0", "op:topk:float32:0", "op:topk:bfloat16:0",
        "op:unique:float32:0", "op:unique:bfloat16:0", "op:nonzero:float32:0", "op:nonzero:bfloat16:0",
        "model:mlp:float32", "model:mlp:bfloat16",
    ]
    for entry in fake_record["cases"]:
        assert entry["measured"] is None and entry["exact"] is False
        assert set(entry["estimate"]) == {"forward", "backward", "step"}
        assert entry["inputs"] and all(" at /" not in line for line in entry["unsupported"])
    by_id = {entry["id"]: entry for entry in fake_record["cases"]}
    assert by_id["op:topk:float32:0"]["train"] and not by_id["op:unique:float32:0"]["train"]
    assert by_id["op:unique:float32:0"]["unsupported"] == []  # unique's outputs and cub's storage, modelled
    assert by_id["op:nonzero:float32:0"]["unsupported"]  # cub's storage of nonzero: not modelled yet
    assert by_id["model:mlp:float32"]["estimate"]["backward"] > by_id["model:mlp:bfloat16"]["estimate"]["backward"]


def test_the_fake_census_replays_and_a_drift_is_caught(fake_record: dict[str, Any]) -> None:
    """Its cases replay to their recorded estimates; an exact case whose measurement
    differs from the estimate, and a drifted estimate, each fail with the case named."""
    assert replay_record(fake_record, fake_record["cases"]) == []
    entry = dict(fake_record["cases"][2])  # op:topk:float32:0, no unsupported op
    exact = {**entry, "exact": True, "measured": {**entry["estimate"], "forward": entry["estimate"]["forward"] + 512}}
    drifted = {**entry, "estimate": {**entry["estimate"], "backward": entry["estimate"]["backward"] - 512}}
    improved = {**drifted, "measured": entry["estimate"]}  # the estimate became the measurement
    failures = replay_record(fake_record, [exact, drifted, improved])
    assert len(failures) == 2 and all(f.startswith("op:topk:float32:0: estimate ") for f in failures)
    assert "measured" in failures[0] and "recorded" in failures[1]


def test_the_script_refuses_to_write_placeholders_into_the_data() -> None:
    with pytest.raises(SystemExit):
        census.main(["--fake", "--ops", "", "--models", ""])
