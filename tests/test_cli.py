"""``python -m pytest_torchmem``: real subprocesses on the files that real pytest runs wrote.

A small suite runs under pytester twice: first with ``--torchmem-update
--torchmem-json base.json`` (the snapshots are then copied to ``base/``), then,
with a wider model, a renamed test and a test gone, with ``--torchmem-json
new.json``, and with ``--torchmem-update``. The command line reads those files.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.cli.diffing import FailOnError, Gate, parse_fail_on
from pytest_torchmem.cli.saved import Saved, load, match
from pytest_torchmem.plugin.snapshots import Entry, Key, write_merged
from pytest_torchmem.plugin.judging import Tolerance

pytest_plugins = ("pytester",)

SUITE = """
import torch
from torch import nn

WIDTH = {width}


def test_mlp(torchmem):
    model = nn.Sequential(nn.Linear(8, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))
    torchmem.check(model, torch.randn(2, 8))


def test_eval(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8), train=False, name="eval")


def test_{extra}(torchmem):
    torchmem.check(nn.Linear(4, 2), torch.randn(1, 4), train=False)
"""

MLP = "tests/test_m.py::test_mlp"
EVAL = "tests/test_m.py::test_eval"
GiB32 = 32 * 2**20


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    # pytester's in-process runs forget the modules imported inside them: import them once.
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))


@pytest.fixture(scope="module")
def _built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"dir": tmp_path_factory.mktemp("saved")}


@pytest.fixture
def saved(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, _built: dict[str, Any]
) -> Path:
    """A folder with ``base.json``, ``base/`` (the first snapshots), ``new.json``, ``tests/``.

    Made by real pytest runs once per module (and xdist worker); each test gets a copy.
    """
    if "done" not in _built:
        monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")
        module = pytester.path / "tests" / "test_m.py"
        module.parent.mkdir()
        module.write_text(SUITE.format(width=16, extra="gone"))
        first = pytester.runpytest("tests", "--torchmem-update", "--torchmem-json", "base.json")
        assert first.ret == 0
        shutil.copytree(pytester.path / "tests" / "__torchmem__", pytester.path / "base")
        module.write_text(SUITE.format(width=32, extra="added"))
        second = pytester.runpytest("tests", "--torchmem-json", "new.json")
        assert second.ret == pytest.ExitCode.TESTS_FAILED
        assert pytester.runpytest("tests", "--torchmem-update").ret == 0
        for name in ("base.json", "base", "new.json", "tests"):
            source, target = pytester.path / name, _built["dir"] / name
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(source, target)
        _built["done"] = True
    shutil.copytree(_built["dir"], pytester.path / "saved")
    return pytester.path / "saved"


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest_torchmem", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,  # a bound for a hang, not for a loaded machine's slowness
        check=False,
        env=env,
    )


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def snapshot_entry(path: Path, test: str, name: str, device: str) -> dict[str, Any]:
    return read(path)["tests"][test][name][device]


def params(width: int, *, block: int = 0) -> int:
    """Bytes of Linear(8, width) and Linear(width, 4) float32 parameters (each tensor
    rounded up to ``block`` bytes when given: the CUDA caching allocator's 512)."""
    sizes = [8 * width * 4, width * 4, width * 4 * 4, 4 * 4]
    if block:
        sizes = [math.ceil(size / block) * block for size in sizes]
    return sum(sizes)


# -- the spec of --fail-on ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "figures", "tolerance"),
    [
        ("bwd:5%", [("backward",)], [Tolerance(rtol=0.05)]),
        ("backward:5%", [("backward",)], [Tolerance(rtol=0.05)]),
        ("FWD:10MiB", [("forward",)], [Tolerance(atol=10 * 2**20)]),
        ("forward: 1.5 GB", [("forward",)], [Tolerance(atol=1_500_000_000)]),
        ("step:0", [("step",)], [Tolerance()]),
        ("peak:2.5%", [("peak",)], [Tolerance(rtol=0.025)]),
        ("reserved:512B", [("reserved",)], [Tolerance(atol=512)]),
        (
            "any:1%",
            [("forward", "backward", "step", "first_step", "peak", "reserved")],
            [Tolerance(rtol=0.01)],
        ),
        (
            "fwd:10MiB, bwd:5%",
            [("forward",), ("backward",)],
            [Tolerance(atol=10 * 2**20), Tolerance(rtol=0.05)],
        ),
    ],
)
def test_fail_on_spec(
    text: str, figures: list[tuple[str, ...]], tolerance: list[Tolerance]
) -> None:
    rules = parse_fail_on(text)
    assert [rule.figures for rule in rules] == figures
    assert [rule.tolerance for rule in rules] == tolerance


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bwd", "'bwd': expected PHASE:LIMIT, e.g. bwd:5% or fwd:10MiB"),
        ("bwd:", "'bwd:': expected PHASE:LIMIT"),
        (":5%", "':5%': expected PHASE:LIMIT"),
        ("gpu:5%", "'gpu:5%': unknown phase 'gpu'; expected PHASE:LIMIT"),
        ("bwd:5", "'bwd:5': a bare number is ambiguous; write 5% (of the OLD figure) or 5B"),
        ("bwd:-5%", "'bwd:-5%': cannot read '-5%'"),
        ("bwd:5%%", "'bwd:5%%': cannot read '5%%'"),
        ("bwd:5 parsecs", "'bwd:5 parsecs': unknown unit 'parsecs'"),
        ("bwd:0.5B", "'bwd:0.5B': '0.5B' is not a whole number of bytes"),
        ("bwd:5%,", "'': expected PHASE:LIMIT"),
    ],
)
def test_malformed_fail_on_spec_names_itself_and_the_form(text: str, message: str) -> None:
    with pytest.raises(FailOnError) as info:
        parse_fail_on(text)
    assert message in str(info.value)


