"""Training code as users write it, traced, and the user's world left as it was (issue 36).

Each family of :mod:`user_code` is a step written as users write it: a model
reached through ``self``, a partial, a callable object, a dataclass, defaults,
a helper's globals; moved to the device it finds, cast, copied, changed. On
cpu the estimate equals ``measure`` byte for byte; on the fake cuda device it
traces (no GPU); and after every call every object the step reaches is as it
was, bit for bit (:func:`fingerprint.fingerprint`: values, types, structure,
no fake tensor left inside).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from fingerprint import fingerprint
from profiled import every_peak
from torch import nn
from user_code import FAMILIES, MODEL, OPT, mlp

import pytest_torchmem as tm

#: A model the step of test_a_module_reached_only_at_run_time_is_refused finds by name.
HIDDEN = mlp()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_is_measure_on_cpu_traces_on_cuda_and_leaves_its_world_as_it_was(name: str) -> None:
    """The estimate on cpu equals ``measure`` (every phase's peak, the breakdown); the fake
    cuda device traces it; after each of the three, everything the step reaches is as it
    was, bit for bit."""
    function, arguments, reached = FAMILIES[name]()
    before = fingerprint(function, arguments, reached)
    estimated = tm.estimate(function, arguments)
    assert fingerprint(function, arguments, reached) == before
    measured = tm.measure(function, arguments)
    assert fingerprint(function, arguments, reached) == before
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(measured)
    assert estimated.breakdown == measured.breakdown
    on_gpu = tm.estimate(function, arguments, device="cuda")
    assert fingerprint(function, arguments, reached) == before
    assert on_gpu.unsupported == ()
    assert on_gpu.peak > estimated.peak  # (the GPU's cuBLAS workspace alone is 32 MiB)


def test_a_trainer_objects_figures_count_its_model_and_optimizer() -> None:
    """``trainer.train_step`` reaches ``self.model`` and ``self.opt``: the parameters are
    in the figures, and the same step written with arguments has the same figures."""
    from user_code import Trainer, step

    trainer = Trainer()
    x = torch.randn(16, 32)

    def with_arguments(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        trainer_losses.append(loss.detach())

    trainer_losses: list[torch.Tensor] = []
    through_self = tm.estimate(trainer.train_step, (x,))
    other = mlp()
    through_arguments = tm.estimate(with_arguments, (other, torch.optim.AdamW(other.parameters(), lr=1e-3), x))
    assert through_self.breakdown[tm.Category.PARAMETERS] == sum(p.nbytes for p in trainer.model.parameters())
    assert every_peak(through_self) == every_peak(through_arguments)
    assert step is not None


def test_a_second_estimate_of_a_step_with_defaults_is_the_first() -> None:
    from user_code import with_defaults

    x = torch.randn(16, 32)
    first, second = (tm.estimate(with_defaults, (x,)) for _ in range(2))
    assert every_peak(first) == every_peak(second)
    assert OPT.state == {} and all(p.grad is None for p in MODEL.parameters())


def test_an_optimizer_that_has_stepped_keeps_its_step_count() -> None:
    """Adam's step count is a tensor (3.0 after three steps): the trace knows its value,
    so its bias corrections do not divide by zero (``1 - beta ** 0``)."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 32)
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    def one_more(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    estimated = tm.estimate(one_more, (model, x, opt))
    assert every_peak(estimated) == every_peak(tm.measure(one_more, (model, x, opt)))
    assert all(state["step"].item() == 3.0 for state in opt.state.values())


def test_the_users_exception_after_a_step_is_the_users() -> None:
    class Diverged(Exception):
        pass

    model = mlp()
    opt = torch.optim.Adam(model.parameters())

    def stops(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model(x).sum().backward()
        opt.step()
        raise Diverged("loss is nan")

    x = torch.randn(4, 32)
    with pytest.raises(Diverged):  # Adam's state and step count, as a loop that ran leaves them
        stops(model, x, opt)
    with pytest.raises(Diverged, match="loss is nan"):
        tm.estimate(stops, (model, x, opt))
    with pytest.raises(Diverged, match="loss is nan"):
        tm.measure(stops, (model, x, opt))
    assert all(state["step"].item() == 1.0 for state in opt.state.values())


def test_a_module_reached_only_at_run_time_is_refused_and_nothing_changes() -> None:
    """A model the step finds through a registry no walk sees: refused where it is called,
    naming it and the fix; the model is as it was."""
    model = HIDDEN

    def step(x: torch.Tensor) -> None:
        registered = getattr(sys.modules[__name__], "HID" + "DEN")  # (a name no walk can read)
        registered(x).sum().backward()

    before = fingerprint(model)
    with pytest.raises(tm.UnfollowedError, match=r"calls a Sequential module .* pass it to the function as an argument"):
        tm.estimate(step, (torch.randn(2, 32),))
    with pytest.raises(tm.UnfollowedError, match=r"calls a Sequential module"):
        tm.measure(step, (torch.randn(2, 32),))
    assert fingerprint(model) == before


def test_an_iterator_the_step_advances_is_rewound_and_a_generator_refused() -> None:
    """An iterator over a list is where it was after the call; a generator cannot be
    rewound: the check says so (the generator has moved on)."""
    model = mlp()
    batches = [torch.randn(4, 32) for _ in range(3)]

    def step(model: nn.Module, batches: Any) -> None:
        model(next(batches)).sum().backward()

    over_a_list = iter(batches)
    tm.estimate(step, (model, over_a_list))
    assert next(over_a_list) is batches[0]
    generated = (b for b in batches)
    with pytest.raises(tm.UnfollowedError, match="cannot be rewound"):
        tm.estimate(step, (model, generated))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_generator_function_is_refused(device: str) -> None:
    def steps(model: nn.Module, x: torch.Tensor) -> Any:
        yield model(x).sum().backward()

    with pytest.raises(TypeError, match="is a generator function: calling it runs none of its body"):
        tm.estimate(steps, (mlp(), torch.randn(2, 32)), device=device)


def test_a_model_made_on_the_host_and_moved_to_the_gpu_is_charged_as_a_gpu_charges_it() -> None:
    """A model the step builds on the host and moves with ``.cuda()``, and a batch it makes
    on the host and moves: on the fake cuda device the GPU is charged the device copies
    (each parameter's block allocated where ``.cuda()`` runs), the host copies nothing; the
    figures are those of the same model handed to the step on the device."""

    def built_and_moved(x: torch.Tensor) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
        batch = torch.randn(64, 256).cuda()  # made on the host, copied
        model(batch + x).square().mean().backward()

    def given(model: nn.Module, x: torch.Tensor) -> None:
        batch = torch.randn(64, 256, device="cuda")
        model(batch + x).square().mean().backward()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    x = torch.randn(64, 256)
    moved = tm.estimate(built_and_moved, (x,), device="cuda")
    handed = tm.estimate(given, (model, x), device="cuda")
    assert moved.unsupported == handed.unsupported == ()
    assert every_peak(moved) == every_peak(handed)
    parameters = sum(-(-p.nbytes // 512) * 512 for p in model.parameters())
    # made in the step, the moved model's blocks are the step's own (activations), the
    # handed one's are its parameters from the start
    assert handed.breakdown[tm.Category.PARAMETERS] == parameters
    assert moved.breakdown[tm.Category.PARAMETERS] == 0
    with pytest.raises(RuntimeError):  # on the fake cpu device there is no GPU, as on this machine
        tm.estimate(built_and_moved, (x,))


def test_cuda_and_casts_of_the_users_model_on_the_fake_gpu() -> None:
    model = mlp()
    x = torch.randn(16, 32)

    def step(model: nn.Module, x: torch.Tensor) -> None:
        model.cuda().bfloat16()
        model(x.cuda().bfloat16()).float().square().mean().backward()

    before = fingerprint(model, x)
    report = tm.estimate(step, (model, x), device="cuda")
    assert report.unsupported == ()
    # the bfloat16 parameters (the fp32 ones, converted in place, freed)
    assert report.peak < tm.estimate(step, (mlp(64), x), device="cuda").peak + 1
    assert fingerprint(model, x) == before


opt = torch.optim.SGD(mlp().parameters(), lr=0.1)  # an unrelated global named opt (item 3)


def test_a_step_reading_an_attribute_named_like_an_unrelated_global_is_followed() -> None:
    """``trainer.opt`` in the step, and a global ``opt`` in this module: the attribute
    is not the global (the walk reads the globals the code loads as globals)."""
    from user_code import Trainer

    trainer = Trainer()
    x = torch.randn(16, 32)

    def step(trainer: Trainer, x: torch.Tensor) -> None:
        trainer.model(x).sum().backward()
        trainer.opt.step()

    estimated = tm.estimate(step, (trainer, x))
    assert every_peak(estimated) == every_peak(tm.measure(step, (trainer, x)))
    assert estimated.breakdown[tm.Category.PARAMETERS] == sum(p.nbytes for p in trainer.model.parameters())
    assert opt.state == {} and trainer.opt.state == {}


def _fully_shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh["dp"])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_parallel_estimate_leaves_the_processs_excepthook(device: str) -> None:
    """``init_process_group`` replaces ``sys.excepthook`` with one that prefixes each line
    of a traceback with ``[rankN]:``; an estimate's fake world must not leave it (the
    user's next uncaught error would print through one layer per estimate)."""
    hook = sys.excepthook
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    tm.estimate(model, torch.randn(4, 8), device=device, parallel=tm.Parallel({"dp": 2}, _fully_shard))
    assert sys.excepthook is hook
