"""CPU rules: reflection and replication padding
(``aten/src/ATen/native/cpu/PaddingKernel.cpp``, torch 2.10 to 2.15).

Every kernel runs on ``.contiguous(fmt)`` copies of its operands (given back
when it returns, a copied output copied back first): ``cpu_padding`` /
``cpu_padding_backward`` in the contiguous format on ``input`` then
``output`` (``grad_output`` then ``grad_input``), the ``_channels_last``
twins on ``input`` then ``output`` (``grad_input`` then ``grad_output``).
The format is the channels-last one when the 2-d (3-d) op's input, or output
gradient, suggests it (``suggest_memory_format``; a 4-d input of a 3-d op is
an unbatched CDHW, always contiguous); 1-d ops always use the contiguous
kernel. The outputs come first (structured kernels).

The outputs' layouts: every 2-d and 3-d forward and backward lays its result
out in the input's suggested memory format (``padding_memory_format_3d``;
``grad_input`` resized to ``input.suggest_memory_format()``), where some fake
kernels make contiguous tensors (the 2-d forward up to torch 2.12, the 3-d
forward and the backward on every release): a channels-last input gets a
channels-last result (which changes the copies above, and the next kernels' paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, OpCall, Steps

# torch's private names (engine/torch_compat/torch_private.py)
suggest_memory_format: Final = private("torch._prims_common.suggest_memory_format")

aten = torch.ops.aten

#: op packet -> number of padded dims
_FORWARD: Final = {
    aten.reflection_pad1d: 1,
    aten.reflection_pad2d: 2,
    aten.reflection_pad3d: 3,
    aten.replication_pad1d: 1,
    aten.replication_pad2d: 2,
    aten.replication_pad3d: 3,
}
_BACKWARD: Final = {
    aten.reflection_pad1d_backward: 1,
    aten.reflection_pad2d_backward: 2,
    aten.reflection_pad3d_backward: 3,
    aten.replication_pad1d_backward: 1,
    aten.replication_pad2d_backward: 2,
    aten.replication_pad3d_backward: 3,
}


def _format(t: torch.Tensor, dims: int) -> torch.memory_format:
    """The layout the kernel is chosen by: ``t.suggest_memory_format()`` for 2-d and
    batched 3-d padding (``padding_memory_format_3d``), contiguous otherwise."""
    if dims == 1 or (dims == 3 and t.dim() == 4):
        return torch.contiguous_format
    return suggest_memory_format(t)


def _copies(fmt: torch.memory_format, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Alloc]:
    return [
        Alloc(f"{name}.contiguous()", t.numel() * t.element_size())
        for name, t in tensors
        if t.numel() and not t.is_contiguous(memory_format=fmt)
    ]


def _laid_out(out: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    if out.is_contiguous(memory_format=fmt):
        return out
    return torch.empty_like(out, memory_format=fmt)


@CPU.implementation(
    aten.reflection_pad2d.default, aten.replication_pad2d.default,
    aten.reflection_pad3d.default, aten.replication_pad3d.default,
)  # fmt: skip
def _pad_layout(call: OpCall) -> Any:
    """A channels-last input, a channels-last result (``padding_memory_format_3d`` and
    the 2-d kernels' ``suggest_memory_format``). The fake 2-d kernels lay it out so
    from torch 2.13 on, contiguously before; the 3-d ones contiguously on every release."""
    return _laid_out(call.default(), _format(call.args[0], _FORWARD[call.func.overloadpacket]))


@CPU.implementation(
    aten.reflection_pad2d_backward.default, aten.replication_pad2d_backward.default,
    aten.reflection_pad3d_backward.default, aten.replication_pad3d_backward.default,
)  # fmt: skip
def _pad_backward_layout(call: OpCall) -> Any:
    """``grad_input`` in the input's suggested memory format (``padding_memory_format_3d``)."""
    dims = _BACKWARD[call.func.overloadpacket]
    return _laid_out(call.default(), _format(call.args[1], dims))


@CPU.scratch(*_FORWARD)
def _pad(call: OpCall) -> Steps:
    """``cpu_padding`` / ``cpu_padding_channels_last``: ``input.contiguous(fmt)`` then
    ``output.contiguous(fmt)``."""
    x = call.args[0]
    fmt = _format(x, _FORWARD[call.func.overloadpacket])
    return [OUTPUTS, *_copies(fmt, [("input", x), ("output", call.out)])]


@CPU.scratch(*_BACKWARD)
def _pad_backward(call: OpCall) -> Steps:
    """``cpu_padding_backward``: ``grad_output.contiguous()`` then ``grad_input``;
    ``cpu_padding_backward_channels_last``: ``grad_input`` then ``grad_output``."""
    grad_output, grad_input = call.args[0], call.out
    fmt = _format(grad_output, _BACKWARD[call.func.overloadpacket])
    order = [("grad_output", grad_output), ("grad_input", grad_input)]
    if fmt != torch.contiguous_format:
        order.reverse()
    return [OUTPUTS, *_copies(fmt, order)]
