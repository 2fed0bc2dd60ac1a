"""Compiled models on the fake cuda device: inductor's cuda program, built without a GPU (issue 11).

The estimate runs the program inductor's cuda backend writes (triton's fusion,
the wrapper's buffer reuse, aten's extern kernels), built on a CPU-only torch
with no kernel compiled, each buffer charged through the caching-allocator
model. There is no GPU to measure here: the figures are checked by hand on a
small model, against the eager estimate, and by what the report lists.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.compiled_cuda import (
    AUTOTUNE_GAP,
    CUDA_GRAPHS_GAP,
    PAD_MM_GAP,
)
from pytest_torchmem.engine.tracing.devices import device_model
from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.engine.tracing.trace import trace
from compiled_zoo import FAMILIES
from following import follows_compiled
from compiled_zoo import Attention as _Attention
from compiled_zoo import Fusable as _Fusable
from test_compiled import _block, _CallsCompiledFunction, _scaled_gelu, _where

KiB = 1024
MiB = 1024 * KiB
#: One small-pool segment of the caching allocator (``kSmallBuffer``).
SMALL_SEGMENT = 2 * MiB


class _Regional(nn.Module):
    """Regional compilation: each repeated block compiled on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_block() for _ in range(2))
        for block in self.blocks:
            block.compile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _compiled(kind: str) -> tuple[nn.Module, str, str]:
    """A compiled model, the region's name and where it is defined."""
    sequential = f"{nn.Sequential.forward.__code__.co_filename}:"
    sequential += str(nn.Sequential.forward.__code__.co_firstlineno)
    if kind == "torch.compile(model)":
        return torch.compile(_block()), "Sequential.forward", sequential
    if kind == "model.compile()":
        model = _block()
        model.compile()
        return model, "Sequential.forward", sequential
    if kind == "compiled function in forward":
        return _CallsCompiledFunction(), "_scaled_gelu", _where(_scaled_gelu)
    return _Regional(), "Sequential.forward", sequential


KINDS = ["torch.compile(model)", "model.compile()", "compiled function in forward", "regional"]


class _SinSum(nn.Module):
    """``sin(x * w).sum()``: one fused kernel forward, one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * self.w).sum()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out


@follows_compiled
def test_a_compiled_program_checked_by_hand() -> None:
    """``sin(x * w).sum()`` over 1024 fp32 values (4 KiB each for x and w).

    The joint graph is ``mul, sin, sum`` forward and ``cos(mul) * x * grad`` for
    w's gradient. The min-cut partitioner saves the primals rather than ``mul``:
    a parameter is free to save (``treat_parameters_as_free_to_save``) and x
    costs its 4 KiB, while ``mul``, fusible into all its users, is charged
    twice its size. Inductor fuses the forward into one persistent reduction
    (1024 values: below 8192, no split) writing one fp32 scalar, and the
    backward into one pointwise kernel writing w's gradient. Each block is
    rounded to 512 bytes: the scalar costs 512.

    forward: w 4096 + x 4096 + the loss 512 = 8704
    backward: 8704 + autograd's ones for the loss 512 + w's gradient 4096 = 13312
    reserved: all in one 2 MiB small-pool segment
    """
    torch.manual_seed(0)
    model, x = _SinSum(), torch.randn(1024)
    report = tm.estimate(torch.compile(model), x, device="cuda", loss_fn=_loss)
    assert report.unsupported == ()
    assert (report.forward_peak, report.backward_peak) == (8704, 13312)
    assert report.reserved_peak == SMALL_SEGMENT
    # eagerly mul and sin each make a 4 KiB tensor, and SinBackward saves mul
    eager = tm.estimate(model, x, device="cuda", loss_fn=_loss)
    assert eager.forward_peak >= 8704 + 2 * 4096


class _DroppedSinSum(nn.Module):
    """``sin(dropout(x * w)).sum()``: a dropout inside the fused kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(nn.functional.dropout(x * self.w, 0.5, self.training)).sum()


