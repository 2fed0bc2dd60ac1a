"""parallel= through the plugin: real pytest runs, real snapshot files.

``torchmem.check(parallel=tm.Parallel(...))`` records the memory of one rank;
the marker's ``mesh=`` and ``rank=`` take the place of the Parallel's own, so
one test checks the same parallelization at another scale; each mesh and rank
has an entry of its own (the check's name, then ``@ <mesh> rank=<rank>``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)

HEADER = """
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import pytest_torchmem as tm

torch.manual_seed(0)
MODEL, X = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)), torch.randn(8, 64)

def ddp(model, mesh):
    return DDP(model, process_group=mesh.get_group())

def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)
"""


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    # pytester's in-process runs restore sys.modules after each run; what the parallel
    # trace imports (DTensor, DDP, torch.library registrations) must be imported first.
    _expected(2)


@pytest.fixture(autouse=True)
def _quiet_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")


def _stored(pytester: pytest.Pytester) -> dict[str, Any]:
    return json.loads((pytester.path / "__torchmem__" / "test_m.json").read_text())["tests"]


def _expected(world: int) -> int:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)), torch.randn(8, 64)
    from torch.nn.parallel import DistributedDataParallel as DDP

    parallel = tm.Parallel({"dp": world}, lambda m, mesh: DDP(m, process_group=mesh.get_group()))
    report = tm.estimate(
        model, x, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), parallel=parallel, cpu="avx2:4"
    )
    return report.forward_peak


def test_entries_key_by_mesh_and_the_marker_rescales(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    pytester.makepyfile(
        test_m=HEADER
        + """
def test_ddp(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, parallel=tm.Parallel({"dp": 8}, ddp))

@pytest.mark.memory_budget(mesh={"dp": 1024}, rank=1023)
def test_ddp_at_scale(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, parallel=tm.Parallel({"dp": 8}, ddp))
"""
    )
    assert pytester.runpytest_inprocess("--torchmem-update").ret == 0
    stored = _stored(pytester)
    assert list(stored["test_ddp"]) == ["default @ dp=8 rank=0"]
    assert list(stored["test_ddp_at_scale"]) == ["default @ dp=1024 rank=1023"]
    entry = stored["test_ddp"]["default @ dp=8 rank=0"]["cpu"]
    assert entry["forward_peak"] == _expected(8)
    assert pytester.runpytest_inprocess().ret == 0

    # Another mesh is another entry: missing, never compared with dp=8's.
    pytester.makepyfile(
        test_m=HEADER
        + """
def test_ddp(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, parallel=tm.Parallel({"dp": 2}, ddp))

@pytest.mark.memory_budget(mesh={"dp": 1024}, rank=1023)
def test_ddp_at_scale(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, parallel=tm.Parallel({"dp": 8}, ddp))
"""
    )
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_ddp*default @ dp=2 rank=0*"])


@pytest.mark.parametrize(
    ("marker", "call", "message"),
    [
        ('mesh={"dp": 0}', 'parallel=tm.Parallel({"dp": 2}, ddp)', "'dp' must be a positive int"),
        ("rank=-1", 'parallel=tm.Parallel({"dp": 2}, ddp)', "rank must be a rank number"),
        ('mesh={"dp": 2}', "", "this check has no parallel="),
        ("rank=4", 'parallel=tm.Parallel({"dp": 2}, ddp)', "ranks run from 0 to 1"),
    ],
    ids=["bad-mesh", "bad-rank", "no-parallel", "rank-outside"],
)
def test_bad_mesh_or_rank_in_the_marker(
    pytester: pytest.Pytester, marker: str, call: str, message: str
) -> None:
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    args = f", {call}" if call else ""
    pytester.makepyfile(
        test_m=HEADER
        + f"""
@pytest.mark.memory_budget({marker})
def test_it(torchmem):
    torchmem.check(MODEL, X{args})
