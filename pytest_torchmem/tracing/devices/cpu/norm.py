"""CPU rules: batch, layer and group normalisation, forward and backward.

The CPU kernels keep their statistics in the parameters' dtype: a ``bfloat16``
input with ``float`` weights ("mixed type", ``is_mixed_type`` in
``native/cpu/mixed_data_type.h``, what autocast produces) gets ``float``
mean / inverse-std outputs, where the meta kernels give ``bfloat16`` ones; the
implementation rules below correct that, so that the saved statistics and the
backward see the real dtypes. Scratch follows ``native/Normalization.cpp``,
``native/cpu/batch_norm_kernel.cpp``, ``native/layer_norm.cpp``,
``native/cpu/layer_norm_kernel.cpp``, ``native/group_norm.cpp`` and
``native/cpu/group_norm_kernel.cpp``.
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch._prims_common import suggest_memory_format

from pytest_torchmem.tracing.devices.cpu.base import CPU, num_threads
from pytest_torchmem.tracing.devices.cpu.misc import arg, itemsize
from pytest_torchmem.tracing.devices.cpu.reduce import mean_steps, sum_steps
from pytest_torchmem.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Steps

aten = torch.ops.aten

_REDUCED: Final = (torch.bfloat16, torch.float16)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """``at::opmath_type``: ``float`` for reduced-precision floats, else the dtype."""
    return torch.float32 if dtype in _REDUCED else dtype


def _mixed(x: torch.Tensor, *params: Any) -> bool:
    """``is_mixed_type``: a reduced-precision input with ``float`` parameters."""
    if x.dtype not in _REDUCED:
        return False
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params)


def _param_dtype(x: torch.Tensor, mixed: bool) -> torch.dtype:
    return torch.float32 if mixed else x.dtype


def _channels_last(t: torch.Tensor) -> bool:
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return t.is_contiguous(memory_format=torch.channels_last_3d)
    return False


def _contiguous_any(t: torch.Tensor) -> bool:
    """``is_contiguous`` of ``Normalization.cpp``: contiguous in some memory format."""
    return t.is_contiguous() or _channels_last(t)


def _contiguous_or_none(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or t.is_contiguous()


def _suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``TensorBase::suggest_memory_format``: channels-last when the strides look like it."""
    return suggest_memory_format(t)


def _image_size(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[0] * x.shape[1])


def _with_float_stats(out: tuple[Any, ...], first: int = 1, count: int = 2) -> tuple[Any, ...]:
    """``out`` with its statistics (``out[first:first+count]``) in ``float``."""
    fixed = list(out)
    for i in range(first, first + count):
        t = fixed[i]
        if isinstance(t, torch.Tensor) and t.dtype != torch.float32:
            fixed[i] = torch.empty_like(t, dtype=torch.float32)
    return tuple(fixed)


# -- batch norm ------------------------------------------------------------------


def _batch_norm_args(call: OpCall) -> tuple[Any, Any, Any, Any, Any, bool]:
    """``(input, weight, bias, running_mean, running_var, training)`` of a batch-norm op."""
    name = call.func.name()
    x, weight, bias = arg(call, 0, "input"), arg(call, 1, "weight"), arg(call, 2, "bias")
    if name == "aten::_native_batch_norm_legit" and call.func._overloadname == "no_stats":
        return x, weight, bias, None, None, bool(arg(call, 3, "training"))
    running_mean, running_var = arg(call, 3, "running_mean"), arg(call, 4, "running_var")
    if name in ("aten::native_batch_norm", "aten::_native_batch_norm_legit"):
        training = bool(arg(call, 5, "training"))
    else:
        training = name == "aten::_batch_norm_with_update"
    return x, weight, bias, running_mean, running_var, training


_BATCH_NORM_FORWARD: Final = (
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default,
    aten._batch_norm_with_update.default,
    aten._batch_norm_no_update.default,
)


@CPU.implementation(*_BATCH_NORM_FORWARD)
def _batch_norm_dtypes(call: OpCall) -> Any:
    """``batch_norm_cpu`` (``Normalization.cpp``): with a mixed-type input the saved
    mean and inverse std are ``float`` (the meta kernel keeps the input dtype)."""
    out = call.func(*call.args, **call.kwargs)
    x, weight, bias, running_mean, running_var, _ = _batch_norm_args(call)
    if _mixed(x, weight, bias, running_mean, running_var):
        return _with_float_stats(out)
    return out


