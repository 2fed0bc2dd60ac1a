"""Block replay where the trace follows compiled code (issue 55, item 3): a model's repeated
blocks, each compiled alone (``layer.compile()``, or ``torch.compile(layer)`` put in the
list, as recipes compile their decoder layers), share one program; the traced step traces
a few of them and replays the others, as it replays eager blocks (compiled_blocks.py,
block_replay.py); and eager blocks beside compiled code (a compiled loss) replay as they
do without it, but those that run inside compiled code or call it.

A replay must give the figures of the step traced block by block (``TORCHMEM_REPLAY=0``),
which on cpu are ``measure``'s, byte for byte; and blocks whose programs differ (dynamo
specializes on an attribute that tells them apart, and builds one program per block) are
traced, with the reason said.

The warm-up step that builds the programs takes shortcuts (warm_up_runs.py): a program's
later runs there make only its outputs, and an optimizer's step there finds no gradient
(the warm-up runs again in full where the step then fails); the figures stay
``measure``'s.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from fingerprint import fingerprint
from following import follows_compiled
from profiled import every_peak
from replay_checks import import_transformers

pytestmark = follows_compiled

LAYERS = 8


#: The ways recipes compile their decoder layers one by one: in place, or a compiled
#: wrapper put in the list in the layer's place (torchtitan's way).
HOW = ["layer.compile()", "torch.compile(layer)"]


def _llama(compile_layers: bool = True, how: str = HOW[0]) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """transformers' Llama (8 layers, width 128), its decoder layers compiled one by one
    (``how``: one of :data:`HOW`) or eager, and AdamW."""
    transformers = import_transformers()
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if compile_layers:
        layers = model.model.layers
        for i, layer in enumerate(layers):
            if how == HOW[0]:
                layer.compile()
            else:
                layers[i] = torch.compile(layer)
    return model, torch.optim.AdamW(model.parameters()), torch.randint(0, 512, (2, 64))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _replayed(report: tm.MemoryReport) -> list[str]:
    return [line for line in report.replayed if "block calls replayed" in line]


def _traced_block_by_block(monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any) -> tm.MemoryReport:
    with monkeypatch.context() as patched:
        patched.setenv("TORCHMEM_REPLAY", "0")
        report = tm.estimate(*args, **kwargs)
    assert _replayed(report) == []
    return report


@pytest.mark.parametrize("how", HOW)
def test_compiled_layers_replay_and_equal_measure_on_cpu(how: str) -> None:
    """Eight decoder layers compiled alone, through the recipe's own loop: the first ones
    traced until two alike make the template, three at the end for their backwards, the
    rest replayed; every figure ``measure``'s."""
    model, optimizer, ids = _llama(how=how)
    before = fingerprint(model, optimizer, ids)
    # (and every module's own attributes: a wrapper's forward, which the replay sets)
    attributes = [dict(module.__dict__) for module in model.modules()]
    report = tm.estimate(_train_step, (model, optimizer, ids))
    assert fingerprint(model, optimizer, ids) == before
    assert [dict(module.__dict__) for module in model.modules()] == attributes
    assert report.unsupported == ()
    [line] = _replayed(report)
    assert line.startswith("model.model.layers: ") and f" of {LAYERS} block calls replayed" in line, line
    assert every_peak(report) == every_peak(tm.measure(_train_step, (model, optimizer, ids)))


