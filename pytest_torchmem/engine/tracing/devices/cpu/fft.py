"""CPU rules: MKL's FFTs (``aten/src/ATen/native/mkl/SpectralOps.cpp``, the ``AT_MKL_ENABLED``
branch, which torch's x86 wheels build; torch 2.13).

Every transform runs ``_exec_fft``: it permutes the input so that the batch
dims come first, in decreasing stride order, then the transformed dims, and
collapses the batch dims with ``input.reshape({-1, signal sizes...})``. Where
that cannot be a view, ``reshape`` makes a contiguous copy of the input (a
real input for ``_fft_r2c``, a complex one for the others); where the view has
a zero stride (an expanded input, such as the gradient of a sum), it is cloned
contiguous before MKL sees it. The copy is held while MKL runs and freed when
``_exec_fft`` returns. The output is ``at::empty`` of its
final size (``resize_`` to the batched shape keeps the storage), re-strided in
place; the conjugate-symmetry fill of a two-sided ``_fft_r2c`` writes into it.
``_fft_c2r`` over several dims first runs ``_fft_c2c_mkl`` over all but the
last (a complex tensor of the input's size, held until the op returns), then
the one-dim complex-to-real transform of that. MKL's descriptors and their
buffers come from MKL's own allocator, which neither the profiler nor
``measure`` sees.

The composite ops around these kernels (``fft_fft``'s padding, ``stft``'s
framing, the backward formulas of ``FunctionsManual.cpp``: ``fft_r2c_backward``'s
zero-padded gradient, ``fft_c2r_backward``'s ``_fft_r2c`` and narrowing) are
dispatched op by op and traced as such.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, view_strides
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Steps, nbytes_of

# torch's private names (engine/torch_compat/torch_private.py)
make_contiguous_strides_for: Final = private("torch._prims_common.make_contiguous_strides_for")

aten = torch.ops.aten

#: The tag of ``_exec_fft``'s copy of its input.
_COPY: Final = "input, batch dims collapsed (contiguous copy)"


def _partition(ndim: int, transformed: set[int]) -> list[int]:
    """The batch dims in the order ``std::partition`` (libstdc++, bidirectional
    iterators: swaps from both ends) leaves them in ``0..ndim-1``."""
    order = list(range(ndim))
    first, last = 0, ndim
    while True:
        while first != last and order[first] not in transformed:
            first += 1
        if first == last:
            return order[:first]
        last -= 1
        while first != last and order[last] in transformed:
            last -= 1
        if first == last:
            return order[:first]
        order[first], order[last] = order[last], order[first]
        first += 1


def _sort_dims(
    strides: Sequence[int], dims: Sequence[int], exclude_last: bool = False
) -> list[int]:
    """``_sort_dims``: the transformed dims by decreasing stride (``std::sort`` of at
    most 16 elements is an insertion sort: stable, as ``sorted`` is)."""
    end = len(dims) - int(exclude_last)
    head = sorted(dims[:end], key=lambda d: -strides[d])
    return [*head, *dims[end:]]


def _exec_fft(
    sizes: Sequence[int], strides: Sequence[int], out_sizes: Sequence[int], dims: Sequence[int]
) -> tuple[bool, list[int]]:
    """``_exec_fft`` for an input of ``sizes``/``strides`` transformed over ``dims``:
    whether it copies the input, and the strides it gives the output (of
    ``out_sizes``). It copies where ``input.permute(...).reshape(...)`` cannot be a
    view, or where that view has a zero stride (an expanded input: MKL newer than
    2021.4 mishandles them, pytorch/pytorch#154477, so it is cloned contiguous).
    An empty output returns before any of this."""
    ndim = len(sizes)
    batch = _partition(ndim, set(dims))
    batch.sort(key=lambda d: -strides[d])
    permute = [*batch, *dims]
    nbatch = len(batch)
    psizes = [sizes[d] for d in permute]
    pstrides = [strides[d] for d in permute]
    batch_size = math.prod(psizes[:nbatch])
    if math.prod(out_sizes) == 0:
        copies = False
    else:
        viewed = view_strides(psizes, pstrides, [batch_size, *psizes[nbatch:]])
        copies = viewed is None or 0 in viewed
    batched = make_contiguous_strides_for([batch_size, *(out_sizes[d] for d in dims)])
    out_strides = [0] * ndim
    numel = 1
    for i in range(nbatch - 1, -1, -1):
        out_strides[permute[i]] = numel * batched[0]
        numel *= out_sizes[permute[i]]
    for i in range(nbatch, ndim):
        out_strides[permute[i]] = batched[1 + i - nbatch]
    return copies, out_strides


@CPU.scratch(aten._fft_r2c.default, aten._fft_c2c.default)
def _fft_r2c_c2c(call: OpCall) -> Steps:
    """``_fft_r2c_mkl`` / ``_fft_c2c_mkl``: the output, then ``_exec_fft``'s copy of an
    input that its permuted, batch-collapsed view cannot be (over the dims sorted by
    ``_sort_dims``; ``r2c`` keeps the last one last). ``_fft_c2c`` over no dim is a
    clone (the output alone)."""
    self, dims = arg(call, 0, "self"), list(arg(call, 1, "dim"))
    if not dims:
        return [OUTPUTS]
    ndim = self.dim()
    dims = [d % ndim for d in dims]
    r2c = call.func is aten._fft_r2c.default
    sorted_dims = _sort_dims(self.stride(), dims, exclude_last=r2c)
    copies, _ = _exec_fft(self.shape, self.stride(), call.out.shape, sorted_dims)
    if not copies:
        return [OUTPUTS]
    return [OUTPUTS, Alloc(_COPY, nbytes_of(self)), Free(_COPY)]


@CPU.scratch(aten._fft_c2r.default)
def _fft_c2r(call: OpCall) -> Steps:
    """``_fft_c2r_mkl``: over several dims, ``_fft_c2c_mkl`` over all but the last first
    (its complex result of the input's size, and that transform's own input copy);
    then the output and ``_exec_fft`` over the last dim of that result, with its
    copy where the permuted view cannot be collapsed. The ``c2c`` result is freed
    when the op returns."""
    self, dims = arg(call, 0, "self"), list(arg(call, 1, "dim"))
    ndim = self.dim()
    dims = [d % ndim for d in dims]
    sizes, strides = list(self.shape), list(self.stride())
    steps: Steps = []
    if len(dims) > 1:
        c2c_dims = _sort_dims(strides, dims[:-1])
        copies, strides = _exec_fft(sizes, self.stride(), sizes, c2c_dims)
        steps = [Alloc("c2c over all but the last dim", nbytes_of(self))]
        if copies:
            steps += [Alloc(f"c2c {_COPY}", nbytes_of(self)), Free(f"c2c {_COPY}")]
        dims = dims[-1:]
    copies, _ = _exec_fft(sizes, strides, call.out.shape, dims)
    steps.append(OUTPUTS)
    if copies:
        steps += [Alloc(_COPY, nbytes_of(self)), Free(_COPY)]
    return steps
