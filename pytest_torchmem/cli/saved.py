"""Saved results, read back outside pytest: snapshot files, directories of them, JSON reports.

An input is a snapshot file (``__torchmem__/test_x.json``), a directory (every
snapshot file in a ``__torchmem__`` directory under it, and in its per-release
directories, ``__torchmem__/torch-2.13/``; failing that, the ``*.json`` files
in it), or a report written by ``pytest --torchmem-json``.
Files are told apart by their content. Every entry is named by its test
module, as a path relative to the directory given (or, in a report, as
pytest's node id names it), its :class:`~pytest_torchmem.plugin.snapshots.Key`, and
the torch release whose directory holds it, if any (``torchmem_per_torch``).

Nothing here imports torch or pytest: ``python -m pytest_torchmem`` starts fast.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

from pytest_torchmem.plugin.releases import Release
from pytest_torchmem.plugin.snapshots import (
    SNAPSHOT_DIR,
    Entry,
    Key,
    SnapshotError,
    SnapshotFile,
    module_of,
    release_of,
)
from pytest_torchmem.plugin.summary import REPORT_SCHEMA

__all__ = ["InputError", "Loaded", "Saved", "load", "match"]

#: Directories never searched for snapshot files (hidden ones, ``.git`` or ``.venv``, too).
_SKIPPED_DIRS: Final = frozenset({"__pycache__", "node_modules", "site-packages"})
_REPORT_HINT: Final = "write it again with pytest --torchmem-json PATH"


class InputError(Exception):
    """An input that cannot be read; the message names the file and what is wrong."""


@dataclass(frozen=True, order=True)
class Saved:
    """One saved entry: a check of a test on a device, and where it was read from."""

    #: The test module, a POSIX path: ``test_m.py``, ``tests/test_m.py``.
    module: str
    key: Key
    entry: Entry = field(compare=False)
    #: The file it was read from, as the user named it.
    file: str = field(compare=False)
    #: The status the run gave it (a report only; None for a snapshot file).
    status: str | None = field(default=None, compare=False)
    #: Where the test module is on disk (a snapshot file in a ``__torchmem__``
    #: directory), as an absolute POSIX path: it tells apart modules of the
    #: same name in other directories when entries are paired.
    origin: str | None = field(default=None, compare=False)
    #: The torch release whose snapshot directory holds it (``"2.13"``: read from
    #: ``__torchmem__/torch-2.13/``, or a report's check that used one); ``""`` for none.
    release: str = ""

    @property
    def label(self) -> str:
        """``tests/test_m.py::test_a``: the test as pytest names it."""
        return f"{self.module}::{self.key.test}"

    @property
    def title(self) -> str:
        """The label, and the release of its directory: ``tests/test_m.py::test_a (torch 2.13)``."""
        return f"{self.label} (torch {self.release})" if self.release else self.label


@dataclass(frozen=True)
class Loaded:
    """What one input holds."""

    #: The input as the user named it.
    path: str
    #: ``"snapshot file"``, ``"report"`` or ``"directory"``.
    kind: str
    #: The files read (one, except for a directory).
    files: tuple[str, ...]
    entries: tuple[Saved, ...]

    def describe(self, shown: int | None = None) -> str:
        """``tests (3 files, 12 entries)``; ``shown``: how many pass the filters, if not all."""
        count = len(self.entries)
        entries = f"{count} entr{'y' if count == 1 else 'ies'}"
        if shown is not None and shown != count:
            entries += f", {shown} shown"
        if self.kind == "directory":
            files = len(self.files)
            return f"{self.path} ({files} file{'' if files == 1 else 's'}, {entries})"
        return f"{self.path} ({self.kind}, {entries})"


def load(argument: str) -> Loaded:
    """Read the input ``argument`` names; :class:`InputError` if it cannot be read."""
    path = Path(argument)
    if path.is_dir():
        return _load_directory(argument, path)
    if not path.exists():
        raise InputError(f"{argument}: no such file or directory")
    kind, entries = _load_file(path, argument, module=None)
    return Loaded(argument, kind, (argument,), tuple(sorted(entries)))


def _load_directory(argument: str, root: Path) -> Loaded:
    files = _snapshot_files(root)
    if not files:
        # A copy of a __torchmem__ directory under another name, or a folder of reports.
        files = sorted(p for p in root.glob("*.json") if p.is_file() and not _hidden(p.name))
    if not files:
        raise InputError(
            f"{argument}: no snapshot files in it (looked for __torchmem__/*.json and "
            "__torchmem__/torch-*/*.json under it, then *.json in it); name a snapshot file or "
            "a JSON report instead"
        )
    entries: dict[tuple[str, str, Key], Saved] = {}
    for path in files:
        shown = _shown(argument, root, path)
        _, found = _load_file(path, shown, module=_module_in(root, path))
        for saved in found:
            twin = entries.get((saved.module, saved.release, saved.key))
            if twin is not None:
                raise InputError(
                    f"{argument}: {saved.title} [{saved.key.name}] on {saved.key.device} is "
                    f"both in {twin.file} and in {saved.file}; name one of them"
                )
            entries[saved.module, saved.release, saved.key] = saved
    return Loaded(
        argument,
        "directory",
        tuple(_shown(argument, root, path) for path in files),
        tuple(sorted(entries.values())),
    )


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _snapshot_files(root: Path) -> list[Path]:
    """Every ``*.json`` in a ``__torchmem__`` directory under ``root`` (``root`` included),
    and in the per-release directories in it (``__torchmem__/torch-2.13/``)."""
    found: list[Path] = []
    for folder, dirs, names in os.walk(os.path.abspath(root)):
        dirs[:] = sorted(d for d in dirs if not _hidden(d) and d not in _SKIPPED_DIRS)
        if _in_snapshot_dir(Path(folder, "x.json")):
            found += [Path(folder, n) for n in names if n.endswith(".json") and not _hidden(n)]
    return sorted(root / path.relative_to(os.path.abspath(root)) for path in found)


def _in_snapshot_dir(path: Path) -> bool:
    """Whether ``path`` is in a ``__torchmem__`` directory or in a per-release one in it."""
    return path.parent.name == SNAPSHOT_DIR or release_of(path) is not None


def _module_in(root: Path, path: Path) -> str:
    """The test module of the snapshot file ``path``, relative to ``root``."""
    parts = list(path.parent.relative_to(root).parts)
    if parts and release_of(path.absolute()) is not None:
        parts.pop()  # torch-2.13
    if parts and parts[-1] == SNAPSHOT_DIR:
        parts.pop()
    return PurePosixPath(*parts, module_of(path.absolute()).name).as_posix()


def _shown(argument: str, root: Path, path: Path) -> str:
    return os.path.join(argument, *path.relative_to(root).parts)


def _load_file(path: Path, shown: str, module: str | None) -> tuple[str, list[Saved]]:
    """The kind of the file at ``path`` and its entries; ``module`` names a snapshot's module."""
    text, data = _read_json(path, shown)
    if isinstance(data, dict) and isinstance(data.get("results"), list):
        return "report", _report_entries(data, shown)
    if isinstance(data, dict) and "tests" in data:
        try:
            snapshot = SnapshotFile.parse(Path(shown), text)
        except SnapshotError as exc:
            raise InputError(str(exc)) from None
        name = module or module_of(path.absolute()).name
        origin = None
        if _in_snapshot_dir(path.absolute()):
            origin = PurePosixPath(*module_of(path.absolute()).parts).as_posix()
        release = release_of(path.absolute())
        return "snapshot file", [
            Saved(name, key, entry, shown, origin=origin, release=_release_text(release))
            for key, entry in snapshot.entries.items()
        ]
    raise InputError(
        f"{shown} is neither a pytest-torchmem snapshot file (a JSON object with "
        f'"schema" and "tests", as in __torchmem__/test_x.json) nor a JSON report (one with '
        f'"schema" and "results", written by pytest --torchmem-json PATH)'
    )


