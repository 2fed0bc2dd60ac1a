"""CPU rules: ``_scaled_mm``, the float8 matrix product (torchao's float8 training).

Below the AMX level the CPU kernel is a program of other ATen ops
(``_scaled_mm_out_cpu`` and ``_scaled_mm_out_cpu_emulated``,
``aten/src/ATen/native/Blas.cpp``, torch 2.13), called in C++ below the
dispatcher, so the fake trace (one meta kernel for the whole op) sees only its
result. :func:`_scaled_mm` runs the same program through the trace, each op with
its own rules: the operands made contiguous (a transposed float8 matrix copied
through ``copy_``'s block buffer), the result sized, both operands cast to
``float`` and scaled (a tensorwise scale read with ``item()`` and multiplied as a
number, a wrapped double and its float copy; rowwise scales multiplied as
tensors), their ``float`` product, the bias added, the cast to the result's dtype
and the copy into it; the copies and the ``float`` products live until the kernel
returns. The scales' values change no size, so the replica multiplies by 1.

On the ``amx`` level, with oneDNN enabled, a tensorwise call goes to oneDNN
instead (``mkldnn_scaled_mm``), whose scratch no rule models: listed.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, NATIVE_INSTRUCTIONS, profile_of
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Inexact, OpCall, Steps

__all__: list[str] = []

aten = torch.ops.aten

_FLOAT8: Final = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)
#: The float8 result dtypes for which the kernel divides by ``scale_result``.
_SCALED_RESULT: Final = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

_ONEDNN_GAP: Final = Inexact(
    f"_scaled_mm on the amx level {NATIVE_INSTRUCTIONS} runs oneDNN's float8 matmul "
    "(mkldnn_scaled_mm), whose scratch is not modelled; the figure is that of the emulated "
    "kernel of lower levels"
)


def _tensorwise(t: torch.Tensor, scale: torch.Tensor) -> bool:
    """``is_tensorwise_scaling``: a float8 matrix, one ``float`` scale."""
    return t.dtype in _FLOAT8 and scale.dtype == torch.float32 and scale.numel() == 1


def _rowwise(t: torch.Tensor, scale: torch.Tensor) -> bool:
    """``is_rowwise_scaling``: a float8 matrix, a contiguous ``float`` scale of ``(rows, 1)``."""
    return (
        t.dtype in _FLOAT8
        and scale.dtype == torch.float32
        and scale.dim() == 2
        and scale.shape[0] == t.shape[0]
        and scale.shape[1] == 1
        and scale.is_contiguous()
    )


def _joint_scaling(
    mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> bool:
    """``get_joint_scaling``: True for tensorwise operands, False for rowwise ones;
    raises what the kernel raises for anything else."""
    if _tensorwise(mat1, scale_a) and _tensorwise(mat2.t(), scale_b.t()):
        return True
    if _rowwise(mat1, scale_a) and _rowwise(mat2.t(), scale_b.t()):
        return False
    raise ValueError(
        "Invalid scaling configuration.\n"
        "- For TensorWise scaling, a and b should be float8, scales should be float and singletons.\n"
        f"- For RowWise scaling, a and b should be float8, scales should be float, scale_a should be "
        f"({mat1.shape[0]}, 1) and scale_b should be (1, {mat2.shape[1]}), and both should be contiguous.\n"
        f"Got mat_a.dtype()={mat1.dtype}, scale_a.dtype()={scale_a.dtype}, scale_a.size()="
        f"{list(scale_a.shape)}, mat_b.dtype()={mat2.dtype}, scale_b.dtype()={scale_b.dtype}, "
        f"scale_b.size()={list(scale_b.shape)}"
    )


def _checked(mat1: torch.Tensor, mat2: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The shape checks of ``_scaled_mm_out_cpu_emulated``, with its messages (the
    estimate fails where the step would)."""
    if mat1.dim() != 2:
        raise RuntimeError("mat1 must be a matrix")
    if mat2.dim() != 2:
        raise RuntimeError("mat2 must be a matrix")
    if mat1.shape[1] != mat2.shape[0]:
        raise RuntimeError(
            f"mat_a and mat_b shapes cannot be multiplied ({mat1.shape[0]}x{mat1.shape[1]} "
            f"and {mat2.shape[0]}x{mat2.shape[1]})"
        )
    if bias is not None and bias.numel() != mat2.shape[1]:
        raise RuntimeError(f"Bias must be size {mat2.shape[1]} but got {bias.numel()}")


