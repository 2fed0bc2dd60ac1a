"""CPU indexing and selection kernels (``cpu.indexing``, ``cpu.sorting``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import Lambda, assert_exact
from torch import nn
from torch.nn import functional as F

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import installed_release

F32, I64 = 4, 8
BF16 = torch.bfloat16


def _forward(fn: Callable[..., Any], x: torch.Tensor) -> int:
    report = tm.estimate(Lambda(fn), x, train=False)
    assert report.forward_peak == tm.measure(Lambda(fn), x, train=False).forward_peak
    return report.forward_peak


# -- embedding_dense_backward ---------------------------------------------------------------


def test_embedding_backward_copies_a_broadcast_gradient() -> None:
    """``Embedding(100, 32)`` on (8, 16) indices, loss = sum: the output gradient is a
    broadcast scalar, which ``embedding_dense_backward_cpu`` copies (``grad_.contiguous()``,
    8 * 16 * 32 floats) beside ``grad_weight`` (100 * 32 floats).

    Backward: weight 12800 + indices 1024 + loss and its gradient 8 + grad_weight 12800
    + the copy 16384 = 43016 (the output is dropped once the loss is taken).
    """
    torch.manual_seed(0)
    model, idx = nn.Embedding(100, 32), torch.randint(0, 100, (8, 16))
    report = tm.estimate(model, idx)
    assert report.backward_peak == 2 * 100 * 32 * F32 + 8 * 16 * I64 + 2 * F32 + 8 * 16 * 32 * F32
    assert report.phase_peaks() == tm.measure(model, idx).phase_peaks()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_step_equals_measure(
    transposed: bool, padding_idx: int | None, threads: int
) -> None:
    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 24, padding_idx=padding_idx)
            self.out = nn.Linear(24, 8)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(idx).transpose(0, 1))

    torch.manual_seed(0)
    idx = torch.randint(0, 50, (12, 6) if transposed else (6, 12))
    idx = idx.t() if transposed else idx
    model = Lookup()
    assert tm.estimate(model, idx).phase_peaks() == tm.measure(model, idx).phase_peaks()


# -- kthvalue, median ------------------------------------------------------------------------


def test_kthvalue_partitions_a_copy() -> None:
    """``kthvalue_out_impl_cpu``: values (16,) and indices (16,), then a clone of the
    (16, 32) input and an int64 index tensor of its size."""
    x = torch.randn(16, 32)
    expected = 16 * 32 * F32 + 16 * (F32 + I64) + 16 * 32 * (F32 + I64)
    assert _forward(lambda x: x.kthvalue(5, dim=1), x) == expected


def test_median_dim_copies_only_a_strided_reduction() -> None:
    """``median_with_indices_impl`` copies the input when the reduced dim is not the
    innermost (dim 0 of a (16, 32) tensor), not otherwise."""
    x = torch.randn(16, 32)
    assert _forward(lambda x: x.median(dim=0), x) == 2 * 16 * 32 * F32 + 32 * (F32 + I64)
    assert _forward(lambda x: x.median(dim=1), x) == 16 * 32 * F32 + 16 * (F32 + I64)


def test_median_of_everything_partitions_a_clone() -> None:
    """``median_impl``: ``self.clone()`` and the 0-dim result."""
    x = torch.randn(16, 32)
    assert _forward(lambda x: x.nanmedian(), x) == 2 * 16 * 32 * F32 + F32


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.kthvalue(3, dim=0).values,
        lambda x: x.kthvalue(1, dim=-1, keepdim=True).values,
        lambda x: x.median(dim=0).values,
        lambda x: x.nanmedian(dim=-1).values,
        lambda x: x.t().median(dim=1).values,
    ],
    ids=[
        "kthvalue dim 0",
        "kthvalue keepdim",
        "median dim 0",
        "nanmedian last",
        "median transposed",
    ],
)
def test_selection_step_equals_measure(fn: Callable[..., Any], threads: int) -> None:
    x = torch.randn(12, 20, requires_grad=True)
    model = Lambda(fn)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


# -- pixel_shuffle, pixel_unshuffle, channel_shuffle ----------------------------------------------


def test_pixel_shuffle_backward_copies_a_broadcast_gradient() -> None:
    """``pixel_shuffle``'s backward is ``pixel_unshuffle`` of the gradient, whose CPU kernel
    makes its output, then ``self.contiguous()``: the broadcast gradient of the sum
    (2 * 2 * 8 * 8 floats) is copied. Backward: x 1024 + loss and its gradient 8 +
    output 1024 + copy 1024 = 3080."""
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    model = nn.PixelShuffle(2)
    report = tm.estimate(model, x)
    assert report.backward_peak == 3 * 2 * 8 * 4 * 4 * F32 + 2 * F32
    assert report.phase_peaks() == tm.measure(model, x).phase_peaks()


@pytest.mark.parametrize(
    ("fn", "layout"),
    [
        (lambda x: torch.pixel_shuffle(x, 2), "contiguous"),
        (lambda x: torch.pixel_unshuffle(x, 2), "channels_last"),
        (lambda x: torch.pixel_shuffle(x.transpose(2, 3), 2), "contiguous"),
        (lambda x: torch.channel_shuffle(x, 4), "contiguous"),
        (lambda x: torch.channel_shuffle(x, 2), "channels_last"),
        (lambda x: torch.channel_shuffle(x.transpose(2, 3), 2), "contiguous"),
    ],
    ids=[
        "pixel",
        "unshuffle cl",
        "pixel transposed",
        "channel",
        "channel cl",
        "channel transposed",
    ],
)
def test_shuffle_step_equals_measure(fn: Callable[..., Any], layout: str, threads: int) -> None:
    x = torch.randn(2, 8, 6, 6)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    model = Lambda(lambda x: fn(x) * 2)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


# -- roll ---------------------------------------------------------------------------------------


def test_roll_over_two_dims_holds_an_intermediate() -> None:
    """A shifted-window roll over (H, W) of a (2, 8, 8, 16) activation (Swin's
    ``torch.roll(x, (-3, -3), (1, 2))``): ``roll_common`` rolls H into an intermediate
    of the input's size, then W into the output."""
    x = torch.randn(2, 8, 8, 16)
    nbytes = 2 * 8 * 8 * 16 * F32
    assert _forward(lambda x: torch.roll(x, (-3, -3), (1, 2)), x) == 3 * nbytes
    assert _forward(lambda x: torch.roll(x, 3, 1), x) == 2 * nbytes


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.roll(x, (1, 2, 3), (0, 1, 2)),
        lambda x: torch.roll(x.transpose(0, 2), 5),
        lambda x: torch.roll(x.transpose(0, 2), (2, -1), (0, 1)),
    ],
    ids=["three dims", "flattened transposed", "two dims transposed"],
)
def test_roll_step_equals_measure(fn: Callable[..., Any], threads: int) -> None:
    x = torch.randn(4, 6, 8, requires_grad=True)
    model = Lambda(fn)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


