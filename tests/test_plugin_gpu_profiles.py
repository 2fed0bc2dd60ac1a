"""GPU profiles of the user's own in pytest (issue 27, item 9): the ``torchmem_gpus`` ini
table, ``--torchmem-gpu`` / ``torchmem_gpu`` and the marker's ``gpu=`` naming them, the
snapshot entries that record their properties, the table that names them. Real pytest
runs (pytester), real snapshot files, real exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.figures.gpu_profiles import PROFILES

pytest_plugins = ("pytester",)

MODULE = """
import pytest
import torch
from torch import nn


def test_default(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))


@pytest.mark.memory_budget(gpu="rtx4070tis")
def test_mine(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))


@pytest.mark.memory_budget(gpu="L4")
def test_l4(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
"""

TABLE = """
[pytest]
torchmem_gpus =
    # the desktops of the team
    RTX4070TiS: memory=16 GiB cc=8.9 sms={sms}
    Workstation: memory=48GiB cc=8.6 sms=84 threads_per_sm=1536
"""

#: What an entry made with the RTX 4070 Ti SUPER of TABLE (sms=66) records of it: the
#: properties the line gives, and those that follow from compute capability 8.9.
RTX_ENVIRONMENT = {
    "gpu": "RTX4070TiS",
    "gpu_memory": "16GiB",
    "gpu_cc": "8.9",
    "gpu_sms": 66,
    "gpu_threads_per_sm": 1536,
    "gpu_shared_per_block": "99KiB",
}


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2), device="cuda")


@pytest.fixture(autouse=True)
def _quiet_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")


def stored(pytester: pytest.Pytester) -> dict[str, Any]:
    return json.loads((pytester.path / "__torchmem__" / "test_m.json").read_text())["tests"]


def cuda_entry(pytester: pytest.Pytester, test: str) -> dict[str, Any]:
    return stored(pytester)[test]["default"]["cuda"]  # type: ignore[no-any-return]


def test_a_gpu_of_the_ini_table_is_checked_recorded_and_named(pytester: pytest.Pytester) -> None:
    """The marker names a GPU of the ini table: the check follows it, its entry records its
    properties, the table names it; a compare run (also under xdist) passes."""
    pytester.makeini(TABLE.format(sms=66))
    pytester.makepyfile(test_m=MODULE)
    result = pytester.runpytest("--torchmem-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "torchmem: update, devices cpu,cuda, rtol 0, atol 0 B, gpu profile H100, cpu profile avx2:4",
            "test_m.py::test_default  cuda  * new",
            "test_m.py::test_l4       cuda (L4) * new",
            "test_m.py::test_mine     cuda (RTX4070TiS) * new",
        ]
    )
    mine, l4, h100 = (cuda_entry(pytester, test) for test in ("test_mine", "test_l4", "test_default"))
    assert {key: value for key, value in mine["environment"].items() if key != "torch"} == RTX_ENVIRONMENT
    assert set(l4["environment"]) == {"gpu", "torch"} and l4["environment"]["gpu"] == "L4"
    assert set(h100["environment"]) == {"gpu", "torch"} and h100["environment"]["gpu"] == "H100"
    # cuBLAS's workspace follows compute capability 8.9, as on the L4, not Hopper's 32 MiB
    assert mine["breakdown"] == l4["breakdown"]
    assert mine["breakdown"]["workspace"] < h100["breakdown"]["workspace"]
    for args in ((), ("-n", "2")):
        result = pytester.runpytest_subprocess(*args) if args else pytester.runpytest()
        assert result.ret == 0, result.stdout.str()
        result.stdout.fnmatch_lines(
            ["torchmem: 6 checks: 6 passed, 0 regressed, 0 improved, 0 missing, 0 unused"]
        )


def test_the_option_and_its_ini_twin_take_a_gpu_of_the_table(pytester: pytest.Pytester) -> None:
    """``--torchmem-gpu`` (any case) and ``torchmem_gpu`` name a GPU of the table for the
    run: the header gives its properties; the marker still wins."""
    pytester.makeini(TABLE.format(sms=66))
    pytester.makepyfile(test_m=MODULE)
    assert pytester.runpytest("--torchmem-update").ret == 0
    result = pytester.runpytest("--torchmem-gpu", "RTX4070TIS", "--torchmem-json", "report.json")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "torchmem: compare, devices cpu,cuda, rtol 0, atol 0 B, gpu profile RTX4070TiS "
            "(memory=16GiB cc=8.9 sms=66 threads_per_sm=1536 shared_per_block=99KiB), cpu profile avx2:4",
            "test_m.py::test_default  cuda  * gpu H100 -> RTX4070TiS  stale",
            "test_m.py::test_l4       cuda (L4) * passed",
            "test_m.py::test_mine     cuda  * passed",
        ]
    )
    settings = json.loads((pytester.path / "report.json").read_text())["settings"]
    assert settings["gpu_profile"] == "RTX4070TiS"
    assert settings["gpu_properties"] == "memory=16GiB cc=8.9 sms=66 threads_per_sm=1536 shared_per_block=99KiB"
    # the ini twin, and a profile written on the command line
    pytester.makeini(TABLE.format(sms=66) + "torchmem_gpu = workstation\n")
    result = pytester.runpytest()
    assert result.ret == 0
    result.stdout.fnmatch_lines(["torchmem: compare, * gpu profile Workstation (memory=48GiB cc=8.6 sms=84 *"])
    result = pytester.runpytest("--torchmem-gpu", "RTX4070TiS: memory=16GiB cc=8.9 sms=66", "-k", "mine")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["test_m.py::test_mine  cuda  * passed"])


def test_a_changed_profile_of_the_table_makes_its_entries_stale(pytester: pytest.Pytester) -> None:
    """Regression guard: an entry made with a profile whose properties changed since is not
    compared (its figures were made for another GPU): the change says which property moved."""
    pytester.makeini(TABLE.format(sms=66))
    pytester.makepyfile(test_m=MODULE)
    assert pytester.runpytest("--torchmem-update").ret == 0
    pytester.makeini(TABLE.format(sms=60))
    result = pytester.runpytest()
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "test_m.py::test_mine     cuda (RTX4070TiS) * gpu_sms 66 -> 60  stale",
            "stale: test_m.py::test_mine on cuda: snapshot environment differs (gpu_sms 66 -> 60); "
            're-record on this machine with: pytest --torchmem-update "test_m.py::test_mine"',
            "torchmem: 6 checks: 5 passed, 0 regressed, 0 improved, 0 missing, 0 unused, 1 stale",
        ]
    )
    assert pytester.runpytest("--torchmem-stale=fail").ret == pytest.ExitCode.TESTS_FAILED
    assert pytester.runpytest("--torchmem-update").ret == 0
    assert cuda_entry(pytester, "test_mine")["environment"]["gpu_sms"] == 60
    assert pytester.runpytest().ret == 0


def test_a_table_gpu_with_a_named_ones_properties_records_its_bytes(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        "[pytest]\ntorchmem_gpus =\n    OurH100: memory=80GiB cc=9.0 sms=132\n"
    )
    pytester.makepyfile(
        test_m="""
import pytest
import torch
from torch import nn

@pytest.mark.memory_budget(gpu="H100")
def test_named(torchmem):
    torchmem.check(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)), torch.randn(32, 64))