def _read_json(path: Path, shown: str) -> tuple[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"cannot read {shown}: it is not a UTF-8 text file") from None
    except OSError as exc:
        raise InputError(f"cannot read {shown}: {exc.strerror or exc}") from None
    if "<<<<<<<" in text:
        line = text[: text.index("<<<<<<<")].count("\n") + 1
        raise InputError(
            f"cannot read {shown}:{line}:1: it holds git conflict markers; resolve the "
            "conflict, or rerun the tests with --torchmem-update"
        )
    if not text.strip():
        raise InputError(f"cannot read {shown}: it is empty")
    try:
        return text, json.loads(text)
    except json.JSONDecodeError as exc:
        # The form snapshots.py uses: PATH:LINE:COLUMN, which editors and CI logs link.
        raise InputError(
            f"cannot read {shown}:{exc.lineno}:{exc.colno}: it is not valid JSON: {exc.msg} "
            f"at line {exc.lineno}, column {exc.colno}"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"cannot read {shown}: it is not valid JSON: {exc}") from None


def _report_entries(data: Mapping[str, Any], shown: str) -> list[Saved]:
    """The estimates of a ``--torchmem-json`` report (``summary.json_report``'s layout);
    a check whose trace stopped has none."""
    schema = data.get("schema")
    if schema != REPORT_SCHEMA:
        raise InputError(
            f"{shown} is a JSON report of schema {schema!r}; this version of pytest-torchmem "
            f"reads schema {REPORT_SCHEMA} ({_REPORT_HINT} with this version)"
        )
    found: list[Saved] = []
    for number, result in enumerate(data["results"], start=1):
        if isinstance(result, Mapping) and result.get("stopped") is not None:
            continue  # a check whose trace stopped: no estimate
        try:
            test, nodeid = str(result["test"]), str(result["nodeid"])
            suffix = f"::{test}"
            module = nodeid[: -len(suffix)] if nodeid.endswith(suffix) else nodeid.split("::")[0]
            figures = result["estimate"]
            entry = Entry.from_json(
                {
                    "forward_peak": figures["forward"],
                    "backward_peak": figures["backward"],
                    "step_peak": figures["step"],
                    "reserved_peak": figures.get("reserved"),
                    "breakdown": result.get("breakdown", {}),
                    "modules": result.get("modules", {}),  # reports of 0.1.0 have none
                    "unsupported": result.get("unsupported", ()),
                    "environment": result.get("environment", {}),
                    "measured": result.get("measured"),
                    # reports made before the training loop have none
                    "first_step": result.get("first_step"),
                }
            )
            key = Key(test, str(result["name"]), str(result["device"]))
            status = result.get("status")
            # The release of the snapshot directory the check used (torchmem_per_torch).
            release = _release_text(Release.of_version(result.get("torch_release")))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"{shown}: result {number} of the JSON report is malformed ({exc!r}); "
                f"{_REPORT_HINT}"
            ) from None
        found.append(
            Saved(
                module,
                key,
                entry,
                shown,
                None if status is None else str(status),
                release=release,
            )
        )
    seen: set[tuple[str, Key]] = set()
    for saved in found:
        if (saved.module, saved.key) in seen:
            raise InputError(
                f"{shown}: {saved.label} [{saved.key.name}] on {saved.key.device} appears twice "
                f"in the JSON report; {_REPORT_HINT}"
            )
        seen.add((saved.module, saved.key))
    return found


