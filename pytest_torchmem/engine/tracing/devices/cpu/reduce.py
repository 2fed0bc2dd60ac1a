"""CPU rules: reductions.

Two mechanisms make CPU reductions take memory beyond their output:

* **Input casts.** ``make_reduction`` / ``make_reduction_from_out_ty``
  (``aten/src/ATen/native/ReduceOpsUtils.h``) build the reduction iterator on
  ``self.to(dtype)`` when the reduction's dtype is not the input's: summing a
  ``bool`` mask into ``int64``, ``sum(dtype=...)``, the ``float`` pass of a
  ``bfloat16`` mean, ``any()`` of a float tensor. The copy has the input's
  ``numel`` and lives until the kernel returns.
* **Two-pass reductions.** ``TensorIteratorBase::parallel_reduce``
  (``aten/src/ATen/TensorIteratorReduce.cpp``), which ``sum``, ``prod``,
  ``amax``/``amin`` and ``all``/``any`` run through (``cascade_sum`` and
  ``binary_kernel_reduce_vec`` in ``native/cpu/Reduce.h``), reduces a tensor to
  a single element with a per-thread buffer, ``at::empty({max_threads} +
  output.shape, output.dtype)``, when the input has at least
  ``at::internal::GRAIN_SIZE`` (32768) elements and more than one intra-op
  thread is available. Reductions to more than one element split the output
  instead and take nothing.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import (
    arg,
    itemsize,
    scalar_comparison,
    transpose_copy,
)
from pytest_torchmem.engine.tracing.devices.tensor_iterator import (
    coalesce_dimensions,
    reorder_dimensions,
)
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Output, Steps

__all__ = ["GRAIN_SIZE", "two_pass_buffer", "sum_steps", "mean_steps"]

aten = torch.ops.aten

#: ``at::internal::GRAIN_SIZE``: below it ATen runs a loop on one thread.
GRAIN_SIZE: Final = 32768


def two_pass_buffer(threads: int, input_numel: int, output_numel: int, dtype: torch.dtype) -> int:
    """Bytes of ``two_pass_reduction``'s per-thread buffer (``TensorIteratorReduce.cpp``):
    used when the output is one element, the input has ``GRAIN_SIZE`` elements
    or more and more than one (``threads``) thread runs."""
    if output_numel != 1 or input_numel < GRAIN_SIZE or threads == 1:
        return 0
    return threads * itemsize(dtype)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def sum_steps(
    threads: int,
    self: torch.Tensor | tuple[int, torch.dtype],
    out_numel: int,
    out_dtype: torch.dtype,
    tag: str = "sum",
) -> list[Alloc | Free]:
    """Scratch of ``sum_out`` into an existing output (``ReduceOps.cpp``,
    ``SumKernel.cpp``): the input cast to the output dtype, then the two-pass
    buffer; both given back before the kernel returns. ``self`` is the input, or
    its ``(numel, dtype)``."""
    numel, dtype = (self.numel(), self.dtype) if isinstance(self, torch.Tensor) else self
    steps: list[Alloc | Free] = []
    if numel == 0:
        return steps
    if dtype != out_dtype:
        steps.append(Alloc(f"{tag}: input as {out_dtype}", numel * itemsize(out_dtype)))
    buffer = two_pass_buffer(threads, numel, out_numel, out_dtype)
    if buffer:
        steps += [Alloc(f"{tag}: per-thread partials", buffer), Free(f"{tag}: per-thread partials")]
    if dtype != out_dtype:
        steps.append(Free(f"{tag}: input as {out_dtype}"))
    return steps


def mean_steps(
    threads: int, self: torch.Tensor | tuple[int, torch.dtype], out_numel: int, out_dtype: torch.dtype
) -> list[Alloc | Free]:
    """Scratch of ``mean_out`` on the CPU after its output is allocated (``ReduceOps.cpp``).

    ``at::sum_out(result_temp, self, dim, keepdim, sum_dtype).div_(dim_prod)``:
    ``bfloat16``/``half`` results are summed into a ``float`` copy of the result
    (``result.to(kFloat)``), which is copied back and freed; ``div_`` by the
    ``int64`` element count wraps it (8 bytes) and casts it to the sum's dtype.
    ``self`` is the input, or its ``(numel, dtype)``.
    """
    half = out_dtype in (torch.bfloat16, torch.float16)
    sum_dtype = torch.float32 if half else out_dtype
    steps: list[Alloc | Free] = []
    if half:
        steps.append(Alloc("mean: float result", out_numel * itemsize(torch.float32)))
    steps += sum_steps(threads, self, out_numel, sum_dtype, "mean")
    steps += [
        Alloc("mean: wrapped count", 8),
        Alloc("mean: count as result dtype", itemsize(sum_dtype)),
        Free("mean: count as result dtype"),
        Free("mean: wrapped count"),
    ]
    if half:
        steps.append(Free("mean: float result"))
    return steps


def uses_acc_buffer(self: torch.Tensor, dims: Any, out_dtype: torch.dtype) -> bool:
    """``should_use_acc_buffer`` of ``sum_out`` (``ReduceOps.cpp``): a ``bfloat16`` /
    ``half`` sum whose reduction iterator, once its dimensions are reordered and
    coalesced, starts with two reduced dimensions (a permuted-layout input) is done
    in ``float`` instead (pytorch#83149)."""
    if out_dtype not in (torch.bfloat16, torch.float16) or self.dim() < 2 or self.numel() == 0:
        return False
    ndim = self.dim()
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        reduced_set = set(range(ndim))
    else:
        reduced_set = {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}
    shape = list(self.shape)
    reduced = [d in reduced_set for d in range(ndim)]
    out_strides, step = [0] * ndim, 1
    for d in range(ndim - 1, -1, -1):
        if not reduced[d]:
            out_strides[d] = step
            step *= shape[d]
    strides = [out_strides, list(self.stride())]
    perm = reorder_dimensions(shape, strides, n_outputs=1)
    shape, strides = coalesce_dimensions(
        [shape[d] for d in perm], [[s[d] for d in perm] for s in strides]
    )
    return len(shape) >= 2 and strides[0][0] == 0 and strides[0][1] == 0


def acc_buffer_steps(
    threads: int, self: torch.Tensor, out_numel: int, tag: str = "sum"
) -> list[Alloc | Free]:
    """The ``float`` path of ``sum_out``: a ``float`` result, ``self.to(float)``, their
    sum (the two-pass buffer if any), then the copy into the result."""
    return [
        Alloc(f"{tag}: float result", out_numel * 4),
        *sum_steps(threads, self, out_numel, torch.float32, f"{tag} (float)"),
        Free(f"{tag}: float result"),
    ]


# -- sum, prod, amax/amin, all/any ---------------------------------------------


@CPU.scratch(
    aten.sum.default, aten.sum.dim_IntList, aten.sum.IntList_out,
    aten.nansum.default, aten.nansum.out,
    aten.prod.default, aten.prod.dim_int, aten.prod.int_out,
)  # fmt: skip
def _sum(call: OpCall) -> Steps:
    """``sum``/``nansum``/``prod`` (``ReduceOps.cpp``: ``make_reduction_from_out_ty``
    casts the input to the result dtype; ``cascade_sum`` / ``binary_kernel_reduce_vec``
    reduce through ``parallel_reduce``)."""
    self, out = arg(call, 0, "self"), _first(call.out)
    threads = profile_of(call).threads
    if call.func in _SUMS and uses_acc_buffer(self, arg(call, 1, "dim"), out.dtype):
        return [OUTPUTS, *acc_buffer_steps(threads, self, out.numel())]
    return [OUTPUTS, *sum_steps(threads, self, out.numel(), out.dtype)]


_SUMS: Final = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.sum.IntList_out})


