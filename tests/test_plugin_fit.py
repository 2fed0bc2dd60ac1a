"""What fits, in pytest (issue 26): the headroom of every cuda check, the marker's
``fits=``, ``--torchmem-advise`` and ``torchmem.fit``. Real pytest runs (pytester), real
snapshot files and reports, real exit codes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.figures.gpu_profiles import usable_memory
from pytest_torchmem.engine.figures.gpu_profiles import PROFILES

pytest_plugins = ("pytester",)

_MiB = 1 << 20
_GiB = 1 << 30

#: Inference of a 16 GiB weight on one row: its reserved peak by hand (tests/test_fit.py):
#: the weight's segment, a 2 MiB small-pool segment, the cuBLAS workspace's segment (32 MiB
#: on an H100, 20 MiB on a T4 or an A100).
BIG = """
import pytest
import torch
from torch import nn


def big():
    with torch.device("meta"):
        return nn.Linear(65536, 65536, bias=False)


@pytest.mark.memory_budget(devices=("cuda",){marker})
def test_big(torchmem):
    torchmem.check(big(), torch.randn(1, 65536, device="meta"), train=False)
"""
RESERVED = {"H100": 16 * _GiB + 2 * _MiB + 32 * _MiB, "T4": 16 * _GiB + 2 * _MiB + 20 * _MiB}
RESERVED["A100-40GB"] = RESERVED["T4"]


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    # pytester's in-process runs forget the modules imported inside them: import them once.
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2), device="cuda")


def _run(pytester: pytest.Pytester, *args: str) -> Any:
    return pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", *args)


def _headroom(gpu: str) -> int:
    return usable_memory(PROFILES[gpu]) - RESERVED[gpu]


def test_every_cuda_check_shows_its_headroom(pytester: pytest.Pytester) -> None:
    """The table's headroom column and the JSON report's rooms: the GPU's usable memory
    less the check's reserved peak, on the GPU the check follows."""
    pytester.makepyfile(test_m=BIG.format(marker=""))
    assert _run(pytester, "--torchmem-update").ret == pytest.ExitCode.OK
    result = _run(pytester, "--torchmem-json", "report.json")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*reserved*headroom*change*status*", f"*test_big*cuda*{tm.format_bytes(_headroom('H100'))}*passed*"])
    (checked,) = json.loads((pytester.path / "report.json").read_text())["results"]
    assert checked["rooms"] == [
        {
            "gpu": "H100",
            "usable": usable_memory(PROFILES["H100"]),
            "reserved": RESERVED["H100"],
            "headroom": _headroom("H100"),
            "fits": True,
            "required": False,
        }
    ]


def test_fits_fails_a_step_that_a_named_gpu_cannot_hold(pytester: pytest.Pytester) -> None:
    """fits=["A100-40GB", "T4"]: each GPU estimated on its own; the T4 cannot hold 16 GiB of
    weight, and the test fails naming it, even under --torchmem-update; without the T4 it
    passes."""
    pytester.makepyfile(test_m=BIG.format(marker=', fits=["A100-40GB", "T4"]'))
    result = _run(pytester, "--torchmem-update", "--torchmem-json", "report.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    over = -_headroom("T4")
    result.stdout.fnmatch_lines(
        [
            f"*cuda step does not fit T4: reserved peak {tm.format_bytes(RESERVED['T4'])}, usable "
            f"{tm.format_bytes(usable_memory(PROFILES['T4']))}*: {tm.format_bytes(over)} over (memory_budget(fits=...))",
            "*a GPU named by fits= must hold the step*",
        ]
    )
    (checked,) = json.loads((pytester.path / "report.json").read_text())["results"]
    assert [(room["gpu"], room["reserved"], room["fits"], room["required"]) for room in checked["rooms"]] == [
        ("H100", RESERVED["H100"], True, False),
        ("A100-40GB", RESERVED["A100-40GB"], True, True),
        ("T4", RESERVED["T4"], False, True),
    ]
    pytester.makepyfile(test_m=BIG.format(marker=', fits=["A100-40GB"], gpu="A100-40GB"'))
    assert _run(pytester, "--torchmem-update").ret == pytest.ExitCode.OK
    assert _run(pytester).ret == pytest.ExitCode.OK


def test_fits_true_is_the_checks_own_gpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_m=BIG.format(marker=', fits=True, gpu="T4"'))
    result = _run(pytester, "--torchmem-update")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*cuda step does not fit T4*"])


