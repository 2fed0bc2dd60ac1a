"""CPU rules: pooling.

The CPU pooling kernels (``aten/src/ATen/native/cpu/MaxPoolKernel.cpp``,
``AvgPoolKernel.cpp``, ``AdaptiveAvgPoolKernel.cpp``,
``AdaptiveMaxPoolKernel.cpp``, torch 2.13) choose a contiguous or a
channels-last loop by one tensor's ``suggest_memory_format()`` and run it on
``.contiguous(format)`` copies of their operands, taken in a fixed order and
given back when the kernel returns (a copied output is copied back first).
The outputs are made before (structured kernels, in the input's suggested
format), so a copy is needed only for an operand in the other layout: a
transposed view, a broadcast gradient (``sum()``'s backward), a channels-last
gradient of a contiguous input. 1-d pooling runs these 2-d kernels on
``unsqueeze(-2)`` views (``max_pool1d_with_indices``, ``avg_pool1d``,
``adaptive_*_pool1d``); ``max_pool1d`` without autograd has its own kernel,
routed in :mod:`pytest_torchmem.engine.tracing.devices.cpu.router`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Steps

__all__ = ["copies", "kernel_format"]

# torch's private names (engine/torch_compat/torch_private.py)
suggest_memory_format: Final = private("torch._prims_common.suggest_memory_format")

aten = torch.ops.aten


def kernel_format(t: torch.Tensor) -> torch.memory_format:
    """The loop a pooling kernel takes when it switches on ``t.suggest_memory_format()``."""
    if t.dim() not in (4, 5):
        return torch.contiguous_format
    return suggest_memory_format(t)


def copies(fmt: torch.memory_format, operands: Sequence[tuple[str, torch.Tensor]]) -> list[Alloc]:
    """``operand.contiguous(fmt)`` of each operand, in order: its bytes when it is
    not already contiguous in ``fmt``."""
    steps = []
    for name, t in operands:
        if t.numel() and not t.is_contiguous(memory_format=fmt):
            steps.append(Alloc(f"{name} contiguous", t.numel() * t.element_size()))
    return steps


def _outputs(call: OpCall) -> list[torch.Tensor]:
    return list(call.out) if isinstance(call.out, (tuple, list)) else [call.out]


@CPU.scratch(
    aten.max_pool2d_with_indices.default,
    aten.avg_pool2d.default,
    aten._adaptive_avg_pool2d.default,
    aten.adaptive_max_pool2d.default,
)
def _pool(call: OpCall) -> Steps:
    """``cpu_max_pool`` / ``cpu_avg_pool`` / ``cpu_adaptive_avg_pool`` /
    ``cpu_adaptive_max_pool`` and their ``_channels_last`` twins, chosen by the
    input's suggested format: the input, then each output (values, indices),
    made contiguous in it."""
    x = arg(call, 0, "self")
    fmt = kernel_format(x)
    outs = _outputs(call)
    names = ["output", "indices"][: len(outs)]
    return [OUTPUTS, *copies(fmt, [("input", x), *zip(names, outs)])]


@CPU.scratch(
    aten.max_pool2d_with_indices_backward.default,
    aten.max_pool3d_with_indices_backward.default,
)
def _max_pool_backward(call: OpCall) -> Steps:
    """``max_pool2d_backward_kernel_impl`` (and ``max_pool3d_backward_kernel_impl``,
    channels-last-3d for 5-d) switches on the output gradient's format:
    ``cpu_max_pool_backward`` copies ``grad_output``, ``indices`` then
    ``grad_input``; the channels-last one ``grad_input``, ``grad_output``, ``indices``."""
    grad_output, indices = arg(call, 0, "grad_output"), arg(call, 7, "indices")
    return _backward(kernel_format(grad_output), grad_output, call.out, indices)


@CPU.scratch(
    aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default
)
def _adaptive_max_pool_backward(call: OpCall) -> Steps:
    """``adaptive_max_pool2d_backward_kernel_impl`` (and its 3-d twin) switches on the input gradient's
    format ("grad_output might be NC11"); the copies as for max pooling."""
    grad_output, indices = arg(call, 0, "grad_output"), arg(call, 2, "indices")
    return _backward(kernel_format(call.out), grad_output, call.out, indices)


@CPU.scratch(
    aten.avg_pool2d_backward.default, aten._adaptive_avg_pool2d_backward.default
)
def _avg_pool_backward(call: OpCall) -> Steps:
    """``avg_pool2d_backward_kernel_impl`` / ``adaptive_avg_pool2d_backward_kernel_impl``
    switch on the output gradient's format: ``cpu_avg_pool_backward`` copies
    ``grad_output`` then ``grad_input``, the channels-last one the other way round."""
    grad_output = arg(call, 0, "grad_output")
    return _backward(kernel_format(grad_output), grad_output, call.out, None)


def _backward(
    fmt: torch.memory_format,
    grad_output: torch.Tensor,
    grad_input: torch.Tensor,
    indices: Any,
) -> Steps:
    operands = [("grad_output", grad_output)]
    if indices is not None:
        operands.append(("indices", indices))
    if fmt == torch.contiguous_format:
        operands.append(("grad_input", grad_input))
    else:
        operands.insert(0, ("grad_input", grad_input))
    return [OUTPUTS, *copies(fmt, operands)]


@CPU.scratch(aten.avg_pool3d.default)
def _avg_pool3d(call: OpCall) -> Steps:
    """``avg_pool3d_out_cpu_template`` (``AveragePool3d.cpp``) has no channels-last
    loop: it runs on ``input.contiguous()`` (a channels-last-3d or transposed input
    is copied, after the output is made)."""
    return [OUTPUTS, *copies(torch.contiguous_format, [("input", arg(call, 0, "self"))])]


@CPU.scratch(aten.avg_pool3d_backward.default, aten._adaptive_avg_pool3d_backward.default)
def _avg_pool3d_backward(call: OpCall) -> Steps:
    """``avg_pool3d_backward_out_cpu_template`` (``AveragePool3d.cpp``) and
    ``adaptive_avg_pool3d_backward_out_cpu_template`` (``AdaptiveAveragePooling3d.cpp``)
    have no channels-last loop: ``gradOutput.contiguous()`` (a broadcast or
    channels-last-3d gradient is copied); the input gradient is written in its own
    layout (measured: no copy of it for a channels-last-3d input)."""
    grad_output = arg(call, 0, "grad_output")
    return [OUTPUTS, *copies(torch.contiguous_format, [("grad_output", grad_output)])]


@CPU.scratch(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def _fractional_max_pool(call: OpCall) -> Steps:
    """``fractional_max_pool2d_out_cpu`` / ``fractional_max_pool3d_out_cpu_template``
    (``FractionalMaxPool2d.cpp``, ``FractionalMaxPool3d.cpp``): the outputs, then
    ``input.contiguous()`` and ``random_samples.contiguous()``, held to the end."""
    x, samples = arg(call, 0, "self"), arg(call, 3, "random_samples")
    return [OUTPUTS, *copies(torch.contiguous_format, [("input", x), ("random_samples", samples)])]


@CPU.scratch(aten.fractional_max_pool2d_backward.default)
def _fractional_max_pool2d_backward(call: OpCall) -> Steps:
    """``fractional_max_pool2d_backward`` (``FractionalMaxPool2d.cpp``): the meta
    function checks the sizes of ``gradOutput_.contiguous()`` before it makes the
    input gradient, and the kernel takes ``gradOutput_.contiguous()`` again: a
    broadcast gradient is copied twice, one copy at a time (measured)."""
    copy = copies(torch.contiguous_format, [("grad_output", arg(call, 0, "grad_output"))])
    if not copy:
        return [OUTPUTS]
    (first,) = copy
    again = Alloc("grad_output contiguous (kernel)", first.nbytes)
    return [first, OUTPUTS, Free(first.tag), again, Free(again.tag)]


@CPU.scratch(aten.fractional_max_pool3d_backward.default)
def _fractional_max_pool3d_backward(call: OpCall) -> Steps:
    """``fractional_max_pool3d_backward_out_cpu_template`` (``FractionalMaxPool3d.cpp``):
    ``gradOutput_.contiguous()``, then ``gradInput.resize_as_(input)`` (the output;
    its outputs come from :mod:`~pytest_torchmem.engine.tracing.devices.meta_kernels`)."""
    copy = copies(torch.contiguous_format, [("grad_output", arg(call, 0, "grad_output"))])
    return [*copy, OUTPUTS]