def test_unfold_backward_indexes_with_an_arange() -> None:
    """``x.unfold(1, 3, 1)`` of a (5, 7, 5) input: overlapping windows, so
    ``unfold_backward`` indexes with ``arange(7)`` in int64 (56 B) beside the zero-filled
    input gradient (5 x 7 x 5 floats); ``step >= size`` copies, with no index."""
    from exactness import rule_buffers
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    with FakeTensorMode():
        grad = torch.empty(5, 5, 5, 3)
        assert rule_buffers(aten.unfold_backward.default, (grad, [5, 7, 5], 1, 3, 1)) == {
            "idx_dim": 7 * 8
        }
        grad = torch.empty(5, 2, 5, 3)
        assert rule_buffers(aten.unfold_backward.default, (grad, [5, 7, 5], 1, 3, 3)) == {}


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.unfold(1, 3, 1),
        lambda x: x.unfold(0, 2, 1).square(),
        lambda x: x.unfold(2, 3, 3),
        lambda x: x.unfold(-1, 4, 2).transpose(0, 1),
    ],
    ids=["overlapping", "overlapping squared", "disjoint", "last dim"],
)
def test_unfold_step_equals_measure(fn: Callable[..., Any], threads: int) -> None:
    """OpInfo's ``unfold`` and ``unfold_copy`` samples: overlapping windows."""
    x = torch.randn(4, 6, 8, requires_grad=True)
    model = Lambda(fn)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()
    xb = torch.randn(4, 6, 8, dtype=torch.bfloat16, requires_grad=True)
    assert tm.estimate(model, xb).phase_peaks() == tm.measure(model, xb).phase_peaks()


def test_an_int32_index_is_converted_to_int64() -> None:
    """``gather``/``scatter*`` index with int64: a (5, 3) int32 index is copied as
    int64 (15 x 8 B); an int64 one is not."""
    from exactness import rule_buffers
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    with FakeTensorMode():
        x, src = torch.empty(10, 5), torch.empty(5, 3)
        idx32, idx64 = torch.zeros(5, 3, dtype=torch.int32), torch.zeros(5, 3, dtype=torch.int64)
        tag = "kernel: index as int64"
        assert rule_buffers(aten.gather.default, (x, 1, idx32)) == {tag: 15 * 8}
        assert rule_buffers(aten.gather.default, (x, 1, idx64)) == {}
        assert rule_buffers(aten.scatter_add_.default, (x, 0, idx32, src)) == {tag: 120}
        assert rule_buffers(aten.scatter.value, (x, 0, idx32, 2.0)) == {tag: 120}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize(
    "fn",
    [
        lambda x, i, s: x.gather(0, i),
        lambda x, i, s: x.gather(1, i[:, :3]),
        lambda x, i, s: x.scatter(0, i, s),
        lambda x, i, s: x.scatter(0, i, 2.0),
        lambda x, i, s: x.scatter_add(0, i, s),
        lambda x, i, s: x.scatter_reduce(0, i, s, "sum"),
        lambda x, i, s: x.clone().scatter_(0, i, s),
    ],
    ids=["gather", "gather narrow", "scatter", "scatter value", "scatter_add", "scatter_reduce",
         "scatter_"],
)  # fmt: skip
def test_scatter_gather_step_equals_measure(
    fn: Callable[..., Any], index_dtype: torch.dtype, dtype: torch.dtype, threads: int
) -> None:
    """OpInfo's ``gather`` and ``scatter`` samples index with int32; in bfloat16 each
    kernel (and ``gather``'s backward ``scatter_add_``) accumulates in a float copy."""
    torch.manual_seed(0)
    idx = torch.randint(0, 5, (5, 5), dtype=index_dtype)
    src = torch.randn(5, 5, dtype=dtype)
    model = Lambda(lambda x: fn(x, idx, src))
    x = torch.randn(10, 5, dtype=dtype, requires_grad=True)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


