"""Parallel training: the memory of one rank, fake ranks traced and real ranks measured.

:mod:`.mesh` is :class:`~.mesh.Parallel` (the mesh, ``apply``, the rank) and runs
``apply`` on a fake process group; :mod:`.pipeline` is a pipeline rank's stages and
schedule. Fake ranks: :mod:`.traced_beside` traces a pipeline in a process forked beside
this one (the tracer's side of a pipeline, its stages traced together, is
:mod:`~pytest_torchmem.engine.tracing.pipeline_group`). Real ranks: :mod:`.real_ranks`
runs gloo processes on this machine, as ``measure(parallel=...)`` does. :mod:`.threads`
keeps the engine's own threads, which a fork waits for.
"""

__all__: list[str] = []
