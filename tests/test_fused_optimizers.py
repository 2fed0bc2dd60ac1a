"""Fused and foreach optimizers and gradient clipping on the fake devices (issue 27, item 5).

On the fake cuda device torch's own optimizer and clipping code decides by
device type (``fused=True`` is refused off its supported devices, foreach is
the default on cuda, ``clip_grad_norm_(foreach=True)`` refuses devices
without foreach kernels): it decides as on the GPU, and the fused kernels are
charged as the CUDA kernels run (they allocate nothing). Expected bytes are
counted by hand (cuda: the caching allocator's blocks, under 512 B a 512-B
block, else rounded up to 512 B) or measured (``tm.measure`` on cpu).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import installed_release

RELEASE = installed_release()[:2]


class Scale(nn.Module):
    """Two parameters of 1000 and 300 floats (4000 B: a 4096-B block; 1200 B: 1536 B)
    and no matrix product (no cuBLAS workspace): ``(x * w).sum() + b.sum()``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1000))
        self.b = nn.Parameter(torch.randn(300))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum() + self.b.sum()


W, B, X, SCALAR = 4096, 1536, 4096, 512  # the blocks of w, b, an input of 1000 floats, a scalar
#: exp_avg and exp_avg_sq per parameter, and a float32 step counter on the device per
#: parameter (fused: ``torch.zeros((), dtype=float32, device=p.device)``, Adam._init_group)
ADAMW_STATE = 2 * (W + B) + 2 * SCALAR


def adamw_fused(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


# -- the fused AdamW step on cuda, counted by hand ------------------------------------------


def test_fused_adamw_on_cuda_is_the_hand_count() -> None:
    """Regression: ``AdamW(fused=True)`` (transformers' ``adamw_torch_fused``) raised
    "`fused=True` requires all the params to be floating point Tensors of supported
    devices ... but torch.float32 and meta" on the fake cuda device.

    Counted by hand. Before the step function runs: w, b and x (4096 + 1536 + 4096).
    Forward: ``x * w`` (4096), its sum (512) while the product lives; then ``b.sum()``
    and the sum of the two (512 each), the loss. Backward, from params + x + the loss:
    autograd's grad of the loss (512, viewed by both branches' expands), ``grad * x``
    stolen as w.grad (4096), and b.grad cloned from its expanded grad (1536), all
    alive at once. Step: params + x + loss + grads + the state the first step makes
    (exp_avg, exp_avg_sq and a float32 step per parameter, on the device: fused); the
    CUDA kernels (``_foreach_add_`` of the steps, ``_fused_adamw_``) allocate
    nothing. The loop's second iteration starts with the state, grads None."""
    report = tm.estimate(Scale(), torch.randn(1000), device="cuda", optimizer=adamw_fused)
    start = W + B + X
    forward = start + X + SCALAR
    backward = start + SCALAR + SCALAR + W + B
    step = start + SCALAR + (W + B) + ADAMW_STATE
    assert report.first_step == tm.StepPeaks(forward=forward, backward=backward, step=step)
    assert (report.forward_peak, report.backward_peak, report.step_peak) == (
        forward + ADAMW_STATE,
        backward + ADAMW_STATE,
        step,
    )
    assert report.peak == backward + ADAMW_STATE == 28672
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == ADAMW_STATE
    assert report.unsupported == ()


def test_fused_adamw_keeps_its_step_counters_on_the_gpu_unlike_foreach() -> None:
    """The same step with the default AdamW (foreach on cuda): the step counters are
    host tensors (``torch.tensor(0.0)``), not charged; the state on the GPU is
    exp_avg and exp_avg_sq only."""
    report = tm.estimate(Scale(), torch.randn(1000), device="cuda", optimizer=lambda p: torch.optim.AdamW(p))
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == 2 * (W + B)


# -- every fused optimizer, on both devices -----------------------------------------------------


FUSED: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, fused=True),
    "adamw": adamw_fused,
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, fused=True, amsgrad=True),
    "adamw-tensor-lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-3), fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, fused=True),
}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizers_step_on_cuda(name: str) -> None:
    """Each fused optimizer steps on the fake cuda device, with its state on the GPU;
    ``_fused_sgd_``, ``_fused_adagrad_`` and the tensor-``lr`` overloads of Adam/AdamW
    have no meta kernel and used to stop the trace. Adagrad's fused kernel has no
    CUDA version before torch 2.12 (``_device_dtype_check_for_fused(p,
    cuda_unsupported=True)``): there the estimate raises what the GPU's step raises."""
    if name == "adagrad" and RELEASE < (2, 12):
        with pytest.raises(RuntimeError, match="`fused=True` requires all the params"):
            tm.estimate(Scale(), torch.randn(1000), device="cuda", optimizer=FUSED[name])
        return
    report = tm.estimate(Scale(), torch.randn(1000), device="cuda", optimizer=FUSED[name])
    assert report.unsupported == ()
    per_parameter = {
        "adam": 2, "adamw": 2, "adamw-tensor-lr": 2, "adamw-amsgrad": 3, "sgd": 0, "sgd-momentum": 1, "adagrad": 1,
    }[name]
    steps = 0 if name.startswith("sgd") else 2 * SCALAR  # float32 step counters on the device
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == per_parameter * (W + B) + steps


