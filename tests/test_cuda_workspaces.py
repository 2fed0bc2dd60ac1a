"""cuBLAS/cuBLASLt workspaces, cuBLAS operand copies and cuDNN convolution rules of the
fake cuda device. Every figure is computed by hand from the sources the rules cite
(CublasHandlePool.cpp, Blas.cpp, cuBlasCommonArgs.h, ConvShared.cpp, Convolution.cpp);
every storage is charged its caching-allocator block (multiples of 512 bytes)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cuda import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.engine.torch_compat.torch_release import installed_release
from pytest_torchmem.engine.tracing.devices.cuda import workspaces
from pytest_torchmem.engine.tracing.devices.cuda.workspaces import (
    ConvWorkspacePolicy,
    conv_workspace_policy,
    cublas_workspace_size,
    cublaslt_workspace_size,
)
from torch_sources import cuda_library, disassembly, has_function, immediates, instructions, library
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Keep,
    OpCall,
    TraceContext,
)

aten = torch.ops.aten
MiB = 1 << 20
H100_WS = 32 * MiB  # 4096 * 8 KiB
A100_WS = 8 * MiB + 128 * 1024  # :4096:2:16:8

_ENV = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
    "DISABLE_ADDMM_CUDA_LT",
    "TORCHMEM_CUDNN_WORKSPACE",
    "CUDNN_CONV_WSCAP_DBG",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cached, unified workspaces, which every release gives when asked (2.15 caches
    only with TORCH_CUBLAS_WORKSPACE_CACHE=1, 2.10-2.11 unify only with
    TORCH_CUBLASLT_UNIFIED_WORKSPACE=1): the figures below follow them on every
    release; the releases' own defaults are tested apart (``test_release_defaults*``)."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "1")
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def run_rule(
    func: Any, args: tuple[Any, ...], out: Any, gpu: str = "H100", **kwargs: Any
) -> list[Any]:
    rule = CUDA.scratch_rule(func)
    assert rule is not None, func
    context = TraceContext("cuda", gpu=gpu_profile(gpu))
    return list(rule(OpCall(func, args, kwargs, out, context)))


# -- sizes ------------------------------------------------------------------------------


def test_default_cublas_workspace_by_architecture() -> None:
    """parseChosenWorkspaceSize: 32 MiB on sm90 (and on compute capability 10.x
    from 2.12), else :4096:2:16:8."""
    assert cublas_workspace_size(gpu_profile("H100")) == 33_554_432
    b200 = 33_554_432 if installed_release()[:2] >= (2, 12) else 8_519_680
    assert cublas_workspace_size(gpu_profile("B200")) == b200
    for name in ("V100", "T4", "A100", "A10G", "L4"):
        assert cublas_workspace_size(gpu_profile(name)) == 8_519_680


@pytest.mark.parametrize(
    ("release", "big"),
    [
        ((2, 10), {(9, 0)}),
        ((2, 11), {(9, 0)}),
        ((2, 12), {(9, 0), (9, 1), (10, 0), (10, 3), (12, 0), (12, 1)}),
        ((2, 13), {(9, 0), (9, 1), (10, 0), (10, 3), (12, 0), (12, 1)}),
        ((2, 14), {(9, 0), (9, 1), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)}),
        ((2, 15), {(9, 0), (9, 1), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)}),
    ],
)
def test_release_defaults_of_the_cublas_workspace_size(
    release: tuple[int, int], big: set[tuple[int, int]]
) -> None:
    """The architectures each release's parseChosenWorkspaceSize gives 32 MiB
    (libtorch_cuda.so: 2.10-2.11 compare (major, minor) with (9, 0), 2.12-2.13 take
    major 9, 10 or 12, 2.14-2.15 major 9 to 12)."""
    for cc in [(7, 0), (8, 0), (8, 9), (9, 0), (9, 1), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1), (13, 0)]:
        assert workspaces._big_default_workspace(cc, release) == (cc in big), (release, cc)


@pytest.mark.parametrize(
    ("release", "caching", "unified", "lt_size"),
    [
        ((2, 10), True, False, 64 * MiB),
        ((2, 11), True, False, H100_WS),
        ((2, 12), True, True, H100_WS),
        ((2, 13), True, True, H100_WS),
        ((2, 14), True, True, H100_WS),
        ((2, 15), False, False, 64 * MiB),
    ],
)
def test_release_defaults_of_caching_and_unified_workspaces(
    release: tuple[int, int], caching: bool, unified: bool, lt_size: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With neither variable set: 2.15 keeps no cuBLAS workspace
    (isCUDABlasWorkspaceCachingEnabled: check_env("TORCH_CUBLAS_WORKSPACE_CACHE") == true);
    cuBLASLt shares it from 2.12 (unified_cublas_and_lt_workspaces, on unless 0),
    not on 2.10-2.11 (getCUDABlasLtWorkspace: check_env(...) == true); a 64 MiB
    CUBLASLT_WORKSPACE_SIZE is capped at the cuBLAS size where unified, and on
    2.11 also by default (its size function reads the variable as on unless 0)."""
    monkeypatch.delenv("TORCH_CUBLAS_WORKSPACE_CACHE")
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "65536")
    monkeypatch.setattr(workspaces, "_release", lambda: release)
    assert workspaces.workspace_caching() is caching
    assert workspaces.unified_workspaces() is unified
    assert cublaslt_workspace_size(gpu_profile("H100")) == lt_size
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "1")
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    assert workspaces.workspace_caching() and workspaces.unified_workspaces()


