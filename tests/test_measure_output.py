"""What a measurement writes to standard error: nothing of the profiler's, all of the user's.

Issue 27, item 10: every ``measure`` printed kineto's ``USDT ... profiler_start`` and
``profiler_stop`` lines, c10's ``CPUAllocator.cpp:245 Memory block of unknown size``
warning and, on a CUDA build of torch without a GPU, ``gpuGetDeviceCount failed with
code 35`` (torch 2.10 to 2.12 also warned ``Profiler clears events at the end of each
cycle``). The tests run in a fresh interpreter of the running torch, where the
profiler starts for the first time (kineto's first start, and its one question to
the CUDA runtime, happen once per process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from pytest_torchmem.engine.measuring.cpu_profiler import stderr_without

pytest_plugins = ("pytester",)

#: What the profiler wrote, as seen on torch 2.10.0+cu128, 2.13.0+cpu and 2.15.0+cu130.
PROFILER_LINES = re.compile(
    r"profiler_start|profiler_stop|gpuGetDeviceCount|Memory block of unknown size|Profiler clears events"
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert done.returncode == 0, done.stderr
    return done


def test_measure_writes_nothing_to_stderr() -> None:
    """Regression: two measurements (the first starts kineto in the process), one with an
    optimizer step, wrote 3 to 5 lines each to stderr; now none."""
    done = _run(
        """
        import torch
        from torch import nn
        import pytest_torchmem as tm

        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        tm.measure(model, torch.randn(4, 8))
        tm.measure(model, torch.randn(4, 8), optimizer=lambda p: torch.optim.AdamW(p))
        print("measured")
        """
    )
    assert done.stdout == "measured\n"
    assert not PROFILER_LINES.search(done.stderr), done.stderr
    assert done.stderr == ""


def test_a_parallel_measure_writes_nothing_to_stderr() -> None:
    """Regression: each gloo rank of ``measure(parallel=...)`` wrote the profiler's lines
    and c10's ``[rank0]:[W... CPUAllocator.cpp:245] Memory block of unknown size`` (DDP's
    apply let go of copies made before the profiler started)."""
    done = _run(
        """
        import torch
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel
        import pytest_torchmem as tm

        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        parallel = tm.Parallel(mesh={"dp": 2}, apply=lambda m, mesh: DistributedDataParallel(m), rank=0)
        assert tm.measure(model, torch.randn(8, 16), parallel=parallel).peak > 0
        print("measured")
        """
    )
    # (gloo of torch 2.10 prints "[Gloo] Rank 0 is connected to 1 peer ranks" to stdout)
    assert done.stdout.splitlines()[-1] == "measured"
    assert not PROFILER_LINES.search(done.stderr), done.stderr


def test_the_users_own_output_and_warnings_stay() -> None:
    """What the step writes to stderr itself (Python's stream, the descriptor, a warning)
    is neither lost nor held back: it comes in the order the step wrote it, during the
    step (between what the step prints to stdout before and after)."""
    done = _run(
        """
        import os, sys, warnings
        import torch
        from torch import nn
        import pytest_torchmem as tm

        class Loud(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                print("forward", flush=True)
                print("the user's line", file=sys.stderr, flush=True)
                os.write(2, b"the user's descriptor line\\n")
                warnings.warn("the user's own warning")
                return self.fc(x)

        tm.measure(Loud(), torch.randn(2, 4))
        print("after", flush=True)
        """
    )
    assert done.stdout == "forward\nafter\n"
    lines = done.stderr.splitlines()
    assert [line for line in lines if "the user's" in line] == [
        "the user's line",
        "the user's descriptor line",
        lines[2],
    ]
    assert "UserWarning: the user's own warning" in lines[2]
    assert not PROFILER_LINES.search(done.stderr), done.stderr


def test_a_pytest_run_that_measures_shows_none_of_it(pytester: pytest.Pytester) -> None:
    """With capture off (``-s``), a test that measures twice leaves pytest's output clean."""
    pytester.makepyfile(
        """
        import torch
        from torch import nn
        import pytest_torchmem as tm

        def test_measures():
            model = nn.Linear(8, 8)
            assert tm.measure(model, torch.randn(2, 8)).peak > 0
            assert tm.measure(model, torch.randn(2, 8)).peak > 0
        """
    )
    result = pytester.runpytest_subprocess("-s", "-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    output = "\n".join(result.outlines + result.errlines)
    assert not PROFILER_LINES.search(output), output
    assert "warnings summary" not in output


def test_stderr_without_writes_back_every_other_line_in_order(capfd: pytest.CaptureFixture[str]) -> None:
    """The filter drops exactly the lines its pattern matches, whole, and keeps the rest in
    order (descriptor 2: what C++ code writes; Python's stream is checked in a fresh
    interpreter above, here pytest holds it)."""
    noise = re.compile(rb"^noise \d+\r?$")
    with stderr_without(noise):
        os.write(2, b"kept 1\nnoise 1\nkept noise 2\n")
        os.write(2, b"noise 3\r\nkept 3\n")
        os.write(2, b"no newline at the end")
    assert capfd.readouterr().err == "kept 1\nkept noise 2\nkept 3\nno newline at the end"


def test_stderr_without_puts_the_descriptor_back_when_the_block_raises(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(RuntimeError, match="inside"):
        with stderr_without(re.compile(rb"^x$")):
            os.write(2, b"before\n")
            raise RuntimeError("inside")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "before\nafter\n"
