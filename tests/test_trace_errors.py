"""A trace that stops is an error carrying its partial report; the program's own errors propagate.

The tracer's failures stop the trace (:class:`tm.TraceStopped`): an op with no
fake kernel, C++ code or ``.numpy()`` reading a fake tensor's values, and anything
raised after a value-dependent op got a stand-in value. A memory rule that fails
costs the op its scratch, listed: the trace goes on, a figure. The program's:
everything else, unchanged (the user's exceptions, a shape error the real kernel
raises too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from exactness import Lambda
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices import DEVICES
from pytest_torchmem.engine.tracing.rules import OpCall
from pytest_torchmem.engine.tracing.trace import trace

F32 = 4


@torch.library.custom_op("torchmem_tests::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _line_of(text: str) -> str:
    with open(__file__) as source:
        for number, line in enumerate(source, 1):
            if text in line and "_line_of" not in line:
                return f"{__file__}:{number}"
    raise AssertionError(text)


def _only(report: tm.MemoryReport) -> tm.Unsupported:
    assert len(report.unsupported) == 1, report.unsupported
    return report.unsupported[0]


def _stopped(run: Callable[[], Any]) -> tm.TraceStopped:
    with pytest.raises(tm.TraceStopped) as info:
        run()
    stop = info.value
    assert stop.report.unsupported[-1] == stop.entry  # the partial report lists it, last
    assert stop.entry.reason.endswith("; the trace stopped here")
    assert "\n" not in str(stop)
    return stop


_CANNOT_RUN = (
    "give the op a fake kernel (torch.library.register_fake) or a rule of the device "
    "(pytest_torchmem_add_rules), or measure the step for real (tm.measure)"
)
_READS_VALUES = (
    "code that reads a tensor's data (.numpy(), a C++ extension) cannot run on fake tensors: "
    "keep it out of the step, or measure the step for real (tm.measure)"
)


# -- the tracer's failures: the trace stopped there, an error --------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_custom_op_without_fake_kernel_stops_the_trace(device: str) -> None:
    """Even where its arguments' values are known: only ATen's ops run on values."""
    x = torch.randn(256)
    model = Lambda(lambda x: _triple(x.exp()))  # custom op call
    stop = _stopped(lambda: tm.estimate(model, x, device=device, train=False))
    entry = stop.entry
    assert entry.op == "torchmem_tests.triple.default"
    assert entry.reason.startswith("fake tensors cannot run it (RuntimeError: There was no fake impl")
    assert entry.location == _line_of("# custom op call")
    assert stop.advice == _CANNOT_RUN
    assert str(stop) == (
        f"the trace stopped at {entry.location} in torchmem_tests.triple.default: "
        f"{entry.reason.removesuffix('; the trace stopped here')}; {_CANNOT_RUN}"
    )
    assert stop.report.unsupported == (entry,)
    if device == "cpu":  # what ran before the op is in the partial report: x, then exp(x)
        assert stop.report.forward_peak == 2 * 256 * F32


def test_numpy_in_forward_stops_the_trace() -> None:
    model = Lambda(lambda x: torch.from_numpy(x.numpy() * 2))  # numpy call
    stop = _stopped(lambda: tm.estimate(model, torch.randn(8), train=False))
    assert stop.entry.op == "Tensor.numpy"
    assert stop.entry.location == _line_of("# numpy call")
    assert stop.advice == _READS_VALUES
    assert str(stop) == (
        f"the trace stopped at {_line_of('# numpy call')} in Tensor.numpy: fake tensors cannot "
        "run it (RuntimeError: .numpy() is not supported for tensor subclasses.); " + _READS_VALUES
    )


#: Elements of an input whose values the trace does not keep (above values.MAX_NUMEL).
_UNKNOWN = (1 << 15) + 1


def test_cpp_reading_tensor_values_stops_the_trace() -> None:
    """``tensor_split`` with a tensor of split points reads them in C++; computed from an
    input too large for the trace to keep its values, they are not known to it."""
    model = Lambda(lambda x, big: torch.tensor_split(x, (big[:2] * 0).long() + torch.tensor([2, 5]))[0] * 2)  # reads values
    stop = _stopped(lambda: tm.estimate(model, (torch.randn(8), torch.randn(_UNKNOWN)), train=False))
    entry = _only(stop.report)
    assert entry.op == "(tensor values)"
    assert "not allocated" in entry.reason
    assert entry.location == _line_of("# reads values")


def test_error_after_a_stand_in_value_stops_the_trace() -> None:
    """``int(n)`` of a number computed from an input too large for the trace to keep its
    values gets the stand-in 0: the empty ``stack`` fails only in the trace."""
    model = Lambda(lambda x, big: torch.stack([x * i for i in range(int(big[0] * 0 + 3))]))  # value
    stop = _stopped(lambda: tm.estimate(model, (torch.randn(4), torch.randn(_UNKNOWN)), train=False))
    first, second = stop.report.unsupported
    assert first.op == "aten._local_scalar_dense.default"
    assert second == stop.entry
    assert "stack expects a non-empty TensorList" in second.reason
    assert "after aten._local_scalar_dense.default" in second.reason
    assert second.location == _line_of("# value")
    assert stop.advice == (
        "the real values may not take this path: compute that value from the step's inputs, "
        "so that the trace knows it, or measure the step for real (tm.measure)"
    )
    with pytest.raises(RuntimeError, match="non-empty"):  # the same program, for real, runs
        torch.stack([])
    tm.measure(model, (torch.randn(4), torch.randn(_UNKNOWN)), train=False)


def test_a_batch_left_on_the_host_stops_the_cuda_trace_at_its_first_op() -> None:
    """Issue 36, item 7: a DataLoader's batches not moved to the device: the first matmul
    meets a host tensor, a GPU raises there, and the trace stopped. Before, the report was
    a figure (forward 9.50 KiB, backward 0 B) that later runs passed against."""
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Linear(32, 8)
    loader = DataLoader(TensorDataset(torch.randn(8, 32)), batch_size=4)

    def train(model: nn.Module) -> None:
        for (x,) in loader:
            model(x).sum().backward()  # the batch, on the host

    stop = _stopped(lambda: tm.estimate(train, (model,), device="cuda"))
    assert stop.entry.op == "aten.mm.default"  # Linear's matmul
    assert stop.entry.location == _line_of("# the batch, on the host")
    assert stop.entry.reason == "its tensors are on two devices, cuda and cpu; the trace stopped here"
    assert stop.advice == 'move the batch to the device (batch.to("cuda")), and any tensor the step takes from outside its inputs (labels a loss reads: labels.to(logits.device)), as a GPU would require'
    assert str(stop).startswith(f"the trace stopped at {_line_of('# the batch, on the host')} in aten.mm.default:")
    assert str(stop).endswith('; move the batch to the device (batch.to("cuda")), and any tensor the step takes from outside its inputs (labels a loss reads: labels.to(logits.device)), as a GPU would require')
    assert stop.report.backward_peak == 0  # the partial report: it stopped in the forward

    def moved(model: nn.Module) -> None:
        for (x,) in loader:
            model(x.to("cuda")).sum().backward()

    assert tm.estimate(moved, (model,), device="cuda").backward_peak > 0


def test_a_stop_the_step_catches_still_stops_the_trace() -> None:
    """The step went on past an op the trace could not run (``except Exception``): what
    followed ran without it, so the figures are no estimate all the same."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        try:
            return _triple(x)  # caught
        except Exception:  # noqa: BLE001 - the user's code catches everything
            return x * 3

    stop = _stopped(lambda: tm.estimate(Lambda(forward), torch.randn(64), train=False))
    assert stop.entry.op == "torchmem_tests.triple.default"
    assert stop.entry.location == _line_of("# caught")


