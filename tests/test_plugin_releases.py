"""Snapshots of several torch releases, end to end: real pytest runs, real files, real exit codes.

A run sees another torch release through the plugin's one seam: a ``conftest.py``
replaces ``pytest_torchmem.plugin.releases.torch_version`` for the run (in
pytest-xdist's workers too) and puts it back at its end, so that one installed
torch plays 2.13 and 2.15 (the figures are this torch's; what differs is the
release each entry records and the directory it goes to).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.cli.main import main
from pytest_torchmem.plugin.snapshots import FILE_SCHEMA

pytest_plugins = ("pytester",)

SEAM = """
from pytest_torchmem.plugin import releases

_installed = releases.torch_version


def pytest_configure(config):
    releases.torch_version = lambda: {version!r}


def pytest_unconfigure(config):
    releases.torch_version = _installed
"""

TWO = """
import torch
from torch import nn


def test_a(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
{second}
"""
SECOND = """

def test_b(torchmem):
    torchmem.check(nn.Linear(8, 2), torch.randn(2, 8), train=False)
"""


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    # pytester's in-process runs forget the modules imported inside them: import them once.
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))


@pytest.fixture(autouse=True)
def _quiet_plugins(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")


def suite(pytester: pytest.Pytester, *, second: bool = True, per_torch: bool = True) -> None:
    """``test_m.py`` with ``test_a`` (and ``test_b``), checked on cpu only."""
    pytester.makepyfile(test_m=TWO.format(second=SECOND if second else ""))
    pytester.makeini(
        "[pytest]\ntorchmem_devices = cpu\n"
        + ("torchmem_per_torch = true\n" if per_torch else "")
    )


def as_release(pytester: pytest.Pytester, version: str) -> None:
    """Make the next runs see torch ``version`` (``torch.__version__``'s form)."""
    pytester.makeconftest(SEAM.format(version=version))


def snapshot_file(pytester: pytest.Pytester, release: str | None, module: str = "test_m") -> Path:
    folder = pytester.path / "__torchmem__"
    return (folder if release is None else folder / f"torch-{release}") / f"{module}.json"


def entries_of(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["tests"]


def cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(args), out=out)
    return code, out.getvalue()


# -- one directory per release -----------------------------------------------------------


def test_an_update_on_each_release_writes_its_own_directory_and_keeps_the_others(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard: --torchmem-update on one release never overwrites another's entries."""
    suite(pytester)
    as_release(pytester, "2.13.0+cpu")
    result = pytester.runpytest("--torchmem-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "torchmem: update, devices cpu, *, snapshots of torch 2.13 (__torchmem__/torch-2.13)",
            "wrote __torchmem__/torch-2.13/test_m.json",
        ]
    )
    first = snapshot_file(pytester, "2.13").read_text()

    as_release(pytester, "2.15.0+cpu")
    result = pytester.runpytest("--torchmem-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["wrote __torchmem__/torch-2.15/test_m.json"])
    assert snapshot_file(pytester, "2.13").read_text() == first
    assert not snapshot_file(pytester, None).exists()
    for release, version in (("2.13", "2.13.0+cpu"), ("2.15", "2.15.0+cpu")):
        path = snapshot_file(pytester, release)
        assert json.loads(path.read_text())["schema"] == FILE_SCHEMA
        tests = entries_of(path)
        assert sorted(tests) == ["test_a", "test_b"]
        # Each entry records the torch it was made on.
        assert {tests[t]["default"]["cpu"]["environment"]["torch"] for t in tests} == {version}

    # Each release compares with its own entries, and finds nothing unused.
    for version in ("2.13.0+cpu", "2.15.0+cpu"):
        as_release(pytester, version)
        result = pytester.runpytest()
        assert result.ret == 0, result.stdout.str()
        result.stdout.fnmatch_lines(
            ["torchmem: 2 checks: 2 passed, 0 regressed, 0 improved, 0 missing, 0 unused"]
        )


def test_a_release_without_its_entry_fails_and_says_how_to_create_it(
    pytester: pytest.Pytester,
) -> None:
    """Given on the command line, --torchmem-per-torch is in the command that creates the entry
    (an update without it would write the file of every release)."""
    suite(pytester, second=False, per_torch=False)
    as_release(pytester, "2.13.0+cpu")
    assert pytester.runpytest("--torchmem-update", "--torchmem-per-torch").ret == 0
    written = snapshot_file(pytester, "2.13").read_text()

    as_release(pytester, "2.15.0+cpu")
    result = pytester.runpytest("--torchmem-per-torch")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "torchmem: missing on cpu: test_m.py::test_a [[]default[]]",
            "cpu: no snapshot entry for torch 2.15 in __torchmem__/torch-2.15/test_m.json (one "
            "snapshot directory per torch release: torchmem_per_torch; estimate: peak *)",
            'snapshot: __torchmem__/torch-2.15/test_m.json, key "test_a" > "default" > "cpu" '
            "(no such entry)",
            "create the entry for torch 2.15 with: "
            'pytest --torchmem-update --torchmem-per-torch "test_m.py::test_a"',
            "torchmem: 1 check: 0 passed, 0 regressed, 0 improved, 1 missing, 0 unused",
        ]
    )
    assert not snapshot_file(pytester, "2.15").parent.exists()
    assert snapshot_file(pytester, "2.13").read_text() == written
    # The command it printed creates the entry.
    created = pytester.runpytest("--torchmem-update", "--torchmem-per-torch", "test_m.py::test_a")
    assert created.ret == 0
    assert sorted(entries_of(snapshot_file(pytester, "2.15"))) == ["test_a"]
    assert pytester.runpytest("--torchmem-per-torch").ret == 0


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_another_releases_entries_are_never_unused_here(
    pytester: pytest.Pytester, xdist: tuple[str, ...]
) -> None:
    """Regression guard: an update on 2.15 neither reports nor prunes the entries of
    torch-2.13/ (test_b, gone since, and a deleted module's file): they are 2.13's to judge."""
    suite(pytester)
    pytester.makepyfile(test_gone=TWO.format(second=""))
    as_release(pytester, "2.13.0+cpu")
    assert pytester.runpytest(*xdist, "--torchmem-update").ret == 0
    (pytester.path / "test_gone.py").unlink()
    suite(pytester, second=False)  # test_b is gone
    thirteen = snapshot_file(pytester, "2.13").parent
    before = {path.name: path.read_text() for path in thirteen.iterdir()}
    assert sorted(before) == ["test_gone.json", "test_m.json"]

    as_release(pytester, "2.15.0+cpu")
    for args in (("--torchmem-update",), ("--torchmem-json", "report.json")):
        result = pytester.runpytest(*xdist, *args)
        assert result.ret == 0, result.stdout.str()
        result.stdout.fnmatch_lines(["torchmem: 1 check: *, 0 unused*"])
        result.stdout.no_fnmatch_line("unused: *")
        after = {path.name: path.read_text() for path in thirteen.iterdir()}
        assert after == before
    assert sorted(entries_of(snapshot_file(pytester, "2.15"))) == ["test_a"]
    # What a worker checked reaches the report with the release of its directory.
    report = json.loads((pytester.path / "report.json").read_text())
    assert [(r["torch_release"], r["status"]) for r in report["results"]] == [("2.15", "passed")]
    assert report["unused"] == []

    # On 2.13 they are unused, and its update prunes them (and leaves 2.15's file alone).
    fifteen = snapshot_file(pytester, "2.15").read_text()
    as_release(pytester, "2.13.0+cpu")
    result = pytester.runpytest(*xdist)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines_random(
        [
            'unused: __torchmem__/torch-2.13/test_gone.json: "test_a" > "default" > "cpu"',
            'unused: __torchmem__/torch-2.13/test_m.json: "test_b" > "default" > "cpu"',
        ]
    )
    assert pytester.runpytest(*xdist, "--torchmem-update").ret == 0
    assert not snapshot_file(pytester, "2.13", "test_gone").exists()
    assert sorted(entries_of(snapshot_file(pytester, "2.13"))) == ["test_a"]
    assert snapshot_file(pytester, "2.15").read_text() == fifteen


# -- one file for every release (the default) ---------------------------------------------


def test_an_entry_of_another_release_says_so_and_names_the_option(
    pytester: pytest.Pytester,
) -> None:
    suite(pytester, second=False, per_torch=False)
    as_release(pytester, "2.13.0+cpu")
    assert pytester.runpytest("--torchmem-update").ret == 0
    entry = entries_of(snapshot_file(pytester, None))["test_a"]["default"]["cpu"]
    assert entry["environment"] == {"torch": "2.13.0+cpu", "cpu": "avx2:4"}

    hint = (
        "a suite run on several torch releases can keep one snapshot directory per release: "
        "torchmem_per_torch = true (--torchmem-per-torch)"
    )
    as_release(pytester, "2.15.0+cpu")
    result = pytester.runpytest()  # stale entries warn: not compared
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "stale: test_m.py::test_a on cpu: snapshot environment differs "
            "(torch 2.13.0+cpu -> 2.15.0+cpu); re-record on this machine with: *",
            "1 stale check was not compared: *",
            f"1 stale snapshot entry was made on torch 2.13, and this is torch 2.15; {hint}",
        ]
    )
    result = pytester.runpytest("--torchmem-stale=fail")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "torchmem: stale on cpu: test_m.py::test_a [[]default[]]",
            "cpu: the snapshot entry was recorded in another environment (torch 2.13.0+cpu -> "
            "2.15.0+cpu): *",
            f"the snapshot entry was made on torch 2.13, and this is torch 2.15; {hint}",
            "re-record the entry on this machine with: *",
        ]
    )
    # Another patch release or build of the same minor release compares: the figures
    # are the minor release's (a CPU wheel and a CUDA wheel estimate alike).
    for version in ("2.13.1+cpu", "2.13.0+cu130"):
        as_release(pytester, version)
        result = pytester.runpytest("--torchmem-stale=fail")
        assert result.ret == 0, result.stdout.str()
        result.stdout.fnmatch_lines(["torchmem: 1 check: 1 passed, *"])
        result.stdout.no_fnmatch_line("*stale*")


