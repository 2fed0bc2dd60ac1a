"""CPU rules for reductions and losses (``pytest_torchmem/engine/tracing/devices/cpu/reduce.py``).

The bytes a rule gives for one call are worked out by hand from
``TensorIteratorReduce.cpp`` (the two-pass reduction's ``{threads} + output``
buffer, taken when the output is one element, the input has at least
``GRAIN_SIZE`` = 32768 elements and more than one thread runs), ``ReduceOps.cpp``
(input casts of ``make_reduction``, ``mean_out``'s ``sum_out(...).div_(n)``),
``SortingKernel.cpp`` and ``Loss.cpp``; small modules then check that the
estimate equals the CPU allocator's measurement in every phase, at 1 and 2
intra-op threads, below and above the grain size, in ``float32`` and ``bfloat16``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import assert_fn_exact as assert_exact
from exactness import rule_buffers as scratch
from torch._subclasses.fake_tensor import FakeTensorMode

from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.engine.tracing.devices.cpu.reduce import GRAIN_SIZE, two_pass_buffer
from pytest_torchmem.engine.tracing.rules import OpCall

aten = torch.ops.aten
BF16 = torch.bfloat16


# -- the bytes of one call, by hand ---------------------------------------------------


def test_two_pass_buffer_condition(threads: int) -> None:
    """One output element, ``GRAIN_SIZE`` input elements and several threads:
    ``threads`` output elements; else nothing."""
    assert GRAIN_SIZE == 32768
    expected = 0 if threads == 1 else threads * 4
    assert two_pass_buffer(threads, 32768, 1, torch.float32) == expected
    assert two_pass_buffer(threads, 32767, 1, torch.float32) == 0
    assert two_pass_buffer(threads, 65536, 256, torch.float32) == 0
    assert two_pass_buffer(threads, 65536, 1, torch.float64) == (0 if threads == 1 else threads * 8)


def test_sum_buffers(threads: int) -> None:
    """``x.sum()`` of 256 x 256 floats: the two-pass buffer only; a bool mask is
    summed into ``int64`` from an ``int64`` copy (65536 x 8 B)."""
    with FakeTensorMode():
        x = torch.empty(256, 256)
        partials = {} if threads == 1 else {"sum: per-thread partials": threads * 4}
        assert scratch(aten.sum.default, (x,)) == partials
        assert scratch(aten.sum.dim_IntList, (x, [1])) == {}
        mask = torch.empty(256, 256, dtype=torch.bool)
        assert scratch(aten.sum.default, (mask,)) == {
            "sum: input as torch.int64": 65536 * 8,
            **({} if threads == 1 else {"sum: per-thread partials": threads * 8}),
        }


def test_mean_buffers(threads: int) -> None:
    """``mean`` is ``sum_out(...).div_(numel)``: the ``int64`` count wrapped (8 B) and
    cast to the sum's dtype; ``bfloat16`` sums a ``float`` copy of the input into a
    ``float`` result."""
    with FakeTensorMode():
        x = torch.empty(256, 256)
        two_pass = {} if threads == 1 else {"mean: per-thread partials": threads * 4}
        assert scratch(aten.mean.default, (x,)) == {
            **two_pass, "mean: wrapped count": 8, "mean: count as result dtype": 4,
        }  # fmt: skip
        assert scratch(aten.mean.dim, (x.to(BF16), [1])) == {
            "mean: float result": 256 * 4,
            "mean: input as torch.float32": 65536 * 4,
            "mean: wrapped count": 8,
            "mean: count as result dtype": 4,
        }


def test_full_variance_takes_a_mean_first(threads: int) -> None:
    """``std_var_all_cpu`` (float/double, full reduction) computes ``self.mean()``."""
    with FakeTensorMode():
        x = torch.empty(256, 256)
        two_pass = {} if threads == 1 else {"mean: per-thread partials": threads * 4}
        assert scratch(aten.var.correction, (x,)) == {
            "std_var_all_cpu: mean": 4,
            **two_pass,
            "mean: wrapped count": 8,
            "mean: count as result dtype": 4,
        }
        assert scratch(aten.var.correction, (x, [1])) == {}
        assert scratch(aten.var.correction, (x.to(BF16),)) == {}


def test_count_nonzero_over_a_dim(threads: int) -> None:
    """``count_nonzero(x, dim)`` is ``(x != 0).sum(dim)``: the wrapped zero (8 B) and its
    float cast (4 B), the bool mask (numel B) and the sum's int64 copy of it
    (numel x 8 B); a bool input is summed as it is; no dim counts into the output."""
    with FakeTensorMode():
        x = torch.empty(16, 32)
        assert scratch(aten.count_nonzero.dim_IntList, (x, [0])) == {
            "self != 0: wrapped 0": 8,
            "input 1 as torch.float32": 4,
            "self != 0": 512,
            "sum: input as torch.int64": 512 * 8,
        }
        mask = torch.empty(16, 32, dtype=torch.bool)
        assert scratch(aten.count_nonzero.dim_IntList, (mask, [0])) == {
            "sum: input as torch.int64": 512 * 8
        }
        assert scratch(aten.count_nonzero.default, (x,)) == {}


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.int32, torch.bool], ids=str)
@pytest.mark.parametrize("shape", [(16, 32), (256, 256)], ids=str)
def test_count_nonzero_exact(threads: int, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = (torch.randn(shape) * 2).to(dtype)
    for dim in (0, (0, 1), None):
        assert_exact(lambda x: torch.count_nonzero(x, dim=dim).float(), inputs=(x,), train=False)


def test_scans_sorts_and_predicates() -> None:
    """``cumsum`` of a bool mask converts it to ``int64``; ``sort`` fills its indices
    from ``arange(size(dim))``; ``any()`` of floats reduces a bool copy."""
    with FakeTensorMode():
        mask = torch.empty(64, 32, dtype=torch.bool)
        assert scratch(aten.cumsum.default, (mask, 0)) == {"scan: input as result dtype": 64 * 32 * 8}
        x = torch.empty(64, 32)
        assert scratch(aten.sort.default, (x, 0)) == {"sort: arange indices": 64 * 8}
        assert scratch(aten.sort.default, (x,)) == {"sort: arange indices": 32 * 8}
        assert scratch(aten.any.default, (x,)) == {"all/any: input as torch.bool": 64 * 32}


def test_renorm_takes_a_norm_per_slice() -> None:
    """``renorm(x, p, 1, maxnorm)`` of a (5, 6, 7) input: one norm per slice along dim 1
    (6 floats); in ``bfloat16`` the norm is a ``float`` reduction of a ``float`` copy
    (5 x 6 x 7 x 4 B), then the ``bfloat16`` factor (6 x 2 B)."""
    with FakeTensorMode():
        x = torch.empty(5, 6, 7)
        assert scratch(aten.renorm.default, (x, 2, 1, 0.5)) == {"norm": 6 * 4}
        xb = torch.empty(5, 6, 7, dtype=BF16)
        assert scratch(aten.renorm_.default, (xb, 2, -1, 0.5)) == {
            "norm (float)": 7 * 4, "norm: input as float": 5 * 6 * 7 * 4, "factor": 7 * 2,
        }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float64], ids=str)
def test_renorm_exact(threads: int, dtype: torch.dtype) -> None:
    """OpInfo's ``renorm`` samples, in place and on a transposed view."""
    x = torch.randn(5, 6, 7, dtype=dtype)
    assert_exact(lambda x: torch.renorm(x, 2, 1, 0.5).sum(), (x,))
    assert_exact(lambda x: torch.renorm(x, 1, 0, 3.0).square().sum(), (x,))
    assert_exact(lambda x: x.clone().renorm_(2, -1, 0.5).sum(), (x,), train=False)
    assert_exact(lambda x: torch.renorm(x.transpose(0, 2), 2, 0, 0.5).sum(), (x,))