@pytest.mark.parametrize("how", HOW)
def test_compiled_layers_replay_on_cuda_as_traced_block_by_block(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer, ids = _llama(how=how)
    report = tm.estimate(_train_step, (model, optimizer, ids), device="cuda")
    assert report.unsupported == ()
    assert len(_replayed(report)) == 1
    traced = _traced_block_by_block(monkeypatch, _train_step, (model, optimizer, ids), device="cuda")
    assert every_peak(report) == every_peak(traced)
    assert report.breakdown == traced.breakdown


class _Special(nn.Module):
    """A block whose forward branches on a flag: dynamo specializes on it and builds two
    programs, the special blocks' (which run ``up`` twice, and keep both outputs for
    backward) and the others'."""

    def __init__(self, special: bool) -> None:
        super().__init__()
        self.special = special
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.special:
            h = h + torch.relu(self.up(x * 2))
        return x + self.down(h)


def test_compiled_blocks_whose_programs_differ_are_traced_and_equal_measure() -> None:
    """Twelve blocks, the third and the eighth special (as a model's global-attention
    layers among sliding ones): the blocks around the eighth are alike, and the last
    three traced ones are not special, so only dynamo's program of the special blocks
    tells it apart: the warm-up saw programs built in three blocks' calls (the first
    block's, whose input needs no gradient; the second's; the third's, special), and the
    blocks are traced."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Special(i % 5 == 2) for i in range(12)))
    for block in model:
        block.compile()
    x = torch.randn(32, 64)
    report = tm.estimate(model, x)
    assert report.unsupported == ()
    assert _replayed(report) == []
    assert "(model): compiled blocks traced (dynamo built programs in 3 of their calls" in "\n".join(report.replayed)
    assert every_peak(report) == every_peak(tm.measure(model, x))


# -- eager blocks beside compiled code ---------------------------------------------------


@torch.compile
def _chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy((h @ weight.t()).float(), labels, reduction="sum")


def _step_with_a_compiled_loss(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """The recipe's loop with its loss compiled and computed chunk by chunk."""
    hidden = model.model(input_ids=ids).last_hidden_state.flatten(0, 1)
    labels = ids.flatten()
    total = hidden.new_zeros((), dtype=torch.float32)
    for part, part_labels in zip(hidden.chunk(4), labels.chunk(4)):
        total = total + _chunked_cross_entropy(part, model.lm_head.weight, part_labels)
    (total / labels.numel()).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_eager_layers_beside_a_compiled_loss_replay_and_equal_measure_on_cpu() -> None:
    model, optimizer, ids = _llama(compile_layers=False)
    before = fingerprint(model, optimizer, ids)
    report = tm.estimate(_step_with_a_compiled_loss, (model, optimizer, ids))
    assert fingerprint(model, optimizer, ids) == before
    assert report.unsupported == ()
    assert len(_replayed(report)) == 1
    assert every_peak(report) == every_peak(tm.measure(_step_with_a_compiled_loss, (model, optimizer, ids)))


def test_eager_layers_beside_a_compiled_loss_replay_on_cuda_as_traced_block_by_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, optimizer, ids = _llama(compile_layers=False)
    report = tm.estimate(_step_with_a_compiled_loss, (model, optimizer, ids), device="cuda")
    assert report.unsupported == ()
    assert len(_replayed(report)) == 1
    traced = _traced_block_by_block(monkeypatch, _step_with_a_compiled_loss, (model, optimizer, ids), device="cuda")
    assert every_peak(report) == every_peak(traced)


@torch.compile
def _gelu_mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x @ up) @ down


