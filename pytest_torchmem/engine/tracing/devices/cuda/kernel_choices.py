"""The dropout, batch-norm and softmax calls a GPU runs with other kernels than the trace's meta composites take.

* **dropout** (``aten/src/ATen/native/Dropout.cpp``, ``dropout``): with
  ``train`` and ``is_fused_kernel_acceptable`` (a CUDA input, ``0 < p < 1``,
  ``numel > 0``) CUDA runs ``native_dropout`` (output and a bool mask, saved
  for ``native_dropout_backward``); on meta the composite takes the
  ``bernoulli_``/``div_``/``mul`` path. ``dropout_`` (in place),
  ``feature_dropout`` (``dropout1d/2d/3d``) and the alpha dropouts take the
  composite path on CUDA too, so they are not routed;
* **batch norm** (``aten/src/ATen/native/Normalization.cpp``,
  ``_batch_norm_impl_index``): ``cudnn_batch_norm`` when its conditions hold,
  else ``native_batch_norm`` as on meta; ``instance_norm``'s composite is
  replayed so that its inner ``batch_norm`` is routed the same way;
* **softmax** (``aten/src/ATen/native/SoftMax.cpp``, ``softmax`` /
  ``log_softmax``): an fp16 CUDA input asked for fp32 runs the kernel with
  ``half_to_float`` instead of casting first.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cuda.routes import (
    Handler,
    Router,
    TensorBase,
    VariableFunctions,
    aten,
    bind,
    on_gpu,
    route,
)

__all__ = [
    "CUDNN_BN_MAX_INFERENCE_BATCH",
    "CUDNN_BN_MAX_TRAINING_BATCH",
    "CUDNN_BN_MIN_EPSILON",
    "suggest_memory_format",
    "use_cudnn_batch_norm",
]

#: ``CUDNN_BN_MIN_EPSILON`` of cuDNN >= 7.5 (``cudnn.h``), as
#: ``at::cuda::detail::CUDAHooks::batchnormMinEpsilonCuDNN`` returns it
#: (``aten/src/ATen/cuda/detail/CUDAHooks.cpp``; ``pxor %xmm0,%xmm0`` in every release).
CUDNN_BN_MIN_EPSILON: Final = 0.0
#: The largest batch cuDNN's batch norm takes in training, and in inference
#: (``aten/src/ATen/native/Normalization.cpp: _select_batch_norm_backend``:
#: ``input.sym_size(0) <= 880801`` / ``<= 65535``).
CUDNN_BN_MAX_TRAINING_BATCH: Final = 880801
CUDNN_BN_MAX_INFERENCE_BATCH: Final = 65535


# -- dropout --------------------------------------------------------------------


@route(VariableFunctions.dropout)
def _dropout(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::native::dropout``: the fused ``native_dropout`` when
    ``is_fused_kernel_acceptable(input, p)`` and ``train``."""
    input, p, train = bind(args, kwargs, ("input", "p", "train"), ())
    if (
        train
        and on_gpu(input)
        and not input.is_nested
        and 0 < p < 1
        and input.numel() > 0
    ):
        return aten.native_dropout.default(input, p, True)[0]
    return func(*args, **kwargs)


# -- batch norm -----------------------------------------------------------------


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``TensorBase::suggest_memory_format``: channels-last when the strides are."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def use_cudnn_batch_norm(
    input: torch.Tensor,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    training: bool,
    eps: float,
    cudnn_enabled: bool,
) -> bool:
    """The ``use_cudnn`` condition of ``_batch_norm_impl_index`` (``aten/src/ATen/native/Normalization.cpp``;
    ``_select_batch_norm_backend`` from torch 2.10)."""
    return (
        on_gpu(input)
        and isinstance(weight, torch.Tensor)
        and isinstance(bias, torch.Tensor)
        and input.dtype != torch.bfloat16
        and weight.dtype != torch.bfloat16
        and (input.dtype != torch.float16 or weight.dtype == torch.float32)
        and input.dtype in (torch.float16, torch.float32, torch.float64)
        and (
            (isinstance(running_mean, torch.Tensor) and isinstance(running_var, torch.Tensor))
            or (running_mean is None and running_var is None and training)
        )
        and input.dim() >= 3
        and (
            (input.size(0) <= CUDNN_BN_MAX_TRAINING_BATCH and training)
            or (input.size(0) <= CUDNN_BN_MAX_INFERENCE_BATCH and not training)
        )
        and eps >= CUDNN_BN_MIN_EPSILON
        and bool(cudnn_enabled)
    )


