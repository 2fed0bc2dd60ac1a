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

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, itemsize
from pytest_torchmem.engine.tracing.devices.cpu.reduce import (
    acc_buffer_steps,
    mean_steps,
    sum_steps,
    uses_acc_buffer,
)
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Output, Steps, nbytes_of

# torch's private names (engine/torch_compat/torch_private.py)
suggest_memory_format: Final = private("torch._prims_common.suggest_memory_format")

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
    mean and inverse std are ``float`` (the meta kernel keeps the input dtype); an
    input in neither layout (a transposed view) gets an output laid out as it
    suggests, ``empty_like(self, self.suggest_memory_format())``, where the meta
    kernel keeps the input's strides."""
    out = call.default()
    x, weight, bias, running_mean, running_var, _ = _batch_norm_args(call)
    if isinstance(out[0], torch.Tensor) and not _contiguous_any(x):
        fmt = _suggest_memory_format(x)
        if not out[0].is_contiguous(memory_format=fmt):
            out = (torch.empty_like(out[0], memory_format=fmt), *out[1:])
    if _mixed(x, weight, bias, running_mean, running_var):
        return _with_float_stats(out)
    return out


@CPU.scratch(*_BATCH_NORM_FORWARD)
def _batch_norm(call: OpCall) -> Steps:
    """``batch_norm_cpu`` (``Normalization.cpp``) and ``batch_norm_cpu_kernel`` /
    ``batch_norm_cpu_collect_stats_kernel`` (``cpu/batch_norm_kernel.cpp``).

    Training: the statistics are collected into ``_mean`` and ``_var_sum``
    (``C`` elements each), through a ``{threads, C}`` buffer for channels-last
    inputs (and for ``N x C x 1 x 1``) when there are more than ``threads``
    rows of ``C`` values (``N > num_threads``); a non-contiguous input takes its mean
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
            # the channels-last kernel reduces through {threads, C}: for float and
            # double only when N*H*W > threads (as measured with torch 2.13; the
            # reduced-precision kernel takes the buffer whatever the row count)
            rows = x.numel() // channels
            threads = profile_of(call).threads
            many_rows = rows > threads or x.dtype in _REDUCED
            if (not x.is_contiguous() or image_size == 1) and many_rows:
                sums = threads * channels * opmath
                steps += [Alloc("per-thread sums", sums), Free("per-thread sums")]
            steps += [Free("_mean"), Free("_var_sum")]
        else:
            # the output, then save_mean = at::mean(input, reduce_dims[, dtype]) with
            # its scratch, then save_var = at::empty({C}) (and the rest)
            steps = [Output(0), Output(1), *mean_steps(profile_of(call).threads, x, channels, _param_dtype(x, mixed)), OUTPUTS]
    all_contiguous = (
        _contiguous_any(x)
        and all(_contiguous_or_none(t) for t in (weight, bias, running_mean, running_var))
    )
    if all_contiguous:
        steps += [Alloc("alpha", channels * opmath), Alloc("beta", channels * opmath)]
    elif not training:
        # invstd = 1 / at::sqrt(running_var + eps): add.Scalar (eps wrapped and cast),
        # sqrt, then ATen's Scalar / Tensor, empty_like(y).fill_(1).div_(y)
        # (TensorOperators.h); the temporaries die at the end of the statement.
        size = running_var.element_size()
        var = running_var.numel() * size
        steps += [
            Alloc("eps wrapped", 8), Alloc("eps cast", size), Alloc("running_var + eps", var),
            Free("eps cast"), Free("eps wrapped"),
            Alloc("sqrt", var), Alloc("invstd", var), Free("sqrt"), Free("running_var + eps"),
        ]  # fmt: skip
    if not all_contiguous:
        # batch_norm_cpu_transform_input_template: a missing weight or bias is a
        # scalar_tensor_static(1 or 0) of the input's type for the TensorIterator
        for name, t in (("weight 1", weight), ("bias 0", bias)):
            if not isinstance(t, torch.Tensor):
                steps.append(Alloc(name, x.element_size()))
    return steps


_BATCH_NORM_BACKWARD: Final = (aten.native_batch_norm_backward.default, aten.batch_norm_backward.default)


@CPU.implementation(*_BATCH_NORM_BACKWARD)
def _batch_norm_backward_mask(call: OpCall) -> Any:
    """``batch_norm_backward_cpu_template`` makes ``grad_input`` only when
    ``output_mask[0]``, laid out as the input suggests (``empty_like(input,
    input.suggest_memory_format())``); the fake kernel (a decomposition) always
    returns one, laid out as the input (or contiguous for a channels-last
    ``bfloat16`` one), which decides whether autograd copies it to a leaf's layout."""
    out = list(call.default())
    mask = arg(call, 9, "output_mask", [True, True, True])
    x, grad_input = arg(call, 1, "input"), out[0]
    if isinstance(grad_input, torch.Tensor):
        fmt = _suggest_memory_format(x)
        if not grad_input.is_contiguous(memory_format=fmt):
            out[0] = torch.empty_like(grad_input, memory_format=fmt)
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
        return [OUTPUTS, *_sum_over_channels(profile_of(call).threads, grad_out, channels)]
    steps: list[Any] = []
    if mask[0]:
        first = Alloc("grad_input (first)", x.numel() * x.element_size())
        steps += [first, OUTPUTS, Free(first.tag)]
    else:
        steps.append(OUTPUTS)
    if x.is_contiguous() and _image_size(x) != 1:
        return steps  # batch_norm_cpu_backward_contiguous_impl: no scratch
    threads = profile_of(call).threads
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