@pytest.mark.memory_budget(gpu="OurH100")
def test_ours(torchmem):
    torchmem.check(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)), torch.randn(32, 64))
"""
    )
    assert pytester.runpytest("--torchmem-update").ret == 0
    named, ours = cuda_entry(pytester, "test_named"), cuda_entry(pytester, "test_ours")
    assert ours.pop("environment")["gpu_sms"] == 132
    named.pop("environment")
    assert ours == named


BAD_TABLES: list[tuple[str, str]] = [
    ("G memory=16GiB", "cannot read 'G memory=16GiB' as a GPU profile: write NAME: memory=... cc=... sms=..., e.g. *"),
    ("G: memory=16GiB cc=8.9", "GPU profile 'G': missing sms=; a profile needs memory, cc and sms, e.g. *"),
    ("G: memory=16 cc=8.9 sms=66", "GPU profile 'G': memory: '16' is 16 bytes, less than any GPU has; write the unit, *"),
    ("G: memory=16GiB cc=six sms=66", "GPU profile 'G': cc: cannot read 'six' as a compute capability; write it as '8.9' or (8, 9) *"),
    ("G: memory=16GiB cc=6.1 sms=66", "GPU profile 'G': cc: compute capability 6.1 is not modelled; the rules follow NVIDIA GPUs of compute capability 7.0 (Volta) and newer"),
    ("G: memory=192GiB cc=gfx942 sms=304", "GPU profile 'G': cc: 'gfx942' is an AMD architecture: the fake cuda device models NVIDIA's CUDA kernels *"),
    ("G: memory=16GiB cc=8.9 sms=0", "GPU profile 'G': sms: the number of SMs must be a positive whole number *, got 0"),
    ("G: memory=16GiB cc=8.9 sms=66 threads_per_sm=100", "GPU profile 'G': threads_per_sm: 100 is not a multiple of the warp size, 32 *"),
    ("G: memory=16GiB cc=8.9 sms=66 shared_per_block=lots", "GPU profile 'G': shared_per_block: cannot read 'lots' as a byte size; *"),
    ("G: memory=16GiB cc=8.9 sms=66 l2=48MiB", "GPU profile 'G': unknown property 'l2'; a line takes memory, cc, sms, threads_per_sm, shared_per_block *"),
    ("A100: memory=80GiB cc=8.0 sms=108", "GPU profile 'A100': A100 is a named profile; give yours another name"),
]


@pytest.mark.parametrize(("line", "message"), BAD_TABLES, ids=[line for line, _ in BAD_TABLES])
def test_a_bad_line_of_the_table_is_a_usage_error_naming_it(
    pytester: pytest.Pytester, line: str, message: str
) -> None:
    pytester.makeini(f"[pytest]\ntorchmem_gpus =\n    {line}\n")
    pytester.makepyfile(test_m=MODULE)
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: ini option torchmem_gpus: {message}"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert not (pytester.path / "__torchmem__").exists()


def test_an_unknown_gpu_names_the_tables_gpus_and_the_fix(pytester: pytest.Pytester) -> None:
    pytester.makeini(TABLE.format(sms=66))
    pytester.makepyfile(test_m=MODULE.replace('gpu="rtx4070tis"', 'gpu="RTX4070"'))
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "test_m.py::test_mine: memory_budget(gpu='RTX4070'): unknown GPU profile 'RTX4070'; "
            f"known profiles: {', '.join(PROFILES)}, RTX4070TiS, Workstation; describe another in "
            "the ini option torchmem_gpus (NAME: memory=16GiB cc=8.9 sms=66), or use 'current' "
            "for this machine's GPU"
        ]
    )
    result = pytester.runpytest("--torchmem-gpu", "G: memory=16GiB cc=8.9")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --torchmem-gpu: GPU profile 'G': missing sms=; *"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_current_without_a_gpu_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m=MODULE)
    result = pytester.runpytest("--torchmem-gpu", "current")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --torchmem-gpu: 'current' is this machine's GPU, and torch.cuda.is_available() is False here; *"]
    )


def test_the_how_tos_table_is_read_as_written(pytester: pytest.Pytester) -> None:
    """The ``ini`` block of docs/howto/gpu-profiles.md, as the page shows it."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "howto" / "gpu-profiles.md").read_text()
    (ini,) = re.findall(r"^```ini\n(.*?)^```$", page, re.S | re.M)
    pytester.makeini(ini)
    pytester.makepyfile(test_m=MODULE.replace('gpu="rtx4070tis"', 'gpu="workstation"'))
    result = pytester.runpytest("--torchmem-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "torchmem: update, * gpu profile RTX4070TiS (memory=16GiB cc=8.9 sms=66 *), cpu profile avx2:4",
            "test_m.py::test_mine     cuda (Workstation) * new",
        ]
    )
    assert cuda_entry(pytester, "test_mine")["environment"]["gpu_sms"] == 84


def test_help_names_the_table(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*--torchmem-gpu=NAME*", "*torchmem_gpus (linelist):*"])
