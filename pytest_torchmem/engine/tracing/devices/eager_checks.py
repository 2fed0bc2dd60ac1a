"""The argument checks of matrix products that fake kernels skip: the estimate fails as the step does.

PyTorch's Python meta kernels, which fake tensors run, accept a matrix
product of two dtypes (``nn.Linear`` on an int64 input, a half model on a
float32 input) and word a shape mismatch their own way. The real kernels
refuse both: these check rules raise what they raise, word for word, so that
``estimate`` and ``torchmem.check`` fail where ``measure`` and eager fail, and
record nothing. The messages follow ATen's structured meta functions (shared
by CPU and CUDA: ``mm``, ``addmm``) and the CPU kernels (``bmm``,
``baddbmm``, ``addmv``, ``mv``, ``dot``) of the torch version we pin; the tests run
each case eagerly and compare the messages.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet

__all__ = ["register_checks"]

aten = torch.ops.aten

#: ``c10::ScalarType`` names, as ``toString(ScalarType)`` prints them.
_SCALAR_TYPE: Final = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}
#: ``caffe2::TypeMeta`` names, as ``<<`` of a tensor's ``dtype()`` prints them.
_TYPE_META: Final = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.int64: "long int",
    torch.int32: "int",
    torch.int16: "short int",
    torch.int8: "signed char",
    torch.uint8: "unsigned char",
    torch.bool: "bool",
    torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}


def _scalar(dtype: torch.dtype) -> str:
    return _SCALAR_TYPE.get(dtype, str(dtype).removeprefix("torch."))


def _meta(dtype: torch.dtype) -> str:
    return _TYPE_META.get(dtype, str(dtype).removeprefix("torch."))


def _tensors(call: OpCall, count: int) -> tuple[Any, ...] | None:
    found = call.args[:count]
    if len(found) < count:
        return None
    for t in found:  # (a loop, not all() over a generator: every matrix product asks)
        if not isinstance(t, torch.Tensor):
            return None
    return found


def _shapes(op: str, mat1: torch.Tensor, mat2: torch.Tensor) -> None:
    """The shape check of ATen's ``mm``/``addmm`` meta functions.

    From torch 2.15 the message starts with the op's name ("addmm: mat1 and
    mat2 shapes cannot be multiplied (2x5 and 4x2)", "mm: ..."), read from the
    eager kernels of each release 2.10.0 to 2.15.0; before, it has no prefix.
    """
    if mat1.dim() == 2 and mat2.dim() == 2 and mat1.shape[1] != mat2.shape[0]:
        prefix = f"{op}: " if torch_minor() >= (2, 15) else ""
        raise RuntimeError(
            f"{prefix}mat1 and mat2 shapes cannot be multiplied ({mat1.shape[0]}x{mat1.shape[1]} "
            f"and {mat2.shape[0]}x{mat2.shape[1]})"
        )


def _mm(call: OpCall) -> None:
    tensors = _tensors(call, 2)
    if tensors is None:
        return
    mat1, mat2 = tensors
    _shapes("mm", mat1, mat2)
    if mat1.dtype != mat2.dtype:
        raise RuntimeError(
            "expected m1 and m2 to have the same dtype, but got: "
            f"{_meta(mat1.dtype)} != {_meta(mat2.dtype)}"
        )


def _addmm(call: OpCall) -> None:
    tensors = _tensors(call, 3)
    if tensors is None:
        return
    bias, mat1, mat2 = tensors
    if bias.dtype != mat2.dtype:
        raise RuntimeError(
            "self and mat2 must have the same dtype, but got "
            f"{_scalar(bias.dtype)} and {_scalar(mat2.dtype)}"
        )
    if mat1.dtype != mat2.dtype:
        raise RuntimeError(
            "mat1 and mat2 must have the same dtype, but got "
            f"{_scalar(mat1.dtype)} and {_scalar(mat2.dtype)}"
        )
    _shapes("addmm", mat1, mat2)


def _batch_shapes(batch1: torch.Tensor, batch2: torch.Tensor) -> None:
    if batch1.dim() != 3 or batch2.dim() != 3:
        return
    expected = [batch1.shape[0], batch1.shape[2]]
    if list(batch2.shape[:2]) != expected:
        raise RuntimeError(
            "Expected size for first two dimensions of batch2 tensor to be: "
            f"[{expected[0]}, {expected[1]}] but got: [{batch2.shape[0]}, {batch2.shape[1]}]."
        )


def _bmm(call: OpCall) -> None:
    tensors = _tensors(call, 2)
    if tensors is None:
        return
    batch1, batch2 = tensors
    _batch_shapes(batch1, batch2)
    if batch1.dtype != batch2.dtype:
        raise RuntimeError(
            f"expected scalar type {_scalar(batch1.dtype)} but found {_scalar(batch2.dtype)}"
        )


def _baddbmm(call: OpCall) -> None:
    tensors = _tensors(call, 3)
    if tensors is None:
        return
    bias, batch1, batch2 = tensors
    _batch_shapes(batch1, batch2)
    if bias.dtype != batch1.dtype:  # the meta function compares the input with batch1 ...
        names = (_meta(t.dtype) for t in (bias, batch1, batch2))
        raise RuntimeError(
            "Input dtypes must be the same, got: input {}, batch1: {}, batch2: {}".format(*names)
        )
    if batch1.dtype != batch2.dtype:  # ... and the CPU kernel batch1 with batch2
        raise RuntimeError(
            f"expected scalar type {_scalar(batch1.dtype)} but found {_scalar(batch2.dtype)}"
        )


def _addmv_dtypes(result: torch.Tensor, mat: torch.Tensor, vec: torch.Tensor) -> None:
    """From torch 2.12 the three dtypes must agree; 2.10 and 2.11 check the matrix
    against the vector only (the kernel's ``expected scalar type`` check)."""
    if torch_minor() < (2, 12):
        if mat.dtype != vec.dtype:
            raise RuntimeError(f"expected scalar type {_scalar(mat.dtype)} but found {_scalar(vec.dtype)}")
        return
    if not result.dtype == mat.dtype == vec.dtype:
        names = [_scalar(t.dtype) for t in (result, mat, vec)]
        raise RuntimeError(
            f"addmv input tensors must have the same dtype, but got {names[0]}, {names[1]}, "
            f"and {names[2]}"
        )


def _addmv(call: OpCall) -> None:
    tensors = _tensors(call, 3)
    if tensors is not None:
        _addmv_dtypes(*tensors)


def _mv(call: OpCall) -> None:
    tensors = _tensors(call, 2)
    if tensors is not None:  # the CPU mv is an addmv into a result of the vector's dtype
        mat, vec = tensors
        _addmv_dtypes(vec, mat, vec)


def _dot(call: OpCall) -> None:
    tensors = _tensors(call, 2)
    if tensors is None:
        return
    first, second = tensors
    if first.dtype != second.dtype:
        raise RuntimeError(
            "dot : expected both vectors to have same dtype, but found "
            f"{_scalar(first.dtype)} and {_scalar(second.dtype)}"
        )


def register_checks(rules: RuleSet) -> None:
    """Every check, on every device: on cuda, the ``bmm``, ``baddbmm``, ``mv`` and
    ``dot`` refusals are worded as the CPU kernels word them (a GPU refuses the
    same arguments in other words)."""
    rules.check(aten.mm.default)(_mm)
    rules.check(aten.addmm.default)(_addmm)
    rules.check(aten.bmm.default)(_bmm)
    rules.check(aten.baddbmm.default)(_baddbmm)
    rules.check(aten.addmv.default)(_addmv)
    rules.check(aten.mv.default)(_mv)
    rules.check(aten.dot.default)(_dot)
