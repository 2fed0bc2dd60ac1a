"""CPU indexing and selection kernels (``cpu.indexing``, ``cpu.sorting``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from exactness import Lambda
from torch import nn

import pytest_torchmem as tm

F32, I64 = 4, 8


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
        assert rule_buffers(aten.gather.default, (x, 1, idx32)) == {"index as int64": 15 * 8}
        assert rule_buffers(aten.gather.default, (x, 1, idx64)) == {}
        assert rule_buffers(aten.scatter_add_.default, (x, 0, idx32, src)) == {"index as int64": 120}
        assert rule_buffers(aten.scatter.value, (x, 0, idx32, 2.0)) == {"index as int64": 120}


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
    fn: Callable[..., Any], index_dtype: torch.dtype, threads: int
) -> None:
    """OpInfo's ``gather`` and ``scatter`` samples index with int32."""
    torch.manual_seed(0)
    idx = torch.randint(0, 5, (5, 5), dtype=index_dtype)
    src = torch.randn(5, 5)
    model = Lambda(lambda x: fn(x, idx, src))
    x = torch.randn(10, 5, requires_grad=True)
    assert tm.estimate(model, x).phase_peaks() == tm.measure(model, x).phase_peaks()


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