def test_reduced_precision_scatter_gather_accumulate_in_float() -> None:
    """``cpu_scatter_gather_base_kernel`` gives a bfloat16 ``self`` (the written tensor:
    ``gather``'s result, the scatters' output) a float copy, ``at::empty(self.sizes(),
    kFloat)``: 4 bytes an element of (5, 3) = 60 B for ``gather``, of (10, 5) = 200 B
    for the scatters. ``scatter_reduce`` without ``include_self`` first fills the
    indexed places with ``scatter_``, whose buffer is given back before the
    reduction takes its own. float32 takes none."""
    from exactness import rule_buffers
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    bf16 = torch.bfloat16
    with FakeTensorMode():
        x, src = torch.empty(10, 5, dtype=bf16), torch.empty(5, 5, dtype=bf16)
        idx = torch.zeros(5, 5, dtype=torch.int64)
        assert rule_buffers(aten.gather.default, (x, 1, idx[:, :3])) == {"kernel: float accumulator": 60}
        assert rule_buffers(aten.scatter_add.default, (x, 0, idx, src)) == {"kernel: float accumulator": 200}
        assert rule_buffers(aten.scatter_.value, (x, 0, idx, 2.0)) == {"kernel: float accumulator": 200}
        assert rule_buffers(aten.scatter.src, (x.float(), 0, idx, src.float())) == {}
        steps = rule_buffers(aten.scatter_reduce.two, (x, 0, idx, src, "amax"), {"include_self": False})
        assert steps == {"scatter_ (exclude self): float accumulator": 200, "kernel: float accumulator": 200}
        idx32 = idx.int()
        assert rule_buffers(aten.gather.default, (x, 0, idx32)) == {
            "kernel: index as int64": 25 * 8, "kernel: float accumulator": 25 * 4,
        }  # fmt: skip


def test_expanded_index_paths_in_reduced_precision() -> None:
    """``can_use_expanded_index_path``: an index expanded over the columns (stride 1
    along dim 0, 0 elsewhere) of a contiguous (10, 32) ``self`` takes the GNN kernels:
    ``gather`` copies rows (no buffer), ``scatter_add``/``scatter_reduce`` sum each
    row in ``at::zeros({num_threads, 32}, kFloat)`` (2 threads: 256 B); fewer than
    16 columns keep the base kernel's float copy of ``self``."""
    from exactness import intra_op_threads, rule_buffers
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    bf16 = torch.bfloat16
    with FakeTensorMode(), intra_op_threads(2):
        x, src = torch.empty(10, 32, dtype=bf16), torch.empty(8, 32, dtype=bf16)
        idx = torch.zeros(8, 1, dtype=torch.int64).expand(8, 32)
        assert rule_buffers(aten.gather.default, (x, 0, idx)) == {}
        assert rule_buffers(aten.scatter_add.default, (x, 0, idx, src)) == {"expanded-index rows": 256}
        steps = rule_buffers(aten.scatter_reduce.two, (x, 0, idx, src, "sum"), {"include_self": False})
        assert steps == {"expanded-index rows": 256}
        narrow = (x[:, :8].contiguous(), 0, idx[:, :8], src[:, :8].contiguous())
        assert rule_buffers(aten.scatter_add.default, narrow) == {"kernel: float accumulator": 80 * 4}
        assert rule_buffers(aten.scatter_add.default, (x, 1, idx, src)) == {"kernel: float accumulator": 320 * 4}