def _cudnn_batch_norm(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, running_mean: Any, running_var: Any,
    training: bool, momentum: float, eps: float,
) -> torch.Tensor:
    """The cuDNN branch of ``_batch_norm_impl_index``: contiguous operands, then
    ``cudnn_batch_norm`` (output, save_mean, save_var, reserve)."""
    input_c = input.contiguous(memory_format=suggest_memory_format(input))
    rmean = running_mean.contiguous() if running_mean is not None else None
    rvar = running_var.contiguous() if running_var is not None else None
    out = aten.cudnn_batch_norm.default(
        input_c, weight.contiguous(), bias.contiguous(), rmean, rvar, bool(training), momentum, eps
    )
    return out[0]


@route(VariableFunctions.batch_norm)
def _batch_norm(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::batch_norm`` -> ``_batch_norm_impl_index``: cuDNN when it may, else the
    native kernel (the same ops as on meta)."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn_enabled")
    input, weight, bias, rmean, rvar, training, momentum, eps, cudnn_enabled = bind(args, kwargs, names, ())
    if use_cudnn_batch_norm(input, weight, bias, rmean, rvar, training, eps, cudnn_enabled):
        return _cudnn_batch_norm(input, weight, bias, rmean, rvar, training, momentum, eps)
    return func(*args, **kwargs)


@route(VariableFunctions.instance_norm)
def _instance_norm(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::instance_norm`` (Normalization.cpp): the input viewed as ``(1, b*c, ...)``
    through ``batch_norm`` with repeated affine parameters and running stats,
    replayed here so that the inner ``batch_norm`` takes cuDNN when it may."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "use_input_stats", "momentum", "eps", "cudnn_enabled")
    input, weight, bias, rmean, rvar, use_input_stats, momentum, eps, cudnn_enabled = bind(args, kwargs, names, ())
    if not on_gpu(input) or input.dim() < 2:
        return func(*args, **kwargs)
    b, c = input.size(0), input.size(1)
    shape = (1, b * c, *input.shape[2:])
    input_r = input.contiguous().view(shape)
    weight_ = weight.repeat(b) if weight is not None else None
    bias_ = bias.repeat(b) if bias is not None else None
    rmean_ = rmean.repeat(b) if rmean is not None else None
    rvar_ = rvar.repeat(b) if rvar is not None else None
    if not use_cudnn_batch_norm(input_r, weight_, bias_, rmean_, rvar_, use_input_stats, eps, cudnn_enabled):
        return func(*args, **kwargs)
    out = _cudnn_batch_norm(input_r, weight_, bias_, rmean_, rvar_, use_input_stats, momentum, eps)
    with torch.no_grad():
        if rmean is not None:
            torch.ops.aten.alias(rmean).copy_(rmean_.view(b, c).mean(0, keepdim=False))
        if rvar is not None:
            torch.ops.aten.alias(rvar).copy_(rvar_.view(b, c).mean(0, keepdim=False))
    return out.view(input.shape)


# -- softmax ----------------------------------------------------------------------


def _softmax_handler(op: Any) -> Handler:
    def handler(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``softmax`` / ``log_softmax`` (SoftMax.cpp): a CUDA fp16 input asked for an
        fp32 result runs ``_softmax(input, dim, half_to_float=True)``, with no
        cast copy (elsewhere, and on meta, the input is converted first)."""
        if len(args) >= 2 and isinstance(args[0], torch.Tensor) and isinstance(args[1], int):
            input, dim = args[0], args[1]
            dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
            if (
                on_gpu(input)
                and input.dtype == torch.float16
                and dtype == torch.float32
                and len(args) <= 3
                and set(kwargs) <= {"dtype"}
            ):
                return op(input, dim, True)
        return func(*args, **kwargs)

    return handler


route(VariableFunctions.softmax, TensorBase.softmax)(_softmax_handler(aten._softmax.default))
route(VariableFunctions.log_softmax, TensorBase.log_softmax)(
    _softmax_handler(aten._log_softmax.default)
)
