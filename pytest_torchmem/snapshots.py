"""Snapshot files: load, look up, merge and write them atomically; find unused entries.

Each test module ``tests/test_x.py`` has one file ``tests/__torchmem__/test_x.json``::

    {
      "schema": 1,
      "tests": {
        "<test id in the module>": {
          "<check name>": {
            "<device>": {<Entry>}
          }
        }
      }
    }

written with sorted keys and a two-space indent, so that one changed test is a
small diff in a pull request. Files are only written at the end of a session
(never by pytest-xdist workers), under a lock, after re-reading the file and
merging, so that two pytest processes updating the same file lose no entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from pytest_torchmem.report import MemoryReport

__all__ = [
    "SNAPSHOT_DIR",
    "FILE_SCHEMA",
    "PHASES",
    "Key",
    "Entry",
    "SnapshotFile",
    "SnapshotError",
    "snapshot_path",
    "module_of",
    "write_merged",
    "unused_keys",
]

#: Name of the directory beside a test module that holds its snapshot file.
SNAPSHOT_DIR: Final = "__torchmem__"
#: Version of the snapshot file format; files of another version are refused.
FILE_SCHEMA: Final = 1
#: The phases whose peaks are recorded and compared.
PHASES: Final = ("forward", "backward", "step")


class SnapshotError(Exception):
    """A snapshot file that cannot be read or written."""


@dataclass(frozen=True, order=True)
class Key:
    """Where an entry lives in its file: test id, check name, device."""

    test: str
    name: str
    device: str

    def __str__(self) -> str:
        return " > ".join(json.dumps(part, ensure_ascii=False) for part in self)

    def __iter__(self) -> Iterator[str]:
        return iter((self.test, self.name, self.device))


@dataclass(frozen=True)
class Entry:
    """The figures of one check on one device, as a snapshot records them (bytes)."""

    forward_peak: int
    backward_peak: int = 0
    step_peak: int = 0
    #: The caching allocator's reserved peak (``cuda`` only).
    reserved_peak: int | None = None
    #: Category -> bytes at the moment of the peak.
    breakdown: Mapping[str, int] = field(default_factory=dict)
    #: Module name -> (forward peak, backward peak).
    modules: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    #: Ops that could not be traced faithfully (names only: stable across machines).
    unsupported: tuple[str, ...] = ()
    #: What produced the figures: torch version, GPU profile or CPU threads and ISA.
    environment: Mapping[str, Any] = field(default_factory=dict)
    #: Peaks measured on a real GPU (``forward_peak``...), when the run measured.
    measured: Mapping[str, int] | None = None

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak, self.step_peak)

    def figures(self) -> dict[str, int]:
        """The compared figures: the three phase peaks, and ``reserved`` when known."""
        figures = {
            "forward": self.forward_peak,
            "backward": self.backward_peak,
            "step": self.step_peak,
        }
        if self.reserved_peak is not None:
            figures["reserved"] = self.reserved_peak
        return figures

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "forward_peak": self.forward_peak,
            "backward_peak": self.backward_peak,
            "step_peak": self.step_peak,
            "peak": self.peak,
            "breakdown": dict(self.breakdown),
            "modules": {
                name: {"forward": fwd, "backward": bwd} for name, (fwd, bwd) in self.modules.items()
            },
            "environment": dict(self.environment),
        }
        if self.reserved_peak is not None:
            data["reserved_peak"] = self.reserved_peak
        if self.unsupported:
            data["unsupported"] = list(self.unsupported)
        if self.measured is not None:
            data["measured"] = dict(self.measured)
        return data

    @classmethod
    def from_report(
        cls,
        report: MemoryReport,
        environment: Mapping[str, Any],
        measured: MemoryReport | None = None,
    ) -> Entry:
        """The entry of an estimate (and of the real measurement beside it, if any)."""
        return cls(
            forward_peak=report.forward_peak,
            backward_peak=report.backward_peak,
            step_peak=report.step_peak,
            reserved_peak=report.reserved_peak,
            breakdown={str(category): nbytes for category, nbytes in report.breakdown.items()},
            modules={name: (peak.forward, peak.backward) for name, peak in report.modules.items()},
            unsupported=tuple(sorted({entry.op for entry in report.unsupported})),
            environment=dict(environment),
            measured=None
            if measured is None
            else {
                "forward_peak": measured.forward_peak,
                "backward_peak": measured.backward_peak,
                "step_peak": measured.step_peak,
                **(
                    {}
                    if measured.reserved_peak is None
                    else {"reserved_peak": measured.reserved_peak}
                ),
            },
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        reserved = data.get("reserved_peak")
        measured = data.get("measured")
        return cls(
            forward_peak=int(data["forward_peak"]),
            backward_peak=int(data.get("backward_peak", 0)),
            step_peak=int(data.get("step_peak", 0)),
            reserved_peak=None if reserved is None else int(reserved),
            breakdown={str(k): int(v) for k, v in data.get("breakdown", {}).items()},
            modules={
                str(name): (int(peaks.get("forward", 0)), int(peaks.get("backward", 0)))
                for name, peaks in data.get("modules", {}).items()
            },
            unsupported=tuple(str(op) for op in data.get("unsupported", ())),
            environment=dict(data.get("environment", {})),
            measured=None if measured is None else {str(k): int(v) for k, v in measured.items()},
        )


def module_of(snapshot: Path) -> Path:
    """The test module a snapshot file belongs to."""
    return snapshot.parent.parent / f"{snapshot.stem}.py"


def snapshot_path(module: Path) -> Path:
    """The snapshot file of the test module at ``module``."""
    path = module.parent / SNAPSHOT_DIR / f"{module.stem}.json"
    # A module name cannot hold a separator, but refuse anything that would
    # put the file outside the directory beside the module.
    if path.parent != module.parent / SNAPSHOT_DIR:  # pragma: no cover - defensive
        raise SnapshotError(f"refusing snapshot path {path} outside {module.parent / SNAPSHOT_DIR}")
    return path


class SnapshotFile:
    """The entries of one snapshot file, in memory."""

    def __init__(self, path: Path, entries: dict[Key, Entry] | None = None) -> None:
        self.path: Final = path
        self.entries: dict[Key, Entry] = dict(entries or {})

    @classmethod
    def load(cls, path: Path) -> SnapshotFile:
        """Read ``path``; a file that does not exist reads as empty."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls(path)
        except OSError as exc:
            raise SnapshotError(f"cannot read snapshot file {path}: {exc}") from None
        return cls.parse(path, text)

    @classmethod
    def parse(cls, path: Path, text: str) -> SnapshotFile:
        fix = "fix it, or delete it and rerun the tests with --torchmem-update"
        try:
            data = json.loads(text)
        except ValueError as exc:
            conflict = "<<<<<<<" in text
            why = "it holds git conflict markers" if conflict else f"it is not valid JSON ({exc})"
            raise SnapshotError(f"cannot read snapshot file {path}: {why}; {fix}") from None
        if not isinstance(data, dict):
            raise SnapshotError(f"snapshot file {path} does not hold a JSON object; {fix}")
        schema = data.get("schema")
        if schema != FILE_SCHEMA:
            raise SnapshotError(
                f"snapshot file {path} has schema {schema!r}; this version of pytest-torchmem "
                f"reads schema {FILE_SCHEMA} (upgrade pytest-torchmem, or {fix})"
            )
        entries: dict[Key, Entry] = {}
        try:
            for test, checks in data.get("tests", {}).items():
                for name, devices in checks.items():
                    for device, entry in devices.items():
                        entries[Key(test, name, device)] = Entry.from_json(entry)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(
                f"snapshot file {path} has a malformed entry ({exc!r}); {fix}"
            ) from None
        return cls(path, entries)

    def get(self, key: Key) -> Entry | None:
        return self.entries.get(key)

    def keys(self) -> list[Key]:
        return sorted(self.entries)

    def dumps(self) -> str:
        """The file's text: sorted keys, two-space indent, a final newline."""
        tests: dict[str, dict[str, dict[str, Any]]] = {}
        for key in sorted(self.entries):
            tests.setdefault(key.test, {}).setdefault(key.name, {})[key.device] = self.entries[
                key
            ].to_json()
        document = {"schema": FILE_SCHEMA, "tests": tests}
        return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_merged(path: Path, writes: Mapping[Key, Entry], removals: Iterable[Key] = ()) -> bool:
    """Apply ``writes`` and ``removals`` to the file at ``path``; True when it changed.

    Under an exclusive lock, the file is read again (another pytest process may
    have written it since this one read it), changed, and replaced atomically:
    written to a temporary file in the same directory, then renamed over it.
    A file left with no entry is deleted.
    """
    with _locked(path):
        current = SnapshotFile.load(path)
        for key in removals:
            if key not in writes:
                current.entries.pop(key, None)
        current.entries.update(writes)
        if not current.entries:
            if path.exists():
                path.unlink()
                return True
            return False
        text = current.dumps()
        try:
            if path.read_text(encoding="utf-8") == text:
                return False
        except FileNotFoundError:
            pass
        _atomic_write(path, text)
        return True


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        # mkstemp makes the file private (0600); give it the mode of a file made by open().
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock between processes on the snapshot file ``path``.

    The lock file lives in the system's temporary directory, keyed by the
    snapshot's absolute path, so that no lock file appears beside the
    snapshots in the repository.
    """
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    owner = os.getuid() if hasattr(os, "getuid") else 0
    lock = Path(tempfile.gettempdir()) / f"pytest-torchmem-{owner}-{digest}.lock"
    with open(lock, "a+b") as handle:
        if os.name == "nt":  # pragma: no cover - exercised on Windows only
            import msvcrt

            while True:
                try:
                    msvcrt.locking(handle.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    continue
            try:
                yield
            finally:
                handle.seek(0)
                msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def unused_keys(
    snapshot: SnapshotFile,
    *,
    completed: set[str],
    used: set[Key],
    known: set[str] | None,
    devices: set[str] | None,
) -> list[Key]:
    """The entries of ``snapshot`` that no test of this run used.

    Judged only over the tests that ran: an entry is unused when its test
    passed in this run without checking it (on a device in ``devices``, or any
    device when ``devices`` is None), or when its test id is not among
    ``known``, every test id of the module that was collected (selected or
    deselected). ``known`` is None when only part of the module was collected
    (``file.py::test_x`` on the command line): then missing test ids prove
    nothing.
    """
    unused: list[Key] = []
    for key in snapshot.keys():
        if key.test in completed:
            if key not in used and (devices is None or key.device in devices):
                unused.append(key)
        elif known is not None and key.test not in known:
            unused.append(key)
    return unused
