"""Rules every device model starts from: value-dependent ops.

Fake tensors have no values, so ``nonzero``, ``masked_select``, ``unique`` or
``.item()`` cannot be run on them. Where the trace knows the values of every
argument (small tensors computed from the step's real inputs: ``values.py``)
the op runs on them and its outputs are exact; the fallbacks here answer the
rest: exact where the values that decide the output are known (a mask's, for
``masked_select`` and boolean indexing), else the largest output the op could
have (every element selected) or a neutral scalar, and the estimate lists the
op in ``unsupported``: for that op the figure is an upper bound, not exact.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.autograd_paths import register_eager_in_place
from pytest_torchmem.engine.tracing.devices.collectives import register_collectives
from pytest_torchmem.engine.tracing.devices.eager_checks import register_checks
from pytest_torchmem.engine.tracing.devices.meta_kernels import register_meta_kernels
from pytest_torchmem.engine.tracing.devices.sparse import register_sparse
from pytest_torchmem.engine.tracing.metric_reads import metric_read
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet
from pytest_torchmem.engine.tracing.values import count_nonzero, on_values

__all__ = ["COMMON"]

aten = torch.ops.aten

#: Rules shared by every device model; device models copy it and add their own.
COMMON: Final = RuleSet("common")
register_checks(COMMON)
register_collectives(COMMON)
register_eager_in_place(COMMON)  # backward formulas that write in place eagerly
register_meta_kernels(COMMON)  # the outputs of ops torch gives no meta kernel
register_sparse(COMMON)  # sparse tensors' parts, flags and constructors

_UPPER: Final = "output size depends on tensor values; the largest possible output was assumed"



@COMMON.fallback(aten._local_scalar_dense.default)
def _item(call: OpCall) -> tuple[Any, str | None]:
    """A neutral value (listed; not where a library reads it only to report it:
    :mod:`~pytest_torchmem.engine.tracing.metric_reads`)."""
    t = call.args[0]
    value: Any
    if t.dtype == torch.bool:
        value = False
    elif t.dtype.is_floating_point:
        value = 0.0
    elif t.dtype.is_complex:
        value = 0j
    else:
        value = 0
    if metric_read():
        return value, None
    return value, f"the Python value of a tensor is not known; {value!r} was used"


@COMMON.fallback(aten.equal.default)
def _equal(call: OpCall) -> tuple[Any, str]:
    """``equal``: ``True`` stands in (an ``equal`` kernel allocates nothing)."""
    return True, "whether two tensors are equal is not known; True was used"


@COMMON.fallback(aten.nonzero.default)
def _nonzero(call: OpCall) -> tuple[Any, str]:
    t = call.args[0]
    return t.new_empty((t.numel(), t.dim()), dtype=torch.long), _UPPER


def _selected(call: OpCall, mask: torch.Tensor) -> int | None:
    """How many elements of ``mask`` are set, where its values are known."""
    return count_nonzero(call.value(mask))


@COMMON.fallback(aten.masked_select.default)
def _masked_select(call: OpCall) -> tuple[Any, str | None]:
    """Its output size is the broadcast mask's count of set elements."""
    t, mask = call.args[0], call.args[1]
    shape = torch.broadcast_shapes(t.shape, mask.shape)
    value = call.value(mask)
    if value is not None:
        with on_values():
            count = int(torch.count_nonzero(value.expand(shape)))
        return t.new_empty((count,)), None
    return t.new_empty((shape.numel(),)), _UPPER


@COMMON.fallback(aten.index.Tensor)
def _index_with_masks(call: OpCall) -> tuple[Any, str | None]:
    """``x[mask]``: a boolean mask selects its set elements (every element, where
    its values are not known)."""
    t, indices = call.args[0], call.args[1]
    expanded: list[Any] = []
    exact = True
    for index in indices:
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            count = _selected(call, index)
            exact = exact and count is not None
            chosen = index.new_empty((index.numel() if count is None else count,), dtype=torch.long)
            expanded.extend([chosen] * index.dim())
        else:
            expanded.append(index)
    return aten.index.Tensor(t, expanded), None if exact else _UPPER


@COMMON.fallback(aten._ctc_loss.Tensor)
def _ctc_loss_lengths_as_tensors(call: OpCall) -> tuple[Any, str | None]:
    """``ctc_loss`` with its lengths as tensors (``ctc_loss_tensor``, ``LossCTC.cpp``: the
    lengths read as integer lists on the host): ``neg_log_likelihood`` of the batch and
    ``log_alpha`` of ``(batch, input length, 2 * longest target + 1)``, as both the CPU and
    the CUDA kernel make them (``ctc_loss_cpu_template``, ``ctc_loss_gpu_template``). The
    longest target is the target lengths' largest value: known where they come from the
    step's inputs (transformers' CTC heads count them from the labels), else the targets'
    whole length is assumed."""
    log_probs, targets = call.args[0], call.args[1]
    target_lengths = call.value(call.args[3])
    batch = log_probs.size(1) if log_probs.dim() == 3 else 1
    if target_lengths is not None:
        longest, reason = (int(target_lengths.max()) if target_lengths.numel() else 0), None
    else:
        longest, reason = targets.size(-1), _UPPER
    neg_log_likelihood = log_probs.new_empty((batch,) if log_probs.dim() == 3 else ())
    log_alpha = log_probs.new_empty((batch, log_probs.size(0), 2 * longest + 1))
    return (neg_log_likelihood, log_alpha), reason


@COMMON.implementation(aten.allclose.default)
def _allclose(call: OpCall) -> bool:
    """``at::allclose`` (``TensorCompare.cpp``): ``isclose(...).all().item()``, run
    through the trace (its ops recorded, ``.item()`` answered from the values)."""
    self, other = call.args[0], call.args[1]
    rtol, atol = call.arg(2, "rtol", 1e-05), call.arg(3, "atol", 1e-08)
    equal_nan = call.arg(4, "equal_nan", False)
    assert call.context is not None and call.context.tracer is not None
    with call.context.tracer.decomposed():
        return bool(torch.isclose(self, other, rtol, atol, equal_nan).all().item())


@COMMON.fallback(aten._unique2.default)
def _unique2(call: OpCall) -> tuple[Any, str]:
    t = call.args[0]
    return_inverse = call.arg(2, "return_inverse", False)
    return_counts = call.arg(3, "return_counts", False)
    out = t.new_empty((t.numel(),))
    inverse = t.new_empty(t.shape if return_inverse else (0,), dtype=torch.long)
    counts = t.new_empty((t.numel(),) if return_counts else (0,), dtype=torch.long)
    return (out, inverse, counts), _UPPER
