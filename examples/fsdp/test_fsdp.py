"""One rank of FSDP2 training: a memory budget per GPU, on a CPU-only machine.

``fully_shard`` runs over a fake process group of 8 ranks (no processes, no
GPUs): the check reports what rank 0 holds, on the fake ``cpu`` and ``cuda``
devices. The second test checks the same parallelization at 64 ranks with the
marker's ``mesh=``. Run it with ``pytest examples/fsdp``; after a change,
accept the new figures with ``pytest --torchmem-update examples/fsdp`` and
commit the diff of ``examples/fsdp/__torchmem__/test_fsdp.json``.
"""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import pytest_torchmem as tm


def make_blocks(width: int = 256, hidden: int = 1024, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(depth)
        ]
    )


def shard(model: nn.Module, mesh) -> nn.Module:
    # float32 shards (and AdamW state), bfloat16 compute, float32 gradient reduction
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


FSDP = tm.Parallel(mesh={"dp": 8}, apply=shard, rank=0)


# The budget is per rank: one GPU of the 8 must fit the training step. On the fake
# cuda device (an H100) most of it is cuBLAS workspace: 32 MiB for the forward's
# stream, 32 MiB more for the backward's.
@pytest.mark.memory_budget(peak="80 MiB")
def test_fsdp_rank_fits_its_budget(torchmem):
    torchmem.check(make_blocks(), torch.randn(32, 256), optimizer=adamw, parallel=FSDP)


# The same sharding at 64 ranks: each rank holds 1/64 of the parameters, gradients
# and optimizer state; the unsharded block in flight stays whole.
@pytest.mark.memory_budget(mesh={"dp": 64})
def test_fsdp_rank_at_64_ranks(torchmem):
    torchmem.check(make_blocks(), torch.randn(32, 256), optimizer=adamw, parallel=FSDP)