@CPU.scratch(aten.amax.default, aten.amax.out, aten.amin.default, aten.amin.out)
def _amax(call: OpCall) -> Steps:
    """``amax``/``amin`` (``ReduceOps.cpp``): ``make_reduction`` in the input dtype,
    ``max_values_stub`` through ``binary_kernel_reduce_vec``."""
    self, out = arg(call, 0, "self"), _first(call.out)
    return [OUTPUTS, *sum_steps(profile_of(call).threads, self, out.numel(), out.dtype, "amax")]


@CPU.scratch(aten.max.default, aten.max.unary_out, aten.min.default, aten.min.unary_out)
def _max_all(call: OpCall) -> Steps:
    """``max``/``min`` of a whole tensor (``ReduceAllOps.cpp``): the 0-dim result, then
    ``max_all_stub`` on ``self.contiguous()``, a copy of a strided input (``clone``,
    whose ``copy_`` takes the transpose block of a transposed matrix) given back when
    the kernel returns. ``parallel_reduce``'s partials are a ``SmallVector``, not the
    allocator's (``ReduceAllOpsKernel.cpp``). torchao's float8 scales are
    ``max(abs(weight.t()))``: a copy of the weight."""
    self = arg(call, 0, "self")
    if self.is_contiguous() or self.numel() == 0:
        return [OUTPUTS]
    copy = "self.contiguous()"
    block = [] if self.is_neg() or self.is_conj() else transpose_copy(self.shape, self.stride(), self.dtype)
    return [OUTPUTS, Alloc(copy, self.numel() * self.element_size()), *block, Free(copy)]