"""
    )
    result = pytester.runpytest_inprocess("--torchmem-update")
    assert result.ret != pytest.ExitCode.OK
    assert message in result.stdout.str()
    assert not (pytester.path / "__torchmem__" / "test_m.json").exists()


def test_a_name_cannot_spell_another_checks_entry(pytester: pytest.Pytester) -> None:
    """Regression guard (issue 27, 2): a check named "a @ dp=2 rank=0" and a check "a" with
    parallel= on dp=2 shared one entry silently (the update wrote one, the compare judged
    the other against it). " @ " separates the derived parts of an entry's key, so a name
    holding it is refused, before anything is traced or written."""
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    pytester.makepyfile(
        test_m=HEADER
        + """
def test_it(torchmem):
    torchmem.check(nn.Linear(64, 2), X, name="a @ dp=2 rank=0")
    torchmem.check(MODEL, X, optimizer=adamw, name="a", parallel=tm.Parallel({"dp": 2}, ddp))
"""
    )
    result = pytester.runpytest_inprocess("--torchmem-update")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "E*ValueError: torchmem.check(name='a @ dp=2 rank=0'): a name cannot hold ' @ ', "
            "which separates the parts of an entry's key that the check adds "
            "(' @ compiled', ' @ dp=8 rank=0'); name it e.g. 'a-dp=2 rank=0'"
        ]
    )
    assert not (pytester.path / "__torchmem__" / "test_m.json").exists()


def test_one_name_keys_an_eager_a_compiled_and_a_parallel_entry_apart(
    pytester: pytest.Pytester,
) -> None:
    """Each derived part of a key is claimed with the name: the same name eager and on a mesh
    is two entries; the same name twice on the same mesh and rank is refused, as an unnamed
    check twice is."""
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    pytester.makepyfile(
        test_m=HEADER
        + """
def test_it(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, name="a")
    torchmem.check(MODEL, X, optimizer=adamw, name="a", parallel=tm.Parallel({"dp": 2}, ddp))
    torchmem.check(MODEL, X, optimizer=adamw, name="a", parallel=tm.Parallel({"dp": 4}, ddp))

def test_twice(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, name="a", parallel=tm.Parallel({"dp": 2}, ddp))
    torchmem.check(MODEL, X, optimizer=adamw, name="a", parallel=tm.Parallel({"dp": 2}, ddp))
"""
    )
    result = pytester.runpytest_inprocess("--torchmem-update")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "E*ValueError: torchmem.check was called twice as 'a' (on the same mesh and rank, "
            "dp=2 rank=0) in test_m.py::test_twice; pass name=... to tell several checks in "
            "one test apart"
        ]
    )
    stored = _stored(pytester)
    assert sorted(stored["test_it"]) == ["a", "a @ dp=2 rank=0", "a @ dp=4 rank=0"]
    assert list(stored["test_twice"]) == ["a @ dp=2 rank=0"]


UNEVEN = """
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
import pytest_torchmem as tm

torch.manual_seed(0)
MODEL, X = nn.Sequential(nn.Sequential(nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 16))), torch.randn(4, 16)

def fsdp(model, mesh):
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)