@follows_compiled
def test_a_compiled_dropout_checked_by_hand() -> None:
    """Dropout over 1024 fp32 values, compiled. Inductor replaces the joint graph's
    ``rand`` by its own random op (``replace_random``): the forward kernel draws from
    a seed (one int64, made by ``randint`` into a buffer of its own) and writes the
    keep-mask (1024 bools) for backward, with no random or dropped tensor between
    kernels. Blocks are rounded to 512 bytes.

    forward: w 4096 + x 4096 + the seed 512 + the mask 1024 + the loss 512 = 10240
    backward: the seed freed; 9728 + autograd's ones 512 + w's gradient 4096 = 14336
    (eagerly the product, the dropped values and the sine's input are 4 KiB each)
    """
    torch.manual_seed(0)
    model, x = _DroppedSinSum(), torch.randn(1024)
    report = tm.estimate(torch.compile(model), x, device="cuda", loss_fn=_loss)
    assert report.unsupported == ()
    assert (report.forward_peak, report.backward_peak) == (10240, 14336)
    eager = tm.estimate(model, x, device="cuda", loss_fn=_loss)
    assert eager.forward_peak > 10240 + 4096


class _ColumnSum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)


class _EmbeddingLoss(nn.Module):
    """A language model's ends: token embeddings as logits over 1024 classes, and
    ``cross_entropy`` with ``ignore_index`` (the loss computed in forward, as
    transformers' models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(64, 1024)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.embedding(tokens).flatten(0, 1)
        return nn.functional.cross_entropy(logits, targets.flatten(), ignore_index=0)


@follows_compiled
def test_a_trained_embedding_and_its_loss_are_followed() -> None:
    """A (64, 1024) fp32 embedding (256 KiB) looked up by 2 x 16 tokens, its 32 rows of
    1024 logits (128 KiB) fed to ``cross_entropy(ignore_index=0)``; int64 tokens and
    targets (256 bytes: a 512-byte block each).

    Building the backward once failed: ``embedding_dense_backward`` decomposes to
    ``_unsafe_masked_index_put_accumulate``, whose decomposition, run by inductor's
    fake propagation on cuda fakes, calls ``~mask`` (a binding with a device guard;
    see ``inductor_device.unguarded``). And the joint graph, traced on meta, lost the
    loss's gradient (``nll_loss``; see ``compiled_cuda._autograd_as_on_cuda``).

    Inductor's forward: the rows (128 KiB, saved), their max and log-sum-exp (one fp32
    per row, saved), the loss and the count of targets not ignored (saved); the
    log-probabilities are never written. The loss function's sum: one more scalar.
    forward: 262144 + 2 * 512 + 131072 + 4 * 512 + 512 = 396800
    Backward: the model's output is released, autograd's ones for the sum; the program
    writes the logits' gradient (128 KiB) and scatters it into the weight's gradient
    (256 KiB) while every saved tensor is held (by autograd, until the backward ends).
    backward: 396800 - 512 + 512 + 131072 + 262144 = 790016
    Eagerly the log-probabilities (128 KiB) are made beside the rows in forward.
    """
    torch.manual_seed(0)
    model = _EmbeddingLoss()
    tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 1024, (2, 16))
    report = tm.estimate(torch.compile(model), (tokens, targets), device="cuda")
    assert report.unsupported == ()
    assert (report.forward_peak, report.backward_peak) == (396800, 790016)
    assert report.breakdown[tm.Category.GRADIENTS] == 262144
    eager = tm.estimate(model, (tokens, targets), device="cuda")
    assert eager.forward_peak >= 262144 + 2 * 512 + 2 * 131072


_COMPOSITES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cross_entropy": lambda h: nn.functional.cross_entropy(h, torch.zeros(8, dtype=torch.long, device=h.device)),
    "var": lambda h: h.var(-1, unbiased=False),
    "where with a scalar": lambda h: torch.where(h > 0, h, 0.0),
    "relu6": nn.functional.relu6,
}


class _TwoLinears(nn.Module):
    def __init__(self, between: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.first, self.second, self.between = nn.Linear(16, 16), nn.Linear(16, 16), between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.between(self.second(self.first(x)))


@pytest.mark.parametrize("name", list(_COMPOSITES))
@follows_compiled
def test_a_composite_op_keeps_its_gradient(name: str) -> None:
    """These ops run their ``CompositeImplicitAutograd`` kernel on a GPU, but have a
    Python meta kernel: the joint graph, traced on meta, once gave them no gradient,
    and the compiled backward made no gradient for the parameters before them."""
    torch.manual_seed(0)
    traced = _traced(torch.compile(_TwoLinears(_COMPOSITES[name])), torch.randn(8, 16))
    assert traced.report.unsupported == ()  # type: ignore[attr-defined]
    roles = traced.timeline.roles.values()  # type: ignore[attr-defined]
    assert sum(role is tm.Category.GRADIENTS for role in roles) == 4  # both weights and biases


_GUARDED_CALLS: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "~": lambda x, mask: ~mask,
    "contiguous": lambda x, mask: x.t().contiguous(),
    "copy_": lambda x, mask: x.copy_(x.t()),
    "nonzero": lambda x, mask: mask.nonzero(),
    "nonzero(as_tuple=True)": lambda x, mask: mask.nonzero(as_tuple=True)[0],
}


@pytest.mark.parametrize("name", list(_GUARDED_CALLS))
@follows_compiled
def test_a_method_that_sets_the_device_runs_on_cuda_fakes(name: str) -> None:
    """These Tensor methods' bindings set the tensor's device first (a CUDA device guard,
    which a CPU-only torch does not have); while a cuda program is built they run their
    op on fake cuda tensors without it, as the decompositions FakeTensorMode runs do."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from pytest_torchmem.engine.tracing.inductor_device import unguarded

    call = _GUARDED_CALLS[name]
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(4, 4, device="cuda")
        mask = torch.empty(4, 4, dtype=torch.bool, device="cuda")
        if torch.version.cuda is None:  # a CPU-only torch
            with pytest.raises(RuntimeError, match="not linked with support for cuda"):
                call(x, mask)
        with unguarded():
            out = call(x, mask)
        assert isinstance(out, torch.Tensor) and out.device == torch.device("cuda", 0)
        assert out.dtype == {"~": torch.bool, "nonzero": torch.int64}.get(name, out.dtype)


