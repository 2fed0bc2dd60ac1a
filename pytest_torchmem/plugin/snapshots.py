"""Snapshot files: load, look up, merge and write them atomically; find unused entries.

Each test module ``tests/test_x.py`` has one file ``tests/__torchmem__/test_x.json``
(or, where the suite keeps one snapshot directory per torch release,
``torchmem_per_torch``, one per release: ``tests/__torchmem__/torch-2.13/test_x.json``)::

    {
      "schema": 2,
      "tests": {
        "<test id in the module>": {
          "<check name>": {
            "<device>": {<Entry>}
          }
        }
      }
    }

``<check name>`` is the ``name=`` of ``torchmem.check`` (``"default"`` without one),
then the parts the check adds, each after ``" @ "`` (which a name cannot hold): a
compiled check's options (``"default @ compiled"``), a parallel check's mesh and
rank (``"default @ dp=8 rank=0"``). The file is
written with sorted keys and a two-space indent, so that one changed test is a
small diff in a pull request. Files are only written at the end of a session
(never by pytest-xdist workers), under a lock, after re-reading the file and
merging, so that two pytest processes updating the same file lose no entry.

Reading is strict: a file that is not a snapshot of this schema (bad JSON, a
hand-edited entry with a wrong type, an unknown device) raises
:class:`SnapshotFormatError`, which names the file and, where JSON gives one,
the line; a file of a newer schema raises :class:`SnapshotError` and is never
overwritten by this version.

Schema 2 records the CPU profile of a ``cpu`` entry (``"environment": {"cpu":
"avx2:4", ...}``). Schema-1 files, written before CPU profiles, still load:
their ``cpu`` entries were estimated for the host they were recorded on, which
:func:`legacy_cpu` names, so they are stale until re-recorded; the next write
of the file upgrades it to schema 2.

Every entry records the torch it was made on (``"environment": {"torch":
"2.13.0+cpu", ...}``), in both schemas: a per-release directory changes where a
file is, not what it holds, so it needs no new schema (an older pytest-torchmem
reads such files as they are).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pytest_torchmem.engine.figures.modelled_device import is_cpu
from pytest_torchmem.plugin.releases import Release

if TYPE_CHECKING:
    from pytest_torchmem.engine.figures.report import MemoryReport

__all__ = [
    "SNAPSHOT_DIR",
    "NAME_SEPARATOR",
    "FILE_SCHEMA",
    "PHASES",
    "Key",
    "Entry",
    "SnapshotFile",
    "SnapshotError",
    "SnapshotFormatError",
    "DEVICE_KEYS",
    "snapshot_path",
    "module_of",
    "release_of",
    "write_merged",
    "atomic_write",
    "unused_keys",
    "is_doctest",
    "legacy_cpu",
]

#: Name of the directory beside a test module that holds its snapshot file.
SNAPSHOT_DIR: Final = "__torchmem__"
#: What separates a check's name from the parts of its entry's name that the check
#: adds (``"default @ compiled"``, ``"default @ dp=8 rank=0"``): a check's name cannot
#: hold it, so each entry's name says unambiguously which check made it.
NAME_SEPARATOR: Final = " @ "
#: Version of the snapshot file format written; older ones are read, newer ones refused.
#: Schema 3: an entry of a training loop holds its first step (``first_step``), which
#: may be its peak.
FILE_SCHEMA: Final = 3
#: The oldest version read.
_OLDEST_SCHEMA: Final = 1
#: How a schema-1 ``cpu`` entry's environment names the CPU: the host it was recorded on.
_LEGACY_CPU: Final = "host {isa}, {threads} threads (before CPU profiles)"
#: The phases whose peaks are recorded and compared.
PHASES: Final = ("forward", "backward", "step")
#: The devices an entry can be recorded for: ``tracing.devices.DEVICES``, spelled
#: out so that reading a snapshot needs no torch (a test checks that the two agree).
DEVICE_KEYS: Final = ("cpu", "cuda")
#: What to do about a file that cannot be read.
_FIX: Final = (
    "fix it, or rewrite it by rerunning all the tests of its module with --torchmem-update"
)


class SnapshotError(Exception):
    """A snapshot file that cannot be read or written."""


class SnapshotFormatError(SnapshotError):
    """A snapshot file whose content is not a snapshot this version can read.

    Unlike a file of a newer schema, ``--torchmem-update`` may replace it.
    ``reason`` says what is wrong, without the file's name.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason: Final = reason


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
    #: The first step's (forward, backward, step) peaks, where the step ran as a
    #: training loop (whose steady state the three phase peaks are), else None.
    first_step: tuple[int, int, int] | None = None

    @property
    def peak(self) -> int:
        loop = max(self.forward_peak, self.backward_peak, self.step_peak)
        return loop if self.first_step is None else max(loop, *self.first_step)

    def figures(self) -> dict[str, int]:
        """The compared figures: the three phase peaks, the first step's peak where the
        step ran as a loop, and ``reserved`` when known."""
        figures = {
            "forward": self.forward_peak,
            "backward": self.backward_peak,
            "step": self.step_peak,
        }
        if self.first_step is not None:
            figures["first_step"] = max(self.first_step)
        if self.reserved_peak is not None:
            figures["reserved"] = self.reserved_peak
        return figures

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "forward_peak": self.forward_peak,
            "backward_peak": self.backward_peak,
            "step_peak": self.step_peak,
            **(
                {}
                if self.first_step is None
                else {"first_step": dict(zip(_PEAK_FIELDS, self.first_step, strict=True))}
            ),
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
                    if measured.first_step is None
                    else {"first_step_peak": measured.first_step.peak}
                ),
                **(
                    {}
                    if measured.reserved_peak is None
                    else {"reserved_peak": measured.reserved_peak}
                ),
            },
            first_step=None
            if report.first_step is None
            else (report.first_step.forward, report.first_step.backward, report.first_step.step),
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        """The entry ``to_json`` wrote; a bad field raises ``TypeError`` or ``ValueError``.

        The three phase peaks are required (and the first step's three, where it
        has one); every byte count must be an integer >= 0 (not a string, a float
        or a bool). Unknown fields are ignored.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"an entry must be a JSON object, got {_shown(data)}")
        forward, backward, step = _peaks(data, "")
        first = None
        if data.get("first_step") is not None:
            first = _peaks(_object(data["first_step"], "first_step"), "first_step.")
        largest = max(forward, backward, step, *(first or ()))
        if "peak" in data and _nbytes(data["peak"], "peak") != largest:
            fields = "forward_peak, backward_peak and step_peak"
            if first is not None:
                fields = "forward_peak, backward_peak, step_peak and first_step's peaks"
            raise ValueError(
                f"peak is {data['peak']}, not the largest of {fields} ({largest}): "
                "was it edited by hand?"
            )
        reserved = data.get("reserved_peak")
        measured = data.get("measured")
        modules = {}
        for name, peaks in _object(data.get("modules", {}), "modules").items():
            where = f"modules[{name!r}]"
            peaks = _object(peaks, where)
            modules[name] = (
                _nbytes(peaks.get("forward", 0), f"{where}.forward"),
                _nbytes(peaks.get("backward", 0), f"{where}.backward"),
            )
        unsupported = data.get("unsupported", [])
        if not isinstance(unsupported, list) or not all(isinstance(op, str) for op in unsupported):
            raise ValueError(f"unsupported must be a list of op names, got {_shown(unsupported)}")
        return cls(
            forward_peak=forward,
            backward_peak=backward,
            step_peak=step,
            reserved_peak=None if reserved is None else _nbytes(reserved, "reserved_peak"),
            breakdown={
                name: _nbytes(nbytes, f"breakdown[{name!r}]")
                for name, nbytes in _object(data.get("breakdown", {}), "breakdown").items()
            },
            modules=modules,
            unsupported=tuple(unsupported),
            environment=dict(_object(data.get("environment", {}), "environment")),
            measured=None
            if measured is None
            else {
                name: _nbytes(nbytes, f"measured[{name!r}]")
                for name, nbytes in _object(measured, "measured").items()
            },
            first_step=first,
        )


#: The fields of an entry's (and its first step's) three phase peaks.
_PEAK_FIELDS: Final = ("forward_peak", "backward_peak", "step_peak")


def _peaks(data: Mapping[str, Any], where: str) -> tuple[int, int, int]:
    """The three phase peaks of an entry (``where``: the prefix of their fields' names)."""
    for name in _PEAK_FIELDS:
        if name not in data:
            raise ValueError(f"the field {where + name!r} is missing")
    forward, backward, step = (_nbytes(data[name], where + name) for name in _PEAK_FIELDS)
    return forward, backward, step


def _shown(value: Any) -> str:
    """``value`` for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _nbytes(value: Any, where: str) -> int:
    if type(value) is int and value >= 0:  # the common case first: files hold thousands
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{where} must be a whole number of bytes (an integer >= 0), got {_shown(value)}"
        )
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if type(value) is not dict and not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a JSON object, got {_shown(value)}")
    return value


def _position(raw: bytes, offset: int) -> tuple[int, int]:
    """Line and column (from 1) of byte ``offset`` in ``raw``."""
    line_start = raw.rfind(b"\n", 0, offset) + 1
    return raw.count(b"\n", 0, offset) + 1, offset - line_start + 1


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members; a key given twice (a bad merge) is an error."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {key!r} appears twice in one object (a bad merge?)")
            seen.add(key)
    return data


def release_of(snapshot: Path) -> Release | None:
    """The torch release whose directory holds the snapshot file ``snapshot``
    (``__torchmem__/torch-2.13/test_x.json``: 2.13), or None for a file of all releases."""
    if snapshot.parent.parent.name != SNAPSHOT_DIR:
        return None
    return Release.of_directory(snapshot.parent.name)


def module_of(snapshot: Path) -> Path:
    """The test file a snapshot file belongs to: ``test_x.json``'s ``test_x.py``; a doctest
    text file's keeps its whole name (``test_doc.txt.json``'s ``test_doc.txt``)."""
    folder = snapshot.parent.parent
    if release_of(snapshot) is not None:
        folder = folder.parent
    module = folder / f"{snapshot.stem}.py"
    if Path(snapshot.stem).suffix and not module.exists():
        return folder / snapshot.stem
    return module


def snapshot_path(module: Path, release: Release | None = None) -> Path:
    """The snapshot file of the test file at ``module``: of every torch release, or of
    ``release`` alone (``torchmem_per_torch``). A Python module's is named after its stem
    (``test_x.json``); any other test file's (a doctest text file) after its whole name
    (``test_doc.txt.json``), so that ``test_doc.txt`` and ``test_doc.py`` have one each."""
    folder = module.parent / SNAPSHOT_DIR
    if release is not None:
        folder /= release.directory
    path = folder / f"{module.stem if module.suffix == '.py' else module.name}.json"
    # A module name cannot hold a separator, but refuse anything that would
    # put the file outside the directory beside the module.
    if path.parent != folder:  # pragma: no cover - defensive
        raise SnapshotError(f"refusing snapshot path {path} outside {folder}")
    return path


class SnapshotFile:
    """The entries of one snapshot file, in memory."""

    def __init__(self, path: Path, entries: dict[Key, Entry] | None = None) -> None:
        self.path: Final = path
        self.entries: dict[Key, Entry] = dict(entries or {})
        #: Entries that could not be read (``keep_malformed``): key -> (their JSON, why).
        self.malformed: dict[Key, tuple[Any, str]] = {}

    @classmethod
    def load(cls, path: Path, *, keep_malformed: bool = False) -> SnapshotFile:
        """Read ``path``; a file that does not exist reads as empty.

        Raises :class:`SnapshotFormatError` for a file that is not a snapshot,
        :class:`SnapshotError` for one of a newer schema or that cannot be read.
        With ``keep_malformed``, an entry that cannot be read (a hand-edited
        figure, an unknown device) does not fail the file: it is kept, as it
        is, in :attr:`malformed`, and written back unchanged by :meth:`dumps`.
        """
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(path)
        except OSError as exc:
            raise SnapshotError(f"cannot read snapshot file {path}: {exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line, column = _position(raw, exc.start)
            byte = raw[exc.start]
            reason = f"it is not UTF-8 text (byte 0x{byte:02x} at line {line}, column {column})"
            raise SnapshotFormatError(
                f"cannot read snapshot file {path}:{line}:{column}: {reason}; {_FIX}",
                reason,
            ) from None
        return cls.parse(path, text, keep_malformed=keep_malformed)

    @classmethod
    def parse(cls, path: Path, text: str, *, keep_malformed: bool = False) -> SnapshotFile:
        """The snapshot held by ``text``, the content of the file at ``path``."""

        def refuse(reason: str, where: str = "") -> SnapshotFormatError:
            return SnapshotFormatError(
                f"cannot read snapshot file {path}{where}: {reason}; {_FIX}", reason
            )

        if "<<<<<<<" in text:
            line = text[: text.index("<<<<<<<")].count("\n") + 1
            raise refuse("it holds git conflict markers", f":{line}:1")
        if not text.strip():
            raise refuse("it is empty")
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            # Every snapshot ends with its closing brace: one that does not was cut short.
            cut = "" if text.rstrip().endswith("}") else " (the file is cut short)"
            raise refuse(
                f"it is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}{cut}",
                f":{exc.lineno}:{exc.colno}",
            ) from None
        except (ValueError, RecursionError) as exc:
            raise refuse(f"it is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise refuse(f"it does not hold a JSON object (it holds a {type(data).__name__})")
        schema = data.get("schema")
        if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
            raise refuse(f'it has no valid schema version ("schema": {_shown(schema)})')
        if schema > FILE_SCHEMA:
            raise SnapshotError(
                f"snapshot file {path} has schema {schema}: it was written by a newer "
                f"pytest-torchmem (this version reads and writes schema {FILE_SCHEMA}); upgrade "
                "pytest-torchmem to use it (--torchmem-update does not overwrite it with an "
                "older schema)"
            )
        if schema < _OLDEST_SCHEMA:  # pragma: no cover - no older schema exists
            raise refuse(f"it has schema {schema}, which this version cannot read")
        entries: dict[Key, Entry] = {}
        malformed: dict[Key, tuple[Any, str]] = {}
        tests = data.get("tests", {})
        if not isinstance(tests, dict):
            raise refuse(f'"tests" must be a JSON object, got {_shown(tests)}')
        for test, checks in tests.items():
            if not isinstance(checks, dict):
                raise refuse(f"test {test!r} must map check names to devices, got {_shown(checks)}")
            for name, devices in checks.items():
                if not isinstance(devices, dict):
                    raise refuse(
                        f"check {json.dumps(test)} > {json.dumps(name)} must map devices to "
                        f"entries, got {_shown(devices)}"
                    )
                for device, entry in devices.items():
                    key = Key(test, name, device)
                    if device not in DEVICE_KEYS:
                        reason = (
                            f"it has an entry {key} for the unknown device {device!r} "
                            f"(known: {', '.join(DEVICE_KEYS)})"
                        )
                        if not keep_malformed:
                            raise refuse(reason)
                        malformed[key] = (entry, reason)
                        continue
                    try:
                        entries[key] = Entry.from_json(entry)
                    except (TypeError, ValueError) as exc:
                        if not keep_malformed:
                            raise refuse(f"it has a malformed entry {key}: {exc}") from None
                        malformed[key] = (entry, f"it is malformed: {exc}")
                        continue
                    if schema == 1 and is_cpu(device):
                        entries[key] = _upgraded_cpu_entry(entries[key])
        snapshot = cls(path, entries)
        snapshot.malformed = malformed
        return snapshot

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
        for key, (raw, _) in self.malformed.items():
            if key not in self.entries:
                tests.setdefault(key.test, {}).setdefault(key.name, {})[key.device] = raw
        document = {"schema": FILE_SCHEMA, "tests": tests}
        return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _upgraded_cpu_entry(entry: Entry) -> Entry:
    """A schema-1 ``cpu`` entry: its environment names the host it was recorded on
    (``cpu_threads``, ``cpu_isa``) in place of a CPU profile."""
    environment = dict(entry.environment)
    threads = environment.pop("cpu_threads", "?")
    isa = environment.pop("cpu_isa", "?")
    environment["cpu"] = _LEGACY_CPU.format(isa=isa, threads=threads)
    return dataclasses.replace(entry, environment=environment)


def legacy_cpu(value: Any) -> bool:
    """Whether ``value``, an entry's ``cpu`` environment, names the host of a schema-1 file."""
    return isinstance(value, str) and value.endswith("(before CPU profiles)")


