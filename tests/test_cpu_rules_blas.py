"""CPU rules for matrix products (``pytest_torchmem/engine/tracing/devices/cpu/blas.py``).

Two kinds of test: the bytes a rule gives for one call, worked out by hand from
the kernel's logic; and small modules whose estimate equals the CPU
allocator's measurement in every phase, at 1 and 2 intra-op threads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exactness import assert_exact, intra_op_threads
from exactness import rule_buffers as scratch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from zoo import CASES

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.engine.tracing.devices.cpu.blas import onednn_gemm_accumulator_bytes
from pytest_torchmem.engine.tracing.rules import OpCall

aten = torch.ops.aten
BF16 = torch.bfloat16

onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    or torch.cpu._is_avx512_bf16_supported()
    or torch.cpu._is_amx_tile_supported(),
    reason="the bfloat16 figures follow oneDNN's gemm_bf16_matmul_t (a CPU without native bfloat16)",
)


@pytest.fixture
def two_threads() -> Iterator[None]:
    with intra_op_threads(2):
        yield


class Fn(nn.Module):
    """A module whose forward is ``f(self, *inputs)``, holding ``params``."""

    def __init__(self, f: Callable[..., Any], **params: torch.Tensor) -> None:
        super().__init__()
        self.f = f
        for name, value in params.items():
            setattr(self, name, nn.Parameter(value))

    def forward(self, *inputs: Any) -> Any:
        return self.f(self, *inputs)


# -- the bytes of one call, by hand ---------------------------------------------------


def test_mm_copies_a_stride0_gradient(threads: int) -> None:
    """``sum()``'s gradient, expanded with strides (0, 0), has no leading dimension
    BLAS can take: ``addmm_impl_cpu_`` clones it (32 x 10 floats)."""
    with FakeTensorMode():
        grad = torch.empty(1, 1).expand(32, 10)
        weight = torch.empty(10, 256)
        assert scratch(aten.mm.default, (grad, weight)) == {"mat1 (contiguous copy)": 32 * 10 * 4}
        # A transposed operand is fine: BLAS takes it as is.
        assert scratch(aten.mm.default, (torch.empty(10, 32).t(), weight)) == {}
        # Every other column of a 32 x 128 matrix: no unit stride, cloned (32 x 64).
        sliced = torch.empty(32, 128)[:, ::2]
        assert scratch(aten.mm.default, (sliced, torch.empty(64, 48))) == {"mat1 (contiguous copy)": 32 * 64 * 4}


def test_mm_into_a_strided_out_computes_in_a_copy() -> None:
    """An ``out=`` whose rows are every other column: neither column- nor row-major,
    so the product goes to a Fortran-contiguous copy (32 x 48 floats)."""
    with FakeTensorMode():
        a, b = torch.empty(32, 64), torch.empty(64, 48)
        out = torch.empty(32, 96)[:, ::2]
        assert scratch(aten.mm.out, (a, b), {"out": out}) == {"result (column-major copy)": 32 * 48 * 4}


@onednn_bf16
def test_bfloat16_mm_takes_onednn_accumulator(threads: int) -> None:
    """bfloat16 goes to oneDNN's gemm_bf16_matmul_t, which books a float accumulator.

    32 x 10 output: on 1 thread one block of 320 floats (already a multiple of
    64); on 2 threads each gets 16 rows = 160 floats, rounded up to 192, twice:
    384 floats. Plus 128 bytes of alignment room.
    """
    with FakeTensorMode():
        a, b = torch.empty(32, 256, dtype=BF16), torch.empty(256, 10, dtype=BF16)
        expected = {1: 320 * 4 + 128, 2: 384 * 4 + 128}[threads]
        assert scratch(aten.mm.default, (a, b)) == {"oneDNN scratchpad": expected}
        # With alpha != 1, ideep also makes a one-float tensor of scales.
        bias = torch.empty(10, dtype=BF16)
        assert scratch(aten.addmm.default, (bias, a, b), {"alpha": 0.5}) == {"oneDNN scratchpad": expected + 4}
        # At most 16 * 16 * 16 multiply-adds: not oneDNN, no scratch.
        assert scratch(aten.mm.default, (torch.empty(16, 16, dtype=BF16), torch.empty(16, 16, dtype=BF16))) == {}


def test_onednn_accumulator_sizes() -> None:
    # 2 threads x 16 rows x 256 columns; 1 thread needs 32 x 256: the larger.
    assert onednn_gemm_accumulator_bytes(1, 32, 256, 2) == 32 * 256 * 4 + 128
    # 8 threads share 7 rows of 100: 88 elements each -> whole rows: none fit,
    # so each keeps its 88 (rounded to 128); 1 thread needs 700 -> 704.
    assert onednn_gemm_accumulator_bytes(1, 7, 100, 8) == 8 * 128 * 4 + 128
    # A batch of 4 matrices of 32 x 64 on 2 threads: at most one matrix each.
    assert onednn_gemm_accumulator_bytes(4, 32, 64, 2) == 2 * 32 * 64 * 4 + 128


def test_bmm_routes(two_threads: None) -> None:
    with FakeTensorMode():
        # MKL's batched gemm takes contiguous or transposed matrices: nothing.
        a, b = torch.empty(4, 32, 16), torch.empty(4, 16, 64)
        assert scratch(aten.bmm.default, (a, b)) == {}
        # A stride-0 operand rules MKL out: one addmm per batch, each cloning it.
        expanded = torch.empty(1, 1, 1).expand(4, 32, 16)
        assert scratch(aten.bmm.default, (expanded, b)) == {"per batch: mat1 (contiguous copy)": 32 * 16 * 4}
        # Fewer than 400 multiply-adds per matrix: the naive kernel, nothing.
        assert scratch(aten.bmm.default, (torch.empty(1, 1, 1).expand(4, 5, 6), torch.empty(4, 6, 7))) == {}


@onednn_bf16
def test_bfloat16_bmm_goes_to_onednn(two_threads: None) -> None:
    """``mkldnn_matmul``: a batch whose matrices are not packed one after the other
    (batch dimension in the middle) is made contiguous (4 x 32 x 16 bf16), and the
    4 x 32 x 64 output is accumulated in floats, one matrix per thread."""
    with FakeTensorMode():
        a = torch.empty(32, 4, 16, dtype=BF16).transpose(0, 1)
        b = torch.empty(4, 16, 64, dtype=BF16)
        assert scratch(aten.bmm.default, (a, b)) == {
            "mat1 (contiguous copy)": 4 * 32 * 16 * 2,
            "oneDNN scratchpad": 2 * 32 * 64 * 4 + 128,
        }


def test_grouped_mm_output_is_padded_to_16_bytes() -> None:
    """``create_grouped_gemm_output_tensor``: rows padded to 16 bytes, so a 16 x 10
    float output has rows of 12 and a storage of 15 * 12 + 10 floats."""
    with FakeTensorMode():
        a, w = torch.empty(16, 32), torch.empty(4, 32, 16)[:, :, :10]
        offs = torch.empty(4, dtype=torch.int32)
        out = CPU.implementation_rule(aten._grouped_mm.default)(
            OpCall(aten._grouped_mm.default, (a, w), {"offs": offs})
        )
        assert out.shape == (16, 10) and out.stride() == (12, 1)
        assert out.untyped_storage().nbytes() == (15 * 12 + 10) * 4
        # Like the CPU kernel, a stride-0 operand is refused.
        with pytest.raises(RuntimeError, match="Invalid strides"):
            CPU.implementation_rule(aten._grouped_mm.default)(
                OpCall(aten._grouped_mm.default, (torch.empty(1, 1).expand(16, 32), w), {"offs": offs})
            )


# -- estimate == measure ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize("m,k,n", [(32, 10, 256), (33, 65, 17), (1, 64, 48)])
def test_linear(threads: int, dtype: torch.dtype, m: int, k: int, n: int) -> None:
    """``sum()``'s stride-0 gradient reaches the backward matmuls."""
    model = Fn(lambda s, x: F.linear(x, s.w, s.b), w=torch.randn(n, k, dtype=dtype), b=torch.randn(n, dtype=dtype))
    assert_exact(model, torch.randn(m, k, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_transposed_and_sliced_operands(threads: int, dtype: torch.dtype) -> None:
    model = Fn(lambda s, x: x.t()[:, ::2] @ s.w, w=torch.randn(40, 48, dtype=dtype))
    assert_exact(model, torch.randn(80, 33, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.float32, (4, 32, 16, 64)),
        (torch.float32, (3, 9, 33, 17)),
        (torch.float32, (4, 5, 6, 7)),
        (BF16, (4, 32, 16, 64)),
        (BF16, (3, 9, 33, 17)),
        (torch.float16, (4, 32, 16, 64)),
    ],
    ids=str,
)
def test_bmm_and_baddbmm(threads: int, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    """Each path of ``bmm_out_or_baddbmm_``: a weight shared by the batch (stride 0),
    a batch dimension in the middle, a stride-0 column, ``alpha`` != 1."""
    b, m, k, n = shape

    def f(s: Fn, a1: torch.Tensor, a2: torch.Tensor, a3: torch.Tensor) -> torch.Tensor:
        shared = torch.bmm(a1, s.w.expand(b, k, n))
        permuted = torch.bmm(a2.transpose(0, 1), s.v)
        return torch.baddbmm(shared + permuted, a3[:, :, :1].expand(b, m, k), s.u, alpha=0.5)

    model = Fn(f, w=torch.randn(1, k, n, dtype=dtype), v=torch.randn(b, k, n, dtype=dtype),
               u=torch.randn(b, k, n, dtype=dtype))
    inputs = (torch.randn(b, m, k, dtype=dtype, requires_grad=True),
              torch.randn(m, b, k, dtype=dtype, requires_grad=True),
              torch.randn(b, m, k, dtype=dtype, requires_grad=True))
    assert_exact(model, inputs)


def test_addmv_into_a_self_of_another_dtype_follows_the_release() -> None:
    """torch 2.10 and 2.11 add a float64 ``self`` into a float32 result (the matrix's
    dtype: 256 B, where the fake kernel would make 512 B); 2.12 on refuse it, and so
    does the estimate, in the kernel's words."""

    def f(s: Fn, x: torch.Tensor) -> torch.Tensor:
        return torch.addmv(s.c, x, s.v)

    model = Fn(f, c=torch.randn(64, dtype=torch.float64), v=torch.randn(32))
    x = torch.randn(64, 32)
    if torch_minor() >= (2, 12):
        with pytest.raises(RuntimeError, match="addmv input tensors must have the same dtype") as real:
            model(x)
        with pytest.raises(RuntimeError, match="addmv input tensors must have the same dtype") as fake:
            tm.estimate(model, x, train=False)
        assert str(fake.value) == str(real.value)
        return
    assert model(x).dtype == torch.float32
    assert tm.estimate(model, x, train=False).forward_peak == tm.measure(model, x, train=False).forward_peak


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_matrix_vector_and_dot(threads: int, dtype: torch.dtype) -> None:
    """``mv``, ``addmv`` on a strided matrix, ``dot``: oneDNN for bfloat16 above
    16 * 16 * 16 elements, with its stride-0 gradient vectors copied."""

    def f(s: Fn, x: torch.Tensor) -> torch.Tensor:
        return (x @ s.v).sum() + torch.addmv(s.c, x[:, ::2], s.v2, alpha=0.5).sum() + x.flatten() @ s.d

    model = Fn(f, v=torch.randn(600, dtype=dtype), v2=torch.randn(300, dtype=dtype),
               c=torch.randn(7, dtype=dtype), d=torch.randn(4200, dtype=dtype))
    assert_exact(model, torch.randn(7, 600, dtype=dtype))


def test_autocast_matmuls_and_weight_cache(threads: int) -> None:
    """Autocast casts each weight to bfloat16 once per region (its cast cache)."""

    def f(s: Fn, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            h = F.linear(torch.relu(F.linear(x, s.w)), s.w)
            return torch.bmm(h.view(4, 8, 64), s.w2.expand(4, 64, 200)).float()

    assert_exact(Fn(f, w=torch.randn(64, 64), w2=torch.randn(1, 64, 200)), torch.randn(32, 64))


class GroupedMoE(nn.Module):
    """Top-1 routed experts with ``torch._grouped_mm`` over expert-sorted tokens."""

    def __init__(self, width: int, hidden: int, experts: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False, dtype=dtype)
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden, dtype=dtype) / math.sqrt(width))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width, dtype=dtype) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        gate, chosen = self.router(tokens).softmax(-1).max(-1)
        order = chosen.argsort()
        offs = F.one_hot(chosen, self.w1.shape[0]).sum(0).cumsum(0).to(torch.int32)
        hidden = F.gelu(torch._grouped_mm(tokens[order], self.w1, offs=offs))
        out = torch._grouped_mm(hidden, self.w2, offs=offs)[order.argsort()]
        return (out * gate.unsqueeze(-1)).reshape(x.shape)


