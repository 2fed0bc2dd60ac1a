"""Expert parallel: a mixture of experts whose experts are sharded over ranks, tokens
exchanged with all-to-all, as torchtitan's ``ExpertParallel`` exchanges them.

A rank's memory depends on how many tokens it receives, which its peers' routers
decide: the ranks tell each other their counts (``all_to_all_single`` of integer
tensors) and split the token exchange by them (``.tolist()``). The estimate knows
the values of small tensors computed from the inputs (``tracing/values.py``), and
answers a collective of an integer tensor with each peer holding this rank's value
(``tracing/exchanged_values.py``): every rank is given the same inputs and holds the
same router. The ground truth is ``measure(parallel=...)``: two real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fingerprint import fingerprint
from test_parallel import _a_real_run_equal_to
from torch import nn

import pytest_torchmem as tm

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
    # (the functional collectives user code calls, under the names torch 2.13 deprecates)
    pytest.mark.filterwarnings("ignore:`torch.distributed._functional_collectives.*` is deprecated:FutureWarning"),
]


class Experts(nn.Module):
    """Each expert a SwiGLU-less MLP; the rank's experts' weights stacked."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden) * width**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width) * hidden**-0.5)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` sorted by expert, ``counts[i]`` of them for expert ``i``."""
        out = [F.silu(chunk @ self.w1[i]) @ self.w2[i] for i, chunk in enumerate(torch.split(tokens, counts))]
        return torch.cat(out)


class MoE(nn.Module):
    """Top-2 routing over 4 experts; over an expert-parallel group the experts are
    sharded, and tokens go to the rank of their expert and come back."""

    def __init__(self, width: int = 32, hidden: int = 64, experts: int = 4, top: int = 2) -> None:
        super().__init__()
        self.n, self.top = experts, top
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = Experts(experts, width, hidden)
        self.group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        b, length, width = x.shape
        x = x.reshape(-1, width)
        weights, chosen = self.router(x).softmax(-1).topk(self.top, dim=-1)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.n)  # tokens per expert
        routed = x[order // self.top]
        if self.group is None:
            out = self.experts(routed, counts.tolist())
        else:
            ranks = dist.get_world_size(self.group)
            # how many tokens each rank sends this one, expert by expert
            received = all_to_all_single(counts, None, None, self.group).view(ranks, -1)
            send, recv = counts.view(ranks, -1).sum(1).tolist(), received.sum(1).tolist()
            tokens = all_to_all_single_autograd(routed, recv, send, self.group)
            # they arrive rank by rank: grouped by the rank's experts, and back
            local = received.shape[1]
            by_expert = torch.arange(received.numel()).view(ranks, local).t().flatten().tolist()
            chunks = torch.split(tokens, received.flatten().tolist())
            out = self.experts(torch.cat([chunks[i] for i in by_expert]), received.sum(0).tolist())
            back = torch.split(out, [chunks[i].shape[0] for i in by_expert])
            out = torch.cat([back[by_expert.index(i)] for i in range(len(by_expert))])
            out = all_to_all_single_autograd(out, send, recv, self.group)
        combined = torch.zeros(b * length * self.top, width, dtype=out.dtype).index_copy(0, order, out)
        return (combined.view(b * length, self.top, width) * weights.unsqueeze(-1)).sum(1).view(b, length, width)


class Model(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.moe = MoE(width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x)))


def expert_parallel(model: Model, mesh: object) -> Model:
    """The rank's share of the experts (dimension 0 of their weights), and the group."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = mesh["ep"]  # type: ignore[index]
    experts = model.moe.experts
    for name, weight in list(experts.named_parameters()):
        local = distribute_tensor(weight.detach(), ep, [Shard(0)]).to_local()
        experts.register_parameter(name, nn.Parameter(local))
    model.moe.group = ep.get_group()
    return model


def _inputs() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 16, 32)


def _ep(rank: int | str = 0) -> tm.Parallel:
    return tm.Parallel(mesh={"ep": 2}, apply=expert_parallel, rank=rank)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_equals_real_ranks(rank: int) -> None:
    """Forward and backward of each rank, the tokens it receives decided by the counts
    its peer sends: equal to two real gloo ranks to the byte, nothing flagged."""
    model, x = Model(), _inputs()
    before = fingerprint(model, x)
    estimated = tm.estimate(model, x, parallel=_ep(rank))
    assert estimated.unsupported == ()
    _a_real_run_equal_to(estimated, lambda: tm.measure(model, x, parallel=_ep(rank)))
    assert fingerprint(model, x) == before


def test_the_ranks_differ_by_the_tokens_they_receive() -> None:
    """The router sends more tokens to one rank's experts than to the other's: two
    distinct ranks, the busier one first."""
    model, x = Model(), _inputs()
    entries = tm.every_rank(model, x, parallel=_ep())
    assert [entry.ranks for entry in entries] in ([(0,), (1,)], [(1,), (0,)])
    reports = {rank: tm.estimate(model, x, parallel=_ep(rank)) for rank in (0, 1)}
    assert reports[0].peak != reports[1].peak
    assert entries[0].report.peak == max(report.peak for report in reports.values())


def test_a_routing_the_trace_cannot_know_stops_it() -> None:
    """After an optimizer step the router's weights come from a gradient that went
    through the peer's experts (float values that differ by rank, not exchanged): the
    second iteration's routing is unknown, and the trace stops there, naming the op,
    never a silent figure."""
    model, x = Model(), _inputs()
    with pytest.raises(tm.TraceStopped, match=r"aten\.bincount\.default: output depends on tensor values"):
        tm.estimate(model, x, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), parallel=_ep())


class Exchange(nn.Module):
    """Allocates rows by the value a collective of an integer tensor gives back."""

    def __init__(self, collective: str) -> None:
        super().__init__()
        self.collective = collective
        self.w = nn.Parameter(torch.ones(16))
        self.group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        counts = torch.tensor([3, 5])
        group, ranks = self.group, 2
        if self.collective == "all_reduce":
            rows = funcol.all_reduce(counts, "sum", group).sum()
        elif self.collective == "all_gather":
            rows = funcol.all_gather_tensor(counts, 0, group).sum()
        elif self.collective == "reduce_scatter":
            rows = funcol.reduce_scatter_tensor(counts, "sum", 0, group).sum()
        elif self.collective == "broadcast":
            rows = funcol.broadcast(counts, 0, group).sum()
        else:
            rows = funcol.all_to_all_single(counts, None, None, group).sum()
        wide = x.repeat(int(rows) * ranks, 1)
        return (wide * self.w).sum()


def _grouped(model: Exchange, mesh: object) -> Exchange:
    model.group = mesh.get_group()  # type: ignore[attr-defined]
    return model


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"])
def test_an_exchanged_integer_sizes_a_tensor_as_on_real_ranks(collective: str) -> None:
    """Each functional collective of an integer tensor: the rows allocated from its
    result equal two real gloo ranks' in every phase, on each rank."""
    x = torch.randn(4, 16)
    for rank in (0, 1):
        parallel = tm.Parallel(mesh={"dp": 2}, apply=_grouped, rank=rank)
        estimated = tm.estimate(Exchange(collective), x, parallel=parallel)
        assert estimated.unsupported == ()
        _a_real_run_equal_to(estimated, lambda: tm.measure(Exchange(collective), x, parallel=parallel))
