"""estimate() and measure() as a user calls them: inputs, outputs, bad input, the untouched model."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from exactness import Lambda
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.values import MAX_NUMEL

F32 = 4


def _peaks(report: tm.MemoryReport) -> tuple[int, int, int]:
    return report.forward_peak, report.backward_peak, report.step_peak


def _linear() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(16, 8), torch.randn(4, 16)


# -- figures that follow from the definition, computed by hand -------------------


def test_linear_step_bytes_by_hand() -> None:
    """Linear(16, 8) on a (4, 16) batch with the default loss (sum of the output).

    Baseline: weight 512 + bias 32 + input 256 = 800 B.
    Forward: addmm output (4, 8) 128 B, then the scalar loss 4 B -> 932.
    Backward: the output is no longer referenced (the loss was taken from it and the
    step drops it), grad of loss 4 B; the grad of the output is an expand (no
    storage); grad weight 512 B comes from mm(grad.t(), input) which copies the
    stride-0 grad into a (8, 4) contiguous buffer (128 B) first; grad bias 32 B.
    """
    model, x = _linear()
    report = tm.estimate(model, x)
    baseline = 8 * 16 * F32 + 8 * F32 + 4 * 16 * F32
    assert report.forward_peak == baseline + 4 * 8 * F32 + F32
    assert report.breakdown[tm.Category.PARAMETERS] + report.breakdown[tm.Category.INPUTS] == baseline
    assert _peaks(report) == _peaks(tm.measure(model, x))


def test_views_and_inplace_allocate_nothing() -> None:
    class Views(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x @ self.w  # 64x64 float: 16384 B
            y.view(-1)[:10].add_(1.0)  # views and in-place: no new storage
            y.t()[0].sub_(y[0])
            y.mul_(2).relu_()
            return y

    model, x = Views(), torch.randn(64, 64)
    report = tm.estimate(model, x, train=False)
    # baseline 2 * 16384; the matmul output 16384; add_(1.0) wraps the number
    # in an 8-byte CPU tensor for the duration of the call, which the kernel's
    # TensorIterator casts to a 4-byte float (compute_types' input promotion).
    assert report.forward_peak == 3 * 16384 + 8 + 4
    assert _peaks(report) == _peaks(tm.measure(model, x, train=False))


def test_out_variant_and_resize() -> None:
    class OutOps(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buf = torch.empty(0)
            torch.add(x, 1.0, out=buf)  # resizes buf: one allocation of x's size
            buf.resize_(2 * x.numel())  # grows: new block, copy, old block freed
            return buf

    x = torch.randn(1000)
    report = tm.estimate(OutOps(), x, train=False)
    # x 4000 + buf 4000 (+ the 8-byte wrapped 1.0 during the add), then the
    # resize holds the old 4000 and the new 8000 at once.
    assert report.forward_peak == 4000 + 4000 + 8000
    assert _peaks(report) == _peaks(tm.measure(OutOps(), x, train=False))


def test_gradient_accumulation_across_uses_and_existing_grads() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.tanh(self.fc(x)))

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(8, 32)
    fresh = tm.estimate(model, x)
    assert _peaks(fresh) == _peaks(tm.measure(model, x))
    model(x).sum().backward()  # now .grad exists: backward accumulates in place
    accumulated = tm.estimate(model, x)
    assert accumulated.breakdown[tm.Category.GRADIENTS] >= (32 * 32 + 32) * F32
    assert _peaks(accumulated) == _peaks(tm.measure(model, x))


def test_optimizer_state_is_counted() -> None:
    model, x = _linear()
    plain = tm.estimate(model, x)
    adam = tm.estimate(model, x, optimizer=lambda p: torch.optim.Adam(p, lr=0.1))
    # exp_avg and exp_avg_sq per parameter, plus a 4-byte step tensor per parameter
    state = 2 * (8 * 16 + 8) * F32 + 2 * F32
    assert adam.breakdown[tm.Category.OPTIMIZER_STATE] == state
    assert adam.step_peak > plain.backward_peak
    assert _peaks(adam) == _peaks(tm.measure(model, x, optimizer=lambda p: torch.optim.Adam(p, lr=0.1)))


# -- inputs ---------------------------------------------------------------------


class TakesEverything(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], *, extra: dict | None = None) -> torch.Tensor:
        out = self.fc(a) + pair[0] * pair[1]
        if extra is not None:
            out = out + extra["bias"]
        return out


def test_inputs_as_tuple_dict_and_nested_containers() -> None:
    model = TakesEverything()
    a, b, c = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    positional = tm.estimate(model, (a, (b, c)))
    keyword = tm.estimate(model, {"a": a, "pair": (b, c), "extra": {"bias": torch.zeros(8)}})
    assert positional.breakdown[tm.Category.INPUTS] == 3 * 2 * 8 * F32
    assert keyword.breakdown[tm.Category.INPUTS] == 3 * 2 * 8 * F32 + 8 * F32
    assert _peaks(keyword) == _peaks(tm.measure(model, {"a": a, "pair": (b, c), "extra": {"bias": torch.zeros(8)}}))


def test_inputs_sharing_storage_count_once() -> None:
    base = torch.randn(4, 16)
    model = TakesEverything()
    report = tm.estimate(model, (base[:, :8], (base[:, 8:], base[:, 8:])))
    assert report.breakdown[tm.Category.INPUTS] == 4 * 16 * F32


# -- models on the meta device ----------------------------------------------------


class MetaFriendly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.register_buffer("scale", torch.ones(64))
        self.table = torch.zeros(64)  # a plain tensor attribute
        self.where = self.fc.weight.device  # captured at build time: meta for a meta model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[0], 64, device=self.where)  # a plain meta tensor when built on meta
        return self.fc(x) * mask * self.scale + self.table


def test_meta_model_estimates_like_the_real_one() -> None:
    torch.manual_seed(0)
    real = MetaFriendly()
    with torch.device("meta"):
        meta = MetaFriendly()
    x = torch.randn(8, 64)
    real_estimate = tm.estimate(real, x)
    meta_estimate = tm.estimate(meta, torch.empty(8, 64, device="meta"))
    assert meta_estimate.unsupported == ()
    assert _peaks(meta_estimate) == _peaks(real_estimate) == _peaks(tm.measure(real, x))
    assert meta.fc.weight.device.type == "meta" and meta.table.device.type == "meta"


def test_big_meta_model_allocates_no_real_memory() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192))  # 1.07 GB of fp32
    x = torch.empty(512, 8192, device="meta")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        report = tm.estimate(model, x, optimizer=lambda p: torch.optim.AdamW(p))
    real_allocated = sum(
        e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0
    )
    assert report.breakdown[tm.Category.PARAMETERS] == 2 * (8192 * 8192 + 8192) * F32
    assert report.step_peak > 4 * report.breakdown[tm.Category.PARAMETERS]
    assert real_allocated < 1 << 20


def test_model_with_real_parameters_is_not_copied() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048))  # 33.6 MB
    x = torch.randn(256, 2048)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tm.estimate(model, x)
    real_allocated = sum(
        e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0
    )
    assert real_allocated < 1 << 20


# -- the model is left as it was ---------------------------------------------------


def _state(model: nn.Module) -> list[object]:
    return [
        (
            name,
            id(p),
            p.data_ptr(),
            p.device,
            p.dtype,
            p.requires_grad,
            None if p.grad is None else (id(p.grad), p.grad.data_ptr(), p.grad.clone()),
            p.detach().clone(),
        )
        for name, p in list(model.named_parameters()) + list(model.named_buffers())
    ] + [model.training, dict(model._forward_hooks), dict(model._forward_pre_hooks)]


def _same(a: list[object], b: list[object]) -> bool:
    def eq(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, tuple):
            return isinstance(y, tuple) and len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y))
        return x == y

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("entry", [tm.estimate, tm.measure], ids=["estimate", "measure"])
def test_model_is_unchanged(entry) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    model(torch.randn(4, 8)).sum().backward()  # existing grads
    model.register_forward_hook(lambda *args: None)
    model.eval()
    before = _state(model)
    entry(model, torch.randn(4, 8), optimizer=lambda p: torch.optim.AdamW(p, lr=1.0))
    assert _same(before, _state(model))


def test_forward_that_raises_gives_the_users_exception_and_restores_the_model() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc(x)
            raise KeyError("the user's own bug")

    model = Broken()
    weight = model.fc.weight
    with pytest.raises(KeyError, match="the user's own bug"):
        tm.estimate(model, torch.randn(2, 4))
    assert model.fc.weight is weight and model.fc._parameters["weight"] is weight
    assert not isinstance(model.fc.weight, torch._subclasses.FakeTensor)


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": 3}, TypeError, "needs an nn.Module or a step function as model, got int"),
        ({"inputs": [torch.randn(2, 4)]}, TypeError, "pass a tuple for positional arguments"),
        ({"inputs": 3}, TypeError, "inputs must be a tensor, a tuple .* got int"),
        ({"inputs": {1: torch.randn(2, 4)}}, TypeError, "string keys"),
        ({"device": "tpu"}, ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        ({"device": "cuda:x"}, ValueError, "got 'cuda:x'"),
        ({"device": 0}, TypeError, "device must be"),
        ({"loss_fn": lambda out: out}, ValueError, r"scalar tensor, got one of shape \(2, 4\)"),
        ({"loss_fn": lambda out: 1.0}, TypeError, "must return a scalar tensor, got float"),
        ({"loss_fn": "sum"}, TypeError, "loss_fn must be callable"),
        ({"optimizer": lambda p: None}, TypeError, "returns a torch.optim.Optimizer"),
        ({"train": "yes"}, TypeError, "train must be True or False"),
    ],
)
@pytest.mark.parametrize("entry", [tm.estimate, tm.measure], ids=["estimate", "measure"])
def test_bad_input_is_named(entry, kwargs, error, match) -> None:  # type: ignore[no-untyped-def]
    call = {"model": nn.Linear(4, 4), "inputs": torch.randn(2, 4), **kwargs}
    with pytest.raises(error, match=match):
        entry(call.pop("model"), call.pop("inputs"), **call)


def test_loss_that_needs_no_grad_is_named() -> None:
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="does not require grad"):
        tm.estimate(model, torch.randn(2, 4))


def test_measure_refuses_meta_models() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="use estimate"):
        tm.measure(model, torch.randn(2, 4))


# -- ops fake tensors cannot run -----------------------------------------------------


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        picked = h[h > 0]  # nonzero: size depends on values
        if h.mean().item() > 100:  # a Python value of a tensor
            picked = picked * 2
        return picked


def test_value_dependent_ops_are_reported_not_raised() -> None:
    """Built on the meta device, the layer's values are not known: neither are ``h``'s."""
    with torch.device("meta"):
        model = DataDependent()
    report = tm.estimate(model, torch.randn(4, 8))
    where = {entry.op: entry.location for entry in report.unsupported}
    assert where == {
        "aten.index.Tensor": f"{__file__}:{_line_of('picked = h[h > 0]')}",
        "aten._local_scalar_dense.default": f"{__file__}:{_line_of('.item() > 100')}",
    }
    assert not report.complete
    # the largest possible selection was assumed: the estimate is an upper bound
    assert report.forward_peak >= tm.measure(DataDependent(), torch.randn(4, 8)).forward_peak


def test_value_dependent_ops_on_known_values_are_exact() -> None:
    """With real parameters and inputs the trace knows ``h``'s values (values.py)."""
    torch.manual_seed(0)
    model, x = DataDependent(), torch.randn(4, 8)
    report = tm.estimate(model, x)
    assert report.complete
    assert report.phase_peaks() == tm.measure(model, x).phase_peaks()


