"""pytest's own features never lose a snapshot entry (issue 15), through real pytest runs.

``--lf``, option-gated parametrizations, crashed pytest-xdist workers, reruns,
symlinked and partly malformed snapshot files, failed writes: in each, the
plugin drops only entries whose test it saw run without them, and says what it
could not do.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)

HEADER = "import os\nimport pytest\nimport torch\nfrom torch import nn\n"
CHECK = "    torchmem.check(nn.Linear(8, {out}), torch.randn(2, 8){name})\n"


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))  # see test_plugin_e2e


@pytest.fixture(autouse=True)
def _cpu_only(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # (after pytester, which clears PYTEST_ADDOPTS) see test_plugin_e2e.
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:randomly")
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")


def output(result: pytest.RunResult) -> str:
    return result.stdout.str() + "\n" + result.stderr.str()


def no_internal_error(result: pytest.RunResult) -> None:
    assert "INTERNALERROR" not in output(result)
    assert "Traceback (most recent call last)" not in output(result)


def entries(path: Path) -> dict[str, list[str]]:
    """test id -> check names recorded in the snapshot file at ``path``."""
    return {test: sorted(checks) for test, checks in json.loads(path.read_text())["tests"].items()}


def module(pytester: pytest.Pytester, name: str, body: str) -> Path:
    return pytester.makepyfile(**{name: HEADER + body})


def linear_tests(*names: str, failing: str = "") -> str:
    """One check per test; ``failing`` names a test that fails after its check when FAIL is set."""
    body = ""
    for name in names:
        body += f"\ndef {name}(torchmem):\n" + CHECK.format(out=4, name="")
        if name == failing:
            body += "    assert not os.environ.get('FAIL')\n"
    return body


# -- 1. --lf --------------------------------------------------------------------------


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_last_failed_update_keeps_the_entries_of_the_tests_it_did_not_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, xdist: tuple[str, ...]
) -> None:
    module(pytester, "test_lf", linear_tests("test_a", "test_b", "test_c", failing="test_b"))
    pytester.runpytest("--torchmem-update").assert_outcomes(passed=3)
    snapshot = pytester.path / "__torchmem__" / "test_lf.json"
    assert sorted(entries(snapshot)) == ["test_a", "test_b", "test_c"]
    monkeypatch.setenv("FAIL", "1")
    pytester.runpytest().assert_outcomes(passed=2, failed=1)
    monkeypatch.delenv("FAIL")

    compare = pytester.runpytest("--lf", *xdist)
    compare.assert_outcomes(passed=1)
    assert compare.ret == 0, output(compare)
    assert "unused" not in output(compare).split("torchmem:")[-1].split("0 unused")[0]

    monkeypatch.setenv("FAIL", "1")
    pytester.runpytest().assert_outcomes(passed=2, failed=1)  # test_b fails again
    monkeypatch.delenv("FAIL")
    update = pytester.runpytest("--lf", "--torchmem-update", *xdist)
    update.assert_outcomes(passed=1)
    no_internal_error(update)
    assert sorted(entries(snapshot)) == ["test_a", "test_b", "test_c"]
    assert pytester.runpytest().ret == 0


def test_an_entry_of_a_deleted_test_is_still_found_unused(pytester: pytest.Pytester) -> None:
    """The guard of --lf does not hide entries whose test is gone from the module."""
    module(pytester, "test_gone", linear_tests("test_a", "test_b"))
    pytester.runpytest("--torchmem-update").assert_outcomes(passed=2)
    module(pytester, "test_gone", linear_tests("test_a"))
    compare = pytester.runpytest()
    assert compare.ret == 1
    compare.stdout.fnmatch_lines(["*unused*test_b*"])
    pytester.runpytest("--torchmem-update").assert_outcomes(passed=1)
    assert sorted(entries(pytester.path / "__torchmem__" / "test_gone.json")) == ["test_a"]


# -- 5. parametrizations that exist only under an option -------------------------------

GATED = """
def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true")

def pytest_generate_tests(metafunc):
    if "width" in metafunc.fixturenames:
        widths = [4, 64] if metafunc.config.getoption("slow") else [4]
        metafunc.parametrize("width", widths)