def test_a_file_made_before_per_release_directories_stays_as_it_is(
    pytester: pytest.Pytester,
) -> None:
    """A suite that turns torchmem_per_torch on: its existing file of every release is
    neither read nor judged unused nor pruned; each mode keeps to its own files."""
    suite(pytester, per_torch=False)
    as_release(pytester, "2.13.0+cpu")
    assert pytester.runpytest("--torchmem-update").ret == 0
    flat = snapshot_file(pytester, None).read_text()
    assert json.loads(flat)["schema"] == FILE_SCHEMA

    suite(pytester, per_torch=True)
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["torchmem: 2 checks: 0 passed, 0 regressed, 0 improved, 2 missing, 0 unused"]
    )
    assert pytester.runpytest("--torchmem-update").ret == 0
    assert snapshot_file(pytester, None).read_text() == flat
    assert sorted(entries_of(snapshot_file(pytester, "2.13"))) == ["test_a", "test_b"]

    # Off again: the file of every release still compares; torch-2.13/ is not judged.
    suite(pytester, second=False, per_torch=False)
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # test_b's entry in the flat file
    result.stdout.fnmatch_lines(
        [
            'unused: __torchmem__/test_m.json: "test_b" > "default" > "cpu"',
            "torchmem: 1 check: 1 passed, 0 regressed, 0 improved, 0 missing, 1 unused",
        ]
    )
    assert sorted(entries_of(snapshot_file(pytester, "2.13"))) == ["test_a", "test_b"]


