"""Every Python example of the documentation (``docs/``, ``README.md``) runs here.

A block that defines tests (``def test_``) is a test file: it runs in a real
pytest run (pytester), which records its snapshot and then compares with it.
A block that defines the plugin's hooks is a ``conftest.py``: a test that
checks memory runs beside it. Any other block is a script: it is run, and
each line that ends with a comment holding a Python value
(``tm.format_bytes(cpu.peak)  # '160.34 MiB'``) is checked: the expression
must give that value. The console transcripts of pytest runs of the tutorial's
test (the tutorial's, the budgets and profile how-tos') are replayed, and each
output compared with the transcript line for line. So the documentation cannot
drift from the code.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for index, match in enumerate(_BLOCK.finditer(page.read_text(encoding="utf-8"))):
            found.append((f"{page.relative_to(ROOT)}#{index + 1}", match.group(1)))
    return found


BLOCKS = _blocks()


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    """Import what the examples use before pytester's in-process runs snapshot
    ``sys.modules`` (a module they dropped would register its torch library twice)."""
    import pytest_torchmem as tm

    model, x = torch.nn.Linear(2, 2), torch.randn(1, 2)
    for device in ("cpu", "cuda"):
        tm.estimate(model, x, device=device, optimizer=lambda p: torch.optim.Adam(p))
    tm.measure(model, x)
    tm.estimate(torch.compile(model), x)
    for name in ("transformers", "transformers.trainer", "peft", "accelerate", "lightning"):
        try:  # (the frameworks a page's examples import, and what they import lazily)
            __import__(name)
        except ImportError:
            pass


def _kind(code: str) -> str:
    if "def pytest_torchmem_" in code:
        return "conftest"
    if re.search(r"^def test_", code, re.M):
        return "test file"
    return "script"


def _claims(code: str) -> list[tuple[int, str, object]]:
    """``(line, expression, value)`` of each line ``expression  # value[: words]``."""
    claims = []
    for number, line in enumerate(code.splitlines(), 1):
        expression, hash_, comment = line.partition("  # ")
        if not hash_ or not expression.strip() or "=" in expression.replace("==", ""):
            continue
        for text in (comment.strip(), comment.split(": ", 1)[0].strip()):
            try:
                claims.append((number, expression.strip(), ast.literal_eval(text)))
                break
            except (ValueError, SyntaxError):
                continue
    return claims


def test_the_documentation_has_examples() -> None:
    kinds = [_kind(code) for _, code in BLOCKS]
    assert {"conftest", "test file", "script"} <= set(kinds)


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_an_example_of_the_documentation_runs(
    where: str, code: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = _kind(code)
    if kind == "script":
        # run here, without pytester: its teardown drops the modules imported since its
        # setup, and a later import makes second copies (transformers' models a script
        # imports: dynamo then guards a compiled model's globals on the other copy)
        if "build_vit()" in code:
            pytest.skip("an illustration: build_vit stands for the user's model")
        torch.manual_seed(0)
        namespace: dict[str, object] = {}
        exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the documentation's own code
        for line, expression, value in _claims(code):
            assert eval(expression, namespace) == value, f"{where}, line {line}: {expression}"  # noqa: S307
        return
    pytester: pytest.Pytester = request.getfixturevalue("pytester")
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:randomly")
    if kind == "conftest":
        pytester.makeconftest(code)
        pytester.makepyfile(
            test_doc="import torch\n\ndef test_x(torchmem):\n"
            "    torchmem.check(torch.nn.Linear(4, 4), torch.randn(2, 4))\n"
        )
    else:
        pytester.makepyfile(test_doc=code)
    update = pytester.runpytest("--torchmem-update")
    assert update.ret == 0, update.stdout.str()
    assert "INTERNALERROR" not in update.stdout.str()
    compare = pytester.runpytest()
    assert compare.ret == 0, compare.stdout.str()


def test_the_hooks_conftest_loads_with_the_plugin_disabled(pytester: pytest.Pytester) -> None:
    """The hooks how-to's ``conftest.py`` marks its hooks optional: ``pytest -p no:torchmem``
    runs the tests instead of stopping at "unknown hook"."""
    (code,) = [code for where, code in BLOCKS if where.startswith("docs/howto/hooks.md") and _kind(code) == "conftest"]
    pytester.makeconftest(code)
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = pytester.runpytest("-p", "no:torchmem")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=1)


