"""Bad input at every entry a user touches, through real pytest runs (pytester).

Malformed budgets, tolerances, devices and GPU profiles (markers, options, ini
files) are usage or collection errors that name the value and the fix. A
snapshot file that is not a snapshot fails the checks of its module, naming
the file (and the line where JSON gives one), and is only replaced under
``--torchmem-update``; one of a newer schema is never replaced. A write that
fails, is interrupted or crashes leaves the previous file whole. An exception
raised by the user's code inside a check is the user's, with the model put
back. Never an INTERNALERROR.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices import DEVICES
from pytest_torchmem.engine.figures.gpu_profiles import PROFILES
from pytest_torchmem.plugin.snapshots import DEVICE_KEYS, FILE_SCHEMA, Key, SnapshotFile

pytest_plugins = ("pytester",)

HEADER = "import pytest\nimport torch\nfrom torch import nn\n"
LINEAR = """
def test_linear(torchmem):
    torchmem.check(nn.Linear(8, {out}), torch.randn(2, 8))
"""
FIX = "fix it, or rewrite it by rerunning all the tests of its module with --torchmem-update"
UNITS = "use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB"
CPU_FIX = "write '<level>:<threads>' such as 'avx2:4' (levels: default, avx2, avx512, avx512_bf16, amx), or 'host' for this machine"
GPU_FIX = (
    "describe another in the ini option torchmem_gpus (NAME: memory=16GiB cc=8.9 sms=66), "
    "or use 'current' for this machine's GPU"
)


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))  # see test_plugin_e2e


@pytest.fixture(autouse=True)
def _quiet_plugins(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # (after pytester, which clears PYTEST_ADDOPTS) see test_plugin_e2e; and tests in file order.
    monkeypatch.setenv(
        "PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider -p no:randomly"
    )


def esc(text: str) -> str:
    """``text`` as an fnmatch pattern that matches it literally."""
    return re.sub(r"([\[\]*?])", r"[\1]", text)


def output(result: pytest.RunResult) -> str:
    return result.stdout.str() + "\n" + result.stderr.str()


def no_internal_error(result: pytest.RunResult) -> None:
    assert "INTERNALERROR" not in output(result)
    assert "Traceback (most recent call last)" not in output(result)


def snapshot_dir(pytester: pytest.Pytester) -> Path:
    return pytester.path / "__torchmem__"


def cpu_only(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")


# -- markers -------------------------------------------------------------------------------

MARKERS: list[tuple[str, str]] = [
    ('peak="5 GB/s"', f"memory_budget(peak='5 GB/s'): unknown unit 'GB/s' in '5 GB/s'; {UNITS}"),
    (
        'forward="1.5 XiB"',
        f"memory_budget(forward='1.5 XiB'): unknown unit 'XiB' in '1.5 XiB'; {UNITS}",
    ),
    (
        'backward="-5 MiB"',
        (
            "memory_budget(backward='-5 MiB'): cannot read '-5 MiB' as a byte size: "
            "it cannot be negative"
        ),
    ),
    ("step=-1", "memory_budget(step=-1): a byte size cannot be negative, got -1"),
    (
        'peak="1e9"',
        (
            "memory_budget(peak='1e9'): cannot read '1e9' as a byte size: write it without an "
            "exponent, e.g. '1 GB' or '1000000000'"
        ),
    ),
    *[
        (
            f"peak={value}",
            (
                f"memory_budget(peak={shown}): a byte size must be an int or a string like "
                f"'512 MiB', got {shown}"
            ),
        )
        for value, shown in (
            ("True", "True"),
            ('float("nan")', "nan"),
            ('float("inf")', "inf"),
            ("1.5", "1.5"),
            ("[1024]", "[1024]"),
        )
    ],
    *[
        (
            f"rtol={value}",
            (
                f"memory_budget(rtol={shown}): a relative tolerance must be a number such as 0.02, "
                f"got {shown}"
            ),
        )
        for value, shown in (
            ('float("nan")', "nan"),
            ('float("inf")', "inf"),
            ("True", "True"),
            ("[0.1]", "[0.1]"),
        )
    ],
    ("rtol=-0.1", "memory_budget(rtol=-0.1): a relative tolerance cannot be negative, got -0.1"),
    ("atol=-1", "memory_budget(atol=-1): a byte size cannot be negative, got -1"),
    ('atol="5 GB/s"', f"memory_budget(atol='5 GB/s'): unknown unit 'GB/s' in '5 GB/s'; {UNITS}"),
    (
        "devices=5",
        (
            "memory_budget(devices=5): devices must be a name or a tuple of names such as "
            "('cpu',), got 5"
        ),
    ),
    (
        'devices=("cpu", None)',
        (
            "memory_budget(devices=('cpu', None)): devices must be a name or a tuple of names such "
            "as ('cpu',), got ('cpu', None)"
        ),
    ),
    ("devices=()", "memory_budget(devices=()): devices must name at least one device, got ()"),
    (
        'devices="cuda:1"',
        "memory_budget(devices='cuda:1'): device 'cuda:1' is not modelled; use one of: cpu, cuda",
    ),
    (
        'devices="tpu"',
        "memory_budget(devices='tpu'): device 'tpu' is not modelled; use one of: cpu, cuda",
    ),
    (
        "gpu=100",
        (
            "memory_budget(gpu=100): a GPU profile is a name such as 'A100' or a tm.GpuProfile, "
            f"got 100; known profiles: {', '.join(PROFILES)}"
        ),
    ),
    ('cpu="avx2:²"', f"memory_budget(cpu='avx2:²'): cannot read 'avx2:²' as a CPU profile; {CPU_FIX}"),
    (
        'gpu="Z9"',
        f"memory_budget(gpu='Z9'): unknown GPU profile 'Z9'; known profiles: {', '.join(PROFILES)}; {GPU_FIX}",
    ),
    (
        'gpu=""',
        f"memory_budget(gpu=''): unknown GPU profile ''; known profiles: {', '.join(PROFILES)}; {GPU_FIX}",
    ),
]


def test_every_malformed_marker_value_is_a_collection_error_naming_test_and_value(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard: each bad marker value fails its module's collection, named, with the fix."""
    for index, (marker, _) in enumerate(MARKERS):
        pytester.makepyfile(
            **{
                f"test_k{index}": f"{HEADER}@pytest.mark.memory_budget({marker}){LINEAR.format(out=4)}"
            }
        )
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.assert_outcomes(errors=len(MARKERS))
    for index, (_, message) in enumerate(MARKERS):
        result.stdout.fnmatch_lines(
            [
                f"*ERROR collecting test_k{index}.py*",
                esc(f"test_k{index}.py::test_linear: {message}"),
            ]
        )
    no_internal_error(result)
    assert not snapshot_dir(pytester).exists()


