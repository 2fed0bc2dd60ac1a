"""The device audit against the running release: torch's GPU branches as its table has them, and the fake cuda device's route for each.

``tests/device_audit.py`` says what the audit compares; ``benchmarks/device_audit.py``
writes each release's table (``tests/data/device_audit/<release>.json``). On a CUDA
build (no GPU needed) these tests run the reference again and fail

* when the release shows a branch its table does not have, or no longer shows one
  it has (by default over the samples and models the table lists: a changed branch;
  the exhaustive test runs every OpInfo sample and public model: a new one);
* when the fake cuda device's route for a row disagrees with the branch torch takes
  there, unless the disagreement is a known one (``KNOWN_DISAGREEMENTS``, each with
  why), and when a known one agrees now.

On a CPU-only build (the README's wheel) they skip: the reference needs fake cuda
tensors under autograd, which abort the process there.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Final

import pytest
import torch

import device_audit as audit

ROOT = Path(__file__).resolve().parents[1]
RELEASE = torch.__version__.split("+")[0]
TABLE = audit.load_table(RELEASE)
WRITE = f"$venv/bin/python benchmarks/device_audit.py --write  # venv=$(bash .ci/torch-venv {RELEASE})"

needs_cuda_build = pytest.mark.skipif(
    not audit.is_cuda_build(),
    reason="the device audit reads torch's GPU branches from fake cuda tensors, which need a CUDA build: "
    "on this CPU-only build autograd on one aborts the process (CI's release suites run it on PyPI's CUDA builds)",
)


def _rows() -> list[dict[str, Any]]:
    return TABLE["rows"] if TABLE is not None else []


#: The transformers families (tests/model_matrix.py) take a second or two each: their rows
#: are exhaustive (CI's release suite on the last release names the tests that run them).
MATRIX: Final = "model_matrix:"


def _names(matrix: bool = True) -> list[str]:
    return sorted({row["name"] for row in _rows() if matrix or not row["name"].startswith(MATRIX)})


def _params() -> list[Any]:
    return [
        pytest.param(name, marks=pytest.mark.exhaustive) if name.startswith(MATRIX) else name
        for name in _names()
    ] or ["(no table)"]


def _subjects(names: set[str]) -> list[audit.Subject]:
    ops = {n for n in names if ":" not in n}
    models = names - ops
    found = list(audit.op_subjects(ops)) if ops else []
    if models:
        found += list(audit.model_subjects(models))
    return found


def _require_table() -> dict[str, Any]:
    if TABLE is None:
        pytest.fail(f"no device-audit table for torch {RELEASE}: write it with {WRITE}")
    return TABLE


def _compare(found: dict[str, Any], names: set[str] | None) -> list[str]:
    """How ``found``'s branches differ from the table's (over ``names`` only, if given)."""
    table = {audit.row_key(r): audit.branch_signature(r) for r in _rows() if names is None or r["name"] in names}
    now = {audit.row_key(r): audit.branch_signature(r) for r in found["rows"]}
    problems = []
    for key in sorted(now.keys() - table.keys()):
        problems.append(f"new branch {key[0]} [{key[1]}]: {json.dumps(now[key])}")
    for key in sorted(table.keys() - now.keys()):
        problems.append(f"branch gone {key[0]} [{key[1]}]")
    for key in sorted(now.keys() & table.keys()):
        if now[key] != table[key]:
            problems.append(f"branch changed {key[0]} [{key[1]}]: {json.dumps(table[key])} -> {json.dumps(now[key])}")
    return problems


def test_every_route_of_the_router_names_its_test() -> None:
    """Each handler of the cuda router (ROUTES) has an entry in ``ROUTE_TESTS``, and the
    test it names exists (any torch: it reads the router and the test files)."""
    # (from the router, which imports every module that registers a route)
    from pytest_torchmem.engine.tracing.devices.cuda.router import ROUTES

    handlers = {f"{h.__module__.rsplit('.', 1)[-1]}.{h.__qualname__}" for h in ROUTES.values()}
    assert sorted(handlers - audit.ROUTE_TESTS.keys()) == []
    assert sorted(audit.ROUTE_TESTS.keys() - handlers) == []
    for test in audit.ROUTE_TESTS.values():
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()
        functions = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
        assert not name or name in functions, test


def test_the_committed_tables_read_and_the_docs_page_is_theirs() -> None:
    """Every committed table is of this schema and of a supported release, and the docs
    page is the one ``benchmarks/device_audit.py --docs`` makes from them (any torch)."""
    import importlib.util

    # benchmarks/device_audit.py (its module name is this helper's)
    spec = importlib.util.spec_from_file_location("device_audit_script", ROOT / "benchmarks" / "device_audit.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from pytest_torchmem.engine.torch_compat.torch_release import release_problem

    tables = sorted(audit.DATA.glob("*.json"))
    assert tables
    for path in tables:
        table = json.loads(path.read_text())
        assert table["schema"] == audit.SCHEMA and table["release"] == path.stem, path
        assert release_problem(path.stem) is None, path
    page = (ROOT / "docs" / "reference" / "device-audit.md").read_text()
    assert page == script.docs_page(), "docs/reference/device-audit.md is stale: python benchmarks/device_audit.py --docs"


@needs_cuda_build
def test_the_release_shows_the_branches_its_table_has() -> None:
    """The table's samples and models (but transformers' families, which the exhaustive test
    runs), run again on fake cpu and fake cuda, branch as the table says (the ops only
    one device ran, per phase, and the errors)."""
    _require_table()
    names = set(_names(matrix=False))
    found = audit.audit(iter(_subjects(names)), judge=False)
    assert _compare(found, names) == [], f"the table is stale: {WRITE}"


@needs_cuda_build
@pytest.mark.exhaustive
def test_every_opinfo_sample_and_public_model_branches_as_the_table_says() -> None:
    """Every OpInfo sample (float32, three an op) and public model: a branch the table
    does not have fails (CI's release suite on the last release names this test)."""
    _require_table()
    found = audit.audit(iter([*audit.op_subjects(), *audit.model_subjects()]), judge=False)
    assert _compare(found, None) == [], f"the table is stale: {WRITE}"


@needs_cuda_build
@pytest.mark.parametrize("name", _params())
def test_the_fake_cuda_device_takes_the_branch_torch_takes(name: str) -> None:
    """Each sample of ``name`` the table lists: the fake cuda device's ops against the
    branch torch takes there now; a disagreement fails unless it is a known one."""
    _require_table()
    subjects = {s.sample: s for s in _subjects({name})}
    verdicts = []
    for row in [r for r in _rows() if r["name"] == name]:
        subject = subjects[row["sample"]]
        branch = audit.branch_of(audit.reference(subject, "cpu"), audit.reference(subject, "cuda"))
        assert branch is not None, f"{name} [{row['sample']}] no longer branches: {WRITE}"
        verdicts.append((row["sample"], audit.verdict(branch, audit.emulate(subject))))
    disagreeing = [(sample, v) for sample, v in verdicts if v["verdict"] == "disagrees"]
    known = audit.KNOWN_DISAGREEMENTS.get(name)
    if known is None:
        assert disagreeing == [], json.dumps(disagreeing, indent=1)
    else:
        assert disagreeing, f"{name} agrees now: take it out of KNOWN_DISAGREEMENTS ({known[:60]}...)"
