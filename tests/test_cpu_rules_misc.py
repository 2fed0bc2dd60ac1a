"""CPU rules for elementwise kernels and dropout (``pytest_torchmem/tracing/devices/cpu/misc.py``),
and the tracker's following of wrapped numbers that autograd saves.

By hand, from ``TensorIteratorBase::compute_types`` (``TensorIterator.cpp``): on the
CPU an input whose dtype is not the common dtype is copied (``input.to(common)``,
its ``numel`` elements), as is an in-place or ``out=`` output of another dtype;
a Python number is a 0-dim ``double``/``int64``/``bool`` tensor, which the
``.Scalar`` overloads make inside the kernel (``wrapped_scalar_tensor``). Then
modules whose estimate equals the CPU allocator's measurement in every phase,
at 1 and 2 intra-op threads, in ``float32`` and ``bfloat16``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from exactness import assert_fn_exact as assert_exact, rule_buffers
from pytest_torchmem.tracing.devices.cpu import CPU
from pytest_torchmem.tracing.devices.cpu.misc import promotion_casts
from pytest_torchmem.tracing.rules import OpCall

aten = torch.ops.aten
BF16 = torch.bfloat16


def scratch(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> list[int]:
    """The sizes of the buffers the CPU scratch rule of ``op`` gives for fake ``args``."""
    return list(rule_buffers(op, args, kwargs).values())


# -- the bytes of one call, by hand ---------------------------------------------------


def test_promotion_casts() -> None:
    with FakeTensorMode():
        x = torch.empty(64, 64)
        xb, xd = x.to(BF16), x.to(torch.float64)
        sizes = lambda steps: [s.nbytes for s in steps]  # noqa: E731
        # x * 0.5: the double wrapped number becomes a 4-byte float.
        assert sizes(promotion_casts([x, 0.5])) == [4]
        assert sizes(promotion_casts([xb, 0.5])) == [2]
        assert sizes(promotion_casts([xd, 0.5])) == []
        # Tensors: the float32 input becomes 64 x 64 doubles.
        assert sizes(promotion_casts([x, xd])) == [64 * 64 * 8]
        # A broadcast operand is copied at its own size (64 elements).
        assert sizes(promotion_casts([x[:1], xd])) == [64 * 8]
        # bf16.add_(f32): a float temporary output, and the bf16 input as float.
        assert sizes(promotion_casts([xb, x], xb)) == [64 * 64 * 4, 64 * 64 * 4]
        # long / 2: true division casts both to the default float dtype.
        xl = torch.empty(64, 64, dtype=torch.int64)
        assert sizes(promotion_casts([xl, 2], int_to_float=True)) == [64 * 64 * 4, 4]


def test_scalar_overloads_wrap_inside_the_kernel() -> None:
    """``mul.Scalar``, ``div_.Scalar``, ``eq.Scalar``, ``rsub.Scalar`` and ``pow.Scalar``
    wrap the number (8 bytes) and cast it; the fake trace sees only a ``Scalar``."""
    with FakeTensorMode():
        x, xb = torch.empty(64, 64), torch.empty(64, 64, dtype=BF16)
        assert scratch(aten.mul.Scalar, (x, 0.5)) == [8, 4]
        assert scratch(aten.div_.Scalar, (xb, 0.9)) == [8, 2]
        assert scratch(aten.eq.Scalar, (x, 0.5)) == [8, 4]
        assert scratch(aten.rsub.Scalar, (x, 1)) == [8, 4]
        assert scratch(aten.pow.Scalar, (2, x)) == [8, 4]
        assert scratch(aten.pow.Scalar, (1, x)) == []
        assert scratch(aten.mul.Tensor, (x, 0.5)) == [4]  # the tracker charges the wrapped number
        assert scratch(aten.where.self, (x > 0, x, xb)) == [64 * 64 * 4]


def test_native_dropout_buffers() -> None:
    """``input.mul(mask).mul_(scale)``: the bool mask as float (64 x 256 x 4 B), then
    the wrapped scale and its cast; the backward's ``grad * mask * scale`` adds the
    intermediate product."""
    with FakeTensorMode():
        x = torch.empty(64, 256)
        assert scratch(aten.native_dropout.default, (x, 0.1, True)) == [65536, 8, 4]
        mask = torch.empty(64, 256, dtype=torch.bool)
        assert scratch(aten.native_dropout_backward.default, (x, mask, 1 / 0.9)) == [65536, 65536, 8, 4]


def test_reduced_precision_broadcast_keeps_channels_last() -> None:
    """A broadcast ``bfloat16`` operand times a channels-last one is channels last,
    as TensorIterator lays it out; the meta kernel makes it contiguous."""
    with FakeTensorMode():
        x = torch.empty(8, 16, 12, 12, dtype=BF16).to(memory_format=torch.channels_last)
        ones = torch.ones((), dtype=BF16).expand(8, 16, 12, 12)
        out = CPU.implementation_rule(aten.mul.Tensor)(OpCall(aten.mul.Tensor, (ones, x), {}))
        assert out.is_contiguous(memory_format=torch.channels_last)


# -- estimate == measure --------------------------------------------------------------

DTYPES = [torch.float32, BF16]


def _ids(v: Any) -> str:
    return str(v).replace("torch.", "").replace(" ", "")


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_python_numbers_exact(threads: int, dtype: torch.dtype) -> None:
    """Numbers in Tensor slots (wrapped by the argument parser), ``.Scalar`` overloads
    from C++ (``1 - x``, ``2 ** x``, comparisons), and in-place chains."""
    x = torch.randn(64, 64, dtype=dtype)
    assert_exact(lambda x: ((x * 3.0) / 7.0 - 2).square().sum(), (x,))
    assert_exact(lambda x: ((1 - x) * (2**x) * (x == 0.5) * (x < 1)).sum(), (x,))
    assert_exact(lambda x: x.clone().mul_(0.5).add_(1.0).div_(3).square().sum(), (x,))
    assert_exact(lambda x: torch.where(x > 0.5, x, 0.0).sum(), (x,))
    assert_exact(lambda x: (x * 0.5).sum(), (x,), train=False)


def test_saved_wrapped_numbers_exact(threads: int) -> None:
    """``scores / sqrt(d)``: ``DivBackward0`` keeps the wrapped ``double`` until the
    backward releases it, and its ``grad / other`` wraps nothing new."""

    def attention(q: torch.Tensor) -> torch.Tensor:
        scores = q @ q.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return (scores.softmax(-1) @ q).square().sum()

    assert_exact(attention, (torch.randn(4, 32, 16),))
    assert_exact(lambda x: ((x * 0.5) * (x * 0.5)).sum(), (torch.randn(64, 64),))


def test_mixed_dtypes_exact(threads: int) -> None:
    """Each leaf is used once: a leaf's second gradient is accumulated out of place
    for fake tensors (``InputBuffer::accumulate`` skips its in-place path for tensor
    subclasses), which is not this module's business."""
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    assert_exact(lambda x, y: (x + y.double()).float().sum(), (x,), (y,))
    assert_exact(lambda x, y: (x.to(BF16) * y).sum(), (x,), (y,))
    assert_exact(lambda x, y: torch.maximum(x, y.to(BF16)).sum() + (y.long() / 2).sum(), (x,), (y,))
    assert_exact(lambda x, y: x.to(BF16).add_(y).float().sum(), (x,), (y,))
    assert_exact(lambda x, y: torch.where(y > 0, x.to(BF16), y).sum(), (x,), (y,))


def test_channels_last_bfloat16_broadcast_exact(threads: int) -> None:
    """``sum()`` hands a broadcast gradient to a channels-last ``bfloat16`` product."""
    x = torch.randn(8, 16, 12, 12, dtype=BF16).to(memory_format=torch.channels_last)
    assert_exact(lambda x: x.square().sum(), (x,))


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_dropout_exact(threads: int, dtype: torch.dtype) -> None:
    x = torch.randn(64, 256, dtype=dtype)
    assert_exact(lambda x: F.dropout(x, 0.1).square().sum(), (x,))
    assert_exact(lambda x: torch.native_dropout(x, 0.1, True)[0].square().sum(), (x,))
    assert_exact(lambda x: torch.native_dropout(x, 0.1, False)[0].square().sum(), (x,))