# -- what reads the files ---------------------------------------------------------------


def test_the_json_report_and_the_command_line_read_the_release_directories(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite(pytester, second=False)
    for version in ("2.13.0+cpu", "2.15.0+cpu"):
        as_release(pytester, version)
        assert pytester.runpytest("--torchmem-update").ret == 0
    assert pytester.runpytest("--torchmem-json", "report.json").ret == 0
    report = json.loads((pytester.path / "report.json").read_text())
    assert report["settings"]["per_torch"] is True
    assert report["environment"]["torch"] == "2.15.0+cpu"
    (result,) = report["results"]
    assert result["torch_release"] == "2.15"
    assert result["snapshot_file"] == "__torchmem__/torch-2.15/test_m.json"
    assert result["status"] == "passed"

    monkeypatch.chdir(pytester.path)
    code, out = cli("show", ".")
    assert code == 0
    assert ". (2 files, 2 entries)" in out
    assert "test_m.py::test_a (torch 2.13)" in out
    assert "test_m.py::test_a (torch 2.15)" in out
    code, out = cli("show", "__torchmem__/torch-2.13/test_m.json", "--format", "json")
    (entry,) = json.loads(out)["inputs"][0]["entries"]
    assert (entry["module"], entry["release"]) == ("test_m.py", "2.13")

    # A directory of several releases against itself: each entry pairs with its own release's.
    code, out = cli("diff", ".", ".", "--fail-on-stale")
    assert code == 0, out
    assert "torchmem diff: 2 entries: 2 passed, 0 regressed, 0 improved, 0 stale" in out
    # One release against another: they pair, recorded on other torches (stale).
    code, out = cli("diff", "__torchmem__/torch-2.13", "__torchmem__/torch-2.15")
    assert code == 0
    assert "test_m.py::test_a (torch 2.15) [default] on cpu: torch 2.13.0+cpu -> 2.15.0+cpu" in out
    assert "1 stale" in out
    # The run's report pairs with the entries of its release (2.13's are only in NEW).
    code, out = cli("diff", "report.json", ".", "--format", "json")
    rows = {(e["release"], e["status"]) for e in json.loads(out)["entries"]}
    assert rows == {("2.15", "passed"), ("2.13", "added")}