@pytest.mark.parametrize(
    ("value", "message"),
    [("'GTX9999'", "unknown GPU profile 'GTX9999'"), ("[]", "fits= names at least one GPU"), ("3", "a GPU profile is a name")],
)
def test_a_bad_fits_is_a_usage_error(pytester: pytest.Pytester, value: str, message: str) -> None:
    pytester.makepyfile(test_m=BIG.format(marker=f", fits={value}"))
    result = _run(pytester)
    assert result.ret != pytest.ExitCode.OK
    assert message in result.stdout.str() + result.stderr.str()


TOWER = """
import pytest
import torch
from torch import nn


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.memory_budget(peak={budget}, devices=("cpu",))
def test_tower(torchmem):
    torch.manual_seed(0)
    torchmem.check(Tower(), torch.randn(256, 64), optimizer=lambda p: torch.optim.AdamW(p))
"""


def test_advise_adds_what_would_fit_to_the_failure(pytester: pytest.Pytester) -> None:
    """--torchmem-advise (and its ini twin): the failure of a check over its budget lists
    the changes that bring it down, each with tm.advise's figure of the changed step."""
    from pytest_torchmem.engine.fit.advice import advise

    namespace: dict[str, Any] = {}
    exec(TOWER.format(budget="1"), namespace)  # noqa: S102 - the test's own module text
    torch.manual_seed(0)
    model, x = namespace["Tower"](), torch.randn(256, 64)
    adamw = lambda p: torch.optim.AdamW(p)  # noqa: E731
    budget = tm.estimate(model, x, optimizer=adamw, cpu="avx2:4").peak * 3 // 4
    advice = advise(model, x, budget=budget, device="cpu", optimizer=adamw, cpu="avx2:4")
    assert advice.suggestions
    pytester.makepyfile(test_m=TOWER.format(budget=budget))
    result = _run(pytester, "--torchmem-update", "--torchmem-advise")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [f"*what would bring it within budget {tm.format_bytes(budget)} (--torchmem-advise*"]
        + [f"*  {suggestion}" for suggestion in advice.suggestions]
    )
    pytester.makeini("[pytest]\ntorchmem_advise = true\n")
    assert "what would bring it within" in _run(pytester, "--torchmem-update").stdout.str()
    pytester.makeini("[pytest]\n")
    assert "what would bring it within" not in _run(pytester, "--torchmem-update").stdout.str()


FIT = """
import torch
from torch import nn


def make():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4096, 16384), nn.GELU(), nn.Linear(16384, 4096))


def test_batch(torchmem):
    found = torchmem.fit(make(), lambda b: torch.randn(b, 4096, device="meta"), gpu="T4",
                         size_name="batch", sizes=range(1, 100001), at_least={at_least})
    assert found.size is not None
"""


def _fit_on_t4() -> Any:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 16384), nn.GELU(), nn.Linear(16384, 4096))
    return tm.fit(model, lambda b: torch.randn(b, 4096, device="meta"), gpu="T4", size_name="batch", sizes=range(1, 100001))


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_torchmem_fit_reports_and_gates_the_largest_size(pytester: pytest.Pytester, workers: list[str]) -> None:
    """torchmem.fit: tm.fit's answer in the summary and the JSON report; below at_least the
    test fails naming the size; a progress line per estimate (one process)."""
    found = _fit_on_t4()
    assert found.size is not None and found.next_size == found.size + 1
    pytester.makepyfile(test_m=FIT.format(at_least=found.size))
    result = _run(pytester, "--torchmem-json", "report.json", *workers)
    assert result.ret == pytest.ExitCode.OK
    line = f"*fit: test_m.py::test_batch: batch {found.size} fits T4: *; batch {found.next_size} needs *; at least {found.size}: passed"
    result.stdout.fnmatch_lines([line])
    if not workers:
        result.stdout.fnmatch_lines([f"torchmem fit: batch {found.size}: *, fits"])
    (record,) = json.loads((pytester.path / "report.json").read_text())["fits"]
    assert (record["size"], record["nbytes"], record["next_nbytes"]) == (found.size, found.nbytes, found.next_nbytes)
    pytester.makepyfile(test_m=FIT.format(at_least=found.size + 1))
    result = _run(pytester, *workers)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*the largest batch that fits T4 is {found.size}, below at_least={found.size + 1}*"])
