"""The constants the tracer takes from torch's C++, pinned on the running torch (the release suite).

The tracker follows what autograd's engine and ATen do (reference counts, node
names, the names of saved attributes, the dtypes of wrapped numbers) and tells
fake tensors' errors by their wording. Each constant is named where it is used,
with the torch source it follows; these tests read each one off the running
torch, so that a release that changes one fails here, by name, rather than
moving a figure somewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_torchmem.engine.tracing import autograd_eager, fake_limits, op_plans

# -- the input buffer's sum (autograd_eager.INPUT_BUFFER_ONLY_*) ----------------------------


class _EngineSums(TorchDispatchMode):
    """Records the use counts of the first argument of every ``add`` the engine makes in
    backward (grad mode off, a node running), as the tracker reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if (
            func is torch.ops.aten.add.Tensor
            and not torch.is_grad_enabled()
            and torch._C._current_autograd_node() is not None
        ):
            old = args[0]
            self.counts.append((old._use_count(), torch._C._storage_Use_Count(old.untyped_storage()._cdata)))
        return func(*args, **(kwargs or {}))


_held: list[torch.Tensor] = []


class _Twice(torch.autograd.Function):
    """``2 x``, whose gradient reaches ``x``'s input buffer first; with ``hold`` a view of
    it is kept (a second reference, from C++: the view's base)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hold: bool) -> torch.Tensor:
        ctx.hold = hold
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad * 2
        if ctx.hold:
            _held.append(out.view(-1))
        return out, None


def _sum_of_two_gradients(make: Callable[[], torch.Tensor], hold: bool) -> tuple[torch.Tensor, list[Any]]:
    """x's two gradients meet in its input buffer: _Twice's first (made later, it runs first)."""
    x, w = make(), make()
    with _EngineSums() as seen:
        loss = (x * w).sum() + _Twice.apply(x, hold).sum()
        loss.backward()
    return x, seen.counts


def _fake() -> torch.Tensor:
    with _FAKE:
        return torch.empty(8, 8, requires_grad=True)


_FAKE = FakeTensorMode()


def test_the_input_buffers_only_reference_shows_the_tabled_use_counts() -> None:
    """Under a dispatch mode above the fake mode (the tracker's place), the engine's sum of
    a gradient only the input buffer holds shows the counts the tracker takes for it."""
    with _FAKE:
        _, counts = _sum_of_two_gradients(_fake, hold=False)
    assert counts == [
        (autograd_eager.INPUT_BUFFER_ONLY_USE_COUNT, autograd_eager.INPUT_BUFFER_ONLY_STORAGE_USE_COUNT)
    ]


def test_a_gradient_held_elsewhere_shows_more() -> None:
    """Other references from C++ (a view of it, kept) show higher counts: the tracker's
    test of equality tells the two apart."""
    with _FAKE:
        _, counts = _sum_of_two_gradients(_fake, hold=True)
    _held.clear()
    [(tensor, storage)] = counts
    assert tensor > autograd_eager.INPUT_BUFFER_ONLY_USE_COUNT
    assert storage > autograd_eager.INPUT_BUFFER_ONLY_STORAGE_USE_COUNT


@pytest.mark.parametrize("hold", [False, True], ids=["only-the-buffer", "held-elsewhere"])
def test_the_engine_sums_in_place_exactly_when_the_buffer_holds_the_only_reference(hold: bool) -> None:
    """On plain tensors, with no mode (the real step): the first gradient becomes x.grad,
    summed into in place, where the buffer holds it alone; else x.grad is a new tensor."""
    x, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    firsts: list[int] = []

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            out = grad * 2
            firsts.append(out.data_ptr())
            if hold:
                _held.append(out.view(-1))
            return out

    ((x * w).sum() + Twice.apply(x).sum()).backward()
    _held.clear()
    assert x.grad is not None
    assert (x.grad.data_ptr() == firsts[0]) is not hold


# -- node names and saved attributes (autograd_eager.COPY_SLICES, SAVED_PREFIX) -------------


def test_a_view_written_in_place_gives_its_base_a_copy_slices_node() -> None:
    x = torch.randn(4, requires_grad=True)
    base = x.clone()
    base[:2].mul_(2.0)
    assert base.grad_fn is not None
    assert base.grad_fn.name() == f"torch::autograd::{autograd_eager.COPY_SLICES}"


def test_a_nodes_saved_argument_and_its_raw_saved_tensor_are_named_as_tabled() -> None:
    x = torch.randn(3, requires_grad=True)
    node = (x / 3.0).grad_fn
    assert node is not None
    saved = getattr(node, f"{autograd_eager.SAVED_PREFIX}other")
    raw = getattr(node, f"{autograd_eager.RAW_SAVED_PREFIX}other")
    assert isinstance(saved, torch.Tensor) and saved.dim() == 0
    assert type(raw) is torch._C._autograd.SavedTensor


# -- wrapped numbers (op_plans.WRAPPED_*_NBYTES) -------------------------------------------


@pytest.mark.parametrize(
    ("number", "nbytes"),
    [
        (True, op_plans.WRAPPED_BOOL_NBYTES),
        (3, op_plans.WRAPPED_NUMBER_NBYTES),
        (3.0, op_plans.WRAPPED_NUMBER_NBYTES),
        (1j, op_plans.WRAPPED_COMPLEX_NBYTES),
    ],
    ids=["bool", "int", "float", "complex"],
)
def test_a_wrapped_number_is_the_tabled_size(number: Any, nbytes: int) -> None:
    """The 0-dim tensor ATen wraps a Python number in, as autograd saves it (x * number)."""
    dtype = torch.complex64 if isinstance(number, complex) else torch.float32
    x = torch.randn(3, dtype=dtype, requires_grad=True)
    node = (x * number).grad_fn
    assert node is not None
    saved = node._saved_other
    assert saved.dim() == 0 and saved.element_size() == nbytes == op_plans.number_nbytes(number)


# -- what fake tensors raise (fake_limits) --------------------------------------------------

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _raised(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error is what is looked at
        return exc
    raise AssertionError(f"{call} raised nothing")


def _fake_tensor() -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(3)


def _custom_op_without_fake_kernel() -> Any:
    @torch.library.custom_op("torchmem_constants::no_fake", mutates_args=())
    def no_fake(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    return no_fake


_NO_FAKE = _custom_op_without_fake_kernel()


def _in_fake_mode(call: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with FakeTensorMode():
            return call(torch.empty(3))

    return run


#: Each wording, and a call on the running torch that raises it.
_WORDINGS: dict[str, Callable[[], Any]] = {
    # a CPU kernel that reads its argument's data, run on a meta tensor's (no data)
    fake_limits.DATA_NOT_ALLOCATED: lambda: torch.ops.aten.bincount.default.redispatch(
        _CPU, torch.empty(3, dtype=torch.long, device="meta")
    ),
    # the data pointer of a tensor with no storage
    fake_limits.NO_DATA_POINTER: lambda: torch.zeros(3).to_sparse().data_ptr(),
    # the storage of a tensor with none
    fake_limits.NO_STORAGE: lambda: torch.zeros(3).to_sparse().untyped_storage(),
    fake_limits.NUMPY_OF_SUBCLASS: lambda: _fake_tensor().numpy(),
    fake_limits.META_STORAGE_ITEM: lambda: torch.empty(2, device="meta").untyped_storage()[0],
    # an op with no meta kernel (the Meta fallback) and a custom op with no fake kernel
    fake_limits.NO_FAKE_KERNEL: lambda: torch.ops.aten._foobar(torch.empty(2, device="meta")),
}


@pytest.mark.parametrize("wording", sorted(_WORDINGS))
def test_torch_raises_each_wording_the_tracker_matches(wording: str) -> None:
    exc = _raised(_WORDINGS[wording])
    assert wording in str(exc)
    assert fake_limits.fake_tensor_limit(exc)


def test_a_custom_op_without_a_fake_kernel_says_so_in_the_tabled_words() -> None:
    exc = _raised(_in_fake_mode(_NO_FAKE))
    assert fake_limits.NO_FAKE_KERNEL in str(exc) and fake_limits.fake_tensor_limit(exc)


def test_the_dispatchers_refusal_names_the_backend_as_tabled() -> None:
    """The dispatcher's words for an op with no kernel of a backend (the Meta fallback
    catches meta's first: shown here on CPU, whose words the meta wording follows)."""
    exc = _raised(lambda: torch.ops.aten._fused_dropout(torch.ones(2), 0.5))
    assert fake_limits.NO_META_KERNEL.replace("Meta", "CPU") in str(exc)


def test_every_wording_is_pinned_here() -> None:
    pinned = {*_WORDINGS, fake_limits.NO_META_KERNEL}
    assert pinned == set(fake_limits.FAKE_LIMITS)


def test_an_error_of_the_program_is_not_a_fake_tensor_limit() -> None:
    exc = _raised(lambda: torch.ones(2) @ torch.ones(3))
    assert not fake_limits.fake_tensor_limit(exc)
