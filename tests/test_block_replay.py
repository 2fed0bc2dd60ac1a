"""Trace once, replay the rest, within a forward (issue 40): a model's repeated blocks are
replayed with the same figures as tracing every block, or traced where they may differ,
and the report says which."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from replay_checks import both, both_steps, same_figures, transformers_decoder

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_private import present
from pytest_torchmem.engine.tracing.replay import ENV


def _blocks_line(report: tm.MemoryReport, name: str) -> str:
    [line] = [line for line in report.replayed if line.startswith(f"{name}: ") or line.startswith("blocks traced")]
    return line


def _replayed_calls(report: tm.MemoryReport, name: str) -> int:
    found = re.fullmatch(rf"{re.escape(name)}: (\d+) of (\d+) block calls replayed \(forward and backward[^)]*\)",
                         _blocks_line(report, name))
    assert found, report.replayed
    return int(found.group(1))


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


# -- models: the benchmarks' Llama, torch's own encoder, a residual MLP in a Sequential ---------


def _llama(layers: int = 8) -> Any:
    from benchmarks.llama import LlamaConfig, build

    config = LlamaConfig(dim=128, layers=layers, heads=4, kv_heads=2, ffn=256, vocab=500)

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        tokens = torch.randint(0, config.vocab, (2, 32))
        return build(config, dtype=torch.float32), (tokens, tokens)

    return make


class _Encoder(nn.Module):
    """``nn.TransformerEncoder`` as its users write it: copies of one layer (post-norm or
    pre-norm), a head, a loss."""

    def __init__(self, norm_first: bool, layers: int = 8) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.encoder(x).mean(1)), y)


def _encoder(norm_first: bool) -> Any:
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return _Encoder(norm_first), (torch.randn(4, 16, 64), torch.randint(0, 10, (4,)))

    return make


class _Residual(nn.Module):
    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


def _sequential(block: type[nn.Module] = _Residual, blocks: int = 8) -> Any:
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 96), *(block() for _ in range(blocks)), nn.Linear(96, 4))
        return model, torch.randn(16, 32)

    return make


def _stages() -> Any:
    """A backbone's stages in one list: seven blocks of one width, then seven of another
    (the blocks alike are each stage's, and each stage's last are traced)."""

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        wide = [_Residual(96) for _ in range(7)]
        narrow = [_Residual(64) for _ in range(7)]
        return nn.Sequential(nn.Linear(32, 96), *wide, nn.Linear(96, 64), *narrow, nn.Linear(64, 4)), torch.randn(8, 32)

    return make


MODELS = {
    "llama": (_llama(), "layers"),
    "encoder post-norm": (_encoder(False), "encoder.layers"),
    "encoder pre-norm": (_encoder(True), "encoder.layers"),
    "sequential": (_sequential(), "(model)"),
    "stages": (_stages(), "(model)"),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(
    "options",
    [dict(optimizer=_adamw), {}, dict(train=False)],
    ids=["loop", "once", "forward only"],
)
def test_repeated_blocks_replay_to_the_same_bytes(
    name: str, options: dict[str, Any], device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, blocks = MODELS[name]
    replayed, traced = both(monkeypatch, make, device=device, **options)
    same_figures(replayed, traced)
    assert traced.replayed == ()
    # (the first two calls make the template, the first again where it made a cached
    # workspace; the last two are traced for their backward)
    assert _replayed_calls(replayed, blocks) >= 1


def test_the_sequential_block_names_the_model() -> None:
    # (a Sequential model's blocks are the model's own children: the report names the root)
    report = tm.estimate(*_sequential()())
    assert _replayed_calls(report, "(model)") == 3  # (8 blocks: 2 make the template, 3 traced at the end)


def test_each_stage_of_a_backbone_replays_its_own_blocks() -> None:
    # (seven of each width: two make each template, three are traced at each stage's end;
    # a stage's replayed blocks have its own last blocks' backward, never the other's)
    report = tm.estimate(*_stages()(), optimizer=_adamw)
    assert _replayed_calls(report, "(model)") == 4


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_leak_check_replays_blocks_to_the_same_growth(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, _llama(6), tm.leaks, device=device, optimizer=_adamw, iterations=3)
    assert (replayed.held, replayed.growth, replayed.per_iteration) == (traced.held, traced.growth, traced.per_iteration)


def test_replayed_blocks_are_what_a_real_run_measures() -> None:
    make = _sequential()
    estimated = tm.estimate(*make(), optimizer=_adamw)
    assert _replayed_calls(estimated, "(model)") == 3
    assert estimated.phase_peaks() == tm.measure(*make(), optimizer=_adamw).phase_peaks()


# -- what may differ between blocks is traced, and says why ------------------------------------


class _Caches(_Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = super().forward(x)
        return self.last


class _ReadsValues(_Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h[:, h[0] > 0].sum(1, keepdim=True).expand(-1, h.shape[1]) + h


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _CustomFunction(_Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scaled.apply(super().forward(x))


class _Checkpointed(_Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


class _Numbered(_Residual):
    count = 0

    def __init__(self) -> None:
        super().__init__()
        _Numbered.count += 1
        self.layer_idx = _Numbered.count  # (as transformers' decoder layers are numbered)


@pytest.mark.parametrize(
    ("block", "why"),
    [
        (_Caches, "a block changed its own attributes"),
        (_ReadsValues, "a block read tensor values"),
        (_CustomFunction, "a block runs a custom autograd function"),
        (_Checkpointed, "a block saves tensors through hooks (a checkpoint)"),
    ],
    ids=["cache", "values", "function", "checkpoint"],
)
def test_blocks_that_may_differ_are_traced_and_say_why(block: Any, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, _sequential(block), optimizer=_adamw)
    same_figures(replayed, traced)
    line = _blocks_line(replayed, "(model)")
    assert line.startswith("(model): blocks traced (") and why in line, replayed.replayed


class _ReadsItsIndex(_Numbered):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h.clone() if self.layer_idx % 2 else h  # (every other block runs one more op)


def test_blocks_that_differ_in_an_attribute_their_forward_reads_are_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    replayed, traced = both(monkeypatch, _sequential(_ReadsItsIndex), optimizer=_adamw)
    same_figures(replayed, traced)
    line = _blocks_line(replayed, "(model)")
    assert line == "(model): blocks traced (its blocks differ in attribute layer_idx, which their forward reads)"


def test_blocks_that_differ_in_an_attribute_their_forward_never_reads_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    # (what the traced calls read is watched without touching the blocks: both() checks the
    # model's fingerprint, types included, and every module's attributes after)
    replayed, traced = both(monkeypatch, _sequential(_Numbered), optimizer=_adamw)
    same_figures(replayed, traced)
    assert _blocks_line(replayed, "(model)") == (
        "(model): 3 of 8 block calls replayed (forward and backward; their layer_idx, never read, differ)"
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_transformers_decoder_layers_replay(name: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' numbered decoder layers, trained without a KV cache (with one:
    tests/test_replay_kv_cache.py)."""
    replayed, traced = both(monkeypatch, transformers_decoder(name, False), device=device, optimizer=_adamw)
    same_figures(replayed, traced)
    layers = "transformer.h" if name == "gpt2" else "model.layers"
    line = _blocks_line(replayed, layers)
    assert re.fullmatch(rf"{layers}: \d+ of \d+ block calls replayed \(forward and backward; their layer_idx, never "
                        r"read, differ\)", line), line
    # (the masks read the positions' values: made of arange, alike in each iteration)
    assert "iteration 2: forward and backward replayed from iteration 1" in replayed.replayed, replayed.replayed