def test_index_add_scatters_in_reduced_precision() -> None:
    """``index_add_cpu_out`` of a result of two or more dims along its first or last
    dim (``alpha == 1``, an int64 index) calls ``scatter_add_`` with the index
    expanded over the other dims: along the last dim of (10, 5), the base kernel's
    float copy (200 B); along dim 0 of (10, 32), the expanded-index kernel's
    (2 threads x 32 floats); with ``alpha=2``, an int32 index, or in float32, none.
    A strided index is first made contiguous (8 bytes an element)."""
    from exactness import intra_op_threads, rule_buffers
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    bf16 = torch.bfloat16
    with FakeTensorMode(), intra_op_threads(2):
        x, idx = torch.empty(10, 5, dtype=bf16), torch.zeros(6, dtype=torch.int64)
        assert rule_buffers(aten.index_add.default, (x, 1, idx[:3], torch.empty(10, 3, dtype=bf16))) == {
            "index_add_: scatter_add_: float accumulator": 200
        }
        wide = torch.empty(10, 32, dtype=bf16)
        rows = torch.empty(6, 32, dtype=bf16)
        assert rule_buffers(aten.index_add_.default, (wide, 0, idx, rows)) == {"index_add_: expanded-index rows": 256}
        assert rule_buffers(aten.index_add.default, (wide, 0, idx, rows), {"alpha": 2}) == {}
        assert rule_buffers(aten.index_add.default, (wide, 0, idx.int(), rows)) == {}
        assert rule_buffers(aten.index_add.default, (wide.float(), 0, idx, rows.float())) == {}
        assert rule_buffers(aten.index_add.default, (wide, 0, idx[::2], rows[:3])) == {
            "index_add_: index.contiguous()": 24, "index_add_: expanded-index rows": 256,
        }  # fmt: skip


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, i: x.gather(0, i),
        lambda x, i: x.scatter_add(0, i, torch.ones(8, 32, dtype=x.dtype)),
        lambda x, i: x.scatter_reduce(0, i, torch.ones(8, 32, dtype=x.dtype), "amax", include_self=False),
        lambda x, i: x.index_add(0, i[:, 0], torch.ones(8, 32, dtype=x.dtype)),
        lambda x, i: x.index_add(1, i[0, :8], torch.ones(10, 8, dtype=x.dtype)),
        lambda x, i: x[:, :4].index_add(0, i[:, 0], torch.ones(8, 4, dtype=x.dtype)),
    ],
    ids=["gather", "scatter_add", "scatter_reduce", "index_add dim 0", "index_add last", "index_add narrow"],
)
def test_expanded_index_step_equals_measure(fn: Callable[..., Any], threads: int) -> None:
    """The GNN paths (an index expanded along dim 0) and ``index_add``'s scatter in
    bfloat16, forward and backward, at 1, 2 and 4 threads (the rows buffer has one
    row per thread)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 10, (8, 1)).expand(8, 32)
    model = Lambda(lambda x: fn(x, idx) * 2)
    x = torch.randn(10, 32, dtype=torch.bfloat16, requires_grad=True)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.sort(dim=0).values,
        lambda x: x.topk(3, dim=1).values,
        lambda x: x.kthvalue(2, dim=0).values,
        lambda x: x.max(dim=1).values,
        lambda x: x.cummax(dim=0).values,
        lambda x: x.median(dim=1).values,
        lambda x: x.index_select(1, torch.tensor([0, 3, 3, 7])),
        lambda x: x.take_along_dim(torch.tensor([[0], [5], [2], [1], [0], [5]]), dim=1),
        lambda x: F.max_unpool1d(*F.max_pool1d(x[None], 2, return_indices=True), 2),
    ],
    ids=["sort", "topk", "kthvalue", "max", "cummax", "median", "index_select", "take_along_dim", "max_unpool1d"],
)  # fmt: skip
def test_reduced_precision_selection_backward_equals_measure(fn: Callable[..., Any], threads: int) -> None:
    """The backward of value-selecting and indexing ops in bfloat16: ``scatter_``,
    ``scatter_add_``, ``index_add_`` and ``gather`` into a float copy of the gradient."""
    torch.manual_seed(0)
    x = torch.randn(6, 20, dtype=torch.bfloat16, requires_grad=True)
    model = Lambda(fn)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


def test_reduced_precision_scatter_accumulates_in_float() -> None:
    """``cpu_scatter_gather_base_kernel`` accumulates a ``bfloat16`` output in a ``float``
    copy (``create_acc_buffer``): a (10, 5) scatter takes 50 x 4 B beside its 100 B
    output; a gather's copy is of its (5, 3) result."""
    from exactness import rule_buffers
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    with FakeTensorMode():
        x, src = torch.empty(10, 5, dtype=BF16), torch.empty(5, 3, dtype=BF16)
        idx = torch.zeros(5, 3, dtype=torch.int64)
        acc = "kernel: float accumulator"
        assert rule_buffers(aten.scatter_add.default, (x, 0, idx, src)) == {acc: 200}
        assert rule_buffers(aten.gather.default, (x, 1, idx)) == {acc: 60}
        assert rule_buffers(aten.scatter_add.default, (x.float(), 0, idx, src.float())) == {}


def test_scatter_reduce_mean_divides_by_counts() -> None:
    """``scatter_reduce(..., "mean", include_self=False)`` of a (10, 5) float tensor with a
    (5, 5) index: the output (200 B), then ``ones_like(src)`` (100 B), ``count`` (200 B)
    and ``count == 0`` (8 B wrapped zero, 4 B as float, a 50 B mask)."""
    from exactness import rule_buffers
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    with FakeTensorMode():
        x, src, idx = torch.empty(10, 5), torch.empty(5, 5), torch.zeros(5, 5, dtype=torch.int64)
        buffers = rule_buffers(
            aten.scatter_reduce.two, (x, 0, idx, src, "mean"), {"include_self": False}
        )
    assert buffers == {
        "ones_like(src)": 100,
        "count": 200,
        "count == 0: wrapped 0": 8,
        "input 1 as torch.float32": 4,
        "count == 0": 50,
    }
    model = Lambda(lambda x: x.scatter_reduce(0, idx, src, "mean", include_self=False))
    forward = 200 + 200 + 100 + 200 + 8 + 4 + 50  # input, output, ones, count, comparison
    torch.manual_seed(0)
    x, idx, src = torch.randn(10, 5), torch.randint(0, 10, (5, 5)), torch.randn(5, 5)
    assert _forward(model.fn, x) == forward


