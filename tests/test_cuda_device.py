"""estimate(device="cuda") on a CPU-only torch: the process survives, the model is traced on
fake meta tensors and charged through the caching-allocator model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cuda.profiles import PROFILES, gpu_profile

MiB = 1 << 20


def test_the_process_survives_autograd_on_the_fake_cuda_device() -> None:
    """Guards the hazard in DESIGN.md: on a CPU-only torch, autograd over a fake
    cuda tensor aborts the interpreter (no exception). The model below asks for
    cuda tensors itself, inside forward; the estimate must still return."""
    script = textwrap.dedent(
        """
        import torch
        from torch import nn
        import pytest_torchmem as tm

        class AsksForCuda(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(32, 32)

            def forward(self, x):
                bias = torch.ones(32, device="cuda", requires_grad=True)
                y = self.fc(x.to("cuda")) + bias
                return torch.nn.functional.dropout(y, 0.1).cuda().sum()

        report = tm.estimate(AsksForCuda(), torch.randn(8, 32), device="cuda",
                             optimizer=lambda p: torch.optim.AdamW(p))
        print("peak", report.peak, "reserved", report.reserved_peak)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "peak" in done.stdout


def test_cuda_figures_are_caching_allocator_blocks() -> None:
    """Linear(1000, 1000) with a (10, 1000) input: every storage is a block of the
    caching allocator, a multiple of 512 bytes. Parameters: weight 4,000,000 B
    (large pool, 20 MiB segment since it is under 10 MiB, block rounded to 512:
    4,000,256 B) and bias 4,000 B (small pool: 4,096 B); input 40,000 B -> 40,448 B."""
    model = nn.Linear(1000, 1000)
    report = tm.estimate(model, torch.randn(10, 1000), device="cuda", train=False)
    assert report.breakdown[tm.Category.PARAMETERS] == 4_000_256 + 4_096
    assert report.breakdown[tm.Category.INPUTS] == 40_448
    assert report.reserved_peak is not None and report.reserved_peak % (2 * MiB) == 0
    assert report.forward_peak % 512 == 0
    assert report.device == "cuda"


def test_host_tensors_are_not_charged_to_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adam's step counters live on the host for CUDA parameters (not capturable,
    not fused): optimizer state is exp_avg and exp_avg_sq only, in 512-byte blocks.
    (Cached cuBLAS workspaces, as torch 2.15 keeps them only when asked: the peak
    is then the optimizer step's, where the state is.)"""
    monkeypatch.setenv("TORCH_CUBLAS_WORKSPACE_CACHE", "1")
    model = nn.Linear(64, 64)
    report = tm.estimate(model, torch.randn(8, 64), device="cuda", optimizer=lambda p: torch.optim.Adam(p))
    weight, bias = 64 * 64 * 4, 512  # 16384 B is a multiple of 512; the bias rounds up
    assert report.breakdown[tm.Category.OPTIMIZER_STATE] == 2 * (weight + bias)


def test_meta_models_and_cuda_inputs_are_the_same_to_the_estimate() -> None:
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 8))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 8))
    a = tm.estimate(real, torch.randn(16, 128), device="cuda")
    b = tm.estimate(meta, torch.empty(16, 128, device="meta"), device="cuda:1")
    assert a.phase_peaks() == b.phase_peaks() and a.reserved_peak == b.reserved_peak


def test_gpu_profiles() -> None:
    assert gpu_profile(None).name == "H100"
    assert gpu_profile("a100").compute_capability == (8, 0)
    assert set(PROFILES) >= {"V100", "A100", "H100", "L4"}
    with pytest.raises(ValueError, match="unknown GPU 'H900'; known GPUs: V100"):
        gpu_profile("H900")
    with pytest.raises(ValueError, match="gpu='H100' applies to device='cuda' only"):
        tm.estimate(nn.Linear(2, 2), torch.randn(1, 2), gpu="H100")
    with pytest.raises(ValueError, match="unknown GPU"):
        tm.estimate(nn.Linear(2, 2), torch.randn(1, 2), device="cuda", gpu="TPU")
