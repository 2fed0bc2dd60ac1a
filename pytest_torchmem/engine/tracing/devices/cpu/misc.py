"""CPU rules: elementwise kernels (TensorIterator type promotion), dropout, and the
small helpers the normalisation and reduction rule modules share.

Type promotion
--------------
A binary ATen kernel builds a ``TensorIterator`` with
``promote_inputs_to_common_dtype(true)`` (``build_borrowing_binary_op``,
``build_borrowing_comparison_op`` in ``aten/src/ATen/TensorIterator.cpp``). On
the CPU, ``TensorIteratorBase::compute_types`` then replaces every input whose
dtype is not the common dtype by ``input.to(common_dtype)`` -- a real copy of
the input's ``numel`` elements, freed when the kernel returns -- and, for
arithmetic ops (``cast_common_dtype_to_outputs(true)``), gives an output of
another dtype (``bf16.add_(f32)``) a temporary of the common dtype that is
copied back at the end. A Python number is a 0-dim "wrapped number" tensor
(``double``, ``int64``, ``bool`` or ``complex128``), so ``x_f32 * 0.5`` casts
8 bytes of ``double`` into a 4-byte ``float`` temporary.

The ``.Scalar`` overloads (``mul.Scalar``, ``div_.Scalar``, ``eq.Scalar``...)
make that wrapped tensor themselves (``wrapped_scalar_tensor`` in
``BinaryOps.cpp`` / the structured meta functions), inside the kernel: the fake
trace sees a Python number in a ``Scalar`` slot and must add it. Where a Python
caller passes the number in a ``Tensor`` slot, the Python argument parser wraps
it before the kernel; the tracker already charges that one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.autograd_paths import in_place_twin
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile
from pytest_torchmem.engine.tracing.devices.memo import BoundedMemo
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Steps

__all__ = [
    "arg",
    "itemsize",
    "meta_tensor",
    "wrapped_nbytes",
    "promotion_casts",
    "transpose_copy",
    "scalar_comparison",
    "view_strides",
    "broadcast_shape",
    "index_long_copies",
]

# torch's private names (engine/torch_compat/torch_private.py)
compute_elementwise_output_strides: Final = private("torch._prims_common.compute_elementwise_output_strides")
_DisableTorchDispatch: Final = private("torch._C._DisableTorchDispatch")

aten = torch.ops.aten

def arg(call: OpCall, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``call``, positional at ``index`` or keyword."""
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


@functools.cache
def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _number_dtype(value: Any) -> torch.dtype | None:
    """dtype of the 0-dim tensor ATen wraps a Python number in (``scalar_to_tensor``)."""
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return torch.float64
    if isinstance(value, complex):
        return torch.complex128
    return None


def wrapped_nbytes(value: Any) -> int:
    """Bytes of the wrapped-number tensor ATen makes of the Python number ``value``."""
    dtype = _number_dtype(value)
    return 0 if dtype is None else itemsize(dtype)


def meta_tensor(
    shape: Sequence[int], dtype: torch.dtype, strides: Sequence[int] | None = None
) -> torch.Tensor:
    """A meta tensor that stands for an operand a kernel makes (a 0-dim constant, a
    view, a copy), to read its dtype promotion or layout from; made outside the
    trace's dispatch modes, which would otherwise track it."""
    with _DisableTorchDispatch():
        if strides is None:
            return torch.empty(tuple(shape), dtype=dtype, device="meta")
        return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype, device="meta")


