"""CPU interpolation kernels (``pytest_torchmem.engine.tracing.devices.cpu.upsample``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pytest_torchmem as tm

F32, I64 = 4, 8


class Interpolate(nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, **self.options)


def _forward(x: torch.Tensor, **options: Any) -> int:
    report = tm.estimate(Interpolate(**options), x, train=False)
    assert report.forward_peak == tm.measure(Interpolate(**options), x, train=False).forward_peak
    return report.forward_peak


def test_small_output_takes_the_channels_last_kernel() -> None:
    """(2, 3, 8, 8) -> (2, 3, 16, 16): ``H + W = 32 <= 128``, so even a channels-first
    input runs ``cpu_upsample_nearest_channels_last``, on a channels-last copy of the
    input (1536 B) and of the output (6144 B)."""
    x = torch.randn(2, 3, 8, 8)
    inp, out = 2 * 3 * 8 * 8 * F32, 2 * 3 * 16 * 16 * F32
    assert _forward(x, scale_factor=2, mode="nearest") == inp + out + inp + out


def test_large_output_takes_the_generic_kernel() -> None:
    """(1, 3, 40, 40) -> (1, 3, 80, 80): ``H + W = 160``, 3 channels: the generic kernel's
    index (int64) and weight (float) tensors per interpolated dim and tap, 80 each:
    nearest 1 tap, bilinear 2."""
    x = torch.randn(1, 3, 40, 40)
    base = 3 * 40 * 40 * F32 + 3 * 80 * 80 * F32
    per_tap = 2 * 80 * (I64 + F32)  # two dims
    assert _forward(x, scale_factor=2, mode="nearest") == base + per_tap
    assert _forward(x, scale_factor=2, mode="bilinear") == base + 2 * per_tap
    assert _forward(x, scale_factor=2, mode="bicubic") == base + 4 * per_tap


def test_channels_last_input_needs_no_copy() -> None:
    """8 channels in channels-last: the vectorized kernel, on the tensors themselves
    (the output is made channels-last, as its input suggests)."""
    x = torch.randn(1, 8, 40, 40).contiguous(memory_format=torch.channels_last)
    assert _forward(x, scale_factor=2, mode="bilinear") == (8 * 40 * 40 + 8 * 80 * 80) * F32


CASES = [
    ((2, 5, 12), {"scale_factor": 2, "mode": "nearest"}),
    ((2, 5, 12), {"size": 17, "mode": "linear", "align_corners": True}),
    ((2, 3, 9, 7), {"scale_factor": 2, "mode": "nearest-exact"}),
    ((1, 3, 40, 40), {"scale_factor": 2, "mode": "bilinear"}),
    ((2, 3, 20, 20), {"scale_factor": 1.5, "mode": "bilinear"}),  # 1 thread: 3 channels vectorized
    ((1, 4, 70, 70), {"scale_factor": 0.5, "mode": "bilinear", "antialias": False}),
    ((1, 2, 10, 12), {"size": (15, 30), "mode": "bicubic"}),
    ((1, 2, 4, 6, 6), {"scale_factor": 2, "mode": "trilinear"}),
    ((1, 2, 4, 6, 6), {"scale_factor": 2, "mode": "nearest"}),
]


@pytest.mark.parametrize(("shape", "options"), CASES, ids=lambda v: str(v))
def test_step_equals_measure(shape: tuple[int, ...], options: dict[str, Any], threads: int) -> None:
    x = torch.randn(*shape, requires_grad=True)
    model = Interpolate(**options)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_channels_last_step_equals_measure(mode: str, threads: int) -> None:
    """Channels-last in, and a channels-last gradient back: the channels-last backward."""
    x = torch.randn(2, 8, 12, 12).contiguous(memory_format=torch.channels_last).requires_grad_()
    model = nn.Sequential(Interpolate(scale_factor=2, mode=mode), nn.Conv2d(8, 4, 1))
    model = model.to(memory_format=torch.channels_last)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


def test_bfloat16_weights_are_bfloat16() -> None:
    """The generic kernel's weights take the input's dtype: 2 bytes for bfloat16."""
    x = torch.randn(1, 3, 40, 40, dtype=torch.bfloat16)
    base = (3 * 40 * 40 + 3 * 80 * 80) * 2
    assert _forward(x, scale_factor=2, mode="bilinear") == base + 2 * 2 * 80 * (I64 + 2)


def test_grid_sample_backward_copies_a_broadcast_gradient() -> None:
    """``grid_sampler_2d_backward_cpu``: ``grad_input`` (zeros, 600 B) and ``grad_grid``
    (256 B), then the kernel's ``grad_output.contiguous()`` of the sum's broadcast
    gradient (384 B). Backward: input 600 + grid 256 + loss and its gradient 8 +
    600 + 256 + 384 = 2104."""
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    grid = (torch.rand(2, 4, 4, 2) * 2 - 1).requires_grad_()

    class Sample(nn.Module):
        def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            return F.grid_sample(x, grid, align_corners=False)

    report = tm.estimate(Sample(), (x, grid))
    assert report.backward_peak == 2 * (600 + 256) + 2 * F32 + 2 * 3 * 4 * 4 * F32
    assert report.phase_peaks() == tm.measure(Sample(), (x, grid)).phase_peaks()


# -- antialiased (separable) interpolation ---------------------------------------------------


def test_antialiased_bilinear_bytes_by_hand() -> None:
    """(2, 3, 16, 20) float32 to (8, 10), bilinear, antialiased: the output (1920 B);
    the width pass into a (2, 3, 16, 10) temporary (3840 B), its bounds (3 x 10 int64),
    weights (scale 2, support 2: 5 taps x 10 floats) and weight indices (10 int64):
    520 B, given back before the height pass (416 B) writes the output. Peak:
    x 7680 + 1920 + 3840 + 520."""
    x = torch.randn(2, 3, 16, 20)
    peak = _forward(x, size=(8, 10), mode="bilinear", antialias=True)
    assert peak == 7680 + 1920 + 3840 + 3 * 10 * I64 + 5 * 10 * F32 + 10 * I64


AA_CASES = [
    ((2, 3, 16, 20), {"size": (8, 10), "mode": "bilinear"}),
    ((2, 3, 16, 20), {"size": (16, 7), "mode": "bilinear", "align_corners": True}),
    ((2, 3, 16, 20), {"size": (40, 9), "mode": "bicubic"}),
    ((2, 3, 16, 20), {"size": (5, 20), "mode": "bicubic", "align_corners": True}),
    ((2, 3, 16, 20), {"size": (16, 20), "mode": "bilinear"}),
    ((1, 2, 9, 13), {"scale_factor": 0.37, "mode": "bilinear"}),
    ((1, 2, 9, 13), {"scale_factor": (1.7, 0.9), "mode": "bicubic", "recompute_scale_factor": False}),
]


@pytest.mark.parametrize(("shape", "options"), AA_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("channels_last", [False, True])
def test_antialiased_step_equals_measure(
    shape: tuple[int, ...], options: dict[str, Any], channels_last: bool, threads: int
) -> None:
    """OpInfo's ``_upsample_bilinear2d_aa`` samples and the bicubic twin, with the
    backward (``grad_output.contiguous()`` of a broadcast gradient)."""
    x = torch.randn(shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    model = Interpolate(antialias=True, **options)
    x.requires_grad_(True)
    estimated = tm.estimate(model, x)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, x).phase_peaks()