@CPU.scratch(
    aten.all.default, aten.all.dim, aten.all.dims, aten.all.out, aten.all.dims_out, aten.all.all_out,
    aten.any.default, aten.any.dim, aten.any.dims, aten.any.out, aten.any.dims_out, aten.any.all_out,
)  # fmt: skip
def _all_any(call: OpCall) -> Steps:
    """``allany_impl`` (``ReduceOps.cpp``): one element is ``self.to(kBool)``; more go
    through ``make_reduction_from_out_ty(..., kBool)`` (a bool copy of a non-bool
    input) and ``binary_kernel_reduce_vec``."""
    self, out = arg(call, 0, "self"), _first(call.out)
    if self.numel() == 0:
        return [OUTPUTS]
    if self.numel() == 1:
        return [OUTPUTS, *([Alloc("self as bool", 1)] if self.dtype != torch.bool else [])]
    return [OUTPUTS, *sum_steps(profile_of(call).threads, self, out.numel(), torch.bool, "all/any")]


@CPU.scratch(aten.count_nonzero.dim_IntList, aten.count_nonzero.default)
def _count_nonzero(call: OpCall) -> Steps:
    """``count_nonzero_cpu`` (``ReduceOps.cpp``): with no dim, a counting loop into the
    output alone; over dims, ``(self != 0).sum(dims)`` (a ``bool`` input is summed as
    it is): ``ne.Scalar`` wraps the ``0`` (an ``int64`` tensor), casts it to the
    common dtype and makes the mask, and the sum casts the mask to ``int64`` into
    the output; the mask is freed when the op returns."""
    self, dim = arg(call, 0, "self"), arg(call, 1, "dim")
    if not ([dim] if isinstance(dim, int) else dim):
        return [OUTPUTS]
    steps = scalar_comparison(self, 0, "self != 0") if self.dtype != torch.bool else []
    threads = profile_of(call).threads
    mask = (self.numel(), torch.bool)
    return [*steps, OUTPUTS, *sum_steps(threads, mask, call.out.numel(), torch.int64, "sum")]


