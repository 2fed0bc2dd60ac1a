"""The Llama model of the scale benchmark (benchmarks/llama.py), estimated as a user would.

Expected bytes are counted by hand from each configuration's shapes: bfloat16
parameters take 2 bytes an element, their gradients the same, AdamW's
``exp_avg`` and ``exp_avg_sq`` the same again each.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from exactness import flagged_native

import pytest_torchmem as tm
from pytest_torchmem.engine.figures.report import Category

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llama import CONFIGS, LlamaConfig, build, parameter_count

BF16 = 2  # bytes


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def parameter_shapes(cfg: LlamaConfig) -> list[tuple[int, ...]]:
    """Every parameter's shape, written out from the architecture."""
    hd = cfg.dim // cfg.heads
    layer = [
        (cfg.dim,),  # attention_norm
        (cfg.heads * hd, cfg.dim),  # wq
        (cfg.kv_heads * hd, cfg.dim),  # wk
        (cfg.kv_heads * hd, cfg.dim),  # wv
        (cfg.dim, cfg.heads * hd),  # wo
        (cfg.dim,),  # ffn_norm
        (cfg.ffn, cfg.dim),  # w1
        (cfg.dim, cfg.ffn),  # w2
        (cfg.ffn, cfg.dim),  # w3
    ]
    return [(cfg.vocab, cfg.dim), *layer * cfg.layers, (cfg.dim,), (cfg.vocab, cfg.dim)]


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def cuda_block(nbytes: int) -> int:
    """The caching allocator's block for a request: a multiple of 512 bytes."""
    return -(-nbytes // 512) * 512


def tokens(cfg: LlamaConfig, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_parameter_counts_are_llama_2s() -> None:
    """The 7B and 70B shapes have Llama 2's published parameter counts."""
    assert parameter_count(CONFIGS["7b"]) == 6_738_415_616
    assert parameter_count(CONFIGS["70b"]) == 68_976_648_192
    for cfg in CONFIGS.values():
        assert parameter_count(cfg) == sum(numel(s) for s in parameter_shapes(cfg))
    model = build(CONFIGS["tiny"])
    assert [tuple(p.shape) for p in model.parameters()] == parameter_shapes(CONFIGS["tiny"])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_tiny_step_on_cpu_matches_measure_and_hand_count(threads: int) -> None:
    """Real bf16 tensors: estimate == measure in every phase; at the loop's peak (its
    backward, AdamW's state alive) the parameters and the state are exactly the
    configuration's bytes, and the first step's peak is its optimizer step."""
    cfg = CONFIGS["tiny"]
    torch.manual_seed(0)
    model = build(cfg, "cpu")
    x = tokens(cfg, 2, 32)
    est = tm.estimate(model, (x, x), device="cpu", optimizer=adamw)
    if not flagged_native(est):  # else exact on the avx512 level (.ci/run caps to it)
        measured = tm.measure(model, (x, x), device="cpu", optimizer=adamw)
        assert est.phase_peaks() == measured.phase_peaks()
        assert est.first_step == measured.first_step
        assert est.unsupported == ()

    weights = sum(numel(s) for s in parameter_shapes(cfg)) * BF16
    n_tensors = len(parameter_shapes(cfg))
    assert est.first_step is not None and est.first_step.peak == est.first_step.step
    assert est.peak == est.backward_peak
    assert est.breakdown[Category.PARAMETERS] == weights
    assert est.breakdown[Category.GRADIENTS] <= weights  # those made so far (none yet)
    # exp_avg and exp_avg_sq, and each parameter's float32 step counter (CPU tensors)
    assert est.breakdown[Category.OPTIMIZER_STATE] == 2 * weights + 4 * n_tensors
    assert est.breakdown[Category.BUFFERS] == cfg.head_dim // 2 * 4  # float32 inv_freq


def test_tiny_step_on_cuda_hand_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake cuda: every storage is charged its 512-byte block; AdamW defaults to
    foreach, whose ``_foreach_sqrt(exp_avg_sqs)`` list is live at the step peak,
    and keeps its step counters on the host. (cuBLAS workspaces cached, as before
    torch 2.15: with 2.15's per-call workspaces the peak may move into a matmul.)"""
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "1")
    cfg = CONFIGS["tiny"]
    est = tm.estimate(build(cfg), (tokens(cfg, 2, 32),) * 2, device="cuda", optimizer=adamw)
    blocks = sum(cuda_block(numel(s) * BF16) for s in parameter_shapes(cfg))
    assert est.first_step is not None and est.first_step.peak == est.first_step.step == est.step_peak
    # the loop's peak is its backward, with AdamW's state alive
    assert est.peak == est.backward_peak
    assert est.breakdown[Category.PARAMETERS] == blocks
    assert est.breakdown[Category.OPTIMIZER_STATE] == 2 * blocks
    # at the step's peak: parameters, gradients, the two states and the sqrt list, beside
    # the inputs, the buffers and the two cuBLAS workspaces, alive all along, and the
    # loss (one 512-byte block: the step holds it until the iteration ends)
    lasting = sum(est.breakdown[c] for c in (Category.INPUTS, Category.BUFFERS, Category.WORKSPACE))
    assert est.step_peak == 5 * blocks + lasting + 512


def test_meta_model_of_7b_width() -> None:
    """Two decoder layers of the 7B shape, built on meta, on 256 tokens: no real
    memory needed, and the step peak holds the hand-counted bytes."""
    cfg = dataclasses.replace(CONFIGS["7b"], layers=2)
    model = build(cfg)
    est = tm.estimate(model, (tokens(cfg, 1, 256),) * 2, device="cuda", optimizer=adamw)
    # 2 x 32000 x 4096 (embedding, head) + 2 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) + 4096
    weights = (2 * 32000 * 4096 + 2 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096) * BF16
    assert est.breakdown[Category.PARAMETERS] == weights  # every tensor a multiple of 512 B
    assert est.breakdown[Category.GRADIENTS] == weights
    assert est.breakdown[Category.OPTIMIZER_STATE] == 2 * weights
    assert est.breakdown[Category.TEMPORARIES] == weights  # foreach AdamW's sqrt(exp_avg_sq)
    assert est.step_peak >= 5 * weights
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(p.grad is None for p in model.parameters())

    forward = tm.estimate(model, tokens(cfg, 1, 256), device="cuda", train=False)
    # at least the parameters and the bf16 logits (256 x 32000)
    assert forward.forward_peak >= weights + 256 * 32000 * BF16
    assert forward.backward_peak == forward.step_peak == 0


FP32 = 4  # bytes
MiB = 2**20


def cuda_block_of_large(nbytes: int) -> int:
    """The block a request gets from the caching allocator, counted by hand from
    CUDACachingAllocator.cpp: a request rounds up to 512 B; one over 10 MiB gets a
    segment rounded up to 2 MiB, and keeps it whole when what is left over is
    1 MiB or less (a large block splits only above that)."""
    size = cuda_block(nbytes)
    if size <= 10 * MiB:
        return size
    segment = -(-size // (2 * MiB)) * (2 * MiB)
    return segment if segment - size <= MiB else size


def fsdp2_mixed_precision(model: torch.nn.Module, mesh: object) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:  # type: ignore[attr-defined]
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


@pytest.mark.parametrize("world", [8, 64])
def test_llama_7b_fsdp2_per_rank_hand_count_on_cuda(world: int) -> None:
    """Llama 2 7B, FSDP2 per decoder layer and root over ``world`` fake ranks,
    float32 parameters sharded (AdamW state float32), bfloat16 compute: a rank
    holds 1/world of every parameter (each shards along dim 0; every dim 0 here
    divides by 8 and 64), of the float32 gradients and of exp_avg/exp_avg_sq
    (the step counters stay on the host). At world 8 the peak is the first
    step's optimizer step, which makes the state; at world 64 it is the loop's
    backward, where the state is alive and one decoder layer is unsharded: its
    bfloat16 all-gather output and its float32 gradients, the reduce-scatter's
    input, are live at the peak."""
    cfg = CONFIGS["7b"]
    model = build(cfg, dtype=torch.float32)
    ids = tokens(cfg, 1, 64)
    report = tm.estimate(
        model, (ids, ids), device="cuda", optimizer=adamw,
        parallel=tm.Parallel(mesh={"dp": world}, apply=fsdp2_mixed_precision),
    )
    shards = [numel(shape) // world * FP32 for shape in parameter_shapes(cfg)]
    parameters = 4 * parameter_count(cfg) // world
    assert sum(shards) == parameters
    breakdown = report.breakdown
    # every shard is a storage of its own: its caching-allocator block
    assert breakdown[Category.PARAMETERS] == sum(cuda_block_of_large(n) for n in shards)
    assert [entry.op for entry in report.unsupported if "NCCL" in entry.op] == ["parallel= on cuda: NCCL"]
    layer = numel((cfg.dim,)) * 2 + numel((cfg.dim, cfg.dim)) * 4 + numel((cfg.ffn, cfg.dim)) * 3
    assert report.first_step is not None
    if world == 8:
        assert report.peak == report.first_step.step
        # the gradients (made in the first backward) and the state (in its step) come
        # from blocks the step's own tensors freed (the step starts after apply, whose
        # cached blocks it does not inherit): a tensor served from a larger cached block
        # keeps a remainder under 1 MiB in it (a large block is split only above 1 MiB),
        # charged to it
        assert parameters <= breakdown[Category.GRADIENTS] < parameters + len(shards) * MiB
        state = breakdown[Category.OPTIMIZER_STATE]
        assert 2 * parameters <= state < 2 * (parameters + len(shards) * MiB)
    else:
        assert report.peak == report.backward_peak
        # exp_avg and exp_avg_sq of every shard (582 zeros_like, two per shard), made by
        # the first step and alive through the loop's backward. They are made mid-step, so
        # the caching allocator serves some from larger cached blocks it does not split
        # (a remainder under 1 MiB stays in the block: the 8,192,000 B shards of the
        # embedding and the head take 8 MiB each): more than the shards' own blocks, which
        # the parameters, made before the step, are charged
        assert breakdown[Category.OPTIMIZER_STATE] >= 2 * breakdown[Category.PARAMETERS]
        all_gather, reduce_scatter_input = layer * BF16, layer * FP32
        assert breakdown[Category.TEMPORARIES] >= all_gather + reduce_scatter_input