class _PermutedHeads(nn.Module):
    """Attention over heads split off a fused projection by a permute."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@follows_compiled
def test_attention_over_permuted_heads_is_followed() -> None:
    """The backward writes the three heads' gradients into one buffer; inductor's
    ``reinplace_inplaceable_ops`` checks the scatter it rewrites with ``copy_``, a method
    whose binding sets the device (it was listed as not followed)."""
    torch.manual_seed(0)
    report = tm.estimate(torch.compile(_PermutedHeads()), torch.randn(2, 16, 32), device="cuda")
    assert not [u for u in report.unsupported if u.op.startswith("torch.compile: ")]


@pytest.mark.parametrize(("gpu", "splits"), [("H100", 512), ("T4", 160)])
@follows_compiled
def test_a_split_reduction_is_sized_for_the_gpu(gpu: str, splits: int) -> None:
    """``x.sum(0)`` of a (65536, 64) fp32 input (16 MiB): 64 outputs, too few to fill the
    GPU, so inductor splits the outer reduction in two kernels with a (splits, 64) fp32
    buffer between them (``Reduction.num_splits``, ``reduction_split_factor`` in
    choices.py; 4 values per thread, 8 warps of 32 threads):

    * H100 (132 SMs, 2048 threads each): 65536 * 64 is below 32 * 132 * 2048, so 32
      values per split thread: ceil(65536 / (4 * 32)) = 512 splits;
    * T4 (40 SMs, 1024 threads each): 65536 * 64 is between 32 and 512 * 40 * 1024,
      so 40 * 1024 / 256 = 160 target blocks, ceil(65536 / (4 * 160)) = 103 per
      thread (the nearest divisor, 128, is 25 away, not taken): ceil(65536 / 412) = 160.

    forward: x 16 MiB + the buffer splits * 64 * 4 + the output 256 (a 512-byte block).
    """
    report = tm.estimate(torch.compile(_ColumnSum()), torch.randn(65536, 64), device="cuda", gpu=gpu, train=False)
    assert report.unsupported == ()
    assert report.forward_peak == 16 * MiB + splits * 64 * 4 + 512


@follows_compiled
def test_reduce_overhead_checked_by_hand() -> None:
    """CUDA graphs: the program of the default mode, its allocations in a private pool.

    The input x (not a parameter) is copied into the pool before the forward graph
    runs, and the copy is what the graph saves for backward; the backward graph's
    tangent (autograd's ones, made eagerly) is copied in too. The pool is a
    segment of its own.

    forward: 8704 + x's copy 4096 = 12800
    backward: 13312 + x's copy 4096 + the tangent's copy 512 = 17920
    reserved: the device's small segment and the pool's
    """
    torch.manual_seed(0)
    model, x = _SinSum(), torch.randn(1024)
    report = tm.estimate(torch.compile(model, mode="reduce-overhead"), x, device="cuda", loss_fn=_loss)
    assert [(u.op, u.reason) for u in report.unsupported] == [
        (f"torch.compile on cuda: {CUDA_GRAPHS_GAP.what}", CUDA_GRAPHS_GAP.why)
    ]
    assert (report.forward_peak, report.backward_peak) == (12800, 17920)
    assert report.reserved_peak == 2 * SMALL_SEGMENT


@follows_compiled
def test_reduce_overhead_on_cpu_is_the_default_program() -> None:
    """Inductor skips CUDA graphs for a cpu graph: the program is the default mode's."""
    torch.manual_seed(0)
    model, x = _Fusable(), torch.randn(8, 16, 32)
    estimated = tm.estimate(torch.compile(model, mode="reduce-overhead"), x, cpu=None)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == tm.estimate(torch.compile(model), x, cpu=None).phase_peaks()
    assert estimated.phase_peaks() == tm.measure(torch.compile(model, mode="reduce-overhead"), x).phase_peaks()


def _storages_made_by(report_trace: object, op: str) -> int:
    return sum(1 for info in report_trace.timeline.storages if info.op == op)  # type: ignore[attr-defined]


def _traced(model: nn.Module, x: torch.Tensor, gpu: str = "H100", **kwargs: object) -> object:
    return trace(
        model,
        (x,),
        {},
        device=device_model("cuda"),
        loss_fn=kwargs.pop("loss_fn", None),  # type: ignore[arg-type]
        optimizer=kwargs.pop("optimizer", None),  # type: ignore[arg-type]
        train=bool(kwargs.pop("train", True)),
        gpu=gpu_profile(gpu),
    )


def _built(name: str) -> Callable[[], nn.Module]:
    return lambda: FAMILIES[name].make(compiled=True)[0]


#: The families of compiled modules (compiled functions and optimizer steps are not followed
#: on cuda).
_MODULE_FAMILIES = ("mlp", "transformer", "conv-bn-relu", "graph break", "selective checkpointing", "regional")
CUDA_FAMILIES = {
    **{
        name: (_built(name), FAMILIES[name].shape, torch.float32, "H100")
        for name in _MODULE_FAMILIES
    },
    # bf16 on an A100: flash attention (the H100 takes cuDNN's)
    "transformer": (lambda: torch.compile(_Attention().to(torch.bfloat16)), (2, 16, 32), torch.bfloat16, "A100"),
}


@pytest.mark.parametrize("family", list(CUDA_FAMILIES))
@follows_compiled
def test_the_cuda_program_is_followed(family: str) -> None:
    """Each family runs inductor's cuda program in the traced step (its buffers are the
    wrapper's ``empty_strided`` calls), nothing is listed, and the figures are not the
    eager ones."""
    torch.manual_seed(0)
    build, shape, dtype, gpu = CUDA_FAMILIES[family]
    model, x = build(), torch.randn(*shape, dtype=dtype)
    traced = _traced(model, x, gpu)
    report = traced.report  # type: ignore[attr-defined]
    assert report.unsupported == ()
    assert _storages_made_by(traced, "aten.empty_strided.default") > 0
    eager_model = getattr(model, "_orig_mod", model)
    if eager_model is not model:
        eager = tm.estimate(eager_model, x, device="cuda", gpu=gpu)
        assert eager.phase_peaks() != report.phase_peaks()


@follows_compiled
def test_attention_takes_the_gpus_kernel() -> None:
    """The joint graph is traced under the device's router: the compiled program calls
    the attention kernel the GPU picks (flash on an A100 in bf16), as eagerly."""
    torch.manual_seed(0)
    model, x = _Attention().to(torch.bfloat16), torch.randn(2, 16, 32, dtype=torch.bfloat16)
    traced = _traced(torch.compile(model), x, "A100")
    ops = {info.op for info in traced.timeline.storages}  # type: ignore[attr-defined]
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert "aten._scaled_dot_product_flash_attention_backward.default" in ops


@follows_compiled
def test_the_bias_gradient_of_a_convolution_is_a_reduction_on_cuda() -> None:
    """Inductor decomposes ``convolution_backward``'s bias gradient into a sum for a
    GPU (decomposition.py); the joint graph, traced on meta, is decomposed as for cuda:
    the compiled backward asks the convolution for no bias gradient."""
    torch.manual_seed(0)
    model, x = torch.compile(nn.Conv2d(3, 8, 3)), torch.randn(2, 3, 16, 16)
    traced = _traced(model, x)
    assert traced.report.unsupported == ()  # type: ignore[attr-defined]
    # the weight's gradient and the bias's (a reduction of the wrapper's own): no input gradient
    assert _storages_made_by(traced, "aten.convolution_backward.default") == 1


@pytest.mark.parametrize("batch", [4, 8])
@follows_compiled
def test_dynamic_shapes(batch: int) -> None:
    torch.manual_seed(0)
    model, x = torch.compile(_Fusable(), dynamic=True), torch.randn(batch, 16, 32)
    report = tm.estimate(model, x, device="cuda")
    assert report.unsupported == ()
    static = tm.estimate(torch.compile(_Fusable()), x, device="cuda")
    assert report.phase_peaks() == static.phase_peaks()


@follows_compiled
def test_an_adamw_step_after_a_compiled_model() -> None:
    """The optimizer step runs eagerly (foreach, as on a GPU) after the compiled
    backward; its figures are the eager model's, whose parameters and gradients match."""
    torch.manual_seed(0)
    eager, x = _Fusable(), torch.randn(8, 16, 32)

    def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params)

    report = tm.estimate(torch.compile(eager), x, device="cuda", optimizer=adamw)
    assert report.unsupported == ()
    assert report.step_peak == tm.estimate(eager, x, device="cuda", optimizer=adamw).step_peak