def test_gate_takes_the_strictest_rule_and_exact_percentages() -> None:
    gate = Gate(tuple(parse_fail_on("bwd:5%,bwd:10KiB,any:29%")))
    # 5% of 1 MiB is 52428.8 -> 52428 B; 10 KiB is 10240 B; 29% is 304087.04 -> 304087 B.
    assert gate.limit("backward", 2**20) == (10240, gate.rules[1])
    assert gate.limit("backward", 100_000) == (5000, gate.rules[0])
    assert gate.limit("forward", 2**20) == (304087, gate.rules[2])
    # 0.29 * 100 is 28.999999999999996 in binary floating point: the limit is 29 bytes,
    # for the plugin's --torchmem-rtol too.
    assert gate.limit("forward", 100) == (29, gate.rules[2])
    assert Tolerance(rtol=0.29).allowed(100) == 29
    assert Gate(tuple(parse_fail_on("fwd:1%"))).limit("backward", 100) is None
    # Without rules the figures the plugin compares have no tolerance; peak is not one.
    assert Gate().limit("backward", 100) == (0, None)
    assert Gate().limit("peak", 100) is None


def test_modules_match_by_path_ending_and_single_modules_pair() -> None:
    def at(module: str, test: str = "test_a") -> Saved:
        return Saved(module, Key(test, "default", "cpu"), Entry(forward_peak=1), "f.json")

    # A report names tests/test_m.py, a snapshot directory test_m.py: the same module.
    pairs = match([at("test_m.py"), at("sub/test_n.py")], [at("tests/test_m.py"), at("test_n.py")])
    assert {(o.module, n.module) for o, n in pairs if o and n} == {
        ("test_m.py", "tests/test_m.py"),
        ("sub/test_n.py", "test_n.py"),
    }
    assert all(o and n for o, n in pairs)
    # Two modules that could both be "test_m.py": neither pairs.
    pairs = match([at("test_m.py"), at("other.py")], [at("a/test_m.py"), at("b/test_m.py")])
    assert all(o is None or n is None for o, n in pairs)
    # One module on each side: a snapshot file saved under another name still matches.
    pairs = match([at("base.py")], [at("tests/test_m.py"), at("tests/test_m.py", "test_b")])
    assert [(o and o.key.test, n and n.key.test) for o, n in pairs] == [
        ("test_a", "test_a"),
        (None, "test_b"),
    ]


