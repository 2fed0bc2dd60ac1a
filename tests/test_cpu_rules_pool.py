"""CPU rules for pooling (``pytest_torchmem/engine/tracing/devices/cpu/pool.py``) and the CPU
router's ``max_pool1d`` (``pytest_torchmem/engine/tracing/devices/cpu/router.py``).

By hand, from ``MaxPoolKernel.cpp``, ``AvgPoolKernel.cpp``,
``AdaptiveAvgPoolKernel.cpp`` and ``AdaptiveMaxPoolKernel.cpp``: a kernel picks
its contiguous or channels-last loop by one tensor's suggested memory format
and copies each operand not already laid out that way (``numel x itemsize``),
after the outputs are made. Then modules whose estimate equals the CPU
allocator's measurement in every phase, at 1 and 2 intra-op threads, in
``float32`` and ``bfloat16``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from exactness import assert_fn_exact as assert_exact
from exactness import rule_buffers as scratch
from torch._subclasses.fake_tensor import FakeTensorMode

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cpu.router import pooling_output_size

aten = torch.ops.aten
BF16 = torch.bfloat16
CL = torch.channels_last


# -- the bytes of one call, by hand ---------------------------------------------------


def test_forward_copies_an_input_in_neither_layout() -> None:
    """A (2, 3, 6, 6) float input: contiguous or channels last, nothing; a transposed
    view is neither, so the contiguous loop copies it (2 x 3 x 6 x 6 x 4 = 864 B)."""
    with FakeTensorMode():
        x = torch.empty(2, 3, 6, 6)
        xt = torch.empty(2, 6, 3, 6).transpose(1, 2)
        for op, args in (
            (aten.max_pool2d_with_indices.default, ([2, 2], [2, 2])),
            (aten.avg_pool2d.default, ([2, 2], [2, 2])),
            (aten._adaptive_avg_pool2d.default, ([3, 3],)),
            (aten.adaptive_max_pool2d.default, ([3, 3],)),
        ):
            assert scratch(op, (x, *args)) == {}
            assert scratch(op, (x.contiguous(memory_format=CL), *args)) == {}
            assert scratch(op, (xt, *args)) == {"input contiguous": 864}


def test_backward_copies_follow_the_kernel_loop() -> None:
    """Max pooling backward switches on the output gradient's layout. A broadcast
    gradient (``sum()``'s backward, 2 x 3 x 3 x 3 floats = 216 B) takes the contiguous
    loop; with a channels-last input it copies the gradient, then the channels-last
    indices (216 x 2 = 432 B) and input gradient (864 B)."""
    with FakeTensorMode():
        x = torch.empty(2, 3, 6, 6)
        _, idx = aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
        ones = torch.ones(()).expand(2, 3, 3, 3)
        args = (ones, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
        assert scratch(aten.max_pool2d_with_indices_backward.default, args) == {
            "grad_output contiguous": 216
        }
        xc = x.contiguous(memory_format=CL)
        _, idx_c = aten.max_pool2d_with_indices.default(xc, [2, 2], [2, 2])
        args = (ones, xc, [2, 2], [2, 2], [0, 0], [1, 1], False, idx_c)
        assert scratch(aten.max_pool2d_with_indices_backward.default, args) == {
            "grad_output contiguous": 216, "indices contiguous": 432, "grad_input contiguous": 864,
        }  # fmt: skip
        # A channels-last gradient of a contiguous input: the channels-last loop makes
        # the input gradient (864 B) and the indices (432 B) channels last.
        g_cl = torch.empty(2, 3, 3, 3).contiguous(memory_format=CL)
        args = (g_cl, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
        assert scratch(aten.max_pool2d_with_indices_backward.default, args) == {
            "grad_input contiguous": 864, "indices contiguous": 432,
        }  # fmt: skip
        # Average pooling: the same gradient, no indices.
        args = (g_cl, x, [2, 2], [2, 2], [0, 0], False, True, None)
        assert scratch(aten.avg_pool2d_backward.default, args) == {"grad_input contiguous": 864}
        # Adaptive max pooling switches on the input gradient's layout instead.
        _, idx_a = aten.adaptive_max_pool2d.default(x, [3, 3])
        assert scratch(aten.adaptive_max_pool2d_backward.default, (g_cl, x, idx_a)) == {
            "grad_output contiguous": 216,
        }  # fmt: skip


def test_pooling_output_size() -> None:
    """``pooling_output_shape``: floor, or ceil when the last window starts inside."""
    assert pooling_output_size(8, 2, 0, 2, 1, False) == 4
    assert pooling_output_size(9, 2, 0, 2, 1, False) == 4
    assert pooling_output_size(9, 2, 0, 2, 1, True) == 5
    assert pooling_output_size(8, 3, 1, 2, 2, True) == 4
    assert pooling_output_size(5, 2, 1, 2, 1, True) == 3


# -- estimate == measure --------------------------------------------------------------

_POOLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "max": lambda x: F.max_pool2d(x, 2),
    "max_padded": lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
    "avg": lambda x: F.avg_pool2d(x, 2, 1),
    "adaptive_avg": lambda x: F.adaptive_avg_pool2d(x, 3),
    "adaptive_max": lambda x: F.adaptive_max_pool2d(x, (2, 3)),
}
_LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda x: x,
    "channels_last": lambda x: x.contiguous(memory_format=CL),
    "transposed": lambda x: x.transpose(2, 3),
}
_LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda y: y.sum(),  # a broadcast output gradient
    "square": lambda y: y.square().sum(),
    "channels_last": lambda y: y.contiguous(memory_format=CL).square().sum(),
}


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize("pool", _POOLS)
def test_pool2d_exact(threads: int, dtype: torch.dtype, pool: str) -> None:
    fn = _POOLS[pool]
    for layout in _LAYOUTS.values():
        x = layout(torch.randn(2, 5, 8, 8, dtype=dtype))
        assert_exact(fn, (x,), train=False)
        for loss in _LOSSES.values():
            assert_exact(lambda x, loss=loss: loss(fn(x)), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_pool1d_exact(threads: int, dtype: torch.dtype) -> None:
    """1-d pooling runs the 2-d kernels on an ``unsqueeze(-2)`` view."""
    x = torch.randn(3, 4, 9, dtype=dtype)
    xt = torch.randn(3, 9, 4, dtype=dtype).transpose(1, 2)
    for fn in (
        lambda x: F.max_pool1d(x, 2),
        lambda x: F.avg_pool1d(x, 3, 1, 1),
        lambda x: F.adaptive_avg_pool1d(x, 4),
        lambda x: F.adaptive_max_pool1d(x, 2),
    ):
        for inp in (x, xt):
            assert_exact(lambda x, fn=fn: fn(x).sum(), (inp,))
            assert_exact(lambda x, fn=fn: fn(x).square().sum(), (inp,))
            assert_exact(fn, (inp,), train=False)


def test_max_pool1d_without_autograd_makes_no_indices(threads: int) -> None:
    """Regression: ``max_pool1d`` under ``no_grad`` runs ``max_pool1d_impl`` on the CPU,
    the output alone (3 x 4 x 4 floats = 192 B) and, for a transposed input, its
    contiguous copy (3 x 4 x 9 x 4 = 432 B); fake tensors took the path with int64
    indices (384 B more)."""
    x = torch.randn(3, 4, 9)
    xt = torch.randn(3, 9, 4).transpose(1, 2)
    pool = torch.nn.MaxPool1d(2)
    for inp, extra in ((x, 0), (xt, 432)):
        estimated = tm.estimate(pool, inp, train=False)
        assert estimated.forward_peak == inp.numel() * 4 + 192 + extra
        assert estimated.forward_peak == tm.measure(pool, inp, train=False).forward_peak
    # Padding, dilation, ceil mode, a 2-d input, a frozen input under grad mode.
    for fn in (
        lambda x: F.max_pool1d(x, 3, 2, 1, 2, ceil_mode=True),
        lambda x: torch.max_pool1d(x, [2]),
        lambda x: F.max_pool1d(x[0], 2),
    ):
        assert_exact(fn, (x,), train=False)
        assert_exact(fn, (xt,), train=False)
    assert_exact(lambda w, x: (F.max_pool1d(x, 2) * w).sum(), (torch.randn(4, 4),), (x,))


_POOLS3D: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "max": lambda x: F.max_pool3d(x, 2),
    "avg": lambda x: F.avg_pool3d(x, 2, 1),
    "adaptive_avg": lambda x: F.adaptive_avg_pool3d(x, 3),
    "adaptive_max": lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)),
}
CL3 = torch.channels_last_3d


def test_backward_3d_copies_a_broadcast_gradient() -> None:
    """The 3-d average pooling backwards run on ``grad_output.contiguous()``: a
    broadcast gradient of a (2, 3, 4, 4, 4) input's 2-pooled output (2 x 3 x 2 x 2 x 2
    floats = 192 B) is copied; a contiguous one is not."""
    with FakeTensorMode():
        x = torch.empty(2, 3, 4, 4, 4)
        ones = torch.ones(()).expand(2, 3, 2, 2, 2)
        args = (ones, x, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, None)
        assert scratch(aten.avg_pool3d_backward.default, args) == {"grad_output contiguous": 192}
        assert scratch(aten.avg_pool3d_backward.default, (ones.contiguous(), *args[1:])) == {}
        assert scratch(aten._adaptive_avg_pool3d_backward.default, (ones, x)) == {
            "grad_output contiguous": 192
        }


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize("pool", _POOLS3D)
def test_pool3d_backward_exact(threads: int, dtype: torch.dtype, pool: str) -> None:
    """OpInfo's ``nn.functional.{avg,max,adaptive_avg,adaptive_max}_pool3d`` samples
    (a broadcast gradient from ``sum()``) and the channels-last-3d layouts."""
    if pool == "avg" and dtype == BF16:
        pytest.skip("avg_pool3d_out_frame has no bfloat16 CPU kernel")
    fn = _POOLS3D[pool]
    for layout in (lambda x: x, lambda x: x.contiguous(memory_format=CL3)):
        x = layout(torch.randn(2, 3, 6, 6, 6, dtype=dtype))
        for loss in (
            lambda y: y.sum(),
            lambda y: y.square().sum(),
            lambda y: y.contiguous(memory_format=CL3).square().sum(),
        ):
            assert_exact(lambda x, loss=loss: loss(fn(x)), (x,))


# -- fractional max pooling -----------------------------------------------------------


def test_fractional_max_pool2d_backward_copies_a_broadcast_gradient_twice() -> None:
    """``fractional_max_pool2d_backward``: its meta function reads
    ``gradOutput.contiguous()`` before making the input gradient, its kernel again
    after: a broadcast gradient of the (2, 3, 4, 4) output (384 B) is copied twice,
    one copy at a time; a contiguous one is not."""
    with FakeTensorMode():
        x = torch.empty(2, 3, 9, 9)
        indices = torch.empty(2, 3, 4, 4, dtype=torch.long)
        ones = torch.ones(()).expand(2, 3, 4, 4)
        op = aten.fractional_max_pool2d_backward.default
        assert scratch(op, (ones, x, [2, 2], [4, 4], indices)) == {
            "grad_output contiguous": 384,
            "grad_output contiguous (kernel)": 384,
        }
        assert scratch(op, (ones.contiguous(), x, [2, 2], [4, 4], indices)) == {}


_FRACTIONAL = {
    "2d": (lambda x: F.fractional_max_pool2d(x, 2, output_size=(4, 3)), (2, 3, 9, 7)),
    "2d ratio": (lambda x: F.fractional_max_pool2d(x, 3, output_ratio=(0.5, 0.5)), (3, 9, 9)),
    "3d": (lambda x: F.fractional_max_pool3d(x, 2, output_size=3), (2, 3, 7, 6, 5)),
    "3d ratio": (lambda x: F.fractional_max_pool3d(x, (2, 1, 2), output_ratio=0.5), (3, 6, 6, 6)),
}


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize("pool", _FRACTIONAL)
def test_fractional_max_pool_exact(threads: int, dtype: torch.dtype, pool: str) -> None:
    """OpInfo's ``nn.functional.fractional_max_pool{2,3}d`` (a broadcast gradient from
    ``sum()``), a dense gradient, and a transposed input (copied by the forward);
    ``fractional_max_pool3d_backward`` has no meta kernel in torch
    (``devices/meta_kernels.py``)."""
    fn, shape = _FRACTIONAL[pool]
    for x in (torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype).transpose(-1, -2)):
        for loss in (lambda y: y.sum(), lambda y: y.square().sum()):
            assert_exact(lambda x, loss=loss: loss(fn(x)), (x,))