def test_pointwise_losses_keep_an_input_sized_scalar() -> None:
    """``mse_loss`` builds its output at the inputs' size, then ``resize_({})``s it:
    the scalar keeps 64 x 200 x 4 B. The unreduced loss is a temporary of that size."""
    with FakeTensorMode():
        x = torch.empty(64, 200)
        out = CPU.implementation_rule(aten.mse_loss.default)(OpCall(aten.mse_loss.default, (x, x), {}))
        assert out.shape == () and out.untyped_storage().nbytes() == 64 * 200 * 4
        assert scratch(aten.mse_loss.default, (x, x, 2)) == {"unreduced loss": 64 * 200 * 4}
        assert scratch(aten.mse_loss.default, (x, x, 0)) == {}
        out = CPU.implementation_rule(aten.binary_cross_entropy.default)(
            OpCall(aten.binary_cross_entropy.default, (x, x), {})
        )
        assert out.untyped_storage().nbytes() == 64 * 200 * 4


# -- estimate == measure --------------------------------------------------------------

SHAPES = [(32, 50), (256, 256)]  # below and above GRAIN_SIZE elements
DTYPES = [torch.float32, BF16]


def _ids(v: Any) -> str:
    return str(v).replace("torch.", "").replace(" ", "")


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_reductions_exact(threads: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = torch.randn(shape, dtype=dtype)
    assert_exact(lambda x: x.sum() + x.mean() + x.amax() * x.amin(1).sum(), (x,))
    assert_exact(lambda x: x.mean(1).sum() * x.sum(0).mean(), (x,))
    assert_exact(lambda x: x.var() + x.std(1).sum() + x.norm(), (x,))
    assert_exact(lambda x: x * ((x > 0).sum() + (x > 0).any() + (x > 0).all() + x.any()), (x,))
    assert_exact(lambda x: (x.cumsum(0) + (x > 0).cumsum(1)).sum(), (x,))
    # Forward only: the backward formulas of prod and sort take another branch for
    # fake tensors (isTensorSubclassLike), which the CPU kernels do not.
    assert_exact(lambda x: x.prod() + x.sort(-1)[0].sum() + x.argsort(0).sum(), (x,), train=False)


def test_reductions_with_dtype_exact(threads: int) -> None:
    x = torch.randn(256, 256)
    assert_exact(lambda x: x.sum(dtype=torch.float64).float() + x.mean(dtype=torch.float64).float(), (x,))
    assert_exact(lambda x: torch.linalg.vector_norm(x.to(BF16), dtype=torch.float32), (x,))
    assert_exact(lambda x: x.double().var().float(), (x,))


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_softmax_and_cross_entropy_exact(threads: int, dtype: torch.dtype) -> None:
    logits, target = torch.randn(64, 200, dtype=dtype), torch.randint(0, 200, (64,))
    assert_exact(lambda x: x.softmax(-1).square().sum() + x.log_softmax(0).square().sum(), (logits,))
    assert_exact(lambda x: F.cross_entropy(x, target), (logits,))
    assert_exact(lambda x: F.cross_entropy(x, target, label_smoothing=0.1, ignore_index=3), (logits,))
    assert_exact(lambda x: F.nll_loss(x.log_softmax(-1), target, reduction="sum"), (logits,))
    images, pixels = torch.randn(4, 10, 8, 8, dtype=dtype), torch.randint(0, 10, (4, 8, 8))
    assert_exact(lambda x: F.cross_entropy(x, pixels), (images,))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses_exact(threads: int, reduction: str) -> None:
    x, y = torch.randn(64, 200), torch.randn(64, 200)
    assert_exact(lambda x: F.mse_loss(x, y, reduction=reduction).sum(), (x,))
    assert_exact(lambda x: F.smooth_l1_loss(x, y, reduction=reduction).sum(), (x,))
    assert_exact(lambda x: F.huber_loss(x, y, reduction=reduction).sum(), (x,))
    assert_exact(lambda x: F.binary_cross_entropy(x.sigmoid(), y.sigmoid(), reduction=reduction).sum(), (x,))
    # Forward only: its backward formula takes an out-of-place branch for fake tensors.
    target, weight = y.sigmoid(), torch.rand(200)
    bce = F.binary_cross_entropy_with_logits
    assert_exact(lambda x: bce(x, target, reduction=reduction).sum(), (x,), train=False)
    assert_exact(lambda x: bce(x, target, pos_weight=weight, reduction=reduction).sum(), (x,), train=False)


def test_softmax_copies_a_non_contiguous_input() -> None:
    """``softmax_cpu_out`` runs on ``input.contiguous()`` (3 x 4 x 5 x 6 floats = 1440 B
    when the input is a transposed view); the backward on ``grad.contiguous()`` and
    ``output.contiguous()``."""
    with FakeTensorMode():
        x = torch.empty(3, 4, 5, 6)
        xt = x.transpose(1, 3)
        assert scratch(aten._softmax.default, (x, -1, False)) == {}
        assert scratch(aten._softmax.default, (xt, -1, False)) == {"input contiguous": 1440}
        assert scratch(aten._log_softmax.default, (xt.to(BF16), 1, False)) == {"input contiguous": 720}
        args = (xt, x.transpose(1, 3).contiguous(), 1, torch.float32)
        assert scratch(aten._softmax_backward_data.default, args) == {"grad contiguous": 1440}
        args = (xt.contiguous(), xt, 1, torch.float32)
        assert scratch(aten._log_softmax_backward_data.default, args) == {"output contiguous": 1440}


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_softmax_of_views_exact(threads: int, dtype: torch.dtype) -> None:
    """Softmax over a transposed view, a gradient that arrives transposed, and the
    attention math path's ``_safe_softmax`` on a view (its inner softmax frees its copy)."""
    x = torch.randn(3, 4, 5, 6, dtype=dtype)
    assert_exact(lambda x: x.transpose(1, 3).softmax(-1).square().sum(), (x,))
    assert_exact(lambda x: x.log_softmax(1).transpose(1, 3).square().sum(), (x,))
    assert_exact(lambda x: aten._safe_softmax(x.transpose(1, 3), -1).square().sum(), (x,))
    assert_exact(lambda x: x.transpose(1, 3).softmax(-1), (x,), train=False)


def test_reduced_precision_sum_of_two_adjacent_reduced_dims_runs_in_float() -> None:
    """``sum_out``'s ``should_use_acc_buffer`` (``ReduceOps.cpp``): a bfloat16/half sum
    whose reduction iterator starts with two reduced dimensions (after reordering and
    coalescing) sums ``self.to(float)`` into a float result: (3, 3, 24) over dims 0 and
    2 takes a 3 x 4 B result and a 216 x 4 B copy; over dim 2 alone, or over a
    broadcast (stride-0) input, nothing."""
    from pytest_torchmem.engine.tracing.devices.cpu.reduce import uses_acc_buffer

    with FakeTensorMode():
        x = torch.empty(3, 3, 24, dtype=BF16)
        assert uses_acc_buffer(x, [0, 2], BF16)
        assert uses_acc_buffer(x.half(), [0, 2], torch.float16)
        assert not uses_acc_buffer(x.float(), [0, 2], torch.float32)
        assert not uses_acc_buffer(x, [2], BF16)
        assert not uses_acc_buffer(x, None, BF16)  # contiguous: coalesced to one dim
        assert not uses_acc_buffer(torch.ones((), dtype=BF16).expand(3, 3, 24), [0, 2], BF16)
        assert scratch(aten.sum.dim_IntList, (x, [0, 2])) == {
            "sum: float result": 12, "sum (float): input as torch.float32": 864,
        }  # fmt: skip
        assert scratch(aten.sum.dim_IntList, (x, [2])) == {}


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
def test_reduced_precision_sums_exact(threads: int, dtype: torch.dtype) -> None:
    """Sums over permuted layouts, and the gradient of a loss on a transposed input
    (``mse_loss_backward`` makes it contiguous, ``zeros_like(input, contiguous)``)."""
    x = torch.randn(3, 5, 24, dtype=dtype)
    for dims in ([0, 2], [0, 1], [1], [0], [2]):
        assert_exact(lambda x, dims=dims: x.sum(dims), (x,), train=False)
        assert_exact(lambda x, dims=dims: x.transpose(0, 2).sum(dims).square().sum(), (x,))
    # The pooled, channels-last-like input's gradient is contiguous: the pooling
    # backward then copies its channels-last input gradient.
    x = torch.randn(4, 12, 16, dtype=dtype)
    target = torch.randn(4, 16, 6, dtype=dtype)
    assert_exact(lambda x: F.mse_loss(F.avg_pool1d(x.transpose(1, 2), 2), target), (x.requires_grad_(),))
    assert_exact(lambda x: F.smooth_l1_loss(F.avg_pool1d(x.transpose(1, 2), 2), target), (x,))


def test_log_softmax_backward_makes_a_contiguous_gradient(threads: int) -> None:
    """``_log_softmax_backward_data`` makes the input gradient contiguous whatever the
    layout of ``grad`` (its meta function); the fake kernel follows ``grad``. A
    contiguous leaf keeps it as its ``.grad`` (``AccumulateGrad`` steals it), where a
    transposed one would be copied (16 B more here)."""
    with FakeTensorMode():
        grad, output = torch.empty(2, 3, 4).transpose(1, 2), torch.empty(2, 4, 3)
        call = OpCall(aten._log_softmax_backward_data.default, (grad, output, 2, torch.float32), {})
        out = CPU.implementation_rule(aten._log_softmax_backward_data.default)(call)
        assert out.shape == (2, 4, 3) and out.is_contiguous()
    x = torch.randn(1, 2, 2, requires_grad=True)
    assert_exact(lambda x: x.log_softmax(-1).transpose(1, 2).mul(0.5).sum(), (x,))
    x = torch.randn(3, 8, 5, requires_grad=True)
    assert_exact(lambda x: x.log_softmax(1).permute(2, 0, 1).square().sum(), (x,))


# -- segment_reduce ------------------------------------------------------------------------------


def test_segment_reduce_checks_lengths() -> None:
    """``segment_reduce`` with lengths (4 int64) of a (6, 4) float: unless ``unsafe``,
    ``lengths.min()`` (8 B), ``lengths.sum(-1)`` (8 B), ``== data.size(0)`` (a wrapped
    8 B size, a 1 B mask) and ``all`` (1 B), all freed before the output; with
    offsets, the output alone."""
    with FakeTensorMode():
        data, lengths = torch.empty(6, 4), torch.zeros(4, dtype=torch.long)
        offsets = torch.zeros(5, dtype=torch.long)
        checks = {
            "lengths.min()": 8, "lengths.sum(-1)": 8, "== size: wrapped size": 8,
            "== size": 1, "all(...)": 1,
        }  # fmt: skip
        assert scratch(aten.segment_reduce.default, (data, "sum"), {"lengths": lengths}) == checks
        unsafe = {"lengths": lengths, "unsafe": True}
        assert scratch(aten.segment_reduce.default, (data, "sum"), unsafe) == {}
        assert scratch(aten.segment_reduce.default, (data, "max"), {"offsets": offsets}) == {}


@pytest.mark.parametrize(
    "fn",
    [
        lambda d: torch.segment_reduce(d, "sum", lengths=torch.tensor([2, 0, 3, 1])),
        lambda d: torch.segment_reduce(d, "mean", lengths=torch.tensor([2, 0, 3, 1]), unsafe=True),
        lambda d: torch.segment_reduce(d, "max", offsets=torch.tensor([0, 2, 2, 5, 6]), initial=0.0),
        lambda d: torch.segment_reduce(d, "prod", lengths=torch.tensor([2, 0, 3, 1]).int()),
        lambda d: torch.segment_reduce(d.t(), "min", lengths=torch.tensor([[1, 5]] * 4), axis=1, initial=9.0),
        lambda d: torch.segment_reduce(
            d.t(), "sum", lengths=torch.tensor([[2, 0, 3, 1]] * 4).t().contiguous().t(), axis=1
        ),
    ],
    ids=["lengths", "unsafe mean", "offsets", "int32 lengths", "transposed", "strided lengths"],
)  # fmt: skip
def test_segment_reduce_exact(fn: Any, threads: int) -> None:
    """Forward and ``_segment_reduce_backward`` (contiguous copies of the expanded
    gradient, the output and the data)."""
    assert_exact(fn, inputs=(torch.randn(6, 4, requires_grad=True),))