# -- options and their ini twins -------------------------------------------------------------

OPTIONS: list[tuple[str, str, str]] = [
    ("atol", "5 GB/s", f"unknown unit 'GB/s' in '5 GB/s'; {UNITS}"),
    ("atol", "1.5 XiB", f"unknown unit 'XiB' in '1.5 XiB'; {UNITS}"),
    ("atol", "-1", "cannot read '-1' as a byte size: it cannot be negative"),
    ("atol", "nan", "cannot read 'nan' as a byte size; write e.g. '1.5 GiB', '512 MB' or '4096'"),
    ("rtol", "nan", "a relative tolerance must be a number such as 0.02, got nan"),
    ("rtol", "inf", "a relative tolerance must be a number such as 0.02, got inf"),
    ("rtol", "-0.5", "a relative tolerance cannot be negative, got -0.5"),
    ("rtol", "2%", "cannot read '2%' as a relative tolerance; write e.g. 0.02"),
    ("measure-rtol", "-1", "a relative tolerance cannot be negative, got -1.0"),
    ("measure-rtol", "nan", "a relative tolerance must be a number such as 0.02, got nan"),
    ("devices", "cpu,tpu", "device 'tpu' is not modelled; use one of: cpu, cuda"),
    ("devices", ",", "devices must name at least one device, got ','"),
    ("gpu", "H1000", f"unknown GPU profile 'H1000'; known profiles: {', '.join(PROFILES)}; {GPU_FIX}"),
    # a digit that is no decimal digit ('²'.isdigit() is True, int('²') raises): it was
    # an INTERNALERROR
    ("cpu", "avx2:²", f"cannot read 'avx2:²' as a CPU profile; {CPU_FIX}"),
]