# -- per-instance callables: a fine-tuning library's layers each hold their own closure ------


def _gelu_call(scale: float) -> Any:
    def _attention_call(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) * scale

    return _attention_call


class _HoldsACall(_Residual):
    """Calls a callable of its own between its projections (a closure each instance made,
    as a fine-tuning library's attention layers hold ``_attention_call``)."""

    def __init__(self) -> None:
        super().__init__()
        self.call = _gelu_call(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.call(self.up(self.norm(x)))))


class _HoldsABoundMethod(_HoldsACall):
    def __init__(self) -> None:
        super().__init__()
        self.call = self.activation

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm.weight[:1] * x)


class _HoldsAPartial(_HoldsACall):
    def __init__(self) -> None:
        super().__init__()
        self.call = functools.partial(F.gelu, approximate="tanh")


class _HoldsALambda(_HoldsACall):
    def __init__(self) -> None:
        super().__init__()
        self.call = lambda x: F.gelu(x).square()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("block", [_HoldsACall, _HoldsABoundMethod, _HoldsAPartial, _HoldsALambda],
                         ids=["closure", "bound method", "partial", "lambda"])
def test_blocks_holding_their_own_closure_of_one_function_replay(
    block: type[nn.Module], device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block's callable is another object, of one function (its code, defaults and
    what it closes over alike; a bound method's object is each block itself): one program."""
    replayed, traced = both(monkeypatch, _sequential(block), device=device, optimizer=_adamw)
    same_figures(replayed, traced)
    assert _replayed_calls(replayed, "(model)") == 3
    if device == "cpu":
        assert replayed.phase_peaks() == tm.measure(*_sequential(block)(), optimizer=_adamw).phase_peaks()


class _HoldsItsOwnScale(_HoldsACall):
    """Every other block closes over another scale (which one holds which moves no byte)."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        _HoldsItsOwnScale.made += 1
        self.call = _gelu_call(1.0 if _HoldsItsOwnScale.made % 2 else 2.0)


def _counter() -> Any:
    calls = 0

    def gated(x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return x * x.sigmoid() if calls % 2 else x  # (every other call saves two more tensors)

    return gated


_COUNTED = _counter()


class _CallsACountingClosure(_Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _COUNTED(super().forward(x))


@pytest.mark.parametrize(
    ("block", "why"),
    [
        (_HoldsItsOwnScale, "(model): blocks traced (its blocks differ: their attribute call)"),
        (_CallsACountingClosure, "(model): blocks traced (a block assigns or changes the variable calls of a closure)"),
    ],
    ids=["closes over another value", "steps a closure's counter"],
)
def test_blocks_whose_closures_differ_or_change_are_traced(block: Any, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # (7 blocks: the counter's parity at a block differs in the loop's second iteration,
    # which the loop's replay sees in the closure's variable)
    replayed, traced = both(monkeypatch, _sequential(block, blocks=7), optimizer=_adamw)
    same_figures(replayed, traced)
    assert _blocks_line(replayed, "(model)") == why
    if block is _CallsACountingClosure:
        assert ("iteration 2: forward and backward traced (the global _COUNTED's variable calls of the model's code "
                "changed since the first iteration)") in replayed.replayed


class _TakesAScale(_Residual):
    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        h = super().forward(x)
        return h if scale is None else h * scale + h


_SEEN: list[Any] = []


class _PassesWhatTheForwardTakes(nn.Module):
    """Passes ``scale`` only to the blocks whose forward takes it, as libraries ask a
    layer's signature; notes what each block's ``forward`` looked like."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 96)
        self.blocks = nn.ModuleList(_TakesAScale() for _ in range(8))
        self.out = nn.Linear(96, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            forward = block.forward
            _SEEN.append((str(inspect.signature(forward)), forward.__name__, forward.__self__ is block,
                          forward.__func__ is type(block).forward, forward.__doc__))
            h = block(h, scale=2.0) if "scale" in inspect.signature(forward).parameters else block(h)
        return self.out(h)


def test_a_replayed_blocks_forward_looks_like_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """While blocks replay, a block's ``forward`` is the bound method to the program: a
    signature that hid ``scale`` made every block skip it (another program's figures,
    silently), and reading its ``__name__`` raised."""

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return _PassesWhatTheForwardTakes(), torch.randn(16, 32)

    replayed, traced = both(monkeypatch, make, optimizer=_adamw)
    same_figures(replayed, traced)
    assert _replayed_calls(replayed, "blocks") >= 3
    _SEEN.clear()
    assert replayed.phase_peaks() == tm.measure(*make(), optimizer=_adamw).phase_peaks()
    real = list(_SEEN)
    _SEEN.clear()
    tm.estimate(*make(), optimizer=_adamw)
    assert _SEEN == real and len(real) == 16  # (two iterations of eight blocks)
    assert "scale" in real[0][0] and real[0][1:] == ("forward", True, True, None)


_KEPT: list[torch.Tensor] = []


class _KeepsAside(_Residual):
    """Keeps a tensor it made in a list of its own module's (not its attributes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        _KEPT.append(h.exp())
        return h


def test_frozen_blocks_that_keep_tensors_are_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frozen blocks under grad mode make no graph: what they keep is kept, not saved for a
    backward that would free it."""

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        _KEPT.clear()
        model = nn.Sequential(*(_KeepsAside() for _ in range(8)), nn.Linear(96, 4))
        model[:8].requires_grad_(False)
        return model, torch.randn(16, 96)

    replayed, traced = both(monkeypatch, make)
    same_figures(replayed, traced)
    # (what they keep, they keep in a global list: the watch sees its length change)
    assert _blocks_line(replayed, "(model)") == "(model): blocks traced (a block assigns or changes the global _KEPT)"


class _SideOutputs(nn.Module):
    """The loss reads an early block's output only: the last blocks have no backward, and a
    replayed block's backward runs before any was recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Residual() for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        h = x
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        return outs[3].square().mean()


def test_a_replay_that_cannot_stand_is_traced_again(monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return _SideOutputs(), (torch.randn(16, 96),)

    replayed, traced = both(monkeypatch, make, loss_fn=lambda out: out)
    same_figures(replayed, traced)
    assert replayed.replayed[0].startswith("blocks traced (blocks: a replayed block's backward ran before")


def test_a_replayed_storage_is_the_recorded_one_in_another_module() -> None:
    """The copy a replayed block makes of a recorded storage's info keeps every field (it is
    written field by field, for speed) but the module."""
    import dataclasses

    from pytest_torchmem.engine.figures.report import Category
    from pytest_torchmem.engine.figures.timeline import Frame, Phase, StorageInfo
    from pytest_torchmem.engine.tracing.block_replay import _moved

    values = dict(nbytes=512, category=Category.WORKSPACE, phase=Phase.BACKWARD, module=3, op="aten::mm",
                  frames=(Frame("model.py", 7, "forward"),), node="MmBackward0", pool=2)
    assert {f.name for f in dataclasses.fields(StorageInfo)} == set(values)
    info = StorageInfo(**values)
    assert _moved(info, 9) == dataclasses.replace(info, module=9)


class _Autocast(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(*args)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("llama", "inner.layers: 3 of 8 block calls replayed"),
        # (its blocks' cast weights stay in autocast's cache, alive beyond the block's output
        # and its graph: found as the first block is traced)
        ("encoder pre-norm", "inner.encoder.layers: blocks traced (a block keeps a tensor it made beyond its output and its graph)"),
    ],
)
def test_blocks_under_autocast_replay_or_are_traced_again(name: str, said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make = MODELS[name][0]

    def wrapped() -> tuple[nn.Module, Any]:
        model, inputs = make()
        return _Autocast(model), inputs

    replayed, traced = both(monkeypatch, wrapped, optimizer=_adamw)
    same_figures(replayed, traced)
    assert replayed.replayed[0].startswith(said), replayed.replayed


def test_blocks_are_not_replayed_with_replay_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    assert tm.estimate(*_sequential()(), optimizer=_adamw).replayed == ()


# -- a rank of parallel=: FSDP2's units replay, anything else is traced ------------------------


def _fully_shard(reshard_after_forward: bool = True, bf16: bool = False) -> Any:
    def apply(model: nn.Module, mesh: object) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
        if bf16:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        blocks = model.layers if hasattr(model, "layers") else [m for m in model if isinstance(m, _Residual)]
        for block in blocks:
            fully_shard(block, **options)
        return fully_shard(model, **options)

    return apply


def _ddp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=mesh.get_group())


needs_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


@needs_gloo
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fsdp2_units_replay_on_a_rank_to_the_same_bytes(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decoder layer an FSDP2 unit (bf16 compute over fp32 shards), rank 1 of 4, an
    AdamW loop: the all-gathers before each layer's forward and backward and the
    reduce-scatters after its backward are FSDP2's hooks, outside the layer's forward,
    traced for every layer; what runs inside replays."""
    parallel = tm.Parallel(mesh={"dp": 4}, apply=_fully_shard(bf16=True), rank=1)
    replayed, traced = both(monkeypatch, _llama(), device=device, parallel=parallel, optimizer=_adamw)
    same_figures(replayed, traced)
    assert traced.replayed == ()
    # (8 layers in each of two iterations: 2 or 3 make the template, 3 traced at the end)
    assert _replayed_calls(replayed, "layers") >= 4


@needs_gloo
@pytest.mark.parametrize("options", [{}, dict(train=False)], ids=["once", "forward only"])
def test_fsdp2_units_kept_gathered_after_forward_replay(options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # (reshard_after_forward=False: a unit's parameters stay gathered from its forward to
    # its backward, and its backward gathers nothing)
    parallel = tm.Parallel(mesh={"dp": 2}, apply=_fully_shard(reshard_after_forward=False))
    replayed, traced = both(monkeypatch, _sequential(), parallel=parallel, **options)
    same_figures(replayed, traced)
    assert _replayed_calls(replayed, "(model)") == 3  # (8 blocks: 2 make the template, 3 traced at the end)


def _tensor_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    for name, block in model.named_children():
        if isinstance(block, _Residual):
            plan[f"{name}.up"], plan[f"{name}.down"] = ColwiseParallel(), RowwiseParallel()
    return parallelize_module(model, mesh, plan)


@needs_gloo
@pytest.mark.parametrize(
    ("mesh", "apply"),
    [({"dp": 2}, _ddp), ({"tp": 2}, _tensor_parallel)],
    ids=["ddp", "tensor parallel"],
)
def test_blocks_under_ddp_or_tensor_parallel_are_traced_and_say_why(
    mesh: dict[str, int], apply: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (DDP's reducer hooks every parameter's gradient in C++, which a replayed backward would
    # skip; tensor parallel's hooks redistribute the blocks' inputs and outputs as DTensors)
    parallel = tm.Parallel(mesh=mesh, apply=apply)
    replayed, traced = both(monkeypatch, _sequential(), parallel=parallel, optimizer=_adamw)
    same_figures(replayed, traced)
    assert replayed.replayed == ("blocks traced (under parallel=, only FSDP2's fully_shard units replay)",)


# -- tensor parallel inside FSDP2's units, and a pipeline's stages ---------------------------

def _policy(bf16: bool = True) -> Any:
    """bf16 compute over fp32 shards, gradients reduced in fp32 (torchtitan's); else none."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()


def _tensor_parallel_units(layers: list[nn.Module], mesh: Any, bf16: bool = True) -> None:
    """torchtitan's layout: each decoder layer tensor-parallel over ``mesh["tp"]`` (query, key,
    value and the MLP's first projections by columns, the outputs by rows), then an FSDP2
    unit over ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh["tp"]
    plan = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for layer in layers:
        parallelize_module(layer, tp, plan)
        layer.attention.heads //= tp.size()
        layer.attention.kv_heads //= tp.size()
        fully_shard(layer, mesh=mesh["dp"], mp_policy=_policy(bf16))


def _tp_fsdp2(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    _tensor_parallel_units(list(model.layers), mesh)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=_policy())


@needs_gloo
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tensor_parallel_inside_fsdp2_units_replays_to_the_same_bytes(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dp 2 x tp 2, rank 1, an AdamW loop: tensor parallel's hooks and DTensor's autograd
    functions run inside each layer's forward and backward, and the replayed backward
    leaves DTensor gradients of the recorded layouts for FSDP2's reduce-scatter."""
    parallel = tm.Parallel(mesh={"dp": 2, "tp": 2}, apply=_tp_fsdp2, rank=1)
    replayed, traced = both(monkeypatch, _llama(), device=device, parallel=parallel, optimizer=_adamw)
    same_figures(replayed, traced)
    assert traced.replayed == ()
    # (8 layers, two iterations: the first makes the template with 2 or 3 and traces its
    # last 3; the second traces only its first and its last)
    assert _replayed_calls(replayed, "layers") >= 2 + 6


class _Stage(nn.Module):
    """One pipeline stage of the benchmarks' Llama, as torchtitan splits it: its share of
    the layers, the embedding on the first, the norm and head on the last."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        count = len(model.layers)
        self.inv_freq = model.inv_freq
        self.tok_embeddings = model.tok_embeddings if stage == 0 else None
        self.layers = nn.ModuleList(list(model.layers)[stage * count // stages : (stage + 1) * count // stages])
        self.norm = model.norm if stage == stages - 1 else None
        self.output = model.output if stage == stages - 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        angles = torch.outer(torch.arange(h.shape[1], device=h.device, dtype=torch.float32), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h if self.output is None else self.output(self.norm(h))


def _pipeline_stage(model: nn.Module, mesh: Any, bf16: bool = True) -> Any:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"]
    stage = _Stage(model, pp.get_local_rank(), pp.size())
    _tensor_parallel_units(list(stage.layers), mesh, bf16)
    fully_shard(stage, mesh=mesh["dp"], mp_policy=_policy(bf16))
    device = torch.device("cuda" if mesh.device_type == "meta" else "cpu")
    return PipelineStage(stage, pp.get_local_rank(), pp.size(), device, group=pp.get_group())


def _pipelined_llama() -> Any:
    from benchmarks.llama import LlamaConfig, build

    config = LlamaConfig(dim=128, layers=16, heads=4, kv_heads=2, ffn=256, vocab=500)

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return build(config, dtype=torch.float32), torch.randint(0, config.vocab, (8, 32))

    return make


def _pipelines_followed() -> bool:
    from pytest_torchmem.engine.torch_compat.torch_release import PIPELINING, torch_minor

    return PIPELINING[0] <= torch_minor() <= PIPELINING[1]


@needs_gloo
@pytest.mark.skipif(not _pipelines_followed(), reason="the estimate follows the pipelining of torch 2.12 to 2.15")
@pytest.mark.parametrize(("schedule", "device"), [("1F1B", "cuda"), ("GPipe", "cpu")])
@pytest.mark.parametrize("stage", ["first", "last"])
def test_pipeline_stages_replay_their_blocks_to_the_same_bytes(
    schedule: str, device: str, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp 2 x dp 2 x tp 2, 4 micro-batches: each stage's 8 layers (tensor parallel inside
    FSDP2 units) replay in the set-up's forward and in every micro-batch's; the figures,
    module by module, are those of the trace of every block."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    parallel = tm.Parallel(
        mesh={"pp": 2, "dp": 2, "tp": 2},
        apply=_pipeline_stage,
        schedule=Schedule1F1B if schedule == "1F1B" else ScheduleGPipe,
        microbatches=4,
        rank=0 if stage == "first" else 7,
    )
    replayed, traced = both(monkeypatch, _pipelined_llama(), device=device, parallel=parallel, optimizer=_adamw)
    same_figures(replayed, traced)
    assert traced.replayed == ()
    if present("torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.to_accumulated_grad_if_needed"):
        # (two iterations of 4 micro-batches, and the set-up's forward: in each forward after
        # the one that made the template, the first layer and the last 3 are traced, 4
        # replay, and once a backward is the template, only the first and the last are)
        assert _replayed_calls(replayed, "stages.0.layers") >= 2 * 4 * 4
    else:
        # (torch 2.15 keeps each micro-batch's gradients on the gathered parameters: only
        # the set-up's blocks replay)
        assert 0 < _replayed_calls(replayed, "stages.0.layers") <= 4


def _two_stages_per_rank(model: nn.Module, mesh: Any) -> list[Any]:
    """A rank's two stages of a schedule of several per rank: ``pp`` ranks hold 2 x ``pp``
    stages, the rank at ``i`` stages ``i`` and ``i + pp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"]
    count = 2 * pp.size()
    stages = []
    for index in (pp.get_local_rank(), pp.get_local_rank() + pp.size()):
        stage = _Stage(model, index, count)
        _tensor_parallel_units(list(stage.layers), mesh)
        fully_shard(stage, mesh=mesh["dp"], mp_policy=_policy())
        device = torch.device("cuda" if mesh.device_type == "meta" else "cpu")
        stages.append(PipelineStage(stage, index, count, device, group=pp.get_group()))
    return stages


@needs_gloo
@pytest.mark.skipif(not _pipelines_followed(), reason="the estimate follows the pipelining of torch 2.12 to 2.15")
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS"])
def test_several_stages_per_rank_replay_their_blocks_to_the_same_bytes(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stages per rank of 6 layers each: each stage's list replays in its own groups."""
    from benchmarks.llama import LlamaConfig, build
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleLoopedBFS

    config = LlamaConfig(dim=128, layers=24, heads=4, kv_heads=2, ffn=256, vocab=500)

    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return build(config, dtype=torch.float32), torch.randint(0, config.vocab, (8, 32))

    parallel = tm.Parallel(
        mesh={"pp": 2, "dp": 2, "tp": 2},
        apply=_two_stages_per_rank,
        schedule=ScheduleInterleaved1F1B if schedule == "Interleaved1F1B" else ScheduleLoopedBFS,
        microbatches=4,
    )
    replayed, traced = both(monkeypatch, make, device="cuda", parallel=parallel, optimizer=_adamw)
    same_figures(replayed, traced)
    assert _replayed_calls(replayed, "stages.0.layers") > 0
    assert _replayed_calls(replayed, "stages.1.layers") > 0


def _no_reduce_dtype_pipeline(rank: int) -> Any:
    from torch.distributed.pipelining import Schedule1F1B

    return tm.Parallel(
        mesh={"pp": 2, "dp": 2, "tp": 2},
        apply=functools.partial(_pipeline_stage, bf16=False),
        schedule=Schedule1F1B,
        microbatches=4,
        rank=rank,
    )


@needs_gloo
@pytest.mark.skipif(not _pipelines_followed(), reason="the estimate follows the pipelining of torch 2.12 to 2.15")
def test_a_pipeline_whose_gradients_add_up_over_micro_batches_replays_its_set_up_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FSDP2 without a reduce dtype of its own (and every unit on torch 2.15) keeps each
    micro-batch's gradients on the gathered parameters, where the next micro-batch's
    backward adds to them, which a replayed backward cannot: the first stage, whose warm-up
    runs every forward before any backward, replays only the set-up's blocks."""
    replayed, traced = both(monkeypatch, _pipelined_llama(), device="cuda", parallel=_no_reduce_dtype_pipeline(0), optimizer=_adamw)
    same_figures(replayed, traced)
    assert 0 < _replayed_calls(replayed, "stages.0.layers") <= 4


@needs_gloo
@pytest.mark.skipif(not _pipelines_followed(), reason="the estimate follows the pipelining of torch 2.12 to 2.15")
def test_a_pipeline_replay_that_cannot_stand_is_traced_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a micro-batch's replayed backward finds its blocks' parameters holding an
    earlier one's gradients after all (told here that FSDP2 moves them off when it does
    not), the pipeline is traced again, every block, and says why."""
    from pytest_torchmem.engine.tracing.block_replay import BlockReplay

    monkeypatch.setattr(BlockReplay, "_grads_leave", lambda self, block: True)
    replayed, traced = both(monkeypatch, _pipelined_llama(), device="cuda", parallel=_no_reduce_dtype_pipeline(0), optimizer=_adamw)
    same_figures(replayed, traced)
    assert replayed.replayed == ("blocks traced (stages.0.layers: a block's parameters had gradients before its backward)",)


# -- a step function's blocks -----------------------------------------------------------------


def _one_step(model: nn.Module, batch: Any, opt: torch.optim.Optimizer) -> None:
    model(*batch)["loss"].backward()
    opt.step()
    opt.zero_grad()


def _accumulating(model: nn.Module, batch: Any, opt: torch.optim.Optimizer) -> None:
    # (the second micro-batch's blocks find their parameters' gradients: traced)
    tokens, labels = batch
    for part in range(2):
        model(tokens[part:part + 1], labels[part:part + 1])["loss"].backward()
    opt.step()
    opt.zero_grad()


def _three_steps(model: nn.Module, batch: Any, opt: torch.optim.Optimizer) -> None:
    for _ in range(3):
        _one_step(model, batch, opt)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("step", [_one_step, _accumulating, _three_steps], ids=["one step", "accumulating", "three steps"])
def test_a_step_functions_blocks_replay_to_the_same_bytes(step: Any, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks of the models a step function reaches replay as the built-in step's do
    (the engine's own hooks on them, which count module calls and refuse modules the walk
    did not reach, are the replay's to skip). (A step function of transformers' Llama is
    ``measure`` on cpu: tests/test_replay_kv_cache.py.)"""
    replayed, traced = both_steps(monkeypatch, _llama(8), step, _adamw, device=device)
    same_figures(replayed, traced)
    assert _replayed_calls(replayed, "model.layers") > 0