@pytest.mark.parametrize("sizes", [(4, 16, 32, 64, 4), (3, 20, 48, 40, 3)], ids=str)
def test_grouped_mm_moe(threads: int, sizes: tuple[int, int, int, int, int]) -> None:
    """The meta kernel of ``_grouped_mm`` takes bfloat16 only; the CPU rule runs the
    float32 layer forward and backward (2-D x 3-D and 2-D x 2-D products)."""
    batch, length, width, hidden, experts = sizes
    torch.manual_seed(0)
    assert_exact(GroupedMoE(width, hidden, experts), torch.randn(batch, length, width))


@onednn_bf16
def test_grouped_mm_bfloat16_is_an_upper_bound(two_threads: None) -> None:
    """bfloat16 groups take oneDNN scratch that grows with the group, whose size is
    in ``offs``: the estimate assumes one group of every token and says so."""
    torch.manual_seed(0)
    model, x = GroupedMoE(32, 64, 4, BF16), torch.randn(4, 16, 32, dtype=BF16)
    estimated, measured = tm.estimate(model, x), tm.measure(model, x)
    assert {u.op for u in estimated.unsupported} == {"aten._grouped_mm.default"}
    assert estimated.forward_peak >= measured.forward_peak
    assert estimated.backward_peak >= measured.backward_peak