@pytest.mark.parametrize(("name", "value", "message"), OPTIONS)
def test_bad_option_and_ini_values_are_usage_errors_naming_the_value(
    pytester: pytest.Pytester, name: str, value: str, message: str
) -> None:
    """Regression guard: the option and its ini twin refuse the same bad value alike."""
    pytester.makepyfile(test_m=HEADER + LINEAR.format(out=4))
    result = pytester.runpytest(f"--torchmem-{name}={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([esc(f"ERROR: --torchmem-{name}: {message}")])
    no_internal_error(result)
    ini = "torchmem_" + name.replace("-", "_")
    pytester.makeini(f"[pytest]\n{ini} = {value}\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([esc(f"ERROR: ini option {ini}: {message}")])
    no_internal_error(result)


@pytest.mark.parametrize(("ini", "value"), [("update", "maybe"), ("fail_on_improvement", "2")])
def test_a_bool_ini_option_that_is_not_a_bool_names_the_option(
    pytester: pytest.Pytester, ini: str, value: str
) -> None:
    pytester.makeini(f"[pytest]\ntorchmem_{ini} = {value}\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: ini option torchmem_{ini}: invalid truth value '{value}'; write true or false"]
    )
    no_internal_error(result)


# -- snapshot files that are not snapshots ------------------------------------------------------


def good_text() -> str:
    """A valid snapshot file of a module with one test, ``test_linear``, on cpu."""
    entry = {
        "forward_peak": 244,
        "backward_peak": 376,
        "step_peak": 0,
        "peak": 376,
        "breakdown": {"parameters": 144, "inputs": 64},
        "modules": {"(model)": {"forward": 244, "backward": 376}},
        "environment": {"torch": "0"},
    }
    document = {"schema": 1, "tests": {"test_linear": {"default": {"cpu": entry}}}}
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def edited(change: Callable[[dict[str, Any]], None]) -> Callable[[str], bytes]:
    def corrupt(text: str) -> bytes:
        data = json.loads(text)
        change(data)
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()

    return corrupt


def entry_of(data: dict[str, Any]) -> dict[str, Any]:
    return data["tests"]["test_linear"]["default"]["cpu"]


def position(text: str, index: int) -> str:
    """``:line:column`` of ``text[index]``, counted from 1."""
    line = text.count("\n", 0, index) + 1
    return f":{line}:{index - (text.rfind(chr(10), 0, index) + 1) + 1}"


def _invalid_json() -> tuple[Callable[[str], bytes], str]:
    text = good_text().replace('"backward_peak": 376,', '"backward_peak": 376,,')
    at = position(text, text.index(",,") + 1)  # the second comma: a member name was expected
    line, column = at[1:].split(":")
    reason = (
        "it is not valid JSON: Expecting property name enclosed in double quotes "
        f"at line {line}, column {column}"
    )
    return lambda _: text.encode(), f"{at}: {esc(reason)}"


def _not_utf8() -> tuple[Callable[[str], bytes], str]:
    text = good_text()
    index = text.index('"default"') + 2  # the "e" of "default", written in Latin-1
    at = position(text, index)
    line, column = at[1:].split(":")
    reason = f"it is not UTF-8 text (byte 0xe9 at line {line}, column {column})"
    return lambda t: t.encode().replace(b'"default"', b'"d\xe9fault"'), f"{at}: {esc(reason)}"


def _conflict(text: str) -> bytes:
    lines = text.splitlines(keepends=True)
    return (
        "".join(lines[:2]) + "<<<<<<< HEAD\n" + "".join(lines[2:]) + "=======\n>>>>>>> b\n"
    ).encode()


def _move_to_tpu(data: dict[str, Any]) -> None:
    data["tests"]["test_linear"]["default"]["tpu"] = data["tests"]["test_linear"]["default"].pop(
        "cpu"
    )


MALFORMED = '"test_linear" > "default" > "cpu"'
#: id -> (make the file's bytes from a good file's text, fnmatch pattern of ":line:col: reason")
CORRUPTIONS: dict[str, tuple[Callable[[str], bytes], str]] = {
    "invalid JSON": _invalid_json(),
    "truncated": (
        lambda t: t[: len(t) // 2].encode(),
        ":*:*: it is not valid JSON: * (the file is cut short)",
    ),
    "empty": (lambda _: b"", ": it is empty"),
    "git conflict": (_conflict, ":3:1: it holds git conflict markers"),
    "not UTF-8": _not_utf8(),
    "duplicate key": (
        lambda _: b'{"schema": 1, "tests": {"test_linear": {}, "test_linear": {}}}\n',
        ": it is not valid JSON: the key 'test_linear' appears twice in one object (a bad merge?)",
    ),
    "JSON list": (lambda _: b"[]\n", ": it does not hold a JSON object (it holds a list)"),
    "no schema": (
        edited(lambda d: d.pop("schema")),
        ': it has no valid schema version ("schema": None)',
    ),
    "tests not an object": (
        edited(lambda d: d.update(tests=[])),
        esc(': "tests" must be a JSON object, got []'),
    ),
    "string for bytes": (
        edited(lambda d: entry_of(d).update(forward_peak="a lot")),
        (
            f": it has a malformed entry {MALFORMED}: forward_peak must be a whole number of bytes "
            "(an integer >= 0), got 'a lot'"
        ),
    ),
    "number as a string": (
        edited(lambda d: entry_of(d).update(backward_peak="376")),
        (
            f": it has a malformed entry {MALFORMED}: backward_peak must be a whole number of bytes "
            "(an integer >= 0), got '376'"
        ),
    ),
    "fraction of a byte": (
        edited(lambda d: entry_of(d).update(step_peak=0.5)),
        (
            f": it has a malformed entry {MALFORMED}: step_peak must be a whole number of bytes "
            "(an integer >= 0), got 0.5"
        ),
    ),
    "negative category": (
        edited(lambda d: entry_of(d)["breakdown"].update(parameters=-144)),
        f": it has a malformed entry {MALFORMED}: "
        + esc(
            "breakdown['parameters'] must be a whole number of bytes (an integer >= 0), got -144"
        ),
    ),
    "missing field": (
        edited(lambda d: entry_of(d).pop("forward_peak")),
        f": it has a malformed entry {MALFORMED}: the field 'forward_peak' is missing",
    ),
    "peak edited by hand": (
        edited(lambda d: entry_of(d).update(peak=1000)),
        (
            f": it has a malformed entry {MALFORMED}: peak is 1000, not the largest of forward_peak, "
            "backward_peak and step_peak (376): was it edited by hand?"
        ),
    ),
    "unknown device": (
        edited(_move_to_tpu),
        (
            ': it has an entry "test_linear" > "default" > "tpu" for the unknown device '
            "'tpu' (known: cpu, cuda)"
        ),
    ),
}


def test_a_file_that_is_not_a_snapshot_fails_naming_it_and_only_update_replaces_it(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard: corrupt, truncated, hand-edited files fail clearly and are kept, until updated."""
    assert SnapshotFile.parse(Path("x.json"), good_text()).keys()  # the uncorrupted file reads
    cpu_only(pytester)
    snapshot_dir(pytester).mkdir()
    files: dict[str, tuple[Path, bytes, str]] = {}
    for index, (kind, (corrupt, reason)) in enumerate(CORRUPTIONS.items()):
        module = f"test_c{index}"
        pytester.makepyfile(**{module: HEADER + LINEAR.format(out=4)})
        path = snapshot_dir(pytester) / f"{module}.json"
        path.write_bytes(corrupt(good_text()))
        files[kind] = (path, path.read_bytes(), reason)

    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=len(CORRUPTIONS))
    for kind, (path, before, reason) in files.items():
        result.stdout.fnmatch_lines(
            [f"cannot read snapshot file */__torchmem__/{path.name}{reason}; {FIX}"]
        )
        assert path.read_bytes() == before, f"{kind}: the file was changed by a compare run"
    no_internal_error(result)

    result = pytester.runpytest("--torchmem-update")
    assert result.ret == 0
    result.assert_outcomes(passed=len(CORRUPTIONS))
    for kind, (path, _, reason) in files.items():
        if "malformed entry" in reason or "unknown device" in reason:
            # The file is a snapshot with one bad entry, of the test that ran: rewritten as any.
            result.stdout.fnmatch_lines([f"wrote __torchmem__/{path.name}"])
        else:
            result.stdout.fnmatch_lines(
                [f"wrote __torchmem__/{path.name} (replacing a file that was not a snapshot: *)"]
            )
        assert SnapshotFile.load(path).keys() == [Key("test_linear", "default", "cpu")], kind
    assert sorted(p.name for p in snapshot_dir(pytester).iterdir()) == sorted(
        path.name for path, _, _ in files.values()
    )
    no_internal_error(result)
    assert pytester.runpytest().ret == 0


def test_a_newer_schema_is_never_overwritten(pytester: pytest.Pytester) -> None:
    """Regression guard: an older pytest-torchmem refuses to downgrade a newer snapshot file."""
    cpu_only(pytester)
    pytester.makepyfile(test_m=HEADER + LINEAR.format(out=4))
    path = snapshot_dir(pytester) / "test_m.json"
    path.parent.mkdir()
    newer = FILE_SCHEMA + 1
    path.write_bytes(edited(lambda d: d.update(schema=newer))(good_text()))
    before = path.read_bytes()
    for args in ([], ["--torchmem-update"]):
        result = pytester.runpytest(*args)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(
            [
                (
                    f"snapshot file */__torchmem__/test_m.json has schema {newer}: it was written by a "
                    f"newer pytest-torchmem (this version reads and writes schema {FILE_SCHEMA}); upgrade "
                    "pytest-torchmem to use it (--torchmem-update does not overwrite it with an older "
                    "schema)"
                )
            ]
        )
        assert path.read_bytes() == before
        no_internal_error(result)


def test_snapshot_device_keys_are_the_modelled_devices() -> None:
    assert set(DEVICE_KEYS) == set(DEVICES)


# -- writes that fail, are interrupted, or crash ---------------------------------------------------

FAULT_CONFTEST = """
import errno
import os

import pytest


def _fault(real, *args, **kwargs):
{body}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session):
    # Only while the plugin writes at the end of this run, and only for snapshot files.
    real = os.{function}

    def patched(*args, **kwargs):
        if any("__torchmem__" in str(arg) for arg in args[:2]):
            return _fault(real, *args, **kwargs)
        return real(*args, **kwargs)

    os.{function} = patched
    try:
        return (yield)
    finally:
        os.{function} = real
"""


def fault_conftest(pytester: pytest.Pytester, function: str, body: str) -> None:
    pytester.makeconftest(FAULT_CONFTEST.format(function=function, body=body))


def previous_snapshot(
    pytester: pytest.Pytester, modules: tuple[str, ...] = ("test_m",)
) -> dict[Path, bytes]:
    """Record snapshots of Linear(8, 4), then change the model: an update would rewrite them."""
    cpu_only(pytester)
    for module in modules:
        pytester.makepyfile(**{module: HEADER + LINEAR.format(out=4)})
    assert pytester.runpytest("--torchmem-update").ret == 0
    for module in modules:
        pytester.makepyfile(**{module: HEADER + LINEAR.format(out=6)})
    return {path: path.read_bytes() for path in snapshot_dir(pytester).iterdir()}


@pytest.mark.parametrize(
    ("function", "body", "message"),
    [
        pytest.param(
            "open",
            # What a read-only directory does to the temporary file the write starts with.
            "    if args[1] & os.O_CREAT:\n"
            "        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), args[0])\n"
            "    return real(*args, **kwargs)\n",
            "could not write __torchmem__/test_m.json: Permission denied: "
            "*/__torchmem__/.test_m.json.*.tmp; the file on disk is unchanged "
            "(make __torchmem__ writable, then rerun with --torchmem-update)",
            id="read-only directory",
        ),
        pytest.param(
            "replace",
            "    raise OSError(errno.EROFS, os.strerror(errno.EROFS), args[0], args[1])\n",
            "could not write __torchmem__/test_m.json: Read-only file system: "
            "*/__torchmem__/.test_m.json.*.tmp; the file on disk is unchanged "
            "(make __torchmem__ writable, then rerun with --torchmem-update)",
            id="read-only file system",
        ),
        pytest.param(
            "access",
            "    return False\n",
            "could not write __torchmem__/test_m.json: snapshot file */__torchmem__/test_m.json "
            "is read-only; make it writable to update it",
            id="read-only file",
        ),
    ],
)
def test_an_update_that_cannot_write_says_where_and_keeps_the_file(
    pytester: pytest.Pytester, function: str, body: str, message: str
) -> None:
    """Regression guard: a failed write is a clear error naming the path, never an INTERNALERROR."""
    before = previous_snapshot(pytester)
    fault_conftest(pytester, function, body)
    result = pytester.runpytest("--torchmem-update")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"torchmem: {message}"])
    assert {path: path.read_bytes() for path in snapshot_dir(pytester).iterdir()} == before
    no_internal_error(result)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="root writes into read-only directories and files: the fault-injected test covers it",
)
@pytest.mark.parametrize("what", ["directory", "file"])
def test_an_update_into_a_read_only_directory_or_file(pytester: pytest.Pytester, what: str) -> None:
    """The real thing, where permissions apply: chmod the snapshot directory or file read-only."""
    before = previous_snapshot(pytester)
    target = snapshot_dir(pytester) / ("test_m.json" if what == "file" else "")
    mode = target.stat().st_mode
    target.chmod(0o555 if what == "directory" else 0o444)
    try:
        result = pytester.runpytest("--torchmem-update")
    finally:
        target.chmod(mode)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    expected = (
        "Permission denied: */__torchmem__/.test_m.json.*.tmp; the file on disk is unchanged *"
        if what == "directory"
        else "snapshot file */__torchmem__/test_m.json is read-only; make it writable to update it"
    )
    result.stdout.fnmatch_lines([f"torchmem: could not write __torchmem__/test_m.json: {expected}"])
    assert {path: path.read_bytes() for path in snapshot_dir(pytester).iterdir()} == before
    no_internal_error(result)


def test_ctrl_c_while_writing_leaves_every_file_whole_and_no_temporary(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard: KeyboardInterrupt between the temporary file and the rename loses nothing."""
    before = previous_snapshot(pytester, ("test_a", "test_b"))
    fault_conftest(pytester, "replace", "    raise KeyboardInterrupt\n")
    result = pytester.runpytest("--torchmem-update")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            (
                "torchmem: interrupted while writing snapshot files; left as they were: "
                "__torchmem__/test_a.json, __torchmem__/test_b.json; rerun with --torchmem-update"
            )
        ]
    )
    assert {path: path.read_bytes() for path in snapshot_dir(pytester).iterdir()} == before
    no_internal_error(result)