def _line_of(text: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, 1):
            if text in line and "_line_of" not in line:
                return number
    raise AssertionError(text)


def test_op_without_fake_kernel_stops_the_trace_with_a_report() -> None:
    class Sparse(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.bincount(x)  # output length depends on the largest value

    # above the values' limit (values.py): bincount cannot run on its values either
    with pytest.raises(tm.TraceStopped) as info:
        tm.estimate(Sparse(), torch.randint(0, 4, (MAX_NUMEL + 1,)), train=False)
    report = info.value.report
    assert [entry.op for entry in report.unsupported] == ["aten.bincount.default"]
    assert "the trace stopped here" in report.unsupported[0].reason
    assert "output depends on tensor values (DynamicOutputShapeException)" in str(info.value)


def test_op_without_fake_kernel_runs_on_known_values_and_is_listed() -> None:
    """On known values its outputs are exact; its kernel's own buffers, which no rule
    follows (bincount's on cuda: the cpu's are modelled), are not: listed, and the trace
    goes on."""

    class Sparse(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.bincount(x) * 2

    report = tm.estimate(Sparse(), torch.tensor([1, 2, 3]), device="cuda", train=False)
    assert [entry.op for entry in report.unsupported] == ["aten.bincount.default"]
    assert "not modelled" in report.unsupported[0].reason
    # the input, bincount's 4 int64 bins, then * 2 (cuda wraps no number): a 512 B block each
    assert report.forward_peak == 3 * 512
    on_cpu = tm.estimate(Sparse(), torch.tensor([1, 2, 3]), train=False)
    assert on_cpu.unsupported == ()
    # the input, bincount's 4 int64 bins, then * 2: its wrapped 2 and its output
    assert on_cpu.forward_peak == 3 * 8 + 4 * 8 + 8 + 4 * 8


# -- the report ------------------------------------------------------------------------


def test_report_json_round_trip() -> None:
    model, x = _linear()
    report = tm.estimate(model, x, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    text = report.to_json()
    assert json.loads(text)["peak"] == report.peak
    again = tm.MemoryReport.from_json(text)
    assert again == report
    assert list(again.breakdown) == list(tm.Category)
    assert again.modules["(model)"] == report.modules["(model)"]
    assert again.first_step == report.first_step is not None
    # a report written before the training loop (schema 1) reads as one with no first step
    old = json.loads(text)
    old.update(schema=1, peak=report.step_peak)
    del old["first_step"]
    assert tm.MemoryReport.from_dict(old).first_step is None


def test_a_report_pickles() -> None:
    # (its mappings are read-only proxies: it travels as its dict, to another process too)
    model, x = _linear()
    report = tm.estimate(model, x, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    again = pickle.loads(pickle.dumps(report))
    assert again == report and again.modules == report.modules and again.first_step == report.first_step
    assert isinstance(again.breakdown, type(report.breakdown))


def test_a_training_step_runs_as_a_loop_whose_first_step_is_beside_it() -> None:
    """SGD with momentum: the momentum buffers (one per parameter) are made by the first
    step and alive through the loop's forward and backward; without an optimizer the step
    runs once."""
    model, x = _linear()
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    report = tm.estimate(model, x, optimizer=sgd)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.first_step is not None
    assert report.forward_peak - report.first_step.forward == params
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == params
    assert report.peak == max(report.phase_peaks().values())
    assert report.phase_peaks()["first_step"] == report.first_step.peak
    measured = tm.measure(model, x, optimizer=sgd)
    assert (measured.phase_peaks(), measured.first_step) == (report.phase_peaks(), report.first_step)
    assert measured.breakdown == report.breakdown
    assert tm.estimate(model, x).first_step is None


def test_module_peaks_cover_forward_and_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    report = tm.estimate(model, torch.randn(8, 16))
    assert set(report.modules) == {"(model)", "0", "1", "2"}
    root = report.modules["(model)"]
    assert root.forward == max(m.forward for m in report.modules.values())
    assert all(0 < m.backward <= report.backward_peak for m in report.modules.values())
    measured = tm.measure(model, torch.randn(8, 16))
    assert measured.modules == report.modules


def test_unused_report_fields_default() -> None:
    report = tm.MemoryReport(device="cpu", forward_peak=10)
    assert report.peak == 10 and report.reserved_peak is None and report.complete
    assert sum(report.breakdown.values()) == 0


def test_functional_dropout_and_loss_inside_model() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.fc(F.dropout(x, 0.2, self.training))
            return {"logits": logits, "loss": F.cross_entropy(logits, target)}

    torch.manual_seed(0)
    model, inputs = WithLoss(), (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    assert _peaks(tm.estimate(model, inputs)) == _peaks(tm.measure(model, inputs))


def test_boolean_mask_selecting_everything_is_exact() -> None:
    """The upper bound assumed for ``x[mask]`` (a mask above the values' limit) is
    reached when the mask is all true."""

    class SelectAll(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > -1e9] * 2

    x = torch.randn(64, MAX_NUMEL // 64 + 1)
    estimated = tm.estimate(SelectAll(), x, train=False)
    assert [entry.op for entry in estimated.unsupported] == ["aten.index.Tensor"]
    assert _peaks(estimated) == _peaks(tm.measure(SelectAll(), x, train=False))


class _TwoProducts(nn.Module):
    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.shared = shared
        self.w1 = nn.Parameter(torch.randn(256, 256))
        self.w2 = nn.Parameter(torch.randn(256, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared:  # AddBackward hands one gradient to both uses of x
            return ((x * self.w1 + x) * self.w2).sum()
        return (x * self.w1).sum() + (x * self.w2).sum()


@pytest.mark.parametrize("shared", [False, True], ids=["private-grads", "shared-grad"])
def test_input_buffer_accumulation_matches_the_engine(shared: bool) -> None:
    """Autograd sums x's two gradients in place when it holds the only reference to
    the first (``InputBuffer::accumulate``), else out of place. Fake tensors always
    take the out-of-place branch; the tracker redoes the engine's choice. Without
    it the private-grads case is one 256 KiB gradient too high in backward."""
    torch.manual_seed(0)
    model, x = _TwoProducts(shared), torch.randn(256, 256, requires_grad=True)
    estimated, measured = tm.estimate(model, x), tm.measure(model, x)
    assert _peaks(estimated) == _peaks(measured)
    if not shared:
        # At most seven 256 KiB tensors live at once: x, w1, w2, their two
        # gradients, and x's two partial gradients while they are summed into the
        # first; an out-of-place sum would make an eighth.
        assert estimated.backward_peak < 8 * 256 * 256 * F32


def test_a_backward_formulas_own_add_stays_out_of_place() -> None:
    """``var_mean_backward`` (``FunctionsManual.cpp``) returns ``gself + aux``: an ``add``
    inside the node's ``apply``, with the use counts of the input buffer's in-place
    sum, but always out of place. x (64, 64) float32, loss = var + mean: at the sum,
    x, the var gradient (``x - mean`` is freed by then), the mean gradient and their
    sum are live, four 16 KiB tensors and two 4-byte ones (65544 B, as measured); in
    place, one 16 KiB tensor fewer."""
    x = torch.randn(64, 64, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x)
        return var + mean

    model = Lambda(fn)
    estimated, measured = tm.estimate(model, x), tm.measure(model, x)
    assert _peaks(estimated) == _peaks(measured)
    assert estimated.backward_peak == 4 * 64 * 64 * F32 + 2 * F32
    # An engine sum under the same node after its apply is still in place:
    # i1e's formula adds, then its two uses of x are summed by the engine.
    model = Lambda(lambda x: torch.special.i1e(x) * x)
    assert _peaks(tm.estimate(model, x)) == _peaks(tm.measure(model, x))


def test_an_expanded_input_is_copied_as_a_view_of_its_storage() -> None:
    """Regression: an input made with ``expand`` (one row repeated four times) spans its
    5-float storage but stores elements twice; ``measure`` copied it into a tensor of
    its strides (zero-stride ``copy_`` raises). It is now a view of a copy of its
    storage, in both the estimate and the measurement (20 bytes of inputs)."""
    x = torch.ones(1, 5).expand(4, 5)
    model = torch.nn.Linear(5, 3)
    estimated, measured = tm.estimate(model, x), tm.measure(model, x)
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.breakdown[tm.Category.INPUTS] == measured.breakdown[tm.Category.INPUTS] == 20


# -- the tracer's short cuts give what the long way gives ----------------------------


class _Seen(TorchDispatchMode):
    """A user's dispatch mode that lets every op through and remembers its name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_users_dispatch_mode_still_sees_the_steps_ops(device: str) -> None:
    """The tracer runs an op's fake kernel by calling the fake mode itself only when
    no other dispatch mode sits between them; under a user's mode (entered before
    ``estimate``) the ops go the dispatcher's way, through that mode, and every
    figure is the same."""
    model, x = _linear()
    plain = tm.estimate(model, x, device=device)
    with _Seen() as seen:
        observed = tm.estimate(model, x, device=device)
    assert {"aten.addmm.default", "aten.mm.default"} <= seen.ops
    assert observed.to_json() == plain.to_json()


@pytest.mark.parametrize("where", ["cpu", "meta"])
def test_stand_ins_are_what_the_fake_mode_makes(where: str) -> None:
    """A model's stand-ins are built as the fake mode builds a factory's output, without
    its dispatch: the same tensor, attribute for attribute, as ``empty_strided``
    under the mode, on the fake cpu device and on the fake cuda device's meta."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pytest_torchmem.engine.tracing.trace import fake_empty

    def attributes(t: torch.Tensor) -> tuple[object, ...]:
        return (
            type(t), t.fake_device, tuple(t.shape), t.stride(), t.dtype, t.storage_offset(),
            t.untyped_storage().nbytes(), t.requires_grad, t.is_leaf, t._version, t._is_view(),
            str(torch._C._dispatch_keys(t)), sorted(vars(t)), t.constant, t.fake_mode,
        )

    originals = [
        torch.empty(3, 4), torch.empty(3, 4).t(), torch.empty(0, 5), torch.empty((), dtype=torch.int64),
        torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.empty(7, dtype=torch.bfloat16),
        torch.empty(10).as_strided((3,), (3,)), torch.empty(5, dtype=torch.bool),
    ]
    mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    device = torch.device(where)
    with mode:
        for t in originals:
            made = fake_empty(mode, t.shape, t.stride(), t.dtype, device)
            expected = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            assert attributes(made) == attributes(expected), (tuple(t.shape), t.stride(), t.dtype)


def test_a_lazy_module_not_yet_run_is_refused_with_the_fix() -> None:
    """``nn.LazyLinear`` makes its parameters at its first forward: before it, the
    check names the parameter and says to run the model once (it was torch's
    ``UninitializedParameter`` error from inside the conversion); after it, exact."""
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    for check in (tm.estimate, tm.measure):
        with pytest.raises(ValueError, match=r"parameter 0\.weight \(LazyLinear\) is not initialized yet.*model\(batch\)"):
            check(model, torch.randn(2, 3))
    model(torch.randn(2, 3))
    assert tm.estimate(model, torch.randn(2, 3)).phase_peaks() == tm.measure(model, torch.randn(2, 3)).phase_peaks()


def test_the_request_carries_its_device_the_profile_resolved_once_and_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """One object goes down from each entry point (issue 58): the request holds the device
    (a ModelledDevice, its predicates in place of names compared), the GPU or CPU profile
    resolved once, and parallel= with the rank traced."""
    from pytest_torchmem.engine import api
    from pytest_torchmem.engine.figures import gpu_profiles
    from pytest_torchmem.engine.figures.modelled_device import ModelledDevice, device_kind
    from pytest_torchmem.engine.step.request import step_request
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile

    model, x = nn.Linear(2, 2), torch.randn(1, 2)
    parallel = tm.Parallel({"dp": 2}, lambda m, mesh: m, rank=1)
    request = step_request("estimate", model, x, "cuda:1", None, None, True, parallel=parallel)
    assert request.device == ModelledDevice("cuda") and request.device.is_cuda and not request.device.is_cpu
    assert (request.parallel, request.rank) == (parallel, 1)
    on_a100 = api.with_profiles(request, "A100-40GB", None)
    assert on_a100.device.gpu == gpu_profiles.gpu_profile("A100-40GB") and on_a100.device.profile == on_a100.device.gpu
    on_cpu = api.with_profiles(step_request("estimate", model, x, "cpu", None, None, True), None, "avx2:4")
    assert on_cpu.device == ModelledDevice("cpu", cpu=CpuProfile("avx2", 4)) and on_cpu.rank == 0
    with pytest.raises(ValueError, match="applies to device='cuda' only"):
        ModelledDevice("cpu", gpu=gpu_profiles.gpu_profile("H100"))
    assert device_kind("cuda:3") == "cuda"
    # the GPU profile is resolved once per estimate, by the entry point: every module's name
    # for the resolver counted
    import sys

    calls: list[object] = []
    resolve = gpu_profiles.gpu_profile

    def counted(value: object, custom: object = None) -> object:
        calls.append(value)
        return resolve(value, custom)  # type: ignore[arg-type]

    for name, module in list(sys.modules.items()):
        if name.startswith("pytest_torchmem") and getattr(module, "gpu_profile", None) is resolve:
            monkeypatch.setattr(module, "gpu_profile", counted)
    assert tm.estimate(nn.Linear(4, 4), torch.randn(2, 4), device="cuda", gpu="L4").profile == "L4"
    assert calls == ["L4"]


# -- the garbage collector -------------------------------------------------------


def test_the_trace_keeps_older_objects_out_of_the_collectors_passes() -> None:
    """While the step is traced, the objects that lived before it are frozen out of the
    collector's passes (a full pass over a large process takes a tenth of a second or
    more); a cycle the step itself makes is still collected; afterwards nothing is
    frozen, as before."""
    import gc

    model, x = _linear()
    before = len(gc.get_objects())

    def step(x: torch.Tensor) -> None:
        # (the step's own assertions: the step's world is put back after the call, and
        # an error of the program's propagates as it is)
        assert gc.get_freeze_count() >= before
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
        model(x).sum().backward()

    assert gc.get_freeze_count() == 0
    tm.estimate(step, (x,))
    assert gc.get_freeze_count() == 0
    with pytest.raises(AssertionError):
        step(x)  # (the same step, run for real: nothing frozen)


def test_objects_the_process_froze_itself_stay_frozen() -> None:
    """A process that froze its objects (before forking workers, say) finds them frozen
    after an estimate, and nothing more frozen."""
    import gc

    model, x = _linear()
    mine: list[object] = [object()]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        tm.estimate(model, x)
        assert not any(obj is mine for obj in gc.get_objects())  # (still frozen: out of its lists)
        assert gc.get_freeze_count() <= frozen  # (a frozen object that died leaves the count)
    finally:
        gc.unfreeze()
