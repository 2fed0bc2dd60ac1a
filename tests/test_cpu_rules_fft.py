"""CPU rules for MKL's FFTs (``pytest_torchmem/engine/tracing/devices/cpu/fft.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from exactness import Lambda, assert_exact

import pytest_torchmem as tm

F32, C64 = 4, 8
_WINDOW = torch.hann_window(4)


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _forward(fn: Callable[..., Any], x: torch.Tensor) -> int:
    report = tm.estimate(Lambda(fn), x, train=False)
    assert report.unsupported == ()
    assert report.forward_peak == tm.measure(Lambda(fn), x, train=False).forward_peak
    return report.forward_peak


def test_rfft_over_a_middle_dim_copies_the_input() -> None:
    """``rfft`` over dim 1 of a contiguous (5, 10, 7) tensor: ``_exec_fft`` puts the
    batch dims (0, 2) first, strides (70, 1), which ``reshape(-1, 10)`` cannot
    collapse: a copy of the input (5 * 10 * 7 floats) beside the (5, 6, 7) complex
    output. Forward: input 1400 + output 1680 + copy 1400."""
    x = torch.randn(5, 10, 7)
    assert _forward(lambda x: torch.fft.rfft(x, dim=1), x) == 2 * 350 * F32 + 210 * C64


def test_rfft_over_the_last_dim_copies_nothing() -> None:
    """Over the last dim the batch dims collapse into a view: input + output only."""
    x = torch.randn(5, 10, 7)
    assert _forward(lambda x: torch.fft.rfft(x), x) == 350 * F32 + 5 * 10 * 4 * C64


def test_an_expanded_input_is_cloned() -> None:
    """A zero-stride (expanded) input collapses into a view with zero strides, which
    ``_exec_fft`` clones contiguous for MKL (pytorch/pytorch#154477): the (6, 8)
    expanded row (8 floats of storage) is copied whole, 48 floats, beside the
    (6, 5) complex output."""
    row = torch.randn(8)
    assert _forward(lambda r: torch.fft.rfft(r.expand(6, 8)), row) == 8 * F32 + 30 * C64 + 48 * F32


def test_irfft2_holds_the_c2c_result() -> None:
    """``irfft2`` of a contiguous (4, 6, 5) complex tensor (960 B): ``_fft_c2r_mkl``
    first transforms dim 1 complex-to-complex into a (4, 6, 5) result, copying the
    input (batch dims 0 and 2 do not collapse); that result, strides (30, 1, 6),
    is copied again for the complex-to-real transform of its last dim into the
    (4, 6, 8) real output (768 B). The peak: input + c2c result + output + the
    second copy = 3 * 960 + 768."""
    z = torch.randn(4, 6, 5, dtype=torch.complex64)
    assert _forward(lambda z: torch.fft.irfft2(z), z) == 3 * 120 * C64 + 192 * F32


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.fft.rfft(x, dim=0),
        lambda x: torch.fft.rfft2(x.transpose(0, 2)),
        lambda x: torch.fft.fft(x, dim=1, norm="ortho"),
        lambda x: torch.fft.irfft(x, dim=0),
        lambda x: torch.fft.irfftn(x.permute(2, 0, 1), s=(4, 6)),
        lambda x: torch.fft.hfft2(x, dim=(0, 2)),
        lambda x: torch.fft.ihfftn(x[:, ::2], dim=(0, 1)),
        lambda x: torch.fft.fftn(x[0].expand(3, 6, 5), dim=(0, 2)),
        lambda x: torch.fft.fft2(x.transpose(1, 2)),
        lambda x: torch.fft.ifftn(torch.complex(x, x), dim=(0, 2)),
        lambda x: torch.stft(x[0, 0], 4, window=_WINDOW, return_complex=True),
    ],
    ids=[
        "rfft dim 0",
        "rfft2 transposed",
        "fft (two-sided r2c) dim 1",
        "irfft dim 0",
        "irfftn permuted",
        "hfft2 dims 0 and 2",
        "ihfftn strided",
        "fftn expanded",
        "fft2 transposed",
        "ifftn complex",
        "stft",
    ],
)
def test_fft_step_equals_measure(fn: Callable[..., Any], threads: int) -> None:
    """Forward and backward (``fft_r2c_backward``, ``fft_c2r_backward``: the gradient of
    a sum is an expanded tensor, cloned by the next transform); a complex result is
    summed through ``view_as_real``."""
    x = torch.randn(3, 6, 5, requires_grad=True)
    assert_exact(Lambda(lambda x: _real(fn(x))), x)
