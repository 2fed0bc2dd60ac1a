"""Pipeline parallel: each stage's memory under its schedule, on a CPU-only machine.

A four-block model is split into two ``torch.distributed.pipelining`` stages, each
stage's blocks sharded with FSDP2 over the data-parallel dimension, as torchtitan
builds a rank (pp=2 x dp=2: four ranks, no processes, no GPUs). The schedule is
1F1B with four micro-batches. The first test budgets the first stage's rank; the
second records the worst rank of the whole mesh (``rank="max"``, every distinct
rank traced) and asks that it fit a T4. Run it with ``pytest examples/pipeline``;
after a change, accept the new figures with ``pytest --torchmem-update
examples/pipeline`` and commit the diff of ``examples/pipeline/__torchmem__``.
"""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import pytest_torchmem as tm

RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
pytestmark = pytest.mark.skipif(
    not (2, 12) <= RELEASE <= (2, 15),
    reason="pytest-torchmem follows the pipelining of torch 2.12 to 2.15",
)


class Blocks(nn.Module):
    def __init__(self, width: int = 128, hidden: int = 512, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def stage_of(model: Blocks, mesh) -> PipelineStage:
    """The rank's stage, as the training script builds it: its share of the blocks,
    each sharded over the data-parallel dimension."""
    pp = mesh["pp"]
    stage, stages = pp.get_local_rank(), pp.size()
    per = len(model.blocks) // stages
    model.blocks = nn.ModuleList(list(model.blocks)[stage * per : (stage + 1) * per])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    device = torch.device("cuda" if mesh.device_type == "meta" else "cpu")
    return PipelineStage(model, stage, stages, device, group=pp.get_group())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


PIPELINE = tm.Parallel(mesh={"pp": 2, "dp": 2}, apply=stage_of, schedule=Schedule1F1B, microbatches=4)


# The first stage's rank: its two blocks' shards, AdamW state, and the activations
# of the micro-batches 1F1B keeps alive (stages - rank = 2 in the warm-up). On the
# fake cuda device (an H100) most of it is cuBLAS workspace.
@pytest.mark.memory_budget(peak="80 MiB")
def test_first_stage_fits_its_budget(torchmem):
    torchmem.check(Blocks(), torch.randn(32, 128), optimizer=adamw, parallel=PIPELINE)


# The worst rank of the mesh: every distinct rank is traced (one trace of a pipeline
# gives both stages; dp's two ends hold the same, so dp counts once), and the one
# with the highest peak is recorded and must fit a T4.
@pytest.mark.memory_budget(rank="max", fits="T4")
def test_worst_rank_fits_a_t4(torchmem):
    torchmem.check(Blocks(), torch.randn(32, 128), optimizer=adamw, parallel=PIPELINE)