def _scaled(mat: torch.Tensor, scale: torch.Tensor, tensorwise: bool) -> torch.Tensor:
    """``at::mul(mat.to(kFloat), scale)``: a tensorwise scale read with ``item()`` is a
    number (``mul.Scalar`` wraps it), a rowwise one a tensor."""
    as_float = mat.to(torch.float32)
    return aten.mul.Scalar(as_float, 1.0) if tensorwise else aten.mul.Tensor(as_float, scale)


@CPU.composite(aten._scaled_mm.default, aten._scaled_mm.out)
def _scaled_mm(call: OpCall) -> Any:
    """``_scaled_mm_cpu`` / ``_scaled_mm_out_cpu`` and ``_scaled_mm_out_cpu_emulated``
    (``Blas.cpp``), op by op (see the module's docstring): tensorwise scales multiply
    as numbers (``item()``), rowwise ones as ``(M, 1)`` and ``(1, N)`` tensors."""
    mat1, mat2 = call.arg(0, "self"), call.arg(1, "mat2")
    scale_a, scale_b = call.arg(2, "scale_a"), call.arg(3, "scale_b")
    bias = call.arg(4, "bias")
    out_dtype = call.arg(6, "out_dtype")
    out = call.kwargs.get("out")
    if out is not None and out_dtype is not None and out_dtype != out.dtype:
        raise ValueError("out_dtype must match output matrix type")
    tensorwise = _joint_scaling(mat1, mat2, scale_a, scale_b)
    _checked(mat1, mat2, bias)
    mat1_cont = mat1.contiguous()
    mat2_cont = mat2.contiguous()
    shape = [mat1_cont.shape[0], mat2_cont.shape[1]]
    if out is None:
        # at::empty({0}) then resize_output: the result's bytes are taken here
        out = aten.empty.memory_format(shape, dtype=out_dtype or mat1.dtype, device=mat1.device)
    else:
        aten.resize_.default(out, shape)
    # (a tensorwise scale is read with item(): a Python number, wrapped by mul.Scalar)
    fp32_mat_a = _scaled(mat1_cont, scale_a, tensorwise)
    fp32_mat_b = _scaled(mat2_cont, scale_b, tensorwise)
    out_tmp = aten.matmul.default(fp32_mat_a, fp32_mat_b)
    if bias is not None:
        out_tmp.add_(bias)
    if (out_dtype or torch.bfloat16) in _SCALED_RESULT:
        out_tmp = aten.mul.Scalar(out_tmp, 1.0)
    out_tmp = out_tmp.to(out.dtype)
    out.copy_(out_tmp)
    # the kernel's locals, given back when it returns
    del mat1_cont, mat2_cont, fp32_mat_a, fp32_mat_b, out_tmp
    return out


@CPU.scratch(aten._scaled_mm.default, aten._scaled_mm.out)
def _scaled_mm_onednn(call: OpCall) -> Steps:
    """``_scaled_mm_out_cpu`` (``Blas.cpp``) sends a tensorwise call to oneDNN where the
    CPU has AMX (``cpuinfo_has_x86_amx_int8``, or ``_fp16`` for operands of two float8
    dtypes) and oneDNN is enabled: not modelled, listed."""
    scale_a, scale_b = call.arg(2, "scale_a"), call.arg(3, "scale_b")
    if (
        profile_of(call).isa == "amx"
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and scale_a.numel() == 1
        and scale_b.numel() == 1
    ):
        return [_ONEDNN_GAP, OUTPUTS]
    return None
