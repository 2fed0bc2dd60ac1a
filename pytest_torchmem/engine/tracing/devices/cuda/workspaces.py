"""CUDA rules: the workspaces cuBLAS, cuBLASLt and cuDNN take from the caching allocator.

**cuBLAS / cuBLASLt** (``aten/src/ATen/cuda/CublasHandlePool.cpp``; the
logic below was read from the torch 2.14.1 CUDA wheel's
``parseChosenWorkspaceSize``, ``parseCUDABlasLtWorkspaceSize`` and
``getCUDABlasLtWorkspace``, and torch 2.13 declares the same API in
``ATen/cuda/CUDAContextLight.h``):

* ``getCurrentCUDABlasHandle()`` gives the calling thread's handle and gives it
  a workspace of ``getChosenWorkspaceSize()`` bytes, allocated from the caching
  allocator the first time a (handle, stream) pair is seen and kept in a map
  until ``torch._C._cuda_clearCublasWorkspaces()``. The size is
  ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, KiB) or, by default,
  32 MiB on compute capability 9.x-12.x (Hopper, Blackwell) and
  ``:4096:2:16:8`` = 8 MiB + 128 KiB before.
* cuBLASLt calls (``gemm_and_bias`` of ``addmm`` with a bias epilogue,
  ``_addmm_activation``, ``_scaled_mm``, ``_int_mm``, and every gemm when
  ``TORCH_BLAS_PREFER_CUBLASLT=1``) take ``getCUDABlasLtWorkspace()``. By
  default (``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset or 1) that *is* the cuBLAS
  workspace of the same (handle, stream), allocated at the cuBLAS size when it
  does not exist yet. With ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`` cuBLASLt has
  its own map and ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024) per (handle,
  stream), and its calls leave the cuBLAS one alone (the Lt handle is fetched
  with ``setup=false``) from 2.12 on; 2.10 and 2.11 fetch it as the cuBLAS
  handle, whose workspace is made then too: their first cuBLASLt call of a
  thread takes both.
* Handles are per thread (``DeviceThreadHandlePool``): the forward and the
  optimizer run on the calling thread, ``loss.backward()`` runs the CUDA ops on
  the autograd engine's device thread. A step that multiplies matrices in both
  therefore holds **two** workspaces: the first matmul of the forward takes one
  and the first matmul of the backward (the first one inside an autograd node)
  another. Both stay allocated to the end of the step (``Keep``).

Per release (each read from that release's PyPI CUDA wheel, ``libtorch_cuda.so``;
docs/explanation/torch-releases.md lists them): the architectures that get the
32 MiB default (:func:`_big_default_workspace`), the default of
``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` (off on 2.10-2.11, :func:`unified_workspaces`),
and torch 2.15's uncached workspaces (:func:`workspace_caching`): there each
gemm and gemv takes its workspace for the call alone and cuBLASLt keeps its own,
unless ``TORCH_CUBLAS_WORKSPACE_CACHE=1``.

``measure(device="cuda")`` starts from ``empty_cache()``, no cuBLAS workspaces
(``torch._C._cuda_clearCublasWorkspaces()``) and reset peak statistics, then
runs one step, so the estimate charges each workspace at the first BLAS call
of its thread in the step. Not seen from the trace: a size set in-process with
``torch.backends.cuda.cublas_workspace_size(n)`` (only the environment is
read), side streams, and threads other than these two.

Besides the workspace, the matmuls copy operands whose strides no BLAS leading
dimension describes (``prepare_matrix_for_cublas`` in
``ATen/native/cuda/cuBlasCommonArgs.h``, ``prepare_batch_matrix_for_cublas``
and ``baddbmm_out_cuda_impl`` in ``native/cuda/Blas.cpp``, ``addmv_out_cuda``):
a stride-0 gradient expanded by ``sum()``'s backward, for instance, is cloned
contiguous for the duration of the call.

**cuDNN convolutions** (``native/cudnn/Conv_v8.cpp``, ``ConvShared.cpp``,
``native/Convolution.cpp``): each cuDNN call runs an execution plan whose
workspace, ``plan.getWorkspaceSize()`` bytes, is allocated from the caching
allocator for the call and freed after it (``run_conv_plan``). Which engine
cuDNN's heuristics rank first (or ``benchmark=True`` times fastest) cannot be
known without the GPU, and neither can its workspace: it is a policy, see
:func:`conv_workspace_policy`. The rules here model what *is* known: the
backend ``_select_conv_backend`` picks on CUDA (cuDNN; the native depthwise
kernels ``_conv_depthwise2d``/``conv_depthwise3d``; the slow im2col paths when
cuDNN cannot run), the ``contiguous(memory_format)`` copies each path makes,
the im2col ``columns`` buffers (and cuBLAS workspace) of ``slow_conv2d`` and
the bias gradient's reduction (``grad_output.sum({0, 2, 3})``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Final, Literal

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cuda.base import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.reduce_launch import reduction_steps
from pytest_torchmem.engine.tracing.devices.memo import BoundedMemo
from pytest_torchmem.engine.tracing.devices.tensor_iterator import non_overlapping_and_dense
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    Keep,
    OpCall,
    Step,
    TraceContext,
    nbytes_of,
)
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor as _release
from pytest_torchmem.engine.figures.units import parse_bytes

__all__ = [
    "CONV_WORKSPACE_ENV",
    "ConvWorkspacePolicy",
    "blas_workspace_steps",
    "conv_workspace_policy",
    "cublas_workspace_size",
    "cublaslt_workspace_size",
    "unified_workspaces",
    "workspace_caching",
]

# torch's private names (engine/torch_compat/torch_private.py)
suggest_memory_format: Final = private("torch._prims_common.suggest_memory_format")
_current_autograd_node: Final = private("torch._C._current_autograd_node")

aten = torch.ops.aten

_KiB: Final = 1024
_MiB: Final = 1024 * 1024

#: The default cuBLAS workspace where ``parseChosenWorkspaceSize``
#: (``aten/src/ATen/cuda/CublasHandlePool.cpp``) gives the big one
#: (:func:`_big_default_workspace`): ``4096 * 8 * 1024`` bytes, 32 MiB.
CUBLAS_BIG_DEFAULT_WORKSPACE: Final = 4096 * 8 * _KiB
#: The default cuBLAS workspace elsewhere: ``:4096:2:16:8``, ``4096 * 1024 * 2 + 16 *
#: 1024 * 8`` bytes, 8 MiB + 128 KiB (``parseChosenWorkspaceSize``, ``0x820000``).
CUBLAS_DEFAULT_WORKSPACE: Final = 4096 * _KiB * 2 + 16 * _KiB * 8
#: ``CUBLASLT_WORKSPACE_SIZE``'s default, in KiB (``CublasHandlePool.cpp:
#: getCUDABlasLtWorkspaceSize``/``parseCUDABlasLtWorkspaceSize``: ``1024``).
CUBLASLT_DEFAULT_WORKSPACE_KIB: Final = 1024
#: ``std::numeric_limits<int>::max()``: ``ConvParams::needs_64bit_indexing_no_split``
#: (``aten/src/ATen/native/Convolution.cpp``) sends larger samples off cuDNN.
INT32_MAX: Final = 2**31 - 1

# -- cuBLAS / cuBLASLt workspaces ------------------------------------------------------


def _cc(gpu: Any) -> tuple[int, int]:
    """The compute capability of the profiled GPU ((9, 0) when unknown)."""
    major, minor = getattr(gpu, "compute_capability", (9, 0))
    return int(major), int(minor)


def _big_default_workspace(cc: tuple[int, int], release: tuple[int, int]) -> bool:
    """Whether ``parseChosenWorkspaceSize`` gives compute capability ``cc`` the
    32 MiB default on torch ``release`` (read from each release's CUDA wheel,
    ``libtorch_cuda.so``; the test is on ``cudaDeviceProp::major``/``minor``):

    * 2.10, 2.11: ``major == 9 && minor == 0`` (sm90 alone; B200 gets the small size);
    * 2.12, 2.13: ``major`` 9, 10 or 12 (not 11);
    * 2.14, 2.15: ``major`` 9 to 12.
    """
    major, minor = cc
    if release <= (2, 11):
        return cc == (9, 0)
    if release <= (2, 13):
        return major in (9, 10, 12)
    return 9 <= major <= 12


def _default_cublas_size(gpu: Any) -> int:
    """``parseChosenWorkspaceSize`` without ``CUBLAS_WORKSPACE_CONFIG``: 32 MiB where
    :func:`_big_default_workspace` says so, else ``:4096:2:16:8``."""
    if _big_default_workspace(_cc(gpu), _release()):
        return CUBLAS_BIG_DEFAULT_WORKSPACE
    return CUBLAS_DEFAULT_WORKSPACE


def cublas_workspace_size(gpu: Any = None) -> int:
    """``at::cuda::getChosenWorkspaceSize()``: ``CUBLAS_WORKSPACE_CONFIG`` read as
    ``:SIZE:COUNT`` pairs (``SIZE`` KiB each, summed); a value without any pair
    falls back to the default, as ATen does (with a warning there)."""
    value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if value is None:
        return _default_cublas_size(gpu)
    pairs = re.findall(r":([0-9]+):([0-9]+)", value)
    if not pairs:
        return _default_cublas_size(gpu)
    return sum(int(size) * _KiB * int(count) for size, count in pairs)


def _check_env(name: str) -> bool | None:
    """``c10::utils::check_env``: "1" -> True, "0" -> False, anything else -> unset."""
    value = os.environ.get(name)
    if value == "1":
        return True
    if value == "0":
        return False
    return None


def workspace_caching() -> bool:
    """``isCUDABlasWorkspaceCachingEnabled()`` (torch 2.15, ``TORCH_CUBLAS_WORKSPACE_CACHE``,
    off unless set to 1): whether cuBLAS keeps one workspace per (handle, stream).
    Off, each gemm/gemv takes ``getChosenWorkspaceSize()`` bytes from the caching
    allocator for the call (``getCurrentCUDABlasHandleWithWorkspace``) and gives it
    back after. Releases before 2.15 always cache."""
    if _release() < (2, 15):
        return True
    return _check_env("TORCH_CUBLAS_WORKSPACE_CACHE") is True


def unified_workspaces() -> bool:
    """Whether cuBLASLt calls run in the cuBLAS workspace of their (handle, stream)
    (``getCUDABlasLtWorkspace``): ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` read by
    ``check_env``, whose default changed:

    * 2.10, 2.11: on only when set to 1 (``check_env(...) == true``);
    * 2.12 to 2.15: on unless set to 0 (``unified_cublas_and_lt_workspaces()``);
    * 2.15 without :func:`workspace_caching`: never (cuBLASLt keeps its own map).
    """
    if not workspace_caching():
        return False
    if _release() <= (2, 11):
        return _check_env("TORCH_CUBLASLT_UNIFIED_WORKSPACE") is True
    return _check_env("TORCH_CUBLASLT_UNIFIED_WORKSPACE") is not False


def _lt_size_capped() -> bool:
    """Whether ``getCUDABlasLtWorkspaceSize`` caps cuBLASLt's size at the cuBLAS one:
    where the workspaces are unified, and on 2.11 also by default (its size
    function reads the variable as on unless 0, its workspace function as off
    unless 1)."""
    if _release() == (2, 11):
        return _check_env("TORCH_CUBLASLT_UNIFIED_WORKSPACE") is not False
    return unified_workspaces()


def _stoi(value: str) -> int | None:
    """``std::stoi``: optional whitespace and sign, then digits (the rest ignored);
    ``None`` where it throws."""
    match = re.match(r"\s*([+-]?[0-9]+)", value)
    if match is None:
        return None
    number = int(match.group(1))
    return number if -(2**31) <= number < 2**31 else None


def cublaslt_workspace_size(gpu: Any = None) -> int:
    """``getCUDABlasLtWorkspaceSize()``: ``CUBLASLT_WORKSPACE_SIZE`` KiB (default
    1024), capped at the cuBLAS size when :func:`_lt_size_capped`."""
    kib = CUBLASLT_DEFAULT_WORKSPACE_KIB
    value = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    if value is not None:
        parsed = _stoi(value)
        if parsed is not None and parsed >= 0:
            kib = parsed
    size = kib * _KiB
    if _lt_size_capped():
        size = min(size, cublas_workspace_size(gpu))
    return size


def _thread() -> str:
    """Which thread a real GPU runs this op on: the autograd engine's device thread
    inside a backward node, else the calling thread."""
    return "autograd" if _current_autograd_node() is not None else "main"


def blas_workspace_steps(call: OpCall, *, lt: bool) -> list[Step]:
    """A ``Keep`` of the workspace this BLAS call allocates, if its (thread, library)
    has none yet in this trace (remembered in ``call.context.memo``)."""
    context = call.context
    gpu = context.gpu if context is not None else None
    if not lt and not workspace_caching():
        # torch 2.15 by default: a workspace for the call alone; dot/vdot take the
        # handle with no workspace (getCurrentCUDABlasHandle, no allocation)
        if call.func in (aten.dot.default, aten.vdot.default):
            return []
        size = cublas_workspace_size(gpu)
        return [Alloc("cublas workspace (this call)", size), Free("cublas workspace (this call)")]
    library = "cublaslt" if lt and not unified_workspaces() else "cublas"
    thread = _thread()
    # 2.10 and 2.11 fetch the cuBLASLt handle as the cuBLAS one, workspace and all
    # (``getCurrentCUDABlasHandle()`` has no ``setup`` argument before 2.12): a
    # cuBLASLt call of their own workspace makes the cuBLAS one first
    libraries = ("cublas", library) if library == "cublaslt" and _lt_handle_sets_up() else (library,)
    seen: set[tuple[str, str]] = (
        context.memo.setdefault("cuda.blas_workspaces", set()) if context is not None else set()
    )
    steps: list[Step] = []
    for made in libraries:
        if (made, thread) in seen:
            continue
        seen.add((made, thread))
        # (the environment is read for the size only when a workspace is made: once or
        # twice a trace, not on each of its hundreds of BLAS calls)
        size = cublaslt_workspace_size(gpu) if made == "cublaslt" else cublas_workspace_size(gpu)
        steps.append(Keep(f"{made} workspace ({thread} thread)", size))
    return steps


def _lt_handle_sets_up() -> bool:
    """Whether ``getCurrentCUDABlasLtHandle()`` gives the thread's cuBLAS handle its
    workspace: on 2.10 and 2.11 it returns ``getCurrentCUDABlasHandle()``, which
    does (their ``libtorch_cuda.so`` exports it without arguments); 2.12 on fetch
    it with ``setup=false``. Seen on an H100 with 2.11: a first ``addmm`` with a
    bias on a thread takes 32 MiB and 1 MiB."""
    return _release() <= (2, 11)


def _prefers_cublaslt() -> bool:
    """``at::globalContext().blasPreferredBackend() == BlasBackend::Cublaslt``
    (``TORCH_BLAS_PREFER_CUBLASLT=1`` or ``torch.backends.cuda.preferred_blas_library``)."""
    return torch.backends.cuda.preferred_blas_library().name == "Cublaslt"


# -- operand copies ---------------------------------------------------------------------



def _matrix_needs_copy(t: torch.Tensor) -> bool:
    """``prepare_matrix_for_cublas``: a 2-d operand is cloned contiguous unless it is
    dense or has a unit stride with a leading dimension at least its extent."""
    s0, s1 = t.stride()
    n0, n1 = t.shape
    if (s0 == 1 and s1 >= max(1, n0)) or (s1 == 1 and s0 >= max(1, n1)):
        return False
    return not non_overlapping_and_dense(t)


def _batch_needs_copy(t: torch.Tensor, transpose_result: bool, m: int, n: int) -> bool:
    """``prepare_batch_matrix_for_cublas``."""
    strides = t.stride()
    fast, lead = (2, 1) if transpose_result else (1, 2)
    if strides[fast] == 1 and strides[lead] >= max(1, m):
        return False
    if strides[lead] == 1 and strides[fast] >= max(1, n):
        return False
    return not (t.is_contiguous() and strides[1] != 0 and strides[2] != 0)


def _gemm_copies(
    mat1: torch.Tensor, mat2: torch.Tensor, result: torch.Tensor
) -> list[tuple[str, int]]:
    """The clones ``cublasCommonArgs(mat1, mat2, result)`` makes, in order."""
    copies: list[tuple[str, int]] = []
    if non_overlapping_and_dense(result):
        transpose_result = result.is_contiguous()
    else:
        s0, s1 = result.stride()
        n0 = result.shape[0]
        transpose_result = not (s0 == 1 and s1 >= max(1, n0))
        if _matrix_needs_copy(result):
            copies.append(("result", nbytes_of(result)))
    first, second = (mat2, mat1) if transpose_result else (mat1, mat2)
    for name, t in (("mat_a", first), ("mat_b", second)):
        if _matrix_needs_copy(t):
            copies.append((name, nbytes_of(t)))
    return copies


def _copy_steps(copies: list[tuple[str, int]], blas: list[Step]) -> list[Step]:
    steps: list[Step] = [OUTPUTS]
    steps += [Alloc(name, nbytes) for name, nbytes in copies]
    steps += blas
    steps += [Free(name) for name, _ in reversed(copies)]
    return steps


def _scalar(value: Any, default: float) -> complex:
    if value is None:
        return complex(default)
    return complex(value)


def _addmm_uses_lt(
    self: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    result: torch.Tensor,
    beta: complex,
) -> bool:
    """``isInputCompliesAddmmCudaLt`` (Blas.cpp) and ``DISABLE_ADDMM_CUDA_LT``: a
    contiguous 1-d bias over the output's columns, ``beta == 1``, a contiguous
    2-d result, float/half/bfloat16/double, and both operands larger than 1 in
    both dimensions (CUDA >= 12.1)."""
    if os.environ.get("DISABLE_ADDMM_CUDA_LT") == "1":
        return False
    return (
        beta == 1
        and self.dim() == 1
        and self.shape[0] == mat2.shape[1]
        and self.is_contiguous()
        and result.dim() == 2
        and result.is_contiguous()
        and mat1.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        and mat1.shape[0] > 1
        and mat1.shape[1] > 1
        and mat2.shape[0] > 1
        and mat2.shape[1] > 1
    )


@CUDA.scratch(
    aten.mm.default,
    aten.mm.out,
    aten.addmm.default,
    aten.addmm.out,
    aten._addmm_activation.default,
)
def _mm(call: OpCall) -> Sequence[Step]:
    """``addmm_out_cuda_impl`` (Blas.cpp; ``mm`` is ``addmm(result, result, ...)``
    with beta 0): nothing when the result is empty or ``k == 0``; otherwise the
    operand clones of ``cublasCommonArgs``, then the gemm: cuBLASLt's
    ``gemm_and_bias`` when :func:`_addmm_uses_lt`, else ``at::cuda::blas::gemm``
    (cuBLAS, or cuBLASLt when it is the preferred backend). The ``out=`` overloads
    are what inductor's compiled programs call (``extern_kernels.mm``), into a
    buffer the program allocated."""
    if call.func in (aten.mm.default, aten.mm.out):
        mat1, mat2 = call.args[0], call.args[1]
        self, beta = None, 0j
    else:
        self, mat1, mat2 = call.args[0], call.args[1], call.args[2]
        beta = _scalar(
            call.kwargs.get("beta", call.args[3] if len(call.args) > 3 else None), 1.0
        )
    result = call.out
    if result.numel() == 0 or mat1.shape[1] == 0:
        return [OUTPUTS]

    def work_out() -> tuple[tuple[tuple[str, int], ...], bool]:
        lt = self is not None and _addmm_uses_lt(self, mat1, mat2, result, beta)
        if not lt:
            lt = _prefers_cublaslt()
        return tuple(_gemm_copies(mat1, mat2, result)), lt

    try:
        key = (
            _layout(mat1), _layout(mat2), _layout(result),
            None if self is None else (_layout(self), os.environ.get("DISABLE_ADDMM_CUDA_LT")),
            beta, _prefers_cublaslt(),
        )
        copies, lt = _GEMM_PLANS.get(key, work_out)
    except TypeError:  # symbolic sizes: no key
        copies, lt = work_out()
    workspace = blas_workspace_steps(call, lt=lt)
    if not copies and not workspace:
        return ()  # only the outputs, as without a rule
    return _copy_steps(list(copies), workspace)


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.dtype, t.layout


#: ``(operand clones, whether cuBLASLt runs it)`` of ``addmm_out_cuda_impl`` by what
#: alone decides them: the operands', result's and bias's sizes, strides, dtypes
#: and layouts, ``beta``, ``DISABLE_ADDMM_CUDA_LT`` and the preferred BLAS library
#: (a model repeats a few products layer after layer).
_GEMM_PLANS: Final[BoundedMemo[tuple[tuple[tuple[str, int], ...], bool]]] = BoundedMemo()


@CUDA.scratch(aten.bmm.default, aten.bmm.out, aten.baddbmm.default, aten.baddbmm.out)
def _bmm(call: OpCall) -> list[Step]:
    """``baddbmm_out_cuda_impl`` (Blas.cpp): nothing for an empty result or
    ``k == 0``; a result whose strides no batched gemm can write is computed in
    a contiguous clone (copied back after); batch operands are cloned when
    ``prepare_batch_matrix_for_cublas`` cannot pass them; then ``bgemm`` (or
    ``gemm`` for one batch)."""
    if call.func in (aten.bmm.default, aten.bmm.out):
        batch1, batch2 = call.args[0], call.args[1]
    else:
        batch1, batch2 = call.args[1], call.args[2]
    result = call.out
    if result.numel() == 0 or batch1.shape[2] == 0:
        return [OUTPUTS]
    copies: list[tuple[str, int]] = []
    s = result.stride()
    size = result.shape
    if s[1] == 1 and (size[2] == 1 or s[2] >= max(1, size[1])):
        transpose_result = False
    elif s[2] == 1 and (size[1] == 1 or s[1] >= max(1, size[2])):
        transpose_result = True
    else:
        transpose_result = False
        copies.append(("result", nbytes_of(result)))
    leading = 1 if transpose_result else 2
    m = size[2 if transpose_result else 1]
    n = size[leading]
    k = (batch2 if transpose_result else batch1).shape[leading]
    first, second = (batch2, batch1) if transpose_result else (batch1, batch2)
    if _batch_needs_copy(first, transpose_result, m, k):
        copies.append(("batch_a", nbytes_of(first)))
    if _batch_needs_copy(second, transpose_result, k, n):
        copies.append(("batch_b", nbytes_of(second)))
    return _copy_steps(copies, blas_workspace_steps(call, lt=_prefers_cublaslt()))


@CUDA.scratch(aten.addmv.default, aten.mv.default)
def _mv(call: OpCall) -> list[Step]:
    """``addmv_out_cuda`` (Blas.cpp; ``mv`` is ``addmv_`` into a new result): a
    stride-0 vector is made contiguous, a matrix with no unit stride is copied
    contiguous, then cuBLAS ``gemv``."""
    if call.func == aten.mv.default:
        mat, vec = call.args[0], call.args[1]
    else:
        mat, vec = call.args[1], call.args[2]
    if mat.numel() == 0 or call.out.numel() == 0:
        return [OUTPUTS]
    copies: list[tuple[str, int]] = []
    if vec.stride(0) == 0 and not vec.is_contiguous():
        copies.append(("vec", nbytes_of(vec)))
    s0, s1 = mat.stride()
    n0, n1 = mat.shape
    if not ((s0 == 1 and s1 >= max(1, n0)) or (s1 == 1 and s0 >= max(1, n1))):
        copies.append(("mat", nbytes_of(mat)))
    return _copy_steps(copies, blas_workspace_steps(call, lt=False))


@CUDA.scratch(aten.dot.default, aten.vdot.default)
def _dot(call: OpCall) -> list[Step]:
    """``dot_cuda``/``vdot_cuda`` (Blas.cpp): cuBLAS ``dot`` into a new 0-dim result,
    through the thread's handle (and so its workspace)."""
    return [OUTPUTS, *blas_workspace_steps(call, lt=False)]


@CUDA.scratch(aten._int_mm.default)
def _int_mm(call: OpCall) -> list[Step]:
    """``_int_mm_out_cuda`` (Blas.cpp): ``at::cuda::blas::int8_gemm``, a cuBLASLt matmul."""
    return [OUTPUTS, *blas_workspace_steps(call, lt=True)]


@CUDA.scratch(aten._scaled_mm.default)
def _scaled_mm(call: OpCall) -> list[Step]:
    """``_scaled_mm_out_cuda`` (Blas.cpp / ScaledBlas.cpp): with tensor-wise scales
    a cuBLASLt matmul (``scaled_gemm``); row- and block-wise scalings may run
    CUTLASS/FBGEMM kernels instead, whose scratch is not modelled."""
    scale_a, scale_b = call.args[2], call.args[3]
    steps: list[Step] = [OUTPUTS, *blas_workspace_steps(call, lt=True)]
    if scale_a.numel() != 1 or scale_b.numel() != 1:
        steps.append(
            Inexact(
                "_scaled_mm with row- or block-wise scales: kernel choice not modelled"
            )
        )
    return steps


# -- cuDNN convolution workspace policy --------------------------------------------------

#: The environment variable read by :func:`conv_workspace_policy`.
CONV_WORKSPACE_ENV: Final = "TORCHMEM_CUDNN_WORKSPACE"


@dataclass(frozen=True)
class ConvWorkspacePolicy:
    """How many bytes each cuDNN convolution call is charged for its workspace.

    * ``none`` (the default): 0. cuDNN 9's heuristics rank implicit-GEMM engines
      first for most shapes, and those need no or a few KiB of workspace; the
      workspace is freed when the call returns, so it can move a peak only
      when a convolution is running at it. A lower bound.
    * ``max``: the cap ``CUDNN_CONV_WSCAP_DBG`` (MiB) sets on the engines cuDNN
      may choose, charged to every call: the upper bound when that variable
      is set (which makes cuDNN itself honour it).
    * a byte size (``"64 MiB"``, ``"4096"``): that much per call, e.g. a
      workspace read off a GPU with ``torch.cuda.max_memory_allocated()``.

    With ``torch.backends.cudnn.benchmark = True`` the first call of each
    configuration also times every candidate plan with the largest candidate
    workspace that fits in free memory (``generate_and_filter_plans``); that
    is not modelled by any policy.
    """

    kind: Literal["none", "max", "fixed"]
    nbytes: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind != "fixed" else f"{self.nbytes} B"


def _parse_policy(value: Any) -> ConvWorkspacePolicy:
    if isinstance(value, ConvWorkspacePolicy):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return ConvWorkspacePolicy("fixed", parse_bytes(value))
    if not isinstance(value, str):
        raise TypeError(
            f"a cuDNN workspace policy is 'none', 'max' or a byte size, got {value!r}"
        )
    text = value.strip().lower()
    if text == "none":
        return ConvWorkspacePolicy("none")
    if text == "max":
        cap = os.environ.get("CUDNN_CONV_WSCAP_DBG")
        if cap is None or not cap.strip().isdecimal():
            raise ValueError(
                "the cuDNN workspace policy 'max' charges the cap CUDNN_CONV_WSCAP_DBG (MiB) "
                "sets; set it, or give a byte size such as '64 MiB'"
            )
        return ConvWorkspacePolicy("max", int(cap) * _MiB)
    return ConvWorkspacePolicy("fixed", parse_bytes(value))


def conv_workspace_policy(context: TraceContext | None = None) -> ConvWorkspacePolicy:
    """The active cuDNN convolution workspace policy (see :class:`ConvWorkspacePolicy`).

    Read, in order, from the trace's ``context.cudnn_workspace`` (a setting the
    API may pass), the ``TORCHMEM_CUDNN_WORKSPACE`` environment variable, and
    the default ``none``.
    """
    value = getattr(context, "cudnn_workspace", None) if context is not None else None
    if value is None:
        value = os.environ.get(CONV_WORKSPACE_ENV)
    if value is None:
        return ConvWorkspacePolicy("none")
    return _parse_policy(value)


# -- convolutions ------------------------------------------------------------------------


def _expand(value: Any, dim: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * dim
    value = tuple(int(v) for v in value)
    return value * dim if len(value) == 1 else value


@dataclass(frozen=True)
class _Conv:
    """A convolution as ``_convolution``/``convolution_backward`` see it."""

    input: torch.Tensor
    weight: torch.Tensor
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int

    @property
    def conv1d(self) -> bool:
        return self.weight.dim() == 3

    def input_shape(self) -> tuple[int, ...]:
        x = tuple(self.input.shape)
        return (x[0], x[1], 1, x[2]) if self.conv1d else x

    def weight_shape(self) -> tuple[int, ...]:
        w = tuple(self.weight.shape)
        return (w[0], w[1], 1, w[2]) if self.conv1d else w

    def dilated(self) -> bool:
        return any(d != 1 for d in self.dilation)

    def output_padding_big(self) -> bool:
        return any(op >= s for op, s in zip(self.output_padding, self.stride))


def _conv(input: torch.Tensor, weight: torch.Tensor, args: Any) -> _Conv:
    stride, padding, dilation, transposed, output_padding, groups = args
    dim = weight.dim() - 2
    return _Conv(
        input,
        weight,
        _expand(stride, dim),
        _expand(padding, dim),
        _expand(dilation, dim),
        bool(transposed),
        _expand(output_padding, dim),
        int(groups),
    )


def _suggest(t: torch.Tensor) -> torch.memory_format:
    """``Tensor::suggest_memory_format()``."""
    return suggest_memory_format(t)


def _cudnn_format(x: torch.Tensor, w: torch.Tensor) -> torch.memory_format:
    """``cudnn_conv_suggest_memory_format``: channels-last when the input or the
    weight suggests it (never for float64)."""
    if x.dtype == torch.float64 or w.dtype == torch.float64:
        return torch.contiguous_format
    if w.dim() == 4 and torch.channels_last in (_suggest(x), _suggest(w)):
        return torch.channels_last
    if w.dim() == 5 and torch.channels_last_3d in (_suggest(x), _suggest(w)):
        return torch.channels_last_3d
    return torch.contiguous_format


def _copy_bytes(
    t: torch.Tensor, fmt: torch.memory_format = torch.contiguous_format
) -> int:
    """Bytes ``t.contiguous(fmt)`` allocates (0 when ``t`` already is)."""
    if t.dim() not in (4, 5) and fmt != torch.contiguous_format:
        fmt = torch.contiguous_format
    return 0 if t.is_contiguous(memory_format=fmt) else nbytes_of(t)


def _needs_64bit_indexing(c: _Conv, out_spatial_numel: int) -> bool:
    """``ConvParams::needs_64bit_indexing_no_split``."""
    x = c.input_shape()
    if c.input.numel() == 0:
        return False
    per_sample = c.input.numel() // x[0]
    return per_sample > INT32_MAX or out_spatial_numel > INT32_MAX


def _out_per_sample(c: _Conv, output: torch.Tensor | None) -> int:
    if output is None:
        return 0
    return output.numel() // max(1, output.shape[0])


def _use_cudnn(c: _Conv, gpu: Any, out_per_sample: int) -> bool:
    """``ConvParams::use_cudnn`` for a CUDA build with cuDNN 9."""
    if _needs_64bit_indexing(c, out_per_sample):
        return False
    if not torch.backends.cudnn.enabled:
        return False
    if torch.bfloat16 in (c.input.dtype, c.weight.dtype) and _cc(gpu)[0] < 8:
        return False  # supportsBFloat16ConvolutionWithCuDNNv8
    if (
        _cudnn_format(c.input, c.weight) == torch.contiguous_format
        and torch.backends.cudnn.deterministic
        and c.dilated()
    ):
        return False  # cuDNN has no deterministic dilated convolution (contiguous)
    return not c.output_padding_big()


def _is_depthwise(c: _Conv) -> bool:
    x = c.input
    return (
        not c.transposed
        and x.dim() in (4, 5)
        and x.shape[1] == c.groups
        and c.groups > 1
        and c.weight.shape[0] % x.shape[1] == 0
    )


def _depthwise_workload(c: _Conv) -> bool:
    """``check_cudnn_depthwise_workload_with_filter`` (``aten/src/ATen/native/Convolution.cpp``,
    cuDNN >= 8.2), inlined in ``ConvParams::use_cudnn_depthwise``: its thresholds (widths
    7 and 28, batch 16, channels 128, 256 and 512, filters 1, 3 and 5) are the C++'s
    literals, read again from each release's ``libtorch_cpu.so`` by
    ``tests/test_cuda_workspaces.py``."""
    x, w = c.input.shape, c.weight.shape
    stride = c.stride[1]
    if x[2] == 1 and stride == 1:
        return True
    if w[2] != w[3]:
        return False
    f = w[3]
    if f not in (1, 3, 5) or x[3] < 7:
        return False
    width = x[3]
    if stride == 1:
        return True
    if stride != 2:
        return False
    ch, bs = x[1], x[0]
    if bs == 1:
        return (f == 1 and width <= 28) or f in (3, 5)
    if f == 1 and bs <= 16 and ch >= 128 and width <= 7:
        return True
    return f in (3, 5) and (ch >= 512 or (ch >= 256 and width >= 28))


def _use_cudnn_depthwise(c: _Conv, gpu: Any, out_per_sample: int) -> bool:
    """``ConvParams::use_cudnn_depthwise``: always for channels-last; for contiguous
    float16 only under the cuDNN >= 8.2 workload heuristic."""
    use = _use_cudnn(c, gpu, out_per_sample)
    if _cudnn_format(c.input, c.weight) != torch.contiguous_format and use:
        return True
    return (
        use
        and c.input.dtype == torch.float16
        and c.weight.dtype == torch.float16
        and c.input.dim() == 4
        and not c.dilated()
        and (c.stride[0] == c.stride[1] or c.input.shape[2] == 1)
        and c.input.shape[1] >= 32  # use_cudnn_depthwise: input.size(1) >= 32 (in libtorch_cpu.so)
        and _depthwise_workload(c)
    )


def _backend(c: _Conv, gpu: Any, out_per_sample: int) -> str:
    """``_select_conv_backend`` for CUDA tensors (cuDNN compiled in; no MIOpen)."""
    x = c.input_shape()
    if x[0] == 0 or x[1] == 0:
        return "empty"
    if _is_depthwise(c):
        if _use_cudnn_depthwise(c, gpu, out_per_sample):
            return "cudnn"
        return "depthwise2d" if c.input.dim() == 4 else "depthwise3d"
    if _use_cudnn(c, gpu, out_per_sample):
        return "cudnn_transpose" if c.transposed else "cudnn"
    nd = len(x)
    if c.transposed:
        return "slow_transpose2d" if nd == 4 else "slow_transpose3d"
    if nd == 4:
        return "slow_dilated2d" if c.dilated() else "slow2d"
    return "slow_dilated3d"


def _conv_workspace(call: OpCall, tag: str) -> list[Step]:
    nbytes = conv_workspace_policy(call.context).nbytes
    return [Alloc(tag, nbytes), Free(tag)] if nbytes else []


def _columns_bytes(c: _Conv, out_spatial: tuple[int, ...]) -> int:
    """``slow_conv2d``'s im2col ``columns``: ``[C_in * kH * kW, oH * oW]`` unless the
    kernel is 1x1 with unit stride and no padding."""
    w = c.weight_shape()
    k = w[2:]
    if (
        all(v == 1 for v in k)
        and all(s == 1 for s in c.stride)
        and all(p == 0 for p in c.padding)
    ):
        return 0
    cin = c.input_shape()[1]
    n = cin
    for v in k:
        n *= v
    for v in out_spatial:
        n *= v
    return n * c.input.element_size()


def _slow_unmodelled(backend: str) -> Inexact:
    return Inexact(
        f"CUDA convolution backend {backend}: its im2col buffers are not modelled"
    )


@CUDA.scratch(aten.convolution.default)
def _convolution(call: OpCall) -> list[Step]:
    """``_convolution`` (Convolution.cpp) on CUDA.

    A 1-d convolution first takes ``input.contiguous()``. cuDNN:
    ``input.contiguous(cudnn format)``, the result, ``weight.contiguous(format)``
    (``cudnn_convolution_forward_out``, ConvShared.cpp), the plan's workspace
    (:func:`conv_workspace_policy`), then the bias added in place. Native
    depthwise: ``input.contiguous()`` and ``weight.expect_contiguous()``
    (DepthwiseConv2d.cu). ``slow_conv2d``: the im2col columns and a cuBLAS gemm
    per sample.
    """
    input, weight = call.args[0], call.args[1]
    c = _conv(input, weight, call.args[3:9])
    out = call.out
    backend = _backend(
        c, call.gpu, _out_per_sample(c, out)
    )
    steps: list[Step] = []
    if c.conv1d and not input.is_contiguous():
        steps.append(Alloc("input_1d", nbytes_of(input)))
        input = torch.empty(input.shape, dtype=input.dtype, device="meta")
        c = _conv(input, weight, call.args[3:9])
    if backend in ("cudnn", "cudnn_transpose"):
        fmt = (
            _cudnn_format(c.input, c.weight)
            if not c.conv1d
            else torch.contiguous_format
        )
        steps.append(Alloc("input", _copy_bytes(c.input, fmt)))
        steps.append(OUTPUTS)
        steps.append(Alloc("weight", _copy_bytes(c.weight, fmt)))
        steps += _conv_workspace(call, "cudnn workspace")
        return steps
    if backend in ("depthwise2d", "depthwise3d"):
        steps.append(Alloc("input", _copy_bytes(c.input)))
        steps.append(OUTPUTS)
        steps.append(Alloc("weight", _copy_bytes(c.weight)))
        return steps
    if backend == "slow2d":
        steps.append(Alloc("input", _copy_bytes(c.input)))
        steps.append(OUTPUTS)
        steps.append(Alloc("weight", _copy_bytes(c.weight)))
        steps.append(Alloc("columns", _columns_bytes(c, tuple(out.shape[2:]))))
        steps += blas_workspace_steps(call, lt=_prefers_cublaslt())
        return steps
    if backend == "empty":
        return [*steps, OUTPUTS]
    return [*steps, OUTPUTS, _slow_unmodelled(backend)]


def _bias_grad_steps(
    call: OpCall, grad_output: torch.Tensor, grad_bias: torch.Tensor | None
) -> list[Step]:
    """``grad_output.sum({0, 2, ...})`` (Convolution.cpp) into the bias gradient."""
    if grad_bias is None:
        return []
    dims = [0, *range(2, grad_output.dim())]
    steps = reduction_steps(
        grad_output, [grad_bias], dims, False, context=call.context, tag="grad_bias"
    )
    return [*steps, Free("grad_bias:semaphores"), Free("grad_bias:buffer")]


def _cudnn_input_grad(call: OpCall, grad_output: torch.Tensor, weight: torch.Tensor) -> list[Any]:
    """cuDNN's backward-data call: the weight and gradient in the layout it asks
    for (``contiguous(format)`` copies where they differ) and its workspace."""
    layout = _cudnn_format(grad_output, weight)
    return [
        Alloc("weight_bi", _copy_bytes(weight, layout)),
        Alloc("grad_output_bi", _copy_bytes(grad_output, layout)),
        *_conv_workspace(call, "cudnn workspace (input grad)"),
        Free("grad_output_bi"),
        Free("weight_bi"),
    ]


@CUDA.scratch(aten.convolution_backward.default)
def _convolution_backward(call: OpCall) -> list[Step]:
    """``convolution_backward`` (Convolution.cpp) on CUDA.

    cuDNN (``cudnn_convolution_backward``, ConvShared.cpp): ``input.contiguous(
    format)`` when the weight gradient is wanted, ``grad_output.to(input's
    suggested format)``; the input gradient takes ``weight`` and
    ``grad_output`` contiguous in the cuDNN format and one workspace; the
    weight gradient ``grad_output`` and ``input`` contiguous in its layout and
    another. Transposed convolutions swap the roles
    (``cudnn_convolution_transpose_backward``). Native depthwise kernels copy
    non-contiguous operands. The bias gradient is a reduction of
    ``grad_output``. All outputs are placed first (the tracker allocates them
    together), which overstates the peak inside the call by the weight and
    bias gradients while the input gradient is computed.
    """
    grad_output, input, weight = call.args[0], call.args[1], call.args[2]
    c = _conv(input, weight, call.args[4:10])
    mask = list(call.args[10])
    outs = call.out
    grad_bias = outs[2] if mask[2] else None
    gpu = call.gpu
    backend = _backend(c, gpu, _out_per_sample(c, grad_output))
    steps: list[Step] = [OUTPUTS]
    if backend == "empty":
        return steps
    if backend == "cudnn":
        fmt = _cudnn_format(input, weight)
        if mask[1]:
            steps.append(Alloc("input", _copy_bytes(input, fmt)))
        if _suggest(grad_output) != _suggest(input):
            steps.append(Alloc("grad_output_to", nbytes_of(grad_output)))
            go = torch.empty_like(grad_output, memory_format=_suggest(input))
        else:
            go = grad_output
        if mask[0]:
            steps += _cudnn_input_grad(call, go, weight)
        if mask[1]:
            layout = _cudnn_format(input, go)
            steps += [
                Alloc("grad_output_bw", _copy_bytes(go, layout)),
                *_conv_workspace(call, "cudnn workspace (weight grad)"),
                Free("grad_output_bw"),
            ]
        steps += [Free("grad_output_to"), Free("input")]
    elif backend == "cudnn_transpose":
        fmt = _cudnn_format(input, weight)
        if mask[1]:
            steps.append(Alloc("input", _copy_bytes(input, fmt)))
        steps.append(Alloc("grad_output", _copy_bytes(grad_output, _suggest(input))))
        go = (
            grad_output
            if grad_output.is_contiguous(memory_format=_suggest(input))
            else (torch.empty_like(grad_output, memory_format=_suggest(input)))
        )
        if mask[0]:
            steps += _cudnn_input_grad(call, go, weight)
        if mask[1]:
            layout = _cudnn_format(go, input)
            steps += [
                Alloc("input_bw", _copy_bytes(input, layout)),
                Alloc("grad_output_bw", _copy_bytes(go, layout)),
                *_conv_workspace(call, "cudnn workspace (weight grad)"),
                Free("grad_output_bw"),
                Free("input_bw"),
            ]
        steps += [Free("grad_output"), Free("input")]
    elif backend in ("depthwise2d", "depthwise3d"):
        steps.append(Alloc("grad_output", _copy_bytes(grad_output)))
        if mask[0]:
            steps.append(Alloc("weight", _copy_bytes(weight)))
        if mask[1]:
            steps.append(Alloc("input", _copy_bytes(input)))
        steps += [Free("input"), Free("weight"), Free("grad_output")]
    elif backend == "slow2d":
        columns = _columns_bytes(c, tuple(grad_output.shape[2:]))
        steps.append(Alloc("grad_output", _copy_bytes(grad_output)))
        if mask[0]:
            steps += [Alloc("grad_columns", columns), Free("grad_columns")]
        if mask[1]:
            steps += [
                Alloc("input", _copy_bytes(input)),
                Alloc("columns", columns),
                Free("columns"),
            ]
        steps += blas_workspace_steps(call, lt=_prefers_cublaslt())
        steps += [Free("input"), Free("grad_output")]
    else:
        steps.append(_slow_unmodelled(backend))
        return steps
    steps += _bias_grad_steps(call, grad_output, grad_bias)
    return steps
