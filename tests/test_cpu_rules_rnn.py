"""CPU rules for recurrent networks (pytest_torchmem/engine/tracing/devices/cpu/rnn.py).

The unit tests call the rules of ``mkldnn_rnn_layer`` and its backward on fake
tensors and check the bytes against figures worked out by hand from oneDNN
v3.12's RNN primitive (rnn_utils.cpp ``set_offsets``: each workspace and
scratch region starts on a 4096-byte page; ``get_good_ld``: a leading
dimension rounded to 64 bytes, plus 64 bytes when a multiple of 256
elements; memory_tracking.hpp: each scratchpad booking gets room to align,
4096 bytes for the RNN space, 128 for the others) and ideep's lstm.hpp. The
end-to-end tests check that ``estimate`` equals ``measure`` byte for byte for
LSTM, GRU and RNN modules, forward and backward, at one and two threads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from exactness import intra_op_threads, skip_where_native
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.engine.tracing.devices.cpu.profiles import host_profile
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall

aten = torch.ops.aten
PAGE = 4096
LSTM_MODE = 2  # ideep::rnn_kind::LSTM

HOST = host_profile()  # the level oneDNN runs at here, after ONEDNN_MAX_CPU_ISA
AVX2 = HOST.avx2
AVX512 = HOST.avx512
AVX512_BF16 = AVX512 and torch.cpu._is_avx512_bf16_supported()

needs_avx2 = pytest.mark.skipif(not AVX2, reason="oneDNN's brgemm RNN needs AVX2")
#: Where the CPU has AVX512-BF16, oneDNN runs bfloat16 LSTMs with its brgemm
#: implementation, whose backward the rules do not model.
needs_reference_bf16 = pytest.mark.skipif(
    AVX512_BF16, reason="bfloat16 takes oneDNN's brgemm implementation on AVX512-BF16 CPUs"
)
#: bfloat16 inference packs the weights for oneDNN's GEMM (AVX512 without AVX512-BF16).
needs_packed_bf16 = pytest.mark.skipif(
    not AVX512 or AVX512_BF16,
    reason="the packed bfloat16 GEMM path is taken on AVX512 CPUs without AVX512-BF16",
)


threads = intra_op_threads  # as a context manager: ``with threads(2):``


def layer_args(
    seq: int, batch: int, input_size: int, hidden: int, dtype: torch.dtype = torch.float32
) -> tuple[Any, ...]:
    """Fake arguments of ``mkldnn_rnn_layer`` for one LSTM layer (time-major input)."""
    gates = 4 * hidden
    return (
        torch.empty(seq, batch, input_size, dtype=dtype),
        torch.empty(gates, input_size, dtype=dtype),
        torch.empty(gates, hidden, dtype=dtype),
        torch.empty(gates, dtype=dtype),
        torch.empty(gates, dtype=dtype),
        torch.empty(batch, hidden, dtype=dtype),
        torch.empty(batch, hidden, dtype=dtype),
        False,  # reverse
        [],  # batch_sizes
        LSTM_MODE,
        hidden,
        1,  # num_layers
        True,  # has_biases
        False,  # bidirectional
        False,  # batch_first
        True,  # train
    )


def forward(args: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    """The outputs (implementation rule) and the steps (scratch rule) of one forward call."""
    func = aten.mkldnn_rnn_layer.default
    out = CPU.implementation_rule(func)(OpCall(func, args, {}))
    steps = CPU.scratch_rule(func)(OpCall(func, args, {}, out))
    return out, list(steps)


def allocs(steps: list[Any]) -> dict[str, int]:
    return {step.tag: step.nbytes for step in steps if isinstance(step, Alloc)}


# -- forward ---------------------------------------------------------------------------


def test_forward_training_f32_workspace_weights_and_scratchpad() -> None:
    """The reference implementation (f32 training) for T=12, N=4, I=32, H=64."""
    with FakeTensorMode(), torch.enable_grad():
        (output, hy, cy, workspace), steps = forward(layer_args(12, 4, 32, 64))
    assert tuple(output.shape) == (12, 4, 64) and tuple(hy.shape) == tuple(cy.shape) == (4, 64)
    # Workspace: gates 12*4*272*4 = 52224 (13 pages; 4*64 = 256 gates padded to 272),
    # ht 12*4*64*4 = 12288 (3 pages), then five state regions of
    # 2*(12+1)*4*64*4 = 26624 bytes (7 pages each): states, c states, and the
    # three diff states.
    assert workspace.dtype == torch.uint8
    assert workspace.numel() == (13 + 3 + 5 * 7) * PAGE == 208896
    # Scratchpad: scratch gates for all 12 steps (merged layer gemm) 52224 (13 pages),
    # scratch ht 4*64*4 (1 page), scratch diff ht 4*64*4 (1 page); the space's
    # 4096-byte alignment; three weight-pointer arrays (8 + 128) and the bias
    # pointers (8 * 4 bytes + 128).
    scratchpad = 15 * PAGE + PAGE + 3 * (8 + 128) + (32 + 128)
    assert steps[0] is OUTPUTS
    assert allocs(steps) == {
        "bias": 4 * 64 * 4,  # bias_ih + bias_hh
        "weights_layer": 32 * 272 * 4,  # ldigo, gates padded to 272
        "weights_iter": 64 * 272 * 4,
        "scratchpad": scratchpad,
    }
    assert scratchpad == 66104


@needs_reference_bf16
def test_forward_training_bf16_layouts() -> None:
    """bfloat16 data: states and gates in 2 bytes, gate scratch and diff states in float32."""
    with FakeTensorMode(), torch.enable_grad():
        (_, _, _, workspace), steps = forward(layer_args(3, 2, 5, 7, torch.bfloat16))
    # good_ld(4*7=28 gates, bf16) = 32; good_ld(7, bf16) = 32; good_ld(7, f32) = 16.
    # gates 3*2*32*2 = 384, ht 3*2*32*2 = 384, states 2*4*2*32*2 = 1024,
    # c states 2*4*2*7*2 = 224, diff states 2*4*2*16*4 = 1024 twice, diff c 2*4*2*7*4 = 448:
    # seven regions of one page each.
    assert workspace.numel() == 7 * PAGE
    assert allocs(steps) == {
        "bias": 4 * 7 * 2,
        "weights_layer": 5 * 32 * 2,
        "weights_iter": 7 * 32 * 2,
        # scratch gates 3*2*good_ld(28, f32)=32*4, scratch ht, scratch diff ht: a page each;
        # bias pointers: 8 * 2 bytes.
        "scratchpad": 3 * PAGE + PAGE + 3 * (8 + 128) + (16 + 128),
    }


def test_one_input_feature_needs_no_reorder() -> None:
    """With I = 1 PyTorch's weight_ih already has oneDNN's forward layout: oneDNN ignores the
    stride of a size-1 dimension when it compares layouts, so ideep reorders nothing."""
    with FakeTensorMode(), torch.enable_grad():
        _, steps = forward(layer_args(5, 2, 1, 16))
    assert "weights_layer" not in allocs(steps)
    assert allocs(steps)["weights_iter"] == 16 * 64 * 4  # 64 gates: already 64-byte aligned
    with FakeTensorMode():
        _, steps = backward(layer_args(5, 2, 1, 16), torch.empty(5, 2, 16), None, None)
    # Backward: good_ld(1) = 16 changes the output stride, so weight_ih is reordered
    # (64 x 16 floats); its gradient in ldigo spans the 64 gates of its single row.
    assert allocs(steps)["weights_layer"] == 64 * 16 * 4
    assert allocs(steps)["diff_weights_layer"] == 64 * 4


@needs_avx2
@pytest.mark.parametrize("nthreads", [1, 2])
def test_forward_inference_f32_brgemm(nthreads: int) -> None:
    """Inference runs oneDNN's brgemm implementation: blocked weights and a per-thread batch."""
    with threads(nthreads), FakeTensorMode(), torch.no_grad():
        (_, _, _, workspace), steps = forward(layer_args(12, 4, 32, 64))
    assert workspace.numel() == 0
    # Everything goes to the scratchpad: states 26624 bytes (7 pages), c states
    # (7 pages), one step of scratch gates 4*272*4 and scratch ht 4*64*4 (a page
    # each, the last rounded up): 17 pages. Then the pointer arrays, and the
    # brgemm batch: 2 K blocks per thread of 40-byte elements.
    batch = 2 * nthreads * 40 + 128
    assert allocs(steps) == {
        "bias": 1024,
        "weights_layer": 32 * 4 * 64 * 4,  # ldgOi32o: 64 outputs in blocks of 32
        "weights_iter": 64 * 4 * 64 * 4,
        "scratchpad": 17 * PAGE + PAGE + 3 * (8 + 128) + (32 + 128) + batch,
    }