def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)
"""


@pytest.mark.parametrize("where", ["marker", "call"])
def test_rank_max_records_the_worst_distinct_rank(pytester: pytest.Pytester, where: str) -> None:
    # FSDP2 over 4 ranks of 5 rows (2, 2, 1, 0): ranks differ, and the entry is the worst's
    marker, rank = ('@pytest.mark.memory_budget(rank="max")', "") if where == "marker" else ("", ', rank="max"')
    pytester.makepyfile(
        test_m=UNEVEN
        + f"""
{marker}
def test_it(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, parallel=tm.Parallel({{"dp": 4}}, fsdp{rank}))
"""
    )
    assert pytester.runpytest_inprocess("--torchmem-update").ret == 0
    stored = _stored(pytester)["test_it"]
    assert list(stored) == ["default @ dp=4 rank=max"]
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Sequential(nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 16))), torch.randn(4, 16)

    def fsdp(model: nn.Module, mesh: object) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    for device, options in (("cpu", {"cpu": "avx2:4"}), ("cuda", {})):
        figures = tm.every_rank(
            model,
            x,
            device=device,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
            parallel=tm.Parallel({"dp": 4}, fsdp),
            **options,  # type: ignore[arg-type]
        )
        assert len(figures) > 1
        worst = figures[0].report
        entry = stored["default @ dp=4 rank=max"][device]
        assert (entry["forward_peak"], entry["backward_peak"], entry["step_peak"]) == (
            worst.forward_peak,
            worst.backward_peak,
            worst.step_peak,
        )
        assert entry.get("reserved_peak") == worst.reserved_peak
    assert pytester.runpytest_inprocess().ret == 0


PIPELINE = """
import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
import pytest_torchmem as tm

torch.manual_seed(0)
MODEL, X = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), torch.randn(16, 64)

def split(model, mesh):
    pp = mesh["pp"]
    stage, stages = pp.get_local_rank(), pp.size()
    mine = nn.Sequential(*list(model)[stage * 2 : stage * 2 + 2])
    device = torch.device("cuda" if mesh.device_type == "meta" else "cpu")
    return PipelineStage(mine, stage, stages, device, group=pp.get_group())

def sgd(params):
    return torch.optim.SGD(params, lr=0.1)
"""


def _recorded_at_rank_1(pytester: pytest.Pytester, module: str, check: str) -> dict[str, Any]:
    """The snapshot entries a test of ``module`` (on cpu) records where it runs ``check``
    under ``memory_budget(rank=1)``: the run with --torchmem-update passes."""
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    pytester.makepyfile(
        test_m=f"""{module}
@pytest.mark.memory_budget(rank=1)
def test_it(torchmem):
    {check}
"""
    )
    assert pytester.runpytest_inprocess("--torchmem-update").ret == 0
    return _stored(pytester)["test_it"]


def test_the_marker_keeps_a_pipelines_schedule(pytester: pytest.Pytester) -> None:
    from test_pipeline import follows_pipelining

    if follows_pipelining.args[0]:
        pytest.skip(follows_pipelining.kwargs["reason"])
    stored = _recorded_at_rank_1(
        pytester,
        PIPELINE,
        'torchmem.check(MODEL, X, optimizer=sgd, parallel=tm.Parallel({"pp": 2}, split, schedule=Schedule1F1B, microbatches=4))',
    )
    assert list(stored) == ["default @ pp=2,Schedule1F1Bx4 rank=1"]
    entry = stored["default @ pp=2,Schedule1F1Bx4 rank=1"]["cpu"]
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), torch.randn(16, 64)

    def split(model: nn.Sequential, mesh: Any) -> Any:
        pp = mesh["pp"]
        stage = pp.get_local_rank()
        return PipelineStage(nn.Sequential(*list(model)[stage * 2 : stage * 2 + 2]), stage, 2, torch.device("cpu"), group=pp.get_group())

    report = tm.estimate(
        model,
        x,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        cpu="avx2:4",
        parallel=tm.Parallel({"pp": 2}, split, rank=1, schedule=Schedule1F1B, microbatches=4),
    )
    assert (entry["forward_peak"], entry["backward_peak"], entry["step_peak"]) == (
        report.forward_peak,
        report.backward_peak,
        report.step_peak,
    )


LOSS_PARALLEL = """
import pytest, torch
import torch.nn.functional as F
from torch import nn
import pytest_torchmem as tm

def vocabulary_parallel(model, mesh):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    plan = {"1": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return parallelize_module(model, mesh["tp"], plan)

def loss_parallel(model, mesh, tokens):
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()

def cross_entropy(logits):
    return F.cross_entropy(logits.flatten(0, 1), torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long))