@CPU.scratch(*_BATCH_NORM_FORWARD)
def _batch_norm(call: OpCall) -> Steps:
    """``batch_norm_cpu`` (``Normalization.cpp``) and ``batch_norm_cpu_kernel`` /
    ``batch_norm_cpu_collect_stats_kernel`` (``cpu/batch_norm_kernel.cpp``).

    Training: the statistics are collected into ``_mean`` and ``_var_sum``
    (``C`` elements each), through a ``{threads, C}`` buffer for channels-last
    inputs (and for ``N x C x 1 x 1``); a non-contiguous input takes its mean
    with ``at::mean`` instead. The contiguous transform then computes
    per-channel ``alpha`` and ``beta`` (``C`` elements each).
    """
    x, weight, bias, running_mean, running_var, training = _batch_norm_args(call)
    if x.numel() == 0:
        return [OUTPUTS]
    mixed = _mixed(x, weight, bias, running_mean, running_var)
    channels = x.shape[1]
    param = itemsize(_param_dtype(x, mixed))
    opmath = itemsize(_opmath(x.dtype))
    image_size = _image_size(x)
    steps: list[Any] = [OUTPUTS]
    if training:
        if _contiguous_any(x):
            steps += [Alloc("_mean", channels * param), Alloc("_var_sum", channels * param)]
            if not x.is_contiguous() or image_size == 1:  # the channels-last kernel
                sums = num_threads() * channels * opmath
                steps += [Alloc("per-thread sums", sums), Free("per-thread sums")]
            steps += [Free("_mean"), Free("_var_sum")]
        else:
            # save_mean = at::mean(input, reduce_dims, dtype): the output is the op's.
            steps += mean_steps(x, channels, _param_dtype(x, mixed))
    all_contiguous = (
        _contiguous_any(x)
        and all(_contiguous_or_none(t) for t in (weight, bias, running_mean, running_var))
    )
    if all_contiguous:
        steps += [Alloc("alpha", channels * opmath), Alloc("beta", channels * opmath)]
    elif not training:
        # invstd = 1 / at::sqrt(running_var + eps): add.Scalar, sqrt, then
        # reciprocal() * 1 (ATen's Scalar / Tensor), each Scalar wrapped and cast.
        size = running_var.element_size()
        var = running_var.numel() * size
        steps += [
            Alloc("eps wrapped", 8), Alloc("eps cast", size), Alloc("running_var + eps", var),
            Free("eps cast"), Free("eps wrapped"),
            Alloc("sqrt", var), Free("running_var + eps"),
            Alloc("reciprocal", var), Alloc("one wrapped", 8), Alloc("one cast", size),
            Alloc("invstd", var), Free("one cast"), Free("one wrapped"), Free("reciprocal"), Free("sqrt"),
        ]  # fmt: skip
    return steps


_BATCH_NORM_BACKWARD: Final = (aten.native_batch_norm_backward.default, aten.batch_norm_backward.default)


@CPU.implementation(*_BATCH_NORM_BACKWARD)
def _batch_norm_backward_mask(call: OpCall) -> Any:
    """``batch_norm_backward_cpu_template`` makes ``grad_input`` only when
    ``output_mask[0]``; the fake kernel (a decomposition) always returns one."""
    out = call.func(*call.args, **call.kwargs)
    mask = arg(call, 9, "output_mask", [True, True, True])
    return tuple(t if wanted else None for t, wanted in zip(out, mask))