@needs_packed_bf16
@pytest.mark.parametrize("nthreads", [1, 2])
def test_forward_inference_bf16_packs_weights(nthreads: int) -> None:
    """bfloat16 inference packs both weights for oneDNN's bf16 GEMM (reference implementation)."""
    with threads(nthreads), FakeTensorMode(), torch.no_grad():
        _, steps = forward(layer_args(12, 4, 32, 64, torch.bfloat16))
    # Packed A (256 x K): a header page, the blocks, a page of kernel overrun.
    # K <= 384 is padded to 128. One thread: one 288 x 128 block (256 rows in
    # units of 48) = 73728 bytes; two threads: two 144 x 128 blocks of 36864.
    packed = PAGE + 18 * PAGE + PAGE
    assert steps[1:] == [
        Alloc("bias", 4 * 64 * 2),
        Alloc("weights_layer", packed),
        Alloc("weights_layer reorder scratchpad", 32 * 256 * 2 + 128),  # transposition
        Free("weights_layer reorder scratchpad"),
        Alloc("weights_iter", packed),
        Alloc("weights_iter reorder scratchpad", 64 * 256 * 2 + 128),
        Free("weights_iter reorder scratchpad"),
        # states 2*13*4*64*2 = 13312 (4 pages), c states (4 pages), scratch gates
        # 12*4*272*4 (13 pages), scratch ht (1 page): 22 pages; bias pointers 8 * 2.
        Alloc("scratchpad", 22 * PAGE + PAGE + 3 * (8 + 128) + (16 + 128)),
    ]


