"""The values a functional collective hands a rank: integer tensors, each peer holding this rank's.

Under ``parallel=`` one rank is traced over a fake process group: no peer
exists, and a collective's output has a shape but no values. Expert parallel
reads values from one: each rank tells its peers how many of its tokens go to
their experts (``all_to_all_single`` of the counts its router chose), and
splits its tokens' exchange by the counts it gets back (``.tolist()``).

Every rank of the estimate is given the inputs the check is given and holds
the same replicated tensors (the router's weights), so an integer tensor the
trace knows the values of (:mod:`~pytest_torchmem.engine.tracing.values`) is
the one each peer computes at the same point: a peer's counts are this rank's.
A collective of such a tensor is then answered as the ranks would answer it,
each peer's contribution this rank's value. Integer tensors only: the float
tensors that move between ranks (gradients, parameter shards, expert outputs)
differ by rank. The one integer tensor that can differ is one made from a
rank's own number (``torch.tensor([dist.get_rank()])``); the documentation's
limits say so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = ["EXCHANGES", "exchanged"]


def _group(name: str) -> tuple[int, int]:
    """This rank's index in the group named ``name``, and the group's size."""
    group = private("torch.distributed.distributed_c10d._resolve_process_group")(name)
    return group.rank(), group.size()


def _all_to_all(value: torch.Tensor, out_splits: Any, in_splits: Any, name: str) -> torch.Tensor | None:
    rank, size = _group(name)
    sizes = list(in_splits) if in_splits else [value.shape[0] // size] * size
    if len(sizes) != size or sum(sizes) != value.shape[0]:
        return None
    mine = value.split(sizes)[rank]  # what each peer sends this rank: its chunk `rank`
    if out_splits and list(out_splits) != [mine.shape[0]] * size:
        return None  # the sizes say the peers send other than this rank would
    return torch.cat([mine] * size)


def _all_gather(value: torch.Tensor, size: int, name: str) -> torch.Tensor:
    return torch.cat([value] * size)


def _reduced(value: torch.Tensor, op: str, size: int) -> torch.Tensor | None:
    op = op.lower()
    if op == "sum":
        return value * size
    if op in ("avg", "max", "min", "band", "bor"):
        return value.clone()
    if op == "product":
        return value**size
    return None


def _all_reduce(value: torch.Tensor, op: str, name: str) -> torch.Tensor | None:
    return _reduced(value, op, _group(name)[1])


def _reduce_scatter(value: torch.Tensor, op: str, size: int, name: str) -> torch.Tensor | None:
    rank, _ = _group(name)
    reduced = _reduced(value, op, size)
    return None if reduced is None else reduced.chunk(size)[rank].clone()


def _broadcast(value: torch.Tensor, src: int, name: str) -> torch.Tensor:
    return value.clone()


def _ops() -> dict[Any, Callable[..., torch.Tensor | None]]:
    if not torch.distributed.is_available():
        return {}
    functional = torch.ops._c10d_functional
    return {
        functional.all_to_all_single.default: _all_to_all,
        functional.all_gather_into_tensor.default: _all_gather,
        functional.all_reduce.default: _all_reduce,
        functional.reduce_scatter_tensor.default: _reduce_scatter,
        functional.broadcast.default: _broadcast,
    }


#: The functional collectives whose outputs :func:`exchanged` answers.
EXCHANGES: Final = _ops()


def exchanged(func: Any, value: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor | None:
    """The output of the collective ``func`` on this rank, ``value`` being its input's
    value (the other arguments: ``args``) and every peer's too; None where it is not
    known (a float tensor, sizes that say the peers hold otherwise)."""
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return None
    with torch.no_grad():
        return EXCHANGES[func](value, *args)
