"""The estimate engine: one training step traced on fake tensors, or measured for real, and its figures.

Rooms by job, each importing only the rooms listed before it (``tests/test_layout.py``
checks the order):

- :mod:`.figures`: the report, the storage timeline, byte units, a stopped trace, GPU
  profiles. No torch.
- :mod:`.torch_compat`: the torch releases supported, the one table of torch's private
  names, the one mechanism that replaces a torch attribute.
- :mod:`.user`: what belongs to the user: the world a step function reaches, a model's
  tensors, nested containers, tensor layouts, twins of optimizers, the loss, where in the
  user's code (or inductor's code for it) a trace is.
- :mod:`.parallel`: parallel training: :class:`~.parallel.mesh.Parallel` and its mesh,
  pipelines, real gloo ranks, ranks traced in a process beside, the engine's threads.
- :mod:`.step`: the step: the built-in training step, step functions and their phases,
  what a step holds, the validated request, one step at a time, ``compile=``.
- :mod:`.tracing`: the fake-tensor tracer, with one rule set per device.
- :mod:`.measuring`: real runs, read through the allocator or the profiler.
- :mod:`.every_rank`: every distinct rank of a parallel run, each traced.
- :mod:`.api`: the public entry points, :func:`~.api.estimate`, :func:`~.api.measure`,
  :func:`~.api.every_rank`.
- :mod:`.leaks`: a step run again and again, and what it keeps.
- :mod:`.fit`: the largest size that fits, and what to change when it does not.
"""

__all__: list[str] = []
