"""Sparse tensors: COO and CSR inputs, sparse gradients, the optimizers that step them.

Issue 27, item 7: ``estimate(nn.Linear(4, 4), torch.randn(2, 4).to_sparse())``, a
model whose ``nn.Embedding(sparse=True)`` holds a sparse ``.grad``, and ``measure`` of
a fresh sparse-embedding model all raised ``NotImplementedError: Cannot access storage
of SparseTensorImpl``. A sparse tensor's memory is its parts' storages: a COO tensor's
``indices`` (sparse dims × nnz, int64) and ``values`` (nnz × dense dims), a CSR
tensor's row pointers, column indices and values, each counted once like any storage
(a gradient's indices that view the input's are the input's bytes).

Every figure is checked against ``measure()`` of the same step (byte for byte), and
counted by hand where the docstring says so: float32 is 4 bytes, int64 8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

F32, I64 = 4, 8
VOCAB, DIM = 100, 8
TABLE = VOCAB * DIM * F32  # 3200: the embedding table
INDICES = 4 * 5 * I64  # 160: a (4, 5) batch of int64 indices
LOOKED_UP = 4 * 5 * DIM * F32  # 640: one row of the table per index


class Embed(nn.Module):
    def __init__(self, bag: bool = False) -> None:
        super().__init__()
        self.table: nn.Module = (
            nn.EmbeddingBag(VOCAB, DIM, sparse=True, mode="mean")
            if bag
            else nn.Embedding(VOCAB, DIM, sparse=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def sparse_adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SparseAdam(list(params))


def _indices(distinct: int) -> torch.Tensor:
    """A (4, 5) batch of 20 indices of which ``distinct`` differ."""
    torch.manual_seed(0)
    values = torch.randperm(VOCAB)[:distinct]
    return torch.cat([values, values[: 20 - distinct]]).reshape(4, 5)


def _both(model: nn.Module, inputs: Any, **options: Any) -> tm.MemoryReport:
    """The estimate, after checking that it is complete and equals the measurement."""
    estimated = tm.estimate(model, inputs, **options)
    measured = tm.measure(model, inputs, **options)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.first_step == measured.first_step
    assert estimated.breakdown == measured.breakdown
    assert estimated.modules == measured.modules
    return estimated


def _snapshot(model: nn.Module) -> list[tuple[str, Any, Any]]:
    """Each parameter's identity, values and gradient (its parts' identities and values)."""
    found = []
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is not None and grad.layout is torch.sparse_coo:
            parts: Any = (id(grad), grad._indices().clone(), grad._values().clone())
        else:
            parts = None if grad is None else (id(grad), grad.clone())
        found.append((name, (id(p), p.detach().clone()), parts))
    return found


def _same(before: list[tuple[str, Any, Any]], after: list[tuple[str, Any, Any]]) -> bool:
    def equal(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, tuple):
            return isinstance(b, tuple) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return bool(a == b)

    return equal(tuple(before), tuple(after))


# -- sparse gradients ------------------------------------------------------------------


def test_a_sparse_embedding_trained_with_sgd_is_exact() -> None:
    """Regression: measure raised ``Cannot access storage of SparseTensorImpl``. By hand:
    forward = table + indices + the looked-up rows + the loss (4); backward = table +
    indices + loss + its gradient (4) + the sparse gradient, which ``AccumulateGrad``
    copies (its values are a view of the sum's expanded gradient): values 640 + indices
    160; the SGD step adds the sparse gradient into the table in place (no buffer)."""
    model = Embed()
    report = _both(model, _indices(20), optimizer=sgd)
    sparse_grad = LOOKED_UP + INDICES
    assert report.forward_peak == TABLE + INDICES + LOOKED_UP + F32
    assert report.backward_peak == TABLE + INDICES + F32 + F32 + sparse_grad
    assert report.step_peak == TABLE + INDICES + F32 + sparse_grad
    assert report.breakdown[tm.Category.GRADIENTS] == sparse_grad
    assert model.table.weight.grad is None  # the model trained nothing


def test_sparse_adam_keeps_as_many_rows_as_there_are_distinct_indices() -> None:
    """SparseAdam coalesces the gradient: its new indices and values are of the input's
    20 elements (the storages ``_coalesce`` allocates, narrowed to the ``k`` distinct
    ones), and every later array of the step has ``k`` rows. By hand, the step's peak:
    table, indices, sparse gradient (800), the two moments (2 × 3200), the loss, the
    coalesced gradient (800), the wrapped ``-step_size`` and its float copy (12) and five
    arrays of ``k`` rows of 8 floats (the two masked moments, their updates and the
    step): 160 bytes a distinct index. The trace knows the indices' values (the input's),
    so ``k`` is exact."""
    for distinct in (20, 13):
        model = Embed()
        report = _both(model, _indices(distinct), optimizer=sparse_adam)
        expected = TABLE + INDICES + 800 + 2 * TABLE + F32 + 800 + 12 + 160 * distinct
        assert report.step_peak == expected, distinct
        assert report.breakdown[tm.Category.OPTIMIZER_STATE] == 2 * TABLE


def test_a_sparse_gradient_taken_without_a_copy_is_exact() -> None:
    """``AccumulateGrad`` keeps a new sparse gradient without copying it where its indices
    and values are contiguous (eagerly; a fake tensor's use counts would make it copy):
    for ``(out * out).sum()`` the gradient's values are the backward's own buffer (640)
    and its indices the input's (counted as input). By hand: backward = table + indices
    + the looked-up rows (saved) + loss + its gradient + the two products of ``MulBackward``."""
    report = _both(Embed(), _indices(20), loss_fn=lambda out: (out * out).sum())
    assert report.backward_peak == TABLE + INDICES + LOOKED_UP + F32 + F32 + 2 * LOOKED_UP
    assert report.breakdown[tm.Category.GRADIENTS] == LOOKED_UP


def test_a_sparse_gradient_the_model_holds_is_accumulated_and_left_alone() -> None:
    """Regression: a model whose sparse embedding holds a gradient raised. Autograd adds
    the new gradient into it (``add_out_sparse_cpu``): new indices and values of the
    two gradients' 40 elements (320 + 1280), the old parts let go after; ``measure`` now
    sees that free (its stand-ins are made under the profiler). The user's gradient is
    the same tensor, with the same indices and values, after both."""
    model = Embed()
    x = _indices(20)
    model(x).sum().backward()
    before = _snapshot(model)
    report = _both(model, x)
    old_grad = LOOKED_UP + INDICES
    assert report.forward_peak == TABLE + INDICES + old_grad + LOOKED_UP + F32
    assert report.backward_peak == TABLE + INDICES + old_grad + F32 + F32 + 40 * I64 + 40 * DIM * F32
    assert _same(before, _snapshot(model))


def test_a_sparse_embedding_bag_is_exact() -> None:
    """``nn.EmbeddingBag(sparse=True, mode="mean")`` with SGD: the sparse backward gathers
    the gradient per index (the sparse gradient's values, 640; its indices are the
    input's) and scales it by the bags' inverse sizes: ``bag_size.to(float)`` and
    ``1 / that`` (4 bags: 16 each) and those gathered per index (80), kernel scratch."""
    report = _both(Embed(bag=True), _indices(20), optimizer=sgd)
    assert report.breakdown[tm.Category.GRADIENTS] == LOOKED_UP
    assert report.breakdown[tm.Category.WORKSPACE] == 16 + 16 + 80


# -- sparse inputs ----------------------------------------------------------------------


def _sparse_batch() -> torch.Tensor:
    """A (3, 4) batch with two zeros: 10 elements."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    x[0, 1] = x[2, 2] = 0
    return x


@pytest.mark.parametrize("requires_grad", [False, True], ids=["input", "input requiring grad"])
def test_a_coo_input_to_a_linear_is_exact(requires_grad: bool) -> None:
    """Regression: ``estimate(nn.Linear(4, 6), x.to_sparse())`` raised. Eagerly the step
    runs (``addmm`` of a sparse ``mat1``, and in backward ``mat1.t()``, a clone, and
    ``_sparse_addmm``); the input counts as its parts: indices 2 × 10 × 8, values 10 × 4."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    x = _sparse_batch().to_sparse().requires_grad_(requires_grad)
    before = (x._indices().clone(), x._values().clone())
    report = _both(model, x)
    assert report.breakdown[tm.Category.INPUTS] == 2 * 10 * I64 + 10 * F32
    assert torch.equal(x._indices(), before[0]) and torch.equal(x._values(), before[1])
    assert x.grad is None


def test_a_csr_input_is_measured_and_stops_the_estimate() -> None:
    """Fake tensors have no kernels for compressed sparse tensors: the estimate stops at
    the first op on one (``TraceStopped``, whose partial report lists it); ``measure``
    runs the step and counts the input as its parts: row pointers (3 + 1) × 8, column indices 10 × 8, values 10 × 4
    (made of their own: ``to_sparse_csr()``'s column indices view a COO tensor's 2 × 10
    indices, whose whole storage it holds)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    converted = _sparse_batch().to_sparse_csr()
    x = torch.sparse_csr_tensor(
        converted.crow_indices().clone(),
        converted.col_indices().clone(),
        converted.values().clone(),
        (3, 4),
        check_invariants=True,
    )
    with pytest.raises(tm.TraceStopped) as info:
        tm.estimate(model, x)
    [entry] = info.value.report.unsupported
    assert entry.op == "aten.addmm.default"
    assert "sparse_csr" in entry.reason and "the trace stopped here" in entry.reason
    assert str(info.value).endswith(
        "fake tensors have no kernels for compressed sparse tensors: measure the step for real (tm.measure)"
    )
    measured = tm.measure(model, x)
    assert measured.unsupported == ()
    assert measured.breakdown[tm.Category.INPUTS] == 4 * I64 + 10 * I64 + 10 * F32
    assert measured.backward_peak > measured.forward_peak > 0


_ADJACENCY = torch.tensor([[0.0, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 5.0]])


class Graph(nn.Module):
    """A graph layer: a sparse adjacency as a buffer (or a module-level matrix), multiplied
    with ``torch.sparse.mm`` (``_sparse_addmm`` of a zeroed result)."""

    def __init__(self, buffer: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        if buffer:
            self.register_buffer("adjacency", _ADJACENCY.to_sparse())
        self.buffer = buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adjacency = self.adjacency if self.buffer else GLOBAL_ADJACENCY
        return self.fc(torch.sparse.mm(adjacency, x))


GLOBAL_ADJACENCY = _ADJACENCY.to_sparse()


@pytest.mark.parametrize("buffer", [True, False], ids=["sparse buffer", "module-level sparse matrix"])
def test_a_sparse_adjacency_through_torch_sparse_mm_is_exact(buffer: bool) -> None:
    """A sparse buffer counts as its parts (5 elements: indices 2 × 5 × 8, values 5 × 4);
    a sparse matrix the model reaches outside its own tensors is used, not charged (a
    real run does not copy it either)."""
    torch.manual_seed(0)
    report = _both(Graph(buffer), torch.randn(4, 2))
    assert report.breakdown[tm.Category.BUFFERS] == (2 * 5 * I64 + 5 * F32 if buffer else 0)


def test_an_op_eager_refuses_on_a_sparse_tensor_raises_the_same_error() -> None:
    """``nn.LayerNorm`` makes its input contiguous, which a sparse tensor refuses eagerly
    (``clone_sparse``); the estimate raises that error, not the fake kernel's."""
    model, x = nn.LayerNorm(4), _sparse_batch().to_sparse()
    with pytest.raises(RuntimeError) as eager:
        model(x)
    for run in (tm.estimate, tm.measure):
        with pytest.raises(RuntimeError) as raised:
            run(model, x)
        assert str(raised.value) == str(eager.value) == "unsupported memory format option Contiguous"


# -- the fake cuda device ------------------------------------------------------------------


CUDA_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], dict[str, Any], str]] = {
    "Embedding + SGD": (Embed, lambda: _indices(20), {"optimizer": sgd}, "aten.clone.default"),
    "Embedding + SparseAdam": (Embed, lambda: _indices(20), {"optimizer": sparse_adam}, "aten.clone.default"),
    "EmbeddingBag": (
        lambda: Embed(bag=True), lambda: _indices(20), {}, "aten._embedding_bag_backward.default"
    ),
    "COO into Linear": (
        lambda: nn.Linear(4, 6), lambda: _sparse_batch().to_sparse(), {}, "aten.addmm.default"
    ),
    "CSR into Linear": (
        lambda: nn.Linear(4, 6), lambda: _sparse_batch().to_sparse_csr(), {}, "aten.addmm.default"
    ),
}


#: The cases whose trace stops at ``op`` (a sparse ``addmm``: no fake kernel on the fake
#: cuda device's meta tensors).
_CUDA_STOPS: Final = frozenset({"COO into Linear", "CSR into Linear"})


@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_sparse_steps_on_the_fake_cuda_device_are_listed_or_stop(case: str) -> None:
    """The CUDA kernels of sparse ops are not modelled: the estimate lists them and goes
    on (a figure, approximate), or, where fake tensors cannot run the op, stops there
    (``TraceStopped``); either way it leaves the model and inputs as they were."""
    make_model, make_inputs, options, op = CUDA_CASES[case]
    torch.manual_seed(0)
    model, x = make_model(), make_inputs()
    before = _snapshot(model)
    if case in _CUDA_STOPS:
        with pytest.raises(tm.TraceStopped) as info:
            tm.estimate(model, x, device="cuda", **options)
        assert info.value.entry.op == op
        report = info.value.report
    else:
        report = tm.estimate(model, x, device="cuda", **options)
        assert report.peak > 0
    assert op in [entry.op for entry in report.unsupported]
    assert _same(before, _snapshot(model))