@pytest.mark.parametrize("name", ["adamw", "adamw-amsgrad", "sgd-momentum"])
def test_fused_optimizers_on_cpu_equal_measure(name: str) -> None:
    """On cpu the fused kernels allocate nothing either: the estimate is what
    ``measure`` reads from the CPU allocator, phase by phase, first step and loop."""
    model, x = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8)), torch.randn(16, 64)
    estimated = tm.estimate(model, x, optimizer=FUSED[name])
    measured = tm.measure(model, x, optimizer=FUSED[name])
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.first_step == measured.first_step


# -- torch's own decisions ------------------------------------------------------------------


@contextmanager
def implementations_run(module: str, name: str) -> Iterator[list[str]]:
    """Which of ``module``'s single-tensor, foreach and fused implementations of
    ``name``'s step ran (torch/optim: ``_single_tensor_<name>``,
    ``_multi_tensor_<name>``, ``_fused_<name>``)."""
    module = importlib.import_module(module)
    ran: list[str] = []
    kinds = {"single": f"_single_tensor_{name}", "foreach": f"_multi_tensor_{name}", "fused": f"_fused_{name}"}
    with ExitStack() as stack:
        for kind, attr in kinds.items():
            real = getattr(module, attr, None)
            if real is None:
                continue

            def record(*args: Any, _real: Any = real, _kind: str = kind, **kwargs: Any) -> Any:
                ran.append(_kind)
                return _real(*args, **kwargs)

            stack.enter_context(mock.patch.object(module, attr, record))
        yield ran


@pytest.mark.parametrize(
    ("factory", "module", "name", "expected"),
    [
        (lambda p: torch.optim.Adam(p), "torch.optim.adam", "adam", "foreach"),
        (lambda p: torch.optim.AdamW(p), "torch.optim.adam", "adam", "foreach"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "torch.optim.sgd", "sgd", "foreach"),
        (lambda p: torch.optim.RMSprop(p), "torch.optim.rmsprop", "rmsprop", "foreach"),
        (lambda p: torch.optim.Adagrad(p), "torch.optim.adagrad", "adagrad", "foreach"),
        (lambda p: torch.optim.Adam(p, foreach=False), "torch.optim.adam", "adam", "single"),
        # a tensor lr without capturable keeps Adam off foreach
        (lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-3)), "torch.optim.adam", "adam", "single"),
        (lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-3), capturable=True), "torch.optim.adam", "adam", "foreach"),
        (lambda p: torch.optim.Adam(p, fused=True), "torch.optim.adam", "adam", "fused"),
        (lambda p: torch.optim.SGD(p, lr=0.1, fused=True), "torch.optim.sgd", "sgd", "fused"),
    ],
    ids=[
        "adam", "adamw", "sgd-momentum", "rmsprop", "adagrad", "adam-foreach-false", "adam-tensor-lr",
        "adam-tensor-lr-capturable", "adam-fused", "sgd-fused",
    ],
)
def test_torch_picks_the_implementation_a_gpu_would(factory: Any, module: str, name: str, expected: str) -> None:
    """torch/optim's own defaults (``_default_to_fused_or_foreach``, each optimizer's
    condition for asking it) decide on the stand-ins as on cuda parameters: foreach
    unless the user says otherwise (a tensor ``lr`` without ``capturable`` keeps Adam
    off it). Before, a copy of each optimizer's condition set ``foreach=True`` on the
    trace's optimizer groups."""
    with implementations_run(module, name) as ran:
        tm.estimate(Scale(), torch.randn(1000), device="cuda", optimizer=factory)
    assert ran and set(ran) == {expected}


def test_capturable_adam_steps_on_cuda() -> None:
    """``Adam(capturable=True)`` asserts its parameters and step counters are on a
    capturable device (``_get_capturable_supported_devices``): on the fake cuda
    device they are, and the counters are on the GPU."""
    capturable = lambda p: torch.optim.Adam(p, capturable=True)  # noqa: E731
    report = tm.estimate(Scale(), torch.randn(1000), device="cuda", optimizer=capturable)
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == ADAMW_STATE


# -- gradient clipping ---------------------------------------------------------------------------