torch.manual_seed(0)
MODEL = nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 256, bias=False))
TOKENS = torch.randint(0, 256, (4, 64))
"""


def test_the_marker_keeps_a_train_context(pytester: pytest.Pytester) -> None:
    """The marker's rank= re-targets the check and keeps its train context
    (loss_parallel: without it torch refuses the sharded logits' cross-entropy)."""
    stored = _recorded_at_rank_1(
        pytester,
        LOSS_PARALLEL,
        "torchmem.check(MODEL, TOKENS, loss_fn=cross_entropy, "
        "parallel=tm.Parallel({'tp': 2}, vocabulary_parallel, train_context=loss_parallel))",
    )
    assert list(stored) == ["default @ tp=2 rank=1"]
    assert pytester.runpytest_inprocess().ret == 0


def test_a_parallel_check_gets_no_advice(pytester: pytest.Pytester) -> None:
    """--torchmem-advise changes a module's built-in step, unsharded: a parallel check over
    its budget gets none, and says why (it was advised on the unsharded model while
    parallel= lived beside the check's request)."""
    pytester.makepyfile(
        test_m=HEADER
        + """
@pytest.mark.memory_budget(peak=1, devices=("cpu",))
def test_ddp(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, parallel=tm.Parallel({"dp": 2}, ddp))
"""
    )
    result = pytester.runpytest_inprocess("--torchmem-update", "--torchmem-advise")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*no advice (--torchmem-advise): the advice does not change parallel steps yet*"])
    assert "what would bring it within" not in result.stdout.str()


def test_a_parallel_check_is_not_measured_on_the_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the run measures cuda checks on this machine's GPU, a parallel check is not
    measured (one rank of a run no process here starts; measure_step refuses parallel= on
    cuda, and the step unsharded is another step): it says so, and its entry holds no
    measurement. The GPU is made up: the plugin's check for one, and the GPU it reads."""
    from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile, gpu_profile
    from pytest_torchmem.engine.measuring import runs
    from pytest_torchmem.engine.step.request import step_request
    from pytest_torchmem.plugin import estimating

    measured: list[Any] = []

    def measure_step(request: Any) -> Any:
        measured.append(request)
        raise AssertionError("a parallel check measured on the GPU")

    monkeypatch.setattr(estimating, "gpu_present", lambda: True)
    monkeypatch.setattr(GpuProfile, "from_device", classmethod(lambda cls, device=None, name=None: gpu_profile("H100")))
    monkeypatch.setattr(runs, "measure_step", measure_step)
    pytester.makepyfile(
        test_m=HEADER
        + """
@pytest.mark.memory_budget(devices=("cuda",))
def test_ddp(torchmem):
    torchmem.check(MODEL, X, optimizer=adamw, parallel=tm.Parallel({"dp": 2}, ddp))
"""
    )
    result = pytester.runpytest_inprocess("--torchmem-update")
    assert result.ret == 0, result.stdout.str()
    assert measured == []
    result.stdout.fnmatch_lines(
        [
            "*TorchmemWarning: torchmem: test_m.py::test_ddp ?default @ dp=2 rank=0? on cuda: "
            "a parallel= check is not measured on this machine's GPU*"
        ]
    )
    entry = _stored(pytester)["test_ddp"]["default @ dp=2 rank=0"]["cuda"]
    assert "measured" not in entry
    # the decision: a check without parallel= is measured
    model = nn.Linear(2, 2)
    plain = step_request("torchmem.check", model, torch.randn(1, 2), "cuda", None, None, True)
    assert estimating.not_measured(plain) is None
    parallel = tm.Parallel({"dp": 2}, lambda m, mesh: m)
    ranked = step_request("torchmem.check", model, torch.randn(1, 2), "cuda", None, None, True, parallel=parallel)
    assert "not measured on this machine's GPU" in (estimating.not_measured(ranked) or "")
