"""RMSNorm on the fake GPU: the fused CUDA kernel (``devices/cuda/rms_norm.py``).

On a GPU ``at::rms_norm`` runs ``_fused_rms_norm``, whose autograd node keeps the
input, the weight and ``rstd``; the trace's meta tensors would take its
CompositeImplicitAutograd decomposition (``pow``, ``mean``, ``add_``, ``rsqrt``,
``mul``) and keep that decomposition's intermediates for the backward. The
figures measured on an H100 (torch 2.11.0+cu130, ``.gpucheck``-style run of
stop 47) are the ground truth of the 2.11 test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fingerprint import fingerprint
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat.torch_release import installed_release
from pytest_torchmem.engine.tracing.devices.cuda import CUDA
from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.engine.tracing.devices.cuda.rms_norm import takes_fused_rms_norm
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, OpCall, TraceContext

aten = torch.ops.aten
KiB = 1024


class RmsMlp(nn.Module):
    """The model measured on the H100: two RMSNorms around a SiLU MLP."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(512, dtype=dtype)
        self.up = nn.Linear(512, 1024, dtype=dtype)
        self.down = nn.Linear(1024, 512, dtype=dtype)
        self.norm2 = nn.RMSNorm(512, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.down(F.silu(self.up(self.norm(x)))))


def _adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)  # type: ignore[arg-type]


#: (dtype, optimizer) -> the forward, backward and step peaks measured on an H100 80GB
#: HBM3 with torch 2.11.0+cu130, from tm.measure(device="cuda") of a fresh RmsMlp
#: (seed 0) on a (64, 512) batch.
MEASURED_ON_H100_2_11 = {
    ("float32", None): (39_857_664, 77_221_376, 0),
    ("bfloat16", None): (37_231_104, 72_690_176, 0),
    ("float32", "adamw"): (81_821_184, 85_630_464, 89_311_744),
}


@pytest.mark.skipif(installed_release()[:2] != (2, 11), reason="measured with torch 2.11 (its cuBLAS workspaces)")
@pytest.mark.parametrize("dtype, optimizer", list(MEASURED_ON_H100_2_11))
def test_the_estimate_is_the_h100s_measurement(dtype: str, optimizer: str | None) -> None:
    torch.manual_seed(0)
    model = RmsMlp(getattr(torch, dtype))
    x = torch.randn(64, 512, dtype=getattr(torch, dtype))
    before = fingerprint(model, x)
    report = tm.estimate(model, x, device="cuda", gpu="H100", optimizer=_adamw if optimizer else None)
    phases = report.phase_peaks()
    assert (phases["forward"], phases["backward"], phases["step"]) == MEASURED_ON_H100_2_11[(dtype, optimizer)]
    assert report.unsupported == ()
    assert fingerprint(model, x) == before


def _forward_peak(norm: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    model = nn.Sequential(nn.Linear(512, 512, bias=False, dtype=dtype), norm, nn.Linear(512, 512, bias=False, dtype=dtype))
    return tm.estimate(model, torch.randn(64, 512, dtype=dtype), device="cuda").forward_peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_norm_keeps_its_output_and_rstd_alone(dtype: torch.dtype) -> None:
    """Against an Identity in its place, the norm adds its weight (512 of the dtype), its
    output (64 x 512 of the input's dtype) and rstd (64 floats, one 512-byte block) to
    the forward: the composite ops kept the upcast input, its square and the normalized
    product too."""
    size = torch.tensor([], dtype=dtype).element_size()
    added = _forward_peak(nn.RMSNorm(512, dtype=dtype), dtype) - _forward_peak(nn.Identity(), dtype)
    assert added == 512 * size + 64 * 512 * size + 512


def test_no_grad_keeps_nothing_for_a_backward() -> None:
    """Evaluation (no graph): rstd dies with the op; the output is all that stays."""
    norm = nn.Sequential(nn.Linear(512, 512, bias=False), nn.RMSNorm(512), nn.Linear(512, 512, bias=False))
    plain = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Identity(), nn.Linear(512, 512, bias=False))
    x = torch.randn(64, 512)
    peaks = [tm.estimate(m, x, device="cuda", train=False).forward_peak for m in (norm, plain)]
    assert peaks[0] - peaks[1] <= 64 * 512 * 4 + 512


def test_which_inputs_take_the_fused_kernel() -> None:
    """``rms_norm_symint``: not a channels-last input, not a complex one, not a weight
    of another dtype; a CPU tensor is no GPU's."""
    gpu = torch.empty(2, 8, device="meta")
    with torch.device("meta"):
        weight = torch.empty(8)
        other = torch.empty(8, dtype=torch.bfloat16)
        channels_last = torch.empty(2, 3, 4, 8).to(memory_format=torch.channels_last)
    assert takes_fused_rms_norm(gpu, weight) and takes_fused_rms_norm(gpu, None)
    assert not takes_fused_rms_norm(gpu, other)
    assert not takes_fused_rms_norm(channels_last, None)
    assert not takes_fused_rms_norm(torch.empty(2, 8), weight)


def test_the_backward_of_many_rows_sums_the_weight_gradient_per_block() -> None:
    """``_fused_rms_norm_backward`` shares the layer norm's LaunchGammaBetaBackwardCUDAKernel:
    M = 70000 rows of N = 64: blocks.y = min(32768 / 2, ceil(70000 / 32)) = 2188, a
    2188 x 64 float buffer for dgamma, then its .sum(0) (no dbeta: RMSNorm has no bias);
    an input that is not contiguous is copied first."""
    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    rule = CUDA.scratch_rule(aten._fused_rms_norm_backward.default)
    context = TraceContext("cuda", gpu=gpu_profile("H100"))
    args = (meta(70000, 64), meta(64, 70000).t(), [64], meta(70000, 1), meta(64), [True, True])
    steps = list(rule(OpCall(aten._fused_rms_norm_backward.default, args, {}, (meta(70000, 64), meta(64)), context)))
    allocs = [(s.tag, s.nbytes) for s in steps if isinstance(s, Alloc)]
    assert allocs[:3] == [("X contiguous", 70000 * 64 * 4), ("dgamma_blocks", 2188 * 64 * 4), ("dgamma_sum", 256)]
    assert OUTPUTS in steps
    few = (meta(60000, 64), meta(60000, 64), [64], meta(60000, 1), meta(64), [True, True])
    assert list(rule(OpCall(aten._fused_rms_norm_backward.default, few, {}, (meta(60000, 64), meta(64)), context))) == [OUTPUTS]
