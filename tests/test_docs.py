"""Every Python example of the documentation (``docs/``, ``README.md``) runs here.

A block that defines tests (``def test_``) is a test file: it runs in a real
pytest run (pytester), which records its snapshot and then compares with it.
A block that defines the plugin's hooks is a ``conftest.py``: a test that
checks memory runs beside it. Any other block is a script: it is run, and
each line that ends with a comment holding a Python value
(``tm.format_bytes(cpu.peak)  # '160.34 MiB'``) is checked: the expression
must give that value. So the documentation cannot drift from the code.
"""

from __future__ import annotations

import ast
import re
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
