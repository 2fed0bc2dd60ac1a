"""The README's commands are the ones CI runs, verbatim, as a newcomer runs them (issue 53).

The README's "Quick start" gives three commands: the main job (a fresh venv, the
project, ``pytest examples``), the set-up and test command, and the install line for
a project that has its own torch. ``.ci/run`` must run each as it is written, the
first two each in a fresh clone of the commit, so that what a newcomer types is what
CI proves; the documentation's front page repeats the main job.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CI = ROOT / ".ci" / "run"


def quick_start_commands() -> list[str]:
    """The commands of the README's console blocks in "Quick start", in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.partition("\n## Quick start\n")[2].partition("\n## ")[0]
    blocks = re.findall(r"^```console\n(.*?)^```$", section, re.S | re.M)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def _ci_lines() -> list[str]:
    """``.ci/run``'s lines that run something (no comments, no blank lines)."""
    lines = CI.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def test_the_readme_gives_the_main_job_the_test_command_and_the_install_line_beside_a_torch() -> None:
    commands = quick_start_commands()
    assert len(commands) == 3, commands
    main_job, tests, beside = commands
    assert main_job.startswith("python3 -m venv .venv && ") and main_job.endswith(" && pytest examples")
    assert tests.startswith("python3 -m venv .venv && ") and "python -m pytest" in tests
    assert beside.startswith("pip install pytest-torchmem ")


def test_ci_runs_each_readme_command_verbatim() -> None:
    lines = _ci_lines()
    for command in quick_start_commands():
        running = [line for line in lines if line == command or line.startswith(command + " || ")]
        assert running, f".ci/run does not run the README's command as written:\n{command}"
        assert len(running) == 1, running


def test_ci_runs_the_main_job_and_the_test_command_each_in_a_fresh_clone() -> None:
    """Each of the two commands follows a ``git clone`` of the checkout and a ``cd`` into
    the clone, with no other command between them that could install something."""
    lines = _ci_lines()
    for command in quick_start_commands()[:2]:
        at = next(i for i, line in enumerate(lines) if line.startswith(command))
        before = [line for line in lines[:at] if not line.startswith(("section ", "export PYTEST_ADDOPTS="))]
        clone, cd = before[-2:]
        assert clone.startswith('git clone -q "$checkout" "$fresh/'), clone
        assert cd == f'cd {clone.split()[-1]}', (clone, cd)


def test_the_documentations_front_page_gives_the_same_main_job() -> None:
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    main_job, tests, _ = quick_start_commands()
    assert main_job in index.splitlines()
    # the index's test command runs in the venv the main job made
    assert tests.partition(" && . .venv/bin/activate && ")[2] in index.splitlines()