def test_trace_stopped_pickles_with_its_report() -> None:
    import pickle

    stop = _stopped(lambda: tm.estimate(Lambda(lambda x: _triple(x)), torch.randn(8), train=False))
    again = pickle.loads(pickle.dumps(stop))
    assert (str(again), again.report, again.entry) == (str(stop), stop.report, stop.entry)
    assert isinstance(again, RuntimeError)


def test_failing_scratch_rule_costs_only_its_scratch() -> None:
    rules = DEVICES["cpu"].rules.copy()

    @rules.scratch(torch.ops.aten.exp.default)
    def _broken(call: OpCall) -> Any:
        raise IndexError("a case the rule did not foresee")

    x = torch.randn(64)
    report = trace(
        Lambda(torch.exp),
        (x,),
        {},
        device=replace(DEVICES["cpu"], rules=rules),
        loss_fn=None,
        optimizer=None,
        train=False,
    ).report
    entry = _only(report)
    assert entry.op == "aten.exp.default"
    assert "memory rule failed (IndexError: a case the rule did not foresee)" in entry.reason
    assert report.forward_peak == 2 * 64 * F32  # input and output: the trace went on


# -- the program's errors: raised unchanged ----------------------------------------------


@pytest.mark.parametrize("entry", [tm.estimate, tm.measure], ids=["estimate", "measure"])
def test_users_exception_propagates(entry: Callable[..., Any]) -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError("expected a batch of sequences")
        return x

    with pytest.raises(ValueError, match="expected a batch of sequences"):
        entry(Lambda(forward), torch.randn(4, 4))