"""


def test_option_gated_parametrizations_keep_their_entries(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(GATED)
    module(
        pytester,
        "test_gated",
        "\ndef test_wide(torchmem, width):\n" + CHECK.format(out="width", name=""),
    )
    pytester.runpytest("--slow", "--torchmem-update").assert_outcomes(passed=2)
    snapshot = pytester.path / "__torchmem__" / "test_gated.json"
    assert sorted(entries(snapshot)) == ["test_wide[4]", "test_wide[64]"]

    compare = pytester.runpytest()
    compare.assert_outcomes(passed=1)
    assert compare.ret == 0, output(compare)
    update = pytester.runpytest("--torchmem-update")
    assert update.ret == 0, output(update)
    assert sorted(entries(snapshot)) == ["test_wide[4]", "test_wide[64]"]
    assert pytester.runpytest("--slow").ret == 0


# -- 2. a crashed pytest-xdist worker ---------------------------------------------------


def test_a_crashed_worker_loses_no_check_it_made_and_the_update_says_so(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = ""
    for index in range(6):
        body += f"\ndef test_{index}(torchmem):\n" + CHECK.format(out=4 + index, name="")
    body += (
        "\ndef test_crash(torchmem):\n"
        + CHECK.format(out=2, name="")
        + "    if os.environ.get('CRASH'):\n        os._exit(1)\n"
    )
    module(pytester, "test_crashy", body)
    monkeypatch.setenv("CRASH", "1")
    update = pytester.runpytest("-n", "2", "--torchmem-update", "-p", "no:randomly")
    no_internal_error(update)
    update.assert_outcomes(passed=6, failed=1)
    assert update.ret == 1
    text = output(update)
    assert "test_crash" in text and "lost" in text, text
    snapshot = pytester.path / "__torchmem__" / "test_crashy.json"
    assert sorted(entries(snapshot)) == [f"test_{index}" for index in range(6)]
    totals = [line for line in text.splitlines() if line.startswith("torchmem: ")][-1]
    assert totals.startswith("torchmem: 6 checks"), totals

    monkeypatch.delenv("CRASH")
    compare = pytester.runpytest("-n", "2")
    compare.assert_outcomes(passed=6, failed=1)  # only the test never recorded is missing
    compare.stdout.fnmatch_lines(["*test_crash*missing*"])


# -- 7. pytest-rerunfailures --------------------------------------------------------------


def test_a_rerun_test_checks_again_as_its_first_run_did(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pytest_rerunfailures")
    module(
        pytester,
        "test_flaky",
        "\nRUNS = []\n\ndef test_flaky(torchmem):\n"
        + CHECK.format(out=4, name="")
        + CHECK.format(out=8, name=", name='second'")
        + "    RUNS.append(1)\n    assert len(RUNS) > 1\n",
    )
    update = pytester.runpytest("--reruns", "1", "--torchmem-update")
    no_internal_error(update)
    assert update.parseoutcomes() == {"passed": 1, "rerun": 1}, output(update)
    assert entries(pytester.path / "__torchmem__" / "test_flaky.json") == {
        "test_flaky": ["default", "second"]
    }
    compare = pytester.runpytest("--reruns", "1")
    assert compare.parseoutcomes() == {"passed": 1, "rerun": 1}, output(compare)
    assert compare.ret == 0, output(compare)
    totals = [line for line in output(compare).splitlines() if line.startswith("torchmem: ")]
    assert totals[-1].startswith("torchmem: 2 checks: 2 passed"), totals


# -- 3. a snapshot file that is a symlink -----------------------------------------------


def test_an_update_writes_through_a_symlinked_snapshot_file(pytester: pytest.Pytester) -> None:
    module(pytester, "test_link", linear_tests("test_a"))
    pytester.runpytest("--torchmem-update").assert_outcomes(passed=1)
    snapshot = pytester.path / "__torchmem__" / "test_link.json"
    shared = pytester.path / "shared.json"
    snapshot.rename(shared)
    snapshot.symlink_to(shared)
    before = json.loads(shared.read_text())["tests"]["test_a"]["default"]["cpu"]["breakdown"]
    module(pytester, "test_link", linear_tests("test_a").replace("8, 4", "8, 16"))
    update = pytester.runpytest("--torchmem-update")
    assert update.ret == 0, output(update)
    assert snapshot.is_symlink()
    after = json.loads(shared.read_text())["tests"]["test_a"]["default"]["cpu"]["breakdown"]
    assert after["parameters"] == (8 * 16 + 16) * 4 != before["parameters"]
    assert pytester.runpytest().ret == 0  # compares with the target's new figures


# -- 4. a malformed entry and an update of one test --------------------------------------


def test_updating_one_test_keeps_the_valid_entries_beside_a_malformed_one(
    pytester: pytest.Pytester,
) -> None:
    module(pytester, "test_mixed", linear_tests("test_a", "test_b", "test_c"))
    pytester.runpytest("--torchmem-update").assert_outcomes(passed=3)
    snapshot = pytester.path / "__torchmem__" / "test_mixed.json"
    data = json.loads(snapshot.read_text())
    data["tests"]["test_b"]["default"]["cpu"]["forward_peak"] = "a lot"
    snapshot.write_text(json.dumps(data, indent=2))

    update = pytester.runpytest("--torchmem-update", "test_mixed.py::test_b")
    no_internal_error(update)
    assert update.ret == 0, output(update)
    assert sorted(entries(snapshot)) == ["test_a", "test_b", "test_c"]
    assert pytester.runpytest().ret == 0

    data = json.loads(snapshot.read_text())
    data["tests"]["test_c"]["default"]["cpu"]["forward_peak"] = -1
    snapshot.write_text(json.dumps(data, indent=2))
    other = pytester.runpytest("--torchmem-update", "test_mixed.py::test_a")
    no_internal_error(other)
    assert other.ret == 1  # test_c's entry is broken and was not rewritten: said, kept as it is
    assert "test_c" in output(other)
    assert sorted(entries_text(snapshot)) == ["test_a", "test_b", "test_c"]


def entries_text(path: Path) -> list[str]:
    return list(json.loads(path.read_text())["tests"])


# -- 6. a failed write is not "updated" ----------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores modes")
def test_a_failed_write_is_not_shown_as_updated(pytester: pytest.Pytester) -> None:
    module(pytester, "test_ro", linear_tests("test_a"))
    folder = pytester.path / "__torchmem__"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        update = pytester.runpytest("--torchmem-update")
    finally:
        folder.chmod(0o755)
    assert update.ret == 1
    assert "new" not in update.stdout.str().split("status")[-1].split("could not")[0]
    update.stdout.fnmatch_lines(["*not written*", "*could not write*"])


def test_a_failed_write_is_not_shown_as_updated_as_root(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through fault injection, which works as root too."""
    module(pytester, "test_ro", linear_tests("test_a"))
    pytester.makeconftest(
        "import pytest\n"
        "from pytest_torchmem.plugin import snapshots\n"
        "def _refuse(path, text):\n"
        "    raise PermissionError(13, 'Permission denied', str(path))\n"
        "@pytest.hookimpl(wrapper=True, tryfirst=True)\n"
        "def pytest_sessionfinish(session):\n"
        "    real, snapshots.atomic_write = snapshots.atomic_write, _refuse\n"
        "    try:\n"
        "        return (yield)\n"
        "    finally:\n"
        "        snapshots.atomic_write = real\n"
    )
    update = pytester.runpytest("--torchmem-update")
    no_internal_error(update)
    assert update.ret == 1
    table = [line for line in update.stdout.lines if "test_ro.py::test_a" in line]
    assert table and all(" new" not in line for line in table), table
    assert any("not written" in line for line in table), table
    update.stdout.fnmatch_lines(["*could not write*"])
    totals = [line for line in update.stdout.lines if line.startswith("torchmem: ")][-1]
    assert "not written" in totals, totals