@CPU.scratch(*_BATCH_NORM_BACKWARD)
def _batch_norm_backward(call: OpCall) -> Steps:
    """``batch_norm_backward_cpu_template`` (``Normalization.cpp``) and
    ``batch_norm_cpu_backward_kernel`` (``cpu/batch_norm_kernel.cpp``).

    On the contiguous path ``grad_input`` is allocated twice (``empty_like`` with
    the input's suggested format, then with the contiguous one), the first given
    back when the second replaces it. The channels-last kernel (also for
    ``N x C x 1 x 1``) reduces through a ``{2, threads, C}`` buffer and keeps
    weight / mean / inverse std copies; a non-contiguous input or gradient
    reduces the gradient with ``at::sum`` first.
    """
    grad_out, x, weight = arg(call, 0, "grad_out"), arg(call, 1, "input"), arg(call, 2, "weight")
    native = call.func.name() == "aten::native_batch_norm_backward"
    training = bool(arg(call, 7, "train" if native else "update"))
    mask = arg(call, 9, "output_mask", [True, True, True])
    if x.numel() == 0:
        return [OUTPUTS]
    channels = x.shape[1]
    all_contiguous = (
        _contiguous_any(x)
        and _contiguous_any(grad_out)
        and _suggest_memory_format(x) == _suggest_memory_format(grad_out)
    )
    if not all_contiguous:
        return [OUTPUTS, *_sum_over_channels(grad_out, channels)]
    steps: list[Any] = []
    if mask[0]:
        first = Alloc("grad_input (first)", x.numel() * x.element_size())
        steps += [first, OUTPUTS, Free(first.tag)]
    else:
        steps.append(OUTPUTS)
    if x.is_contiguous() and _image_size(x) != 1:
        return steps  # batch_norm_cpu_backward_contiguous_impl: no scratch
    threads = num_threads()
    if x.dtype in _REDUCED:
        # batch_norm_cpu_backward_channels_last_internal: float weight, mean and invstd.
        steps += [Alloc(name, channels * 4) for name in ("weight_f", "mean_f", "invstd_f")]
        steps.append(Alloc("sum/dotp buffer", 2 * threads * channels * 4))
        return steps
    size = x.element_size()
    if not isinstance(weight, torch.Tensor):
        steps.append(Alloc("ones weight", channels * size))
    if not training:
        steps.append(Alloc("invstd", channels * size))
    steps.append(Alloc("sum/dotp buffer", 2 * threads * channels * size))
    return steps


def _sum_over_channels(grad_out: torch.Tensor, channels: int) -> list[Any]:
    """``at::sum(grad_out, reduce_dims)`` of the non-contiguous backward path."""
    return [
        Alloc("sum over N and spatial dims", channels * grad_out.element_size()),
        *sum_steps(grad_out, channels, grad_out.dtype),
    ]


# -- layer norm --------------------------------------------------------------------


@CPU.implementation(aten.native_layer_norm.default)
def _layer_norm_dtypes(call: OpCall) -> Any:
    """``layer_norm_cpu`` (``layer_norm.cpp``): mean and rstd are
    ``param_scalar_type(input, mixed_type)``, ``float`` for a mixed-type input."""
    out = call.func(*call.args, **call.kwargs)
    x, weight, bias = arg(call, 0, "input"), arg(call, 2, "weight"), arg(call, 3, "bias")
    return _with_float_stats(out) if _mixed(x, weight, bias) else out


def _copies_if_strided(*tensors: Any) -> list[Any]:
    """``expect_contiguous()`` copies of non-contiguous operands, held to the end."""
    return [
        Alloc(f"contiguous copy {i}", t.numel() * t.element_size())
        for i, t in enumerate(tensors)
        if isinstance(t, torch.Tensor) and not t.is_contiguous()
    ]


@CPU.scratch(aten.native_layer_norm.default)
def _layer_norm(call: OpCall) -> Steps:
    """``layer_norm_cpu`` (``layer_norm.cpp``): ``input``, ``weight`` and ``bias`` are
    made contiguous (``expect_contiguous``) before the outputs; the kernel
    (``LayerNormKernelImplInternal``) takes nothing more."""
    x, weight, bias = arg(call, 0, "input"), arg(call, 2, "weight"), arg(call, 3, "bias")
    return [*_copies_if_strided(x, weight, bias), OUTPUTS]


@CPU.scratch(aten.native_layer_norm_backward.default)
def _layer_norm_backward(call: OpCall) -> Steps:
    """``layer_norm_backward_cpu`` (``layer_norm.cpp``) and
    ``LayerNormBackwardKernelImplInternal`` (``cpu/layer_norm_kernel.cpp``):
    ``dY.contiguous()``, and when ``dgamma`` or ``dbeta`` is wanted a
    ``{2, threads, N}`` buffer in the input dtype (two-pass column reduction)."""
    grad_out, x = arg(call, 0, "grad_out"), arg(call, 1, "input")
    normalized_shape = arg(call, 2, "normalized_shape")
    weight, bias = arg(call, 5, "weight"), arg(call, 6, "bias")
    mask = arg(call, 7, "output_mask", [True, True, True])
    steps: list[Any] = [*_copies_if_strided(x, weight, bias), OUTPUTS]
    inner = 1
    for size in normalized_shape:
        inner *= int(size)
    rows = x.numel() // inner if inner else 0
    if rows == 0:
        return steps
    if not grad_out.is_contiguous():
        steps.append(Alloc("dY contiguous", grad_out.numel() * grad_out.element_size()))
    if mask[1] or mask[2]:
        steps.append(Alloc("dgamma/dbeta buffer", 2 * num_threads() * inner * x.element_size()))
    return steps


