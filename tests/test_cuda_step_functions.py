"""The step-function families on the fake cuda device (issue 25), counted by hand.

Also: torch's own foreach choices (gradient clipping, ``AveragedModel``) as on a GPU,
and a greedy ``generate()`` of a tiny GPT-2.

No GPU is needed and none is used: each expected figure below is worked out
from the rules of CUDA's caching allocator and of the kernels the step runs,
and the estimate must equal it to the byte on every torch release (2.10 to
2.15). On the default profile (H100, compute capability 9.0):

* every tensor here is a small request (at most 1 MiB): its block is its size
  rounded up to 512 bytes. The MLP of the cpu families (``Linear(32, 64)``,
  GELU, ``Linear(64, 8)``) holds 8192 + 512 + 2048 + 512 = 11264 bytes of
  parameter blocks (``P``; biases of 256 and 32 bytes take a block each), its
  input ``x`` (16, 32) 2048 bytes, and a batch's activations are h1 = 4096
  (16 x 64 fp32), gelu(h1) 4096, y 512 (16 x 8), y.square() 512, the loss 512;
* cuBLAS takes a workspace of 32 MiB (``WS``) per handle and stream: one for
  the thread that runs the forward, one for autograd's device thread that runs
  the backward, each from its first matmul to the end of the step. The tests
  ask every release for that (``TORCH_CUBLAS_WORKSPACE_CACHE=1``: 2.15 takes it
  per call otherwise; ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``: 2.10 and 2.11 give
  the bias epilogue's cuBLASLt a 1 MiB workspace of its own otherwise); each
  release's own default is counted apart (``test_each_release_s_own_workspaces``);
* ``torch.optim`` picks foreach kernels for CUDA parameters: Adam(W) keeps
  ``exp_avg`` and ``exp_avg_sq`` (2 P) and its step counters on the host
  (``torch.tensor(0.0)``, not the GPU's), and ``_foreach_sqrt(exp_avg_sqs)`` is
  its one temporary (P); SGD with momentum clones each gradient into its buffer
  at its first step (P) and then updates in place;
* no reduction here is split across thread blocks (``setReduceConfig``: at most
  16 values per output for the bias gradients, 128 for the loss), so none takes
  a staging buffer; the in-place foreach kernels (``MultiTensorApply.cuh``) take
  nothing.

The figures are the call's: each phase's peak is the highest of its iterations
(``report.iterations``, each ``(forward, backward, step)``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_step_function import (
    Lit,
    _adamw,
    _mlp,
    accumulation,
    ema,
    gan,
    lightning_loop,
    loop_of_three,
    retained_backward,
    scheduled,
    zero_grad_kept,
)
from torch import nn
from torch.optim.swa_utils import AveragedModel

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cuda import workspaces

MiB = 1 << 20
WS = 32 * MiB  # parseChosenWorkspaceSize on compute capability 9.0: 4096 * 8 KiB
WS2 = 2 * WS  # the forward thread's and autograd's device thread's
P = 8192 + 512 + 2048 + 512  # the MLP's parameter blocks
X = 2048  # its input, (16, 32) fp32

_ENV = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "DISABLE_ADDMM_CUDA_LT",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
)


@pytest.fixture(autouse=True)
def _cached_unified_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """One cuBLAS workspace per thread, kept, shared with cuBLASLt: every release's
    behaviour when asked (see the module's docstring); the allocator's defaults."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "1")
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")


def _on_cuda(fn: Any, arguments: tuple[Any, ...]) -> tm.MemoryReport:
    report = tm.estimate(fn, arguments, device="cuda")
    assert report.unsupported == (), report.unsupported
    return report


def _peaks(report: tm.MemoryReport) -> tuple[int, int, int]:
    return report.forward_peak, report.backward_peak, report.step_peak


def _iterations(report: tm.MemoryReport) -> tuple[tuple[int, int, int], ...]:
    return tuple((it.forward, it.backward, it.step) for it in report.iterations)


def _plain() -> tuple[nn.Module, torch.Tensor, torch.optim.Optimizer]:
    model = _mlp()
    return model, torch.randn(16, 32), _adamw(model)


# -- the families ----------------------------------------------------------------------------


def test_loop_of_three_by_hand() -> None:
    """``loss = model(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad()``
    three times, AdamW.

    Iteration 1: forward P + X + h1 + WS + gelu + y + square + loss = 23040 + WS
    (13312 before it). Backward starts with h1, gelu, y and the loss (22528 + WS):
    the seed ``ones_like`` (512) and the square's gradient (512) stay, y goes (its
    last reader ran), then Linear2's ``mm``s: dh 4096, autograd's own workspace,
    dW2 2048, db2 512: 29696 + 2 WS. Step: P + X + the loss + the gradients P =
    25088, AdamW's state 2 P and its sqrt P: 58880 + 2 WS.
    Iterations 2 and 3 hold the state (2 P) and the last loss (512) from the start,
    which goes when the new loss is bound: forward 46080 + 2 WS, backward (the old
    loss gone) 22528 + 29696 = 52224 + 2 WS, step 58880 + 2 WS."""
    report = _on_cuda(loop_of_three, _plain())
    later = (46080 + WS2, 52224 + WS2, 58880 + WS2)
    assert _iterations(report) == ((23040 + WS, 29696 + WS2, 58880 + WS2), later, later)
    assert _peaks(report) == later
    assert report.breakdown[tm.Category.WORKSPACE] == WS2
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == 2 * P


def test_learning_rate_scheduler_by_hand() -> None:
    """The loop of three with ``model(x).square().mean().backward()`` (no loss kept
    after the backward) and a ``StepLR`` stepped after each ``opt.step()``, which
    allocates nothing: iteration 1 as the loop of three (23040 + WS forward, 29696
    + 2 WS backward), its step without the loss, 58880 - 512 = 58368 + 2 WS; later
    forwards 46080 - 512 = 45568 + 2 WS, backwards 52224 + 2 WS (the same tensors
    live), steps 58368 + 2 WS."""
    model, x, opt = _plain()
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    report = _on_cuda(scheduled, (model, x, opt, schedule))
    later = (45568 + WS2, 52224 + WS2, 58368 + WS2)
    assert _iterations(report) == ((23040 + WS, 29696 + WS2, 58368 + WS2), later, later)
    assert _peaks(report) == later


def test_gradient_accumulation_by_hand() -> None:
    """Four micro-batches of 4 rows (views of x), ``loss = model(micro).square().mean()
    / 4`` each, one AdamW step. A micro-batch's h1 and gelu are 1024 bytes, its y,
    square, mean and loss a 512 block each (the 4 is a wrapped number on the host).

    Micro-batch 1: forward 13312 + 1024 + WS + 1024 + 512 + 512 + 512 = 16896 + WS
    (the square goes, the loss comes, the mean goes: 16384). Backward: the seed, the
    division's and the mean's gradients and the square's (the division's goes): 17408,
    y goes, then dh 1024, the second workspace, dW2 2048, db2 512: 20480 + 2 WS; then
    Linear1: dh, y's gradient, gelu and h1 go for gelu's gradient (1024), dW1 8192
    and db1 512: 26624 + 2 WS, the backward's peak.
    Micro-batches 2 to 4 start with the gradients (P) and the last loss: 25088 + 2
    WS, forward 28672 + 2 WS; each new gradient is added into ``.grad`` and freed:
    Linear2 reaches 31744, Linear1, its dW2 and db2 gone, 35328 + 2 WS.
    The step: 25088 + 2 P (state) + P (sqrt) = 58880 + 2 WS."""
    report = _on_cuda(accumulation, _plain())
    later = (28672 + WS2, 35328 + WS2, 0)
    assert _iterations(report) == (
        (16896 + WS, 26624 + WS2, 0),
        later,
        later,
        (28672 + WS2, 35328 + WS2, 58880 + WS2),
    )
    assert _peaks(report) == (28672 + WS2, 35328 + WS2, 58880 + WS2)


def test_zero_grad_kept_and_clipping_by_hand() -> None:
    """Twice: ``model(x).square().mean().backward()``, ``clip_grad_norm_(params, 1.0)``,
    AdamW's step, ``zero_grad(set_to_none=False)``.

    Iteration 1 as the scheduler's (23040 + WS, 29696 + 2 WS, 58368 + 2 WS). The
    clipping, after the backward (13312 + P + 2 WS live), takes at most 3072: the
    four norms (512 each), their stack and the total norm; then the total, its sum
    with 1e-6, its reciprocal and the product (2048). Iteration 2 starts with the
    zeroed gradients (P) beside the state: forward 13312 + 2 P + P + 9728 = 56832 +
    2 WS, backward 56320 + 512 (seed, square's gradient; y gone) + dh 4096 + dW2
    2048 + db2 512 = 63488 + 2 WS (each added into ``.grad`` and freed), step 13312
    + 3 P + the sqrt P = 58368 + 2 WS."""
    report = _on_cuda(zero_grad_kept, _plain())
    assert _iterations(report) == (
        (23040 + WS, 29696 + WS2, 58368 + WS2),
        (56832 + WS2, 63488 + WS2, 58368 + WS2),
    )
    assert _peaks(report) == (56832 + WS2, 63488 + WS2, 58368 + WS2)


def test_retained_backward_ten_times_by_hand() -> None:
    """``y = model(x)``, ``dy = randn_like(y)``, ``y.backward(dy, retain_graph=True)``
    ten times (one iteration: no forward between the backwards).

    Forward 13312 + h1 + WS + gelu + y + dy = 22528 + WS. First backward (no seed:
    dy is given): dh 4096, the second workspace, dW2 2048, db2 512, gelu's gradient
    4096 (dh goes), dW1 8192 and db1 512: 22528 + 2048 + 512 + 8192 + 512 + 4096 =
    37888 + 2 WS. Each later one adds into the gradients (P live): 22528 + P + dh,
    dW2, db2 (which go) = 40448, then gelu's gradient (dh goes) and dW1, db1: 33792
    + 4096 + 8704 = 46592 + 2 WS, the graph and y kept throughout."""
    report = _on_cuda(retained_backward, (_mlp(), torch.randn(16, 32)))
    assert _iterations(report) == ((22528 + WS, 46592 + WS2, 0),)
    assert report.breakdown[tm.Category.GRADIENTS] == P


def test_ema_by_hand() -> None:
    """Two iterations of the scheduler's loop and ``kept.lerp_(now, 0.01)`` over an
    averaged copy of the model (P more from the start; ``lerp_`` is in place):
    every figure of the scheduler's plus P = 11264."""
    model, x, opt = _plain()
    report = _on_cuda(ema, (model, copy.deepcopy(model), x, opt))
    assert _iterations(report) == (
        (23040 + P + WS, 29696 + P + WS2, 58368 + P + WS2),
        (45568 + P + WS2, 52224 + P + WS2, 58368 + P + WS2),
    )


def test_gan_by_hand() -> None:
    """G = Linear(8, 64), ReLU, Linear(64, 32) (blocks 2048 + 512 + 8192 + 512 =
    11264); D = Linear(32, 64), LeakyReLU, Linear(64, 1) (8192 + 512 + 512 + 512 =
    9728); z 512, real 2048: 23552 before the step. Adam on each. Twice: ``fake =
    g(z)``; ``loss_d = d(real).square().mean() + d(fake.detach()).mean()``, its
    backward, D's step and ``zero_grad``; ``loss_g = -d(fake).mean()``, its backward
    (into D too), G's step and ``zero_grad``. A D pass keeps a = 4096 (its first
    Linear's output, LeakyReLU's input) and l = 4096; D's output is a 512 block.

    Loop 1, ``loss_d``: forward 23552 + WS + relu 4096 + fake 2048 + real's a, l, out,
    square, mean (9728) + fake's a, l, out, mean (9216) = 48128 + WS, then the sum
    (the means and fake's out go): 47104. Backward: fake's branch first (seed, mean's
    gradient 512, dl 4096, the second workspace, dW2 and db2 512 each, dl's LeakyReLU
    gradient, dW1 8192, db1 512), then real's; the two branches' gradients of each D
    parameter are summed out of place into new tensors (autograd's input buffer), the
    last the 8192 of W1: 56832 + 2 WS. D's step: 39936 (the loss kept) + Adam's state
    19456 + sqrt 9728 = 69120 + 2 WS. ``loss_g``: forward 49664 + a, l, out, mean =
    58880 + 2 WS; backward through D (its gradients again) into G: the peak is
    ReLU's gradient 4096 beside dWg2 8192 and dbg2: 77312 + 2 WS; G's step 67072 +
    state 22528 + sqrt 11264 = 100864 + 2 WS.
    Loop 2 starts with both states, D's gradients from ``loss_g``, fake and both
    losses: 78336 + 2 WS. ``loss_d``'s forward reaches 100864 + 2 WS (the new fake
    replaces the old); its backward sums each D parameter's two gradients as before,
    then adds the sum into ``.grad``: the last, W1's 8192 sum beside its two
    products, 107520 + 2 WS; D's step 82432 + sqrt 9728 = 92160 + 2 WS. ``loss_g``:
    72704 + 9216 = 81920 + 2 WS forward, 99840 + 2 WS backward, G's step 89600 + sqrt
    11264 = 100864 + 2 WS."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32))
    d = nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(), nn.Linear(64, 1))
    z, real = torch.randn(16, 8), torch.randn(16, 32)
    arguments = (g, d, z, real, torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters()))
    report = _on_cuda(gan, arguments)
    assert _iterations(report) == (
        (48128 + WS, 56832 + WS2, 69120 + WS2),
        (58880 + WS2, 77312 + WS2, 100864 + WS2),
        (100864 + WS2, 107520 + WS2, 92160 + WS2),
        (81920 + WS2, 99840 + WS2, 100864 + WS2),
    )
    assert _peaks(report) == (100864 + WS2, 107520 + WS2, 100864 + WS2)


def _autocast_cuda(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _gpu_grad_scaler(monkeypatch: pytest.MonkeyPatch) -> torch.amp.GradScaler:
    """``GradScaler("cuda")`` as a machine with a GPU builds it: where CUDA is not
    available torch disables it at construction (and warns)."""
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
        scaler = torch.amp.GradScaler("cuda")
    assert scaler.is_enabled()
    return scaler


def test_autocast_and_grad_scaler_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice: forward under ``autocast("cuda", float16)`` then ``.float()``, the
    scaled loss's backward, ``scaler.step(opt)`` (AdamW), ``scaler.update()``,
    ``zero_grad()``.

    Forward 1: autocast casts ``linear``'s arguments last to first (the C++ call's
    argument order), each leaf weight once, kept in its cache to the region's end:
    b1 (128 -> 512), W1 4096, x 1024; h1 fp16 2048, WS, gelu 2048; b2 (512), W2 1024,
    y fp16 (512), its fp32 copy 512 (the fp16 y goes), square, mean: 13312 + 12800
    = 26112 + WS. Leaving the region frees b1, W1 and b2's copies (W2's is saved for
    dh, x's for dW1); the scaler makes its scale and growth tracker (512 each) and
    the scaled loss (512): 22016 + WS. Backward: the seed, the scale's product, the
    mean's and square's gradients, the fp16 cast of dy (512); dh 2048, the second
    workspace, dW2 1024 and db2 (fp16), cast to fp32 for W2 and b2 (2048, 512) as
    the fp16 ones go; gelu's gradient 2048; dW1 fp16 4096, db1; the fp32 dW1 8192
    beside it: 31232 + 2 WS. ``unscale_``: the scale in double, its reciprocal, in
    float, ``found_inf`` and its per-device copy and the inverse scale's copy
    (28160 at most); the step (13312 + P + the loss, scale, tracker and the found_inf
    kept = 26624) with AdamW's state and sqrt: 60416 + 2 WS. Iteration 2 starts with
    the state, the loss, scale and tracker: 37376; forward + 12800 = 50176 + 2 WS,
    backward 44544 + 9216 = 53760 + 2 WS, step 60416 + 2 WS."""
    model, x, opt = _plain()
    report = _on_cuda(_autocast_cuda, (model, x, opt, _gpu_grad_scaler(monkeypatch)))
    assert _iterations(report) == (
        (26112 + WS, 31232 + WS2, 60416 + WS2),
        (50176 + WS2, 53760 + WS2, 60416 + WS2),
    )


def test_lightning_style_training_step_by_hand() -> None:
    """``loss = lit.training_step(batch); loss.backward(); opt.step(); opt.zero_grad()``
    over three batches (3 x 2048 of inputs: 17408 before the step), SGD with momentum
    0.9. Iteration 1: forward 17408 + 9728 + WS = 27136 + WS, backward 26624 + 512 +
    6656 = 33792 + 2 WS, step 17408 + the loss + P + the momentum buffers cloned from
    the gradients P = 40448 + 2 WS. Later: the buffers and the last loss from the
    start (29184): forward 38912 + 2 WS, backward 38400 + 6656 = 45056 + 2 WS, step
    (in place) 40448 + 2 WS."""
    module = Lit()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    report = _on_cuda(lightning_loop, (module, [torch.randn(16, 32) for _ in range(3)], opt))
    later = (38912 + WS2, 45056 + WS2, 40448 + WS2)
    assert _iterations(report) == ((27136 + WS, 33792 + WS2, 40448 + WS2), later, later)


# -- each release's own workspaces -------------------------------------------------------------

LT = 1 * MiB  # cuBLASLt's own workspace (CUBLASLT_WORKSPACE_SIZE's default, 1024 KiB)


#: The loop of three's first and later iterations under each release's own settings.
#: Cached, the bias epilogue's cuBLASLt keeping 1 MiB of its own on the forward's thread,
#: beside that thread's cuBLAS workspace (2.10 and 2.11 fetch the cuBLASLt handle with
#: it: measured on an H100 with 2.11), the backward's mm a cuBLAS workspace on autograd's:
_SEPARATE = (
    (23040 + LT + WS, 29696 + LT + WS2, 58880 + LT + WS2),
    (46080 + LT + WS2, 52224 + LT + WS2, 58880 + LT + WS2),
)
#: Cached and shared: the module's count.
_SHARED = ((23040 + WS, 29696 + WS2, 58880 + WS2), (46080 + WS2, 52224 + WS2, 58880 + WS2))
#: cuBLASLt keeping its 1 MiB; each cuBLAS gemm taking 32 MiB for its own call.
_PER_CALL = ((23040 + LT, 29184 + LT + WS, 58880 + LT), (46080 + LT, 51712 + LT + WS, 58880 + LT))


@pytest.mark.parametrize(
    ("release", "expected"),
    [
        ((2, 10), _SEPARATE),
        ((2, 11), _SEPARATE),
        ((2, 12), _SHARED),
        ((2, 13), _SHARED),
        ((2, 14), _SHARED),
        ((2, 15), _PER_CALL),
    ],
)
def test_each_release_s_own_workspaces(
    release: tuple[int, int], expected: tuple[tuple[int, int, int], ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop of three with neither workspace variable set, as each release does it
    (docs/explanation/torch-releases.md). 2.10 and 2.11: the forward's ``addmm`` with
    its bias goes through cuBLASLt's ``gemm_and_bias`` with a 1 MiB workspace (a small
    block) of its own, and its handle, fetched as the cuBLAS one, makes the thread's
    32 MiB too; the backward's ``mm``s take 32 MiB on autograd's thread as before. 2.15 (no cache): the forward keeps its 1 MiB; each backward
    ``mm`` holds 32 MiB during its call, after its output: the peak is dW2's (or dW1's:
    the same) 27136 + 2048 = 29184 + 1 MiB + 32 MiB, in later iterations 22528 (AdamW's
    state) more; no workspace is live in the step."""
    monkeypatch.delenv("TORCH_CUBLAS_WORKSPACE_CACHE")
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    monkeypatch.setattr(workspaces, "_release", lambda: release)
    first, later = expected
    assert _iterations(_on_cuda(loop_of_three, _plain())) == (first, later, later)


# -- torch's own foreach choices, as on a GPU ------------------------------------------------------


def _clipped(model: nn.Module, x: torch.Tensor, foreach: bool | None) -> None:
    model(x).sum().backward()
    with tm.phase("before"):  # the live bytes after the backward
        pass
    with tm.phase("clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)


@pytest.mark.parametrize(("foreach", "by_hand"), [(None, 2048), (True, 2048), (False, 3584)])
def test_clip_grad_norm_takes_the_gpus_foreach_kernels(foreach: bool | None, by_hand: int) -> None:
    """``clip_grad_norm_`` of one (2048, 4096) fp32 gradient (32 MiB, 128 chunks of
    65536): on a GPU its default is the foreach route (``_has_foreach_support``: a
    foreach device and plain tensors). ``_foreach_norm`` takes ``output_per_tensor``
    (128 floats: 512) and the norm (512); then the stack of the one norm and the total
    norm (512 each, the norm kept: 1536); clipping holds the total, its sum with 1e-6,
    the reciprocal and the product: 2048 above what the backward left.
    ``foreach=False``: ``linalg_vector_norm`` of 8,388,608 values splits them over
    528 blocks (132 SMs x 2048 / 512 threads; 16384 values a thread), whose partial
    sums (528 x 4 = 2112 bytes: 2560) and semaphore (4: 512) sit beside the norm:
    3584: the two routes differ here, where tests/test_fused_optimizers.py's small
    gradients give both the same peak."""
    with torch.device("meta"):
        model = nn.Linear(4096, 2048, bias=False)
    report = _on_cuda(_clipped, (model, torch.randn(1, 4096), foreach))
    assert report.phases["clip"] - report.phases["before"] == by_hand


def _averaged(model: nn.Module, average: AveragedModel, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        average.update_parameters(model)


def test_averaged_model_takes_the_gpus_foreach_update() -> None:
    """``AveragedModel(model)`` (a copy of the parameters, P, and ``n_averaged``, a 512
    block) updated after each SGD step (in place, foreach). The first update copies;
    the second, on a GPU, takes the foreach route (a device with foreach kernels):
    ``_foreach_lerp_`` by ``1 / (n_averaged + 1)`` (three 512 blocks at most), where
    the per-parameter route held W1's difference and quotient (8192 each) and
    ``n_averaged + 1``. The step's peak is SGD's, P + X + P + 512 + the gradients P =
    36352 + 2 WS; the update's at most 25088 + 1536."""
    model = _mlp()
    arguments = (model, AveragedModel(model), torch.randn(16, 32), torch.optim.SGD(model.parameters(), lr=0.1))
    report = _on_cuda(_averaged, arguments)
    later = (34816 + WS2, 41472 + WS2, 36352 + WS2)
    assert _iterations(report) == ((34816 + WS, 41472 + WS2, 36352 + WS2), later)


# -- generate() ---------------------------------------------------------------------------------


def _greedy_one_token(model: nn.Module, ids: torch.Tensor) -> Any:
    return model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)