# -- 13. lock files ---------------------------------------------------------------------------


def test_updates_leave_no_lock_file(pytester: pytest.Pytester, tmp_path: Path) -> None:
    module(pytester, "test_lock", linear_tests("test_a"))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(temporary))
        import tempfile

        patch.setattr(tempfile, "tempdir", None)
        for _ in range(2):
            assert pytester.runpytest_subprocess("--torchmem-update").ret == 0
    assert list(temporary.glob("pytest-torchmem-*")) == []
    assert sorted(p.name for p in (pytester.path / "__torchmem__").iterdir()) == ["test_lock.json"]


# -- 8. a marker added at collection ------------------------------------------------------------

ADD_MARKER = """
import pytest

def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.memory_budget(peak=100))
"""


@pytest.mark.parametrize("level", ["function", "class", "module"])
def test_a_marker_added_at_collection_overrides_the_tests_own(
    pytester: pytest.Pytester, level: str
) -> None:
    pytester.makeconftest(ADD_MARKER)
    check = "(torchmem):\n" + CHECK.format(out=4, name="")
    body = {
        "function": "\n@pytest.mark.memory_budget(peak='1 GiB')\ndef test_a" + check,
        "class": "\n@pytest.mark.memory_budget(peak='1 GiB')\nclass TestA:\n    def test_a(self"
        + check.replace("(torchmem)", ", torchmem)").replace("\n    ", "\n        "),
        "module": "\npytestmark = pytest.mark.memory_budget(peak='1 GiB')\ndef test_a" + check,
    }[level]
    module(pytester, "test_added", body)
    result = pytester.runpytest("--torchmem-update")
    no_internal_error(result)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*over budget*"])