def _contiguous_copy_of(t: Any, tag: str) -> list[Alloc]:
    """``t.contiguous()`` of an optional tensor: a copy where it is not contiguous."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return []
    return [Alloc(tag, t.numel() * t.element_size())]


@CPU.scratch(aten.segment_reduce.default)
def _segment_reduce(call: OpCall) -> Steps:
    """``segment_reduce_kernel`` (``SegmentReduce.cpp``): ``data.contiguous()``; with
    offsets, ``offsets.contiguous()``; with lengths, unless ``unsafe``, the checks
    ``lengths.min().item()`` (a 0-dim result; ``min`` copies a non-contiguous input)
    and ``all(lengths.sum({-1}) == data.size(axis)).item()`` (the sum, the wrapped
    size, the mask, the ``all``), then ``lengths.contiguous()``; the output last."""
    data = arg(call, 0, "data")
    lengths, offsets = call.kwargs.get("lengths"), call.kwargs.get("offsets")
    steps: list[Any] = _contiguous_copy_of(data, "data.contiguous()")
    if offsets is not None or lengths is None:
        return [*steps, *_contiguous_copy_of(offsets, "offsets.contiguous()"), OUTPUTS]
    if not call.kwargs.get("unsafe", False) and lengths.numel() > 0:
        sums = lengths.numel() // lengths.shape[-1] if lengths.shape[-1] else 0
        threads = profile_of(call).threads
        min_copy = _contiguous_copy_of(lengths, "min: lengths.contiguous()")
        steps += [
            Alloc("lengths.min()", lengths.element_size()),
            *min_copy,
            *(Free(a.tag) for a in min_copy),
            Free("lengths.min()"),
            Alloc("lengths.sum(-1)", sums * 8),
            *sum_steps(threads, lengths, sums, torch.int64),
            Alloc("== size: wrapped size", 8),
            Alloc("== size", sums),
            Free("== size: wrapped size"),
            Alloc("all(...)", 1),
            *sum_steps(threads, (sums, torch.bool), 1, torch.bool, "all"),
            Free("all(...)"),
            Free("== size"),
            Free("lengths.sum(-1)"),
        ]
    return [*steps, *_contiguous_copy_of(lengths, "lengths.contiguous()"), OUTPUTS]


@CPU.scratch(aten._segment_reduce_backward.default)
def _segment_reduce_backward(call: OpCall) -> Steps:
    """``_segment_reduce_backward_kernel`` (``SegmentReduce.cpp``): ``contiguous()`` copies
    of the gradient (an expanded one, from a sum), the forward's output, the data and
    the lengths or offsets, then the output (``zeros_like(data)``)."""
    names = ("grad", "output", "data")
    tensors = [arg(call, i, n) for i, n in enumerate(names)]
    tensors.append(call.kwargs.get("lengths", call.kwargs.get("offsets")))
    copies = [
        a for t, n in zip(tensors, (*names, "lengths/offsets")) for a in _contiguous_copy_of(t, n)
    ]
    return [*copies, OUTPUTS]


# -- mean, var, std --------------------------------------------------------------


@CPU.scratch(aten.mean.default, aten.mean.dim, aten.mean.out, aten.mean.dtype_out)
def _mean(call: OpCall) -> Steps:
    """``mean_out`` on the CPU (``ReduceOps.cpp``): ``sum_out(...).div_(dim_prod)``."""
    self, out = arg(call, 0, "self"), _first(call.out)
    return [OUTPUTS, *mean_steps(profile_of(call).threads, self, out.numel(), out.dtype)]


def _full_reduction(self: torch.Tensor, out: torch.Tensor) -> bool:
    return self.numel() > 0 and out.numel() == 1


@CPU.scratch(aten.var.correction, aten.var.correction_out, aten.std.correction, aten.std.correction_out)
def _var(call: OpCall) -> Steps:
    """``std_var_out`` (``ReduceOps.cpp``): a full reduction of a ``float``/``double``
    tensor runs ``std_var_all_cpu``, which first takes ``self.mean().item()``."""
    self, out = arg(call, 0, "self"), _first(call.out)
    if not _full_reduction(self, out) or self.dtype not in (torch.float32, torch.float64):
        return [OUTPUTS]
    return [
        OUTPUTS,
        Alloc("std_var_all_cpu: mean", itemsize(self.dtype)),
        *mean_steps(profile_of(call).threads, self, 1, self.dtype),
        Free("std_var_all_cpu: mean"),
    ]


@CPU.scratch(aten.linalg_vector_norm.default, aten.linalg_vector_norm.out)
def _vector_norm(call: OpCall) -> Steps:
    """``linalg_vector_norm_out`` (``LinearAlgebra.cpp``): with ``dtype=`` other than
    the input's, ``make_reduction_from_out_ty`` reduces a converted copy."""
    self, out = arg(call, 0, "self"), _first(call.out)
    if self.numel() == 0 or self.dtype == out.dtype or self.is_complex():
        return [OUTPUTS]
    return [OUTPUTS, Alloc("norm: input as result dtype", self.numel() * itemsize(out.dtype))]


