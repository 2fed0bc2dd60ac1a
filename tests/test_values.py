"""Values of small tensors known to the trace (``tracing/values.py``, issue 10).

Value-dependent ops (``nonzero``, boolean masks, ``unique``, ``.item()``,
``equal``) and backward formulas that pick their algorithm by values are exact
where the trace knows the values: tensors computed from the step's real inputs
that stay within the limits. Where it does not (too large, drawn at random,
written in place with unknown values), the op is listed in ``unsupported``, as
before. Each exact case is checked against ``measure`` byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import Lambda, skip_where_native
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.values import MAX_BYTES, MAX_NUMEL, KnownValues


def _exact(fn: Callable[..., Any], *inputs: torch.Tensor, **options: Any) -> tm.MemoryReport:
    """``estimate`` of ``fn(*inputs)`` equals ``measure`` in every phase, unflagged."""
    model = Lambda(fn)
    estimated = tm.estimate(model, inputs, **options)
    skip_where_native(estimated)
    measured = tm.measure(model, inputs, **options)
    assert estimated.unsupported == (), estimated.unsupported
    assert estimated.phase_peaks() == measured.phase_peaks()
    return estimated


def _flagged(fn: Callable[..., Any], *inputs: torch.Tensor, **options: Any) -> list[str]:
    return [f"{u.op}: {u.reason}" for u in tm.estimate(Lambda(fn), inputs, **options).unsupported]


def _x(*shape: int, zeros: int = 0, nans: int = 0) -> torch.Tensor:
    """A random float tensor with ``zeros`` zeros and then ``nans`` NaNs, every third element."""
    torch.manual_seed(0)
    x = torch.randn(*shape)
    x.view(-1)[: zeros * 3 : 3] = 0
    x.view(-1)[1 : nans * 3 : 3] = float("nan")
    return x.requires_grad_(True)


# -- value-dependent ops, exact on known values ------------------------------------------


OPS: dict[str, tuple[Callable[..., Any], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "nonzero": (lambda x: x.nonzero().float().sum() + x.sum(), lambda: (_x(6, 5, zeros=7),)),
    "argwhere": (lambda x: torch.argwhere(x > 0).sum() * x, lambda: (_x(6, 5),)),
    "x[mask]": (lambda x: x[x > 0].sum() * 2, lambda: (_x(6, 5),)),
    "x[mask] = v": (
        lambda x, v: x.clone().index_put_((x > 0,), v[: int((x > 0).sum())]),
        lambda: (_x(6, 5), torch.randn(30, requires_grad=True)),
    ),
    "masked_select": (lambda x: x.masked_select(x > 0.5).sum(), lambda: (_x(6, 5),)),
    # (a broadcast mask: with more than one thread, the prefix-sum kernel)
    "masked_select, broadcast mask": (
        lambda x: x.masked_select(x[0] > 0).sum(),
        lambda: (_x(6, 5),),
    ),
    "unique": (
        lambda x: torch.unique(x.detach().round(), return_inverse=True, return_counts=True)[0].sum()
        + x.sum(),
        lambda: (_x(6, 5),),
    ),
    "unique (bool)": (lambda x: torch.unique(x > 0).sum() + x.sum(), lambda: (_x(6, 5),)),
    "unique_consecutive": (
        lambda x: torch.unique_consecutive(x.detach().round(), return_counts=True)[1].sum() * x,
        lambda: (_x(6, 5),),
    ),
    ".item()": (lambda x: x * x.sum().item(), lambda: (_x(6, 5),)),
    "a tensor as bool": (lambda x: x * 2 if (x.sum() > 0) else x * 3, lambda: (_x(6, 5),)),
    "equal": (lambda x: x * torch.equal(x, x.detach().clone()), lambda: (_x(6, 5),)),
    "allclose": (lambda x: x * torch.allclose(x, x + 1e-9), lambda: (_x(6, 5),)),
    "narrow at a tensor": (lambda x, at: x.narrow(0, at, 2) * 2, lambda: (_x(6, 5), torch.tensor(3))),
    "tensor_split at a tensor": (
        lambda x, at: torch.tensor_split(x, at)[1] * 2,
        lambda: (_x(6, 5), torch.tensor([1, 4])),
    ),
    "repeat_interleave": (
        lambda x, n: x[torch.arange(x.shape[0]).repeat_interleave(n)].sum(),
        lambda: (_x(6, 5), torch.tensor([1, 0, 2, 3, 1, 1])),
    ),
    "repeat_interleave, int32": (
        lambda x, n: torch.repeat_interleave(n).sum() * x,
        lambda: (_x(6, 5), torch.tensor([1, 0, 2, 2, 1, 1], dtype=torch.int32)),
    ),
    "ctc_loss": (
        lambda lp, targets: F.ctc_loss(
            lp.log_softmax(2), targets, [50] * 4, [20, 15, 30, 10], reduction="sum"
        ),
        lambda: (torch.randn(50, 4, 20, requires_grad=True), torch.randint(1, 20, (4, 30))),
    ),
    "gaussian_nll_loss": (
        lambda x, target, var: F.gaussian_nll_loss(x, target, var),
        lambda: (_x(6, 5), torch.randn(6, 5), torch.rand(6, 5) + 0.1),
    ),
}


@pytest.mark.parametrize("name", OPS)
def test_value_dependent_op_is_exact(name: str, threads: int) -> None:
    fn, inputs = OPS[name]
    _exact(fn, *inputs())


# -- backward formulas that pick their algorithm by values --------------------------------


FORMULAS: dict[str, tuple[Callable[..., Any], dict[str, int]]] = {
    "max()": (lambda x: x.max(), {}),
    "max(), a NaN": (lambda x: x.max(), {"nans": 1}),
    "min()": (lambda x: x.min(), {}),
    "median()": (lambda x: x.median(), {}),
    "nanmedian(), NaNs": (lambda x: x.nanmedian(), {"nans": 2}),
    "cumprod": (lambda x: x.cumprod(1), {}),
    "cumprod, zeros": (lambda x: x.cumprod(1), {"zeros": 2}),
    "prod()": (lambda x: x.prod(), {}),
    "prod(), a zero": (lambda x: x.prod(), {"zeros": 1}),
    "prod(), zeros": (lambda x: x.prod(), {"zeros": 2}),
    "prod(dim)": (lambda x: x.prod(0), {}),
    "prod(dim), zeros": (lambda x: x.prod(0), {"zeros": 2}),
    "masked_fill with a tensor": (lambda x: x.masked_fill(x > 0, x[0, 0]), {}),
}


@pytest.mark.parametrize("name", FORMULAS)
def test_formula_picked_by_values_is_exact(name: str, threads: int) -> None:
    """Eagerly these formulas choose by ``.item()``/``nonzero()`` (and take the
    composite algorithm only for tensor subclasses): the trace runs their eager
    branch, chosen by the input's values."""
    fn, special = FORMULAS[name]
    _exact(fn, _x(5, 5, **special))


