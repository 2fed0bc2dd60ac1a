"""CPU rules: convolutions (``aten.convolution`` and ``aten.convolution_backward``).

What a CPU convolution takes from the allocator depends on the backend ATen
picks and, for oneDNN, on the primitive implementation oneDNN picks (modelled
in the :mod:`~pytest_torchmem.engine.tracing.devices.cpu.onednn` package). The rules
follow torch 2.13:

1. **ATen** (``aten/src/ATen/native/Convolution.cpp``): ``_select_conv_backend``
   with ``ConvParams::use_mkldnn`` chooses oneDNN ("mkldnn") or a slow path
   (``thnn_conv2d``, ``slow_conv_dilated2d``, ``slow_conv_transpose2d``,
   ``slow_conv3d``); a 1-d convolution runs as a 2-d one on a contiguous input;
   the backend's memory format decides the ``.contiguous(fmt)`` copies.
2. **mkldnn glue** (``aten/src/ATen/native/mkldnn/Conv.cpp`` and ideep's
   ``convolution_forward``/``_backward_data``/``_backward_weights``): ideep
   reorders the operands into the formats the primitive chose, allocates the
   result in its format, books the scratchpad, and ``mkldnn_to_dense`` copies
   the result into a dense tensor (a channels-last result is copied
   ``.contiguous()`` again).
3. **oneDNN**: see :mod:`~pytest_torchmem.engine.tracing.devices.cpu.onednn`.

Not modelled (the op's outputs are counted, its scratch is not): bfloat16 and
float16 convolutions that oneDNN runs (bfloat16 from the avx512 level on,
float16 on amx; listed in ``unsupported``; below, ATen's slow paths run them
and are modelled, but for ``slow_conv_transpose3d``'s gemm, which oneDNN
computes there: ``mkldnn_bf16_gemm``) and NNPACK (reached only with oneDNN
disabled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import meta_tensor
from pytest_torchmem.engine.tracing.devices.cpu.onednn import conv_list
from pytest_torchmem.engine.tracing.devices.cpu.onednn.common import Geo
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile
from pytest_torchmem.engine.tracing.devices.cpu.reduce import acc_buffer_steps, sum_steps, uses_acc_buffer
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    OpCall,
    Output,
    Step,
    nbytes_of,
)

# torch's private names (engine/torch_compat/torch_private.py)
suggest_memory_format: Final = private("torch._prims_common.suggest_memory_format")
are_strides_like_channels_last_or_false: Final = private("torch._prims_common.are_strides_like_channels_last_or_false")
make_channels_last_strides_for: Final = private("torch._prims_common.make_channels_last_strides_for")
make_contiguous_strides_for: Final = private("torch._prims_common.make_contiguous_strides_for")
_get_nnpack_enabled: Final = private("torch._C._get_nnpack_enabled")

aten = torch.ops.aten


# -- ATen: backend selection (Convolution.cpp) ---------------------------------------------


@dataclass(frozen=True)
class _Conv:
    """One ``aten.convolution`` call, normalised as ``_convolution`` does."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int
    #: The input is 3-d: ATen views it as 4-d after ``input.contiguous()``.
    conv1d: bool

    @property
    def dim(self) -> int:
        return len(self.stride)

    def weight_shape(self) -> tuple[int, ...]:
        w = tuple(self.weight.shape)
        return (w[0], w[1], 1, w[2]) if self.conv1d else w

    def input_shape(self) -> tuple[int, ...]:
        x = tuple(self.input.shape)
        return (x[0], x[1], 1, x[2]) if self.conv1d else x