# -- group norm --------------------------------------------------------------------


@CPU.implementation(aten.native_group_norm.default)
def _group_norm_dtypes(call: OpCall) -> Any:
    """``native_group_norm`` (``group_norm.cpp``): mean and rstd are ``float`` for a
    mixed-type input."""
    out = call.func(*call.args, **call.kwargs)
    x, weight, bias = arg(call, 0, "input"), arg(call, 1, "weight"), arg(call, 2, "bias")
    return _with_float_stats(out) if _mixed(x, weight, bias) else out


@CPU.implementation(aten.native_group_norm_backward.default)
def _group_norm_backward_dtypes(call: OpCall) -> Any:
    """``native_group_norm_backward`` (``group_norm.cpp``): ``dX`` is ``empty_like(X)``
    and ``dgamma``/``dbeta`` ``empty_like(gamma)``; with ``float`` statistics of a
    mixed-type input the fake kernel promotes ``dX`` to ``float``."""
    out = call.func(*call.args, **call.kwargs)
    x, weight = arg(call, 1, "input"), arg(call, 4, "weight")
    fixed = []
    for t, like in zip(out, (x, weight, weight)):
        if isinstance(t, torch.Tensor) and isinstance(like, torch.Tensor) and t.dtype != like.dtype:
            t = torch.empty_like(t, dtype=like.dtype)
        fixed.append(t)
    return tuple(fixed)


def _group_norm_dims(call: OpCall, first: int) -> tuple[int, int, int, int]:
    """``(N, C, HxW, group)``, the int arguments from position ``first`` on."""
    n, c, hxw, group = (int(arg(call, first + i, name)) for i, name in enumerate(("N", "C", "HxW", "group")))
    return n, c, hxw, group


@CPU.scratch(aten.native_group_norm.default)
def _group_norm(call: OpCall) -> Steps:
    """``GroupNormKernelImplChannelsLastInternal`` (``cpu/group_norm_kernel.cpp``):
    channels-last inputs use a ``{N*G, 2*D}`` scale/bias buffer when ``HxW < 1024``,
    else ``{threads, N, 2C}`` partial sums and a ``{N, 2G}`` buffer (opmath dtype).
    Contiguous inputs take nothing."""
    x = arg(call, 0, "input")
    n, c, hxw, group = _group_norm_dims(call, 3)
    if _suggest_memory_format(x) == torch.contiguous_format or x.numel() == 0:
        return [OUTPUTS]
    opmath = itemsize(_opmath(x.dtype))
    if hxw < 1024:
        return [OUTPUTS, Alloc("scale/bias", n * 2 * c * opmath)]
    return [
        OUTPUTS,
        Alloc("per-thread moments", num_threads() * n * 2 * c * opmath),
        Alloc("mean/rstd", n * 2 * group * opmath),
    ]


@CPU.scratch(aten.native_group_norm_backward.default)
def _group_norm_backward(call: OpCall) -> Steps:
    """``GroupNormBackwardKernelImplInternal`` / ``...ChannelsLastInternal``
    (``cpu/group_norm_kernel.cpp``): ``ds`` and ``db`` of ``{N, C}`` in the opmath
    dtype; channels-last with ``HxW >= 2048`` adds ``{threads, N, 2C}`` partials
    and a ``{N, 2G}`` buffer."""
    x = arg(call, 1, "input")
    n, c, hxw, group = _group_norm_dims(call, 5)
    if x.numel() == 0:
        return [OUTPUTS]
    opmath = itemsize(_opmath(x.dtype))
    steps: list[Any] = [OUTPUTS, Alloc("ds", n * c * opmath), Alloc("db", n * c * opmath)]
    if _suggest_memory_format(x) != torch.contiguous_format and hxw >= 2048:
        steps += [
            Alloc("per-thread gradients", num_threads() * n * 2 * c * opmath),
            Alloc("ds/db times gamma", n * 2 * group * opmath),
        ]
    return steps
