"""Outputs of the ops whose meta (fake) kernel is missing or lays them out otherwise than the real one.

For the trace only: the ops that torch gives no meta (fake) kernel, or one that
lays the output out otherwise than the real kernel.

Fake tensors run an op through its meta or fake kernel; torch 2.13 registers
none for the backwards below, which have CPU and CUDA kernels, so the trace
stopped at them ("fake tensors cannot run it"). Each implementation makes the
outputs the real kernel returns (shapes, dtypes, contiguous layouts, as
``aten/src/ATen/native`` allocates them) from the arguments alone: the outputs
depend on no tensor values. They are implementation rules of the device
models, registered on every model's rule set (:func:`register_meta_kernels`);
nothing is registered in torch itself. The kernels' scratch is the devices'
concern (``cpu/pool.py``, ``cpu/losses.py``). Ops with a CPU kernel alone
(``histogram``, ``histogramdd``'s) get theirs from the CPU rules
(``cpu/histogram.py``): on ``cuda`` the trace stops where the step would fail.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.tensor_iterator import non_overlapping_and_dense
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["laid_out_as_cloned", "register_meta_kernels"]

# torch's private names (engine/torch_compat/torch_private.py)
suggest_memory_format: Final = private("torch._prims_common.suggest_memory_format")

aten = torch.ops.aten


#: Backwards whose input gradient is made like ``self`` (the op's second argument).
_GRAD_INPUT_LIKE_SELF: Final = (
    aten.fractional_max_pool3d_backward.default,
    aten.multi_margin_loss_backward.default,
    aten.multilabel_margin_loss_backward.default,
)


def _grad_input_like_self(call: OpCall) -> torch.Tensor:
    """``fractional_max_pool3d_backward_cpu`` (``FractionalMaxPool3d.cpp``):
    ``gradInput.resize_as_(input)``; ``multi_margin_loss_cpu_backward``
    (``LossMultiMargin.cpp``): ``grad_input.resize_as_(input)``;
    ``multilabel_margin_loss_backward_cpu`` (``LossMultiLabelMargin.cpp``):
    ``at::zeros_like(self, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``: contiguous, with
    ``self``'s shape and dtype."""
    self = call.arg(1, "self")
    return torch.empty(self.shape, dtype=self.dtype, device=self.device)


#: Ops made as ``self.clone()`` (preserve_format) then written into, and the last torch
#: release whose fake kernel lays their output out otherwise: ``index_fill`` made a
#: dense ``self``'s result contiguous (a size-1 dim's stride 0 too: the incoming
#: gradient of a sum, expanded, which autograd's accumulation would then steal where
#: the real one copies it); the scatters kept an expanded ``self``'s stride 0 (the
#: values copied into such an output overlap).
_CLONE_LAYOUT_FAKED_UNTIL: Final = {
    aten.index_fill.int_Scalar: (2, 11),
    aten.select_scatter.default: (2, 11),
    aten.slice_scatter.default: (2, 11),
    aten.diagonal_scatter.default: (2, 12),
}


def _like_its_clone(call: OpCall) -> torch.Tensor:
    return laid_out_as_cloned(call, call.default())


def laid_out_as_cloned(call: OpCall, out: Any) -> Any:
    """``out`` of an op of :data:`_CLONE_LAYOUT_FAKED_UNTIL`, laid out as ``self.clone()``
    is where its fake kernel does not: a non-overlapping and dense ``self``'s strides,
    else contiguous in its suggested memory format (``out`` itself for any other op)."""
    until = _CLONE_LAYOUT_FAKED_UNTIL.get(call.func)
    if until is None or torch_minor() > until:
        return out
    self = call.args[0]
    if non_overlapping_and_dense(self):
        return out if out.stride() == self.stride() else out.new_empty_strided(self.shape, self.stride())
    fmt = suggest_memory_format(self)
    return out if out.is_contiguous(memory_format=fmt) else torch.empty_like(out, memory_format=fmt)


#: The fused optimizer steps without a meta kernel (torch 2.10 to 2.15 register one for
#: ``_fused_adam_.default`` and ``_fused_adamw_.default`` only): ``SGD(fused=True)``,
#: ``Adagrad(fused=True)``, and Adam/AdamW with a tensor ``lr``.
_FUSED_STEPS: Final = (
    aten._fused_sgd_.default,
    aten._fused_sgd_.tensor_lr,
    aten._fused_adagrad_.default,
    aten._fused_adagrad_.tensor_lr,
    aten._fused_adam_.tensor_lr,
    aten._fused_adamw_.tensor_lr,
)


def _fused_step(call: OpCall) -> None:
    """A fused optimizer step writes its tensor lists in place and returns nothing
    (``-> ()``). CUDA (``FusedSgdKernel.cu``, ``FusedAdagradKernel.cu``,
    ``FusedAdam[W]Kernel.cu``): one ``multi_tensor_apply`` launch whose tensor
    addresses travel as the kernel's argument (``TensorListMetadata``,
    ``MultiTensorApply.cuh``), ``grad_scale``/``found_inf``/``lr`` read through their
    data pointers (a host ``lr`` through ``lr.item()``): nothing is allocated. CPU
    (``FusedSGD.cpp``, ``FusedAdagrad.cpp``, ``FusedAdam.cpp``): a loop over the
    parameters, each updated in place by the vectorized kernel: nothing allocated
    either (``measure(device="cpu")`` agrees: tests/test_fused_optimizers.py)."""
    return None


def register_meta_kernels(rules: RuleSet) -> None:
    """Register the implementations above on ``rules``."""
    rules.implementation(*_GRAD_INPUT_LIKE_SELF)(_grad_input_like_self)
    rules.implementation(*_FUSED_STEPS)(_fused_step)
    # (an op with an implementation already, an eager in-place one of autograd_paths,
    # lays its out-of-place result out so itself)
    rules.implementation(*(op for op in _CLONE_LAYOUT_FAKED_UNTIL if rules.implementation_rule(op) is None))(
        _like_its_clone
    )