@pytest.mark.filterwarnings(r"ignore:index_reduce\(\) is in beta:UserWarning")
def test_index_reduce_counts() -> None:
    """``index_reduce`` of a 1-D (5,) float tensor keeps ``counts`` (20 B) whatever the
    reduction, and for ``mean`` the ``counts == 0`` mask (8 + 4 + 5 B); a 2-D (5, 3)
    ``mean`` takes counts (60 B), ``ones_like(source)`` (4 x 3 floats, freed by the
    index_add) and the mask (8 + 4 + 15 B)."""
    i = torch.tensor([0, 2, 1, 2])
    x1, s1 = torch.randn(5), torch.randn(4)
    assert _forward(lambda x: x.index_reduce(0, i, s1, "prod"), x1) == 20 + 20 + 20
    assert _forward(lambda x: x.index_reduce(0, i, s1, "mean"), x1) == 20 + 20 + 20 + 8 + 4 + 5
    x2, s2 = torch.randn(5, 3), torch.randn(4, 3)
    assert _forward(lambda x: x.index_reduce(0, i, s2, "amax"), x2) == 60 + 60
    assert _forward(lambda x: x.index_reduce(0, i, s2, "mean"), x2) == 60 + 60 + 60 + 48


_I4 = torch.tensor([0, 2, 1, 2])


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize(
    "fn",
    [
        lambda x, i, s: x.scatter_reduce(0, i, s, "mean"),
        lambda x, i, s: x.scatter_reduce(0, i, s, "mean", include_self=False),
        lambda x, i, s: x.scatter_reduce(0, i.int(), s, "mean", include_self=False),
        lambda x, i, s: x[:5].scatter_reduce(1, i.t() % 5, s.t(), "mean"),
        lambda x, i, s: x.scatter_reduce(0, i, s, "amax", include_self=False),
        lambda x, i, s: x.scatter_add(0, i, s),
        lambda x, i, s: x.gather(1, i[:, :3] % 5),
        lambda x, i, s: x.index_reduce(0, _I4, s[:4], "mean"),
        lambda x, i, s: x.index_reduce(0, _I4, s[:4], "mean", include_self=False),
        lambda x, i, s: x[:5].index_reduce(1, _I4.int(), s.t()[:, :4], "mean"),
        lambda x, i, s: x.index_reduce(0, _I4[::2], s[:2], "prod"),
        lambda x, i, s: x[:, 0].index_reduce(0, _I4, s[:4, 0], "mean", include_self=False),
        lambda x, i, s: x[:, 0].index_reduce(0, _I4, s[:4, 0], "amin"),
        lambda x, i, s: x.index_add(0, _I4, s[:4]),
        lambda x, i, s: x.index_select(0, _I4),
        lambda x, i, s: x.t().index_select(1, _I4[::2]),
    ],
    ids=[
        "scatter_reduce mean", "mean exclude self", "mean int32 index", "mean dim 1",
        "amax exclude self", "scatter_add", "gather", "index_reduce mean",
        "index_reduce mean exclude self", "index_reduce mean dim 1 int32", "index_reduce strided",
        "index_reduce 1-D mean", "index_reduce 1-D amin", "index_add", "index_select",
        "index_select dim 1 transposed",
    ],
)  # fmt: skip
def test_scatter_reduce_and_index_reduce_equal_measure(
    fn: Callable[..., Any], dtype: torch.dtype, threads: int
) -> None:
    torch.manual_seed(0)
    idx, src = torch.randint(0, 10, (5, 5)), torch.randn(5, 5, dtype=dtype)
    model = Lambda(lambda x: fn(x, idx, src))
    x = torch.randn(10, 5, dtype=dtype, requires_grad=True)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "fn",
    [
        lambda x, i, s: x.scatter_add(0, i, s),
        lambda x, i, s: x.scatter_reduce(0, i, s, "mean", include_self=False),
        lambda x, i, s: x.scatter_reduce(0, i, s, "amax"),
        lambda x, i, s: x.gather(0, i[:7]),
        lambda x, i, s: x.index_add(0, i[:, 0], s),
        lambda x, i, s: x.index_reduce(0, i[:, 0], s, "mean"),
    ],
    ids=["scatter_add", "scatter_reduce mean", "scatter_reduce amax", "gather", "index_add",
         "index_reduce mean"],
)  # fmt: skip
def test_expanded_index_path_equals_measure(
    fn: Callable[..., Any], dtype: torch.dtype, threads: int
) -> None:
    """A column index expanded over rows of 32 (a GNN's): the expanded-index kernels,
    which accumulate ``bfloat16``/``half`` in a ``float`` row per thread."""
    torch.manual_seed(0)
    idx = torch.randint(0, 10, (50, 1)).expand(50, 32)
    src = torch.randn(50, 32, dtype=dtype)
    model = Lambda(lambda x: fn(x, idx, src))
    x = torch.randn(10, 32, dtype=dtype)
    estimated = tm.estimate(model, x, train=False)
    assert estimated.unsupported == ()
    assert estimated.forward_peak == tm.measure(model, x, train=False).forward_peak