def test_a_page_whose_examples_import_another_package_says_to_install_it_first() -> None:
    """Regression guard (issue 36): the generation and fit how-tos import transformers, which
    pytest-torchmem does not install, and did not say so: a reader without this repository's
    ``[test]`` extra met an ``ImportError``. A page's examples import the standard library,
    pytest-torchmem and what it installs (its dependencies in ``pyproject.toml``, imported by
    their own names); any other package is named with ``pip install`` before the first
    example that imports it."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    dependencies = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.S | re.M)
    assert dependencies is not None
    installed = {*re.findall(r'"([A-Za-z0-9_]+)', dependencies[1]), "pytest_torchmem"}
    assert {"torch", "pytest"} <= installed
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in _BLOCK.finditer(text):
            for name in re.findall(r"^\s*(?:from|import) (\w+)", block[1], re.M):
                if name not in sys.stdlib_module_names and name not in installed:
                    before = " ".join(text[: block.start()].split())
                    assert f"pip install {name}" in before, f"{page.relative_to(ROOT)} imports {name} without saying to install it"


# -- the pin of the installed torch ----------------------------------------------------------

_PIN = re.compile(r'"torch==\$\((python -c .*?)\)"')


def test_the_pin_of_the_installed_torch_is_the_version_pip_recorded(tmp_path: Path) -> None:
    """Regression guard (issue 36): ``torch==$(python -c '... torch.__version__')`` expanded
    to ``torch==2.15.0+cu132`` for PyPI's CUDA builds, whose recorded version is ``2.15.0``
    and which no index has: pip failed. Each page's pin is run beside such a torch (its
    ``__version__`` with a local label, its distribution's without) and must give the
    recorded version, which pip finds installed."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text('__version__ = "2.15.0+cu132"\n')
    (site / "torch-2.15.0.dist-info").mkdir()
    (site / "torch-2.15.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.15.0\n")
    pins = [(page, match[1]) for page in PAGES for match in _PIN.finditer(page.read_text(encoding="utf-8"))]
    assert [page.name for page, _ in pins][:1] == ["README.md"]
    for page, command in pins:
        python, flag, code = shlex.split(command)
        printed = subprocess.run(
            [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
            capture_output=True, text=True, check=True,
        ).stdout
        assert printed == "2.15.0\n", (page, command)


# -- the transcripts of pytest runs ------------------------------------------------------

TUTORIAL = ROOT / "docs" / "tutorial.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
#: the lines of pytest's header that describe the machine and the directory, not the plugin
_MACHINE = ("platform ", "rootdir: ", "configfile: ", "plugins: ")


def _commands(block: str) -> list[tuple[str, list[str]]]:
    """A console block's ``(command, output lines)``, in order."""
    found: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            found.append((line[2:], []))
        else:
            found[-1][1].append(line)
    return found


def _normalised(lines: list[str]) -> list[str]:
    """pytest's output without the machine's lines and with the duration as ``N.NNs`` (the
    summary line's ``=`` padding follows its length)."""
    kept = []
    for line in lines:
        if line.startswith(_MACHINE):
            continue
        timed = re.fullmatch(r"(=+ )?(.*) in \d+\.\d+s(?: \([\d:]+\))?( =+)?", line)
        if timed:
            line = f"{'== ' if timed[1] else ''}{timed[2]} in N.NNs{' ==' if timed[3] else ''}"
        kept.append(line.rstrip())
    return kept


def _as_documented(lines: list[str], documented: list[str]) -> list[str]:
    """pytest's output ``lines``, with the reader's header (platform, rootdir, configfile,
    plugins) and the documented duration kept wherever the rest of the line is the same."""
    def header(output: list[str]) -> list[str]:
        return output[: next((i for i, line in enumerate(output) if line.startswith("collected")), 0)]

    head, old_head = header(lines), header(documented)
    out = (old_head if _normalised(head) == _normalised(old_head) else head) + lines[len(head) :]
    timed = [line for line in documented if not line.startswith(_MACHINE) and [line] != _normalised([line])]
    return [next((old for old in timed if _normalised([old]) == _normalised([line])), line) for line in out]


#: ``TORCHMEM_RECORD_TRANSCRIPTS=1``: the transcript tests write what pytest prints into the
#: pages instead of comparing (the reader's header lines kept), after a change of the output.
RECORD = os.environ.get("TORCHMEM_RECORD_TRANSCRIPTS") == "1"


def _replay(pytester: pytest.Pytester, block: str, where: str) -> int:
    """Run a console block's ``pytest`` commands, compare each output with the block's, and
    each ``echo $?`` with the exit code; return how many ran. The block shows the reader's
    project, never a temporary directory. Under :data:`RECORD` the block is rewritten with
    what the commands print."""
    ran: list[str] = []
    ret = None
    recorded: list[str] = []
    for command, documented in _commands(block):
        recorded.append(f"$ {command}")
        if command == "echo $?":
            assert RECORD or documented == [str(ret)], f"{where}: the exit code of {ran[-1]!r}"
            recorded.append(str(ret))
        elif command.startswith("pytest"):
            result = pytester.runpytest(*shlex.split(command)[1:])
            ret = int(result.ret)
            if RECORD:
                recorded += _as_documented(result.outlines, documented)
            else:
                assert _normalised(result.outlines) == _normalised(documented), f"{where}: {command}"
            ran.append(command)
        else:
            recorded += documented
        for line in documented:
            assert not re.match(r"rootdir: (/tmp|/var/tmp|/private/var|/var/folders)/", line), (where, line)
    if RECORD:
        page = ROOT / where
        text = page.read_text(encoding="utf-8")
        page.write_text(text.replace(block, "\n".join(line.rstrip() for line in recorded) + "\n", 1), encoding="utf-8")
    return len(ran)


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tutorial's project: its test file, ``tests/test_model.py``; an 80-column terminal on a
    reader's machine (pytest leaves the short summary's lines whole where ``CI`` or
    ``BUILD_NUMBER`` is set)."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:randomly")
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
    if not torch.__version__.startswith("2.13."):
        pytest.skip(f"the transcripts' figures are torch 2.13's (the README's), not {torch.__version__}'s")
    text = TUTORIAL.read_text(encoding="utf-8")
    test_file = pytester.mkdir("tests") / "test_model.py"
    test_file.write_text(next(m[2] for m in _FENCE.finditer(text) if m[1] == "python"), encoding="utf-8")
    return test_file