def test_entries_pair_within_their_release_where_a_side_holds_several() -> None:
    def at(release: str, test: str = "test_a", module: str = "test_m.py") -> Saved:
        key = Key(test, "default", "cpu")
        return Saved(module, key, Entry(forward_peak=1), "f.json", release=release)

    def pairs(old: list[Saved], new: list[Saved]) -> set[tuple[str | None, str | None]]:
        return {(o and o.release, n and n.release) for o, n in match(old, new)}

    # A suite's directories on both sides: each release with its own.
    both = [at("2.13"), at("2.15")]
    assert pairs(both, both) == {("2.13", "2.13"), ("2.15", "2.15")}
    # A report (or directory) of one release against them: its release pairs, the other not.
    assert pairs([at("2.15")], both) == {("2.15", "2.15"), (None, "2.13")}
    # One release on each side: the releases are compared with each other.
    assert pairs([at("2.13")], [at("2.15")]) == {("2.13", "2.15")}
    assert pairs([at("")], [at("2.15")]) == {("", "2.15")}


def test_a_directory_reads_the_release_directories_in_it(tmp_path: Path) -> None:
    entry = Entry(forward_peak=64, environment={"torch": "2.13.0+cpu"})
    key = Key("test_a", "default", "cpu")
    folder = tmp_path / "tests" / "__torchmem__"
    write_merged(folder / "test_m.json", {key: entry})
    write_merged(folder / "torch-2.13" / "test_m.json", {key: entry})
    write_merged(folder / "torch-2.15" / "test_m.json", {key: entry})
    loaded = load(str(tmp_path / "tests"))
    assert [(s.module, s.release) for s in loaded.entries] == [
        ("test_m.py", ""),
        ("test_m.py", "2.13"),
        ("test_m.py", "2.15"),
    ]
    # From inside __torchmem__, and from inside one release's directory.
    inside = load(str(folder))
    assert [(s.module, s.release) for s in inside.entries] == [
        (s.module, s.release) for s in loaded.entries
    ]
    (one,) = load(str(folder / "torch-2.15")).entries
    assert (one.module, one.release) == ("test_m.py", "2.15")
    assert one.title == "test_m.py::test_a (torch 2.15)"
    (single,) = load(str(folder / "torch-2.13" / "test_m.json")).entries
    assert single.release == "2.13"
    assert single.origin is not None and single.origin.endswith("tests/test_m.py")


# -- no torch ----------------------------------------------------------------------------


def test_the_command_line_never_imports_torch_or_pytest(saved: Path, tmp_path: Path) -> None:
    """Regression guard: `python -m pytest_torchmem` starts without torch (nor pytest)."""
    for name in ("torch", "pytest"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} was imported')\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    control = subprocess.run(
        [sys.executable, "-c", "import torch"], env=env, capture_output=True, check=False
    )
    assert b"torch was imported" in control.stderr  # the trap works
    for args in (
        ["diff", "--help"],
        ["show", "tests", "base.json"],
        ["diff", "base.json", "new.json", "--fail-on", "any:1%", "--format", "json"],
    ):
        done = cli(*args, cwd=saved, env=env)
        assert "was imported" not in done.stderr, args
        assert done.returncode in (0, 1), (args, done.stderr)


def test_help_has_examples_and_exit_codes_and_version(saved: Path) -> None:
    main = cli("--help", cwd=saved)
    assert main.returncode == 0
    for text in ("show", "diff", "python -m pytest_torchmem diff", "exit codes:", "--version"):
        assert text in main.stdout
    show = cli("show", "--help", cwd=saved)
    assert "python -m pytest_torchmem show tests/ --device cuda --sort peak" in show.stdout
    diff = cli("diff", "--help", cwd=saved)
    assert "Without --fail-on, diff judges the forward, backward and step peaks, a" in diff.stdout
    assert "reports, and exits 0." in diff.stdout
    assert "0  success; for diff: no entry fails (always so without --fail-on" in diff.stdout
    assert "1  diff: an entry fails a --fail-on limit" in diff.stdout
    assert "2  a malformed command line, or an input that cannot be read" in diff.stdout
    version = cli("--version", cwd=saved)
    assert version.stdout == f"pytest-torchmem {tm.__version__}\n"
    assert cli(cwd=saved).returncode == 2  # no command


# -- show --------------------------------------------------------------------------------