def write_merged(
    path: Path,
    writes: Mapping[Key, Entry],
    removals: Iterable[Key] = (),
    *,
    replace_unreadable: bool = False,
    kept: list[str] | None = None,
) -> bool:
    """Apply ``writes`` and ``removals`` to the file at ``path``; True when it changed.

    Under an exclusive lock, the file is read again (another pytest process may
    have written it since this one read it), changed, and replaced atomically:
    written to a temporary file in the same directory, then renamed over it, so
    that an interrupted write leaves the previous file whole. A file left with
    no entry is deleted. A file that cannot be read raises
    :class:`SnapshotError` and is left as it is, unless ``replace_unreadable``
    and it is not a snapshot at all (:class:`SnapshotFormatError`): then it is
    replaced by ``writes``. A file of a newer schema, or one without write
    permission, is never touched. A file that is a symbolic link is written
    through it: the link stays, its target gets the new entries. A malformed
    entry (a hand-edited figure) that ``writes`` does not replace is kept as it
    is, and named, with why, in ``kept``: an update of some tests never loses
    the entries of the others.
    """
    path = Path(os.path.realpath(path))
    removals = set(removals)
    with _locked(path):
        try:
            current = SnapshotFile.load(path, keep_malformed=True)
        except SnapshotFormatError:
            if not replace_unreadable:
                raise
            current = SnapshotFile(path)
        if path.exists() and not os.access(path, os.W_OK):
            raise SnapshotError(f"snapshot file {path} is read-only; make it writable to update it")
        _remove_leftovers(path)
        before: dict[Key, Entry] | None = dict(current.entries)
        for key in removals:
            if key not in writes:
                current.entries.pop(key, None)
        current.entries.update(writes)
        replaced = [key for key in current.malformed if key in writes or key in removals]
        for key in replaced:
            del current.malformed[key]
        if kept is not None:
            kept.extend(f"{key}: {why}" for key, (_, why) in sorted(current.malformed.items()))
        if replaced:
            before = None  # the file changes, though the readable entries may not
        if before is not None and current.entries == before and path.exists():
            return False  # nothing to change: spare formatting a big file to find out
        if not current.entries and not current.malformed:
            if path.exists():
                path.unlink()
                return True
            return False
        text = current.dumps()
        try:
            if path.read_bytes() == text.encode("utf-8"):
                return False
        except FileNotFoundError:
            pass
        atomic_write(path, text)
        return True


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def _remove_leftovers(path: Path) -> None:
    """Delete temporary files that a writer of ``path`` left when it died mid-write.

    Called under the lock of ``path``: no other writer of it is running, so
    every such file is a leftover.
    """
    if not path.parent.is_dir():
        return
    for leftover in path.parent.glob(f"{glob.escape(_temporary_prefix(path))}*.tmp"):
        try:
            leftover.unlink()
        except OSError:
            pass