class _CallsCompiled(nn.Module):
    """An eager block whose forward calls a compiled function."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(64, 256) / 8)
        self.down = nn.Parameter(torch.randn(256, 64) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _gelu_mlp(x, self.up, self.down)


@pytest.mark.parametrize(
    ("how", "train"),
    [("blocks that call a compiled function", True), ("blocks that call a compiled function", False),
     ("the whole model compiled", True)],
)
def test_eager_blocks_in_or_around_compiled_code_are_traced_and_equal_measure(how: str, train: bool) -> None:
    """Blocks that run compiled code, or run inside it, are traced (a replay would skip
    their programs' runs, or set a forward that dynamo's guards see); a forward alone
    (``train=False``) has no autograd node that tells a compiled program apart."""
    torch.manual_seed(0)
    if how == "the whole model compiled":
        model: nn.Module = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                           for _ in range(8)))
        model.compile()
    else:
        model = nn.Sequential(*(_CallsCompiled() for _ in range(8)))
    x = torch.randn(32, 64)
    report = tm.estimate(model, x, train=train)
    assert report.unsupported == ()
    assert _replayed(report) == []
    assert every_peak(report) == every_peak(tm.measure(model, x, train=train))


# -- a compiled program's runs in the warm-up -------------------------------------------


def test_in_the_warm_up_a_program_runs_in_full_once_per_input_layout() -> None:
    """An output module's ``call`` (warm_up_runs.py): in the warm-up its first run on inputs
    of given layouts runs, the later ones make outputs of the layouts it returned; a run
    on other layouts runs; a program that returns a view of its input always runs; outside
    the warm-up every run runs."""
    from pytest_torchmem.engine.tracing.warm_up_runs import first_run_in_full, warming_up

    runs: list[int] = []

    def program(args: list[Any]) -> tuple[torch.Tensor, ...]:
        (x,) = args
        args.clear()
        runs.append(x.shape[0])
        return (torch.empty(x.shape[0], 3), torch.empty(2, x.shape[0]).t())

    call = first_run_in_full(program)
    with warming_up():
        first = call([torch.randn(4)])
        again = [call([torch.randn(4)]) for _ in range(3)]
        other = call([torch.randn(5)])
    assert runs == [4, 5]
    for out in again:
        assert [(t.shape, t.stride(), t.dtype) for t in out] == [(t.shape, t.stride(), t.dtype) for t in first]
        assert all(t.untyped_storage()._cdata != f.untyped_storage()._cdata for t, f in zip(out, first))
    assert other[0].shape == (5, 3)
    call([torch.randn(4)])
    assert runs == [4, 5, 4]  # (outside the warm-up)

    viewed: list[int] = []

    def view_of_input(args: list[Any]) -> tuple[torch.Tensor]:
        (x,) = args
        args.clear()
        viewed.append(1)
        return (x[1:],)

    call = first_run_in_full(view_of_input)
    with warming_up():
        for _ in range(3):
            call([torch.randn(4)])
    assert len(viewed) == 3


def test_in_the_warm_up_a_training_graph_is_made_again_from_its_inputs() -> None:
    """A training graph's forward returns the weights it saves for backward (its inputs
    themselves) and, with dynamic shapes, the sizes its backward needs; its backward
    None for an input that needs no gradient: the later runs in the warm-up return
    those inputs, numbers and Nones where the first did, and fresh tensors for the rest.
    Outputs that are views (of an input, or two on one storage) cannot be made so: those
    runs run."""
    from pytest_torchmem.engine.tracing.warm_up_runs import first_run_in_full, warming_up

    runs: list[str] = []

    def training_forward(args: list[Any]) -> tuple[Any, ...]:
        x, weight = args
        args.clear()
        runs.append("forward")
        return (x @ weight, weight, None, x.shape[0])

    call = first_run_in_full(training_forward)
    with warming_up():
        x, weight = torch.randn(4, 3), torch.randn(3, 2)
        first = call([x, weight])
        x2, weight2 = torch.randn(4, 3), torch.randn(3, 2)
        again = call([x2, weight2])
    assert runs == ["forward"]
    assert again[1] is weight2 and again[2] is None and again[3] == 4 and first[1] is weight
    assert (again[0].shape, again[0].stride()) == ((4, 2), (2, 1))
    assert again[0].untyped_storage()._cdata not in (x2.untyped_storage()._cdata, first[0].untyped_storage()._cdata)

    def shared(args: list[Any]) -> tuple[torch.Tensor, ...]:
        (x,) = args
        args.clear()
        runs.append("shared")
        both = torch.empty(2, x.shape[0])
        return (both[0], both[1])

    call = first_run_in_full(shared)
    with warming_up():
        for _ in range(3):
            call([torch.randn(4)])
    assert runs.count("shared") == 3


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_in_the_warm_up_compiled_layers_run_in_full_once_each_way(monkeypatch: pytest.MonkeyPatch, shapes: str) -> None:
    """transformers' Llama, its layers compiled one by one: in the warm-up the layers'
    forward program (which returns the weights it saves) and backward program (which
    returns None for the position ids' gradient) each run in full once; the other
    seven calls of each make their outputs. The figures stay ``measure``'s.

    ``dynamic``: the step was estimated at another length first, so dynamo compiles the
    layer again with dynamic shapes (its programs take and return sizes), as a test
    suite that estimates one model at two lengths has it (this process's earlier tests
    may have done so in the static case too: dynamo keeps what it saw per code object)."""
    from pytest_torchmem.engine.tracing import compiled_program, inductor_device, warm_up_runs

    full: list[int] = []

    def counting(call: Any) -> Any:
        def counted(args: list[Any]) -> Any:
            if getattr(warm_up_runs._STATE, "on", False):
                full.append(id(call))
            return call(args)

        return warm_up_runs.first_run_in_full(counted)

    monkeypatch.setattr(compiled_program, "first_run_in_full", counting)
    monkeypatch.setattr(inductor_device, "first_run_in_full", counting)
    model, optimizer, ids = _llama()
    if shapes == "dynamic":
        tm.estimate(_train_step, (model, optimizer, ids[:, :32]))
        full.clear()
    report = tm.estimate(_train_step, (model, optimizer, ids))
    assert sorted(full.count(program) for program in set(full)) == [1, 1]
    assert every_peak(report) == every_peak(tm.measure(_train_step, (model, optimizer, ids)))


# -- an optimizer's step in the warm-up ----------------------------------------------------


def _compiled_blocks() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[_Special(False) for _ in range(4)])
    for block in model:
        block.compile()
    return model, torch.randn(8, 64)


class _SeenGradients(torch.optim.SGD):
    """SGD that notes in the file ``notes``, at each step, whether the warm-up runs and
    how many of its parameters have a gradient (a file: the trace puts back what the
    step changed of the objects it reaches)."""

    notes = ""

    def step(self, closure: Any = None) -> Any:
        from pytest_torchmem.engine.tracing import warm_up_runs

        warming = getattr(warm_up_runs._STATE, "on", False)
        with open(self.notes, "a") as notes:
            notes.write(f"{warming} {sum(p.grad is not None for g in self.param_groups for p in g['params'])}\n")
        return super().step(closure)


def test_in_the_warm_up_an_optimizer_step_finds_no_gradient(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up's optimizer step builds nothing the traced step runs: it finds no
    gradient, and updates nothing; the traced step's finds every one. The figures stay
    ``measure``'s."""
    model, x = _compiled_blocks()
    optimizer = _SeenGradients(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    monkeypatch.setattr(_SeenGradients, "notes", str(tmp_path / "notes"))
    report = tm.estimate(step, (x,))
    assert report.unsupported == ()
    assert (tmp_path / "notes").read_text().splitlines() == ["True 0", "False 16"]
    assert every_peak(report) == every_peak(tm.measure(step, (x,)))


def test_a_step_that_reads_the_state_its_optimizer_step_made_is_followed() -> None:
    """A step that reads its optimizer's state after the step (a log of the step counts)
    fails in a warm-up whose optimizer step made none: the warm-up runs again with its
    optimizer step in full, and the compiled blocks are followed (without that second
    run they ran eagerly, listed)."""
    model, x = _compiled_blocks()
    optimizer = torch.optim.AdamW(model.parameters())

    def step(x: torch.Tensor) -> float:
        model(x).sum().backward()
        optimizer.step()
        counts = [float(optimizer.state[p]["step"]) for p in model.parameters()]
        optimizer.zero_grad()
        return sum(counts)

    before = fingerprint(model, optimizer, x)
    report = tm.estimate(step, (x,))
    assert fingerprint(model, optimizer, x) == before
    assert report.unsupported == ()
    assert every_peak(report) == every_peak(tm.measure(step, (x,)))


def test_an_optimizer_step_with_a_closure_in_the_warm_up_runs_the_closure() -> None:
    """``optimizer.step(closure)`` (Lightning's loop): the closure's forward and backward
    run inside the step, in the warm-up too, so the compiled blocks are built there."""
    model, x = _compiled_blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> None:
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(x).sum()
            loss.backward()
            return loss

        optimizer.step(closure)

    report = tm.estimate(step, (x,))
    assert report.unsupported == ()
    assert every_peak(report) == every_peak(tm.measure(step, (x,)))