def test_show_a_snapshot_file_in_exact_bytes(saved: Path) -> None:
    done = cli("show", "base/test_m.json", "--bytes", cwd=saved)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "base/test_m.json (snapshot file, 6 entries)"
    assert lines[2].split() == [
        "test",
        "name",
        "device",
        "forward",
        "backward",
        "step",
        "peak",
        "reserved",
        "environment",
    ]
    rows = {tuple(line.split()[:3]): line.split() for line in lines[4:]}
    assert set(rows) == {
        (f"test_m.py::{test}", name, device)
        for test, name in (("test_eval", "eval"), ("test_gone", "default"), ("test_mlp", "default"))
        for device in ("cpu", "cuda")
    }
    # Linear(8, 4) without grad on a (2, 8) input: 144 B of parameters, 64 B of input,
    # 32 B of output.
    assert rows["test_m.py::test_eval", "eval", "cpu"] == [
        *("test_m.py::test_eval", "eval", "cpu", "240", "0", "0", "240", "-"),
        *("torch", f"{torch.__version__},", "cpu", "avx2:4"),
    ]
    # On the fake H100: weight, bias, input and output in 512 B blocks, and cuBLAS's
    # 32 MiB workspace.
    cuda = rows["test_m.py::test_eval", "eval", "cuda"]
    assert cuda[3:7] == [str(GiB32 + 4 * 512), "0", "0", str(GiB32 + 4 * 512)]
    assert cuda[8:] == ["torch", f"{torch.__version__},", "H100"]
    # Every figure as the file holds it.
    mlp = snapshot_entry(saved / "base" / "test_m.json", "test_mlp", "default", "cuda")
    figures = ("forward_peak", "backward_peak", "step_peak", "peak", "reserved_peak")
    assert rows["test_m.py::test_mlp", "default", "cuda"][3:8] == [str(mlp[f]) for f in figures]


def test_show_human_sizes_a_directory_and_a_report_alike(saved: Path) -> None:
    done = cli("show", "base", "base.json", "-k", "eval", cwd=saved)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "base (1 file, 6 entries, 2 shown)" in out
    assert "base.json (report, 6 entries, 2 shown)" in out
    eval_rows = [line.split() for line in out.splitlines() if "test_eval" in line]
    assert [row[:7] for row in eval_rows] == [
        ["test_m.py::test_eval", "eval", "cpu", "240", "B", "0", "B"],
        ["test_m.py::test_eval", "eval", "cuda", "32.00", "MiB", "0", "B"],
        ["tests/test_m.py::test_eval", "eval", "cpu", "240", "B", "0", "B"],
        ["tests/test_m.py::test_eval", "eval", "cuda", "32.00", "MiB", "0", "B"],
    ]
    # A report has the run's status of each check.
    assert "status" in out.split("base.json (report")[1]
    # A report of an update run holds what the snapshot file holds, module figures included.
    shown = {
        path: json.loads(cli("show", path, "--format", "json", cwd=saved).stdout)
        for path in ("base", "base.json")
    }
    entries = {
        path: {
            (e["test"], e["name"], e["device"]): {
                k: e[k] for k in ("figures", "breakdown", "modules")
            }
            for e in data["inputs"][0]["entries"]
        }
        for path, data in shown.items()
    }
    assert entries["base"] == entries["base.json"]
    assert len(entries["base"]) == 6
    mlp = snapshot_entry(saved / "base" / "test_m.json", "test_mlp", "default", "cpu")
    assert entries["base"]["test_mlp", "default", "cpu"]["modules"] == mlp["modules"]
    assert [e["status"] for e in shown["base.json"]["inputs"][0]["entries"]] == ["new"] * 6
    assert {e["module"] for e in shown["base.json"]["inputs"][0]["entries"]} == {"tests/test_m.py"}