def test_a_crash_while_writing_leaves_the_file_whole_and_the_leftover_is_cleaned(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard: a process killed mid-write keeps the old file; its temporary file harms nothing."""
    before = previous_snapshot(pytester)
    fault_conftest(pytester, "replace", "    os._exit(3)  # the temporary file is complete\n")
    result = pytester.runpytest_subprocess("--torchmem-update")
    assert result.ret == 3
    path = snapshot_dir(pytester) / "test_m.json"
    leftovers = [p for p in snapshot_dir(pytester).iterdir() if p != path]
    assert [p.name.startswith(".test_m.json.") and p.suffix == ".tmp" for p in leftovers] == [True]
    assert path.read_bytes() == before[path]

    # The next run compares with the previous file, and ignores the leftover.
    (pytester.path / "conftest.py").unlink()
    pytester.makepyfile(test_m=HEADER + LINEAR.format(out=4))
    result = pytester.runpytest()
    assert result.ret == 0
    result.stdout.fnmatch_lines(["torchmem: 1 check: 1 passed, *, 0 unused"])
    # The next update of the file removes it.
    assert pytester.runpytest("--torchmem-update").ret == 0
    assert list(snapshot_dir(pytester).iterdir()) == [path]
    assert path.read_bytes() == before[path]


WAIT_FOR_SIGINT = """
def test_waits_for_sigint():
    import pathlib, signal, time

    # Ctrl-C as Python's own handler raises it, but only while this loop runs and has not
    # been interrupted yet; "interrupted" tells the parent to stop sending SIGINT (one
    # that came after the interpreter began to shut down would kill it). A KeyboardInterrupt
    # lost on its way (one that lands in a finalizer is swallowed) leaves the loop running:
    # it takes the file away, and the parent signals again.
    armed = []
    interrupted = pathlib.Path("interrupted")

    def interrupt(signum, frame):
        if armed:
            armed.clear()
            interrupted.write_text("")
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    pathlib.Path("started").write_text("")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if not armed:
            interrupted.unlink(missing_ok=True)
            armed.append(True)
        time.sleep(0.05)
    raise AssertionError("no SIGINT came")
"""

#: The bound of each wait: generous, for a loaded machine (each wait ends as soon as it can).
PATIENCE = 300.0


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_during_an_update_run_writes_nothing(pytester: pytest.Pytester) -> None:
    """Regression guard: Ctrl-C in the middle of `pytest --torchmem-update` leaves the files as they were.

    Robust on a loaded machine (issue 27, 12: once, the one SIGINT sent was not acted
    on and the child ran its whole loop): the child says when it is inside the test
    (test_linear has checked by then), SIGINT is sent again, at growing intervals, until
    the child says it raised KeyboardInterrupt, and the run's end is awaited; the output
    goes to a file, so a full pipe never stalls the child.
    """
    before = previous_snapshot(pytester)
    pytester.makepyfile(test_m=HEADER + LINEAR.format(out=6) + WAIT_FOR_SIGINT)
    log = pytester.path / "run.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "--torchmem-update"],
            cwd=pytester.path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + PATIENCE
        while not (pytester.path / "started").exists():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the run did not start:\n" + log.read_text()
            time.sleep(0.05)
        interval, deadline = 1.0, time.monotonic() + PATIENCE
        while process.poll() is None:
            if not (pytester.path / "interrupted").exists():
                process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=interval)
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "the run did not stop:\n" + log.read_text()
                interval = min(2 * interval, 30.0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert process.returncode == pytest.ExitCode.INTERRUPTED, text
    assert "KeyboardInterrupt" in text
    assert "no SIGINT came" not in text
    assert (
        "torchmem: the run was interrupted: no snapshot file was written; "
        "rerun with --torchmem-update"
    ) in text
    assert "not written (interrupted)" in text
    assert "INTERNALERROR" not in text
    assert {path: path.read_bytes() for path in snapshot_dir(pytester).iterdir()} == before


# -- the user's code raising inside a check ---------------------------------------------------------

RAISING = """
import pytest
import torch
from torch import nn


def fail(where):
    raise ValueError(f"{where} failed on purpose")


class Net(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros(3))
        self.where = where

    def forward(self, x):
        y = self.fc(x)
        if self.where == "forward":
            fail("forward")
        if self.where == "backward":
            y.register_hook(lambda grad: fail("backward"))
        return y


def snapshot(model):
    return {
        name: (tensor, tensor.detach().clone(), tensor.requires_grad)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }


@pytest.mark.parametrize(
    "device", [pytest.param(d, marks=pytest.mark.memory_budget(devices=d)) for d in ("cpu", "cuda")]
)
@pytest.mark.parametrize("where", ["forward", "loss_fn", "backward", "optimizer"])
def test_raises(torchmem, where, device):
    model = Net(where)
    model.eval()  # not the default: the check must leave it so
    grad = torch.full_like(model.fc.weight, 7.0)
    model.fc.weight.grad = grad
    before = snapshot(model)
    try:
        torchmem.check(
            model,
            torch.randn(2, 8),
            loss_fn=(lambda out: fail("loss_fn")) if where == "loss_fn" else None,
            optimizer=(lambda params: fail("optimizer")) if where == "optimizer" else None,
        )
    finally:
        after = dict([*model.named_parameters(), *model.named_buffers()])
        assert after.keys() == before.keys()
        for name, (tensor, value, requires_grad) in before.items():
            assert after[name] is tensor and type(tensor) in (torch.Tensor, nn.Parameter)
            assert tensor.device.type == "cpu" and torch.equal(tensor, value)
            assert tensor.requires_grad == requires_grad
        assert model.fc.weight.grad is grad and torch.equal(grad, torch.full_like(grad, 7.0))
        assert model.fc.bias.grad is None
        assert not model.training
        assert type(model.fc(torch.randn(2, 8))) is torch.Tensor  # no fake mode or hook left


def test_after(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
"""


def test_an_exception_in_the_users_code_is_theirs_and_the_model_is_put_back(
    pytester: pytest.Pytester,
) -> None:
    """Regression guard: forward, loss_fn, backward or optimizer raising: the user's error, the model as it was."""
    pytester.makepyfile(test_m=RAISING)
    result = pytester.runpytest("--torchmem-update")
    result.assert_outcomes(failed=8, passed=1)  # and the run went on to test_after
    source = (pytester.path / "test_m.py").read_text().splitlines()
    raise_line = source.index('    raise ValueError(f"{where} failed on purpose")') + 1
    for where in ("forward", "loss_fn", "backward", "optimizer"):
        for device in ("cpu", "cuda"):
            result.stdout.fnmatch_lines(
                [
                    f"*_ test_raises[[]{where}-{device}[]] _*",
                    f"E * ValueError: {where} failed on purpose",
                    f"test_m.py:{raise_line}: ValueError",
                ]
            )
    assert "AssertionError" not in result.stdout.str()  # the model checks in `finally` held
    no_internal_error(result)


BAD_ARGUMENTS = """
import pytest
import torch
from torch import nn

x = torch.randn(2, 8)

def test_loss_not_scalar(torchmem):
    torchmem.check(nn.Linear(8, 4), x, loss_fn=lambda out: out)

def test_loss_not_a_tensor(torchmem):
    torchmem.check(nn.Linear(8, 4), x, loss_fn=lambda out: 1.0)

def test_optimizer_factory_returns_a_string(torchmem):
    torchmem.check(nn.Linear(8, 4), x, optimizer=lambda params: "sgd")

def test_optimizer_instead_of_a_factory(torchmem):
    model = nn.Linear(8, 4)
    torchmem.check(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

def test_inputs_list(torchmem):
    torchmem.check(nn.Linear(8, 4), [x])

def test_inputs_array(torchmem):
    torchmem.check(nn.Linear(8, 4), x.numpy())

def test_inputs_dict_with_int_keys(torchmem):
    torchmem.check(nn.Linear(8, 4), {0: x})

def test_model_a_number(torchmem):
    torchmem.check(3, x)

def test_train_a_string(torchmem):
    torchmem.check(nn.Linear(8, 4), x, train="no")

def test_name_a_number(torchmem):
    torchmem.check(nn.Linear(8, 4), x, name=3)

def test_after(torchmem):
    torchmem.check(nn.Linear(8, 4), x)
"""


def test_bad_arguments_to_check_fail_that_test_with_the_fix(pytester: pytest.Pytester) -> None:
    cpu_only(pytester)
    pytester.makepyfile(test_m=BAD_ARGUMENTS)
    result = pytester.runpytest("--torchmem-update")
    result.assert_outcomes(failed=10, passed=1)
    for message in (
        (
            "ValueError: loss_fn must return a scalar tensor, got one of shape (2, 4); "
            "reduce it, e.g. with .sum() or .mean()"
        ),
        "TypeError: loss_fn must return a scalar tensor, got float",
        (
            "TypeError: optimizer must be a callable that takes the parameters and returns a "
            "torch.optim.Optimizer, got str back; "
            "e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        ),
        (
            "TypeError: optimizer must be a factory that makes the optimizer from the parameters it "
            "is given, not a SGD; e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
        ),
        (
            "TypeError: inputs must be a tensor, a tuple of positional arguments or a mapping (a "
            "dict, a BatchEncoding) of keyword arguments, got list; pass a tuple for positional arguments"
        ),
        (
            "TypeError: inputs must be a tensor, a tuple of positional arguments or a mapping (a "
            "dict, a BatchEncoding) of keyword arguments, got ndarray"
        ),
        "TypeError: keyword inputs need string keys, got 0",
        "TypeError: torchmem.check() needs an nn.Module or a step function as model, got int",
        "TypeError: train must be True or False, got 'no'",
        "TypeError: torchmem.check(name=...) must be a non-empty string, got 3",
    ):
        result.stdout.fnmatch_lines([f"E * {esc(message)}"])
    no_internal_error(result)