@CPU.scratch(aten.renorm.default, aten.renorm.out, aten.renorm_.default)
def _renorm(call: OpCall) -> Steps:
    """``renorm_out`` (``Normalization.cpp``, a structured kernel: the output first)::

        norm = at::linalg_vector_norm(self, p, reduce_dims, true[, acc_type]);  // size(dim)
        factor = acc_type == dtype ? norm : at::empty(norm.sizes(), self.options());
        renorm_scale_factor_stub(...);  at::mul_outf(self, factor, out);

    ``acc_type`` is CUDA's accumulate type: ``float`` for ``bfloat16``/``half``, whose
    norm (with ``dtype=``) reduces a ``float`` copy of ``self`` (``_vector_norm``)."""
    self, dim = arg(call, 0, "self"), arg(call, 2, "dim")
    if self.numel() == 0 or self.is_complex():
        return [OUTPUTS]
    n = self.shape[dim] if self.dim() else 1
    if self.dtype not in (torch.bfloat16, torch.float16):
        return [OUTPUTS, Alloc("norm", n * itemsize(self.dtype))]
    return [
        OUTPUTS,
        Alloc("norm (float)", n * 4),
        Alloc("norm: input as float", self.numel() * 4),
        Free("norm: input as float"),
        Alloc("factor", n * itemsize(self.dtype)),
    ]


# -- scans and sorts ---------------------------------------------------------------


@CPU.scratch(aten.cumsum.default, aten.cumsum.out, aten.cumprod.default, aten.cumprod.out)
def _cumsum(call: OpCall) -> Steps:
    """``cumsum``/``cumprod`` (``ReduceOps.cpp``, ``impl_func_cum_ops``): an input of
    another dtype than the result is converted first (``self.to(result dtype)``)."""
    self, out = arg(call, 0, "self"), _first(call.out)
    if self.dtype == out.dtype:
        return [OUTPUTS]
    return [OUTPUTS, Alloc("scan: input as result dtype", self.numel() * itemsize(out.dtype))]


@CPU.scratch(aten.sort.default, aten.sort.stable, aten.sort.values, aten.sort.values_stable)
def _sort(call: OpCall) -> Steps:
    """``sort_kernel`` (``native/cpu/SortingKernel.cpp``): ``_fill_indices`` makes
    ``arange(size(dim))`` in ``int64`` and copies it into the indices."""
    self = arg(call, 0, "self")
    dim = call.kwargs.get("dim", -1)
    for a in call.args[1:]:
        if isinstance(a, int) and not isinstance(a, bool):
            dim = a
            break
    if self.dim() == 0:
        return [OUTPUTS]
    return [OUTPUTS, Alloc("sort: arange indices", self.shape[dim % self.dim()] * 8)]


# -- losses ----------------------------------------------------------------------------
#
# ``Reduction``: 0 none, 1 mean, 2 sum (``aten/src/ATen/core/Reduction.h``).