def _sum_over_channels(threads: int, grad_out: torch.Tensor, channels: int) -> list[Any]:
    """``at::sum(grad_out, reduce_dims)`` of the non-contiguous backward path (in
    ``float`` for a reduced-precision gradient whose layout starts with two reduced
    dimensions, ``should_use_acc_buffer``)."""
    dims = [0, *range(2, grad_out.dim())]
    if uses_acc_buffer(grad_out, dims, grad_out.dtype):
        inner = acc_buffer_steps(threads, grad_out, channels)
    else:
        inner = sum_steps(threads, grad_out, channels, grad_out.dtype)
    return [Alloc("sum over N and spatial dims", channels * grad_out.element_size()), *inner]


# -- layer norm --------------------------------------------------------------------


@CPU.implementation(aten.native_layer_norm.default)
def _layer_norm_dtypes(call: OpCall) -> Any:
    """``layer_norm_cpu`` (``layer_norm.cpp``): mean and rstd are
    ``param_scalar_type(input, mixed_type)``, ``float`` for a mixed-type input."""
    out = call.default()
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


@CPU.implementation(aten.native_layer_norm_backward.default)
def _layer_norm_backward_layout(call: OpCall) -> Any:
    """``layer_norm_backward_cpu`` (``layer_norm.cpp``) makes ``dX`` contiguous
    (``empty_like`` of the contiguous ``X``) whatever the layouts of ``X`` and
    ``dY``; the fake kernel (a decomposition) follows ``dY``."""
    out = call.default()
    dx = out[0]
    if isinstance(dx, torch.Tensor) and not dx.is_contiguous():
        return (torch.empty_like(dx, memory_format=torch.contiguous_format), *out[1:])
    return out


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
        steps.append(Alloc("dgamma/dbeta buffer", 2 * profile_of(call).threads * inner * x.element_size()))
    return steps


# -- group norm --------------------------------------------------------------------


@CPU.implementation(aten.native_group_norm.default)
def _group_norm_dtypes(call: OpCall) -> Any:
    """``native_group_norm`` (``group_norm.cpp``): mean and rstd are ``float`` for a
    mixed-type input."""
    out = call.default()
    x, weight, bias = arg(call, 0, "input"), arg(call, 1, "weight"), arg(call, 2, "bias")
    return _with_float_stats(out) if _mixed(x, weight, bias) else out


