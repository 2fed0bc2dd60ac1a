"""The context a rank's forward and backward run in: ``Parallel(train_context=...)``.

Context parallel (``context_parallel(mesh["cp"], buffers=..., buffer_seq_dims=...)``)
shards the sequence of the buffers it is given in place and turns SDPA into ring
attention for the block; tensor parallel's ``loss_parallel()`` computes the
cross-entropy over the vocabulary's shards. Both wrap the forward and backward of
each iteration, as torchtitan's ``train_context`` does.

torch runs context parallel on CUDA only (its ring attention has no sharding rule
for the CPU's SDPA kernel), so on cuda its figures are checked by hand, buffer by
buffer, from torch's source; on cpu the estimate raises torch's own error, as a
real gloo run does. ``loss_parallel`` runs on gloo and is compared with real ranks
byte for byte.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fingerprint import fingerprint
from test_parallel import _a_real_run_equal_to
from test_pipeline import BATCH, MICRO_BATCHES, WIDTH, Layers, _schedules, _sgd, follows_pipelining, split
from torch import nn
from zoo import Attention  # SDPA, causal: what ring attention takes over

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


class Ring(nn.Module):
    """Attention over the step's q, k and v: what ring attention holds, and nothing else."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _context_parallel(*seq_dims: int, keep: bool = True):
    """torchtitan's train context: the batch's sequence sharded over ``cp`` for the block
    (``keep=False``: the batch is not restored on exit, ``no_restore_buffers``)."""

    def train_context(model: nn.Module, mesh: object, *batch: torch.Tensor) -> object:
        from torch.distributed.tensor.experimental import context_parallel

        return context_parallel(
            mesh["cp"],  # type: ignore[index]
            buffers=list(batch),
            buffer_seq_dims=list(seq_dims),
            no_restore_buffers=None if keep else set(batch),
        )

    return train_context


def _cp(world: int, *seq_dims: int, rank: int = 0, keep: bool = True) -> tm.Parallel:
    return tm.Parallel(
        mesh={"cp": world},
        apply=lambda model, mesh: model,
        rank=rank,
        train_context=_context_parallel(*seq_dims, keep=keep),
    )


