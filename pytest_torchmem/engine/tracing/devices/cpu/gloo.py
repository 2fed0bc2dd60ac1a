"""Gloo's collectives on the CPU: the flat buffers they take from the allocator.

Collectives write into the tensors they are given (see
:mod:`pytest_torchmem.engine.tracing.devices.collectives`); gloo's all-gather into
one tensor (``_allgather_base_``, FSDP2's parameter all-gather) also takes,
on top, two buffers the size of its output, one after the other, freed before
it completes (read off the profiler's allocator events of FSDP2 steps over
gloo at world 2 and 4: ``+out -out +out -out`` between the output's
allocation and its copy-out). Its reduce-scatter from one tensor
(``_reduce_scatter_base_``, FSDP2's gradient reduce-scatter) clones its input
and frees the clone before it completes; gloo has no average, so with
``ReduceOp.AVG`` (FSDP2's default for float32 and bfloat16 gradients) it sums
and then divides the output in place by the world size, a Python int: the
wrapped int64 (8 bytes) and its cast to the output's dtype, while the clone
is live.
"""

from __future__ import annotations

import torch

from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.rules import Alloc, Free, OpCall, Steps, nbytes_of

if torch.distributed.is_available():

    @CPU.scratch(torch.ops.c10d._allgather_base_.default)
    def _allgather_base(call: OpCall) -> Steps:
        nbytes = nbytes_of(call.args[0])
        return [
            Alloc("gloo flat output", nbytes),
            Free("gloo flat output"),
            Alloc("gloo flat output, again", nbytes),
            Free("gloo flat output, again"),
        ]

    @CPU.scratch(torch.ops.c10d._reduce_scatter_base_.default)
    def _reduce_scatter_base(call: OpCall) -> Steps:
        steps = [Alloc("gloo copy of the input", nbytes_of(call.args[1]))]
        if _reduce_op(call.args[3]) == int(torch.distributed.ReduceOp.RedOpType.AVG):
            divisor = Alloc("world size, wrapped", 8)
            cast = Alloc("world size, cast", call.args[0].element_size())
            steps += [divisor, cast, Free(cast.tag), Free(divisor.tag)]
        return [*steps, Free("gloo copy of the input")]

    def _reduce_op(boxed: object) -> int | None:
        """The ``RedOpType`` of a boxed ``ReduceOp`` as the c10d ops take it."""
        try:
            return int(boxed.op())  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError, TypeError):
            return None
