"""Parallel training: the memory of one rank, fake ranks traced and real ranks measured.

:mod:`.mesh` is :class:`~.mesh.Parallel` (the mesh, ``apply``, the rank) and runs
``apply`` on a fake process group; :mod:`.pipeline` is a pipeline rank's stages and
schedule. Fake ranks: :mod:`.traced_beside` traces a pipeline in a process forked beside
this one (the tracer's side of a pipeline, its stages traced together, is
:mod:`~pytest_torchmem.engine.tracing.pipeline_group`). Real ranks: :mod:`.real_ranks`
runs gloo processes on this machine, as ``measure(parallel=...)`` does. :mod:`.threads`
keeps the engine's own threads, which a fork waits for.
"""

from typing import Any

from pytest_torchmem.engine import moved_attribute

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    """The names of ``engine/parallel.py`` (release 0.1.0), now :mod:`.mesh`'s, until the next release."""
    return moved_attribute(__name__, "mesh", name)
