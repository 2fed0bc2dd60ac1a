"""CPU rules for normalisation (``pytest_torchmem/engine/tracing/devices/cpu/norm.py``).

Two kinds of test: the buffers a rule gives for one call, worked out by hand from
``Normalization.cpp`` / ``batch_norm_kernel.cpp``, ``layer_norm_kernel.cpp`` and
``group_norm_kernel.cpp``; and small modules whose estimate equals the CPU
allocator's measurement in every phase, at 1 and 2 intra-op threads, in
``float32``, ``bfloat16`` and mixed ``bfloat16``-input / ``float``-parameter form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import assert_exact_with_breakdown, intra_op_threads
from exactness import assert_fn_exact as assert_exact
from exactness import rule_buffers as scratch
from torch._subclasses.fake_tensor import FakeTensorMode

from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.engine.tracing.rules import OpCall

aten = torch.ops.aten
BF16 = torch.bfloat16
CL = torch.channels_last


def implementation(op: Any, args: tuple[Any, ...]) -> Any:
    return CPU.implementation_rule(op)(OpCall(op, args, {}))


# -- batch norm: the bytes of one call, by hand ----------------------------------------


def test_batch_norm_training_buffers(threads: int) -> None:
    """Training, 16 channels of float: ``_mean`` and ``_var_sum`` (16 x 4 B each),
    then ``alpha`` and ``beta`` (16 x 4 B each); a channels-last input reduces
    through ``{threads, 16}`` floats first."""
    with FakeTensorMode():
        x, c = torch.empty(8, 16, 12, 12), torch.empty(16)
        args = (x, c, c, c, c, True, 0.1, 1e-5)
        assert scratch(aten.native_batch_norm.default, args) == {
            "_mean": 64, "_var_sum": 64, "alpha": 64, "beta": 64,
        }  # fmt: skip
        args = (x.to(memory_format=CL), c, c, c, c, True, 0.1, 1e-5)
        assert scratch(aten.native_batch_norm.default, args) == {
            "_mean": 64, "_var_sum": 64, "per-thread sums": threads * 16 * 4, "alpha": 64, "beta": 64,
        }  # fmt: skip


def test_batch_norm_mixed_type_keeps_float_statistics() -> None:
    """A ``bfloat16`` input with ``float`` parameters: statistics, ``_mean``,
    ``_var_sum``, ``alpha`` and ``beta`` are ``float`` (16 x 4 B)."""
    with FakeTensorMode():
        x, c = torch.empty(8, 16, 12, 12, dtype=BF16), torch.empty(16)
        args = (x, c, c, c, c, True, 0.1, 1e-5)
        out, mean, invstd = implementation(aten.native_batch_norm.default, args)
        assert (out.dtype, mean.dtype, invstd.dtype) == (BF16, torch.float32, torch.float32)
        assert scratch(aten.native_batch_norm.default, args) == {
            "_mean": 64, "_var_sum": 64, "alpha": 64, "beta": 64,
        }  # fmt: skip


def test_batch_norm_eval_buffers() -> None:
    """Evaluation: no statistics are collected; ``alpha`` and ``beta`` remain."""
    with FakeTensorMode():
        x, c = torch.empty(8, 16, 12, 12), torch.empty(16)
        assert scratch(aten.native_batch_norm.default, (x, c, c, c, c, False, 0.1, 1e-5)) == {
            "alpha": 64,
            "beta": 64,
        }


def test_batch_norm_backward_buffers(threads: int) -> None:
    """Contiguous: ``grad_input`` is made twice (8 x 16 x 12 x 12 x 4 B). Channels
    last adds a ``{2, threads, 16}`` float buffer; ``bfloat16`` also float copies of
    weight, mean and inverse std (16 x 4 B each)."""
    with FakeTensorMode():
        x, c = torch.empty(8, 16, 12, 12), torch.empty(16)
        first = 8 * 16 * 12 * 12 * 4
        args = (x, x, c, c, c, c, c, True, 1e-5, [True, True, True])
        assert scratch(aten.native_batch_norm_backward.default, args) == {"grad_input (first)": first}
        xc = x.to(memory_format=CL)
        args = (xc, xc, c, c, c, c, c, True, 1e-5, [True, True, True])
        assert scratch(aten.native_batch_norm_backward.default, args) == {
            "grad_input (first)": first,
            "sum/dotp buffer": 2 * threads * 16 * 4,
        }
        xb = xc.to(BF16)
        args = (xb, xb, c, c, c, c, c, True, 1e-5, [True, True, True])
        assert scratch(aten.native_batch_norm_backward.default, args) == {
            "grad_input (first)": first // 2,
            "weight_f": 64, "mean_f": 64, "invstd_f": 64,
            "sum/dotp buffer": 2 * threads * 16 * 4,
        }  # fmt: skip


def test_batch_norm_backward_honours_the_output_mask() -> None:
    """Without ``output_mask[0]`` the CPU kernel makes no ``grad_input`` (the fake
    kernel does); nor is it made twice."""
    with FakeTensorMode():
        x, c = torch.empty(8, 16, 12, 12), torch.empty(16)
        args = (x, x, c, c, c, c, c, True, 1e-5, [False, True, True])
        grad_input, grad_weight, grad_bias = implementation(aten.native_batch_norm_backward.default, args)
        assert grad_input is None and grad_weight.shape == grad_bias.shape == (16,)
        assert scratch(aten.native_batch_norm_backward.default, args) == {}


# -- layer and group norm: the bytes of one call, by hand -------------------------------


def test_layer_norm_backward_buffer(threads: int) -> None:
    """``{2, threads, 64}`` elements of the input dtype for dgamma/dbeta partials;
    a broadcast ``dY`` is made contiguous (8 x 16 x 64 x 4 B)."""
    with FakeTensorMode():
        x, w, stat = torch.empty(8, 16, 64), torch.empty(64), torch.empty(8, 16, 1)
        mask = [True, True, True]
        op = aten.native_layer_norm_backward.default
        buffer = "dgamma/dbeta buffer"
        assert scratch(op, (x, x, [64], stat, stat, w, w, mask)) == {buffer: 2 * threads * 64 * 4}
        xb = x.to(BF16)
        assert scratch(op, (xb, xb, [64], stat, stat, w, w, mask)) == {buffer: 2 * threads * 64 * 2}
        assert scratch(op, (xb, xb, [64], stat, stat, w, w, [True, False, False])) == {}
        ones = torch.ones(()).expand(8, 16, 64)
        assert scratch(op, (ones, x, [64], stat, stat, w, w, mask)) == {
            "dY contiguous": 8 * 16 * 64 * 4,
            "dgamma/dbeta buffer": 2 * threads * 64 * 4,
        }


def test_layer_and_group_norm_mixed_type_statistics() -> None:
    """``param_scalar_type``: ``float`` mean and rstd for a ``bfloat16`` input with
    ``float`` weights; the group-norm ``dX`` stays ``bfloat16``."""
    with FakeTensorMode():
        x, w = torch.empty(4, 16, 64, dtype=BF16), torch.empty(64)
        _, mean, rstd = implementation(aten.native_layer_norm.default, (x, [64], w, w, 1e-5))
        assert mean.dtype == rstd.dtype == torch.float32
        x, w = torch.empty(4, 16, 8, 8, dtype=BF16), torch.empty(16)
        _, mean, rstd = implementation(aten.native_group_norm.default, (x, w, w, 4, 16, 64, 4, 1e-5))
        assert mean.dtype == rstd.dtype == torch.float32
        dx, dw, db = implementation(
            aten.native_group_norm_backward.default, (x, x, mean, rstd, w, 4, 16, 64, 4, [True, True, True])
        )
        assert (dx.dtype, dw.dtype, db.dtype) == (BF16, torch.float32, torch.float32)


def test_group_norm_buffers(threads: int) -> None:
    """Channels last, 4 x 16 channels in 4 groups: ``HxW < 1024`` takes ``{N*G, 2*D}``
    floats; ``HxW >= 1024`` ``{threads, N, 2C}`` and ``{N, 2G}``. The backward keeps
    ``ds``/``db`` of ``{N, C}`` floats (plus the same two buffers at ``HxW >= 2048``)."""
    with FakeTensorMode():
        w = torch.empty(16)
        small = torch.empty(4, 16, 8, 8).to(memory_format=CL)
        assert scratch(aten.native_group_norm.default, (small, w, w, 4, 16, 64, 4, 1e-5)) == {
            "scale/bias": 4 * 2 * 16 * 4
        }
        assert scratch(aten.native_group_norm.default, (small.contiguous(), w, w, 4, 16, 64, 4, 1e-5)) == {}
        big = torch.empty(2, 16, 48, 48).to(memory_format=CL)
        assert scratch(aten.native_group_norm.default, (big, w, w, 2, 16, 2304, 4, 1e-5)) == {
            "per-thread moments": threads * 2 * 2 * 16 * 4,
            "mean/rstd": 2 * 2 * 4 * 4,
        }
        stat = torch.empty(2, 4)
        args = (big, big, stat, stat, w, 2, 16, 2304, 4, [True, True, True])
        assert scratch(aten.native_group_norm_backward.default, args) == {
            "ds": 2 * 16 * 4,
            "db": 2 * 16 * 4,
            "per-thread gradients": threads * 2 * 2 * 16 * 4,
            "ds/db times gamma": 2 * 2 * 4 * 4,
        }


# -- estimate == measure --------------------------------------------------------------

_C = 16


def _bn(training: bool, loss: str = "square") -> Callable[..., torch.Tensor]:
    def fn(x: torch.Tensor, w: Any, b: Any, rm: torch.Tensor, rv: torch.Tensor) -> torch.Tensor:
        y = F.batch_norm(x, rm, rv, w, b, training=training)
        return y.square().sum() if loss == "square" else y.sum()

    return fn


@pytest.mark.parametrize(
    "shape, layout, dtype, param_dtype",
    [
        ((8, _C, 12, 12), "contiguous", torch.float32, torch.float32),
        ((8, _C, 12, 12), "channels_last", torch.float32, torch.float32),
        ((64, _C), "contiguous", torch.float32, torch.float32),
        ((64, _C, 1, 1), "contiguous", torch.float32, torch.float32),
        ((8, _C, 12, 12), "sliced", torch.float32, torch.float32),
        ((4, _C, 6, 6, 6), "contiguous", torch.float32, torch.float32),
        ((8, _C, 12, 12), "contiguous", BF16, BF16),
        ((8, _C, 12, 12), "contiguous", BF16, torch.float32),
        ((8, _C, 12, 12), "channels_last", BF16, torch.float32),
    ],
    ids=lambda v: str(v).replace("torch.", "").replace(" ", ""),
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_exact(
    threads: int,
    shape: tuple[int, ...],
    layout: str,
    dtype: torch.dtype,
    param_dtype: torch.dtype,
    training: bool,
) -> None:
    x = torch.randn(shape, dtype=dtype)
    if layout == "channels_last":
        x = x.to(memory_format=CL)
    elif layout == "sliced":
        x = torch.randn(shape[0], shape[1], shape[2] * 2, shape[3], dtype=dtype)[:, :, ::2]
    w, b = torch.randn(_C, dtype=param_dtype), torch.randn(_C, dtype=param_dtype)
    rm, rv = torch.zeros(_C, dtype=param_dtype), torch.ones(_C, dtype=param_dtype)
    # The input is a parameter, so grad_input is wanted.
    assert_exact(_bn(training), (x, w, b), (), (rm, rv))


def test_batch_norm_exact_without_input_gradient(threads: int) -> None:
    """Only weight and bias want gradients, and ``sum()`` hands the backward a
    broadcast (non-contiguous) gradient."""
    x, w, b = torch.randn(8, _C, 12, 12), torch.randn(_C), torch.randn(_C)
    stats = (torch.zeros(_C), torch.ones(_C))
    assert_exact(lambda w, b, x, rm, rv: _bn(True, "sum")(x, w, b, rm, rv), (w, b), (x,), stats)
    assert_exact(lambda w, b, x, rm, rv: _bn(True)(x, w, b, rm, rv), (w, b), (x,), stats)


def test_batch_norm_exact_without_affine(threads: int) -> None:
    x = torch.randn(8, _C, 12, 12).to(memory_format=CL)
    assert_exact(
        lambda x, rm, rv: F.batch_norm(x, rm, rv, None, None, training=False).square().sum(),
        (x,), (), (torch.zeros(_C), torch.ones(_C)),
    )  # fmt: skip


@pytest.mark.parametrize(
    "shape, dtype, param_dtype",
    [
        ((8, 16, 64), torch.float32, torch.float32),
        ((300, 64), torch.float32, torch.float32),
        ((8, 16, 64), BF16, BF16),
        ((8, 16, 64), BF16, torch.float32),
    ],
    ids=lambda v: str(v).replace("torch.", "").replace(" ", ""),
)
def test_layer_norm_exact(
    threads: int, shape: tuple[int, ...], dtype: torch.dtype, param_dtype: torch.dtype
) -> None:
    x = torch.randn(shape, dtype=dtype)
    w, b = torch.randn(64, dtype=param_dtype), torch.randn(64, dtype=param_dtype)
    assert_exact(lambda x, w, b: F.layer_norm(x, (64,), w, b).square().sum(), (x, w, b))


def test_layer_norm_exact_strided_and_broadcast(threads: int) -> None:
    """A transposed input is copied contiguous; ``sum()`` gives a broadcast ``dY``;
    a norm without affine takes no dgamma/dbeta buffer."""
    x, w, b = torch.randn(8, 16, 64), torch.randn(64), torch.randn(64)
    assert_exact(lambda x, w, b: F.layer_norm(x.transpose(0, 1), (64,), w, b).square().sum(), (x, w, b))
    assert_exact(lambda x, w, b: F.layer_norm(x, (64,), w, b).sum(), (x, w, b))
    assert_exact(lambda x: F.layer_norm(x, (16, 64)).square().sum(), (x,))


@pytest.mark.parametrize(
    "shape, layout, dtype, param_dtype",
    [
        ((4, 16, 8, 8), "contiguous", torch.float32, torch.float32),
        ((4, 16, 8, 8), "channels_last", torch.float32, torch.float32),
        ((2, 16, 48, 48), "channels_last", torch.float32, torch.float32),
        ((4, 16, 8, 8), "contiguous", BF16, BF16),
        ((4, 16, 8, 8), "contiguous", BF16, torch.float32),
        ((4, 16, 8, 8), "channels_last", BF16, torch.float32),
    ],
    ids=lambda v: str(v).replace("torch.", "").replace(" ", ""),
)
def test_group_norm_exact(
    threads: int, shape: tuple[int, ...], layout: str, dtype: torch.dtype, param_dtype: torch.dtype
) -> None:
    x = torch.randn(shape, dtype=dtype)
    if layout == "channels_last":
        x = x.to(memory_format=CL)
    w, b = torch.randn(16, dtype=param_dtype), torch.randn(16, dtype=param_dtype)
    assert_exact(lambda x, w, b: F.group_norm(x, 4, w, b).square().sum(), (x, w, b))


def test_group_norm_exact_without_affine(threads: int) -> None:
    x = torch.randn(4, 16, 8, 8).to(memory_format=CL)
    assert_exact(lambda x: F.group_norm(x, 4).square().sum(), (x,))


def test_channels_last_statistics_buffer_needs_more_rows_than_threads() -> None:
    """``batch_norm_cpu_collect_stats_channels_last_impl`` reduces through a
    ``{threads, C}`` buffer only when ``N*H*W > threads`` (float and double): a
    (2, 3, 1, 1) float input has 2 rows, so 2 threads read them directly and 1 thread
    takes a 1 x 3 x 4 B buffer. (The bfloat16 kernel takes its float buffer always.)"""
    with FakeTensorMode():
        x, c = torch.empty(2, 3, 1, 1), torch.empty(3)
        args = (x, c, c, c, c, True, 0.1, 1e-5)
        with intra_op_threads(2):
            assert "per-thread sums" not in scratch(aten.native_batch_norm.default, args)
            xb, cb = x.to(BF16), c.to(BF16)
            bf16 = scratch(aten.native_batch_norm.default, (xb, cb, cb, cb, cb, True, 0.1, 1e-5))
            assert bf16["per-thread sums"] == 2 * 3 * 4
        with intra_op_threads(1):
            assert scratch(aten.native_batch_norm.default, args)["per-thread sums"] == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, BF16], ids=str)
def test_batch_norm_few_rows_and_channels_last_leaves_exact(threads: int, dtype: torch.dtype) -> None:
    """Regression: N x C x 1 x 1 inputs with no more rows than threads; and a
    channels-last bfloat16 leaf, whose input gradient the kernel makes channels last
    (the fake kernel made it contiguous, and autograd copied it to the leaf's layout)."""
    for shape, cl in (((2, 2, 1), False), ((2, 3, 1, 1), False), ((1, 4, 2, 1), True), ((2, 4, 3, 3), True)):
        x = torch.randn(*shape, dtype=dtype)
        if cl:
            x = x.contiguous(memory_format=CL)
        channels = shape[1]
        ones, zeros = torch.ones(channels, dtype=dtype), torch.zeros(channels, dtype=dtype)
        leaf = x.clone().requires_grad_()
        assert_exact(lambda w, b, x: F.batch_norm(x, None, None, w, b, training=True).sum(), (ones, zeros), (leaf,))
        assert_exact(lambda x: F.batch_norm(x, None, None, training=True), (), (x,), train=False)


def test_batch_norm_strided_input_buffers() -> None:
    """A transposed (8, 4, 10) float input is not contiguous: evaluation takes
    ``invstd = 1 / sqrt(running_var + eps)`` (the wrapped ``eps`` and its float, then
    three 4 x 4 B tensors: ``Scalar / Tensor`` is ``empty_like(y).fill_(1).div_(y)``)
    and, with no affine parameters, a 1-element weight and bias for the iterator."""
    with FakeTensorMode():
        x, c = torch.empty(8, 10, 4).transpose(1, 2), torch.empty(4)
        assert scratch(aten.native_batch_norm.default, (x, None, None, c, c, False, 0.1, 1e-5)) == {
            "eps wrapped": 8, "eps cast": 4, "running_var + eps": 16, "sqrt": 16, "invstd": 16,
            "weight 1": 4, "bias 0": 4,
        }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_batch_norm_strided_input_exact(threads: int, dtype: torch.dtype) -> None:
    """Regression: a transposed input, training (statistics through ``at::mean``, the
    output made before them) and evaluation, with and without affine parameters; the
    input gradient is contiguous (``empty_like(input, suggest_memory_format())``), so
    autograd copies it into the strided leaf's layout; the output too is contiguous
    (``empty_like(self, self.suggest_memory_format())``)."""
    x = torch.randn(8, 10, 4, dtype=dtype).transpose(1, 2)
    w, b = torch.randn(4, dtype=dtype), torch.randn(4, dtype=dtype)
    mean, var = torch.zeros(4, dtype=dtype), torch.ones(4, dtype=dtype)
    leaf = x.detach().clone().requires_grad_()
    for training in (True, False):
        def normed(x: torch.Tensor, w: Any = None, b: Any = None, training: bool = training) -> torch.Tensor:
            return F.batch_norm(x, mean, var, w, b, training)

        assert_exact(lambda w, b, x, normed=normed: normed(x, w, b).sum(), (w, b), (leaf,))
        # the output is contiguous, so a second batch norm takes the contiguous path
        assert_exact(lambda x, normed=normed: normed(normed(x)), (), (x,), train=False)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_norm_gradients_follow_the_input_layout(threads: int, dtype: torch.dtype) -> None:
    """Regression: the fake kernels of ``native_layer_norm_backward`` and
    ``native_group_norm_backward`` laid ``dX`` out like ``dY``; the CPU kernels make
    it contiguous (layer norm) or like ``X`` (group norm), so a gradient arriving
    transposed was copied by the leaf's ``AccumulateGrad`` in the estimate only."""
    x = torch.randn(2, 4, 6, dtype=dtype, requires_grad=True)
    assert_exact_with_breakdown(lambda x: F.layer_norm(x, (6,)).transpose(1, 2).mul(0.5).sum(), (x,))
    assert_exact_with_breakdown(lambda x: F.group_norm(x, 2).transpose(1, 2).mul(0.5).sum(), (x,))
    w = torch.randn(6, dtype=dtype, requires_grad=True)
    assert_exact_with_breakdown(lambda x, w: F.layer_norm(x, (6,), w, w).transpose(1, 2).mul(0.5).sum(), (x, w))
    x = torch.randn(2, 4, 3, 5, dtype=dtype).contiguous(memory_format=torch.channels_last)
    assert_exact_with_breakdown(lambda x: F.group_norm(x, 2).permute(0, 2, 3, 1).mul(0.5).sum(), (x.requires_grad_(),))