# q, k and v of the hand count: bf16, batch 1, 2 heads, 1,024 tokens, head width 64
B, H, L, D = 1, 2, 1024, 64
S = B * H * L * D * 2  # the bytes of one of them, whole (256 KiB); a rank's shard is S // 2
LSE = B * H * (L // 2) * 4  # a rank's logsumexp: fp32, one per head and token of its shard
SEEDS = 2 * 512  # the kernel's seed and offset: 8 B each, one 512 B block each on cuda


@pytest.mark.parametrize("rank", [0, 1])
def test_ring_attention_forward_by_hand(rank: int) -> None:
    """Each rank's forward peak over two ranks, buffer by buffer, as torch's source makes
    them (torch/distributed/tensor/experimental/_context_parallel/_attention.py:
    ``context_parallel``, ``_templated_ring_attention``, ``_SDPAMerger``), the load
    balancer on (causal): rank 0 holds the sequence's first and last quarter, rank 1 the
    two middle ones. H100: cuDNN attention, its outputs bf16, its logsumexp fp32.
    """
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    report = tm.estimate(Ring(), (q, k, v), device="cuda", train=False, parallel=_cp(2, 2, 2, 2, rank=rank))

    held = (
        3 * S  # q, k, v: the batch stays whole (resize_ to a shard keeps the storage)
        + 3 * S  # context_parallel's clones of them, to restore them on exit
        + 3 * S // 2  # the three shards, held by its list `shards` through the block
        + S // 2  # the last `shard.clone()` of its loop, held by the loop's variable
        + 2 * S  # K and V of both ranks, all-gathered once (_AllGatherRotater)
        + S  # the merged output: the first block's, as fp32 (convert_to_f32)
    )
    # from 2.14 the first block's seed and offset are kept for the result (saved_rest)
    kept = SEEDS if torch_minor() >= (2, 14) else 0
    if rank == 0:
        # the second block is the other rank's K and V against the last quarter of q
        # (partial): the output's and logsumexp's second halves are merged and put back
        at_peak = (
            S // 4  # the block's output, bf16, a quarter of the sequence
            + LSE // 2  # its logsumexp
            + SEEDS
            + S // 2  # its output as fp32
            + S // 2  # the merged half of the output
            + LSE // 2  # the merged half of the logsumexp
            + LSE  # the logsumexp put back whole (_partial_update's cat)
            + S  # the output put back whole, being made (the peak)
        )
    else:
        # the second block is the first half of the other rank's K and V against all of q
        at_peak = (
            LSE  # the first block's logsumexp, the merger's
            + S // 2  # the block's output, bf16
            + LSE  # its logsumexp
            + SEEDS
            + S  # its output as fp32
            + LSE  # sigmoid(block_lse - lse)
            + S  # out - block_out
            + S  # their product, being made (the peak)
        )
    assert report.forward_peak == held + at_peak + kept
    assert report.breakdown[tm.Category.INPUTS] == 3 * S


def test_the_batch_of_each_iteration_is_whole() -> None:
    """A context that keeps the batch sharded (``no_restore_buffers``) leaves the next
    iteration the whole batch, as the loop's next one is: in both iterations the step
    holds what it holds when the batch is restored on exit, less the one copy it keeps
    to restore it (sharded twice, the second would hold a quarter of the sequence)."""
    x = torch.randn(2, 256, 64)

    def estimated(keep: bool) -> tm.MemoryReport:
        return tm.estimate(
            Attention(),
            (x,),
            device="cuda",
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            parallel=_cp(2, 1, keep=keep),
        )

    restored, kept_sharded = estimated(True), estimated(False)
    assert restored.first_step is not None and kept_sharded.first_step is not None
    assert restored.first_step.forward - kept_sharded.first_step.forward == x.nbytes
    assert restored.forward_peak - kept_sharded.forward_peak == x.nbytes
    assert kept_sharded.breakdown[tm.Category.INPUTS] == x.nbytes


def test_context_parallel_takes_a_share_of_the_sequence() -> None:
    """Each rank's activations fall with the ranks the sequence is spread over; the
    batch it is handed stays whole."""
    x = torch.randn(2, 2048, 64, dtype=torch.bfloat16)
    model = Attention().to(torch.bfloat16)
    activations = []
    for world in (2, 4, 8):
        report = tm.estimate(model, (x,), device="cuda", parallel=_cp(world, 1))
        assert report.breakdown[tm.Category.INPUTS] == x.nbytes
        activations.append(report.breakdown[tm.Category.ACTIVATIONS])
    assert activations[0] > activations[1] > activations[2], activations


def test_every_rank_of_a_context_parallel_run() -> None:
    """The ranks of a causal ring differ (the load balancer gives each its own blocks to
    skip or halve): every_rank's entries are each rank's own estimate."""
    x = torch.randn(1, 1024, 64, dtype=torch.bfloat16)
    model = Attention().to(torch.bfloat16)
    entries = tm.every_rank(model, (x,), device="cuda", parallel=_cp(4, 1))
    own = {rank: tm.estimate(model, (x,), device="cuda", parallel=_cp(4, 1, rank=rank)) for rank in range(4)}
    assert sorted(rank for entry in entries for rank in entry.ranks) == [0, 1, 2, 3]
    for entry in entries:
        for rank in entry.ranks:
            assert own[rank].peak == entry.report.peak
            assert own[rank].breakdown == entry.report.breakdown
    assert entries[0].report.reserved_peak == max(report.reserved_peak for report in own.values())


def test_the_users_objects_are_as_they_were() -> None:
    """context_parallel resizes its buffers in place: the user's batch is never one."""
    model, x = Attention(), torch.randn(2, 256, 64)
    before = fingerprint(model, x)
    tm.estimate(model, (x,), device="cuda", parallel=_cp(2, 1, keep=False))
    assert fingerprint(model, x) == before
    assert x.shape == (2, 256, 64)


def test_on_cpu_the_estimate_raises_what_real_ranks_raise() -> None:
    """torch has no context parallel on the CPU: its SDPA kernel there has no sharding
    rule. The estimate says so as two real gloo ranks do."""
    model, x = Attention(), torch.randn(2, 64, 64)
    sdpa = F.scaled_dot_product_attention
    with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu") as estimated:
        tm.estimate(model, (x,), parallel=_cp(2, 1))
    with pytest.raises(RuntimeError) as measured:
        tm.measure(model, (x,), parallel=_cp(2, 1))
    assert "_scaled_dot_product_flash_attention_for_cpu" in str(measured.value)
    assert "does not have a sharding strategy registered" in str(estimated.value)
    # SDPA is torch's again (2.10 to 2.12 leave ring attention's patch when the block raises)
    assert F.scaled_dot_product_attention is sdpa
    tm.estimate(Attention(), torch.randn(2, 64, 64))


class Head(nn.Module):
    """A language model's output head: its logits' vocabulary is what loss_parallel shards."""

    def __init__(self, width: int = 32, vocabulary: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def _vocabulary_parallel(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    plan = {"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return parallelize_module(model, mesh["tp"], plan)  # type: ignore[index]


def _loss_parallel(model: nn.Module, mesh: object, tokens: torch.Tensor) -> object:
    return loss_parallel_context()


def _cross_entropy(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long))


@pytest.mark.parametrize("rank", [0, 1])
def test_loss_parallel_equals_real_ranks(rank: int) -> None:
    """Tensor parallel's cross-entropy over the vocabulary's shards, in the train context
    ``loss_parallel()``: every phase of each rank equal to real gloo ranks'."""
    tokens = torch.randint(0, 256, (4, 64))
    parallel = tm.Parallel(mesh={"tp": 2}, apply=_vocabulary_parallel, rank=rank, train_context=_loss_parallel)
    options = dict(loss_fn=_cross_entropy, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    model = Head()
    before = fingerprint(model, tokens)
    estimated = tm.estimate(model, tokens, parallel=parallel, **options)
    _a_real_run_equal_to(estimated, lambda: tm.measure(model, tokens, parallel=parallel, **options))
    assert fingerprint(model, tokens) == before
    # the context ran: without it, torch refuses the cross-entropy of sharded logits
    with pytest.raises(Exception, match="mixed torch.Tensor and DTensor"):
        tm.estimate(model, tokens, parallel=tm.Parallel(mesh={"tp": 2}, apply=_vocabulary_parallel), **options)


def test_a_train_context_that_is_not_a_context_manager() -> None:
    parallel = tm.Parallel(mesh={"cp": 2}, apply=lambda model, mesh: model, train_context=lambda *a: None)
    with pytest.raises(TypeError, match=r"train_context=\.\.\.\) must return a context manager"):
        tm.estimate(Attention(), torch.randn(1, 8, 64), device="cuda", parallel=parallel)
    with pytest.raises(TypeError, match=r"train_context=\.\.\.\) must be a callable"):
        tm.Parallel(mesh={"cp": 2}, apply=lambda model, mesh: model, train_context=3)  # type: ignore[arg-type]


@follows_pipelining
def test_a_pipeline_with_a_train_context_is_refused() -> None:
    """A pipeline's ranks trace on threads of one process, and context_parallel patches
    torch for the process while it lasts: refused in one line, not a figure."""
    parallel = tm.Parallel(
        mesh={"pp": 2},
        apply=split,
        schedule=_schedules()["GPipe"],
        microbatches=MICRO_BATCHES,
        train_context=lambda model, mesh, x: loss_parallel_context(),
    )
    with pytest.raises(NotImplementedError, match=r"train_context=\.\.\.\)\) is not followed yet"):
        tm.estimate(Layers(), (torch.randn(BATCH, WIDTH),), optimizer=_sgd, parallel=parallel)


def loss_parallel_context() -> object:
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