@CPU.implementation(aten.native_group_norm_backward.default)
def _group_norm_backward_dtypes(call: OpCall) -> Any:
    """``native_group_norm_backward`` (``group_norm.cpp``): ``dX`` is ``empty_like(X)``
    and ``dgamma``/``dbeta`` ``empty_like(gamma)``; with ``float`` statistics of a
    mixed-type input the fake kernel promotes ``dX`` to ``float``, and it lays
    ``dX`` out like ``dY`` (a decomposition), not like ``X``."""
    out = call.default()
    x, weight = arg(call, 1, "input"), arg(call, 4, "weight")
    fixed = []
    for index, (t, like) in enumerate(zip(out, (x, weight, weight))):
        if index == 0 and isinstance(t, torch.Tensor) and t.stride() != x.stride():
            t = torch.empty_like(x)  # X is contiguous in its suggested format (checked)
        if isinstance(t, torch.Tensor) and isinstance(like, torch.Tensor) and t.dtype != like.dtype:
            t = torch.empty_like(t, dtype=like.dtype)
        fixed.append(t)
    return tuple(fixed)


def _group_norm_dims(call: OpCall, first: int) -> tuple[int, int, int, int]:
    """``(N, C, HxW, group)``, the int arguments from position ``first`` on."""
    n, c, hxw, group = (int(arg(call, first + i, name)) for i, name in enumerate(("N", "C", "HxW", "group")))
    return n, c, hxw, group


def _input_contiguous(x: torch.Tensor) -> list[Any]:
    """From torch 2.14 ``native_group_norm`` and its backward make ``X`` contiguous in
    its suggested format inside the CPU kernel, after (forward) or before (backward)
    their outputs: a scratch copy where ``X`` is not (the profiler's op events of 2.14.1
    and 2.15.0). Up to 2.13 the composite ``group_norm`` made ``input.contiguous()``
    before the op, which saved that copy for backward (a tensor the trace sees)."""
    if torch_minor() < (2, 14) or x.is_contiguous(memory_format=_suggest_memory_format(x)):
        return []
    return [Alloc("X.contiguous()", nbytes_of(x))]


@CPU.scratch(aten.native_group_norm.default)
def _group_norm(call: OpCall) -> Steps:
    """``GroupNormKernelImplChannelsLastInternal`` (``cpu/group_norm_kernel.cpp``):
    channels-last inputs use a ``{N*G, 2*D}`` scale/bias buffer when ``HxW < 1024``,
    else ``{threads, N, 2C}`` partial sums and a ``{N, 2G}`` buffer (opmath dtype).
    Contiguous inputs take nothing."""
    x = arg(call, 0, "input")
    n, c, hxw, group = _group_norm_dims(call, 3)
    if _suggest_memory_format(x) == torch.contiguous_format or x.numel() == 0:
        return [OUTPUTS, *_input_contiguous(x)]
    opmath = itemsize(_opmath(x.dtype))
    if hxw < 1024:
        return [OUTPUTS, Alloc("scale/bias", n * 2 * c * opmath)]
    return [
        OUTPUTS,
        Alloc("per-thread moments", profile_of(call).threads * n * 2 * c * opmath),
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
    steps: list[Any] = []
    dy = arg(call, 0, "grad_out")
    if torch_minor() >= (2, 14) and not dy.is_contiguous(memory_format=_suggest_memory_format(x)):
        # From 2.14 the kernel makes dY contiguous in X's format itself (the profiler's op
        # events of 2.14.1/2.15.0: contiguous inside native_group_norm_backward); up to 2.13
        # the autograd formula did, before the op (a copy the trace sees).
        steps.append(Alloc("dY.contiguous()", nbytes_of(dy)))
    steps += [*_input_contiguous(x), OUTPUTS, Alloc("ds", n * c * opmath), Alloc("db", n * c * opmath)]
    if _suggest_memory_format(x) != torch.contiguous_format and hxw >= 2048:
        steps += [
            Alloc("per-thread gradients", profile_of(call).threads * n * 2 * c * opmath),
            Alloc("ds/db times gamma", n * 2 * group * opmath),
        ]
    return steps
