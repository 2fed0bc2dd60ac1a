"""CPU rules: kernels that are small programs of other ATen ops, run below the
dispatcher, so that the fake trace (which has a meta kernel for the whole op)
sees only their result. Each rule lists their intermediates in the program's
order (torch 2.13).

A comparison of a tensor with a Python number (``x == INFINITY``) wraps the
number in a 0-dim ``double`` tensor, which ``TensorIterator`` casts to the
tensor's dtype before it makes the boolean result (see :mod:`.misc`).

Where the kernel is registered as such a program (``CompositeExplicitAutograd``:
a C++ function of ``at::`` calls, or a custom op's Python function), no rule
repeats it: :func:`follow_cpu_kernel`, a composite rule, runs the kernel itself
on the fake tensors with the trace watching, and each op it calls is traced
with its own rules, in its order.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, itemsize
from pytest_torchmem.engine.tracing.devices.cpu.reduce import (
    acc_buffer_steps,
    sum_steps,
    uses_acc_buffer,
)
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Steps

# torch's private names (engine/torch_compat/torch_private.py)
DispatchKey: Final = private("torch._C.DispatchKey")
DispatchKeySet: Final = private("torch._C.DispatchKeySet")

aten = torch.ops.aten

_DOUBLE = 8

#: The CPU kernel's slot of the dispatcher (where a composite kernel is registered too).
_CPU_KERNEL: Final = DispatchKeySet(DispatchKey.CPU)


def follow_cpu_kernel(call: OpCall) -> Any:
    """A composite rule that runs ``call``'s CPU kernel where that kernel is a program
    of other ops, so that the trace sees each of them (their outputs, their scratch)
    instead of the op's meta kernel alone. Grad mode is off, as in a custom op's
    forward: nothing below the dispatcher is recorded by autograd."""
    with torch.no_grad():
        return call.func.redispatch(_CPU_KERNEL, *call.args, **call.kwargs)


#: Ops whose CPU kernel is followed op by op (torch 2.13):
#:
#: * ``_trilinear`` (``Linear.cpp``, ``bilinear``'s kernel and its backward): a zero
#:   output, then per step of the unrolled dim ``sumproduct_pair`` twice (permuted
#:   copies, ``bmm`` or ``mul``, ``sum``) added into a slice of it;
#: * ``soft_margin_loss`` / ``soft_margin_loss_backward`` (``Loss.cpp``): in-place
#:   elementwise programs on an ``empty({0})`` result (``neg_out(...).mul_(target)
#:   .exp_().log1p_()`` and a loss reduction; ``exp(-target * input)`` and the
#:   gradient's ``mul_``/``add_``/``div_`` with wrapped numbers);
#: * the window functions (``TensorFactories.cpp``: ``hann_window`` is
#:   ``hamming_window``'s ``arange``, then ``mul_``/``cos_``/``mul_``/``add_`` in place,
#:   each scalar a wrapped double and its float copy: measured 8 + 4 bytes each;
#:   ``blackman_window`` and ``bartlett_window`` alike; not ``kaiser_window``, whose
#:   kernel writes through a TensorIterator kernel of its own).
_WINDOWS: Final = tuple(
    getattr(getattr(aten, name), overload)
    for name in ("hann_window", "hamming_window", "blackman_window", "bartlett_window")
    for overload in getattr(aten, name).overloads()
    if not overload.endswith("out")
)
_FOLLOWED: Final = (
    aten._trilinear.default,
    aten.soft_margin_loss.default, aten.soft_margin_loss.out,
    aten.soft_margin_loss_backward.default, aten.soft_margin_loss_backward.grad_input,
    *_WINDOWS,
)  # fmt: skip
CPU.composite(*_FOLLOWED)(follow_cpu_kernel)


_KAISER: Final = tuple(
    getattr(aten.kaiser_window, overload)
    for overload in aten.kaiser_window.overloads()
    if not overload.endswith("out")
)


@CPU.composite(*_KAISER)
def _kaiser_window(call: OpCall) -> Any:
    """``kaiser_window`` (``TensorFactories.cpp``), whose values come from a kernel of
    its own: ``arange`` and ``empty`` of the length (one more when periodic, the
    result then a ``narrow`` of it, holding the longer storage), ``arange`` freed
    when it returns (measured: a periodic window of 64 floats holds 260 bytes)."""
    length = call.arg(0, "window_length")
    periodic = call.arg(1, "periodic", True)
    options = {k: call.kwargs[k] for k in ("dtype", "layout", "device", "pin_memory") if k in call.kwargs}
    if length <= 1:
        factory = aten.empty.memory_format if length == 0 else aten.ones.default
        return factory([length], **options)
    n = length + 1 if periodic else length
    initial = aten.arange.default(n, **options)
    window = aten.empty.memory_format([n], **options)
    out = aten.narrow.default(window, 0, 0, n - 1) if periodic else window
    del initial
    return out


def _chunked_linear_cross_entropy() -> tuple[Any, ...]:
    """``linear_cross_entropy``'s chunked custom ops (``torch/nn/modules/
    linear_cross_entropy.py``, registered when that module is imported): their
    forward is a Python program (``_linear_cross_entropy_batch_chunked_accumulator``:
    per batch chunk the logits, their log-sum-exp, the gathered targets, and for the
    mean/sum op the gradients too), which the fake kernel replaces by its outputs."""
    try:
        import torch.nn.modules.linear_cross_entropy  # noqa: F401  (registers the ops)
    except ImportError:  # a torch without it
        return ()
    namespace = torch.ops.torch_nn
    names = ("_linear_cross_entropy_batch_chunked", "_linear_cross_entropy_batch_chunked_no_reduction")
    return tuple(getattr(namespace, name).default for name in names if hasattr(namespace, name))


_CUSTOM_FOLLOWED: Final = _chunked_linear_cross_entropy()
if _CUSTOM_FOLLOWED:
    CPU.composite(*_CUSTOM_FOLLOWED)(follow_cpu_kernel)


def _compare_with_number(dtype: torch.dtype, numel: int, tag: str) -> list[Alloc | Free]:
    """``t == number`` on a ``dtype`` tensor of ``numel`` elements: the wrapped double,
    its cast to ``dtype`` (none for double), then the boolean result, named ``tag``."""
    cast = 0 if dtype == torch.float64 else itemsize(dtype)
    return [
        Alloc(f"{tag}: wrapped number", _DOUBLE),
        Alloc(f"{tag}: number as {dtype}", cast),
        Alloc(tag, numel),
        Free(f"{tag}: wrapped number"),
        Free(f"{tag}: number as {dtype}"),
    ]


@CPU.scratch(aten.logsumexp.default, aten.logsumexp.out)
def _logsumexp(call: OpCall) -> Steps:
    """``logsumexp_out_impl`` (``ReduceOps.cpp``) into an empty result::

        maxes = at::amax(at::real(self), dims, true);
        maxes_squeezed.masked_fill_(maxes_squeezed.abs() == INFINITY, 0);
        at::sum_out(result, (self - maxes).exp_(), dims, keepdim);  // result sized here
        result.log_().add_(maxes_squeezed);

    ``sum_out`` adds its own scratch (:mod:`.reduce`). An empty ``self``:
    ``at::sum_out(result, at::exp(self), ...)``.
    """
    self, out = arg(call, 0, "self"), call.out
    size = itemsize(self.dtype)
    if self.numel() == 0:
        return [Alloc("exp(self)", 0), OUTPUTS]
    if self.is_complex():
        return [OUTPUTS]  # not followed: amax of the real part, complex casts
    reduced = out.numel()
    threads = profile_of(call).threads
    # The difference has self's layout (an elementwise result): sum_out reads it
    # as it would read self.
    if uses_acc_buffer(self, arg(call, 1, "dim"), out.dtype):
        summed = acc_buffer_steps(threads, self, reduced, "sum_out")
    else:
        summed = sum_steps(threads, self, reduced, out.dtype, "sum_out")
    return [
        Alloc("maxes", reduced * size),
        Alloc("maxes.abs()", reduced * size),
        *_compare_with_number(self.dtype, reduced, "abs == INFINITY"),
        Free("abs == INFINITY"),
        Free("maxes.abs()"),
        Alloc("self - maxes", self.numel() * size),
        OUTPUTS,
        *summed,
        Free("self - maxes"),
    ]


@CPU.scratch(aten.isinf.default)
def _isinf(call: OpCall) -> Steps:
    """``isinf`` (``TensorCompare.cpp``) of a floating tensor:
    ``self.abs() == std::numeric_limits<scalar_t>::infinity()`` (integers:
    ``zeros_like``; complex: not followed)."""
    self = arg(call, 0, "self")
    if not self.is_floating_point():
        return [OUTPUTS]
    numel = self.numel()
    steps = _compare_with_number(self.dtype, numel, "result")
    steps[2] = OUTPUTS  # the comparison's result is the op's output
    return [Alloc("self.abs()", numel * itemsize(self.dtype)), *steps]


@CPU.scratch(aten.dist.default)
def _dist(call: OpCall) -> Steps:
    """``dist`` (``ReduceOps.cpp``): ``at::norm(self - other, p)``."""
    self, other = arg(call, 0, "self"), arg(call, 1, "other")
    numel = torch.broadcast_shapes(self.shape, other.shape).numel()
    dtype = torch.promote_types(self.dtype, other.dtype)
    return [Alloc("self - other", numel * itemsize(dtype)), OUTPUTS]


@CPU.scratch(aten.mvlgamma.default)
def _mvlgamma(call: OpCall) -> Steps:
    """``mvlgamma`` (``UnaryOps.cpp``)::

        Tensor args = native::arange(-p * HALF + HALF, HALF, HALF, dtype, ...);  // p elements
        args = args.add(self.unsqueeze(-1));   // self's shape + (p,); the arange is freed
        return args.lgamma_().sum(-1).add_(p2_sub_p * std::log(pi) * QUARTER);

    in the result dtype (the default float dtype for an integer ``self``, which the
    addition casts). ``sum_out`` adds its own scratch (:mod:`.reduce`); ``add_`` of a
    number wraps it as a ``double`` and casts it. ``args`` is contiguous for a
    contiguous ``self``; a reduced-precision sum over a permuted ``args`` may take
    ``sum_out``'s ``float`` path, which is not followed (listed in ``unsupported``).
    """
    self, p, out = arg(call, 0, "self"), arg(call, 1, "p"), call.out
    size = itemsize(out.dtype)
    numel = self.numel()
    steps: Steps = [Alloc("arange", p * size)]
    if self.dtype != out.dtype:
        steps.append(Alloc("self as result dtype", numel * size))
    steps += [Alloc("args", numel * p * size), Free("arange")]
    if self.dtype != out.dtype:
        steps.append(Free("self as result dtype"))
    if out.dtype in (torch.bfloat16, torch.float16) and not self.is_contiguous():
        steps.insert(0, Inexact("sum(-1) of a permuted reduced-precision args may run in float"))
    cast = 0 if out.dtype == torch.float64 else size
    threads = profile_of(call).threads
    return [
        *steps,
        OUTPUTS,
        *sum_steps(threads, (numel * p, out.dtype), out.numel(), out.dtype, "sum(-1)"),
        Alloc("add_: wrapped number", _DOUBLE),
        Alloc("add_: number as result dtype", cast),
        Free("add_: number as result dtype"),
        Free("add_: wrapped number"),
        Free("args"),
    ]
