"""pytest-torchmem: memory regression tests for PyTorch models.

``estimate`` traces one training step with fake tensors and predicts its
memory on a fake ``cpu`` or ``cuda`` device; ``measure`` runs the same step for
real. Both return a :class:`MemoryReport`.
"""

from pytest_torchmem.api import estimate, measure
from pytest_torchmem.report import Category, MemoryReport, ModulePeak, Unsupported
from pytest_torchmem.units import format_bytes, parse_bytes

__all__ = [
    "estimate",
    "measure",
    "MemoryReport",
    "Category",
    "ModulePeak",
    "Unsupported",
    "parse_bytes",
    "format_bytes",
]

__version__ = "0.1.0"
