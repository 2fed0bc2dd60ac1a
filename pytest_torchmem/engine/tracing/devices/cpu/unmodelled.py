"""CPU rules: kernels whose scratch is known to be missing, listed in ``unsupported``.

Each of these kernels takes buffers from the allocator that no rule follows yet
(found by PyTorch's OpInfo samples against the profiler's allocator events,
``benchmarks/opinfo.py``; torch 2.13). The rule counts the outputs and lists
the call, so that the estimate says it is a lower bound there instead of being
silently short. A rule that models one of them replaces its entry here.
"""

from __future__ import annotations

from typing import Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Inexact, OpCall, Steps

aten = torch.ops.aten

#: op -> what the kernel takes that is not modelled (measured on OpInfo samples).
_UNMODELLED: Final = {
    aten.isin.Tensor_Tensor: "isin's sort-based kernel (isin_sorting: concatenated, "
    "sorted and unique copies) is not modelled",
    aten.isin.Tensor_Scalar: "isin's kernel (a wrapped scalar, then eq) is not modelled",
    aten.isin.Scalar_Tensor: "isin's kernel (a wrapped scalar, then eq) is not modelled",
    aten.multinomial.default: "multinomial's normalised copies, cumulative sums and "
    "random draws are not modelled",
    aten.masked_scatter_backward.default: "masked_scatter_backward's masked_select and "
    "mask sums (value-sized) are not modelled",
    aten._unsafe_masked_index.default: "_unsafe_masked_index's broadcast indices and "
    "masked copies are not modelled",
    aten._unsafe_masked_index_put_accumulate.default: "_unsafe_masked_index_put_accumulate's "
    "broadcast indices and masked copies are not modelled",
    aten.segment_reduce.default: "segment_reduce's lengths/offsets conversions are not modelled",
    aten._segment_reduce_backward.default: "_segment_reduce_backward's lengths/offsets "
    "conversions are not modelled",
    aten._embedding_bag.default: "embedding_bag's offsets, bag and index buffers are not modelled",
    aten._embedding_bag_forward_only.default: "embedding_bag's offsets, bag and index buffers "
    "are not modelled",
    aten._embedding_bag_backward.default: "embedding_bag backward's sorted indices and "
    "counts are not modelled",
    aten._embedding_bag_per_sample_weights_backward.default: "embedding_bag's per-sample "
    "weights backward buffers are not modelled",
    aten.normal.Tensor_float: "normal's broadcast mean/std and the draws' buffers are not modelled",
    aten.normal.float_Tensor: "normal's broadcast mean/std and the draws' buffers are not modelled",
    aten.normal.Tensor_Tensor: "normal's broadcast mean/std and the draws' buffers are not modelled",
}


@CPU.scratch(*_UNMODELLED)
def _unmodelled(call: OpCall) -> Steps:
    return [Inexact(_UNMODELLED[call.func]), OUTPUTS]


@CPU.scratch(aten.index_reduce.default, aten.index_reduce_.default)
def _index_reduce(call: OpCall) -> Steps:
    """``index_reduce`` with ``reduce="mean"`` keeps a count per output element
    (``index_reduce_func_impl``, ``TensorAdvancedIndexing.cpp``): not modelled; the
    other reductions take nothing beside the output (measured)."""
    if arg(call, 4, "reduce") == "mean":
        return [Inexact("index_reduce's mean counts are not modelled"), OUTPUTS]
    return [OUTPUTS]


@CPU.scratch(aten.count_nonzero.dim_IntList, aten.count_nonzero.default)
def _count_nonzero(call: OpCall) -> Steps:
    """``count_nonzero`` over dims (``TensorCompare.cpp``) takes buffers (the wrapped
    zero and its cast, the ``!= 0`` mask, the sum's ``int64`` copy) that are not
    modelled; with no dim it reduces with nothing beside the output (measured)."""
    if call.func is aten.count_nonzero.dim_IntList or arg(call, 1, "dim") is not None:
        return [Inexact("count_nonzero over a dim: its mask and casts are not modelled"), OUTPUTS]
    return [OUTPUTS]
