"""The CPU device model: scratch that CPU kernels take from the allocator.

Every rule was found by comparing a fake trace with the profiler's allocator
events of the same step run for real (``benchmarks/kernel_diff.py``), and
follows the kernel's source in ATen; each rule's docstring names it. The rules
live in one :class:`~pytest_torchmem.engine.tracing.rules.RuleSet`, :data:`CPU`,
filled by the modules of this package, one per kernel family.
"""

from pytest_torchmem.engine.tracing.devices.cpu import (  # noqa: F401  (they register rules)
    attention,
    blas,
    composite,
    conv,
    embedding_bag,
    fft,
    formulas,
    gloo,
    histogram,
    indexing,
    linalg,
    losses,
    masks,
    misc,
    norm,
    padding,
    pool,
    qr,
    reduce,
    rnn,
    sampling,
    scaled_mm,
    sorting,
    sparse,
    spectral,
    upsample,
)
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU

__all__ = ["CPU"]
