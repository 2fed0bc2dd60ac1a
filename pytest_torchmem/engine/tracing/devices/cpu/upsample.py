"""CPU rules: interpolation (``F.interpolate``'s nearest, linear, bilinear, bicubic,
trilinear), torch 2.13.

Forward (``aten/src/ATen/native/cpu/UpSampleKernel.cpp``): after the output
(structured), one of two kernels runs.

* ``upsample_generic_Nd_kernel_impl`` precomputes, for each interpolated dim in
  order and each of the mode's ``interp_size`` taps (nearest 1, linear 2,
  cubic 4), an int64 index tensor and a weight tensor in the input's dtype
  (nearest: ``at::ones``, unused), each of the output's size along that dim
  (``HelperInterp*::compute_indices_weights``), freed when the kernel returns.
* The channels-last kernels (``cpu_upsample_nearest_channels_last``,
  ``cpu_upsample_linear_channels_last``) run on ``input.contiguous(cl)`` and
  ``output.contiguous(cl)`` and copy the result back: copies of a
  channels-first input and output. 2-d nearest and bilinear take them when
  ``_use_vectorized_kernel_cond_2d``: a channels-last input with more than 3
  channels, or an output with ``H + W <= 128`` -- also for channels-first
  tensors (bilinear also with one thread and 3 channels); 3-d when
  ``_use_vectorized_kernel_cond_3d`` (channels-last-3d input, more than 3
  channels). 1-d and bicubic always take the generic kernel.

Antialiased 2-d bilinear and bicubic (``_upsample_*2d_aa``) run
``separable_upsample_generic_Nd_kernel_impl``: one pass per interpolated dim
whose size changes, the last dim first, each into a temporary of the sizes so
far (``at::empty(temp_oshape, input.options())``, held to the end) except the
last pass, which writes the output; each pass makes its index ranges and
weights (``_compute_index_ranges_weights``: three int64 tensors of the
output's size along the dim, the weights of ``max_interp_size`` taps each in
the input's dtype, one more int64 tensor) and gives them back after it.

Backward (``UpSampleMoreKernel.cpp``, ``UpSampleBicubic2d.cpp``): the gradient of
the input (structured) first; then a channels-last output gradient of a 4-d or
5-d nearest/linear op takes ``cpu_upsample_*_backward_channels_last`` on
``grad_output.contiguous(cl)`` and ``grad_input.contiguous(cl)``, anything else
``grad_output.contiguous()`` and ``grad_input.contiguous()`` (a broadcast
gradient, as ``sum()``'s backward gives, is copied).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import itemsize
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    OpCall,
    Step,
    Steps,
    nbytes_of,
)

aten = torch.ops.aten

#: forward op packet -> (interpolated dims, taps, which channels-last condition applies)
_FORWARD: Final = {
    aten.upsample_nearest1d: (1, 1, None),
    aten._upsample_nearest_exact1d: (1, 1, None),
    aten.upsample_nearest2d: (2, 1, "2d"),
    aten._upsample_nearest_exact2d: (2, 1, "2d"),
    aten.upsample_nearest3d: (3, 1, "3d"),
    aten._upsample_nearest_exact3d: (3, 1, "3d"),
    aten.upsample_linear1d: (1, 2, None),
    aten.upsample_bilinear2d: (2, 2, "bilinear"),
    aten.upsample_trilinear3d: (3, 2, "3d"),
    aten.upsample_bicubic2d: (2, 4, None),
}

_BACKWARD: Final = (
    aten.upsample_nearest1d_backward,
    aten._upsample_nearest_exact1d_backward,
    aten.upsample_nearest2d_backward,
    aten._upsample_nearest_exact2d_backward,
    aten.upsample_nearest3d_backward,
    aten._upsample_nearest_exact3d_backward,
    aten.upsample_linear1d_backward,
    aten.upsample_bilinear2d_backward,
    aten.upsample_trilinear3d_backward,
    aten.upsample_bicubic2d_backward,
)



def _channels_last(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


def _vectorized(threads: int, kind: str | None, output: torch.Tensor, x: torch.Tensor) -> bool:
    """``_use_vectorized_kernel_cond_2d`` / ``_3d``, and bilinear's extra one-thread case."""
    if kind is None:
        return False
    channels_last = x.is_contiguous(memory_format=_channels_last(x)) and x.size(1) > 3
    if kind == "3d":
        return channels_last
    if channels_last or output.size(-2) + output.size(-1) <= 128:
        return True
    return kind == "bilinear" and threads == 1 and x.size(1) == 3


def _copies(fmt: torch.memory_format, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Alloc]:
    """``t.contiguous(fmt)`` of each tensor that is not already."""
    return [
        Alloc(f"{name}.contiguous()", nbytes_of(t))
        for name, t in tensors
        if t.numel() and not t.is_contiguous(memory_format=fmt)
    ]


