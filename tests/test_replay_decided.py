"""Block replay stands one block's events in for another's only where both run the same
program (issue 56): blocks decided by their class, by the caller, by globals, by hooks in
forward and backward, by what a block keeps and by the exceptions it raises give, replay on,
every figure and every ``unsupported`` entry they give with every block traced, on both
devices, leak checks included; and the watch changes nothing the user's code can see."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from replay_checks import both, same_figures

import pytest_torchmem as tm

WIDTH = 32
BLOCKS = 10


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    """``BLOCKS`` blocks in a ModuleList, called one after the other by ``run`` (the caller
    decides how: ``run(position, block, x)``)."""

    def __init__(self, block: Callable[[], nn.Module], run: Callable[[int, nn.Module, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)
        self.run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for position, block in enumerate(self.blocks):
            x = self.run(position, block, x) if self.run is not None else block(x)
        return self.head(x).sum()


def _make(block: Callable[[], nn.Module], run: Any = None) -> Callable[[], tuple[nn.Module, Any]]:
    def make() -> tuple[nn.Module, Any]:
        _reset()
        torch.manual_seed(0)
        return Stack(block, run), (torch.randn(16, WIDTH),)

    return make


# -- decided by the class (numbered blocks, as transformers' are: a replay watches what
# their forward reads of their number) ---------------------------------------------------------


class Numbered(Block):
    number = 0

    def __init__(self) -> None:
        super().__init__()
        Numbered.number += 1
        self.layer_idx = Numbered.number




class ByItsClass(Numbered):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h.clone() if type(self) is ByItsClass else h  # (one more activation: the real class)


REGISTRY: list[type] = []


class Registered(Numbered):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        REGISTRY.append(cls)


class NeedsAKeyword(Numbered):
    def __init_subclass__(cls, *, kind: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)


# -- decided by the caller --------------------------------------------------------------------


def _checkpoints_some(position: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, use_reentrant=False) if 2 <= position <= 5 else block(x)


def _offloads_some(position: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if 2 <= position <= 5:
        with torch.autograd.graph.save_on_cpu():
            return block(x)
    return block(x)


class CallDecides(Block):
    """Its ``__call__`` checkpoints it where its number says so."""

    number = 0

    def __init__(self) -> None:
        super().__init__()
        CallDecides.number += 1
        self.checkpointed = 3 <= CallDecides.number % BLOCKS <= 6

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(super().__call__, x, use_reentrant=False)
        return super().__call__(x)


# -- decided by globals -----------------------------------------------------------------------

CALLS = 0


class CountsItsCalls(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global CALLS
        CALLS += 1
        h = super().forward(x)
        return h * 1.5 if CALLS % 3 == 0 else h


WIDE = False


def _sets_a_flag(position: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    global WIDE
    WIDE = position >= 6
    return block(x)


class ReadsAFlag(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return torch.cat([h, h], 1)[:, :WIDTH] if WIDE else h


class Settings:
    def __init__(self) -> None:
        self.wide = False


SETTINGS = Settings()


def _sets_a_setting(position: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    SETTINGS.wide = position >= 6
    try:
        return block(x)
    finally:
        SETTINGS.wide = SETTINGS.wide and position < BLOCKS - 1  # (left as it was found)


class ReadsItsSettings(Block):
    def __init__(self) -> None:
        super().__init__()
        self.settings = SETTINGS  # (one object, shared: the caller changes it between blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return torch.cat([h, h], 1)[:, :WIDTH] if self.settings.wide else h


# -- decided by what a block reads of itself -------------------------------------------------


class ReadsItsDict(Numbered):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h.clone() if self.__dict__["layer_idx"] % 2 else h


class ReadsByName(Numbered):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h.clone() if getattr(self, "layer_idx") % 2 else h


class Indexes(Numbered):
    """Reads its number in a branch a step does not take: replayed."""

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        h = super().forward(x)
        if cache is not None:
            cache[self.layer_idx] = h
        return h


# -- what a block keeps -----------------------------------------------------------------------

KEPT: list[torch.Tensor] = []


class KeepsItsInputInAGlobal(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        KEPT.append(x)
        return super().forward(x)


class KeepsItsInputOnItsClass(Block):
    kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).kept.append(x)
        return super().forward(x)


class KeepsAnInnerTensorInAGlobal(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        KEPT.append(h.detach())
        return x + self.down(h)


# -- hooks it does not carry ------------------------------------------------------------------


def _global_hook_keeping(kept: list[torch.Tensor]) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(module, nn.Linear) and module.out_features == 4 * WIDTH:
            kept.append(output)

    return hook


class HookedInForward(Numbered):
    """A tensor hook, made in forward, that reads its block's number in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 2 if self.layer_idx % 2 else None)
        return x + self.down(F.gelu(h))


