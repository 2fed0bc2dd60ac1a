"""Snapshot files: format, atomic merged writes under a lock, unused entries."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from pytest_torchmem.engine.figures.report import Category, MemoryReport, ModulePeak, Unsupported
from pytest_torchmem.plugin.releases import Release, recorded_release
from pytest_torchmem.plugin.snapshots import (
    FILE_SCHEMA,
    Entry,
    Key,
    SnapshotError,
    SnapshotFile,
    module_of,
    release_of,
    snapshot_path,
    unused_keys,
    write_merged,
)


def entry(forward: int = 100, backward: int = 200, step: int = 0, **kwargs) -> Entry:
    return Entry(forward_peak=forward, backward_peak=backward, step_peak=step, **kwargs)


def test_snapshot_path_is_beside_the_module(tmp_path: Path) -> None:
    module = tmp_path / "tests" / "test_model.py"
    path = snapshot_path(module)
    assert path == tmp_path / "tests" / "__torchmem__" / "test_model.json"
    assert module_of(path) == module


def test_a_doctest_text_file_has_a_snapshot_file_of_its_own(tmp_path: Path) -> None:
    """test_doc.txt beside test_doc.py: each keeps its own file, and each file names its own."""
    folder = tmp_path / "tests"
    folder.mkdir()
    text, module = folder / "test_doc.txt", folder / "test_doc.py"
    assert snapshot_path(text) == folder / "__torchmem__" / "test_doc.txt.json"
    assert snapshot_path(module) == folder / "__torchmem__" / "test_doc.json"
    assert module_of(snapshot_path(text)) == text
    assert module_of(snapshot_path(module)) == module
    assert module_of(snapshot_path(text, Release(2, 13))) == text
    # A Python module whose stem holds a dot (importmode=importlib) stays the module's.
    dotted = folder / "test_v1.2.py"
    dotted.write_text("")
    assert module_of(snapshot_path(dotted)) == dotted


def test_a_release_has_a_directory_of_its_own_beside_the_module(tmp_path: Path) -> None:
    module = tmp_path / "tests" / "test_model.py"
    path = snapshot_path(module, Release(2, 13))
    assert path == tmp_path / "tests" / "__torchmem__" / "torch-2.13" / "test_model.json"
    assert module_of(path) == module
    assert release_of(path) == Release(2, 13)
    assert release_of(snapshot_path(module)) is None
    # Only a directory in __torchmem__ is a release's.
    assert release_of(tmp_path / "torch-2.13" / "test_model.json") is None
    assert release_of(tmp_path / "__torchmem__" / "torch-x" / "test_model.json") is None


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("2.13.0+cpu", Release(2, 13)),
        ("2.14.1+cu130", Release(2, 14)),
        ("2.15.0.dev20260101", Release(2, 15)),
        ("2.10", Release(2, 10)),
        ("nightly", None),
        (None, None),
        (213, None),
    ],
)
def test_the_release_of_a_torch_version(version: object, release: Release | None) -> None:
    assert Release.of_version(version) == release
    assert recorded_release({"torch": version}) == release


def test_releases_name_their_directories_and_sort() -> None:
    assert str(Release(2, 13)) == "2.13"
    assert Release(2, 13).directory == "torch-2.13"
    assert Release.of_directory("torch-2.13") == Release(2, 13)
    assert Release.of_directory("torch-2.13.0") is None
    assert Release.of_directory("torch-2.13 ") is None
    assert Release(2, 9) < Release(2, 10) < Release(2, 15)
    assert recorded_release({}) is None


def test_entry_from_report_records_peaks_breakdown_modules_and_environment() -> None:
    report = MemoryReport(
        device="cuda",
        forward_peak=1024,
        backward_peak=3072,
        step_peak=2048,
        breakdown={Category.PARAMETERS: 512, Category.ACTIVATIONS: 2560},
        reserved_peak=4 * 2**20,
        modules={"(model)": ModulePeak(1024, 3072), "fc": ModulePeak(1000, 3000)},
        unsupported=(Unsupported("aten.nonzero.default", "why", "model.py:3"),) * 2,
    )
    data = Entry.from_report(report, {"torch": "2.13.0", "gpu": "H100"}).to_json()
    assert data["forward_peak"] == 1024
    assert data["backward_peak"] == 3072
    assert data["step_peak"] == 2048
    assert data["peak"] == 3072
    assert data["reserved_peak"] == 4 * 2**20
    assert data["breakdown"]["parameters"] == 512
    assert data["breakdown"]["activations"] == 2560
    assert data["breakdown"]["workspace"] == 0
    assert data["modules"]["fc"] == {"forward": 1000, "backward": 3000}
    assert data["environment"] == {"torch": "2.13.0", "gpu": "H100"}
    # Op names only, once each: a location would change with every edit of the model's file.
    assert data["unsupported"] == ["aten.nonzero.default"]
    assert Entry.from_json(data).to_json() == data


def test_cpu_entry_has_no_reserved_peak_and_no_empty_fields() -> None:
    data = entry().to_json()
    assert "reserved_peak" not in data
    assert "unsupported" not in data
    assert "measured" not in data


def test_file_format_is_sorted_indented_versioned(tmp_path: Path) -> None:
    snapshot = SnapshotFile(tmp_path / "x.json")
    snapshot.entries[Key("test_b", "default", "cpu")] = entry(1)
    snapshot.entries[Key("test_a", "eval", "cpu")] = entry(2)
    text = snapshot.dumps()
    data = json.loads(text)
    assert data["schema"] == FILE_SCHEMA
    assert list(data["tests"]) == ["test_a", "test_b"]
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert text.startswith(
        '{\n  "schema": 3,\n  "tests": {\n    "test_a": {\n      "eval": {\n        "cpu": {'
    )


def test_write_merged_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "__torchmem__" / "test_m.json"
    assert write_merged(path, {Key("t", "default", "cpu"): entry()})
    assert SnapshotFile.load(path).get(Key("t", "default", "cpu")) == entry()
    assert sorted(p.name for p in path.parent.iterdir()) == ["test_m.json"]
    # A file made by open() would be readable by others: the temporary file's 0600 is not kept.
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode == 0o666 & ~_umask()
    # The same content again: not rewritten.
    before = path.stat().st_mtime_ns
    assert not write_merged(path, {Key("t", "default", "cpu"): entry()})
    assert path.stat().st_mtime_ns == before


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_write_merged_rereads_the_file_before_writing(tmp_path: Path) -> None:
    """Regression guard: an update keeps the entries another process wrote after this one read."""
    path = tmp_path / "test_m.json"
    write_merged(path, {Key("a", "default", "cpu"): entry(1)})
    stale = SnapshotFile.load(path)  # what this process saw when it started
    write_merged(path, {Key("b", "default", "cpu"): entry(2)})  # another process
    assert stale.get(Key("b", "default", "cpu")) is None
    write_merged(path, {Key("c", "default", "cpu"): entry(3)})  # this process flushes
    assert SnapshotFile.load(path).keys() == [
        Key("a", "default", "cpu"),
        Key("b", "default", "cpu"),
        Key("c", "default", "cpu"),
    ]


def test_removals_and_deleting_an_emptied_file(tmp_path: Path) -> None:
    path = tmp_path / "test_m.json"
    a, b = Key("a", "default", "cpu"), Key("b", "default", "cpu")
    write_merged(path, {a: entry(1), b: entry(2)})
    write_merged(path, {}, [a])
    assert SnapshotFile.load(path).keys() == [b]
    # A key both written and removed is written.
    write_merged(path, {a: entry(3)}, [a])
    assert SnapshotFile.load(path).get(a) == entry(3)
    write_merged(path, {}, [a, b])
    assert not path.exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ('<<<<<<< HEAD\n{"schema": 1}\n=======\n', "git conflict markers"),
        ("[]", "does not hold a JSON object"),
        ('{"schema": 99, "tests": {}}', "has schema 99"),
        (
            '{"schema": 1, "tests": {"t": {"default": {"cpu": {"backward_peak": 1}}}}}',
            "malformed entry",
        ),
    ],
)
def test_unreadable_files_are_refused_with_the_fix(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "test_m.json"
    path.write_text(text)
    with pytest.raises(SnapshotError, match=message) as info:
        SnapshotFile.load(path)
    assert str(path) in str(info.value)
    if message == "malformed entry":
        # A snapshot with one bad entry: an update of another test keeps it, as it is, and says so.
        kept: list[str] = []
        assert write_merged(path, {Key("u", "default", "cpu"): entry()}, kept=kept)
        assert kept == ['"t" > "default" > "cpu": it is malformed: the field \'forward_peak\' is missing']
        assert json.loads(path.read_text())["tests"]["t"] == json.loads(text)["tests"]["t"]
        assert SnapshotFile.load(path, keep_malformed=True).keys() == [Key("u", "default", "cpu")]
        return
    # Never overwritten: the entries of other tests would be lost.
    with pytest.raises(SnapshotError):
        write_merged(path, {Key("t", "default", "cpu"): entry()})
    assert path.read_text() == text


def _writer(path: str, prefix: str, count: int) -> None:
    for index in range(count):
        write_merged(Path(path), {Key(f"{prefix}{index}", "default", "cpu"): entry(index)})


def test_two_processes_writing_one_file_lose_no_entry(tmp_path: Path) -> None:
    """Regression guard: the lock and re-read-merge make concurrent writers lose nothing."""
    path = tmp_path / "test_m.json"
    # A first write here imports what writing needs: a forked writer that had to import
    # while another thread of this process (pytest-xdist's) held an import lock would hang.
    _writer(str(path), "z", 1)
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_writer, args=(str(path), p, 25)) for p in ("x", "y")]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join(600)  # a generous bound: 25 locked writes each, on a machine maybe loaded
            assert worker.exitcode == 0, f"a writer ended with {worker.exitcode}"
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
    assert len(SnapshotFile.load(path).keys()) == 51


def test_unused_keys_judges_only_tests_that_ran() -> None:
    snapshot = SnapshotFile(Path("x.json"))
    keys = {
        "ran_used": Key("test_a", "default", "cpu"),
        "ran_dropped_check": Key("test_a", "eval", "cpu"),
        "ran_other_device": Key("test_a", "default", "cuda"),
        "deselected": Key("test_b", "default", "cpu"),
        "deleted": Key("test_gone", "default", "cpu"),
    }
    for key in keys.values():
        snapshot.entries[key] = entry()
    common = dict(completed={"test_a"}, used={keys["ran_used"]})
    found = unused_keys(snapshot, known={"test_a", "test_b"}, devices=None, **common)
    assert found == sorted([keys["ran_dropped_check"], keys["ran_other_device"], keys["deleted"]])
    # --torchmem-devices cpu on the command line: cuda entries are not judged.
    found = unused_keys(snapshot, known={"test_a", "test_b"}, devices={"cpu"}, **common)
    assert found == sorted([keys["ran_dropped_check"], keys["deleted"]])
    # Only part of the module collected (file.py::test_a): a missing test id proves nothing.
    found = unused_keys(snapshot, known=None, devices={"cpu"}, **common)
    assert found == [keys["ran_dropped_check"]]