# -- 9. a failed check does not stop the test's later checks -------------------------------------


def test_the_checks_after_a_failed_one_still_run_and_are_reported(
    pytester: pytest.Pytester,
) -> None:
    body = (
        "\n@pytest.mark.memory_budget(peak=100)\ndef test_three(torchmem):\n"
        + CHECK.format(out=4, name=", name='first'")
        + CHECK.format(out=4, name=", name='second'")
        + CHECK.format(out=4, name=", name='third'")
    )
    module(pytester, "test_three", body)
    report = pytester.path / "report.json"
    result = pytester.runpytest("--torchmem-update", f"--torchmem-json={report}")
    result.assert_outcomes(failed=1)
    assert output(result).count("over budget") >= 3
    checks = json.loads(report.read_text())["results"]
    assert sorted(check["name"] for check in checks) == ["first", "second", "third"]
    assert entries(pytester.path / "__torchmem__" / "test_three.json") == {
        "test_three": ["first", "second", "third"]
    }


# -- 12. the fixture through request.getfixturevalue -------------------------------------------


def test_a_marker_on_a_test_that_gets_the_fixture_by_name_does_not_warn(
    pytester: pytest.Pytester,
) -> None:
    body = (
        "\n@pytest.fixture\ndef memory(request):\n    return request.getfixturevalue('torchmem')\n"
        "\n@pytest.mark.memory_budget(peak=100)\ndef test_by_name(request):\n"
        "    request.getfixturevalue('torchmem').check(nn.Linear(8, 4), torch.randn(2, 8))\n"
        "\n@pytest.mark.memory_budget(peak=100)\ndef test_by_fixture(memory):\n"
        "    memory.check(nn.Linear(8, 4), torch.randn(2, 8))\n"
        "\n@pytest.mark.memory_budget(peak=100)\ndef test_plain():\n    pass\n"
    )
    module(pytester, "test_named", body)
    result = pytester.runpytest("--torchmem-update", "-W", "error::pytest.PytestWarning")
    no_internal_error(result)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 3, output(result)  # both budgets apply; test_plain warns
    result.stdout.fnmatch_lines(["*test_by_name*over budget*", "*test_by_fixture*over budget*"])
    result.stdout.fnmatch_lines(["E   *TorchmemWarning: *has no effect on test_named.py::test_plain*"])
    assert "has no effect on test_named.py::test_by" not in output(result)


# -- 10. the CLI pairs modules of the same name in other directories ----------------------------


