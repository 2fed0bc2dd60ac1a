"""What the built distributions carry: the license text travels with the code (MIT asks it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("setuptools", reason="builds with the project's build backend")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel and an sdist, built by setuptools from a copy of the project."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "pytest_torchmem", source / "pytest_torchmem", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    script = (
        "import sys\nfrom setuptools import build_meta as b\n"
        "out = sys.argv[1]\nb.build_wheel(out)\nb.build_sdist(out)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(out)], cwd=source, check=True, capture_output=True)
    return out


def test_the_license_file_is_mit() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "The above copyright notice" in text


def test_the_wheel_and_the_sdist_carry_the_license(built: Path) -> None:
    (wheel,) = built.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
    metadata = next(name for name in names if name.endswith(".dist-info/METADATA"))
    assert "License-File: LICENSE" in zipfile.ZipFile(wheel).read(metadata).decode()
    (sdist,) = built.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        assert any(name.endswith("/LICENSE") for name in archive.getnames())