def test_a_dropped_reduction_frees_its_saved_result() -> None:
    """``max()``'s node gets hooks for its replica; they must not keep the node (and
    the result it saved) alive after the program drops it."""
    _exact(lambda x: x * (x.max() > 0) + x * (x.prod() > 0), _x(5, 5))


# -- what stays unknown: listed, as before -------------------------------------------------


def test_a_tensor_above_the_limit_is_flagged() -> None:
    x = torch.randn(MAX_NUMEL + 1)
    flagged = _flagged(lambda x: x.nonzero().float().sum(), x, train=False)
    assert any("aten.nonzero" in u and "largest possible output" in u for u in flagged), flagged


def test_the_same_op_below_the_limit_is_exact() -> None:
    _exact(lambda x: x.nonzero().float().sum(), torch.randn(MAX_NUMEL), train=False)


def test_values_drawn_at_random_are_flagged() -> None:
    fn = lambda x: (x + torch.rand_like(x)).nonzero().float().sum()  # noqa: E731
    flagged = _flagged(fn, torch.randn(8), train=False)
    assert any("aten.nonzero" in u for u in flagged), flagged


def test_a_write_with_unknown_values_forgets_the_storage() -> None:
    """``y`` is known until a random draw is added into it in place; its view ``v``
    shares the storage and is forgotten with it."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        v = y[:4]
        y.add_(torch.rand_like(y))
        return v.nonzero().float().sum()

    flagged = _flagged(fn, torch.randn(8), train=False)
    assert any("aten.nonzero" in u for u in flagged), flagged


def test_a_write_with_known_values_keeps_them() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        v = y[:4]
        y.mul_(0)  # v sees the zeros: nonzero finds none
        return v.nonzero().float().sum() + x.sum()

    _exact(fn, torch.randn(8), train=False)


def test_meta_parameters_are_unknown() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    model.register_buffer("mask", torch.ones(4, dtype=torch.bool, device="meta"))

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)[:, self.inner.mask].sum()

    flagged = [u.op for u in tm.estimate(Masked(), torch.randn(2, 4)).unsupported]
    assert "aten.index.Tensor" in flagged


def test_real_buffers_are_known() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("mask", torch.tensor([True, False, True, True]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)[:, self.mask].sum()

    model = Masked()
    estimated = tm.estimate(model, torch.randn(2, 4))
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.measure(model, torch.randn(2, 4)).phase_peaks()


def test_estimate_leaves_the_inputs_alone() -> None:
    """The shadows are copies: an in-place op of the step on an input changes neither
    the user's tensor nor its version counter."""
    x = torch.arange(6.0)
    before, version = x.clone(), x._version
    report = tm.estimate(Lambda(lambda x: x.add_(1).nonzero().sum() * x), x, train=False)
    assert report.unsupported == ()
    assert torch.equal(x, before) and x._version == version


