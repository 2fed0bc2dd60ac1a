"""Torch releases as snapshots know them: the running one, and one directory per release.

Figures are exact for one torch release, and may differ on the next (a kernel's
scratch changed). Every entry records the torch it was made on
(``"environment": {"torch": "2.13.0+cpu", ...}``); a suite whose CI runs
several releases keeps one snapshot directory per minor release
(``torchmem_per_torch``): ``tests/__torchmem__/torch-2.13/test_x.json``, so that
the jobs of a CI matrix never write the same file.

Every reader of the running torch goes through :func:`torch_version`, called
through this module at run time (``releases.torch_version()``, never a name
imported from it): the plugin's own tests replace it
(``monkeypatch.setattr(releases, "torch_version", lambda: "2.15.0")``, or a
``conftest.py`` that does so in ``pytest_configure``, for pytest-xdist's
workers too) to run a suite as another release would, without installing one.
Nothing here imports torch or pytest: the command line reads the directories'
names with it.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["RELEASE_DIR_PREFIX", "Release", "recorded_release", "running_release", "torch_version"]

#: A per-release snapshot directory is this prefix and the release: ``torch-2.13``.
RELEASE_DIR_PREFIX: Final = "torch-"
_VERSION: Final = re.compile(r"(\d+)\.(\d+)")
_DIRECTORY: Final = re.compile(rf"{re.escape(RELEASE_DIR_PREFIX)}(\d+)\.(\d+)")


@dataclass(frozen=True, order=True)
class Release:
    """A minor release of torch: ``2.13`` (of 2.13.0, 2.13.1+cu130, ...)."""

    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def directory(self) -> str:
        """The name of its snapshot directory in ``__torchmem__``: ``torch-2.13``."""
        return f"{RELEASE_DIR_PREFIX}{self}"

    @classmethod
    def of_version(cls, version: Any) -> Release | None:
        """The release of a torch version (``"2.13.0+cpu"``), or None for anything else."""
        if not isinstance(version, str):
            return None
        match = _VERSION.match(version.strip())
        return None if match is None else cls(int(match[1]), int(match[2]))

    @classmethod
    def of_directory(cls, name: str) -> Release | None:
        """The release whose snapshot directory is named ``name``, or None."""
        match = _DIRECTORY.fullmatch(name)
        return None if match is None else cls(int(match[1]), int(match[2]))


def torch_version() -> str | None:
    """The version of the torch this process runs (``torch.__version__``); None without torch.

    Read without importing torch where no test imported it yet (the report
    header, the pytest-xdist controller). Tests replace this function to
    simulate another release (see the module's docstring).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def running_release() -> Release | None:
    """The minor release of the running torch (None without torch)."""
    return Release.of_version(torch_version())


def recorded_release(environment: Mapping[str, Any]) -> Release | None:
    """The release an entry's ``environment`` says it was made on (None: not recorded)."""
    return Release.of_version(environment.get("torch"))