@pytest.mark.parametrize("entry", [tm.estimate, tm.measure], ids=["estimate", "measure"])
def test_shape_error_of_a_real_op_propagates(entry: Callable[..., Any]) -> None:
    """The meta kernel words it differently from the CPU kernel, but it is the same
    error: the (2, 16) activation does not fit the (32, 4) layer."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(32, 4))
    with pytest.raises(RuntimeError, match=r"2.*16.*32.*4"):
        entry(model, torch.randn(2, 8))


def test_users_exception_before_any_stand_in_is_not_swallowed() -> None:
    """The user's own exception propagates even when it comes from deep in a module tree."""

    class Inner(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError("Inner.forward is abstract")

    with pytest.raises(NotImplementedError, match="abstract"):
        tm.estimate(nn.Sequential(nn.Linear(4, 4), Inner()), torch.randn(2, 4))


# -- zero tensors ---------------------------------------------------------------------------


def test_zero_tensor_gradient_costs_nothing() -> None:
    """``sgn``'s gradient is an ``_efficientzerotensor``: no memory, and no data
    pointer for measure() to read."""
    x = torch.randn(100, 100, requires_grad=True)
    model = Lambda(lambda x: torch.sgn(x) * x)
    estimated, measured = tm.estimate(model, x), tm.measure(model, x)
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.complete


# -- the real kernel's refusals, word for word ----------------------------------------------------

_REFUSED: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "int64 input to a Linear": lambda: (nn.Linear(4, 2), torch.ones(2, 4, dtype=torch.long)),
    "float32 input to a half Linear": lambda: (nn.Linear(4, 2).half(), torch.randn(2, 4)),
    "float64 input, no bias": lambda: (
        nn.Linear(4, 2, bias=False),
        torch.ones(2, 4, dtype=torch.float64),
    ),
    "float32 batch to a bf16 Linear": lambda: (nn.Linear(4, 2).bfloat16(), torch.randn(3, 2, 4)),
    "wrong in_features": lambda: (nn.Linear(4, 2), torch.randn(2, 5)),
    "wrong in_features, batched": lambda: (nn.Linear(4, 2), torch.randn(3, 2, 5)),
    "bmm of two dtypes": lambda: (
        Lambda(lambda x: torch.bmm(x, x.transpose(1, 2).double())),
        torch.randn(3, 2, 4),
    ),
    "bmm of mismatched batches": lambda: (
        Lambda(lambda x: torch.bmm(x, x[:2].transpose(1, 2))),
        torch.randn(3, 2, 4),
    ),
    "baddbmm of two dtypes": lambda: (
        Lambda(lambda x: torch.baddbmm(x[:, :, :2], x, x.transpose(1, 2)[:, :, :2].double())),
        torch.randn(3, 2, 4),
    ),
    "mv of two dtypes": lambda: (Lambda(lambda x: torch.mv(x, x[0].double())), torch.randn(4, 4)),
    "dot of two dtypes": lambda: (
        Lambda(lambda x: torch.dot(x[0], x[1].double())),
        torch.randn(2, 4),
    ),
}


def _raised(run: Callable[[], Any]) -> str:
    with pytest.raises(RuntimeError) as info:
        run()
    return str(info.value)


@pytest.mark.parametrize("case", list(_REFUSED))
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_estimate_refuses_what_the_real_kernel_refuses_with_its_message(
    case: str, device: str
) -> None:
    model, x = _REFUSED[case]()
    eager = _raised(lambda: model(x))
    assert _raised(lambda: tm.measure(model, x)) == eager
    if device == "cuda" and any(word in case for word in ("bmm", "mv", "dot")):
        # CUDA's kernels word these otherwise: the estimate raises, as a GPU would.
        _raised(lambda: tm.estimate(model, x, device=device))
        return
    assert _raised(lambda: tm.estimate(model, x, device=device)) == eager