@follows_compiled
def test_max_autotune_is_listed() -> None:
    torch.manual_seed(0)
    model = torch.compile(_Fusable(), mode="max-autotune-no-cudagraphs")
    report = tm.estimate(model, torch.randn(8, 16, 32), device="cuda")
    assert [(u.op, u.reason) for u in report.unsupported] == [
        (f"torch.compile on cuda: {AUTOTUNE_GAP.what}", AUTOTUNE_GAP.why)
    ]


@follows_compiled
def test_a_matmul_that_pad_mm_may_pad_is_listed() -> None:
    """A bf16 linear with 30 input features (not a multiple of 8)."""
    torch.manual_seed(0)
    model = torch.compile(nn.Linear(30, 64).to(torch.bfloat16))
    report = tm.estimate(model, torch.randn(16, 30, dtype=torch.bfloat16), device="cuda")
    assert [u.op for u in report.unsupported] == [f"torch.compile on cuda: {PAD_MM_GAP.what}"]


@follows_compiled
def test_the_estimate_leaves_torch_as_it_was() -> None:
    """The device queries answered as the GPU's while inductor compiles are put back."""
    from torch._dynamo import device_interface
    from torch._inductor.runtime.hints import DeviceProperties

    def state() -> tuple[object, ...]:
        return (
            torch.cuda.get_device_properties,
            torch.cuda.get_device_capability,
            DeviceProperties.__dict__["create"],
            dict(device_interface.device_interfaces),
            torch.overrides._get_current_function_mode_stack(),
            torch._decomp.decomposition_table,
            # the Python dispatcher's resolution of the joint graph's autograd on meta
            torch.ops.aten.nll_loss.default._dispatch_cache.get(torch._C.DispatchKey.AutogradMeta),
        )

    # dynamo registers its device interfaces lazily, on the first query in the process
    # (torch's own one-time setup, not a change of the estimate's): done before the state
    # is read, so that the test gives the same answer whichever tests ran before it
    list(device_interface.get_registered_device_interfaces())
    saved = state()
    tm.estimate(torch.compile(_SinSum()), torch.randn(1024), device="cuda", loss_fn=_loss)
    assert saved == state()