def _hidden(test_file: Path, width: int) -> None:
    source = test_file.read_text(encoding="utf-8")
    assert len(re.findall(r"hidden: int = \d+", source)) == 1
    test_file.write_text(re.sub(r"hidden: int = \d+", f"hidden: int = {width}", source), encoding="utf-8")


def test_the_tutorials_transcripts_are_what_pytest_prints(pytester: pytest.Pytester, project: Path) -> None:
    """The tutorial's console blocks, replayed in order: its test file written as shown, the
    hidden layer widened where the text says so, every ``pytest`` command run and its output
    compared line for line (all but the header's platform, rootdir, configfile and plugins
    lines, and the durations), every ``echo $?`` with the exit code. (The ``git diff`` shows
    the reader's repository.)"""
    text = TUTORIAL.read_text(encoding="utf-8")
    position, ran = 0, 0
    for fence in _FENCE.finditer(text):
        if "`hidden: int = 512`" in text[position : fence.start()]:
            _hidden(project, 512)
        position = fence.end()
        if fence[1] == "console":
            ran += _replay(pytester, fence[2], "docs/tutorial.md")
    assert ran == 7


def test_the_readmes_failure_is_lines_of_the_tutorials_replayed_run() -> None:
    """The README's ``pytest -q`` failure shows lines of the tutorial's ``pytest -q`` run
    (which the test above replays against pytest), in their order, none added: what the
    README shows, and says of it, is what that command prints (issue 36: it promised the
    moved categories and modules, which only plain ``pytest`` prints)."""
    fences = _FENCE.finditer((ROOT / "README.md").read_text(encoding="utf-8"))
    (block,) = [m[2] for m in fences if m[1] == "console" and m[2].startswith("$ pytest -q\n")]
    ((command, shown),) = _commands(block)
    runs = [
        output
        for fence in _FENCE.finditer(TUTORIAL.read_text(encoding="utf-8"))
        if fence[1] == "console"
        for command_run, output in _commands(fence[2])
        if command_run == command and any("FAILURES" in line for line in output)
    ]
    assert len(runs) == 1
    printed = iter(runs[0])
    assert all(line in printed for line in shown), "the README shows a line the run does not print, or out of order"
    assert not any(line.startswith(("  categories that moved", "  modules that moved", "snapshot: ")) for line in runs[0])


TUTORIAL_TEST = "tests/test_model.py::test_training_step_memory"
#: The how-tos' runs of the tutorial's test: the page, its block's command, the hidden width
#: its snapshot was recorded with, and the width it runs with.
HOWTO_RUNS = [
    ("docs/howto/gpu-profiles.md", "pytest --torchmem-gpu A100", 512, 512),
    ("docs/howto/cpu-profiles.md", "pytest --torchmem-cpu avx512:8", 256, 256),
    ("docs/howto/budgets.md", f'pytest --torchmem-update "{TUTORIAL_TEST}"', 512, 4096),
]


@pytest.mark.parametrize(("page", "command", "recorded", "width"), HOWTO_RUNS, ids=[r[0] for r in HOWTO_RUNS])
def test_the_how_tos_transcripts_are_what_pytest_prints(
    pytester: pytest.Pytester, project: Path, page: str, command: str, recorded: int, width: int
) -> None:
    """A how-to's run of the tutorial's test, from the snapshot the tutorial left
    (recorded with ``hidden: int = recorded``), replayed as the tutorial's are."""
    fences = _FENCE.finditer((ROOT / page).read_text(encoding="utf-8"))
    (block,) = [m[2] for m in fences if m[1] == "console" and m[2].startswith(f"$ {command}\n")]
    _hidden(project, recorded)
    assert pytester.runpytest("--torchmem-update").ret == 0
    _hidden(project, width)
    assert _replay(pytester, block, page) == 1
