"""RNN routing: whole sequences to cuDNN's ``_cudnn_rnn``, single steps to the fused CUDA cell kernels.

``aten/src/ATen/native/RNN.cpp``: ``lstm`` / ``gru`` / ``rnn_tanh`` /
``rnn_relu`` with a padded input run ``_cudnn_impl`` -> ``_cudnn_rnn`` when
``cudnn_is_acceptable`` holds (under CUDA autocast after AutocastRNN.cpp's fp16
casts); the ``lstm_cell`` / ``gru_cell`` of CUDA tensors run the fused
``_thnn_fused_lstm_cell`` / ``_gru_cell`` kernels. Not routed (a GPU takes
another path than the trace): packed-sequence RNNs, and RNNs on CUDA without
cuDNN (their per-step fused cells).
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cuda.routes import (
    Handler,
    Router,
    VariableFunctions,
    aten,
    bind,
    eligible,
    on_gpu,
    route,
)

__all__ = ["GRU", "LSTM", "RNN_RELU", "RNN_TANH", "cudnn_is_acceptable"]

#: ``cudnnRNNMode_t`` (cuDNN's ``cudnn_adv`` header: ``CUDNN_RNN_RELU``,
#: ``CUDNN_RNN_TANH``, ``CUDNN_LSTM``, ``CUDNN_GRU``), the ``mode`` argument of
#: ``_cudnn_rnn`` (``aten/src/ATen/native/cudnn/RNN.cpp``).
RNN_RELU: Final = 0
RNN_TANH: Final = 1
LSTM: Final = 2
GRU: Final = 3




def cudnn_is_acceptable(t: Any) -> bool:
    """``at::native::cudnn_is_acceptable`` (``aten/src/ATen/native/TensorProperties.cpp``),
    with bfloat16 on sm80+ (``supportsBFloat16RNNWithCuDNN``, used by ``use_cudnn``)."""
    return (
        on_gpu(t)
        and torch.backends.cudnn.enabled
        and t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        and t.numel() > 0
    )


def _rnn_handler(mode: int) -> Handler:
    def handler(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (RNN.cpp) with a padded input:
        ``_cudnn_impl`` -> ``_cudnn_rnn`` when ``cudnn_is_acceptable``."""
        if kwargs or len(args) != 9 or not isinstance(args[2], (list, tuple)):
            return func(*args, **kwargs)  # the packed-sequence overloads
        input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
        if not cudnn_is_acceptable(input) or input.dim() != 3:
            return func(*args, **kwargs)
        if mode == LSTM:
            h, c = hx
        else:
            h, c = hx, None
        hidden_size, proj_size = h.size(2), 0
        if c is not None and c.size(2) != h.size(2):
            hidden_size, proj_size = c.size(2), h.size(2)
        weight_stride0 = (4 if has_biases else 2) + (1 if proj_size else 0)
        weights = list(params)
        if router.autocast_dtype() is not None and eligible(weights[0]) and weights[0].dtype != torch.float16:
            # AutocastRNN.cpp, _cudnn_rnn_cast_reflatten: input and states through
            # cached_cast(kHalf) (fp16 whatever the autocast dtype), the weights
            # copied, autograd-exposed, into fp16 (cuDNN's flat fp16 buffer is
            # modelled as one cast per weight: the same bytes).
            half = torch.float16
            input, h = router.cast(input, half, half), router.cast(h, half, half)
            c = router.cast(c, half, half) if c is not None else None
            weights = [w.to(half) for w in weights]
        out = aten._cudnn_rnn.default(
            input, weights, weight_stride0, None, h, c, mode, hidden_size, proj_size,
            num_layers, batch_first, float(dropout), bool(train), bool(bidirectional), [], None,
        )
        output, hy, cy = out[0], out[1], out[2]
        return (output, hy, cy) if mode == LSTM else (output, hy)

    return handler


for _mode, _funcs in (
    (LSTM, (VariableFunctions.lstm,)),
    (GRU, (VariableFunctions.gru,)),
    (RNN_TANH, (VariableFunctions.rnn_tanh,)),
    (RNN_RELU, (VariableFunctions.rnn_relu,)),
):
    route(*_funcs)(_rnn_handler(_mode))


@route(VariableFunctions.lstm_cell)
def _lstm_cell(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``lstm_cell`` -> ``LSTMCell<CellParams>`` (RNN.cpp): on CUDA the gates are two
    matmuls and ``_thnn_fused_lstm_cell`` (hy, cy and a (n, 4h) workspace saved for
    backward); on meta the composite cell runs elementwise ops."""
    input, hx, w_ih, w_hh, b_ih, b_hh = bind(args, kwargs, ("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), (None, None))
    if not on_gpu(input):
        return func(*args, **kwargs)
    igates = torch.matmul(input, w_ih.t())
    hgates = torch.matmul(hx[0], w_hh.t())
    hy, cy, _workspace = aten._thnn_fused_lstm_cell.default(igates, hgates, hx[1], b_ih, b_hh)
    return hy, cy


@route(VariableFunctions.gru_cell)
def _gru_cell(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``gru_cell`` -> ``GRUCell<CellParams>`` (RNN.cpp): on CUDA two matmuls and
    ``_thnn_fused_gru_cell`` (hy and a (n, 5h) workspace saved for backward)."""
    input, hx, w_ih, w_hh, b_ih, b_hh = bind(args, kwargs, ("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), (None, None))
    if not on_gpu(input):
        return func(*args, **kwargs)
    igates = torch.matmul(input, w_ih.t())
    hgates = torch.matmul(hx, w_hh.t())
    return aten._thnn_fused_gru_cell.default(igates, hgates, hx, b_ih, b_hh)[0]
