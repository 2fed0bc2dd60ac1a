"""RMSNorm on the GPU: ``rms_norm`` runs the fused CUDA kernel, not the composite ops.

``at::rms_norm`` (``aten/src/ATen/native/layer_norm.cpp``, ``rms_norm_symint``)
calls ``_fused_rms_norm`` on every device but MPS, except for a channels-last
input, a complex one, or a weight of another dtype than the input's (a warning
then, and ``rms_norm_composite``). ``_fused_rms_norm`` has a CUDA kernel
(``_fused_rms_norm_cuda``, ``layer_norm_kernel.cu``) and no meta or CPU one:
elsewhere its ``CompositeImplicitAutograd`` registration decomposes it into
``pow``, ``mean``, ``add_``, ``rsqrt`` and two ``mul``\\ s, and autograd records
each. The trace's tensors live on the meta device, so without this route the
fake GPU ran the CPU's ops: each norm kept its upcast input, squared input and
product for the backward instead of the kernel's ``rstd`` alone. Seen on an H100
with torch 2.11: two ``nn.RMSNorm(512)`` over a (64, 512) batch, measured 256 KiB
below that estimate in the forward, half of it in the backward.

The CUDA kernel makes the output (the input's shape and dtype, contiguous) and
``rstd`` (``[*batch, 1, ...]`` in the accumulate type: float for half and
bfloat16) from ``input.expect_contiguous()`` and ``weight.expect_contiguous()``;
its autograd node (``FusedRmsNormBackward0``) saves the input, the weight and
``rstd``, and runs ``_fused_rms_norm_backward`` (meta kernel in torch). The
contiguous copies and the backward's buffers are scratch rules of ``temporaries.py``. Here the op runs below autograd (its outputs from
:func:`_fused_outputs`) inside an autograd function that saves those three and
calls the same backward.

Not routed: CUDA autocast regions (``rms_norm`` runs in float32 there from
2.12, ``autocast.py``), which keep the composite ops.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.kernel_choices import suggest_memory_format
from pytest_torchmem.engine.tracing.devices.cuda.routes import Router, VariableFunctions, aten, bind, on_gpu, route
from pytest_torchmem.engine.tracing.rules import OpCall

__all__ = ["takes_fused_rms_norm"]

# torch's private names (engine/torch_compat/torch_private.py)
_BelowAutograd: Final = private("torch._C._AutoDispatchBelowAutograd")

_CHANNELS_LAST: Final = (torch.channels_last, torch.channels_last_3d)


def takes_fused_rms_norm(input: Any, weight: Any) -> bool:
    """Whether ``rms_norm_symint`` calls ``_fused_rms_norm`` for a GPU ``input``."""
    return (
        on_gpu(input)
        and not input.is_nested
        and suggest_memory_format(input) not in _CHANNELS_LAST
        and not input.is_complex()
        and input.dtype.is_floating_point
        and (weight is None or weight.dtype == input.dtype)
    )


class _FusedRmsNorm(torch.autograd.Function):
    """``_fused_rms_norm`` with its autograd node: saves the input, ``rstd`` and the
    weight; its backward is ``_fused_rms_norm_backward``."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: Any, shape: list[int], eps: Any) -> torch.Tensor:
        with _BelowAutograd():
            out, rstd = aten._fused_rms_norm.default(input, shape, weight, eps)
        ctx.save_for_backward(input, rstd, weight)
        ctx.shape = shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        input, rstd, weight = ctx.saved_tensors
        mask = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])]
        with _BelowAutograd():
            grad_input, grad_weight = aten._fused_rms_norm_backward.default(grad, input, ctx.shape, rstd, weight, mask)
        return (grad_input if mask[0] else None), (grad_weight if mask[1] else None), None, None


@route(VariableFunctions.rms_norm)
def _rms_norm(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::rms_norm``: the fused kernel where ``rms_norm_symint`` takes it."""
    input, shape, weight, eps = bind(args, kwargs, ("input", "normalized_shape", "weight", "eps"), (None, None))
    if router.autocast_dtype() is not None or not takes_fused_rms_norm(input, weight):
        return func(*args, **kwargs)
    shape = [int(s) for s in shape]
    records = torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad))
    if not records:
        with _BelowAutograd():
            return aten._fused_rms_norm.default(input, shape, weight, eps)[0]
    return _FusedRmsNorm.apply(input, weight, shape, eps)


def _accumulate_type(dtype: torch.dtype) -> torch.dtype:
    """``at::toAccumulateType(dtype, /*is_cuda=*/true)`` for the floating types."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16, torch.float32) else dtype


@CUDA.implementation(aten._fused_rms_norm.default)
def _fused_outputs(call: OpCall) -> Any:
    """``_fused_rms_norm_cuda``: the output like the input, contiguous, and ``rstd`` of
    the batch dims with a 1 for each normalized one, in the accumulate type."""
    input, shape = call.arg(0, "input"), call.arg(1, "normalized_shape")
    axis = input.dim() - len(shape)
    out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    rstd = torch.empty((*input.shape[:axis], *([1] * len(shape))), dtype=_accumulate_type(input.dtype), device=input.device)
    return out, rstd