def test_show_filters_sorts_and_markdown(saved: Path) -> None:
    done = cli("show", "tests", "--device", "cuda", "--sort", "peak", "--bytes", cwd=saved)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[4:]]
    assert [row[2] for row in rows] == ["cuda"] * 3
    peaks = [int(row[6]) for row in rows]
    assert peaks == sorted(peaks, reverse=True)
    assert rows[0][0] == "test_m.py::test_mlp"  # the training step needs two workspaces
    both = cli("show", "tests", "--device", "cpu,cuda", "-k", "added", "-k", "eval", cwd=saved)
    names = sorted(line.split()[0] for line in both.stdout.splitlines()[4:])
    assert names == ["test_m.py::test_added"] * 2 + ["test_m.py::test_eval"] * 2
    markdown = cli("show", "tests", "--format", "markdown", "--device", "cpu", cwd=saved)
    lines = markdown.stdout.splitlines()
    assert lines[0] == "#### tests (1 file, 6 entries, 3 shown)"
    assert lines[2].startswith("| test ") and lines[2].endswith(" |")
    assert lines[3].startswith("|:---") and "---:|" in lines[3]  # numbers right-aligned
    assert lines[4].startswith("| test_m.py::test_added | default | cpu ")
    # Linear(4, 2) without grad on a (1, 4) input: 40 B of parameters, 16 B in, 8 B out.
    assert re.search(r"\|\s+64 B \|", lines[4])
    nothing = cli("show", "tests", "--device", "tpu", cwd=saved)
    assert nothing.returncode == 2
    assert "no entry matches --device tpu (devices in the inputs: cpu, cuda)" in nothing.stderr


# -- diff --------------------------------------------------------------------------------


def test_diff_without_fail_on_reports_the_plugins_verdicts_and_exits_0(saved: Path) -> None:
    done = cli("diff", "base.json", "new.json", cwd=saved)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert (
        out.splitlines()[0]
        == "OLD base.json (report, 6 entries) -> NEW new.json (report, 6 entries)"
    )
    assert (
        "torchmem diff: 8 entries: 2 passed, 2 regressed, 0 improved, 0 stale, 2 removed, 2 added"
        in out
    )
    assert "report only: no --fail-on given, exit 0 (gate with e.g. --fail-on any:0)" in out
    # The plugin judged the same pairs in the second run: the same verdicts.
    report = read(saved / "new.json")
    plugin = {(r["test"], r["device"]): r["status"] for r in report["results"] if r["snapshot"]}
    verdicts = json.loads(
        cli("diff", "base.json", "new.json", "--format", "json", cwd=saved).stdout
    )
    ours = {(e["test"], e["device"]): e["status"] for e in verdicts["entries"]}
    assert plugin == {k: v for k, v in ours.items() if k in plugin}
    assert plugin == {
        ("test_eval", "cpu"): "passed",
        ("test_eval", "cuda"): "passed",
        ("test_mlp", "cpu"): "regressed",
        ("test_mlp", "cuda"): "regressed",
    }
    # The categories that moved, as the plugin's failure message words them: the
    # parameters grew from Linear(8, 16), Linear(16, 4) to Linear(8, 32), Linear(32, 4).
    grown = params(32) - params(16)
    assert grown == 832
    assert (
        "  categories that moved most (at the peak): gradients +832 B (+98.1%), "
        "parameters +832 B (+98.1%)" in out
    )
    assert "  modules that moved most (forward peak): " in out
    cpu = next(e for e in verdicts["entries"] if e["test"] == "test_mlp" and e["device"] == "cpu")
    assert cpu["categories"]["parameters"] == grown
    cuda = next(e for e in verdicts["entries"] if e["test"] == "test_mlp" and e["device"] == "cuda")
    assert cuda["categories"]["parameters"] == params(32, block=512) - params(16, block=512) == 512
    assert "only in OLD (removed):\ntests/test_m.py::test_gone [default] on cpu: peak 64 B" in out
    assert "tests/test_m.py::test_added [default] on cpu: peak 64 B (new.json)" in out


def test_diff_table_rows_are_the_files_figures(saved: Path) -> None:
    old = snapshot_entry(saved / "base" / "test_m.json", "test_mlp", "default", "cpu")
    new = snapshot_entry(
        saved / "tests" / "__torchmem__" / "test_m.json", "test_mlp", "default", "cpu"
    )
    done = cli("diff", "base", "tests", "--bytes", "--device", "cpu", "-k", "mlp", cwd=saved)
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("\n\n")[1].splitlines()
    rows = [line.split() for line in table[2:]]
    expected = []
    for phase in ("forward", "backward"):
        before, after = old[f"{phase}_peak"], new[f"{phase}_peak"]
        assert after > before
        percent = f"{(after - before) / before:.1%}"
        expected.append(
            [
                "test_m.py::test_mlp",
                "default",
                "cpu",
                phase,
                str(before),
                str(after),
                f"+{after - before}",
                f"(+{percent})",
                "±0",
                "regressed",
            ]
        )
    assert rows == expected