def test_release_2_15_takes_a_cublas_workspace_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.15 by default: gemm takes getChosenWorkspaceSize() bytes for the call
    (getCurrentCUDABlasHandleWithWorkspace, freed by ~CUDABlasHandleWithWorkspace),
    between the operand copies; dot takes none."""
    monkeypatch.delenv("TORCH_CUBLAS_WORKSPACE_CACHE")
    monkeypatch.setattr(workspaces, "_release", lambda: (2, 15))
    grad = meta(1, 1).expand(32, 64)
    steps = run_rule(aten.mm.default, (grad, meta(128, 64).t()), meta(32, 128))
    tag = "cublas workspace (this call)"
    assert steps == [OUTPUTS, Alloc("mat_b", 8192), Alloc(tag, H100_WS), Free(tag), Free("mat_b")]
    # a second call takes it again
    assert run_rule(aten.mm.default, (meta(8, 64), meta(64, 8)), meta(8, 8)) == [
        OUTPUTS, Alloc(tag, H100_WS), Free(tag)
    ]
    assert run_rule(aten.dot.default, (meta(8), meta(8)), meta()) == [OUTPUTS]
    model = nn.Linear(64, 64, bias=False)
    report = tm.estimate(model, torch.randn(8, 64), device="cuda", train=False)
    assert report.breakdown[tm.Category.WORKSPACE] == H100_WS  # at the peak, in the call
    assert report.forward_peak == 64 * 64 * 4 + 2048 + 2048 + H100_WS


def test_cublas_workspace_config(monkeypatch: pytest.MonkeyPatch) -> None:
    h100 = gpu_profile("H100")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cublas_workspace_size(h100) == 4096 * 1024 * 8
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the deterministic setting
    assert cublas_workspace_size(h100) == 16 * 1024 * 8
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_size(h100) == 8_519_680
    monkeypatch.setenv(
        "CUBLAS_WORKSPACE_CONFIG", "4096"
    )  # no :SIZE:COUNT pair: the default
    assert cublas_workspace_size(h100) == H100_WS


def test_cublaslt_workspace_size(monkeypatch: pytest.MonkeyPatch) -> None:
    h100 = gpu_profile("H100")
    assert (
        cublaslt_workspace_size(h100) == 1024 * 1024
    )  # 1024 KiB, under the cuBLAS size
    monkeypatch.setenv(
        "CUBLASLT_WORKSPACE_SIZE", "65536"
    )  # 64 MiB: capped when unified
    assert cublaslt_workspace_size(h100) == H100_WS
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    assert cublaslt_workspace_size(h100) == 64 * MiB
    monkeypatch.setenv(
        "CUBLASLT_WORKSPACE_SIZE", "abc"
    )  # std::stoi throws: the default
    assert cublaslt_workspace_size(h100) == 1024 * 1024


# -- lifetime: one per thread, kept --------------------------------------------------------


def test_forward_matmul_keeps_one_workspace() -> None:
    """Linear(64, 64) on (8, 64), forward only: addmm with a 1-d bias goes through
    cuBLASLt's gemm_and_bias, whose workspace is the cuBLAS one (unified): 32 MiB on
    H100, kept to the end of the step."""
    model = nn.Linear(64, 64)
    report = tm.estimate(model, torch.randn(8, 64), device="cuda", train=False)
    assert report.breakdown[tm.Category.WORKSPACE] == H100_WS
    params = 64 * 64 * 4 + 512  # weight 16 KiB, bias 256 B -> 512
    assert (
        report.forward_peak == params + 2048 + 2048 + H100_WS
    )  # input, output, workspace


def test_backward_runs_on_the_autograd_thread_with_its_own_workspace() -> None:
    """The backward's matmuls run on the autograd engine's device thread, whose cuBLAS
    handle gets a second workspace: both are live at the backward peak, beside the
    weight gradient's mm(grad.t(), x) clone of the stride-0 gradient that sum()'s
    backward expands (8 * 64 * 4 = 2048 bytes)."""
    model = nn.Linear(64, 64)
    h100 = tm.estimate(model, torch.randn(8, 64), device="cuda")
    assert h100.breakdown[tm.Category.WORKSPACE] == 2 * H100_WS + 2048
    a100 = tm.estimate(model, torch.randn(8, 64), device="cuda", gpu="A100")
    assert a100.breakdown[tm.Category.WORKSPACE] == 2 * A100_WS + 2048
    assert h100.peak - a100.peak == 2 * (H100_WS - A100_WS)


def test_workspace_is_taken_once_per_thread() -> None:
    x, w = meta(8, 64), meta(64, 64)
    rule = CUDA.scratch_rule(aten.mm.default)
    assert rule is not None
    context = TraceContext("cuda", gpu=gpu_profile("H100"))
    first = list(rule(OpCall(aten.mm.default, (x, w), {}, meta(8, 64), context)))
    second = list(rule(OpCall(aten.mm.default, (x, w), {}, meta(8, 64), context)))
    assert [s for s in first if isinstance(s, Keep)] == [
        Keep("cublas workspace (main thread)", H100_WS)
    ]
    assert not any(isinstance(s, Keep) for s in second)


def test_separate_cublaslt_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_CUBLASLT_UNIFIED_WORKSPACE=0: addmm with a bias epilogue takes its own
    1 MiB cuBLASLt workspace; a plain mm then takes the 32 MiB cuBLAS one."""
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, bias=False))
    report = tm.estimate(model, torch.randn(8, 64), device="cuda", train=False)
    assert report.breakdown[tm.Category.WORKSPACE] == 1 * MiB + H100_WS
    monkeypatch.setenv(
        "DISABLE_ADDMM_CUDA_LT", "1"
    )  # addmm through cuBLAS: one workspace
    report = tm.estimate(model, torch.randn(8, 64), device="cuda", train=False)
    assert report.breakdown[tm.Category.WORKSPACE] == H100_WS


