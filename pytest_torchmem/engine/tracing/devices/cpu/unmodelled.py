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
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Inexact, OpCall, Steps

aten = torch.ops.aten

#: op -> what the kernel takes that is not modelled (measured on OpInfo samples).
_UNMODELLED: Final = {
    aten.fractional_max_pool2d_backward.default: "fractional_max_pool2d_backward's "
    "contiguous copies are not modelled",
    aten._upsample_bilinear2d_aa.default: "the antialiased upsampling's weight and index "
    "buffers are not modelled",
    aten._upsample_bilinear2d_aa_backward.default: "the antialiased upsampling's weight and "
    "index buffers are not modelled",
    aten.soft_margin_loss.default: "soft_margin_loss's elementwise temporaries are not modelled",
    aten.soft_margin_loss_backward.default: "soft_margin_loss_backward's elementwise "
    "temporaries are not modelled",
    aten._trilinear.default: "_trilinear's (bilinear) per-step sum and permuted copies are "
    "not modelled",
}


@CPU.scratch(*_UNMODELLED)
def _unmodelled(call: OpCall) -> Steps:
    return [Inexact(_UNMODELLED[call.func]), OUTPUTS]
