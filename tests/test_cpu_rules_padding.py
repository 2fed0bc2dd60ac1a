"""CPU reflection and replication padding (``pytest_torchmem.engine.tracing.devices.cpu.padding``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pytest_torchmem as tm

F32 = 4


class Pad(nn.Module):
    def __init__(self, pad: tuple[int, ...], mode: str, conv: bool = False) -> None:
        super().__init__()
        self.pad, self.mode = pad, mode
        self.conv = nn.Conv2d(4, 4, 3) if conv else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(x, self.pad, mode=self.mode)
        return self.conv(y) if self.conv is not None else y


def test_backward_copies_a_broadcast_gradient() -> None:
    """``reflect`` padding of (2, 4, 10, 10) by 1, loss = sum: ``cpu_padding_backward``
    copies the broadcast output gradient (2 * 4 * 12 * 12 floats) beside the input
    gradient. Backward: x 3200 + loss and its gradient 8 + grad_input 3200 + the
    copy 4608 = 11016 (the padded output is dropped once the loss is taken)."""
    x = torch.randn(2, 4, 10, 10, requires_grad=True)
    report = tm.estimate(Pad((1, 1, 1, 1), "reflect"), x)
    assert report.backward_peak == 2 * 2 * 4 * 10 * 10 * F32 + 2 * F32 + 2 * 4 * 12 * 12 * F32
    assert report.phase_peaks() == tm.measure(Pad((1, 1, 1, 1), "reflect"), x).phase_peaks()


def test_forward_copies_a_transposed_input() -> None:
    """A transposed input is copied contiguous (``input.contiguous()``) before padding."""
    x = torch.randn(10, 10, 4, 2)

    class Transposed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.pad(x.permute(3, 2, 0, 1), (2, 2, 2, 2), mode="replicate")

    report = tm.estimate(Transposed(), x, train=False)
    assert report.forward_peak == 2 * 800 * F32 + 2 * 4 * 14 * 14 * F32
    assert report.forward_peak == tm.measure(Transposed(), x, train=False).forward_peak


CASES = [
    ((2, 3, 6), (2, 2), "reflect", False),
    ((2, 3, 6), (1, 3), "replicate", False),
    ((2, 4, 10, 10), (1, 1, 1, 1), "reflect", False),
    ((2, 4, 10, 10), (2, 1, 0, 3), "replicate", False),
    ((2, 4, 10, 10), (1, 1, 1, 1), "reflect", True),
    ((1, 2, 4, 6, 6), (1, 1, 1, 1, 1, 1), "replicate", False),
    ((2, 4, 6, 6), (1, 1, 1, 1, 1, 1), "reflect", False),  # unbatched 3-d: CDHW
]


@pytest.mark.parametrize(("shape", "pad", "mode", "channels_last"), CASES, ids=str)
def test_step_equals_measure(
    shape: tuple[int, ...], pad: tuple[int, ...], mode: str, channels_last: bool, threads: int
) -> None:
    model = Pad(pad, mode, conv=channels_last)
    x = torch.randn(*shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        model = model.to(memory_format=torch.channels_last)
    x.requires_grad_()
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


LAYOUTS = [
    (torch.ops.aten.reflection_pad2d, (2, 3, 4, 5), [1, 1, 0, 2], torch.channels_last),
    (torch.ops.aten.replication_pad2d, (2, 3, 4, 5), [1, 1, 1, 0], torch.channels_last),
    (torch.ops.aten.reflection_pad3d, (2, 3, 4, 5, 6), [1, 1, 0, 0, 1, 1], torch.channels_last_3d),
    (torch.ops.aten.replication_pad3d, (2, 3, 4, 5, 6), [1, 0, 1, 0, 1, 1], torch.channels_last_3d),
]


@pytest.mark.parametrize(("op", "shape", "pad", "fmt"), LAYOUTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_channels_last_input_gives_channels_last_results_and_gradients(
    op: torch._ops.OpOverloadPacket, shape: tuple[int, ...], pad: list[int], fmt: torch.memory_format
) -> None:
    """Regression: the fake kernels lay out the 3-d forward's result and every
    backward's ``grad_input`` contiguous, where the CPU kernels follow the input's
    suggested format. The wrong layout made ``reflect``-padded channels-last blocks
    (a padded convolution branch beside a plain one) charge a copy of the
    gradient, and book the input's gradient as a temporary at the peak."""
    x = torch.randn(shape).contiguous(memory_format=fmt).requires_grad_()

    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return op(x, pad) * 2

    estimated, measured = tm.estimate(Model(), x), tm.measure(Model(), x)
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert dict(estimated.breakdown) == dict(measured.breakdown)
    # The real op's layouts, which the rule follows.
    y = op(x.detach(), pad)
    backward = getattr(torch.ops.aten, op.__name__.split(".")[-1] + "_backward")
    assert y.is_contiguous(memory_format=fmt)
    assert backward(torch.randn(y.shape), x.detach(), pad).is_contiguous(memory_format=fmt)


def test_reflect_padded_channels_last_branch_beside_a_plain_one(threads: int) -> None:
    """Regression (found by the property tests at 2 threads): two channels-last
    convolutions on one input, one after ``reflect`` padding; every category at the
    peak agrees once ``reflection_pad2d_backward`` lays its gradient out as the CPU does."""
    x = torch.randn(2, 2, 2, 2).contiguous(memory_format=torch.channels_last).requires_grad_()
    a = nn.Conv2d(2, 2, 1).to(memory_format=torch.channels_last)
    b = nn.Conv2d(2, 2, (1, 3), padding=(0, 1), padding_mode="reflect", bias=False)
    b = b.to(memory_format=torch.channels_last)

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(torch.cat([self.a(x), torch.relu(self.b(x))], dim=1))

    model = Branches().eval()
    estimated, measured = tm.estimate(model, x), tm.measure(model, x)
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert dict(estimated.breakdown) == dict(measured.breakdown)