def clipped_step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, foreach: bool | None) -> None:
    """A Trainer-like step: forward, backward, ``clip_grad_norm_`` (its own phase),
    the optimizer step and ``zero_grad``."""
    loss = model(x)
    loss.backward()
    with tm.phase("clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize(
    ("foreach", "uses_foreach"), [(True, True), (None, True), (False, False)], ids=["foreach", "default", "loop"]
)
def test_clipping_on_cuda_is_the_hand_count(foreach: bool | None, uses_foreach: bool) -> None:
    """Regression: ``clip_grad_norm_(params, 1.0, foreach=True)`` raised "foreach=True
    was passed, but can't use the foreach API on meta tensors" on the fake cuda device
    (torch's C++ grouping sees the stand-ins' meta device). On cuda the default is
    foreach too (``_has_foreach_support``: a cuda device, plain tensors).

    Counted by hand (torch/nn/utils/clip_grad.py), from what lives after backward (w,
    b, x, the loss, w.grad, b.grad). ``_get_total_norm``: ``_foreach_norm`` of the two
    gradients takes ``output_per_tensor`` (ForeachReduceOp.cu: 2 tensors x 1 chunk
    x 4 B, a 512-B block) before its two norms (512 each), then frees it (the loop
    path: one ``vector_norm`` per gradient, no scratch at this size); ``stack`` of
    the norms (512) and its ``vector_norm`` (512): four scalars, the peak; the norms
    and the stack die with the function. ``_clip_grads_with_norm_``: ``total + 1e-6``,
    ``max_norm / that`` and the ``clamp`` (512 each) never hold more than three
    scalars; ``_foreach_mul_`` (or ``mul_``) scales in place."""
    model, x = Scale(), torch.randn(1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the clip's peak is its own
    with mock.patch.object(torch, "_foreach_norm", wraps=torch._foreach_norm) as foreach_norm:
        report = tm.estimate(clipped_step, (model, x, opt, foreach), device="cuda")
    assert foreach_norm.called is uses_foreach
    after_backward = W + B + X + SCALAR + W + B
    assert report.phases["clip"] == after_backward + 4 * SCALAR == 17920
    assert report.unsupported == ()


@pytest.mark.parametrize("foreach", [True, None, False], ids=["foreach", "default", "loop"])
def test_clipping_with_fused_adamw_on_cpu_equals_measure(foreach: bool | None) -> None:
    """transformers' Trainer on the CPU: ``AdamW(fused=True)`` and ``clip_grad_norm_``;
    the estimate is what ``measure`` reads, the clip's own peak included."""
    model, x = Scale(), torch.randn(1000)
    opt = adamw_fused(model.parameters())
    estimated = tm.estimate(clipped_step, (model, x, opt, foreach))
    measured = tm.measure(clipped_step, (model, x, opt, foreach))
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.phases == measured.phases


def test_a_trainer_like_step_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TrainingArguments``' defaults on a GPU: ``adamw_torch_fused`` and
    ``max_grad_norm=1.0`` (``clip_grad_norm_``, foreach by default on cuda), on a
    model with matrix products, the optimizer made outside the step function: the
    step runs as on the GPU, the state (with the step counters) on the device.
    (Cached cuBLAS workspaces, as torch 2.15 keeps them only when asked: the peak is
    then the loop's, where the state is.)"""
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "1")
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0, fused=True)

    def train_step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        loss = model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    report = tm.estimate(train_step, (model, torch.randn(32, 64), opt), device="cuda")
    assert report.unsupported == ()
    weights = 64 * 128 * 4 * 2  # two 32768-B weights (multiples of 512)
    biases = 512 + 512  # 128 and 64 floats: 512 B and 256 B, one block each
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == 2 * (weights + biases) + 4 * SCALAR
    assert opt.state == {}  # the user's optimizer is untouched


@pytest.mark.parametrize("unscaled", [False, True], ids=["scaled", "unscaled-and-clipped"])
def test_grad_scaler_hands_the_fused_step_its_scale_on_cuda(unscaled: bool) -> None:
    """``GradScaler("cuda")`` made in the step is enabled on the fake cuda device, as on
    a GPU (a CPU-only torch disables it elsewhere); its ``unscale_`` groups the
    gradients by the device torch's code sees, and ``step`` hands a fused optimizer
    (``_step_supports_amp_scaling``) ``found_inf`` and, unless ``unscale_`` ran,
    ``grad_scale``, which ``_fused_adamw_`` takes on the parameters' device."""
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    # (a mock records what the step saw: a list it appended to would be put back as it was)
    enabled = mock.Mock()

    def train_step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        scaler = torch.amp.GradScaler("cuda")
        enabled(scaler.is_enabled())
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if unscaled:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    with mock.patch.object(torch, "_fused_adamw_", wraps=torch._fused_adamw_) as fused:
        report = tm.estimate(train_step, (model, torch.randn(32, 64), opt), device="cuda")
    assert enabled.call_args_list == [mock.call(True)] and report.unsupported == ()
    kwargs = fused.call_args.kwargs
    assert isinstance(kwargs["found_inf"], torch.Tensor)
    assert (kwargs["grad_scale"] is None) is unscaled