@pytest.mark.parametrize(
    "release, cublas_too",
    [((2, 10), True), ((2, 11), True), ((2, 12), False), ((2, 13), False), ((2, 14), False)],
)
def test_a_separate_cublaslt_workspace_makes_the_cublas_one_on_2_10_and_2_11(
    release: tuple[int, int], cublas_too: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2.10 and 2.11 fetch the cuBLASLt handle as the cuBLAS one
    (getCurrentCUDABlasHandle() has no setup argument before 2.12: their
    libtorch_cuda.so exports it without one), which gives the thread's handle its
    workspace. Seen on an H100 with 2.11.0+cu130 (no variable set): nn.Linear(8, 4)
    on a (2, 8) batch measured 33.00 MiB in its forward (32 MiB + 1 MiB + the
    tensors), 65.00 MiB in its backward (the autograd thread's 32 MiB more); the
    estimate had 1 MiB and 33 MiB."""
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    monkeypatch.setattr(workspaces, "_release", lambda: release)
    bias, x, w = meta(64), meta(8, 64), meta(64, 64).t()
    context = TraceContext("cuda", gpu=gpu_profile("H100"))
    first = list(CUDA.scratch_rule(aten.addmm.default)(OpCall(aten.addmm.default, (bias, x, w), {}, meta(8, 64), context)))
    kept = [s for s in first if isinstance(s, Keep)]
    lt = Keep("cublaslt workspace (main thread)", 1 * MiB)
    assert kept == ([Keep("cublas workspace (main thread)", H100_WS), lt] if cublas_too else [lt])
    # the thread's plain gemm then finds the cuBLAS workspace made or makes it
    mm = list(CUDA.scratch_rule(aten.mm.default)(OpCall(aten.mm.default, (x, w), {}, meta(8, 64), context)))
    assert [s for s in mm if isinstance(s, Keep)] == ([] if cublas_too else [Keep("cublas workspace (main thread)", H100_WS)])


def test_no_blas_no_workspace() -> None:
    """Nothing multiplies matrices: no workspace; an empty product calls no BLAS."""
    report = tm.estimate(nn.ReLU(), torch.randn(8, 64), device="cuda", train=False)
    assert report.breakdown[tm.Category.WORKSPACE] == 0
    assert run_rule(aten.mm.default, (meta(8, 0), meta(0, 4)), meta(8, 4)) == [OUTPUTS]


# -- operand copies ----------------------------------------------------------------------------


def test_expanded_gradient_is_cloned_for_cublas() -> None:
    """mm(grad, w) with grad = ones(()).expand(32, 64) (sum()'s backward): strides (0, 0),
    neither dense nor a matrix with a leading dimension: prepare_matrix_for_cublas
    clones it, 32 * 64 * 4 = 8192 bytes, for the call. The transposed weight is dense."""
    grad = meta(1, 1).expand(32, 64)
    weight = meta(128, 64).t()
    steps = run_rule(aten.mm.default, (grad, weight), meta(32, 128))
    assert steps == [
        OUTPUTS,
        Alloc("mat_b", 8192),
        Keep("cublas workspace (main thread)", H100_WS),
        Free("mat_b"),
    ]


def test_strided_slice_is_passed_with_its_leading_dimension() -> None:
    """A column slice x[:, :32] of a (16, 64) matrix has strides (64, 1): ld 64 >= 32, no copy."""
    x = meta(16, 64)[:, :32]
    steps = run_rule(aten.mm.default, (x, meta(32, 8)), meta(16, 8))
    assert not any(isinstance(s, Alloc) for s in steps)


def test_bmm_copies() -> None:
    """bmm into a contiguous (4, 8, 16) result: transpose_result, so batch2 is
    prepared first. batch1 = (1, 8, 32).expand(4, 8, 32) has strides (0, 32, 1),
    which a batched gemm takes (ld 32 >= 8); batch2 = a (4, 16, 32) tensor
    transposed in a way no ld describes, (4, 32, 16) with strides (512, 1, 32)
    passes too; a stride-0 middle dimension does not and is cloned (4 * 32 * 16 * 4)."""
    b1 = meta(1, 8, 32).expand(4, 8, 32)
    b2 = meta(4, 16, 32).transpose(1, 2)
    assert not any(
        isinstance(s, Alloc)
        for s in run_rule(aten.bmm.default, (b1, b2), meta(4, 8, 16))
    )
    b2 = meta(4, 1, 16).expand(4, 32, 16)
    steps = run_rule(aten.bmm.default, (b1, b2), meta(4, 8, 16))
    assert [s for s in steps if isinstance(s, Alloc)] == [
        Alloc("batch_a", 4 * 32 * 16 * 4)
    ]


def _run_out(func: Any, args: tuple[Any, ...], out: torch.Tensor) -> list[Any]:
    """The rule of an ``out=`` overload, called as inductor's programs call it."""
    rule = CUDA.scratch_rule(func)
    assert rule is not None, func
    context = TraceContext("cuda", gpu=gpu_profile("H100"))
    return list(rule(OpCall(func, args, {"out": out}, out, context)))


def test_the_out_overloads_take_the_same_steps() -> None:
    """``mm(a, b, out=buf)`` and ``bmm(..., out=buf)`` (what inductor's compiled programs
    call, into a buffer of their own) are ``addmm_out_cuda_impl`` / ``baddbmm_out_cuda_impl``
    with that buffer as the result: the same clones and workspace as the functional forms."""
    grad = meta(1, 1).expand(32, 64)
    weight = meta(128, 64).t()
    out = meta(32, 128)
    assert _run_out(aten.mm.out, (grad, weight), out) == run_rule(aten.mm.default, (grad, weight), out)
    bias = meta(128)
    assert _run_out(aten.addmm.out, (bias, grad, weight), out) == run_rule(
        aten.addmm.default, (bias, grad, weight), out
    )
    b1, b2, result = meta(1, 8, 32).expand(4, 8, 32), meta(4, 1, 16).expand(4, 32, 16), meta(4, 8, 16)
    steps = _run_out(aten.bmm.out, (b1, b2), result)
    assert steps == run_rule(aten.bmm.default, (b1, b2), result)
    assert [s for s in steps if isinstance(s, Alloc)] == [Alloc("batch_a", 4 * 32 * 16 * 4)]


# -- cuDNN convolution -------------------------------------------------------------------


def test_conv_workspace_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert conv_workspace_policy() == ConvWorkspacePolicy("none")
    monkeypatch.setenv("TORCHMEM_CUDNN_WORKSPACE", "64 MiB")
    assert conv_workspace_policy() == ConvWorkspacePolicy("fixed", 64 * MiB)
    monkeypatch.setenv("TORCHMEM_CUDNN_WORKSPACE", "max")
    with pytest.raises(ValueError, match="CUDNN_CONV_WSCAP_DBG"):
        conv_workspace_policy()
    monkeypatch.setenv("CUDNN_CONV_WSCAP_DBG", "256")
    assert conv_workspace_policy() == ConvWorkspacePolicy("max", 256 * MiB)


def test_cudnn_forward_charges_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conv2d(3, 8, 3) on (2, 3, 16, 16), forward only: the cuDNN call's workspace is
    allocated and freed inside the call, so the forward peak grows by exactly it."""
    model, x = nn.Conv2d(3, 8, 3), torch.randn(2, 3, 16, 16)
    base = tm.estimate(model, x, device="cuda", train=False)
    monkeypatch.setenv("TORCHMEM_CUDNN_WORKSPACE", "1 MiB")
    with_ws = tm.estimate(model, x, device="cuda", train=False)
    assert with_ws.forward_peak - base.forward_peak == MiB
    assert with_ws.breakdown[tm.Category.WORKSPACE] == MiB


def test_cudnn_channels_last_copies_a_contiguous_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A channels-last weight makes cuDNN run in NHWC: _convolution copies the
    contiguous input, input.contiguous(channels_last), 2*3*16*16*4 = 6144 bytes."""
    monkeypatch.setenv("TORCHMEM_CUDNN_WORKSPACE", "4096")
    x = meta(2, 3, 16, 16)
    w = meta(8, 3, 3, 3).contiguous(memory_format=torch.channels_last)
    out = meta(2, 8, 14, 14).contiguous(memory_format=torch.channels_last)
    steps = run_rule(
        aten.convolution.default,
        (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        out,
    )
    assert steps == [
        Alloc("input", 6144),
        OUTPUTS,
        Alloc("weight", 0),
        Alloc("cudnn workspace", 4096),
        Free("cudnn workspace"),
    ]


def test_depthwise_float32_runs_the_native_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """groups == channels in float32 (contiguous): _conv_depthwise2d, not cuDNN
    (use_cudnn_depthwise wants float16 or channels-last): no cuDNN workspace."""
    monkeypatch.setenv("TORCHMEM_CUDNN_WORKSPACE", "1 MiB")
    x, w = meta(2, 32, 16, 16), meta(32, 1, 3, 3)
    steps = run_rule(
        aten.convolution.default,
        (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 32),
        meta(2, 32, 16, 16),
    )
    assert steps == [Alloc("input", 0), OUTPUTS, Alloc("weight", 0)]
    # float16, 32 channels, 3x3 stride 1, width 16 >= 7: cuDNN's depthwise engines
    x16, w16 = (
        meta(2, 32, 16, 16, dtype=torch.float16),
        meta(32, 1, 3, 3, dtype=torch.float16),
    )
    steps = run_rule(
        aten.convolution.default,
        (x16, w16, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 32),
        meta(2, 32, 16, 16, dtype=torch.float16),
    )
    assert Alloc("cudnn workspace", MiB) in steps


def test_cudnn_backward_copies_an_expanded_gradient() -> None:
    """Conv2d(3, 8, 3) whose output is summed: grad_output is a stride-0 expand of
    the (2, 8, 14, 14) output. The input gradient's cuDNN call takes
    grad_output.contiguous() (2*8*14*14*4 = 12544 bytes), the weight gradient's
    another; the bias gradient reduces it (no global buffers at this size)."""
    x, w = meta(2, 3, 16, 16), meta(8, 3, 3, 3)
    grad = meta(1, 1, 1, 1).expand(2, 8, 14, 14)
    outs = (meta(2, 3, 16, 16), meta(8, 3, 3, 3), meta(8))
    steps = run_rule(
        aten.convolution_backward.default,
        (grad, x, w, [8], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True]),
        outs,
    )
    allocs = [s for s in steps if isinstance(s, Alloc) and s.nbytes]
    assert allocs == [Alloc("grad_output_bi", 12544), Alloc("grad_output_bw", 12544)]


# -- the C++ constants, read again from the installed torch -------------------------------
# (each release venv of the release suite pins them for its release; tests/torch_sources.py)

PARSE_CHOSEN_WORKSPACE_SIZE = r"^_ZN2at4cuda24parseChosenWorkspaceSizeEv$"


def test_cublas_default_sizes_are_pinned_by_the_installed_libtorch_cuda() -> None:
    """``parseChosenWorkspaceSize`` loads ``:4096:2:16:8`` as ``$0x820000`` and the big
    size as ``$0x2000000`` (2.10 to 2.13), or as ``0x820000 + $0x17e0000`` in the
    branch-free form of 2.14 and 2.15."""
    found = immediates(disassembly(cuda_library("libtorch_cuda.so"), PARSE_CHOSEN_WORKSPACE_SIZE))
    small, big = workspaces.CUBLAS_DEFAULT_WORKSPACE, workspaces.CUBLAS_BIG_DEFAULT_WORKSPACE
    assert (small, big) == (4096 * 1024 * 2 + 16 * 1024 * 8, 32 * MiB)
    assert small in found
    assert big in found or big - small in found


#: The compiled tests of ``cudaDeviceProp::major`` (``0x168``) and ``minor`` (``0x16c``)
#: that choose the big default, and the architectures each gives it
#: (docs/explanation/torch-releases.md).
BIG_WORKSPACE_TESTS = [
    (r"cmpq \$0x9,0x168\(%\w+\)", lambda cc: cc == (9, 0)),
    (
        r"mov 0x168\(%\w+\),%\w+; lea -0x9\(%\w+\),%\w+; cmp \$0x1,%\w+; jbe .*cmp \$0xc,%\w+; je",
        lambda cc: cc[0] in (9, 10, 12),
    ),
    (r"mov 0x168\(%\w+\),%\w+; sub \$0x9,%\w+; cmp \$0x4,%\w+; sbb", lambda cc: 9 <= cc[0] <= 12),
]


def test_big_cublas_workspace_architectures_are_pinned_by_the_installed_libtorch_cuda() -> None:
    """The installed release's ``parseChosenWorkspaceSize`` compiles exactly one of the
    known architecture tests, and ``_big_default_workspace`` answers as it does for
    every compute capability."""
    code = instructions(disassembly(cuda_library("libtorch_cuda.so"), PARSE_CHOSEN_WORKSPACE_SIZE))
    matched = [rule for pattern, rule in BIG_WORKSPACE_TESTS if re.search(pattern, code)]
    assert len(matched) == 1, "parseChosenWorkspaceSize tests the architecture otherwise now"
    release = installed_release()[:2]
    for cc in [(7, 0), (8, 0), (8, 9), (9, 0), (9, 1), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1), (13, 0)]:
        assert workspaces._big_default_workspace(cc, release) == matched[0](cc), cc


def test_cublaslt_default_size_is_pinned_by_the_installed_libtorch_cuda() -> None:
    """``parseCUDABlasLtWorkspaceSize`` (``getCUDABlasLtWorkspaceSize``'s parser): 1024
    KiB (``$0x400``) without ``CUBLASLT_WORKSPACE_SIZE``."""
    code = disassembly(cuda_library("libtorch_cuda.so"), r"parseCUDABlasLtWorkspaceSize")
    assert workspaces.CUBLASLT_DEFAULT_WORKSPACE_KIB == 1024
    assert workspaces.CUBLASLT_DEFAULT_WORKSPACE_KIB in immediates(code)


def test_workspace_caching_switch_is_pinned_by_the_installed_libtorch_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``isCUDABlasWorkspaceCachingEnabled`` exists from 2.15 only, and there the
    workspaces are not cached by default: ``workspace_caching()`` follows the release."""
    monkeypatch.delenv("TORCH_CUBLAS_WORKSPACE_CACHE", raising=False)
    exists = has_function(cuda_library("libtorch_cuda.so"), r"isCUDABlasWorkspaceCachingEnabled")
    assert exists == (installed_release()[:2] >= (2, 15))
    assert workspaces.workspace_caching() is not exists


def test_the_cublaslt_handle_setup_is_pinned_by_the_installed_libtorch_cuda() -> None:
    """``getCurrentCUDABlasHandle`` takes no argument on 2.10 and 2.11 (``...HandleEv``:
    the cuBLASLt handle fetched through it gets the cuBLAS workspace) and a ``bool
    setup`` from 2.12 (``...HandleEb``: the cuBLASLt handle is fetched with
    ``setup=false``); ``_lt_handle_sets_up`` follows the installed release."""
    path = cuda_library("libtorch_cuda.so")
    no_setup = has_function(path, r"^_ZN2at4cuda24getCurrentCUDABlasHandleEv$")
    with_setup = has_function(path, r"^_ZN2at4cuda24getCurrentCUDABlasHandleEb$")
    assert no_setup != with_setup
    assert workspaces._lt_handle_sets_up() is no_setup


def test_conv_64bit_indexing_limit_is_pinned_by_the_installed_libtorch_cpu() -> None:
    """``ConvParams::needs_64bit_indexing_no_split`` (Convolution.cpp, ``libtorch_cpu.so``
    of CPU and CUDA builds) compares with ``std::numeric_limits<int>::max()``."""
    found = immediates(disassembly(library("libtorch_cpu.so"), r"needs_64bit_indexing_no_split"))
    assert workspaces.INT32_MAX == 0x7FFFFFFF and workspaces.INT32_MAX in found


def test_cudnn_depthwise_heuristic_is_pinned_by_the_installed_libtorch_cpu() -> None:
    """``ConvParams<long>::use_cudnn_depthwise`` with ``check_cudnn_depthwise_workload_with_filter``
    inlined (Convolution.cpp) compares with the thresholds ``_depthwise_workload`` and
    ``_use_cudnn_depthwise`` use: width <= 28 and >= 28, <= 7 and >= 7, batch <= 16,
    channels >= 128, >= 256, >= 512 and >= 32 (compiled as ``< n + 1`` / ``> n - 1``)."""
    found = immediates(disassembly(library("libtorch_cpu.so"), r"ConvParamsIlE19use_cudnn_depthwise"))
    for value in (28, 27, 7, 6, 16, 127, 255, 511, 31):
        assert value in found, value