@pytest.mark.parametrize("name", ["mlp", "bf16", "moe_topk"])
def test_zoo_cases(threads: int, name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    model, inputs = case.make()
    assert_exact(model, inputs, **case.options)


def test_linear_on_a_strided_input_adds_its_bias_in_place(threads: int) -> None:
    """Regression: ``linear`` of an input neither 2-d nor contiguous runs ``at::matmul``
    and then ``output.add_(bias)``; for tensor subclasses (fake tensors) the composite
    adds out of place. A (3, 4, 8) transposed input and 64 outputs: the fake step
    held one more 3 x 4 x 64 float tensor (3072 B) at the forward peak. The CPU router
    runs the plain-tensor path; also inside ``F.multi_head_attention_forward``."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 64)
    x = torch.randn(4, 3, 8)
    strided = [
        lambda lin, x: lin(x.transpose(0, 1)),
        lambda lin, x: lin(x.unsqueeze(0).expand(2, 4, 3, 8)),
        lambda lin, x: F.linear(x.transpose(0, 1), lin.weight, lin.bias),
    ]
    for fn in strided:
        model = _Apply(lin, fn)
        assert_exact(model, x, train=False)
        assert_exact(model, x, loss_fn=lambda out: out.sum())
    # By hand: parameters (64 x 8 + 64) x 4 B, the input 4 x 3 x 8 x 4 B, then the
    # copy of the input that matmul folds (384 B) and the 3 x 4 x 64 output (3072 B).
    estimated = tm.estimate(_Apply(lin, strided[0]), x, train=False)
    assert estimated.forward_peak == (64 * 8 + 64) * 4 + 384 + 384 + 3072
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    assert_exact(_Apply(mha, lambda m, x: m(x, x, x)[0]), torch.randn(2, 5, 8))


class _Apply(nn.Module):
    def __init__(self, module: nn.Module, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.module, x)


class _Apply(nn.Module):
    def __init__(self, module: nn.Module, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.module, x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recomputes_a_strided_linear_in_place(threads: int, reentrant: bool) -> None:
    """Regression: the backward ran without the CPU router, so a checkpoint's
    recomputation added a strided linear's bias out of place (one more output-sized
    tensor), and with early stopping recomputed past where the real step stops."""
    torch.manual_seed(0)
    lin, norm = nn.Linear(8, 16), nn.GroupNorm(1, 16)

    def body(x: torch.Tensor) -> torch.Tensor:
        y = lin(x.transpose(1, 2)).transpose(1, 2)
        return lin.weight.new_ones(()) * norm(y).transpose(1, 2).sum(-1)

    def fn(_: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(
            body, x, use_reentrant=reentrant, preserve_rng_state=False
        )

    model = _Apply(nn.ModuleList([lin, norm]), fn)
    x = torch.randn(2, 8, 5, requires_grad=reentrant)
    estimated, measured = tm.estimate(model, x), tm.measure(model, x)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.breakdown == measured.breakdown


class _MovedLinear(nn.Module):
    """A Linear on the channels moved last (a strided view), moved back."""

    def __init__(self, c: int, out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.movedim(1, -1)).movedim(-1, 1)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recomputes_moved_linears_in_place(threads: int, reentrant: bool) -> None:
    """Regression: the backward ran without the CPU router, so a checkpoint's
    recomputation added a strided linear's bias out of place: one more output-sized
    tensor, alive at the backward peak here (a case tests/test_properties.py found)."""
    torch.manual_seed(0)
    body = nn.Sequential(
        _MovedLinear(1, 2), nn.GroupNorm(1, 2, affine=False), _MovedLinear(2, 2), _MovedLinear(2, 1)
    )

    def fn(body: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x + torch.utils.checkpoint.checkpoint(
            body, x, use_reentrant=reentrant, preserve_rng_state=False
        )

    model = _Apply(body, fn)
    x = torch.randn(2, 1, 7, requires_grad=reentrant)
    estimated, measured = tm.estimate(model, x), tm.measure(model, x)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.breakdown == measured.breakdown
