"""Doctests that check memory are tests like any other: their entries are kept, compared
and reported, and a run that did not collect them never deletes them.

A doctest text file (``test_doc.txt``, collected by pytest's ``--doctest-glob``) has
a snapshot file of its own, named after the whole file name
(``__torchmem__/test_doc.txt.json``: beside ``test_doc.py``'s ``test_doc.json``); the
doctests of a Python module (``--doctest-modules``) keep their entries in the module's
file, judged only by runs that collect them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))  # see test_plugin_e2e


@pytest.fixture(autouse=True)
def _quiet_plugins(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # (after pytester, which clears PYTEST_ADDOPTS) see test_plugin_e2e
    monkeypatch.setenv(
        "PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider -p no:randomly"
    )
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")


DOC_TEXT = """\
>>> import torch
>>> from torch import nn
>>> _ = getfixture("torchmem").check(nn.Linear(8, {out}), torch.randn(2, 8))
"""

MODULE = '''
import torch
from torch import nn


def test_a(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))


def documented():
    """
    >>> import torch
    >>> from torch import nn
    >>> _ = getfixture("torchmem").check(nn.Linear(8, {out}), torch.randn(2, 8))
    """
'''

SIBLING = """
import torch
from torch import nn


def test_b(torchmem):
    torchmem.check(nn.Linear(8, 2), torch.randn(2, 8))
"""


def stored(path: Path) -> dict[str, list[str]]:
    tests: dict[str, Any] = json.loads(path.read_text())["tests"]
    return {test: sorted(checks) for test, checks in tests.items()}


def test_a_doctest_text_file_keeps_compares_and_reports_its_entries(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard (issue 27, 3): right after --torchmem-update a plain run reported the
    entry of test_doc.txt unused, and updating a sibling module deleted test_doc.json."""
    pytester.maketxtfile(test_doc=DOC_TEXT.format(out=4))
    pytester.makepyfile(test_sib=SIBLING)
    update = pytester.runpytest("--torchmem-update")
    update.assert_outcomes(passed=2)
    update.stdout.fnmatch_lines(
        ["wrote __torchmem__/test_doc.txt.json", "wrote __torchmem__/test_sib.json"]
    )
    snapshot = pytester.path / "__torchmem__" / "test_doc.txt.json"
    assert stored(snapshot) == {"test_doc.txt": ["default"]}

    compare = pytester.runpytest()
    assert compare.ret == 0, compare.stdout.str()
    compare.stdout.fnmatch_lines(["torchmem: 2 checks: 2 passed, 0 regressed, *, 0 unused"])

    before = snapshot.read_bytes()
    sibling = pytester.runpytest("--torchmem-update", "test_sib.py")
    assert sibling.ret == 0, sibling.stdout.str()
    assert snapshot.read_bytes() == before

    # Compared: a regression in the doctest fails it.
    pytester.maketxtfile(test_doc=DOC_TEXT.format(out=6))
    regressed = pytester.runpytest("-rf")
    regressed.assert_outcomes(passed=1, failed=1)
    regressed.stdout.fnmatch_lines(
        [
            "torchmem: regressed on cpu: test_doc.txt::test_doc.txt [default]",
            'accept the change with: pytest --torchmem-update "test_doc.txt::test_doc.txt"',
        ]
    )
    accept = pytester.runpytest("--torchmem-update", "test_doc.txt::test_doc.txt")
    accept.assert_outcomes(passed=1)
    assert pytester.runpytest().ret == 0


def test_a_doctest_text_file_beside_a_module_of_its_name_has_a_file_of_its_own(
    pytester: pytest.Pytester,
) -> None:
    """test_doc.txt and test_doc.py: neither's update drops the other's entries."""
    pytester.maketxtfile(test_doc=DOC_TEXT.format(out=4))
    pytester.makepyfile(test_doc=SIBLING)
    assert pytester.runpytest("--torchmem-update").ret == 0
    folder = pytester.path / "__torchmem__"
    assert stored(folder / "test_doc.json") == {"test_b": ["default"]}
    assert stored(folder / "test_doc.txt.json") == {"test_doc.txt": ["default"]}
    for only in ("test_doc.py", "test_doc.txt"):
        assert pytester.runpytest("--torchmem-update", only).ret == 0
        assert stored(folder / "test_doc.json") == {"test_b": ["default"]}
        assert stored(folder / "test_doc.txt.json") == {"test_doc.txt": ["default"]}
    assert pytester.runpytest().ret == 0


def test_doctests_of_a_module_are_judged_only_by_runs_that_collect_them(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard (issue 27, 3): entries recorded with --doctest-modules were deleted by
    an update run without the option."""
    pytester.makepyfile(test_m=MODULE.format(out=4))
    update = pytester.runpytest("--torchmem-update", "--doctest-modules")
    update.assert_outcomes(passed=2)
    snapshot = pytester.path / "__torchmem__" / "test_m.json"
    assert stored(snapshot) == {"test_a": ["default"], "test_m.documented": ["default"]}

    plain = pytester.runpytest("--torchmem-update")
    plain.assert_outcomes(passed=1)
    assert "unused" not in plain.stdout.str().split("-- torchmem --")[-1].split("0 unused")[0]
    assert stored(snapshot) == {"test_a": ["default"], "test_m.documented": ["default"]}

    compare = pytester.runpytest("--doctest-modules")
    assert compare.ret == 0, compare.stdout.str()
    compare.stdout.fnmatch_lines(["torchmem: 2 checks: 2 passed, *, 0 unused"])

    # A regression in the docstring fails it; the command that accepts it collects it.
    pytester.makepyfile(test_m=MODULE.format(out=6))
    regressed = pytester.runpytest("--doctest-modules")
    regressed.assert_outcomes(passed=1, failed=1)
    regressed.stdout.fnmatch_lines(
        [
            "torchmem: regressed on cpu: test_m.py::test_m.documented [default]",
            "accept the change with: pytest --torchmem-update --doctest-modules "
            '"test_m.py::test_m.documented"',
        ]
    )
    accept = pytester.runpytest("--torchmem-update", "--doctest-modules", "test_m.py::test_m.documented")
    accept.assert_outcomes(passed=1)
    assert pytester.runpytest("--doctest-modules").ret == 0

    # A docstring example deleted: its entry is unused, judged by a run that collected the
    # module's doctests, and dropped by its update.
    pytester.makepyfile(test_m=MODULE.split("\n\ndef documented")[0] + "\n")
    assert pytester.runpytest().ret == 0
    gone = pytester.runpytest("--doctest-modules")
    assert gone.ret == pytest.ExitCode.TESTS_FAILED
    gone.stdout.fnmatch_lines(['unused: __torchmem__/test_m.json: "test_m.documented" > *'])
    assert pytester.runpytest("--torchmem-update", "--doctest-modules").ret == 0
    assert stored(snapshot) == {"test_a": ["default"]}