@needs_packed_bf16
def test_forward_inference_bf16_single_sequence_packs_unblocked() -> None:
    """With one sequence the iteration gemm is a gemv: A is copied whole, with a padded ld."""
    with threads(1), FakeTensorMode(), torch.no_grad():
        _, steps = forward(layer_args(12, 1, 32, 64, torch.bfloat16))
    # prep_gemm_pack: ld = rnd_up(64, 1024) + 32 = 1056 rows of 256 bf16 values.
    assert allocs(steps)["weights_iter"] == PAGE + 1056 * 256 * 2 + PAGE


# -- backward --------------------------------------------------------------------------


def backward(
    args: tuple[Any, ...], grad_output: Any, grad_hy: Any, grad_cy: Any
) -> tuple[Any, list[Any]]:
    """The outputs and steps of the backward of :func:`layer_args`'s layer."""
    input, w_ih, w_hh, b_ih, b_hh, hx, cx = args[:7]
    output = torch.empty(input.shape[0], input.shape[1], hx.shape[1], dtype=input.dtype)
    bargs = (
        input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, torch.empty_like(hx), torch.empty_like(cx),
        grad_output, grad_hy, grad_cy,
        False, LSTM_MODE, hx.shape[1], 1, True, True, False, [], False,
        torch.empty(0, dtype=torch.uint8),
    )  # fmt: skip
    func = aten.mkldnn_rnn_layer_backward.default
    out = CPU.implementation_rule(func)(OpCall(func, bargs, {}))
    steps = CPU.scratch_rule(func)(OpCall(func, bargs, {}, out))
    return out, list(steps)