@pytest.mark.parametrize("kind", KINDS)
@follows_compiled
def test_each_way_of_compiling_is_followed(kind: str) -> None:
    """``torch.compile(model)``, ``model.compile()``, regional compilation and a compiled
    function called in ``forward`` (checked by hand in test_compiled_everywhere.py)."""
    model, _, _ = _compiled(kind)
    report = tm.estimate(model, torch.randn(4, 16), device="cuda")
    assert report.unsupported == ()


def _line_of(function: Callable[..., object], text: str) -> str:
    """``file:line`` of the first line of ``function``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(function)
    found = next(number for number, line in enumerate(lines, first) if text in line)
    return f"{inspect.getsourcefile(function)}:{found}"


@follows_compiled
def test_an_op_listed_in_a_compiled_program_is_located_at_the_users_line() -> None:
    """The efficient attention's backward workspace, listed from inductor's program of two
    blocks, is located once at the user's call of the attention (inductor's line map: a
    backward node keeps its forward's stack), not at two lines of inductor's output
    module, a temporary file."""
    torch.manual_seed(0)
    model = torch.compile(nn.Sequential(_Attention(), _Attention()))
    report = tm.estimate(model, torch.randn(2, 16, 32), device="cuda")
    assert [(u.op, u.location) for u in report.unsupported] == [
        (
            "aten._scaled_dot_product_efficient_attention_backward.default",
            _line_of(_Attention.forward, "scaled_dot_product_attention("),
        )
    ]


class _BranchesOnTheDevice(nn.Module):
    """A wide layer where the input is on a GPU, a narrow one elsewhere (as libraries
    branch on ``x.is_cuda`` or ``x.device.type``); ``where`` forces a branch."""

    def __init__(self, where: str | None = None) -> None:
        super().__init__()
        self.wide, self.narrow = nn.Linear(16, 4096), nn.Linear(16, 16)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on_gpu = x.is_cuda and x.device.type == "cuda" if self.where is None else self.where == "cuda"
        return self.wide(x).sum(1) if on_gpu else self.narrow(x).sum(1)


@follows_compiled
def test_the_compiled_modules_code_sees_the_gpu() -> None:
    """Dynamo traces the module's code with its tensors on the trace's meta device; the
    code is told they are on cuda, as eagerly: it takes the GPU's branch (its wide
    layer's 8 x 4096 fp32 output, 128 KiB), not the CPU's."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    figures = {}
    for where in (None, "cuda", "cpu"):
        report = tm.estimate(torch.compile(_BranchesOnTheDevice(where)), x, device="cuda")
        assert report.unsupported == ()
        figures[where] = report.phase_peaks()
    assert figures[None] == figures["cuda"] != figures["cpu"]
    # the wide output against the narrow one's (8 x 16 fp32: one 512-byte block)
    assert figures["cuda"]["forward"] - figures["cpu"]["forward"] == 8 * 4096 * 4 - 512