def test_chunk_cat_pads_a_tensor_not_divisible_in_chunks() -> None:
    """``_chunk_cat([a, b], -1, 5)`` of two (1, 2, 3) floats: each is padded to
    (1, 2, 5) (40 B) before the cat; sizes divisible by ``num_chunks`` are viewed."""
    from exactness import rule_buffers
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    with FakeTensorMode():
        a, b = torch.empty(1, 2, 3), torch.empty(4, 10)
        assert rule_buffers(aten._chunk_cat.default, ([a, a], -1, 5)) == {
            "tensor 0 padded": 40, "tensor 1 padded": 40,
        }  # fmt: skip
        assert rule_buffers(aten._chunk_cat.default, ([b, b[:, :7]], 1, 2)) == {
            "tensor 1 padded": 4 * 8 * 4
        }
        assert rule_buffers(aten._chunk_cat.default, ([b], 1, 5)) == {}


@pytest.mark.parametrize(
    "shapes, dim, chunks",
    [
        ([(1, 2, 3), (1, 2, 3)], -1, 5),
        ([(1, 2, 130), (1, 2, 300)], -1, 5),
        ([(4, 10), (4, 7)], 1, 2),
        ([(3, 4, 5)], 0, 2),
    ],
)
def test_chunk_cat_forward_equals_measure(
    shapes: list[tuple[int, ...]], dim: int, chunks: int, threads: int
) -> None:
    """OpInfo's ``_chunk_cat`` samples (no autograd)."""
    tensors = tuple(torch.randn(*s) for s in shapes)
    model = Lambda(lambda *a: torch.ops.aten._chunk_cat(list(a), dim, chunks), tensors)
    estimated = tm.estimate(model, (), train=False)
    assert estimated.phase_peaks() == tm.measure(model, (), train=False).phase_peaks()


# -- isin -------------------------------------------------------------------------------------


def test_isin_default_kernel_casts_to_the_common_dtype() -> None:
    """``isin`` of 20 floats in 5 int64 test elements (fewer than ``10 * 20 ** 0.145``):
    ``isin_default_kernel_cpu`` casts the test elements to float (5 x 4 B)."""
    e, t = torch.randn(20), torch.randint(0, 3, (5,))
    assert _forward(lambda e: torch.isin(e, t), e) == 80 + 20 + 20


def test_isin_sorting_with_assume_unique() -> None:
    """``isin`` of 5 floats in 20 (``assume_unique``): the sort-based kernel concatenates
    them (25 x 4 B), sorts (values 100 B, order 200 B, the sort's arange 200 B freed),
    and marks duplicates (25 B mask, 24 B comparison freed, 1 B value, 25 B mask).
    Forward peak: input 20 + output 5 + cat 100 + values 100 + order 200 + arange 200."""
    e, t = torch.randn(5), torch.randn(20)
    peak = _forward(lambda e: torch.isin(e, t, assume_unique=True), e)
    assert peak == 20 + 5 + 100 + 100 + 200 + 200


@pytest.mark.parametrize(
    "fn",
    [
        lambda e, t: torch.isin(e, t[:5]),
        lambda e, t: torch.isin(e, t[:5].long(), invert=True),
        lambda e, t: torch.isin(e[:5], t, assume_unique=True),
        lambda e, t: torch.isin(e[:15].view(5, 3).t(), t.view(4, 5).t(), assume_unique=True),
        lambda e, t: torch.isin(e, 0.5),
        lambda e, t: torch.isin(e, 2, invert=True),
        lambda e, t: torch.isin(0.5, t[:5]),
        lambda e, t: torch.isin(3, t.long()[:5]),
        lambda e, t: torch.isin(0.5, t.double(), assume_unique=True),
    ],
    ids=["default", "int test inverted", "sorting", "sorting transposed", "scalar test",
         "int scalar test", "scalar element", "int scalar element", "scalar element sorting"],
)  # fmt: skip
def test_isin_equals_measure(fn: Callable[..., Any], threads: int) -> None:
    e, t = torch.randn(20), torch.randn(20)
    model = Lambda(lambda e: fn(e, t))
    estimated = tm.estimate(model, e, train=False)
    assert estimated.unsupported == ()
    assert estimated.forward_peak == tm.measure(model, e, train=False).forward_peak


# -- _unsafe_masked_index (inductor's decompositions) ------------------------------------------


def test_unsafe_masked_index_clamps_indexes_and_fills() -> None:
    """``_unsafe_masked_index`` of a (5, 5) float (100 B) with (10, 1) and (1, 10) int64
    indices and a (10, 10) mask (the model's constants): the clamped indices
    (80 + 80 B), ``_unsafe_index`` (400 B), the not-mask (100 B) and the output
    (400 B), all held at once."""
    i0, i1 = torch.randint(0, 5, (10, 1)), torch.randint(0, 5, (1, 10))
    mask = torch.rand(10, 10) > 0.5
    x = torch.randn(5, 5)
    peak = _forward(lambda x: torch.ops.aten._unsafe_masked_index(x, mask, [i0, i1], 2.0), x)
    assert peak == 100 + 80 + 80 + 400 + 100 + 400