@CPU.scratch(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def _ctc_loss(call: OpCall) -> Steps:
    """``ctc_loss_cpu_template`` (``LossCTC.cpp``): ``log_alpha`` is made before
    ``neg_log_likelihood`` (the op returns them the other way round). Its size
    depends on the longest target (values): the op ran on them, or was listed."""
    return [Output(1), Output(0)]


@CPU.implementation(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward_output(call: OpCall) -> Any:
    """``_ctc_loss_backward`` has no meta kernel: its gradient is
    ``full_like(log_probs, -inf, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``."""
    log_probs = arg(call, 1, "log_probs")
    return torch.empty_like(log_probs, memory_format=torch.contiguous_format)


@CPU.scratch(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward(call: OpCall) -> Steps:
    """``ctc_loss_backward_cpu_template``: the gradient (``full_like(log_probs, -inf)``),
    then ``log_beta = empty_like(log_alpha)``, freed on return."""
    log_alpha = arg(call, 6, "log_alpha")
    return [OUTPUTS, Alloc("log_beta", log_alpha.numel() * log_alpha.element_size())]


def _reduction(call: OpCall, index: int) -> int:
    return int(arg(call, index, "reduction", 1))


def _reduce_loss(call: OpCall, numel: int, dtype: torch.dtype, reduction: int) -> list[Alloc | Free]:
    """``apply_loss_reduction`` (``Loss.cpp``): ``loss.mean()`` or ``loss.sum()``."""
    threads = profile_of(call).threads
    if reduction == 1:
        return mean_steps(threads, (numel, dtype), 1, dtype)
    return sum_steps(threads, (numel, dtype), 1, dtype)


def _scalar_in_input_sized_storage(out: torch.Tensor, numel: int) -> torch.Tensor:
    """A 0-dim loss whose storage kept the unreduced size: the CPU kernel allocated the
    output at the loss's full size and then ``resize_``d it to a scalar, which does
    not give the memory back."""
    big = torch.empty(numel, dtype=out.dtype, device=out.device)
    return big.resize_(())


def _broadcast_numel(*tensors: torch.Tensor) -> int:
    return torch.broadcast_shapes(*(t.shape for t in tensors)).numel()


@CPU.implementation(aten.mse_loss.default, aten.smooth_l1_loss.default)
def _pointwise_loss_output(call: OpCall) -> Any:
    """``mse_loss`` / ``smooth_l1_loss`` meta functions (``Loss.cpp``) build a binary
    iterator on the output, allocating it at the inputs' broadcast size, then
    ``resize_({})`` it when reducing: the scalar loss keeps that storage."""
    out = call.default()
    self, target = arg(call, 0, "self"), arg(call, 1, "target")
    if _reduction(call, 2) == 0 or not isinstance(out, torch.Tensor):
        return out
    if call.func is aten.smooth_l1_loss.default and float(arg(call, 3, "beta", 1.0)) == 0.0:
        return out  # beta == 0 is l1_loss
    return _scalar_in_input_sized_storage(out, _broadcast_numel(self, target))


@CPU.implementation(
    aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default, aten.huber_loss_backward.default
)
def _pointwise_loss_backward_layout(call: OpCall) -> Any:
    """``mse_loss_backward`` / ``smooth_l1_loss_backward`` / ``huber_loss_backward``
    (``Loss.cpp``) make the input gradient with ``at::zeros_like(input,
    LEGACY_CONTIGUOUS_MEMORY_FORMAT)``: contiguous whatever the input's layout (the
    meta kernel follows the input's strides), which decides later kernels' copies."""
    out = call.default()
    if isinstance(out, torch.Tensor) and not out.is_contiguous():
        return torch.empty_like(out, memory_format=torch.contiguous_format)
    return out


@CPU.scratch(aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default)
def _pointwise_loss(call: OpCall) -> Steps:
    """``mse_loss_out`` / ``smooth_l1_loss_out`` / ``huber_loss`` (``Loss.cpp``): reducing
    losses compute the unreduced loss into a temporary (``borrowing_binary_op``),
    then ``mean_out`` / ``sum_out`` it into the output."""
    self, target, out = arg(call, 0, "self"), arg(call, 1, "target"), _first(call.out)
    reduction = _reduction(call, 2)
    if reduction == 0:
        return [OUTPUTS]
    if call.func is aten.smooth_l1_loss.default and float(arg(call, 3, "beta", 1.0)) == 0.0:
        return [OUTPUTS]  # l1_loss: composite, its ops are traced
    numel = _broadcast_numel(self, target)
    loss = Alloc("unreduced loss", numel * out.element_size())
    if call.func is aten.huber_loss.default:
        steps: list[Any] = [loss, OUTPUTS]
    else:
        steps = [OUTPUTS, loss]
    return [*steps, *_reduce_loss(call, numel, out.dtype, reduction), Free(loss.tag)]


@CPU.implementation(aten.binary_cross_entropy.default)
def _bce_output(call: OpCall) -> Any:
    """``binary_cross_entropy_out_cpu`` (``Loss.cpp``) writes the unreduced loss into
    ``empty_like(input)``, then ``resize_as_`` it to the reduced scalar: the scalar
    keeps the input-sized storage."""
    out = call.default()
    if _reduction(call, 3) == 0:
        return out
    return _scalar_in_input_sized_storage(out, arg(call, 0, "self").numel())


@CPU.scratch(aten.binary_cross_entropy.default)
def _bce(call: OpCall) -> Steps:
    """``binary_cross_entropy_out_cpu``: ``apply_loss_reduction`` makes the reduced
    value, which is copied into the loss and freed."""
    self, out = arg(call, 0, "self"), _first(call.out)
    reduction = _reduction(call, 3)
    if reduction == 0:
        return [OUTPUTS]
    size = out.element_size()
    return [
        OUTPUTS,
        Alloc("reduced loss", size),
        *_reduce_loss(call, self.numel(), out.dtype, reduction),
        Free("reduced loss"),
    ]


@CPU.scratch(aten.binary_cross_entropy_backward.default)
def _bce_backward(call: OpCall) -> Steps:
    """``binary_cross_entropy_backward_out_cpu`` (``Loss.cpp``): for a mean,
    ``grad_input.div_(input.numel())`` wraps and casts the count."""
    out = _first(call.out)
    if _reduction(call, 4) != 1:
        return [OUTPUTS]
    return [OUTPUTS, Alloc("wrapped count", 8), Alloc("count as gradient dtype", out.element_size())]


@CPU.scratch(aten.binary_cross_entropy_with_logits.default)
def _bce_with_logits(call: OpCall) -> Steps:
    """``binary_cross_entropy_with_logits`` (``Loss.cpp``): ``log_sigmoid(input)``
    (``log_sigmoid_forward`` also makes an input-sized buffer), with ``pos_weight``
    ``(pos_weight - 1).mul(target).add_(1)`` multiplied into it, the loss into
    ``empty_like(input)`` by one kernel, then ``apply_loss_reduction``."""
    self, target = arg(call, 0, "self"), arg(call, 1, "target")
    pos_weight = arg(call, 3, "pos_weight")
    reduction = _reduction(call, 4)
    size = self.element_size()
    numel = self.numel()
    steps: list[Any] = [
        Alloc("log_sigmoid(input)", numel * size),
        Alloc("log_sigmoid buffer", numel * size),
        Free("log_sigmoid buffer"),
    ]
    if isinstance(pos_weight, torch.Tensor):
        weight_size = pos_weight.element_size()
        steps += [
            Alloc("wrapped 1", 8), Alloc("1 as pos_weight dtype", weight_size),
            Alloc("pos_weight - 1", pos_weight.numel() * weight_size),
            Free("1 as pos_weight dtype"), Free("wrapped 1"),
            Alloc("log_weight", _broadcast_numel(pos_weight, target) * weight_size),
            Alloc("wrapped 1 (add_)", 8), Alloc("1 as log_weight dtype", weight_size),
            Free("1 as log_weight dtype"), Free("wrapped 1 (add_)"),
            Free("pos_weight - 1"), Free("log_weight"),
        ]  # fmt: skip
    if reduction == 0:
        return [*steps, OUTPUTS, Free("log_sigmoid(input)")]
    return [
        *steps,
        Alloc("unreduced loss", numel * size),
        OUTPUTS,
        *_reduce_loss(call, numel, self.dtype, reduction),
        Free("unreduced loss"),
        Free("log_sigmoid(input)"),
    ]


# -- softmax ---------------------------------------------------------------------------


def _contiguous_copy(t: torch.Tensor) -> int:
    """Bytes ``t.contiguous()`` allocates (0 when ``t`` already is)."""
    return 0 if t.is_contiguous() else t.numel() * t.element_size()


@CPU.scratch(aten._softmax.default, aten._log_softmax.default)
def _softmax(call: OpCall) -> Steps:
    """``softmax_cpu_out`` / ``log_softmax_cpu_out`` (``SoftMax.cpp``): the output
    (structured), then ``input.contiguous()`` for the kernel."""
    x = arg(call, 0, "self")
    if x.numel() == 0:
        return [OUTPUTS]
    return [OUTPUTS, Alloc("input contiguous", _contiguous_copy(x))]


@CPU.scratch(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(call: OpCall) -> Steps:
    """``softmax_backward_cpu_out`` / ``log_softmax_backward_cpu_out`` (``SoftMax.cpp``):
    the input gradient (structured), then ``grad.contiguous()`` and
    ``output.contiguous()``."""
    grad, output = arg(call, 0, "grad_output"), arg(call, 1, "output")
    return [
        OUTPUTS,
        Alloc("grad contiguous", _contiguous_copy(grad)),
        Alloc("output contiguous", _contiguous_copy(output)),
    ]


@CPU.implementation(aten._log_softmax_backward_data.default)
def _log_softmax_backward_layout(call: OpCall) -> Any:
    """``log_softmax_backward_data``'s meta function (``SoftMax.cpp``) makes the input
    gradient with ``LEGACY_CONTIGUOUS_MEMORY_FORMAT``: contiguous whatever ``grad``'s
    layout (the fake kernel, a decomposition, follows it), which decides whether
    ``AccumulateGrad`` can keep it as the leaf's gradient."""
    out = call.default()
    if isinstance(out, torch.Tensor) and not out.is_contiguous():
        return torch.empty_like(out, memory_format=torch.contiguous_format)
    return out