def test_unknown_formula_values_are_flagged() -> None:
    """Above the limit the replica still runs eager's algorithm; its ``.item()`` gets a
    stand-in and is listed. (Short rows: on torch 2.10 and 2.11 the node's own formula,
    which runs unrecorded beside the replica, loops over the cumulated dim in O(n^2) ops.)"""
    x = torch.randn(MAX_NUMEL // 4 + 1, 4, requires_grad=True)
    flagged = _flagged(lambda x: x.cumprod(1), x)
    assert any("_local_scalar_dense" in u for u in flagged), flagged


# -- the bounds -------------------------------------------------------------------------------


def test_shadows_respect_the_per_tensor_limit_and_the_total_cap() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    values = KnownValues(max_numel=100, max_bytes=1000)
    with FakeTensorMode():
        fakes = [torch.empty(n) for n in (101, 100, 100, 100)]
    reals = [torch.zeros(n) for n in (101, 100, 100, 100)]
    values.adopt(zip(fakes, reals))
    # 101 elements: over the limit; 100 floats (400 B) twice fit in 1000 B, a third does not
    assert [values.of(f) is not None for f in fakes] == [False, True, True, False]
    assert values.nbytes == 800
    assert MAX_BYTES == 16 * 2**20 and MAX_NUMEL == 2**15


# -- an argument that decides the output: known whatever the other holds ------------------


def _decided(combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[str]:
    """What the trace lists for ``bool(combine(known, unknown).any())``: the unknown
    operand is drawn at random (values the trace never has), the known one is made from
    the inputs' shape."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        unknown = torch.rand(x.shape[0]) > 0.5
        if bool(combine(x[:, 0] == x[:, 0], unknown).any()):  # the known one: all True
            return x * 2
        return x * 3

    return _flagged(fn, _x(4, 3))


@pytest.mark.parametrize(
    "combine",
    [
        lambda done, unknown: done | unknown,
        lambda done, unknown: torch.logical_or(unknown, done),
        lambda done, unknown: unknown & ~done,
        lambda done, unknown: torch.logical_and(~done, unknown),
        lambda done, unknown: unknown.long() & (~done).long(),
    ],
    ids=["true | ?", "logical_or(?, true)", "? & false", "logical_and(false, ?)", "int ? & 0"],
)
def test_an_absorbing_operand_decides_an_unknown_one(combine: Callable[..., torch.Tensor]) -> None:
    """``stop_at_max_length | stop_at_eos`` is known once the first is all True (a
    generation loop's end), ``x & 0`` is 0: nothing is listed."""
    assert _decided(combine) == []


@pytest.mark.parametrize(
    "combine",
    [
        lambda done, unknown: ~done | unknown,  # false | ?: the unknown decides
        lambda done, unknown: done & unknown,  # true & ?
        lambda done, unknown: unknown.long() | done.long(),  # an integer's or: 1 | ? is not 1
    ],
    ids=["false | ?", "true & ?", "int ? | 1"],
)
def test_an_operand_that_does_not_decide_leaves_it_unknown(combine: Callable[..., torch.Tensor]) -> None:
    flagged = _decided(combine)
    assert len(flagged) == 1 and "the Python value of a tensor is not known" in flagged[0], flagged


class _Chooser(nn.Module):
    """The rows its forward allocates depend on its weights' values, which the first
    iteration's optimizer step changes through a gradient that autograd writes in place
    into a zero tensor (``topk``'s backward scatters into zeros), or sums in place (``h``
    used twice: its node's input buffer adds the second gradient to the first)."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.twice = twice
        self.w = nn.Parameter(torch.tensor([0.5, 0.4, 0.3, -0.1, -0.2, 0.2, 0.1, -0.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int((self.w > 0).sum())  # 5 before the step
        wide = x.repeat(rows, 1)
        if self.twice:
            h = self.w * 1.0
            chosen = (h * -1.0).sum() + (h * 2.0).sum()  # h's gradient: -1 + 2
        else:
            chosen = self.w.topk(2).values.sum()
        return wide.sum() + chosen


@pytest.mark.parametrize("twice", [False, True], ids=["scattered", "accumulated"])
def test_a_gradient_written_in_place_by_autograd_has_its_values(twice: bool) -> None:
    """The second iteration allocates by the weights the first one's step left: SGD moves
    the top two weights (gradient 1, lr 1.5) below zero, or every weight down by 0.35
    (gradient 1, lr 0.35; either gradient alone moves them otherwise): the values of a
    gradient that eager autograd writes in place into its first argument are the real
    ones (once the zeros' or the first gradient's, and the second iteration allocated
    other rows than a real one)."""
    x = torch.randn(64, 64)
    lr = 0.35 if twice else 1.5
    report = _exact(_Chooser(twice), x, optimizer=lambda params: torch.optim.SGD(params, lr=lr))
    assert report.first_step is not None
    assert report.forward_peak != report.first_step.forward