def test_diff_pairs_a_snapshot_directory_with_its_own_module_in_a_report(
    pytester: pytest.Pytester,
) -> None:
    for folder in ("a", "b"):
        (pytester.path / "tests" / folder).mkdir(parents=True)
        (pytester.path / "tests" / folder / "__init__.py").write_text("")
        (pytester.path / "tests" / folder / "test_same.py").write_text(
            HEADER + linear_tests("test_x")
        )
    pytester.runpytest("--torchmem-update", "tests").assert_outcomes(passed=2)
    b = pytester.path / "tests" / "b" / "test_same.py"
    b.write_text(b.read_text().replace("nn.Linear(8, 4)", "nn.Linear(8, 64)"))
    report = pytester.path / "report.json"
    pytester.runpytest("tests", f"--torchmem-json={report}").assert_outcomes(passed=1, failed=1)

    def diff(old: str, new: str) -> str:
        done = pytester.run(
            sys.executable, "-m", "pytest_torchmem", "diff", old, new, "--fail-on", "any:0"
        )
        assert done.ret == (1 if old.startswith("tests") else 0), output(done)
        return [line for line in done.stdout.lines if line.startswith("torchmem diff:")][0]

    # b's snapshot pairs with b's result in the report (a is only in the report)
    assert diff("tests/b/__torchmem__", "report.json").endswith(
        "1 regressed, 0 improved, 0 stale, 0 removed, 1 added"
    )
    assert diff("report.json", "tests/b/__torchmem__").endswith(
        "0 regressed, 1 improved, 0 stale, 1 removed, 0 added"
    )
    same = pytester.run(
        sys.executable, "-m", "pytest_torchmem", "diff", "tests/a/__torchmem__", "report.json",
        "--fail-on", "any:0",
    )
    assert same.ret == 0, output(same)


# -- 11. what pytest_torchmem_adjust_report returns is checked where it comes back --------------

ADJUST = """
import dataclasses
import numpy

def pytest_torchmem_adjust_report(item, device, name, report):
    return dataclasses.replace(report, forward_peak={value})
"""


@pytest.mark.parametrize("xdist", [(), ("-n", "1")], ids=["serial", "xdist"])
def test_a_numpy_figure_from_the_adjust_hook_is_taken_as_its_integer(
    pytester: pytest.Pytester, xdist: tuple[str, ...]
) -> None:
    pytest.importorskip("numpy")
    pytester.makeconftest(ADJUST.format(value="numpy.int64(report.forward_peak + 1000)"))
    module(pytester, "test_numpy", linear_tests("test_a"))
    update = pytester.runpytest("--torchmem-update", "--torchmem-json=report.json", *xdist)
    no_internal_error(update)
    assert update.ret == 0, output(update)
    estimate = json.loads((pytester.path / "report.json").read_text())["results"][0]["estimate"]
    figures = json.loads((pytester.path / "__torchmem__" / "test_numpy.json").read_text())
    recorded = figures["tests"]["test_a"]["default"]["cpu"]["forward_peak"]
    assert recorded == 244 + 1000 and type(recorded) is int
    assert estimate["forward"] == recorded
    assert pytester.runpytest(*xdist).ret == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-5", "forward_peak is negative (-5 B)"),
        ("1.5", "forward_peak is 1.5 (float)"),
        ("True", "forward_peak is True (bool)"),
    ],
)
def test_a_bad_figure_from_the_adjust_hook_fails_the_check_and_is_not_written(
    pytester: pytest.Pytester, value: str, message: str
) -> None:
    pytester.makeconftest(ADJUST.format(value=value))
    module(pytester, "test_bad", linear_tests("test_a"))
    update = pytester.runpytest("--torchmem-update")
    no_internal_error(update)
    update.assert_outcomes(failed=1)
    update.stdout.fnmatch_lines([f"*pytest_torchmem_adjust_report returned a report whose {message}*"])
    assert not (pytester.path / "__torchmem__").exists()


# -- 14. native TOML values -------------------------------------------------------------------


@pytest.mark.skipif(int(pytest.__version__.split(".")[0]) < 9, reason="[tool.pytest] is pytest 9's")
def test_native_toml_values_are_read_as_their_strings_would_be(pytester: pytest.Pytester) -> None:
    (pytester.path / "tox.ini").unlink(missing_ok=True)
    pytester.makefile(
        ".toml",
        pyproject=(
            "[tool.pytest]\n"
            'torchmem_devices = ["cpu"]\n'
            "torchmem_rtol = 0.05\n"
            "torchmem_atol = 0\n"
            "torchmem_update = true\n"
        ),
    )
    module(pytester, "test_toml", linear_tests("test_a"))
    update = pytester.runpytest()
    assert update.ret == 0, output(update)
    update.stdout.fnmatch_lines(["torchmem: update, devices cpu, rtol 0.05, atol 0 B*"])
    assert entries(pytester.path / "__torchmem__" / "test_toml.json") == {"test_a": ["default"]}

    pytester.makefile(".toml", pyproject='[tool.pytest]\ntorchmem_update = "yes please"\n')
    bad = pytester.runpytest()
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*ini option torchmem_update:*write true or false"])