def _expand(value: Sequence[int] | int, dim: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * dim
    value = tuple(int(v) for v in value)
    return value * dim if len(value) == 1 else value


def _conv(input: torch.Tensor, weight: torch.Tensor, bias: bool, args: Sequence[Any]) -> _Conv:
    stride, padding, dilation, transposed, output_padding, groups = args
    dim = weight.dim() - 2
    c = _Conv(
        input, weight, bias, _expand(stride, dim), _expand(padding, dim), _expand(dilation, dim),
        bool(transposed), _expand(output_padding, dim), int(groups), weight.dim() == 3,
    )
    if c.conv1d:  # ConvParams::view1d_as_2d
        c = replace(
            c, stride=(1, *c.stride), padding=(0, *c.padding), dilation=(1, *c.dilation),
            output_padding=(0, *c.output_padding),
        )
    return c


def _mkldnn_enabled() -> bool:
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def _backend(c: _Conv, cpu: CpuProfile) -> str:
    """``_select_conv_backend`` for CPU tensors."""
    x, w = c.input_shape(), c.weight_shape()
    if x[0] == 0 or x[1] == 0:
        return "empty"
    dtype = c.input.dtype
    strided = any(s != 1 for s in c.stride)
    dilated = any(d != 1 for d in c.dilation)
    big_output_padding = any(op >= s for op, s in zip(c.output_padding, c.stride))
    mkldnn = False
    if _mkldnn_enabled() and not (c.transposed and big_output_padding):
        if dtype == torch.bfloat16 and cpu.onednn_bf16:
            mkldnn = True
        elif dtype == torch.float16 and "float16" in cpu.native_dtypes:
            mkldnn = True  # mkldnn_fp16_device_check: avx512_core_fp16 (the amx level)
        elif dtype == torch.float32:
            mkldnn = (
                strided or dilated or x[0] >= 16 or w[-1] != 1 or w[-2] != 1 or cpu.threads > 1
            ) and (
                c.groups > 1 or (w[-1] > 3 and w[-2] > 3) or x[0] > 1
                or x[0] * x[1] * x[2] * x[3] > 20480
            )
    if mkldnn:
        return "mkldnn_transpose" if c.transposed else "mkldnn"
    nd = len(x)
    if not c.transposed and nd == 5 and not dilated:
        return "slow3d"
    if c.transposed:
        return "slow_transpose2d" if nd == 4 else "slow_transpose3d"
    if nd == 4:
        if dilated:
            return "slow_dilated2d"
        if _nnpack(c, x, w):
            return "nnpack"
        return "slow2d"
    return "slow_dilated3d"


def _nnpack(c: _Conv, x: tuple[int, ...], w: tuple[int, ...]) -> bool:
    """``ConvParams::use_nnpack`` (reached only when oneDNN is off)."""
    return (
        _get_nnpack_enabled() and torch.backends.nnpack.is_available() and c.input.dtype == torch.float32
        and w[2] < 17 and w[3] < 17 and c.padding[0] < w[2] and c.padding[1] < w[3] and x[0] >= 16
    )


def _suggests_cl(t: torch.Tensor) -> bool:
    """``Tensor::suggest_memory_format()`` is channels-last (2-d or 3-d)."""
    if t.dim() not in (4, 5):
        return False
    fmt = suggest_memory_format(t)
    return fmt in (torch.channels_last, torch.channels_last_3d)


def _view4d_suggests_cl(t: torch.Tensor) -> bool:
    """``_suggests_cl`` of ``view4d(t.contiguous())``, the 4-d view ``_convolution``
    makes of a 1-d convolution's operands: ``unsqueeze(2)`` gives the new size-1
    dim the stride ``size[2] * stride[2]``, so a ``(N, 1, L)`` input whose channel
    stride is 1 suggests channels last."""
    shape = tuple(t.shape)
    strides = tuple(t.stride()) if t.is_contiguous() else (shape[1] * shape[2], shape[2], 1)
    shape4, strides4 = (shape[0], shape[1], 1, shape[2]), (strides[0], strides[1], shape[2] * strides[2], strides[2])
    return are_strides_like_channels_last_or_false(shape4, strides4)


def _channels_last(c: _Conv, backend: str) -> bool:
    """``determine_backend_memory_format``: channels-last for oneDNN when the
    input or the weight suggests it (never for float64), and for the slow 2-d
    paths (``thnn_conv_use_channels_last``); a 1-d convolution asks its 4-d views."""
    suggests = _view4d_suggests_cl if c.conv1d else _suggests_cl
    if backend.startswith("mkldnn"):
        return c.input.dtype != torch.float64 and (suggests(c.input) or suggests(c.weight))
    if backend in ("slow2d", "slow_dilated2d", "slow_transpose2d"):
        return (c.conv1d or c.input.dim() == 4) and (suggests(c.input) or suggests(c.weight))
    return False



def _contiguous_copy(t: torch.Tensor, cl: bool) -> int:
    """Bytes ``t.contiguous(fmt)`` allocates (0 when ``t`` already is)."""
    if t.dim() == 4 and cl:
        fmt = torch.channels_last
    elif t.dim() == 5 and cl:
        fmt = torch.channels_last_3d
    else:
        fmt = torch.contiguous_format
    return 0 if t.is_contiguous(memory_format=fmt) else nbytes_of(t)


def _geo(c: _Conv, out_spatial: Sequence[int], *, deconv: bool = False) -> Geo:
    """The oneDNN problem of a convolution (for a transposed one: of the
    deconvolution, whose src is the input and dst the output)."""
    x, w = c.input_shape(), c.weight_shape()
    g = c.groups
    if deconv:
        ic, oc = x[1] // g, w[1]
    else:
        ic, oc = x[1] // g, w[0] // g
    nd = len(x)

    def three(v: Sequence[int], fill: int) -> tuple[int, int, int]:
        v = tuple(v)
        return (fill,) * (3 - len(v)) + v  # type: ignore[return-value]

    return Geo(
        mb=x[0], g=g, ic=ic, oc=oc, i=three(x[2:], 1), o=three(out_spatial, 1), k=three(w[2:], 1),
        s=three(c.stride, 1), p=three(c.padding, 0), d=three([d - 1 for d in c.dilation], 0),
        ndims=nd, bias=c.bias, dsz=c.input.element_size(),
    )


class _Steps:
    """A little builder for a rule's steps, with generated tags."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._n = 0

    def alloc(self, nbytes: int, name: str) -> str | None:
        if nbytes <= 0:
            return None
        self._n += 1
        tag = f"{name}#{self._n}"
        self.steps.append(Alloc(tag, nbytes))
        return tag

    def free(self, *tags: str | None) -> None:
        for tag in tags:
            if tag is not None:
                self.steps.append(Free(tag))

    def outputs(self) -> None:
        self.steps.append(OUTPUTS)

    def output(self, index: int, nbytes: int) -> None:
        """The op's output ``index`` is made here (when it has bytes)."""
        if nbytes > 0:
            self.steps.append(Output(index))


def _mkldnn_forward(s: _Steps, c: _Conv, cpu: CpuProfile, out: torch.Tensor) -> bool:
    """``mkldnn_convolution`` / ``mkldnn_convolution_transpose`` on float32;
    returns False when no implementation is modelled."""
    cl = _channels_last(c, "mkldnn")
    out_sp = tuple(out.shape[2:]) if not c.conv1d else (1, out.shape[2])
    p = _geo(c, out_sp, deconv=c.transposed)
    if p.dsz != 4:
        return False
    prim = conv_list.deconv_fwd(p, cpu, cl) if c.transposed else conv_list.pick(conv_list.FWD, p, cpu, cl)
    if prim is None:
        return False
    if cl:  # the output is allocated first and handed to oneDNN
        s.outputs()
    scratch = s.alloc(prim.scratch, "scratchpad")
    src = s.alloc(prim.src, "src reorder")
    wei = s.alloc(prim.wei, "weights reorder")
    dst = s.alloc(prim.dst, "dst")
    s.free(wei, src, scratch)
    if not cl:
        # mkldnn_to_dense: a dense tensor in the public form of oneDNN's
        # format; an nhwc one is then copied .contiguous() into the output
        first = s.alloc(nbytes_of(out) if prim.nxc_result else 0, "dense nhwc")
        s.outputs()
        s.free(first, dst)
    return True


def _mkldnn_backward(
    s: _Steps, c: _Conv, cpu: CpuProfile, grad_output: torch.Tensor, mask: Sequence[bool], outs: Any
) -> bool:
    """``mkldnn_convolution_backward`` / ``..._transpose_backward`` on float32."""
    cl = _channels_last(c, "mkldnn")
    out_sp = tuple(grad_output.shape[2:]) if not c.conv1d else (1, grad_output.shape[2])
    p = _geo(c, out_sp, deconv=c.transposed)
    if p.dsz != 4:
        return False
    data = weights = None
    if mask[0]:
        data = conv_list.deconv_bwd_d(p, cpu, cl) if c.transposed else conv_list.pick(conv_list.BWD_D, p, cpu, cl)
        if data is None:
            return False
        if data.name == "brgconv_strided" and p.ic == 1 and cpu.avx512 and not c.transposed:
            s.steps.append(_STRIDED_ONE_CHANNEL_GAP)
    if mask[1] or mask[2]:
        weights = conv_list.deconv_bwd_w(p, cpu, cl) if c.transposed else conv_list.pick(conv_list.BWD_W, p, cpu, cl)
        if weights is None:
            return False
    go_copy = s.alloc(_contiguous_copy(grad_output, cl), "grad_output contiguous")
    grad_input = nbytes_of(outs[0]) if mask[0] and outs[0] is not None else 0
    if data is not None:
        if cl:
            s.output(0, grad_input)
        if c.transposed:  # forward of the swapped convolution: src is the output gradient
            go, wei, gi, scratch_b = data.src, data.wei, data.dst, data.scratch
            scratch = s.alloc(scratch_b, "scratchpad")
            go_t = s.alloc(go, "grad_output reorder")
            wei_t = s.alloc(wei, "weights reorder")
            gi_t = s.alloc(gi, "grad_input")
            s.free(wei_t, go_t, scratch)
        else:
            go_t = s.alloc(data.dst, "grad_output reorder")
            wei_t = s.alloc(data.wei, "weights reorder")
            gi_t = s.alloc(data.src, "grad_input")
            scratch = s.alloc(data.scratch, "scratchpad")
            s.free(scratch, wei_t, go_t)
        if not cl:
            if data.nxc_result:
                first = s.alloc(grad_input, "dense nhwc")
                s.output(0, grad_input)
                s.free(first)
            else:
                s.output(0, grad_input)
            s.free(gi_t)
    if weights is not None:
        go_t = s.alloc(weights.dst, "grad_output reorder")
        src_t = s.alloc(weights.src, "input reorder")
        gw_t = s.alloc(weights.wei, "grad_weight")
        scratch = s.alloc(weights.scratch, "scratchpad")
        gb_t = s.alloc(p.g * p.oc * p.dsz if mask[2] else 0, "grad_bias")
        s.free(scratch, src_t, go_t)
        gw_bytes = nbytes_of(outs[1]) if mask[1] and outs[1] is not None else 0
        if cl:
            # mkldnn_to_dense(grad_w).to(channels_last); hwio weights are
            # first copied .contiguous() by mkldnn_to_dense
            dense = s.alloc(gw_bytes, "dense grad_weight")
            plain = s.alloc(gw_bytes if weights.nxc_result else 0, "contiguous grad_weight")
            s.free(dense if weights.nxc_result else None)
            s.outputs()
            s.free(plain if weights.nxc_result else dense)
        else:
            dense = s.alloc(gw_bytes if weights.nxc_result else 0, "dense grad_weight")
            s.outputs()
            s.free(dense)
        s.free(gw_t, gb_t)
    else:
        s.outputs()
    s.free(go_copy)
    return True


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass(frozen=True)
class _Slow:
    """One group of a slow-path convolution, as the nogroup kernels see it."""

    kind: str
    n: int
    c: int  # input channels (of this group)
    oc: int  # output channels (of this group)
    in_sp: int
    out_sp: int
    ks: int
    item: int
    unit: bool  # 1x1, unit stride, no padding (no im2col)
    channels_last: bool
    bias: bool = False

    @property
    def transposed3d_held(self) -> int:
        """``slow_conv_transpose3d``'s output is ``empty_like(input)`` resized: the
        input's bytes, which it keeps when the output is not larger."""
        return self.n * self.c * self.in_sp * self.item

    @property
    def output_bytes(self) -> int:
        return self.n * self.oc * self.out_sp * self.item

    @property
    def columns(self) -> int:
        """im2col columns of all images (``thnn_conv2d``, ``slow_conv3d``)."""
        return 0 if self.unit else self.n * self.c * self.ks * self.out_sp * self.item


def _slow(c: _Conv, backend: str, out_spatial: Sequence[int]) -> _Slow:
    x, w = c.input_shape(), c.weight_shape()
    g = 1 if backend == "slow3d" else c.groups  # slow_conv3d handles groups itself
    oc = w[1] if c.transposed else w[0] // g
    unit = _prod(w[2:]) == 1 and all(v == 1 for v in c.stride) and all(v == 0 for v in c.padding)
    if c.transposed:
        unit = unit and all(v == 1 for v in c.dilation)
    if backend == "slow3d":
        unit = unit and c.groups == 1  # compute_columns3d views the input only without groups
    return _Slow(
        backend, x[0], x[1] // g, oc, _prod(x[2:]), _prod(out_spatial), _prod(w[2:]),
        c.input.element_size(), unit, _channels_last(c, backend), c.bias,
    )


def _slow_forward_group(s: _Steps, k: _Slow, output: Any) -> Any:
    """The forward of one group; ``output()`` allocates the result (the op's
    outputs, or one group's result) and returns its tag."""
    if k.kind in ("slow2d", "slow3d"):
        # compute_columns2d / slow_conv3d: columns of every image, then the output
        cols = s.alloc(k.columns, "columns")
        tag = output()
        s.free(cols)
    elif k.kind in ("slow_dilated2d", "slow_dilated3d"):
        tag = output()
        cols = s.alloc(k.c * k.ks * k.out_sp * k.item, "columns")  # one image
        s.free(cols)
    elif k.kind == "slow_transpose3d":
        # slow_conv_transpose3d_out_cpu_template: empty_like(input) resized to the
        # output (a new buffer only when larger), one image's columns (even for
        # 1x1x1), and at::ones(output spatial) with a bias
        held = k.transposed3d_held if k.output_bytes > k.transposed3d_held else 0
        first = s.alloc(held, "output before resize")
        tag = output()
        s.free(first)
        cols = s.alloc(k.oc * k.ks * k.in_sp * k.item, "columns")
        ones = s.alloc(k.out_sp * k.item if k.bias else 0, "ones")
        s.free(ones, cols)
    else:  # slow_conv_transpose2d: columns of every image, even for 1x1
        tag = output()
        cols = s.alloc(k.n * k.oc * k.ks * k.in_sp * k.item, "columns")
        s.free(cols)
    return tag


def _slow_backward_group(
    s: _Steps, k: _Slow, mask: Sequence[bool], go_copy: int, output: Any, bias_sum: Sequence[Step] = ()
) -> Any:
    """The backward of one group (``slow_conv2d_backward_cpu``,
    ``slow_conv3d_backward_cpu``, ``slow_conv_dilated*_backward_cpu``,
    ``slow_conv_transpose*_backward_cpu``); ``output(i)`` allocates gradient
    ``i`` and returns its tag. ``go_copy``: bytes of ``grad_output.contiguous()``;
    ``bias_sum``: the scratch of ``at::sum_out(grad_bias, grad_output, ...)``
    (:func:`_bias_sum`), right after the bias gradient is made."""
    tags: list[Any] = []
    if k.kind in ("slow_dilated2d", "slow_dilated3d"):
        go = s.alloc(go_copy, "grad_output contiguous")
        for i in range(3):
            if mask[i]:
                tags.append(output(i))
        cols = s.alloc(k.c * k.ks * k.out_sp * k.item, "columns")
        if mask[2]:  # grad_bias += grad_output_n.sum(dims), one image at a time
            s.free(s.alloc(k.oc * k.item, "bias sum"))
        s.free(cols, go)
        return tags
    if mask[0]:
        go = s.alloc(go_copy, "grad_output contiguous")
        tags.append(output(0))
        if k.kind == "slow3d":  # fgrad_input: always allocated
            s.free(s.alloc(k.n * k.c * k.ks * k.out_sp * k.item, "grad columns"))
        elif k.kind in ("slow_transpose2d", "slow_transpose3d"):
            s.free(s.alloc(0 if k.unit else k.oc * k.ks * k.in_sp * k.item, "grad columns"))
        # slow_conv2d: the input gradient's columns come from new[], not the allocator
        s.free(go)
    if k.kind == "slow_transpose3d" and (mask[1] or mask[2]):
        # slow_conv_transpose3d_acc_grad_parameters_cpu: both gradients resized, then
        # the columns, and the bias gradient summed while they are held (measured)
        tags += [output(i) for i in (1, 2) if mask[i]]
        go = s.alloc(go_copy, "grad_output contiguous")
        cols = s.alloc(0 if k.unit else k.oc * k.ks * k.in_sp * k.item, "columns")
        if mask[2]:
            s.steps.extend(bias_sum)
        s.free(cols, go)
        return tags
    if mask[2]:
        tags.append(output(2))
        s.steps.extend(bias_sum)
    if mask[1]:
        tags.append(output(1))
        go = s.alloc(go_copy, "grad_output contiguous")
        if k.kind in ("slow_transpose2d", "slow_transpose3d"):
            cols = s.alloc(0 if k.unit else k.oc * k.ks * k.in_sp * k.item, "columns")
        else:
            cols = s.alloc(k.columns, "columns")
        s.free(cols, go)
    return tags


_SLOW: Final = frozenset(
    {"slow2d", "slow3d", "slow_dilated2d", "slow_dilated3d", "slow_transpose2d", "slow_transpose3d"}
)


def _subtensor_copy(t: torch.Tensor, groups: int) -> int:
    """Bytes of one group's ``subtensor(t, 1, groups, g)`` (``Convolution.cpp``):
    ``t.narrow(1, n * g, n).contiguous(t.suggest_memory_format())``, a copy unless
    the slice already is (one image of a contiguous tensor)."""
    fmt = torch.channels_last if _suggests_cl(t) else torch.contiguous_format
    if t.dim() == 5 and fmt == torch.channels_last:
        fmt = torch.channels_last_3d
    part = t.narrow(1, 0, t.shape[1] // groups)
    return 0 if part.is_contiguous(memory_format=fmt) else nbytes_of(t) // groups


def _format_strides(shape: Sequence[int], channels_last: bool) -> tuple[int, ...]:
    if channels_last and len(shape) in (4, 5):
        return tuple(make_channels_last_strides_for(shape))
    return tuple(make_contiguous_strides_for(shape))


def _relaid(t: torch.Tensor, groups: int, channels_last: bool) -> bool:
    """Whether one group of ``t``, contiguous in ``t.suggest_memory_format()`` (what
    ``subtensor`` gives), is not contiguous in the kernel's format: strides compared
    in the dimensions of more than one element."""
    shape = (t.shape[0], t.shape[1] // groups, *t.shape[2:])
    given = _format_strides(shape, _suggests_cl(t))
    wanted = _format_strides(shape, channels_last)
    return any(size > 1 and a != b for size, a, b in zip(shape, given, wanted))


#: The slow kernels whose backward sums the bias gradient with
#: ``at::sum_out(grad_bias, grad_output, {0, 2, 3[, 4]})`` between the input's and the
#: weight's gradients (``slow_conv2d_backward_out_cpu``, ``slow_conv3d_backward_out_cpu``,
#: ``slow_conv_transpose2d_backward_out_cpu``; ``slow_conv_transpose3d_acc_grad_parameters_cpu``
#: on its contiguous copy, with the columns held); the dilated ones sum one image at a time.
_SUMS_BIAS: Final = frozenset({"slow2d", "slow3d", "slow_transpose2d", "slow_transpose3d"})


def _bias_sum(k: _Slow, grad_output: torch.Tensor, threads: int) -> list[Step]:
    """The scratch of the bias gradient's ``at::sum_out`` over every dim but the
    channels of ``grad_output`` (what the kernel is given): in bfloat16/float16 the
    ``float`` path of ``sum_out`` where its iterator starts with two reduced dims
    (``should_use_acc_buffer``: a batch of more than one image, laid out densely)."""
    if k.kind not in _SUMS_BIAS:
        return []
    dims = (0, *range(2, grad_output.dim()))
    if uses_acc_buffer(grad_output, dims, grad_output.dtype):
        return list(acc_buffer_steps(threads, grad_output, k.oc, "grad_bias sum"))
    return list(sum_steps(threads, grad_output, k.oc, grad_output.dtype, "grad_bias sum"))


def _view4d(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes and strides of ``view4d(t)`` (``t.unsqueeze(2)``), a 1-d convolution's
    operand as the 2-d kernels see it."""
    n, ch, length = t.shape
    s0, s1, s2 = t.stride()
    return (n, ch, 1, length), (s0, s1, length * s2, s2)


def _subtensor(t: torch.Tensor, groups: int) -> torch.Tensor:
    """One group of ``t`` as ``subtensor(t, 1, groups, g)`` gives it: the narrowed
    view where that is contiguous in ``t.suggest_memory_format()``, else a copy in it."""
    shape = (t.shape[0], t.shape[1] // groups, *t.shape[2:])
    if _subtensor_copy(t, groups) == 0:
        return meta_tensor(shape, t.dtype, t.stride())
    return meta_tensor(shape, t.dtype, _format_strides(shape, _suggests_cl(t)))


def _slow_forward(s: _Steps, c: _Conv, backend: str, out: torch.Tensor) -> None:
    """``_convolution`` on a slow path: ``input.contiguous(fmt)``, then per
    group (``subtensor``: a contiguous copy of the group's input channels) the
    nogroup kernel, and ``at::cat`` of the groups' results."""
    out_sp = tuple(out.shape[2:]) if not c.conv1d else (1, out.shape[2])
    k = _slow(c, backend, out_sp)
    x_copy = s.alloc(0 if c.conv1d else _contiguous_copy(c.input, k.channels_last), "input contiguous")
    w_copy = s.alloc(_contiguous_copy(c.weight, k.channels_last), "weight contiguous")
    if c.groups == 1 or backend == "slow3d":
        _slow_forward_group(s, k, s.outputs)
    else:
        group_out = nbytes_of(out) // c.groups
        if backend == "slow_transpose3d":
            group_out = max(group_out, k.transposed3d_held)
        per_group_in = 0 if k.n == 1 else nbytes_of(c.input) // c.groups
        results = []
        for _ in range(c.groups):
            x_g = s.alloc(per_group_in, "input group")
            results.append(_slow_forward_group(s, k, lambda: s.alloc(group_out, "group output")))
            s.free(x_g)
        s.outputs()
        s.free(*results)
    s.free(w_copy, x_copy)


def _slow_backward(
    s: _Steps, c: _Conv, backend: str, grad_output: torch.Tensor, mask: Sequence[bool], outs: Any, threads: int
) -> None:
    """``convolution_backward`` on a slow path, per group like the forward
    (copies of the group's output gradient and input), gradients concatenated."""
    out_sp = tuple(grad_output.shape[2:]) if not c.conv1d else (1, grad_output.shape[2])
    k = _slow(c, backend, out_sp)
    x_copy = s.alloc(0 if c.conv1d else _contiguous_copy(c.input, k.channels_last), "input contiguous")
    w_copy = s.alloc(_contiguous_copy(c.weight, k.channels_last), "weight contiguous")
    sizes = [nbytes_of(o) if o is not None else 0 for o in outs]
    if c.groups == 1 or backend == "slow3d":

        def output(i: int) -> Any:
            s.output(i, sizes[i])  # the gradients, in the kernel's order

        go_copy = _contiguous_copy(grad_output, k.channels_last)
        kernel_go = grad_output
        if c.conv1d:
            shape, strides = _view4d(grad_output)
            kernel_go = meta_tensor(shape, grad_output.dtype, strides)
        elif backend == "slow_transpose3d":
            kernel_go = meta_tensor(grad_output.shape, grad_output.dtype)
        bias_sum = _bias_sum(k, kernel_go, threads) if mask[2] else ()
        _slow_backward_group(s, k, mask, go_copy, output, bias_sum)
        s.outputs()
    else:
        g = c.groups
        go_g = _subtensor_copy(grad_output, g)
        # The group's gradient is laid out as the whole one suggests; the kernel
        # copies it .contiguous(its own format) where that differs (once for the
        # input's gradient, once for the weight's).
        go_kernel_copy = nbytes_of(grad_output) // g if _relaid(grad_output, g, k.channels_last) else 0
        bias_sum = _bias_sum(k, _subtensor(grad_output, g), threads) if mask[2] else ()
        x_g_bytes = 0 if k.n == 1 else nbytes_of(c.input) // g
        per: list[list[Any]] = [[], [], []]
        for _ in range(g):
            gog = s.alloc(go_g, "grad_output group")
            x_g = s.alloc(x_g_bytes, "input group")

            def output(i: int) -> Any:
                tag = s.alloc(sizes[i] // g, "group gradient")
                per[i].append(tag)
                return tag

            _slow_backward_group(s, k, mask, go_kernel_copy, output, bias_sum)
            s.free(x_g, gog)
        s.outputs()
        s.free(*per[2], *per[1], *per[0])
    s.free(w_copy, x_copy)


def _convolution_steps(call: OpCall) -> list[Step] | None:
    input, weight, bias = call.args[0], call.args[1], call.args[2]
    c = _conv(input, weight, bias is not None, call.args[3:9])
    cpu = profile_of(call)
    backend = _backend(c, cpu)
    s = _Steps()
    one_d = s.alloc(_contiguous_copy(input, False) if c.conv1d else 0, "input contiguous")
    if backend.startswith("mkldnn"):
        cl = _channels_last(c, backend)
        x_copy = s.alloc(0 if c.conv1d else _contiguous_copy(input, cl), "input contiguous")
        w_copy = s.alloc(_contiguous_copy(weight, cl), "weight contiguous")
        if input.dtype != torch.float32 or not _mkldnn_forward(s, c, cpu, call.out):
            return None
        s.free(w_copy, x_copy)
    elif backend in _SLOW:
        _slow_forward(s, c, backend, call.out)
    else:
        return None
    s.free(one_d)
    return s.steps


def _convolution_backward_steps(call: OpCall) -> list[Step] | None:
    grad_output, input, weight = call.args[0], call.args[1], call.args[2]
    mask = call.args[10]
    c = _conv(input, weight, bool(mask[2]), call.args[4:10])
    cpu = profile_of(call)
    backend = _backend(c, cpu)
    s = _Steps()
    one_d = s.alloc(_contiguous_copy(input, False) if c.conv1d else 0, "input contiguous")
    if backend.startswith("mkldnn"):
        cl = _channels_last(c, backend)
        x_copy = s.alloc(0 if c.conv1d else _contiguous_copy(input, cl), "input contiguous")
        w_copy = s.alloc(_contiguous_copy(weight, cl), "weight contiguous")
        if input.dtype != torch.float32 or not _mkldnn_backward(s, c, cpu, grad_output, mask, call.out):
            return None
        s.free(w_copy, x_copy)
    elif backend in _SLOW:
        _slow_backward(s, c, backend, grad_output, mask, call.out, cpu.threads)
    else:
        return None
    s.free(one_d)
    return s.steps


def _steps_or_default(steps: list[Step] | None) -> list[Step]:
    return steps if steps is not None else [OUTPUTS]


#: A strided backward-data of one input channel on avx512: oneDNN takes its brgemm
#: kernel or its jit kernel by a cost estimate that is not modelled (seen: a 3-d
#: convolution of 1 channel, 4^3 input, 4^3 kernel, stride 2 took the jit kernel, its
#: blocked weights 65,536 B against the brgemm kernel's 61,488 B of scratch; with 2
#: or more channels the brgemm kernel, as modelled, on every size tried).
_STRIDED_ONE_CHANNEL_GAP: Final = Inexact(
    "a strided convolution's backward of one input channel on avx512: oneDNN picks its "
    "brgemm or its jit kernel by a cost estimate that is not modelled (the brgemm "
    "kernel's buffers are counted)"
)
_LOW_PRECISION_GAP: Final = Inexact(
    "the scratch of oneDNN's bfloat16/float16 convolution kernels is not modelled; "
    "only the outputs are counted"
)


def _onednn_computes(cpu: CpuProfile, dtype: torch.dtype) -> bool:
    """``mkldnn_bf16_device_check`` / ``mkldnn_fp16_device_check``: oneDNN computes
    ``dtype`` here (``slow_conv_transpose3d``'s gemm included: ``mkldnn_bf16_gemm``,
    measured: buffers of the columns' size that no rule models)."""
    return cpu.onednn_bf16 if dtype == torch.bfloat16 else "float16" in cpu.native_dtypes


def _flag_low_precision(call: OpCall, steps: list[Step]) -> list[Step]:
    """Flag a bfloat16/float16 convolution that oneDNN runs; ATen's slow paths
    (reached where oneDNN does not compute the dtype) are modelled at any dtype,
    but for ``slow_conv_transpose3d`` where oneDNN runs its gemm."""
    dtype = call.args[0].dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return steps
    cpu = profile_of(call)
    if call.func is aten.convolution.default:
        c = _conv(call.args[0], call.args[1], call.args[2] is not None, call.args[3:9])
    else:  # convolution_backward(grad_output, input, weight, bias_sizes, ...)
        c = _conv(call.args[1], call.args[2], bool(call.args[10][2]), call.args[4:10])
    backend = _backend(c, cpu)
    if backend in _SLOW and not (backend == "slow_transpose3d" and _onednn_computes(cpu, dtype)):
        return steps
    return [_LOW_PRECISION_GAP, *steps]


@CPU.implementation(aten.convolution.default)
def _convolution_output(call: OpCall) -> Any:
    """``slow_conv_transpose3d`` makes its output as ``empty_like(input)`` and
    ``resize_``s it: an output smaller than the input keeps the input's storage
    (measured: a padded 3-d transposed convolution of a 2000-byte input into 324
    bytes holds 2000)."""
    out = call.default()
    input, weight, bias = call.args[0], call.args[1], call.args[2]
    c = _conv(input, weight, bias is not None, call.args[3:9])
    if c.groups != 1 or not isinstance(out, torch.Tensor) or _backend(c, profile_of(call)) != "slow_transpose3d":
        return out
    if nbytes_of(input) <= nbytes_of(out):
        return out
    held = torch.empty((input.numel(),), dtype=out.dtype, device=out.device)
    return held.resize_(out.shape)


@CPU.scratch(aten.convolution.default)
def _convolution(call: OpCall) -> list[Step]:
    """``at::_convolution`` on the CPU: oneDNN's reorders, result buffer and
    scratchpad (``mkldnn_convolution``), or the slow paths' im2col columns."""
    return _flag_low_precision(call, _steps_or_default(_convolution_steps(call)))


@CPU.scratch(aten.convolution_backward.default)
def _convolution_backward(call: OpCall) -> list[Step]:
    """``at::convolution_backward`` on the CPU: the contiguous output
    gradient, oneDNN's backward-data then backward-weights primitives (each
    with its reorders, result buffers and scratchpad), or the slow paths'
    columns."""
    return _flag_low_precision(call, _steps_or_default(_convolution_backward_steps(call)))
