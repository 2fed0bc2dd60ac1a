"""CPU rules for elementwise kernels and dropout (``pytest_torchmem/engine/tracing/devices/cpu/misc.py``),
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
from exactness import assert_exact as assert_model_exact
from exactness import assert_exact_with_breakdown, rule_buffers
from exactness import assert_fn_exact as assert_exact
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import promotion_casts, view_strides
from pytest_torchmem.engine.tracing.rules import Alloc, Free, OpCall

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
        # deg2rad / rad2deg: mul_out(result, self, wrapped_scalar_tensor(pi / 180));
        # an integer input is also cast to the default float dtype (64 x 64 x 4 B).
        assert scratch(aten.deg2rad.default, (x,)) == [8, 4]
        assert scratch(aten.rad2deg_.default, (xb,)) == [8, 2]
        xi = torch.empty(64, 64, dtype=torch.int64)
        assert scratch(aten.rad2deg.default, (xi,)) == [8, 64 * 64 * 4, 4]
        # ldexp: pow(2.0, other) (64 x 64 floats), its wrapped 2.0 and cast, then the product.
        assert scratch(aten.ldexp.Tensor, (x, x)) == [64 * 64 * 4, 8, 4]
        assert scratch(aten.ldexp.Tensor, (x, xi)) == []


def test_ldexp_of_other_dtypes_powers_a_two_of_self_dtype() -> None:
    """``_pow2`` (``BinaryOps.cpp``) of a bfloat16, float16 or float64 ``self`` is
    ``at::full({}, 2.0, self.options()).pow(other)``: a 0-dim two of ``self``'s dtype
    (2, 2, 8 bytes), no wrapped number, then the power (8 elements); an operand of
    another dtype is cast, in the power (float32 ``other``: the two as float, 4 B) or
    in the product (``self`` as float, 8 x 8 x 4 B). A float32 ``self`` with a bfloat16
    ``other`` takes ``pow(2.0, other)`` (bfloat16), then casts it to float for the
    product (8 x 4 B). An integer ``self`` and ``other``: ``pow(2.0, other)`` in float
    (its wrapped 2.0, the 2.0 and ``other`` cast), then ``self`` cast (8 x 8 x 4 B)."""
    with FakeTensorMode():
        x = torch.empty(8, 8)
        e = torch.empty(8)
        for dtype, two in ((BF16, 2), (torch.float16, 2), (torch.float64, 8)):
            size = torch.empty((), dtype=dtype).element_size()
            assert scratch(aten.ldexp.Tensor, (x.to(dtype), e.to(dtype))) == [two, 8 * size]
        assert scratch(aten.ldexp.Tensor, (x.to(BF16), e)) == [2, 4, 8 * 4, 8 * 8 * 4]
        assert scratch(aten.ldexp.Tensor, (x, e.to(BF16))) == [8 * 2, 8, 2, 8 * 4]
        xi, ei = x.long(), e.long()
        assert scratch(aten.ldexp.Tensor, (xi, ei)) == [8 * 4, 8, 4, 8 * 4, 8 * 8 * 4]


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
    assert_exact(lambda x: (torch.deg2rad(x) + torch.rad2deg(x)).sum(), (x,))
    assert_exact(lambda x: x.clone().deg2rad_().sum(), (x,), train=False)
    xi = torch.randint(0, 9, (8, 8))
    assert_exact(lambda x: torch.rad2deg(x).sum(), inputs=(xi,), train=False)
    e = torch.randn(8, dtype=dtype)
    assert_exact(lambda x: torch.ldexp(x, e).sum(), (x[:8, :8],))
    assert_exact(lambda x: torch.ldexp(x[:, :1], e).sum(), (x[:8],))


@pytest.mark.parametrize(
    ("x_dtype", "e_dtype"),
    [
        (BF16, BF16), (torch.float16, torch.float16), (torch.float64, torch.float64),
        (BF16, torch.float32), (torch.float32, BF16), (BF16, torch.int64), (torch.float32, torch.int64),
        (torch.int64, torch.int64),
    ],
    ids=_ids,
)  # fmt: skip
# (an int64 exponent makes ldexp's result int64 first, then resizes the float out it is given)
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized:UserWarning")
def test_ldexp_forward_exact(threads: int, x_dtype: torch.dtype, e_dtype: torch.dtype) -> None:
    """OpInfo's ``ldexp`` samples (a (5, 1) ``self``, a (5,) exponent, and 0-dim ones):
    the power, then the product, at the forward's peak; with an integer exponent,
    ``empty_like(self)`` (10 or 20 B), then the (5, 5) result it is resized to."""
    x, e = torch.randn(5, 1).to(x_dtype), torch.randn(5).mul(3).to(e_dtype)
    assert_exact(lambda x, e: torch.ldexp(x, e), inputs=(x, e), train=False)
    assert_exact(lambda x, e: torch.ldexp(x, e), inputs=(x[0, 0].clone(), e[0].clone()), train=False)


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


# -- foreach ops: the CPU slow path ------------------------------------------------------


def _inner_peak(op: Any, args: tuple[Any, ...]) -> int:
    """The most bytes a scratch rule's buffers hold at once."""
    live = top = 0
    sizes: dict[str, int] = {}
    out = op(*args)
    for step in CPU.scratch_rule(op)(OpCall(op, args, {}, out)):
        if isinstance(step, Alloc):
            sizes[step.tag] = step.nbytes
            live += step.nbytes
            top = max(top, live)
        elif isinstance(step, Free):
            live -= sizes.pop(step.tag)
    return top