def atomic_write(path: Path, text: str) -> None:
    """Replace the file at ``path`` by ``text`` whole, or leave it as it was: written to a
    temporary file in the same directory, flushed to disk, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=_temporary_prefix(path), suffix=".tmp"
    )
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

    On POSIX systems the lock is held on the snapshot's directory itself (made
    if need be), so that no lock file is left anywhere. Windows cannot lock a
    directory: there a lock file in the system's temporary directory, keyed by
    the snapshot's absolute path, is locked (and left, empty, for the next run).
    """
    if os.name != "nt":
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = os.open(path.parent, os.O_RDONLY)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield
        finally:
            os.close(handle)  # releases the lock
        return
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    lock = Path(tempfile.gettempdir()) / f"pytest-torchmem-{digest}.lock"
    with open(lock, "a+b") as stream:  # pragma: no cover - exercised on Windows only
        import msvcrt

        while True:
            try:
                msvcrt.locking(stream.fileno(), msvcrt.LK_LOCK, 1)
                break
            except OSError:
                continue
        try:
            yield
        finally:
            stream.seek(0)
            msvcrt.locking(stream.fileno(), msvcrt.LK_UNLCK, 1)


def unused_keys(
    snapshot: SnapshotFile,
    *,
    completed: set[str],
    used: set[Key],
    known: set[str] | None,
    devices: set[str] | None,
    doctests: bool = True,
) -> list[Key]:
    """The entries of ``snapshot`` that no test of this run used.

    Judged only over the tests that ran: an entry is unused when its test
    passed in this run without checking it (on a device in ``devices``, or any
    device when ``devices`` is None), or when its test id is not among
    ``known``, every test id of the module that was collected (selected or
    deselected). ``known`` is None when only part of the module was collected
    (``file.py::test_x`` on the command line): then missing test ids prove
    nothing. Nor does a missing parametrization of a test function that was
    collected (``test_x[slow]`` beside ``test_x[fast]``): it may exist only
    under an option of the run (``pytest_generate_tests``). Nor, where
    ``doctests`` is False (a run without ``--doctest-modules``), a missing
    doctest of a Python module (``test_x.helper``: its docstring's examples).
    """
    functions = None if known is None else {_function(test) for test in known}
    unused: list[Key] = []
    for key in sorted({*snapshot.keys(), *snapshot.malformed}):
        if not doctests and is_doctest(key.test):
            continue
        if key.test in completed:
            if key not in used and (devices is None or key.device in devices):
                unused.append(key)
        elif functions is not None and _function(key.test) not in functions:
            unused.append(key)
    return unused


def is_doctest(test: str) -> bool:
    """Whether the test id ``test`` is a doctest's: ``test_x.helper`` (pytest names a
    docstring's examples after the module and the object); a test function's id never
    holds a dot outside its parameters (``TestA::test_b[1.5]``)."""
    return "." in _function(test)


def _function(test: str) -> str:
    """The test function of a test id: ``TestA::test_b`` of ``TestA::test_b[1-x]``."""
    return test.split("[", 1)[0]