CASES: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "branches on type(self)": _make(ByItsClass),
    "__init_subclass__ registry": _make(Registered),
    "__init_subclass__ with a required keyword": _make(lambda: NeedsAKeyword()),
    "the caller checkpoints blocks 3-6": _make(Block, _checkpoints_some),
    "the caller offloads blocks 3-6": _make(Block, _offloads_some),
    "__call__ checkpoints blocks 3-6": _make(CallDecides),
    "a global counter": _make(CountsItsCalls),
    "a global flag the caller sets": _make(ReadsAFlag, _sets_a_flag),
    "a shared settings object the caller changes": _make(ReadsItsSettings, _sets_a_setting),
    "its number through __dict__": _make(ReadsItsDict),
    "its number through getattr": _make(ReadsByName),
    "keeps its input in a global list": _make(KeepsItsInputInAGlobal),
    "keeps its input on its class": _make(KeepsItsInputOnItsClass),
    "keeps an inner tensor in a global list": _make(KeepsAnInnerTensorInAGlobal),
    "a tensor hook reads its number in backward": _make(HookedInForward),
}


def _reset() -> None:
    """The program's state as it starts (each run of each case makes its model afresh)."""
    global CALLS, WIDE
    CALLS, WIDE = 0, False
    SETTINGS.wide = False
    KEPT.clear()
    KeepsItsInputOnItsClass.kept.clear()


@pytest.fixture(autouse=True)
def _fresh_state() -> Any:
    registered = list(REGISTRY)
    yield
    _reset()
    assert REGISTRY == registered  # (no class of the tool's own was made of the user's)


#: The cases the README's command checks (on cpu); CI's exhaustive run checks every one on
#: both devices.
QUICK = (
    "branches on type(self)",
    "__init_subclass__ with a required keyword",
    "__init_subclass__ registry",
    "a global counter",
    "keeps its input in a global list",
)


def _cases() -> list[Any]:
    return [
        pytest.param(case, device, id=f"{case}-{device}",
                     marks=[] if case in QUICK and device == "cpu" else [pytest.mark.exhaustive])
        for case in CASES
        for device in ("cpu", "cuda")
    ]


@pytest.mark.parametrize(("case", "device"), _cases())
def test_replay_gives_the_traced_figures(case: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, CASES[case], device=device, optimizer=_adamw)
    same_figures(replayed, traced)
    # (no class of the tool's own was made of the user's: every subclass is this module's)
    blocks = {type(m) for m in CASES[case]()[0].blocks}
    assert all(sub is globals()[sub.__name__] for cls in blocks for sub in cls.__subclasses__())


#: (a leak check of a model that keeps a tensor per block takes about 90 s on 2 cores, replay
#: on or off, the leak checker's own cost: CI's exhaustive run checks one)
LEAKING = (pytest.param("keeps an inner tensor in a global list", "cuda", id="inner tensor in a global list-cuda"),)


@pytest.mark.exhaustive
@pytest.mark.parametrize(("case", "device"), LEAKING)
def test_leak_checks_replayed_find_what_traced_ones_find(case: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, CASES[case], tm.leaks, device=device, optimizer=_adamw, iterations=3)
    assert (replayed.held, replayed.growth, replayed.per_iteration) == (traced.held, traced.growth, traced.per_iteration)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.exhaustive)])
def test_a_global_hook_that_keeps_inner_outputs_is_followed(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kept: list[torch.Tensor] = []
    handle = nn.modules.module.register_module_forward_hook(_global_hook_keeping(kept))
    try:
        replayed, traced = both(monkeypatch, _make(Block), device=device, optimizer=_adamw)
        same_figures(replayed, traced)
        assert not any("block calls replayed" in line for line in replayed.replayed), replayed.replayed
    finally:
        handle.remove()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.exhaustive)])
def test_a_parameter_hook_that_keeps_gradients_is_followed(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> tuple[nn.Module, Any]:
        model, inputs = _make(Block)()
        kept: list[torch.Tensor] = []
        for block in model.blocks:
            block.up.weight.register_hook(kept.append)
        return model, inputs

    replayed, traced = both(monkeypatch, make, device=device, optimizer=_adamw)
    same_figures(replayed, traced)
    assert not any("block calls replayed" in line for line in replayed.replayed), replayed.replayed


class RaisesOnItsEighthCall(Block):
    calls = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        if self.calls[0] == 8:
            raise RuntimeError("the eighth call")
        return super().forward(x)


def test_a_block_that_raises_raises_replay_on() -> None:
    RaisesOnItsEighthCall.calls[0] = 0
    with pytest.raises(RuntimeError, match="the eighth call"):
        tm.estimate(*_make(RaisesOnItsEighthCall)(), optimizer=_adamw)


def test_a_block_that_reads_its_number_only_to_index_a_cache_it_is_not_given_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, _make(Indexes), optimizer=_adamw)
    same_figures(replayed, traced)
    assert any("block calls replayed" in line for line in replayed.replayed), replayed.replayed


