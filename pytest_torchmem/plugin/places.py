"""Where the run's snapshot entries live and how its messages name them: paths, the accept command.

An entry is keyed by its test's id inside its module (:func:`module_test_id`) in
the snapshot file beside the module (one directory per torch release under
``torchmem_per_torch``). Paths are shown relative to where pytest was started.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Final

import pytest

from pytest_torchmem.plugin import releases
from pytest_torchmem.plugin.releases import Release
from pytest_torchmem.plugin.settings import Settings
from pytest_torchmem.plugin.snapshots import is_doctest, snapshot_path

__all__ = ["SnapshotPlaces", "module_test_id"]

#: ``file:line`` of an absolute path in a message (the engine names the user's lines so).
_LOCATION: Final = re.compile(r"((?:/|[A-Za-z]:\\)[^\s:]*?\.py):(\d+)")


def module_test_id(item: pytest.Item) -> str:
    """The test's id inside its module: the node id after the file (``TestA::test_b[1]``)."""
    return item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name


def _quote(target: str) -> str:
    if any(char in target for char in '"$`\\!'):
        return shlex.quote(target)
    return f'"{target}"'


class SnapshotPlaces:
    """The snapshot files of one run, and the paths and commands its messages show."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self._config: Final = config
        self._settings: Final = settings
        #: The release whose snapshot directory this run uses (read at its first use).
        self._release: Release | None = None

    def release(self) -> Release | None:
        """The torch release whose snapshot directory this run reads and writes
        (``torchmem_per_torch``), or None: one directory for every release."""
        if not self._settings.per_torch:
            return None
        if self._release is None:
            release = releases.running_release()
            if release is None:
                raise pytest.UsageError(
                    f"--torchmem-per-torch (ini torchmem_per_torch): cannot tell the release of "
                    f"the installed torch ({releases.torch_version()!r})"
                )
            self._release = release
        return self._release

    def snapshot_file(self, module: Path) -> Path:
        """The snapshot file this run uses for the test module at ``module``."""
        return snapshot_path(module, self.release())

    def snapshot_file_of(self, nodeid: str) -> str:
        """The snapshot file (as pending writes key it) of the module of test ``nodeid``."""
        return str(self.snapshot_file(self._config.rootpath / nodeid.split("::", 1)[0]))

    def display(self, path: Path) -> str:
        """``path`` as the user sees it: relative to where pytest was started."""
        try:
            return Path(os.path.relpath(path, self._config.invocation_params.dir)).as_posix()
        except ValueError:  # another drive on Windows
            return str(path)

    def locations(self, text: str) -> str:
        """``text`` with each ``/absolute/file.py:line`` of the user's code in it as the
        user sees it: relative to where pytest was started, when inside it (a library's
        file stays as it is)."""

        def shown(match: re.Match[str]) -> str:
            path = self.display(Path(match[1]))
            return match[0] if path.startswith("..") else f"{path}:{match[2]}"

        return _LOCATION.sub(shown, text)

    def accept_command(self, item: pytest.Item) -> str:
        """The command that updates the entries of the test ``item``."""
        return self.accept(item.path, module_test_id(item) if "::" in item.nodeid else None)

    def accept(self, path: Path, test: str | None) -> str:
        """The command that updates the entries of ``test`` (a test id) in the file at ``path``."""
        target = self.display(path)
        if test is not None:
            target += "::" + test
        # Where the entry goes: an update without the option would write another file.
        options = " --torchmem-per-torch" if self._settings.per_torch_given else ""
        # A module's doctest is collected (and found by its node id) with the option only.
        if (
            path.suffix == ".py"
            and test is not None
            and is_doctest(test)
            and "--doctest-modules" in self._config.invocation_params.args
        ):
            options += " --doctest-modules"
        return f"pytest --torchmem-update{options} {_quote(target)}"