def _operand(value: Any) -> tuple[torch.dtype, int] | None:
    """``(dtype, numel)`` of a TensorIterator input: a tensor, or a wrapped number."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.numel()
    dtype = _number_dtype(value)
    return None if dtype is None else (dtype, 1)


def _common_dtype(inputs: Sequence[Any], *, int_to_float: bool) -> torch.dtype | None:
    """``TensorIteratorBase::compute_common_dtype`` for two inputs (``torch.result_type``)."""
    if len(inputs) != 2 or not any(isinstance(v, torch.Tensor) for v in inputs):
        return None
    try:
        # Read from the dtypes alone: without the trace's dispatch modes, which
        # would otherwise hash the fake arguments for their cache on every call.
        with _DisableTorchDispatch():
            dtype = torch.result_type(inputs[0], inputs[1])
    except (RuntimeError, TypeError):
        return None
    if int_to_float and not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.get_default_dtype()
    return dtype


def promotion_casts(
    inputs: Sequence[Any],
    output: torch.Tensor | None = None,
    *,
    int_to_float: bool = False,
    cast_output: bool = True,
) -> list[Alloc]:
    """The temporaries ``TensorIteratorBase::compute_types`` makes on the CPU.

    ``inputs`` are the iterator's inputs (tensors or Python numbers); ``output``
    an output the caller provides (in-place or ``out=``), whose dtype must be
    cast to when ``cast_output`` (``cast_common_dtype_to_outputs``).
    """
    common = _common_dtype(inputs, int_to_float=int_to_float)
    if common is None:
        return []
    size = itemsize(common)
    steps: list[Alloc] = []
    if cast_output and isinstance(output, torch.Tensor) and output.dtype != common:
        steps.append(Alloc("common-dtype output", output.numel() * size))
    for i, value in enumerate(inputs):
        operand = _operand(value)
        if operand is not None and operand[0] != common:
            steps.append(Alloc(f"input {i} as {common}", operand[1] * size))
    return steps


def scalar_comparison(t: torch.Tensor, value: Any, mask: str) -> list[Alloc | Free]:
    """``t == value`` (``t != value``...) called inside a kernel: ``eq.Scalar`` wraps the
    number, casts it to the common dtype (``promotion_casts``) and makes the ``bool``
    mask, named ``mask`` and left to the caller to free; the wrapped number and its
    cast are freed when the comparison returns."""
    wrapped = f"{mask}: wrapped {value!r}"
    casts = promotion_casts([t, value])
    return [
        Alloc(wrapped, wrapped_nbytes(value)),
        *casts,
        Alloc(mask, t.numel()),
        Free(wrapped),
        *(Free(c.tag) for c in casts),
    ]


def _scalar_wrap(values: Iterable[Any]) -> list[Alloc]:
    return [
        Alloc(f"wrapped scalar {i}", wrapped_nbytes(v))
        for i, v in enumerate(values)
        if not isinstance(v, torch.Tensor) and wrapped_nbytes(v)
    ]


def _binary(call: OpCall, *, int_to_float: bool, cast_output: bool, wraps: bool) -> Steps:
    self, other = arg(call, 0, "self"), arg(call, 1, "other")
    output = call.kwargs.get("out")
    if call.func._schema.name.endswith("_") and isinstance(self, torch.Tensor):
        output = self
    steps: list[Any] = _scalar_wrap([other]) if wraps else []
    steps += promotion_casts([self, other], output, int_to_float=int_to_float, cast_output=cast_output)
    return [*steps, OUTPUTS]


# -- arithmetic: promote inputs, cast a provided output -----------------------

_ARITHMETIC: Final = (
    aten.add.Tensor, aten.add_.Tensor, aten.add.out,
    aten.sub.Tensor, aten.sub_.Tensor, aten.sub.out,
    aten.mul.Tensor, aten.mul_.Tensor, aten.mul.out,
    aten.div.Tensor_mode, aten.div_.Tensor_mode, aten.div.out_mode,
    aten.remainder.Tensor, aten.remainder_.Tensor, aten.remainder.Tensor_out,
    aten.fmod.Tensor, aten.fmod_.Tensor, aten.fmod.Tensor_out,
    aten.floor_divide.default, aten.floor_divide_.Tensor, aten.floor_divide.out,
    aten.maximum.default, aten.maximum.out, aten.minimum.default, aten.minimum.out,
    aten.fmax.default, aten.fmax.out, aten.fmin.default, aten.fmin.out,
    aten.pow.Tensor_Tensor, aten.pow_.Tensor, aten.pow.Tensor_Tensor_out,
)  # fmt: skip

_ARITHMETIC_SCALAR: Final = (
    aten.add.Scalar, aten.add_.Scalar,
    aten.sub.Scalar, aten.sub_.Scalar,
    aten.mul.Scalar, aten.mul_.Scalar,
    aten.div.Scalar_mode, aten.div_.Scalar_mode,
    aten.remainder.Scalar, aten.remainder_.Scalar,
    aten.fmod.Scalar, aten.fmod_.Scalar,
)  # fmt: skip

_TRUE_DIVIDE: Final = (aten.div.Tensor, aten.div_.Tensor, aten.div.out)
_TRUE_DIVIDE_SCALAR: Final = (aten.div.Scalar, aten.div_.Scalar)

_COMPARISON: Final = tuple(
    getattr(getattr(aten, name), overload)
    for name in ("eq", "ne", "lt", "le", "gt", "ge")
    for overload in ("Tensor", "Tensor_out")
)
_COMPARISON_SCALAR: Final = tuple(
    getattr(aten, name).Scalar for name in ("eq", "ne", "lt", "le", "gt", "ge")
)


def _functional_binary_ops() -> tuple[Any, ...]:
    return tuple(
        op
        for op in (*_ARITHMETIC, *_TRUE_DIVIDE, *_COMPARISON)
        if not op._schema.name.endswith("_") and "out" not in op._overloadname
    )


#: ``compute_elementwise_output_strides`` by the output's shape and the inputs' shapes
#: and strides, which alone decide it: a model repeats a few layouts layer after
#: layer, and computing one dispatches an ``expand`` per input.
_LAYOUTS: Final[BoundedMemo[tuple[int, ...]]] = BoundedMemo()


@CPU.implementation(*_functional_binary_ops())
def _binary_layout(call: OpCall) -> Any:
    """The output strides ``TensorIterator`` gives a binary op (``compute_strides``:
    the inputs' dimension order, broadcast dimensions ignored). The meta kernel
    gets them wrong for reduced-precision inputs when the first one is a
    broadcast (stride-0) view of a channels-last tensor's shape, which changes
    later kernels' paths (a channels-last batch norm backward, ``.contiguous()``).
    Inside a backward formula that multiplies in place eagerly, the in-place op
    (:data:`~pytest_torchmem.engine.tracing.devices.autograd_paths.EAGER_IN_PLACE_BINARY`)."""
    twin = in_place_twin(call)
    if twin is not None:
        return twin(*call.args, **call.kwargs)
    return _iterator_layout(call, reduced_only=True)


def _iterator_layout(call: OpCall, reduced_only: bool, operands: tuple[int, int] = (0, 1)) -> Any:
    """``call``'s output laid out as ``TensorIterator`` lays out a binary op on the
    arguments at ``operands`` (for reduced-precision inputs only if ``reduced_only``)."""
    out = call.default()
    tensors = [
        a for a in (call.args[i] for i in operands if i < len(call.args)) if isinstance(a, torch.Tensor)
    ]
    if (
        len(tensors) < 2
        or not isinstance(out, torch.Tensor)
        or (reduced_only and not any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors))
        or any(t.dim() == 0 for t in tensors)
    ):
        return out
    key = (tuple(out.shape), *((tuple(t.shape), t.stride()) for t in tensors))
    strides = _LAYOUTS.get(
        key, lambda: tuple(compute_elementwise_output_strides(*(t.expand(out.shape) for t in tensors)))
    )
    if strides == out.stride():
        return out
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device)


#: Activation backwards, binary TensorIterator ops on ``(grad, input or output)`` whose
#: meta kernels lay out a reduced-precision result the same wrong way.
_ACTIVATION_BACKWARD: Final = (
    aten.gelu_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default,
    aten.silu_backward.default, aten.mish_backward.default,
)  # fmt: skip
CPU.implementation(*_ACTIVATION_BACKWARD)(_binary_layout)

#: Binary TensorIterator ops on ``(grad, input)`` whose fake kernels (decompositions)
#: lay out the result like ``input``, at any dtype, where ``TensorIterator`` follows
#: ``grad`` when the two disagree: ``hardtanh_backward``, ``hardswish_backward``,
#: ``logit_backward`` (``TensorIterator::borrowing_binary_op``), the structured
#: ``elu_backward``, ``hardsigmoid_backward``, ``softplus_backward``
#: (``build_borrowing_binary_op``) and ``native_dropout_backward`` (``grad * mask *
#: scale``, ``Dropout.cpp``). A leaf keeps a gradient laid out like itself as its
#: ``.grad`` and copies any other (``AccumulateGrad``).
_GRAD_FIRST_BACKWARD: Final = (
    aten.hardtanh_backward.default, aten.hardswish_backward.default,
    aten.logit_backward.default, aten.hardsigmoid_backward.default,
    aten.softplus_backward.default, aten.native_dropout_backward.default,
)  # fmt: skip


@CPU.implementation(*_GRAD_FIRST_BACKWARD)
def _grad_first_layout(call: OpCall) -> Any:
    return _iterator_layout(call, reduced_only=False)


@CPU.implementation(aten.elu_backward.default)
def _elu_backward_layout(call: OpCall) -> Any:
    """(``elu_backward(grad, alpha, scale, input_scale, is_result, self_or_result)``)"""
    return _iterator_layout(call, reduced_only=False, operands=(0, 5))


@CPU.scratch(*_ARITHMETIC)
def _arithmetic(call: OpCall) -> Steps:
    """``build_borrowing_binary_op`` (``BinaryOps.cpp``): inputs of another dtype than
    the common one are copied (``compute_types``), as is a provided output."""
    return _binary(call, int_to_float=False, cast_output=True, wraps=False)


@CPU.scratch(*_ARITHMETIC_SCALAR)
def _arithmetic_scalar(call: OpCall) -> Steps:
    """``add.Scalar`` & co. (``BinaryOps.cpp``): ``op(self, wrapped_scalar_tensor(other))``,
    so the wrapped number is made inside the kernel, then promoted."""
    return _binary(call, int_to_float=False, cast_output=True, wraps=True)


@CPU.scratch(*_TRUE_DIVIDE)
def _true_divide(call: OpCall) -> Steps:
    """``div`` without rounding mode: ``build_borrowing_binary_float_op``, which also
    promotes integer inputs to the default float dtype."""
    return _binary(call, int_to_float=True, cast_output=True, wraps=False)


@CPU.scratch(*_TRUE_DIVIDE_SCALAR)
def _true_divide_scalar(call: OpCall) -> Steps:
    """``div.Scalar``: ``div(self, wrapped_scalar_tensor(other))``."""
    return _binary(call, int_to_float=True, cast_output=True, wraps=True)


@CPU.scratch(*_COMPARISON)
def _comparison(call: OpCall) -> Steps:
    """``build_borrowing_comparison_op`` (``BinaryOps.cpp``): inputs promoted to their
    common dtype; the bool output is not cast."""
    return _binary(call, int_to_float=False, cast_output=False, wraps=False)


@CPU.scratch(*_COMPARISON_SCALAR)
def _comparison_scalar(call: OpCall) -> Steps:
    """``eq.Scalar`` & co.: the structured meta function wraps ``other``
    (``wrapped_scalar_tensor``) and builds a comparison iterator on it."""
    return _binary(call, int_to_float=False, cast_output=False, wraps=True)


@CPU.scratch(aten.rsub.Scalar)
def _rsub_scalar(call: OpCall) -> Steps:
    """``rsub.Scalar`` (``BinaryOps.cpp``): ``sub(wrapped_scalar_tensor(other), self)``."""
    self, other = arg(call, 0, "self"), arg(call, 1, "other")
    return [*_scalar_wrap([other]), *promotion_casts([other, self]), OUTPUTS]


@CPU.scratch(aten.rsub.Tensor)
def _rsub(call: OpCall) -> Steps:
    """``rsub.Tensor``: ``sub(other, self)``."""
    self, other = arg(call, 0, "self"), arg(call, 1, "other")
    return [*promotion_casts([other, self]), OUTPUTS]


@CPU.scratch(aten.pow.Scalar)
def _pow_scalar_base(call: OpCall) -> Steps:
    """``pow.Scalar`` (``Pow.cpp``): the output first, then
    ``pow_out(result, wrapped_scalar_tensor(base), exp)`` (nothing when ``base == 1``)."""
    base, exponent = arg(call, 0, "self"), arg(call, 1, "exponent")
    if not isinstance(exponent, torch.Tensor) or base == 1:
        return [OUTPUTS]
    return [OUTPUTS, *_scalar_wrap([base]), *promotion_casts([base, exponent])]


@CPU.scratch(aten.where.self, aten.where.self_out)
def _where(call: OpCall) -> Steps:
    """``where_self_out`` (``TensorCompare.cpp``): ``self``/``other`` not of
    ``result_type(self, other)`` are converted with ``.to(result_type)`` first."""
    self, other = arg(call, 1, "self"), arg(call, 2, "other")
    return [*promotion_casts([self, other], cast_output=False), OUTPUTS]


# -- views: the strides ATen gives -----------------------------------------------------


def view_strides(
    shape: Sequence[int], strides: Sequence[int], new_shape: Sequence[int]
) -> tuple[int, ...] | None:
    """``at::detail::computeStride`` (``aten/src/ATen/TensorUtils.cpp``): the strides of
    ``view(new_shape)`` of a tensor, or None when it cannot be a view. Sizes of 1
    get the stride of the chunk they fall in, where the fake kernels choose others."""
    if not shape:
        return (1,) * len(new_shape)
    numel = math.prod(shape)
    if numel == 0:
        if tuple(shape) == tuple(new_shape):
            return tuple(strides)
        out, step = [0] * len(new_shape), 1
        for d in range(len(new_shape) - 1, -1, -1):
            out[d] = step
            step *= max(new_shape[d], 1)
        return tuple(out)
    out = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[tensor_d]
        if tensor_d == 0 or (
            shape[tensor_d - 1] != 1 and strides[tensor_d - 1] != tensor_numel * chunk_base_stride
        ):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                out[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = strides[tensor_d - 1]
                tensor_numel = view_numel = 1
    return tuple(out) if view_d == -1 else None


#: :func:`view_strides` of the (sizes, strides, new sizes) tuples met: every view op of
#: a CPU trace asks, and a step views the same few shapes again and again.
_view_strides_of: Final = functools.lru_cache(maxsize=4096)(view_strides)


@CPU.implementation(aten.view.default, aten._unsafe_view.default)
def _view(call: OpCall) -> Any:
    """``view_impl`` (``TensorShape.cpp``) takes its strides from ``computeStride``;
    the fake kernel gives sizes of 1 other strides, which later kernels read (the
    CPU ``addmm``'s operand checks compare them)."""
    out = call.default()
    x = call.args[0]
    try:
        strides = _view_strides_of(x.shape, x.stride(), out.shape)
    except TypeError:  # symbolic sizes: no cache key
        strides = view_strides(x.shape, x.stride(), out.shape)
    if strides is None or strides == out.stride():
        return out
    return out.as_strided(out.shape, strides, out.storage_offset())


# -- copies ------------------------------------------------------------------------------

#: ``copy_transpose_valid``'s least element count (``Copy.cpp``).
_TRANSPOSE_MIN: Final = 60 * 60


def transpose_copy(sizes: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> list[Alloc | Free]:
    """The scratch of ``copy_`` into a contiguous tensor of the same sizes and dtype
    from ``src`` laid out as ``sizes``/``strides`` (``copy_impl``, ``Copy.cpp``): a 2-D
    transposed-contiguous matrix of 3600 elements or more is copied block by block
    through ``copy_same_type_transpose_``'s buffer, ``60 x 60`` elements (``120 x
    120`` for ``uint8``)."""
    if (
        len(sizes) != 2
        or math.prod(sizes) < _TRANSPOSE_MIN
        or strides[0] != 1
        or strides[1] != sizes[0]
    ):
        return []
    block = 120 if dtype == torch.uint8 else 60
    return [Alloc("transpose block", block * block * itemsize(dtype)), Free("transpose block")]


def _same_copy(dst: torch.Tensor, src: Any) -> bool:
    """``copy_transpose_valid``'s other conditions: a contiguous destination of the
    source's sizes, dtype, negative and conjugate bits."""
    return (
        isinstance(src, torch.Tensor)
        and dst.is_contiguous()
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_neg() == src.is_neg()
        and dst.is_conj() == src.is_conj()
        and not dst.is_quantized
    )


@CPU.scratch(aten.copy_.default)
def _copy(call: OpCall) -> Steps:
    dst, src = call.args[0], call.args[1]
    if not _same_copy(dst, src):
        return [OUTPUTS]
    return [OUTPUTS, *transpose_copy(src.shape, src.stride(), src.dtype)]


@CPU.scratch(aten.clone.default, aten._to_copy.default)
def _clone(call: OpCall) -> Steps:
    """``clone`` and ``_to_copy`` make their output, then ``copy_`` into it."""
    src = call.args[0]
    if not isinstance(call.out, torch.Tensor) or not _same_copy(call.out, src):
        return [OUTPUTS]
    return [OUTPUTS, *transpose_copy(src.shape, src.stride(), src.dtype)]


# -- activations run by oneDNN ---------------------------------------------------------


def _onednn_eltwise(cpu: CpuProfile, x: torch.Tensor) -> bool:
    """``use_mkldnn`` of ``Activation.cpp``: oneDNN enabled, a contiguous input of more
    than one element, ``float32`` (or ``bfloat16`` where oneDNN runs it on ``cpu``)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if not x.is_contiguous() or x.numel() <= 1:
        return False
    if x.dtype == torch.bfloat16:
        return cpu.onednn_bf16
    return x.dtype == torch.float32


@CPU.scratch(aten.gelu_backward.default)
def _gelu_backward(call: OpCall) -> Steps:
    """``gelu_backward_out_cpu`` (``Activation.cpp``): the exact GELU of a oneDNN input
    (:func:`_onednn_eltwise`) runs ``ideep::eltwise_backward``, which reorders an
    output gradient, and the input gradient (laid out as the iterator lays out
    ``grad, self``), that are not dense like the input into dense buffers."""
    grad, x = arg(call, 0, "grad_output"), arg(call, 1, "self")
    if arg(call, 2, "approximate", "none") != "none" or not _onednn_eltwise(profile_of(call), x):
        return [OUTPUTS]
    steps: list[Any] = [OUTPUTS]
    for name, t in (("grad_output", grad), ("grad_input", call.out)):
        if not t.is_contiguous():
            steps.append(Alloc(f"{name} dense", x.numel() * x.element_size()))
    return steps


# -- foreach ops: the CPU slow path ---------------------------------------------------


def _foreach_table() -> dict[Any, tuple[Any, str]]:
    """``_foreach_<op>[_]`` overload -> (the per-tensor overload its CPU kernel calls,
    how the second operand is given: one ``scalar``, ``scalars`` or a ``list`` of
    tensors, one per tensor, or one 0-dim ``tensor``)."""
    table = {}
    for name in ("add", "sub", "mul", "div"):
        for suffix in ("", "_"):
            packet = getattr(aten, f"_foreach_{name}{suffix}")
            single = getattr(aten, f"{name}{suffix}")
            for overload, operand, per_tensor in (
                ("Scalar", "scalar", "Scalar"),
                ("ScalarList", "scalars", "Scalar"),
                ("Tensor", "tensor", "Tensor"),
                ("List", "list", "Tensor"),
            ):
                if overload in packet.overloads():
                    table[getattr(packet, overload)] = (getattr(single, per_tensor), operand)
    return table


_FOREACH: Final = _foreach_table()


@CPU.scratch(*_FOREACH)
def _foreach_binary(call: OpCall) -> Steps:
    """``foreach_tensor_<op>_{scalar,scalarlist,tensor,list}_kernel_slow[_]``
    (``ForeachOpsKernels.cpp``): the CPU has no fused foreach kernels, so each is a
    loop of ``tensors[i].<op>[_](operand_i)``, one ``<op>[_].Scalar`` or
    ``.Tensor`` call per tensor, whose buffers (the wrapped number and its
    promotion, above) are freed before the next call. Out of place, the results
    are placed first: exact when the last call's buffers are the largest, as in
    a list of one dtype (an optimizer's parameters)."""
    per_tensor, operand = _FOREACH[call.func]
    rule = CPU.scratch_rule(per_tensor)
    if rule is None:  # pragma: no cover - every per-tensor overload has a rule
        return [OUTPUTS]
    tensors, other = call.args[0], arg(call, 1, "other")
    if other is None:
        other = call.kwargs.get("scalar", call.kwargs.get("scalars"))
    kwargs = {"alpha": call.kwargs["alpha"]} if "alpha" in call.kwargs else {}
    inplace = call.func._schema.name.endswith("_")
    steps: list[Any] = [] if inplace else [OUTPUTS]
    for i, t in enumerate(tensors):
        second = other[i] if operand in ("scalars", "list") else other
        out = t if inplace else call.out[i]
        held: list[str] = []
        for step in rule(OpCall(per_tensor, (t, second), kwargs, out, call.context)):
            if isinstance(step, Alloc):
                held.append(f"{i}: {step.tag}")
                steps.append(Alloc(held[-1], step.nbytes))
            elif isinstance(step, Free):
                held.remove(f"{i}: {step.tag}")
                steps.append(Free(f"{i}: {step.tag}"))
        steps += [Free(tag) for tag in reversed(held)]
    return steps


# -- dropout -------------------------------------------------------------------------


@CPU.implementation(aten.native_dropout.default)
def _native_dropout_eval(call: OpCall) -> Any:
    """``native_dropout_cpu`` with ``train=False`` returns ``input.clone()`` and a
    ``ones_like`` bool mask; the fake kernel returns ``input`` itself, which autograd
    rejects for a leaf."""
    x, train = arg(call, 0, "input"), arg(call, 2, "train")
    if train is False and x.numel() != 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    return call.default()


@CPU.scratch(aten.native_dropout.default)
def _native_dropout(call: OpCall) -> Steps:
    """``native_dropout_cpu`` (``Dropout.cpp``), training: a bool ``mask`` is drawn, then
    ``input.mul(mask).mul_(scale)``: the mask promoted to the input's dtype for the
    ``mul``, the ``double`` scale wrapped and cast for the ``mul_``. (``F.dropout``
    on the CPU does not come here: it runs ``bernoulli_``, ``div_`` and ``mul``.)"""
    x, train = arg(call, 0, "input"), arg(call, 2, "train")
    if x.numel() == 0 or train is False:
        return [OUTPUTS]
    size = x.element_size()
    return [
        OUTPUTS,
        Alloc("mask as input dtype", x.numel() * size), Free("mask as input dtype"),
        Alloc("wrapped scale", 8), Alloc("scale as input dtype", size),
    ]  # fmt: skip


@CPU.scratch(aten.native_dropout_backward.default)
def _native_dropout_backward(call: OpCall) -> Steps:
    """``native_dropout_backward`` (``Dropout.cpp``): ``grad * mask * scale``, so the mask
    promoted to the gradient's dtype, ``grad * mask``, then a ``mul.Scalar`` by the scale."""
    grad, mask = arg(call, 0, "grad_output"), arg(call, 1, "mask")
    casts = promotion_casts([grad, mask])
    size = torch.result_type(grad, mask).itemsize
    numel = torch.broadcast_shapes(grad.shape, mask.shape).numel()
    return [
        *casts, Alloc("grad * mask", numel * size), *[Free(c.tag) for c in casts],
        Alloc("wrapped scale", 8), Alloc("scale as gradient dtype", size),
        OUTPUTS,
        Free("scale as gradient dtype"), Free("wrapped scale"), Free("grad * mask"),
    ]  # fmt: skip


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to (``infer_size``), computed without tensors."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        for i, size in enumerate(shape, ndim - len(shape)):
            out[i] = size if out[i] == 1 else out[i]
    return tuple(out)


def index_long_copies(indices: Sequence[Any], tag: str = "index") -> list[Alloc]:
    """``AdvancedIndex`` (``TensorAdvancedIndexing.cpp``) converts each ``int32`` index,
    expanded with the others to their broadcast shape, with ``.to(kLong)``: 8 bytes an
    element of that shape (held while the kernel runs)."""
    present = [i for i in indices if i is not None]
    if not any(i.dtype == torch.int32 for i in present):
        return []
    numel = math.prod(broadcast_shape(*(i.shape for i in present)))
    return [
        Alloc(f"{tag} {k} as int64", numel * 8)
        for k, i in enumerate(indices)
        if i is not None and i.dtype == torch.int32
    ]


_DEG_RAD = (
    aten.deg2rad.default, aten.deg2rad.out, aten.deg2rad_.default,
    aten.rad2deg.default, aten.rad2deg.out, aten.rad2deg_.default,
)  # fmt: skip


@CPU.scratch(*_DEG_RAD)
def _deg_rad(call: OpCall) -> Steps:
    """``deg2rad`` / ``rad2deg`` (``UnaryOps.cpp``): the result first (the default
    float dtype for an integer input), then
    ``at::mul_out(result, self, wrapped_scalar_tensor(M_PI_180))``: the wrapped
    ``double`` and the iterator's casts to the common dtype (the number, and an
    integer ``self``)."""
    self = arg(call, 0, "self")
    if call.func._schema.name.endswith("_"):
        output = self
    else:
        output = call.kwargs.get("out", call.out)
    scale = 0.017453292519943295
    return [OUTPUTS, *_scalar_wrap([scale]), *promotion_casts([self, scale], output)]


@CPU.scratch(aten.ldexp.Tensor)
def _ldexp(call: OpCall) -> Steps:
    """``ldexp`` (``BinaryOps.cpp``): a floating ``self`` with an integer ``other`` takes
    ``_ldexp_int_exponent`` into ``empty_like(self)``, which the iterator resizes (a
    new storage where the result broadcasts to more elements); otherwise ``at::mul(self, _pow2(self,
    other))``. ``_pow2`` of a float32 or integer ``self`` is ``at::pow(2.0, other)``
    (``pow.Scalar``: its result, then the wrapped 2.0 and the iterator's casts); of
    any other dtype (bfloat16, float16, float64) ``at::full({}, 2.0,
    self.options()).pow(other)`` (the 0-dim two, the iterator's casts, then the
    power; the two is freed when the power returns). Then the product (its casts,
    then the op's output); the power is freed last."""
    self, other = arg(call, 0, "self"), arg(call, 1, "other")
    if not (other.is_floating_point() or other.is_complex()) and self.is_floating_point():
        # empty_like(self), resized by the iterator: a broadcast result is a new storage
        if call.out.numel() <= self.numel():
            return [OUTPUTS]
        first = Alloc("empty_like(self)", self.numel() * self.element_size())
        return [first, OUTPUTS, Free(first.tag)]
    base: Any = 2.0
    if self.dtype != torch.float32 and (self.is_floating_point() or self.is_complex()):
        base = meta_tensor((), self.dtype)
    power = _common_dtype([base, other], int_to_float=False)
    if power is None:
        return [OUTPUTS]
    result = Alloc("pow(2, other)", other.numel() * itemsize(power))
    casts = [Alloc(f"pow: {c.tag}", c.nbytes) for c in promotion_casts([base, other])]
    if isinstance(base, torch.Tensor):
        two = Alloc("full({}, 2)", itemsize(self.dtype))
        steps: list[Any] = [two, *casts, result, *(Free(c.tag) for c in reversed(casts)), Free(two.tag)]
    else:
        casts = [*_scalar_wrap([base]), *casts]
        steps = [result, *casts, *(Free(c.tag) for c in reversed(casts))]
    power_tensor = meta_tensor(other.shape, power)
    product = [Alloc(f"product: {c.tag}", c.nbytes) for c in promotion_casts([self, power_tensor])]
    steps += [*product, OUTPUTS, *(Free(c.tag) for c in reversed(product))]
    return [*steps, Free(result.tag)]