def test_diff_fails_beyond_the_limit_only(saved: Path) -> None:
    """A figure may move exactly its limit; one byte more fails (exit 1)."""
    old = snapshot_entry(saved / "base" / "test_m.json", "test_mlp", "default", "cpu")
    new = snapshot_entry(
        saved / "tests" / "__torchmem__" / "test_m.json", "test_mlp", "default", "cpu"
    )
    grew = new["backward_peak"] - old["backward_peak"]
    args = ("diff", "base", "tests", "--device", "cpu")
    assert cli(*args, "--fail-on", f"bwd:{grew}B", cwd=saved).returncode == 0
    failed = cli(*args, "--fail-on", f"bwd:{grew - 1}B", cwd=saved)
    assert failed.returncode == 1
    assert "failed: 1 entry fails bwd:" in failed.stdout
    assert (
        f"cpu backward peak grew: new {tm.format_bytes(new['backward_peak'])}, old "
        f"{tm.format_bytes(old['backward_peak'])}: " in failed.stdout
    )
    assert f"allowed ±{tm.format_bytes(grew - 1)} (--fail-on bwd:{grew - 1}B)" in failed.stdout
    # As a percentage of the OLD figure: the smallest that allows the growth, in tenths
    # of a per mille, and the next smaller one.
    percent = Decimal(math.ceil(Decimal(grew) * 100_000 / old["backward_peak"])) / 1000
    assert math.floor(percent / 100 * old["backward_peak"]) >= grew
    assert math.floor((percent - Decimal("0.001")) / 100 * old["backward_peak"]) < grew
    assert cli(*args, "--fail-on", f"bwd:{percent}%", cwd=saved).returncode == 0
    assert cli(*args, "--fail-on", f"bwd:{percent - Decimal('0.001')}%", cwd=saved).returncode == 1
    # Only the gated figures fail; the others are shown, not gated.
    other = cli(*args, "--fail-on", "step:0", cwd=saved)
    assert other.returncode == 0
    assert "not gated" in other.stdout
    assert "passed: no entry fails step:0" in other.stdout
    # Several rules: the stricter one holds.
    both = cli(*args, "--fail-on", f"bwd:{percent}%", "--fail-on", f"bwd:{grew - 1}B", cwd=saved)
    assert both.returncode == 1


def test_diff_a_report_against_a_snapshot_directory_and_missing_entries(saved: Path) -> None:
    # base.json names the module tests/test_m.py; the directory tests/, test_m.py.
    done = cli("diff", "base.json", "tests", "--fail-on", "any:1000%", cwd=saved)
    assert done.returncode == 0, done.stdout
    assert "4 passed, 0 regressed, 0 improved, 0 stale, 2 removed, 2 added" in done.stdout
    strict = cli("diff", "base.json", "tests", "--fail-on-missing", cwd=saved)
    assert strict.returncode == 1
    assert (
        "tests/test_m.py::test_gone [default] on cpu: peak 64 B (base.json) (fails: --fail-on-missing)"
        in strict.stdout
    )
    assert "failed: 4 entries fail --fail-on-missing (exit 1)" in strict.stdout
    # The same directory on both sides: nothing changed.
    same = cli("diff", "tests", "tests/__torchmem__/test_m.json", "--fail-on", "any:0", cwd=saved)
    assert same.returncode == 0
    assert "no figure changed" in same.stdout
    assert "torchmem diff: 6 entries: 6 passed," in same.stdout


def test_diff_improvement_fails_when_asked(saved: Path) -> None:
    args = ("diff", "tests", "base", "-k", "mlp")
    assert cli(*args, "--fail-on", "any:1%", cwd=saved).returncode == 0
    done = cli(*args, "--fail-on", "any:1%", "--fail-on-improvement", cwd=saved)
    assert done.returncode == 1
    assert "test_m.py::test_mlp [default] on cpu: improved (fails)" in done.stdout
    assert "cpu backward peak shrank: new " in done.stdout
    alone = cli(*args, "--fail-on-improvement", cwd=saved)
    assert alone.returncode == 2
    assert "--fail-on-improvement needs --fail-on" in alone.stderr