def test_backward_f32_gradients_and_primitive_buffers() -> None:
    with FakeTensorMode():
        args = layer_args(12, 4, 32, 64)
        grad_output = torch.empty(4, 12, 64).transpose(0, 1)  # not contiguous
        out, steps = backward(args, grad_output, None, None)
    diff_x, diff_w_ih, diff_w_hh, diff_b, diff_b2, diff_hx, diff_cx = out
    assert all(t.dtype == torch.float32 for t in out)
    assert diff_b.untyped_storage()._cdata == diff_b2.untyped_storage()._cdata
    assert steps == [
        Alloc("grad_output contiguous", 12 * 4 * 64 * 4),
        Alloc("grad_hy zeros", 4 * 64 * 4),
        Alloc("grad_cy zeros", 4 * 64 * 4),
        Alloc("bias", 4 * 64 * 4),
        OUTPUTS,
        # good_ld(32) = 32 and good_ld(64) = 64: PyTorch's weights already have the
        # backward layout (ldgoi), no reorder. The weight gradients: ldigo, gates padded to 272.
        Alloc("diff_weights_layer", 32 * 272 * 4),
        Alloc("diff_weights_iter", 64 * 272 * 4),
        Alloc("diff_bias", 256 * 4),
        # As forward: 12 steps of scratch gates (13 pages), scratch ht and diff ht.
        Alloc("scratchpad", 15 * PAGE + PAGE + 3 * (8 + 128) + (32 + 128)),
    ]


def test_backward_reorders_weights_whose_ld_is_padded() -> None:
    """An input size of 256 floats is padded to 272 in the backward layout: ideep reorders."""
    with FakeTensorMode():
        args = layer_args(2, 1, 256, 8)
        out, steps = backward(args, torch.empty(2, 1, 8), torch.empty(1, 8), torch.empty(1, 8))
    assert allocs(steps)["weights_layer"] == 4 * 8 * 272 * 4
    # A hidden size of 8 floats is padded to 16 (64 bytes).
    assert allocs(steps)["weights_iter"] == 4 * 8 * 16 * 4
    assert "grad_output contiguous" not in allocs(steps)


@needs_reference_bf16
def test_backward_bf16_copies_gradients_to_f32_and_clones_a_shared_cx() -> None:
    with FakeTensorMode():
        args = list(layer_args(3, 2, 5, 7, torch.bfloat16))
        args[6] = args[5]  # cx is hx: the kernel clones cx
        _, steps = backward(tuple(args), torch.empty(3, 2, 7, dtype=torch.bfloat16), None, None)
    # (on torch 2.10 the layer is listed first: test_the_lstm_of_torch_2_10_is_listed_...)
    steps = [step for step in steps if not isinstance(step, Inexact)]
    assert steps[:5] == [
        Alloc("grad_hy zeros", 2 * 7 * 2),
        Alloc("grad_cy zeros", 2 * 7 * 2),
        Alloc("bias", 4 * 7 * 2),
        Alloc("cx clone", 2 * 7 * 2),
        OUTPUTS,
    ]
    # grad_y_, grad_hy_, grad_cy_: float32 copies for the primitive.
    assert steps[5:8] == [
        Alloc("grad_y f32", 3 * 2 * 7 * 4),
        Alloc("grad_hy f32", 2 * 7 * 4),
        Alloc("grad_cy f32", 2 * 7 * 4),
    ]
    # bf16 weights in the backward layout: good_ld(5, bf16) = 32, good_ld(7, bf16) = 32.
    assert allocs(steps)["weights_layer"] == 4 * 7 * 32 * 2
    assert allocs(steps)["weights_iter"] == 4 * 7 * 32 * 2
    # The weight gradients stay float32: gates 28 padded to good_ld(28, f32) = 32.
    assert allocs(steps)["diff_weights_layer"] == 5 * 32 * 4
    # Backward scratch gates are bf16 (scratch_t is the data type): 3*2*32*2.
    assert allocs(steps)["scratchpad"] == 3 * PAGE + PAGE + 3 * (8 + 128) + (16 + 128)