def test_generate_greedy_by_hand() -> None:
    """``generate(input_ids, max_new_tokens=1, do_sample=False)`` of a GPT-2 of one
    layer (width 32, 2 heads, 64 tokens, 16 positions; no end token, pad token 0), one
    prompt of 4 tokens. Counted for transformers 5.24's ``generate`` and GPT-2.

    Parameters: wte 8192 (also the LM head), wpe 2048, c_attn 12288 + 512 (bias 384),
    the attention's c_proj 4096 + 512, c_fc 16384 + 512, the MLP's c_proj 16384 + 512,
    three LayerNorms 6 x 512: 64512; the prompt 512. The peak is the prefill's MLP, in
    GPT-2's tanh GELU, ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x ** 3))))``: c_fc's
    output x (4 x 128 fp32: 2048), ``0.5 * x``, ``x ** 3`` and ``0.044715 * x ** 3``
    (2048 each; the power goes once the product is made). Beside them: generate's pad
    token tensor, position ids (the all-ones attention mask is dropped),
    ``unfinished_sequences`` and the prompt's clone for the model (512 each); the two
    embeddings and their sum, the block's input (512 each); the cache's key and value
    (2 heads x 4 x 16 fp32, concatenated onto empty ones: 512 each); the attention's
    output projection, the residual sum and ln_2's output (512 each); the forward
    thread's cuBLAS workspace (c_attn's ``addmm``). The attention itself (fp32: the
    memory-efficient kernel, neither flash nor cuDNN) and the LayerNorms' statistics
    are gone by then. 65024 + 2048 + 1536 + 1024 + 1536 + 8192 = 79360 + WS.
    (The position ids are a ``cumsum`` of one row, which CUDA runs through cub's
    ``DeviceScan`` with a temporary the estimate does not model: a few hundred bytes,
    before the forward, far below the peak.)"""
    transformers = pytest.importorskip("transformers")
    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) != (5, 24):
        pytest.skip(f"counted for transformers 5.24's generate, not {transformers.__version__}: recount")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=None, eos_token_id=None
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    assert sum(-(-p.nbytes // 512) * 512 for p in model.parameters()) == 64512
    report = _on_cuda(_greedy_one_token, (model, torch.randint(1, 64, (1, 4))))
    assert _peaks(report) == (79360 + WS, 0, 0)