def test_foreach_scalar_ops_loop_over_scalar_overloads() -> None:
    """The CPU runs ``_foreach_mul_(tensors, 0.9)`` as ``t.mul_(0.9)`` per tensor
    (``ForeachOpsKernels.cpp``): each call wraps the number (8 B ``double``) and
    casts it to the tensor's dtype (4 B ``float``, 2 B ``bfloat16``, nothing for a
    ``double``), and frees both before the next call."""
    with FakeTensorMode():
        a, b = torch.empty(3, 3), torch.empty(3, dtype=BF16)
        d = torch.empty(5, dtype=torch.float64)
        assert scratch(aten._foreach_mul_.Scalar, ([a, b], 0.9)) == [8, 4, 8, 2]
        assert _inner_peak(aten._foreach_mul_.Scalar, ([a, b], 0.9)) == 8 + 4
        assert scratch(aten._foreach_div_.ScalarList, ([a, d], [2.0, 3.0])) == [8, 4, 8]
        assert scratch(aten._foreach_add.Scalar, ([b, b], 1.0)) == [8, 2, 8, 2]
        # Tensor operands: only promotions. a.add_(double): a float temporary
        # output and ``a`` as double (3 x 3 x 8 B each); b + b: nothing.
        assert scratch(aten._foreach_add_.List, ([a, b], [a.double(), b])) == [72, 72]
        assert scratch(aten._foreach_mul_.Tensor, ([a], torch.tensor(2.0))) == []


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float64], ids=_ids)
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_foreach_optimizers_exact(threads: int, dtype: torch.dtype, name: str) -> None:
    """Adam's and AdamW's foreach steps on the CPU: ``_foreach_mul_(exp_avg_sqs, beta2)``,
    ``_foreach_div_(..., bias_correction2_sqrt)``, ``_foreach_add_(..., eps)`` and, with
    weight decay, ``_foreach_mul_(params, 1 - lr * wd)`` or ``_foreach_add``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    cls = getattr(torch.optim, name)
    for amsgrad, weight_decay in ((False, 0.0), (True, 0.01)):
        options = {"lr": 0.01, "foreach": True, "amsgrad": amsgrad, "weight_decay": weight_decay}
        assert_model_exact(model, x, optimizer=lambda p, options=options: cls(p, **options))


class _CheckpointedHeads(torch.nn.Module):
    """``s = fc(x) / sqrt(d)`` (a saved wrapped number), then a non-reentrant
    checkpoint whose body multiplies by a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.a, self.b = torch.nn.Linear(8, 1), torch.nn.Linear(1, 8)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        h = (h.view(2, 3, 2, 4).transpose(1, 2) * 2.0).transpose(1, 2).reshape(2, 3, 8)
        return self.b(self.a(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.fc(x) / math.sqrt(8)
        return s + 0.5 * checkpoint(self.body, s, use_reentrant=False, preserve_rng_state=False)


def test_saved_numbers_are_read_without_running_checkpoint_hooks() -> None:
    """Regression: looking for saved wrapped numbers on the running backward node read
    every saved tensor, which runs a non-reentrant checkpoint's unpack hook (a
    recomputation inside the recomputation: torch's internal assertion failed)."""
    torch.manual_seed(0)
    assert_model_exact(_CheckpointedHeads(), torch.randn(2, 3, 8))


# -- views ----------------------------------------------------------------------------


@st.composite
def _viewable(draw: Any) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A strided tensor (sizes of 1 common, some dims permuted or sliced) and a
    shape of the same number of elements."""
    shape = draw(st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=0, max_size=5))
    base = torch.empty([s * draw(st.sampled_from([1, 1, 2])) for s in shape])
    t = base[tuple(slice(None, s) for s in shape)]
    order = draw(st.permutations(range(len(shape))))
    t = t.permute(order) if draw(st.booleans()) else t
    dims = draw(st.lists(st.sampled_from([1, 1, 2, 3, 4, 6]), min_size=0, max_size=5))
    new = tuple(dims) if math.prod(dims) == t.numel() else (*dims, t.numel() // max(math.prod(dims), 1), 1)
    if math.prod(new) != t.numel():
        new = (1, t.numel(), 1)
    return t, new


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(_viewable())
def test_view_strides_follow_compute_stride(case: tuple[torch.Tensor, tuple[int, ...]]) -> None:
    """``view_strides`` gives the strides the real ``view`` gives, sizes of 1
    included, and None where the real one refuses."""
    t, new = case
    try:
        expected: tuple[int, ...] | None = t.view(new).stride()
    except RuntimeError:
        expected = None
    assert view_strides(t.shape, t.stride(), new) == expected


def test_fake_view_takes_the_real_strides() -> None:
    """Regression: ``(1, 1, 3, 2)`` with strides ``(2, 2, 2, 1)`` viewed as ``(1, 1, 6)``
    is ``(6, 6, 1)`` in ATen (the fake kernel said ``(2, 2, 1)``), and the CPU
    ``mm`` of its transpose then copies nothing. Found in ``nn.MultiheadAttention``'s
    backward with one token."""
    with FakeTensorMode():
        x = torch.empty(1, 1, 3, 2)
        out = CPU.implementation_rule(aten.view.default)(OpCall(aten.view.default, (x, [1, 1, 6]), {}))
        assert out.stride() == (6, 6, 1)
        assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
    layer = torch.nn.MultiheadAttention(2, 1, bias=False)
    torch.manual_seed(0)
    assert_model_exact(_SelfAttention(layer), torch.randn(1, 1, 2))


class _SelfAttention(torch.nn.Module):
    def __init__(self, layer: torch.nn.MultiheadAttention) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, x, x, need_weights=False)[0]


def test_exact_gelu_backward_reorders_strided_gradients_for_onednn() -> None:
    """``gelu_backward_out_cpu`` runs oneDNN's eltwise backward for a contiguous float
    input: a transposed (4, 5, 12) output gradient, and the input gradient laid out
    like it, are reordered into dense 960 B buffers; a strided input, the tanh
    approximation or float64 take the TensorIterator kernel (nothing)."""
    with FakeTensorMode():
        x, g = torch.empty(4, 5, 12), torch.empty(4, 12, 5).transpose(1, 2)
        assert scratch(aten.gelu_backward.default, (g, x)) == [960, 960]
        assert scratch(aten.gelu_backward.default, (x, x)) == []
        assert scratch(aten.gelu_backward.default, (g, g)) == []
        assert scratch(aten.gelu_backward.default, (g, x), {"approximate": "tanh"}) == []
        assert scratch(aten.gelu_backward.default, (g.double(), x.double())) == []


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16], ids=_ids)
def test_activation_backwards_exact(threads: int, dtype: torch.dtype) -> None:
    """Regression: with a broadcast output gradient (``sum()``'s backward) the
    reduced-precision meta kernels of ``gelu/sigmoid/tanh/silu/mish_backward`` made a
    contiguous input gradient where TensorIterator follows the input's layout, and
    autograd then copied it into a strided leaf's layout."""
    for make in (
        lambda: torch.randn(4, 12, 5, dtype=dtype).transpose(1, 2),
        lambda: torch.randn(2, 3, 4, 5, dtype=dtype).contiguous(memory_format=torch.channels_last),
    ):
        x = make().requires_grad_()
        for act in (F.gelu, torch.sigmoid, torch.tanh, F.silu, F.mish):
            assert_exact(lambda x, act=act: act(x).sum(), (x,))
        assert_exact(lambda x: F.gelu(x).transpose(-1, -2).square().sum(), (x.detach().contiguous(),))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=_ids)
def test_gradients_arriving_transposed_keep_their_layout(threads: int, dtype: torch.dtype) -> None:
    """Regression: the fake kernels (decompositions) of ``hardtanh/hardswish/
    hardsigmoid/softplus/elu/logit_backward`` and ``native_dropout_backward`` laid
    the input gradient out like the input, where TensorIterator follows the output
    gradient; a contiguous leaf then copied a gradient that arrived transposed
    (``AccumulateGrad``) in the estimate only."""
    with FakeTensorMode():
        g, x = torch.empty(2, 3, 4, dtype=dtype).transpose(1, 2), torch.empty(2, 4, 3, dtype=dtype)
        for op, args in (
            (aten.hardtanh_backward.default, (g, x, -1.0, 1.0)),
            (aten.elu_backward.default, (g, 1.0, 1.0, 1.0, False, x)),
            (aten.native_dropout_backward.default, (g, x > 0, 2.0)),
        ):
            out = CPU.implementation_rule(op)(OpCall(op, args, {}))
            assert out.stride() == g.stride(), op
    x = torch.randn(2, 4, 3, dtype=dtype, requires_grad=True)
    for act in (
        F.hardtanh, F.relu6, F.hardswish, F.hardsigmoid, F.softplus, F.elu, F.selu, F.celu,
        lambda x: torch.logit(x, eps=1e-3),
    ):  # fmt: skip
        assert_exact_with_breakdown(lambda x, act=act: act(x).transpose(1, 2).mul(0.5).sum(), (x,))
    assert_exact_with_breakdown(lambda x: F.dropout(x, 0.5).transpose(1, 2).mul(0.5).sum(), (x,))


# -- copies of transposed matrices -----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, size, block",
    [
        (torch.float32, (100, 80), 60 * 60 * 4),
        (torch.bfloat16, (100, 80), 60 * 60 * 2),
        (torch.uint8, (100, 80), 120 * 120),
        (torch.bool, (100, 80), 60 * 60),
        (torch.float32, (60, 60), 60 * 60 * 4),
        (torch.float32, (59, 61), 0),
    ],
)
def test_transposed_copy_takes_a_block_buffer(dtype: torch.dtype, size: tuple[int, int], block: int) -> None:
    """``copy_`` into a contiguous tensor from a transposed-contiguous 2-D matrix of 3600
    elements or more (``copy_transpose_valid``, ``Copy.cpp``) goes through a 60x60 block
    buffer (120x120 bytes for ``uint8``): ``x.t().contiguous()`` and ``copy_``."""
    x = torch.empty(size, device="meta", dtype=dtype)
    assert scratch(aten.clone.default, (x.t(),), {"memory_format": torch.contiguous_format}) == (
        [block] if block else []
    )
    dst = torch.empty(size[::-1], device="meta", dtype=dtype)
    assert scratch(aten.copy_.default, (dst, x.t())) == ([block] if block else [])
    assert scratch(aten.clone.default, (x.t(),)) == []  # (preserves the transposed layout)


@pytest.mark.parametrize("fn", [lambda x: x.t().contiguous(), lambda x: torch.empty(80, 100).copy_(x.t())])
def test_transposed_copies_equal_measure(fn: Any) -> None:
    x = torch.randn(100, 80)
    assert_model_exact(_Fn(fn), x, train=False)


class _Fn(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