def test_diff_stale_entries_are_marked_and_not_compared(saved: Path) -> None:
    path = saved / "base" / "test_m.json"
    data = read(path)
    cpu = data["tests"]["test_mlp"]["default"]["cpu"]
    assert cpu["environment"]["cpu"] == "avx2:4"
    cpu["environment"]["cpu"] = "avx2:8"
    path.write_text(json.dumps(data))
    done = cli("diff", "base", "tests", "--fail-on", "any:0", "--device", "cpu", cwd=saved)
    assert done.returncode == 0, done.stdout  # not compared: the growth does not fail
    assert "stale (recorded in another environment: figures not compared):" in done.stdout
    assert (
        "test_m.py::test_mlp [default] on cpu: cpu avx2:8 -> avx2:4"
        in done.stdout
    )
    assert "stale: not compared" in done.stdout
    assert "1 passed, 0 regressed, 0 improved, 1 stale, 1 removed, 1 added" in done.stdout
    assert cli("diff", "base", "tests", "--fail-on-stale", cwd=saved).returncode == 1


def test_diff_of_entries_with_other_keep_output_is_stale_not_failed(saved: Path) -> None:
    """Two snapshot files whose entry differs in keep_output (the base kept the output):
    the figures measured other steps, so they are not compared; a deliberate change
    of the test does not fail the gate unless --fail-on-stale asks."""
    path = saved / "base" / "test_m.json"
    data = read(path)
    data["tests"]["test_mlp"]["default"]["cpu"]["environment"]["keep_output"] = True
    path.write_text(json.dumps(data))
    done = cli("diff", "base", "tests", "--fail-on", "any:0", "--device", "cpu", cwd=saved)
    assert done.returncode == 0, done.stdout
    assert "test_m.py::test_mlp [default] on cpu: keep_output True -> False" in done.stdout
    assert cli("diff", "base", "tests", "--fail-on-stale", cwd=saved).returncode == 1