class _StartsACache(nn.Module):
    """A key-value cache as transformers' ``DynamicLayer`` starts one: an empty tensor
    made from Python data on the input's device, then ``cat`` with the new keys."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = torch.tensor([], dtype=x.dtype, device=x.device)
        return torch.cat([keys, self.linear(x)], dim=-2)


@follows_compiled
def test_a_cache_started_from_python_data_in_a_compiled_module_is_followed() -> None:
    """On the trace's meta device ``torch.tensor(data, device=...)`` reaches no
    dispatcher and makes a plain meta tensor, which dynamo's fake values refuse: the
    region fell back to its eager figures (transformers' GPT-2 and Llama, whose
    key-value cache starts so, did)."""
    torch.manual_seed(0)
    report = tm.estimate(torch.compile(_StartsACache()), torch.randn(8, 16), device="cuda")
    assert report.unsupported == ()


class _Island(nn.Module):
    """An fp16 autocast region around a layer, with the layer's own region enabled or
    not (``island``: disabled, as transformers' rotary embeddings force float32)."""

    def __init__(self, island: bool | None) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 256)
        self.island = island

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.island is None:  # no autocast at all
            return self.linear(x).sum()
        with torch.autocast("cuda", dtype=torch.float16):
            with torch.autocast("cuda", enabled=not self.island):
                return self.linear(x).float().sum()


@follows_compiled
def test_autocast_regions_in_a_compiled_module_are_as_enabled_as_on_a_gpu() -> None:
    """Dynamo builds the module's autocast regions itself: they enter enabled where the
    code enables them (fp16 buffers), disabled where it disables them (the float32
    program), not all disabled (a CPU-only torch finds no CUDA for autocast)."""
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    peaks = {}
    for island in (None, True, False):
        report = tm.estimate(torch.compile(_Island(island)), x, device="cuda", loss_fn=_loss)
        assert report.unsupported == ()
        peaks[island] = report.phase_peaks()
    assert peaks[True] == peaks[None] != peaks[False]