@CPU.scratch(*_FORWARD)
def _upsample(call: OpCall) -> Steps:
    """The output, then the channels-last kernel's copies or the generic kernel's
    index and weight tensors (see the module's notes)."""
    dims, taps, kind = _FORWARD[call.func.overloadpacket]
    x, output = call.args[0], call.out
    if x.dtype == torch.uint8 and taps > 1:
        return [OUTPUTS, Inexact("the uint8 separable interpolation kernels are not modelled")]
    if _vectorized(profile_of(call).threads, kind, output, x):
        fmt = _channels_last(x)
        return [OUTPUTS, *_copies(fmt, [("input", x), ("output", output)])]
    weight = itemsize(torch.float32 if x.dtype == torch.uint8 else x.dtype)
    steps: list[Alloc | object] = [OUTPUTS]
    for d in range(dims):
        size = output.size(2 + d)
        for j in range(taps):
            steps.append(Alloc(f"dim {d} tap {j} indices", size * itemsize(torch.long)))
            steps.append(Alloc(f"dim {d} tap {j} weights", size * weight))
    return steps


@CPU.scratch(*_BACKWARD)
def _upsample_backward(call: OpCall) -> Steps:
    """The input's gradient, then the copies of ``grad_output`` and ``grad_input`` the
    kernel's layout asks for (see the module's notes)."""
    grad_output, grad_input = call.args[0], call.out
    fmt = torch.contiguous_format
    bicubic = call.func._schema.name.endswith("bicubic2d_backward")
    channels_last = grad_output.dim() in (4, 5) and grad_output.is_contiguous(
        memory_format=_channels_last(grad_output)
    )
    if channels_last and not bicubic:
        fmt = _channels_last(grad_output)
    return [OUTPUTS, *_copies(fmt, [("grad_output", grad_output), ("grad_input", grad_input)])]


#: antialiased forward op -> taps of its filter (``HelperInterpLinear`` / ``HelperInterpCubic``)
_ANTIALIASED: Final = {aten._upsample_bilinear2d_aa.default: 2, aten._upsample_bicubic2d_aa.default: 4}


def _f32(value: float) -> float:
    """``value`` rounded to a C ``float``."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _aa_taps(in_size: int, out_size: int, align_corners: bool, scale: float | None, taps: int, dtype: torch.dtype) -> int:
    """``max_interp_size`` of ``_compute_index_ranges_weights``: the filter's support
    widened by the scale (``area_pixel_compute_scale`` in the kernel's float type)."""
    cast = _f32 if dtype == torch.float32 else float
    if align_corners:
        ratio = cast((in_size - 1) / (out_size - 1)) if out_size > 1 else 0.0
    elif scale is not None and scale > 0:
        ratio = cast(1.0 / scale)
    else:
        ratio = cast(cast(in_size) / out_size)
    support = cast(taps * 0.5 * ratio) if ratio >= 1.0 else taps * 0.5
    return math.ceil(support) * 2 + 1


@CPU.scratch(*_ANTIALIASED)
def _upsample_aa(call: OpCall) -> Steps:
    """The output, then the separable passes (see the module's notes)."""
    x, output = call.args[0], call.out
    if x.dtype not in (torch.float32, torch.float64):
        return [OUTPUTS, Inexact("the antialiased uint8 interpolation kernels are not modelled")]
    align_corners = bool(call.args[2])
    scales = [call.arg(3, "scales_h"), call.arg(4, "scales_w")]
    taps = _ANTIALIASED[call.func]
    steps: list[Step] = [OUTPUTS]
    changed = [d for d in (3, 2) if output.size(d) != x.size(d)]  # the last dim first
    temp = list(x.shape)
    for i, d in enumerate(changed):
        if i < len(changed) - 1:
            temp[d] = output.size(d)
            steps.append(Alloc(f"pass {i} result", math.prod(temp) * x.element_size()))
        out_size = output.size(d)
        width = _aa_taps(x.size(d), out_size, align_corners, scales[d - 2], taps, x.dtype)
        buffers = [
            *(Alloc(f"pass {i}: bounds {j}", out_size * 8) for j in range(3)),
            Alloc(f"pass {i}: weights", out_size * width * x.element_size()),
            Alloc(f"pass {i}: weight indices", out_size * 8),
        ]
        steps += [*buffers, *(Free(b.tag) for b in buffers)]
    return steps


@CPU.scratch(aten._upsample_bilinear2d_aa_backward.default, aten._upsample_bicubic2d_aa_backward.default)
def _upsample_aa_backward(call: OpCall) -> Steps:
    """``cpu_upsample_genNd_backward_aa``: the input's gradient (structured), then
    ``grad_output.contiguous()`` and ``grad_input.contiguous()``; the weights are
    computed on the stack."""
    grad_output, grad_input = call.args[0], call.out
    return [OUTPUTS, *_copies(torch.contiguous_format, [("grad_output", grad_output), ("grad_input", grad_input)])]


@CPU.scratch(aten.grid_sampler_2d_backward.default)
def _grid_sampler_backward(call: OpCall) -> Steps:
    """``grid_sampler_2d_backward_cpu`` (``GridSampler.cpp``) makes ``grad_input`` and
    ``grad_grid``, then ``grid_sampler_2d_backward_cpu_kernel_impl``
    (``cpu/GridSamplerKernel.cpp``) runs on ``grad_output_.contiguous()``."""
    grad_output = call.args[0]
    return [OUTPUTS, *_copies(torch.contiguous_format, [("grad_output", grad_output)])]
