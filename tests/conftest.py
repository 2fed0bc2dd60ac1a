import sys
from pathlib import Path

# The model zoo (tests/zoo.py) is shared by the test suite and the benchmarks.
sys.path.insert(0, str(Path(__file__).parent))

# Before any test module (and transformers, which imports torchvision when it is
# installed): torchvision's wheel needs the CUDA build of torch to import as is.
from torchvision_import import import_torchvision  # noqa: E402

import_torchvision()


def _capped_inductor_cache() -> None:
    """A run capped below this host's level (``ATEN_CPU_CAPABILITY``, as ``.ci/run``
    does) compiles into an inductor cache of its level's own: inductor's cache keys
    do not tell the levels apart (see ``capped_inductor_cache``)."""
    import os

    if "ATEN_CPU_CAPABILITY" in os.environ:
        from pytest_torchmem.engine.tracing.devices.cpu.profiles import capped_inductor_cache, host_profile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = capped_inductor_cache(host_profile().isa)


_capped_inductor_cache()

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from exactness import intra_op_threads  # noqa: E402


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}thread")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test at 1, 2 and 4 intra-op threads (CPU kernels' buffers depend on it)."""
    with intra_op_threads(request.param) as n:
        yield n