@pytest.mark.parametrize("int32", [False, True], ids=["int64", "int32"])
@pytest.mark.parametrize(
    "fn",
    [
        lambda x, m, i0, i1: torch.ops.aten._unsafe_masked_index(x, m, [i0, i1], 2.0),
        lambda x, m, i0, i1: torch.ops.aten._unsafe_masked_index(x, m[:5, :5], [None, i1[0, :5]], 0.0),
        lambda x, m, i0, i1: torch.ops.aten._unsafe_masked_index(x[:0], m[:5, :5], [None, i1[0, :5]], 0.0),
        lambda x, m, i0, i1: x[i0, i1],
        lambda x, m, i0, i1: x.index_put((i0, i1), x[i0, i1] * 2),
        lambda x, m, i0, i1: x.index_put((i0, i1), x[i0, i1], accumulate=True),
        lambda x, m, i0, i1: x.index_put((m[:5, :5],), torch.tensor(2.0)),
    ],
    ids=["two indices", "None index", "empty self", "index", "index_put", "index_put accumulate",
         "index_put mask value"],
)  # fmt: skip
def test_unsafe_masked_index_equals_measure(fn: Callable[..., Any], int32: bool, threads: int) -> None:
    """The backward is ``_unsafe_masked_index_put_accumulate`` (and ``index_put_``)."""
    torch.manual_seed(0)
    i0, i1 = torch.randint(0, 5, (10, 1)), torch.randint(0, 5, (1, 10))
    if int32:
        i0 = i0.int()
    mask = torch.rand(10, 10) > 0.5
    model = Lambda(lambda x: fn(x, mask, i0, i1))
    x = torch.randn(5, 5, requires_grad=True)
    assert_exact(model, x)


# -- nonzero_static --------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [2, 7, 20])
@pytest.mark.parametrize("shape", [(12,), (3, 4)], ids=str)
def test_nonzero_static_holds_the_whole_nonzero_beside_its_output(size: int, shape: tuple[int, ...]) -> None:
    """``nonzero_static`` (which ``combinations`` calls from torch 2.14) computes all of
    ``nonzero(self)`` and copies its first ``size`` rows into the output: 8 of 12
    elements set, 8 * dim int64 beside the output, whatever ``size`` is."""
    x = torch.tensor([1.0, -1, 2, 3, 0, 5, -2, 1, 1, 1, 1, -1]).view(shape)
    model = Lambda(lambda x: torch.nonzero_static(x > 0, size=size, fill_value=-1).float().sum() + x.sum())
    estimated, measured = tm.estimate(model, x, train=False), tm.measure(model, x, train=False)
    assert estimated.unsupported == ()
    assert estimated.forward_peak == measured.forward_peak


def test_nonzero_static_of_unknown_values_takes_every_element_and_says_so() -> None:
    x = torch.randn(3, 4)
    model = Lambda(lambda x: torch.nonzero_static(x + torch.rand_like(x) > 1, size=2).float().sum())
    estimated = tm.estimate(model, x, train=False)
    assert [u.op for u in estimated.unsupported] == ["aten.nonzero_static.default"]
    assert estimated.forward_peak >= tm.measure(model, x, train=False).forward_peak


# -- masked_scatter's backward --------------------------------------------------------------------


def test_masked_scatter_backward_takes_its_largest_buffers_and_says_so() -> None:
    """How many elements ``masked_select`` takes depends on the mask's values: the
    select and the zeros of the rest take one output's bytes (exact), and the
    prefix-sum path (a broadcast gradient) runs beside a select taken as complete,
    which is ``(n - k) * 4`` bytes above the real one: an upper bound, listed."""
    x, src = torch.randn(5, 5), torch.randn(5, 5, requires_grad=True)
    for unselected in (1, 10):
        mask = torch.ones(25, dtype=torch.bool)
        mask[:unselected] = False
        model = Lambda(lambda src, x: x.masked_scatter(mask.view(5, 5), src), (src,))
        estimated = tm.estimate(model, x)
        assert any("masked_scatter_backward" in u.reason for u in estimated.unsupported)
        measured = tm.measure(model, x)
        assert estimated.forward_peak == measured.forward_peak
        assert estimated.backward_peak - measured.backward_peak == unselected * 4


# -- embedding_bag --------------------------------------------------------------------------------


