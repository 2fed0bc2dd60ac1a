"""What the CUDA kernels of the routed ops allocate that their meta kernels don't show.

The router (:mod:`.router`) sends calls to the ops a GPU runs; these rules
give those ops' CUDA behaviour where the meta kernel differs: outputs that
live on the host or that the meta kernel sizes differently (implementation
rules), and the buffers the kernels take from the caching allocator and give
back before returning (scratch rules). Sources, torch 2.13/2.14:

* flash attention: ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``
  (``mha_fwd``, ``set_params_splitkv``, ``num_splits_heuristic``, ``mha_bwd``) and
  ``attention_backward.cu`` (``_flash_attention_backward``);
* memory-efficient attention: ``transformers/cuda/attention.cu``
  (``_efficient_attention_forward``) and ``attention_backward.cu``
  (``_efficient_attention_backward``), ``mem_eff_attention/kernel_forward.h`` /
  ``kernel_backward.h``;
* cuDNN attention: ``transformers/cuda/attention.cu`` (``_cudnn_attention_forward``),
  ``aten/src/ATen/native/cudnn/MHA.cpp`` and cudnn-frontend's SDPA backward node;
* cuDNN RNNs: ``aten/src/ATen/native/cudnn/RNN.cpp`` (``_cudnn_rnn``,
  ``_cudnn_rnn_backward``, ``_cudnn_rnn_backward_input``/``_weight``).

Where the size is chosen inside a closed library (cuDNN's RNN reserve and
workspace), the rule states the model it uses.
"""

from __future__ import annotations

import math
from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.blas import grouped_mm_output
from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Steps

__all__ = [
    "flash_num_splits",
    "rnn_reserve_bytes",
    "rnn_workspace_bytes",
]

aten = torch.ops.aten
_F32: Final = 4
_HALVES: Final = (torch.float16, torch.bfloat16)



def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _sm_count(call: OpCall) -> int:
    gpu = call.gpu
    return gpu.sm_count if gpu is not None else 132


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _copy_bytes_if_not_contiguous(t: torch.Tensor) -> int:
    """Bytes ``t.contiguous()`` allocates (0 when ``t`` already is)."""
    return 0 if t.is_contiguous() else t.numel() * t.element_size()


def _transposed_copy_bytes(t: torch.Tensor, dim0: int, dim1: int) -> int:
    """``_copy_bytes_if_not_contiguous(t.transpose(dim0, dim1))`` for a strided ``t``,
    read from its sizes and strides: no view op (a fake dispatch, ~60 us) is made.

    Contiguity as ``c10::_compute_contiguous`` has it: empty, or each dimension
    longer than 1, last first, strided by the product of the sizes after it.
    """
    sizes, strides = list(t.shape), list(t.stride())
    sizes[dim0], sizes[dim1] = sizes[dim1], sizes[dim0]
    strides[dim0], strides[dim1] = strides[dim1], strides[dim0]
    numel = t.numel()
    if numel == 0:
        return 0
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size == 1:
            continue
        if stride != expected:
            return numel * t.element_size()
        expected *= size
    return 0


# -- flash attention --------------------------------------------------------------


