"""The GPU profile the device's rules follow: :mod:`pytest_torchmem.engine.figures.gpu_profiles`.

The profiles live outside the device package (whose import is torch's) so
that the pytest plugin reads the ``torchmem_gpus`` ini table without
importing torch; their names are re-exported here, where the tracer's modules import them.
"""

from __future__ import annotations

from pytest_torchmem.engine.figures.gpu_profiles import DEFAULT_GPU, PROFILES, GpuProfile, gpu_profile

__all__ = ["GpuProfile", "PROFILES", "DEFAULT_GPU", "gpu_profile"]