# -- estimate against measure ------------------------------------------------------------


def _lstm(**kw: Any) -> nn.Module:
    torch.manual_seed(0)
    return nn.LSTM(**kw)


def _sum_all(out: Any) -> torch.Tensor:
    output, (hy, cy) = out
    return output.float().sum() + hy.float().sum() + cy.float().sum()


def _first(out: Any) -> torch.Tensor:
    return out[0].float().sum()


Case = tuple[Any, tuple[int, ...], dict[str, Any]]


def _case(make: Any, shape: tuple[int, ...], **options: Any) -> Case:
    return make, shape, options


BF16 = torch.bfloat16
CASES = {
    # oneDNN's forward training and backward (reference implementation); the zoo's shape first
    "lstm-2layer-batch-first": _case(
        lambda: _lstm(input_size=32, hidden_size=64, num_layers=2, batch_first=True), (4, 12, 32)
    ),
    "lstm-bidirectional-3layer-odd": _case(
        lambda: _lstm(input_size=7, hidden_size=13, num_layers=3, bidirectional=True), (4, 5, 7)
    ),
    "lstm-bf16": _case(
        lambda: _lstm(input_size=5, hidden_size=33, num_layers=2).bfloat16(), (3, 4, 5), dtype=BF16
    ),
    "lstm-no-bias-dropout": _case(
        lambda: _lstm(input_size=16, hidden_size=8, num_layers=2, bias=False, dropout=0.5),
        (5, 3, 16),
    ),
    "lstm-input-256": _case(lambda: _lstm(input_size=256, hidden_size=31), (2, 2, 256)),
    "lstm-states-used": _case(
        lambda: _lstm(input_size=8, hidden_size=16, batch_first=True),
        (3, 5, 8),
        init=True,
        loss=_sum_all,
    ),
    "lstm-one-tensor-for-h0-and-c0": _case(
        lambda: _lstm(input_size=3, hidden_size=6), (4, 2, 3), init="shared"
    ),
    # ATen's native cells: composites the fake trace sees op by op
    "lstm-proj": _case(lambda: _lstm(input_size=8, hidden_size=16, proj_size=4), (2, 3, 8)),
    "gru-bidirectional": _case(
        lambda: nn.GRU(12, 20, bidirectional=True, batch_first=True), (3, 2, 12)
    ),
    "rnn-tanh": _case(lambda: nn.RNN(6, 10, num_layers=2), (2, 2, 6), init=True),
    "rnn-relu-bf16": _case(
        lambda: nn.RNN(6, 10, nonlinearity="relu").bfloat16(), (2, 3, 6), dtype=BF16
    ),
}
EVAL_CASES = {
    # brgemm (float32) and packed-GEMM (bfloat16) inference
    "lstm-f32": _case(lambda: _lstm(input_size=32, hidden_size=64, num_layers=2), (12, 4, 32)),
    "lstm-f32-one-sequence": _case(
        lambda: _lstm(input_size=64, hidden_size=64, num_layers=2), (3, 1, 64)
    ),
    "lstm-bf16-eval": _case(
        lambda: _lstm(input_size=32, hidden_size=64, num_layers=2).bfloat16(),
        (12, 4, 32),
        dtype=BF16,
    ),
    "lstm-bf16-one-sequence": _case(
        lambda: _lstm(input_size=13, hidden_size=33).bfloat16(), (9, 1, 13), dtype=BF16
    ),
    "lstm-bf16-long-input": _case(
        lambda: _lstm(input_size=400, hidden_size=100).bfloat16(), (2, 8, 400), dtype=BF16
    ),
}


