"""The CUDA rule set, which the rule modules of this package fill.

The rule modules (kernels, temporaries, workspaces) register into it on import;
the package's ``__init__`` imports them."""

from __future__ import annotations

from typing import Final

from pytest_torchmem.engine.tracing.devices.autograd_paths import (
    EAGER_IN_PLACE_BINARY,
    register_eager_in_place,
)
from pytest_torchmem.engine.tracing.devices.common import COMMON
from pytest_torchmem.engine.tracing.devices.sparse import register_unmodelled_sparse
from pytest_torchmem.engine.tracing.rules import RuleSet

__all__ = ["CUDA"]

#: The CUDA rules.
CUDA: Final[RuleSet] = COMMON.copy("cuda")
# (the CPU's binary-op layout rules ask for these themselves: cpu/misc.py)
register_eager_in_place(CUDA, EAGER_IN_PLACE_BINARY)
# sparse tensors' kernels are not modelled on cuda: their ops are listed (devices/sparse.py)
register_unmodelled_sparse(CUDA)