def flash_num_splits(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """``num_splits_heuristic`` (flash_api.cpp): the fewest splits reaching 85% of
    the best wave efficiency."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or -(-num_n_blocks // n) != -(-num_n_blocks // (n - 1))

    efficiency = []
    best = 0.0
    for n in range(1, max_splits + 1):
        if not eligible(n):
            efficiency.append(0.0)
            continue
        waves = batch_nheads_mblocks * n / num_sms
        eff = waves / math.ceil(waves)
        best = max(best, eff)
        efficiency.append(eff)
    for n in range(1, max_splits + 1):
        if eligible(n) and efficiency[n - 1] >= 0.85 * best:
            return n
    return 1


@CUDA.scratch(aten._scaled_dot_product_flash_attention.default)
def _flash_forward(call: OpCall) -> Steps:
    """``mha_fwd``: with no dropout, ``set_params_splitkv`` may split the keys and
    then takes fp32 ``softmax_lse_accum`` (splits, b, h, s_q) and ``out_accum``
    (splits, b, h, s_q, d_rounded) for the call; with dropout, a first
    ``rng_state`` (2 x uint64) is replaced by a second one, the first freed at
    the end."""
    q, k = call.args[0], call.args[1]
    dropout_p = call.arg(3, "dropout_p", 0.0)
    b, h, s_q, d = q.shape
    s_k, h_k = k.size(2), k.size(1)
    if s_q == 1 and h > h_k and dropout_p == 0.0 and d % 8 == 0:  # seqlenq_ngroups_swapped
        s_q, h = h // h_k, h_k
    head = _round_up(d, 8)
    head_rounded = _round_up(head, 32 if head <= 128 else 64)
    steps: list[Any] = [OUTPUTS]
    if dropout_p == 0.0:
        block_n = 256 if head <= 64 else (128 if head <= 128 else 64)
        n_blocks = -(-s_k // block_n)
        m_blocks = -(-s_q // 64)
        splits = flash_num_splits(b * h * m_blocks, _sm_count(call) * 2, n_blocks, 128)
        if splits > 1:
            steps.append(Alloc("softmax_lse_accum", splits * b * h * s_q * _F32))
            steps.append(Alloc("out_accum", splits * b * h * s_q * head_rounded * _F32))
    else:
        steps.append(Alloc("rng_state (first)", 16))
    return steps


@CUDA.scratch(aten._scaled_dot_product_flash_attention_backward.default)
def _flash_backward(call: OpCall) -> Steps:
    """``_flash_attention_backward`` + ``mha_bwd``: contiguous copies of ``dout`` and
    ``out`` (in (b, s, h, d) layout) when they are not, then, beside dq, dk, dv:
    ``softmax_d`` (b, h, round128(s_q)) fp32, the fp32 ``dq_accum``
    (b, round128(s_q), h, d_rounded; ``nsplits`` of them, zeroed, when
    deterministic) and, for grouped-query attention, ``dk_expanded`` /
    ``dv_expanded`` (b, s_k, h, d) in the input dtype."""
    grad_out, q, k, out = call.args[0], call.args[1], call.args[2], call.args[4]
    b, h, s_q, d = q.shape
    s_k, h_k = k.size(2), k.size(1)
    item = q.element_size()
    steps: list[Any] = [
        Alloc("dout.contiguous()", _transposed_copy_bytes(grad_out, 1, 2)),
        Alloc("out.contiguous()", _transposed_copy_bytes(out, 1, 2)),
        OUTPUTS,
    ]
    s_q_rounded = _round_up(s_q, 128)
    d_rounded = _round_up(d, 32 if d <= 128 else 64)
    steps.append(Alloc("softmax_d", b * h * s_q_rounded * _F32))
    accum = b * s_q_rounded * h * d_rounded * _F32
    if _deterministic():
        accum *= -(-_sm_count(call) // (b * h))
    steps.append(Alloc("dq_accum", accum))
    if h_k != h:
        steps.append(Alloc("dk_expanded", b * s_k * h * d * item))
        steps.append(Alloc("dv_expanded", b * s_k * h * d * item))
    return steps


# -- memory-efficient attention ------------------------------------------------------


@CUDA.implementation(aten._scaled_dot_product_efficient_attention.default)
def _efficient_forward_outputs(call: OpCall) -> Any:
    """``_efficient_attention_forward``: the philox seed and offset are 0-dim int64
    tensors on the host (Note [Seed and Offset Device], outside graph capture);
    the meta kernel puts them on the device."""
    out, lse, _seed, _offset = call.default()
    host = torch.device("cpu")
    return (
        out,
        lse,
        torch.empty((), dtype=torch.int64, device=host),
        torch.empty((), dtype=torch.int64, device=host),
    )


@CUDA.scratch(aten._scaled_dot_product_efficient_attention.default)
def _efficient_forward(call: OpCall) -> Steps:
    """``_efficient_attention_forward``: kernels whose value head dim does not fit one
    iteration (``kNeedsOutputAccumulatorBuffer``: ``kMaxK > kKeysPerBlock`` with a
    16-bit output, i.e. the ``k65536`` kernels picked for head dims above 128)
    accumulate in an fp32 ``output_accum`` (b, s_q, h, d_v) for the call."""
    q, v = call.args[0], call.args[2]
    steps: list[Any] = [OUTPUTS]
    if q.dtype in _HALVES and max(q.size(-1), v.size(-1)) > 128:
        b, h, s_q = q.size(0), q.size(1), q.size(2)
        steps.append(Alloc("output_accum", b * s_q * h * v.size(-1) * _F32))
    return steps


_CUTLASS_WORKSPACE: Final = (
    "memory-efficient attention backward: the cutlass kernel's workspace is modelled "
    "as its fp32 dQ accumulator for the sm80 kernel table (dK/dV accumulators and "
    "key splits of other kernels not modelled)"
)


def _cutlass_backward_blocks(max_k: int) -> tuple[int, int]:
    """``(kBlockSizeI, kBlockSizeJ)`` of the first ``cutlassB`` sm80 kernel that fits
    ``max_k`` (mem_eff_attention/kernels/cutlassB.h): 64x64 up to head dim 64,
    128x128 up to 128, 64x64 for the ``k65536`` kernels beyond."""
    if max_k <= 64:
        return 64, 64
    if max_k <= 128:
        return 128, 128
    return 64, 64


@CUDA.scratch(aten._scaled_dot_product_efficient_attention_backward.default)
def _efficient_backward(call: OpCall) -> Steps:
    """``_efficient_attention_backward``: ``grad_out.contiguous()`` (b, s_q, h, d_v)
    when it is not; after dq, dk, dv (and the 16-aligned grad bias), ``delta``
    (b, h, s_q) fp32 -- made by the kernel for 16-bit inputs
    (``kKernelComputesDelta``), else as ``(grad_out.float() * out.float()).sum(-1)
    .transpose(-2, -1).contiguous()`` with its product and sum temporaries -- and
    the kernel workspace: an fp32 dQ accumulator of
    ``round_up(s_q, kBlockSizeI) x round_up(d, kBlockSizeJ)`` per (batch, head)
    (``workspace_elements_gq``; ``kNeedsAccumGradQ``)."""
    grad_out, q, v = call.args[0], call.args[1], call.args[3]
    b, h, s_q, d = q.shape
    d_v = v.size(-1)
    steps: list[Any] = [
        Alloc("grad_out.contiguous()", _transposed_copy_bytes(grad_out, 1, 2)),
        OUTPUTS,
    ]
    if q.dtype in _HALVES:
        steps.append(Alloc("delta", b * h * s_q * _F32))
    else:
        steps += [
            Alloc("grad_out * out", b * s_q * h * d_v * _F32),
            Alloc("sum(-1)", b * s_q * h * _F32),
            Free("grad_out * out"),
            Alloc("delta", b * h * s_q * _F32),
            Free("sum(-1)"),
        ]
    block_i, block_j = _cutlass_backward_blocks(max(d, d_v))
    gq = _round_up(s_q, block_i) * _round_up(d, block_j)
    steps.append(Alloc("workspace", b * h * _round_up(gq, 4) * _F32))
    steps.append(Inexact(_CUTLASS_WORKSPACE))
    return steps


# -- cuDNN attention ------------------------------------------------------------------


@CUDA.implementation(aten._scaled_dot_product_cudnn_attention.default)
def _cudnn_attention_outputs(call: OpCall) -> Any:
    """``_cudnn_attention_forward`` / ``run_cudnn_SDP_fprop``: the softmax statistics
    (b, h, s_q, 1) fp32 are made only when ``compute_log_sumexp``; the seed and
    offset are 0-dim int64 tensors on the device (as the meta kernel has them)."""
    out = list(call.default())
    if not call.arg(4, "compute_log_sumexp", False):
        out[1] = out[1].new_empty((0,))
    return tuple(out)


@CUDA.scratch(aten._scaled_dot_product_cudnn_attention.default)
def _cudnn_attention_decode(call: OpCall) -> Steps:
    """Torch 2.14 disables cuDNN attention for decoding (a query of length 1) on
    compute capability 10.x and 11.x with cuDNN 9.19 to 9.25.0 except 9.24.1
    (``is_cudnn_attention_decode_disabled``; its wheel has cuDNN 9.24.0), under
    conditions read at run time that the router does not follow: such a call is
    listed as possibly another backend's."""
    gpu = call.gpu
    major = getattr(gpu, "compute_capability", (9, 0))[0]
    if torch_minor() != (2, 14) or major not in (10, 11) or call.args[0].size(2) != 1:
        return ()
    return [OUTPUTS, Inexact(_CUDNN_DECODE)]


_CUDNN_DECODE: Final = (
    "cuDNN attention decode (query length 1) on compute capability 10.x/11.x: torch 2.14 "
    "with cuDNN 9.24.0 may disable it (is_cudnn_attention_decode_disabled) and run "
    "another backend"
)


@CUDA.scratch(aten._scaled_dot_product_cudnn_attention_backward.default)
def _cudnn_attention_backward(call: OpCall) -> Steps:
    """``run_cudnn_SDP_bprop``: the cudnn-frontend SDPA backward graph's workspace
    holds its non-virtual tensors, ``softmax_sum`` (b, h, s_q, 1) fp32 and the fp32
    ``dQ_accum`` (b, h, s_q, d_qk); the backend engine's own workspace, which
    cuDNN reports at run time, is taken as 0."""
    q = call.args[1]
    b, h, s_q, d = q.shape
    return [
        OUTPUTS,
        Alloc("workspace", b * h * s_q * _F32 + b * h * s_q * d * _F32),
        Inexact("cuDNN attention backward: the engine's own workspace is reported by cuDNN at run time (taken as 0)"),
    ]


# -- cuDNN RNN ------------------------------------------------------------------------

_LSTM: Final = 2
_GRU: Final = 3
#: Width-``hidden`` vectors cuDNN keeps per step, layer and direction for backward
#: (the reserve model): LSTM 4 gates + cell + hidden, GRU 3 gates + hidden + the
#: recurrent ``W_hn h + b_hn`` term, plain RNNs pre-activation + hidden.
_RESERVED_VECTORS: Final = {_LSTM: 6, _GRU: 5, 0: 2, 1: 2}
#: Gates per cell: the width of the input-to-hidden GEMM over all steps (workspace model).
_GATES: Final = {_LSTM: 4, _GRU: 3, 0: 1, 1: 1}


_CUDNN_RNN_MODEL: Final = (
    "cuDNN RNN: the reserve space and workspace sizes are cuDNN's own "
    "(cudnnGetRNNTempSpaceSizes); a model of them was used"
)


def _rnn_dims(call: OpCall) -> tuple[int, int, int, int, int, int, bool]:
    """(seq_len, batch, hidden, out_size, layers, directions, batch_first) of a call."""
    input = call.args[0]
    if call.func is aten._cudnn_rnn.default:
        hidden, proj, layers, batch_first, bidirectional = (
            call.args[7], call.args[8], call.args[9], call.args[10], call.args[13],
        )
    else:
        hidden, proj, layers, batch_first, bidirectional = (
            call.args[11], call.args[12], call.args[13], call.args[14], call.args[17],
        )
    t, n = (input.size(1), input.size(0)) if batch_first else (input.size(0), input.size(1))
    return t, n, hidden, proj or hidden, layers, 2 if bidirectional else 1, batch_first


def rnn_reserve_bytes(mode: int, seq_len: int, batch: int, hidden: int, out_size: int,
                      layers: int, directions: int, dropout: float, itemsize: int) -> int:
    """The cuDNN training reserve space (``cudnnGetRNNTempSpaceSizes``, training mode).

    cuDNN does not publish the size; it is modelled as what backward needs kept
    from forward: per step, layer and direction, :data:`_RESERVED_VECTORS` vectors
    of width ``hidden``, plus, with inter-layer dropout, the dropped outputs of
    every layer but the last.
    """
    size = layers * directions * seq_len * batch * hidden * _RESERVED_VECTORS[mode] * itemsize
    if dropout > 0 and layers > 1:
        size += (layers - 1) * seq_len * batch * directions * out_size * itemsize
    return size


def rnn_workspace_bytes(mode: int, seq_len: int, batch: int, hidden: int, directions: int, itemsize: int) -> int:
    """The cuDNN RNN workspace, modelled as the input-to-hidden GEMM of one layer
    over all steps (``gates x hidden`` per step, batch element and direction),
    which cuDNN's standard algorithm computes ahead of the recurrence."""
    return seq_len * batch * _GATES[mode] * hidden * directions * itemsize


@CUDA.implementation(aten._cudnn_rnn.default)
def _cudnn_rnn_outputs(call: OpCall) -> Any:
    """``_cudnn_rnn`` (cudnn/RNN.cpp): ``output`` made seq-major (s, b, dirs * out)
    and transposed back when ``batch_first``; ``hy``; ``cy`` (or an empty one);
    the training ``reserve`` (:func:`rnn_reserve_bytes`, empty in eval); and the
    weight buffer. A module on cuda has flattened its weights into one buffer
    (``RNNBase.flatten_parameters`` from ``_apply``), which ``_cudnn_impl``
    passes as ``weight_buf``: no copy is made, so the output aliases storage
    that is already live (the first weight's, or the buffer passed)."""
    input, weight, _stride0, weight_buf, hx, cx, mode = call.args[:7]
    dropout, train = call.args[11], call.args[12]
    t, n, hidden, out_size, layers, dirs, batch_first = _rnn_dims(call)
    output = input.new_empty((t, n, dirs * out_size))
    if batch_first:
        output = output.transpose(0, 1)
    hy = hx.new_empty((layers * dirs, n, out_size))
    cy = cx.new_empty((layers * dirs, n, hidden)) if cx is not None else hx.new_empty((0,))
    nbytes = rnn_reserve_bytes(mode, t, n, hidden, out_size, layers, dirs, dropout, input.element_size())
    reserve = input.new_empty((nbytes if train else 0,), dtype=torch.uint8)
    buf = (weight_buf if weight_buf is not None else weight[0]).detach()
    return output, hy, cy, reserve, buf


@CUDA.scratch(aten._cudnn_rnn.default)
def _cudnn_rnn_scratch(call: OpCall) -> Steps:
    """``_cudnn_rnn``: ``x = input.contiguous()`` after the ``batch_first`` transpose,
    then the outputs, then the workspace (:func:`rnn_workspace_bytes`)."""
    input, mode = call.args[0], call.args[6]
    t, n, hidden, _out, _layers, dirs, batch_first = _rnn_dims(call)
    x = input.transpose(0, 1) if batch_first else input
    item = input.element_size()
    return [
        Alloc("x", _copy_bytes_if_not_contiguous(x)),
        OUTPUTS,
        Alloc("workspace", rnn_workspace_bytes(mode, t, n, hidden, dirs, item)),
        Inexact(_CUDNN_RNN_MODEL),
    ]


def _flat_views(weight: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of ``weight`` as views into one zeroed flat buffer
    (``at::zeros(weight_buf.sizes())`` + ``get_parameters``)."""
    flat = torch.zeros(sum(w.numel() for w in weight), dtype=weight[0].dtype, device=weight[0].device)
    views, offset = [], 0
    for w in weight:
        views.append(flat[offset : offset + w.numel()].view(w.shape))
        offset += w.numel()
    return views


@CUDA.implementation(aten._cudnn_rnn_backward.default)
def _cudnn_rnn_backward_outputs(call: OpCall) -> Any:
    """``_cudnn_rnn_backward``: ``dx`` (seq-major, transposed back when
    ``batch_first``), ``dhx``, ``dcx`` and the weight gradients as views of one
    flat ``dw`` buffer; there is no meta kernel for it."""
    input, weight, hx, cx = call.args[0], call.args[1], call.args[4], call.args[5]
    mask = call.args[21]
    t, n, _hidden, _out, _layers, _dirs, batch_first = _rnn_dims(call)
    dx = input.new_empty((t, n, input.size(-1)))
    if batch_first:
        dx = dx.transpose(0, 1)
    dhx = hx.new_empty(hx.shape)
    dcx = cx.new_empty(cx.shape) if cx is not None else hx.new_empty((0,))
    dw = _flat_views(list(weight)) if mask[3] else []
    return dx, dhx, dcx, dw


@CUDA.scratch(aten._cudnn_rnn_backward.default)
def _cudnn_rnn_backward_scratch(call: OpCall) -> Steps:
    """``_cudnn_rnn_backward``: zeros for the missing output gradients; then
    ``_cudnn_rnn_backward_input`` (``x`` and ``dy`` made contiguous, ``dx``, ``dhx``,
    ``dcx``, a workspace) and ``_cudnn_rnn_backward_weight`` (``x`` made contiguous
    again, the flat ``dw``, a workspace). The outputs are recorded together after
    the first half, its own outputs standing in as one buffer until then."""
    input, hx, cx, output = call.args[0], call.args[4], call.args[5], call.args[6]
    grad_output, grad_hy, grad_cy, mode = call.args[7], call.args[8], call.args[9], call.args[10]
    t, n, hidden, _out, _layers, dirs, batch_first = _rnn_dims(call)
    item = input.element_size()
    steps: list[Any] = []
    if grad_output is None:
        steps.append(Alloc("zeros_like(output)", output.numel() * output.element_size()))
        grad_output = output
    if grad_hy is None:
        steps.append(Alloc("zeros_like(hx)", hx.numel() * hx.element_size()))
    if cx is not None and grad_cy is None:
        steps.append(Alloc("zeros_like(cx)", cx.numel() * cx.element_size()))
    x = input.transpose(0, 1) if batch_first else input
    dy = grad_output.transpose(0, 1) if batch_first else grad_output
    first_outputs = (input.numel() + hx.numel() + (cx.numel() if cx is not None else 0)) * item
    workspace = rnn_workspace_bytes(mode, t, n, hidden, dirs, item)
    steps += [
        Alloc("x (input)", _copy_bytes_if_not_contiguous(x)),
        Alloc("dy", _copy_bytes_if_not_contiguous(dy)),
        Alloc("dx, dhx, dcx", first_outputs),
        Alloc("workspace (input)", workspace),
        Free("workspace (input)"),
        Free("dy"),
        Free("x (input)"),
        Alloc("x (weight)", _copy_bytes_if_not_contiguous(x)),
        Free("dx, dhx, dcx"),
        OUTPUTS,
        Alloc("workspace (weight)", workspace),
        Inexact(_CUDNN_RNN_MODEL),
    ]
    return steps


# -- fused RNN cells ----------------------------------------------------------------

_GRU_WORKSPACE_MULTIPLIER: Final = 5


@CUDA.implementation(aten._thnn_fused_gru_cell.default)
def _fused_gru_cell(call: OpCall) -> Any:
    """``_thnn_fused_gru_cell_cuda`` (native/cuda/RNN.cu): a (n, 5h) workspace (saved
    for backward) and ``hy`` like ``hx``; there is no meta kernel."""
    hx = call.args[2]
    workspace = hx.new_empty((hx.size(0), hx.size(1) * _GRU_WORKSPACE_MULTIPLIER))
    return hx.new_empty(hx.shape), workspace


@CUDA.implementation(aten._thnn_fused_gru_cell_backward.default)
def _fused_gru_cell_backward(call: OpCall) -> Any:
    """``_thnn_fused_gru_cell_backward_cuda``: input and hidden gate gradients
    (n, 3h) each, ``grad_hx`` like ``grad_hy`` and, with biases, their sums over
    the batch (3h each)."""
    grad_hy, workspace, has_bias = call.args
    n, hidden = workspace.size(0), workspace.size(1) // _GRU_WORKSPACE_MULTIPLIER
    grad_input = workspace.new_empty((n, 3 * hidden))
    grad_hidden = workspace.new_empty((n, 3 * hidden))
    grad_hx = grad_hy.new_empty(grad_hy.shape)
    if has_bias:
        return grad_input, grad_hidden, grad_hx, grad_input.sum(0), grad_hidden.sum(0)
    empty = workspace.new_empty((0,))
    return grad_input, grad_hidden, grad_hx, empty, empty


# -- _grouped_mm -----------------------------------------------------------------


@CUDA.implementation(aten._grouped_mm.default)
def _grouped_mm(call: OpCall) -> Any:
    """``_grouped_mm_cuda`` (aten/src/ATen/native/cuda/GroupedBlas.cpp): bfloat16
    operands take CUTLASS's grouped GEMM, which the meta kernel models; any other
    dtype (float32, float16) takes ``_grouped_mm_fallback``, a loop of ``mm_out``
    into the same output (``create_grouped_gemm_output_tensor``), which the meta
    kernel refuses ("Expected inputs of BF16 type"): a mixture-of-experts model
    in float32 runs on a GPU, and is traced here as it runs there."""
    mat_a, mat_b = call.args[0], call.args[1]
    out_dtype = call.args[4] if len(call.args) > 4 else call.kwargs.get("out_dtype")
    if mat_a.dtype == mat_b.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16):
        return call.default()
    return grouped_mm_output(call)