def test_embedding_bag_keeps_offset2bag_of_n_plus_one() -> None:
    """``mean`` over 6 indices in 2 bags of a (5, 5) float table (100 B): ``offset2bag`` is
    resized to 7 elements, ``make_offset2bag`` adds ``ones_like(offsets)`` (16 B) and a
    wrapped 1 (8 B), then ``cumsum`` into a new 7-element storage (56 B, the output)
    that replaces the first; the forward then holds the output 40, offset2bag 56,
    bag_size 16 and max_indices 16, and ``mean`` divides by
    ``max(bag_size, ones_like(bag_size)).to(float)`` (16 + 16 + 8 B)."""
    weight = torch.randn(5, 5)
    idx, offsets = torch.tensor([0, 2, 1, 2, 4, 3]), torch.tensor([0, 2])
    peak = _forward(lambda w: F.embedding_bag(idx, w, offsets, mode="mean"), weight)
    if installed_release()[:2] >= (2, 15):  # bag_size.clamp_min(1).to(float): no ones_like
        assert peak == 100 + (40 + 56 + 16 + 16) + (16 + 8)
    else:
        assert peak == 100 + (40 + 56 + 16 + 16) + (16 + 16 + 8)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "sum"},
        {"mode": "sum", "per_sample_weights": True},
        {"mode": "mean"},
        {"mode": "sum", "padding_idx": 2},
        {"mode": "sum", "per_sample_weights": True, "padding_idx": 1},
        {"mode": "mean", "include_last_offset": True},
        {"mode": "sum", "include_last_offset": True},
        {"mode": "max"},
    ],
    ids=["sum", "weighted", "mean", "padding", "weighted padding", "mean last offset",
         "sum last offset", "max"],
)  # fmt: skip
def test_embedding_bag_equals_measure(kwargs: dict[str, Any], dtype: torch.dtype, threads: int) -> None:
    """Forward, backward (``_embedding_bag_backward``, recomputing ``offset2bag`` after
    the fast path) and ``_embedding_bag_per_sample_weights_backward``; ``max``'s
    backward is listed (its non-empty bags), exact when no bag is empty."""
    torch.manual_seed(0)
    weight = torch.randn(10, 6, dtype=dtype, requires_grad=True)
    idx, offsets = torch.randint(0, 10, (7,)), torch.tensor([0, 3, 5])
    psw = torch.randn(7, dtype=dtype, requires_grad=True)
    options = {k: v for k, v in kwargs.items() if k != "per_sample_weights"}

    def fn(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        weights = p if kwargs.get("per_sample_weights") else None
        return F.embedding_bag(idx, w, offsets, per_sample_weights=weights, **options)

    model = Lambda(fn)
    estimated = tm.estimate(model, (weight, psw))
    expected = ["embedding_bag"] if kwargs["mode"] == "max" else []
    assert [u.reason.split("'")[0] for u in estimated.unsupported] == expected
    assert estimated.phase_peaks() == tm.measure(model, (weight, psw)).phase_peaks()


# -- repeat, index_select ----------------------------------------------------------------------


def test_repeat_builds_an_int64_permutation() -> None:
    """``x.repeat(2, 3)``, x (16, 32) float32: the (32, 96) result, then for the 2 repeat
    dims ``arange(2)`` (16 B), the wrapped 2 of ``add`` (8 B) and the sum (16 B), their
    ``cat`` (32 B): x + result + 16 + 16 + 32 at the peak (the wrapped number is given
    back before the ``cat``)."""
    x = torch.randn(16, 32)
    assert _forward(lambda x: x.repeat(2, 3), x) == 16 * 32 * F32 + 32 * 96 * F32 + 64


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.repeat(2, 1, 3),
        lambda x: x.repeat(1, 1),
        lambda x: x.repeat(0, 2),
        lambda x: x[0, 0].repeat(()),
        lambda x: x[:0].repeat(2, 1),
        lambda x: torch.tile(x, (2,)),
        lambda x: torch.tile(x[0, 0], ()),
    ],
    ids=["new dim", "ones", "zero repeat", "scalar", "empty", "tile", "tile scalar"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_repeat_step_equals_measure(fn: Callable[..., Any], dtype: torch.dtype, threads: int) -> None:
    x = torch.randn(6, 10, dtype=dtype, requires_grad=True)
    model = Lambda(fn)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


def test_index_select_along_dim_1_copies_a_strided_input() -> None:
    """``x.t().index_select(1, idx)``, x (32, 64) float32, 5 indices: the (64, 5) result,
    then ``index_select_out_cpu_dim1_`` reads ``self.contiguous()`` (32 * 64 floats)."""
    x, idx = torch.randn(32, 64), torch.tensor([0, 3, 3, 7, 1])
    peak = _forward(lambda x: x.t().index_select(1, idx), x)
    assert peak == 32 * 64 * F32 + 64 * 5 * F32 + 32 * 64 * F32


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.index_select(1, torch.tensor([2, 0, 1])),
        lambda x: x.transpose(0, 2).index_select(1, torch.tensor([2, 0, 1])),
        lambda x: x.index_copy(2, torch.tensor([4, 0, 1]), torch.ones(6, 5, 3, dtype=x.dtype)),
        lambda x: x.index_copy(-1, torch.tensor([4, 0, 1, 3, 2]), x.flip(-1)),
    ],
    ids=["dim 1", "transposed dim 1", "index_copy", "index_copy of itself"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_index_select_step_equals_measure(fn: Callable[..., Any], dtype: torch.dtype, threads: int) -> None:
    """``index_copy``'s backward selects its source's gradient from a broadcast one
    along the last dim (``index_select`` with ``self.contiguous()``)."""
    x = torch.randn(6, 5, 5, dtype=dtype, requires_grad=True)
    model = Lambda(fn)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()