def test_the_watch_leaves_a_tracer_already_set_running() -> None:
    import sys

    seen: set[str] = set()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        seen.add(frame.f_code.co_name)
        return None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        tm.estimate(*_make(Block)(), optimizer=_adamw)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(before)
    assert "forward" in seen


# -- transformers' layers, checkpointed by the library ----------------------------------------


def _checkpointed(model: nn.Module) -> None:
    """transformers' gradient checkpointing switched on (5.x's name, or 4.x's)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def _transformers_model(name: str) -> Callable[[], tuple[nn.Module, Any]]:
    from torchvision_import import import_torchvision

    import_torchvision()  # (before transformers imports it)
    transformers = pytest.importorskip("transformers")

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        if name == "mamba":
            config = transformers.MambaConfig(
                num_hidden_layers=8, hidden_size=32, state_size=8, intermediate_size=64, vocab_size=128,
                use_mambapy=False,
            )
            model = transformers.MambaForCausalLM(config)
            _checkpointed(model)
        else:
            config = transformers.LlamaConfig(
                num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128,
            )
            model = transformers.LlamaForCausalLM(config)
            _checkpointed(model)
            for layer in model.model.layers[:4]:
                layer.gradient_checkpointing = False  # (the first four layers keep their activations)
        model.train()
        ids = torch.randint(0, 128, (2, 16))
        return model, {"input_ids": ids, "labels": ids, "use_cache": False}

    return make


@pytest.mark.exhaustive
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["mamba", "llama, half its layers checkpointed"])
def test_transformers_checkpointed_layers_give_the_traced_figures(name: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make = _transformers_model(name.split(",")[0])
    replayed, traced = both(monkeypatch, make, device=device, optimizer=_adamw)
    same_figures(replayed, traced)


#: A garbage collector's callback that assigns a global of its own module (as hypothesis's
#: does), not the module of the model's classes.
ELSEWHERE: dict[str, Any] = {}
exec("collections = 0\ndef count(phase, info):\n    global collections\n    collections += 1\n", ELSEWHERE)


class Collects(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gc.collect(0)  # (the youngest generation: its callbacks run as a whole collection's do, in a moment)
        return super().forward(x)


def test_a_garbage_collector_callback_is_not_the_programs_code(monkeypatch: pytest.MonkeyPatch) -> None:
    # (hypothesis registers one that assigns a global: it runs wherever the collector runs)
    gc.callbacks.append(ELSEWHERE["count"])
    try:
        replayed, traced = both(monkeypatch, _make(Collects), optimizer=_adamw)
    finally:
        gc.callbacks.remove(ELSEWHERE["count"])
    same_figures(replayed, traced)
    assert ELSEWHERE["collections"] > 0
    assert replayed.replayed[1] == "iteration 2: forward and backward replayed from iteration 1", replayed.replayed
    assert "block calls replayed" in replayed.replayed[0], replayed.replayed


# -- what a block's graph holds that no tensor of the trace is: a wrapped number ----------------


class DividesByANumber(Block):
    """``x / 3.0``: autograd's node saves the 0-dim tensor 3.0 was wrapped in (GPT-2's
    attention divides its scores so), until the backward frees it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x))) / 3.0


class DividesAViewByANumber(Block):
    """The same in place on a view: the node that saved it is inside a CopySlices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        h[:, :WIDTH] /= 3.0
        return x + self.down(h)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("block", [DividesByANumber, DividesAViewByANumber], ids=["out of place", "in place on a view"])
def test_a_block_whose_graph_saves_a_wrapped_number_replays(block: type, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, _make(block), device=device, optimizer=_adamw)
    same_figures(replayed, traced)
    assert "block calls replayed" in replayed.replayed[0], replayed.replayed


def test_the_module_trackers_of_traces_are_not_a_users_global_hook() -> None:
    """A pipeline's ranks trace on threads of one process: each trace's module tracker
    registers its global hooks, and none of them is the user's."""
    from pytest_torchmem.engine.step.built_in import ModuleTracker, QuietProbe
    from pytest_torchmem.engine.tracing.replay_state import global_hooks

    model = _make(Block)()[0]
    with ModuleTracker(model, QuietProbe()), ModuleTracker(model, QuietProbe()):
        assert not global_hooks()
        handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
        try:
            assert global_hooks()
        finally:
            handle.remove()