def _inputs(model: nn.Module, shape: tuple[int, ...], options: dict[str, Any]) -> Any:
    torch.manual_seed(1)
    dtype = options.get("dtype", torch.float32)
    x = torch.randn(shape).to(dtype)
    if not options.get("init"):
        return x
    batch = shape[0] if model.batch_first else shape[1]
    layers = model.num_layers * (2 if model.bidirectional else 1)
    h0 = torch.randn(layers, batch, getattr(model, "proj_size", 0) or model.hidden_size).to(dtype)
    if isinstance(model, nn.LSTM):
        if options["init"] == "shared":
            return x, (h0, h0)
        return x, (h0, torch.randn(layers, batch, model.hidden_size).to(dtype))
    return x, h0


def _peaks(report: tm.MemoryReport) -> tuple[int, int]:
    return report.forward_peak, report.backward_peak


# The reference implementation's buffers do not depend on the thread count: one
# case runs at both, the others at two.
TRAINING = [(name, 2) for name in CASES] + [("lstm-2layer-batch-first", 1)]
#: Cases whose figures hang on paths only some CPUs take.
NEEDS = {
    "lstm-bf16": needs_reference_bf16,
    "lstm-f32": needs_avx2,
    "lstm-f32-one-sequence": needs_avx2,
    "lstm-bf16-eval": needs_packed_bf16,
    "lstm-bf16-one-sequence": needs_packed_bf16,
    "lstm-bf16-long-input": needs_packed_bf16,
}


def _params(names: list[tuple[str, int]]) -> list[Any]:
    return [
        pytest.param(name, n, marks=[NEEDS[name]] if name in NEEDS else [], id=f"{name}-{n}")
        for name, n in names
    ]


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize(("name", "nthreads"), _params(TRAINING))
def test_training_step_estimate_equals_measure(name: str, nthreads: int) -> None:
    make, shape, options = CASES[name]
    model = make()
    inputs = _inputs(model, shape, options)
    loss = options.get("loss", _first)
    with threads(nthreads):
        estimated = tm.estimate(model, inputs, loss_fn=loss)
        skip_where_native(estimated)
        measured = tm.measure(model, inputs, loss_fn=loss)
    assert estimated.unsupported == ()
    assert _peaks(estimated) == _peaks(measured)


@pytest.mark.parametrize(
    ("name", "nthreads"), _params([(name, n) for name in EVAL_CASES for n in (1, 2)])
)
def test_inference_estimate_equals_measure(name: str, nthreads: int) -> None:
    make, shape, options = EVAL_CASES[name]
    model = make()
    inputs = _inputs(model, shape, options)
    with threads(nthreads):
        estimated = tm.estimate(model, inputs, train=False)
        measured = tm.measure(model, inputs, train=False)
    assert estimated.forward_peak == measured.forward_peak


def test_repeated_estimates_agree() -> None:
    """FakeTensorMode caches kernels by shape; a cached backward must not change the figures."""
    model = _lstm(input_size=4, hidden_size=8)
    x = torch.randn(3, 1, 4)
    first = tm.estimate(model, x, loss_fn=_first)
    again = tm.estimate(model, x, loss_fn=_first)
    assert _peaks(first) == _peaks(again) == _peaks(tm.measure(model, x, loss_fn=_first))


def test_the_lstm_of_torch_2_10_is_listed_and_no_other_release_s() -> None:
    """torch 2.10's oneDNN (3.7.1) sizes the LSTM scratchpad otherwise than the one the
    rules follow: there each oneDNN layer, forward and backward, is in ``unsupported``
    (the figure may be low); on 2.11 to 2.15 the same step is exact and unlisted."""
    model = _lstm(input_size=16, hidden_size=32)
    x = torch.randn(10, 4, 16)
    estimated = tm.estimate(model, x, loss_fn=lambda out: out[0].sum())
    listed = sorted({u.op for u in estimated.unsupported})
    if torch_minor() == (2, 10):
        assert listed == ["aten.mkldnn_rnn_layer.default", "aten.mkldnn_rnn_layer_backward.default"]
        assert all("oneDNN (3.7.1)" in u.reason for u in estimated.unsupported)
    else:
        assert listed == []
