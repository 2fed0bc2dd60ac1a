"""What fake tensors cannot do that a real step can: the errors they raise, told apart from the program's.

A fake tensor has shapes, strides and a device but no data, and some ops have
no fake or meta kernel. Where the traced step meets such a limit, an op (or
C++ code reading values) raises an error that the real step has no reason to
raise: the trace stops there and lists it in ``unsupported``
(:func:`fake_tensor_limit` says which errors those are). Every other error is
the program's own (a shape mismatch the real kernel raises too) and reaches
the caller unchanged.

Some of these errors have types of their own; the others are told by their
wording, which torch's C++ and Python code writes: each constant below names
the function that writes it, and ``tests/test_torch_constants.py`` raises each
one on the running torch (CI runs it on every release of the window).
"""

from __future__ import annotations

from typing import Final

from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = [
    "CANNOT_RUN",
    "DATA_NOT_ALLOCATED",
    "FAKE_LIMITS",
    "META_STORAGE_ITEM",
    "NEEDS_VALUES",
    "NO_DATA_POINTER",
    "NO_FAKE_KERNEL",
    "NO_META_KERNEL",
    "NO_STORAGE",
    "NUMPY_OF_SUBCLASS",
    "TraceAborted",
    "UnsupportedOperatorException",
    "fake_tensor_limit",
    "first_line",
]

#: What the fake mode raises for an op it has no fake or meta kernel for.
UnsupportedOperatorException: Final = private("torch._subclasses.fake_tensor.UnsupportedOperatorException")

#: What fake tensors raise for an op they cannot run, where a real tensor would run it.
CANNOT_RUN: Final = (
    UnsupportedOperatorException,
    private("torch._subclasses.fake_tensor.UnsupportedFakeTensorException"),
    private("torch._subclasses.fake_tensor.UnsupportedMutationAliasingException"),
)
#: What fake tensors raise where the program asks a question only values answer.
NEEDS_VALUES: Final = (
    private("torch._subclasses.fake_tensor.DataDependentOutputException"),
    private("torch._subclasses.fake_tensor.DynamicOutputShapeException"),
)

# The wording of the errors a fake tensor raises where a real one has no reason to.

#: ``TensorImpl::data_ptr_impl_impl`` (c10/core/TensorImpl.h): a C++ kernel reads the
#: data of a tensor whose storage holds none ("The tensor has a non-zero number of
#: elements, but its data is not allocated yet"), a fake tensor's meta storage.
DATA_NOT_ALLOCATED: Final = "data is not allocated yet"
#: ``TensorImpl::throw_data_ptr_access_error`` (c10/core/TensorImpl.cpp: "... that
#: doesn't have storage") and ``throwNullDataPtrError`` (c10/core/StorageImpl.cpp:
#: "... (e.g. FakeTensor, FunctionalTensor)"): C++ code asks for the data pointer of a
#: tensor that has no data.
NO_DATA_POINTER: Final = "Cannot access data pointer of Tensor"
#: ``TensorImpl::throw_storage_access_error`` (c10/core/TensorImpl.cpp): C++ code asks for
#: the storage of a tensor that has none.
NO_STORAGE: Final = "Cannot access storage of"
#: ``tensor_to_numpy`` (torch/csrc/utils/tensor_numpy.cpp): ``Tensor.numpy()``, and NumPy's
#: ``__array__``, of a tensor subclass (a fake tensor is one).
NUMPY_OF_SUBCLASS: Final = ".numpy() is not supported for tensor subclasses"
#: ``_StorageBase.__getitem__`` and ``TypedStorage._getitem`` (torch/storage.py): the
#: elements of a meta storage, which a fake tensor's is.
META_STORAGE_ITEM: Final = "Not available for 'meta' device type"
#: ``metaFallback`` (aten/src/ATen/core/MetaFallbackKernel.cpp: "...there was no fake impl
#: or Meta kernel registered") and a ``torch.library`` custom op's fake kernel
#: (torch/_library/custom_ops.py, ``CustomOpDef``: "There was no fake impl registered
#: for ..."): an op with neither a fake nor a meta kernel.
NO_FAKE_KERNEL: Final = "no fake impl"
#: ``OperatorEntry::reportError`` (aten/src/ATen/core/dispatch/OperatorEntry.cpp): "Could
#: not run '<op>' with arguments from the 'Meta' backend", an op with no kernel for the
#: meta tensors inside fake ones.
NO_META_KERNEL: Final = "'Meta' backend"

#: The wordings, in the order they are tried.
FAKE_LIMITS: Final = (
    DATA_NOT_ALLOCATED,
    NO_DATA_POINTER,
    NO_STORAGE,
    NUMPY_OF_SUBCLASS,
    META_STORAGE_ITEM,
    NO_FAKE_KERNEL,
    NO_META_KERNEL,
)


class TraceAborted(Exception):
    """Raised inside the trace when an op can be neither run nor modelled."""


def fake_tensor_limit(exc: BaseException) -> bool:
    """Whether ``exc`` comes from what fake tensors lack (values, a fake kernel),
    not from the traced program: the real step has no reason to raise it."""
    if isinstance(exc, (*CANNOT_RUN, *NEEDS_VALUES)):
        return True
    if not isinstance(exc, (RuntimeError, NotImplementedError)):
        return False
    text = str(exc)
    return any(limit in text for limit in FAKE_LIMITS)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (fake-tensor messages run to many lines)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