def test_diff_json_and_markdown(saved: Path) -> None:
    done = cli(
        "diff", "base.json", "new.json", "--fail-on", "bwd:5%", "--format", "json", cwd=saved
    )
    data = json.loads(done.stdout)
    assert data["fail_on"] == ["bwd:5%"]
    reports = read(saved / "base.json"), read(saved / "new.json")
    failed = 0
    for device in ("cpu", "cuda"):
        old, new = (
            next(r for r in report["results"] if r["test"] == "test_mlp" and r["device"] == device)[
                "estimate"
            ]["backward"]
            for report in reports
        )
        entry = next(
            e for e in data["entries"] if e["test"] == "test_mlp" and e["device"] == device
        )
        grew = new - old > old * 5 // 100
        assert entry["changes"]["backward"] == {
            "old": old,
            "new": new,
            "delta": new - old,
            "ratio": (new - old) / old,
            "allowed": old * 5 // 100,
            "rule": "bwd:5%",
            "moved": "grew" if grew else None,
        }
        assert entry["changes"]["forward"]["rule"] is None  # not gated
        assert entry["failed"] is grew and entry["status"] == ("regressed" if grew else "passed")
        failed += grew
    assert failed == 1  # on cpu; the cuda backward peak is mostly cuBLAS workspaces
    assert done.returncode == data["exit_code"] == 1 and data["failed"] is True
    assert data["totals"] == {
        "passed": 3,
        "regressed": 1,
        "improved": 0,
        "stale": 0,
        "removed": 2,
        "added": 2,
        "entries": 8,
        "failed": 1,
    }
    markdown = cli(
        "diff", "base.json", "new.json", "--fail-on", "bwd:5%", "--format", "markdown", cwd=saved
    )
    assert markdown.returncode == 1
    lines = markdown.stdout.splitlines()
    assert lines[0] == "#### OLD base.json (report, 6 entries) -> NEW new.json (report, 6 entries)"
    assert lines[2].startswith("| test ") and "| phase " in lines[2]
    assert "- `tests/test_m.py::test_gone` [default] on cpu: peak 64 B (base.json)" in lines
    assert lines[-1].startswith("**failed: ") and lines[-1].endswith(" (exit 1)**")
    assert lines[-2].startswith("**torchmem diff: 8 entries: ")


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{\n  "schema": 1,\n  "tests": {\n    "a": 1,\n  }\n}\n',
            (
                "cannot read bad.json:5:3: it is not valid JSON: Expecting property name "
                "enclosed in double quotes at line 5, column 3"
            ),
        ),
        (
            '{\n<<<<<<< HEAD\n  "schema": 1,\n=======\n',
            "cannot read bad.json:2:1: it holds git conflict markers",
        ),
        ("[1, 2]\n", "bad.json is neither a pytest-torchmem snapshot file"),
        ('{"schema": 4, "tests": {}}', "bad.json has schema 4"),
        ('{"schema": 1, "tests": {"t": {"default": {"cpu": {"step_peak": 1}}}}}', "forward_peak"),
        ('{"schema": 9, "results": []}', "bad.json is a JSON report of schema 9"),
        (
            '{"schema": 1, "results": [{"test": "t", "nodeid": "m.py::t"}]}',
            "bad.json: result 1 of the JSON report is malformed (KeyError('estimate'))",
        ),
        (b"\xff\xfe\x00", "cannot read bad.json: it is not a UTF-8 text file"),
        (" \n", "cannot read bad.json: it is empty"),
    ],
)
def test_unreadable_inputs_exit_2_naming_the_file(
    saved: Path, content: str | bytes, message: str
) -> None:
    path = saved / "bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    done = cli("show", "bad.json", cwd=saved)
    assert done.returncode == 2
    assert done.stdout == ""
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_missing_paths_empty_directories_and_bad_options_exit_2(saved: Path) -> None:
    (saved / "empty").mkdir()
    cases = [
        (("show", "nothing.json"), "nothing.json: no such file or directory"),
        (("show", "empty"), "empty: no snapshot files in it"),
        (("diff", "base.json", "empty"), "empty: no snapshot files in it"),
        (  # SUITE starts with a blank line: "import" is at line 2, column 1
            ("diff", "tests/test_m.py", "base"),
            "cannot read tests/test_m.py:2:1: it is not valid JSON: Expecting value",
        ),
        (("diff", "base.json"), "the following arguments are required: NEW"),
        (
            ("diff", "base.json", "new.json", "--fail-on", "bwd:5"),
            "'bwd:5': a bare number is ambiguous",
        ),
        (("diff", "base.json", "new.json", "--fail-on", "gpu:1%"), "unknown phase 'gpu'"),
        (("show", "tests", "--sort", "size"), "invalid choice: 'size'"),
    ]
    for args, message in cases:
        done = cli(*args, cwd=saved)
        assert done.returncode == 2, args
        assert message in done.stderr, (args, done.stderr)


def test_a_report_s_stopped_check_has_no_entry_to_read(tmp_path: Path) -> None:
    """A check whose trace stopped is in a JSON report with ``"estimate": null``: the
    command line reads the report's other checks and passes over it."""
    from pytest_torchmem.plugin.judging import judge, stopped
    from pytest_torchmem.plugin.summary import json_report

    entry = Entry(forward_peak=100, backward_peak=200, environment={"cpu": "avx2:4"})
    common: dict[str, Any] = {
        "nodeid": "test_m.py::test_a",
        "file": "__torchmem__/test_m.json",
        "accept": 'pytest --torchmem-update "test_m.py::test_a"',
        "snapshot": None,
        "tolerance": Tolerance(),
        "budgets": {},
        "update": False,
    }
    results = [
        judge(key=Key("test_a", "default", "cpu"), estimate=entry, fail_on_improvement=False, **common),
        stopped(key=Key("test_a", "default", "cuda"), partial=entry, why="the trace stopped at ...", **common),
    ]
    report = json_report(results, [], environment={}, settings={})
    assert [r["estimate"] is None for r in report["results"]] == [False, True]
    (tmp_path / "report.json").write_text(json.dumps(report))
    loaded = load(str(tmp_path / "report.json"))
    assert [(saved.key.device, saved.status) for saved in loaded.entries] == [("cpu", "missing")]