def _release_text(release: Release | None) -> str:
    return "" if release is None else str(release)


# -- matching two inputs ----------------------------------------------------------------


def match(old: Sequence[Saved], new: Sequence[Saved]) -> list[tuple[Saved | None, Saved | None]]:
    """Pair the entries of two inputs by test module, test id, check name and device,
    and torch release where either side holds several releases' directories.

    Modules pair by name; else when one path ends with the other
    (``tests/test_m.py`` and ``test_m.py``: a report beside a snapshot
    directory) and no other module could pair with either; else, when each
    side holds a single module, those two (a snapshot file saved under
    another name). Where a path could pair with several (``test_same.py`` of
    a snapshot directory against ``tests/a/test_same.py`` and
    ``tests/b/test_same.py`` of a report), the snapshot file's place on disk
    picks the one. Unpaired entries come with None on the other side.

    Where each side holds one release at most (``__torchmem__/torch-2.13`` against
    ``__torchmem__/torch-2.15``, a directory against a report), releases are not
    compared: that is how two releases' figures are diffed. Where a side holds
    several (``tests/`` of a suite with ``torchmem_per_torch``), each entry pairs
    with the entry of its own release only.
    """
    origins = {s.module: s.origin for s in (*old, *new) if s.origin is not None}
    modules = _pair_modules({s.module for s in old}, {s.module for s in new}, origins)
    by_release = max(len({s.release for s in old}), len({s.release for s in new})) > 1

    def release(saved: Saved) -> str:
        return saved.release if by_release else ""

    olds = {(modules.get(s.module, s.module), release(s), s.key): s for s in old}
    news = {(s.module, release(s), s.key): s for s in new}
    return [(olds.get(where), news.get(where)) for where in sorted(set(olds) | set(news))]


def _pair_modules(old: set[str], new: set[str], origins: Mapping[str, str]) -> dict[str, str]:
    """Old module -> the new module it is; ``origins``: module -> its path on disk, if known."""
    if len(old) == 1 and len(new) == 1:
        return {next(iter(old)): next(iter(new))}
    pairs = {module: module for module in old & new}
    left, right = old - new, new - old

    def alike(module: str, others: list[str]) -> list[str]:
        found = [other for other in others if _ends_alike(module, other)]
        if len(found) > 1:  # a tie: where the files are on disk decides, if it can
            found = [
                o for o in found if _ends_alike(origins.get(module, module), origins.get(o, o))
            ]
        return found

    for module in left:
        candidates = alike(module, sorted(right))
        if len(candidates) == 1 and alike(candidates[0], sorted(left)) == [module]:
            pairs[module] = candidates[0]
    return pairs


def _ends_alike(a: str, b: str) -> bool:
    """Whether the shorter of two POSIX paths is the end of the longer, part by part."""
    parts_a, parts_b = PurePosixPath(a).parts, PurePosixPath(b).parts
    shorter = min(len(parts_a), len(parts_b))
    return parts_a[-shorter:] == parts_b[-shorter:]
