"""oneDNN's convolution primitives as Python arithmetic: the shared vocabulary.

The problem as oneDNN sees it (:class:`Geo`), what a primitive makes ideep
allocate (:class:`Prim`), the scratchpad registry's bookings (:class:`Pad`),
oneDNN's integer and float arithmetic, and the lock-free reducers several
backward-weights kernels book.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

__all__ = [
    "BARRIER",
    "BATCH_ELEMENT",
    "PAGE",
    "Geo",
    "Pad",
    "Prim",
    "best_divider",
    "balance",
    "book_reducer",
    "book_reducer_2d",
    "cdiv",
    "div_up",
    "end_pad",
    "f32",
    "least_memory",
    "nxc_is_plain",
    "rnd_up",
    "swap",
]

# -- arithmetic as oneDNN writes it ---------------------------------------------------


def div_up(a: int, b: int) -> int:
    return -(-a // b)


def rnd_up(a: int, b: int) -> int:
    return div_up(a, b) * b


def f32(x: float) -> float:
    """``x`` rounded to a C ``float`` (oneDNN's heuristics compare floats)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def end_pad(start: int, dst: int, src: int, stride: int, ext_k: int) -> int:
    """oneDNN ``calculate_end_padding``."""
    return (dst - 1) * stride + ext_k - (src + start)


def best_divider(value: int, lo: int, hi: int, find_max: bool) -> int:
    """oneDNN ``best_divider`` (jit_uni_1x1_conv_utils.hpp)."""
    hi = max(1, min(hi, value))
    lo = max(1, min(lo, hi))
    best, x = float("inf"), hi
    for div in range(hi, lo - 1, -1):
        r = rnd_up(value, div)
        loss = f32((r - value) / r)
        if (find_max and loss < best) or (not find_max and loss <= best):
            best, x = loss, div
    return x


PAGE: Final = 4096


#: ``simple_barrier::ctx_t``: 4096 bytes, 4096-aligned (CTX_ALIGNMENT off Windows).
BARRIER: Final = 4096


#: sizeof(brgemm_batch_element_t): two pointers, two dim_t of padding, one dim_t.
BATCH_ELEMENT: Final = 40


class Pad:
    """oneDNN ``memory_tracking::registry_t``: a booking costs its size plus its
    alignment (at least 128); empty bookings cost nothing."""

    def __init__(self) -> None:
        self.size = 0

    def book(self, nbytes: int, align: int = 128) -> None:
        if nbytes > 0:
            self.size += nbytes + max(align, 128)


@dataclass(frozen=True)
class Geo:
    """A convolution in oneDNN's terms: channels per group, three spatial
    dimensions (depth and height 1 when absent), dilation counted from 0."""

    mb: int
    g: int
    ic: int
    oc: int
    i: tuple[int, int, int]
    o: tuple[int, int, int]
    k: tuple[int, int, int]
    s: tuple[int, int, int]
    p: tuple[int, int, int]  # front, top, left padding
    d: tuple[int, int, int]
    ndims: int  # 4 or 5: 1-d convolutions arrive as 2-d ones
    bias: bool
    dsz: int = 4

    @property
    def ext_k(self) -> tuple[int, ...]:
        return tuple((k - 1) * (d + 1) + 1 for k, d in zip(self.k, self.d))

    @property
    def pr(self) -> tuple[int, ...]:
        """Back, bottom, right padding (``calculate_end_padding``)."""
        return tuple(
            end_pad(p, o, i, s, e) for p, o, i, s, e in zip(self.p, self.o, self.i, self.s, self.ext_k)
        )

    @property
    def isp(self) -> int:
        return self.i[0] * self.i[1] * self.i[2]

    @property
    def osp(self) -> int:
        return self.o[0] * self.o[1] * self.o[2]

    @property
    def ks(self) -> int:
        return self.k[0] * self.k[1] * self.k[2]

    def data(self, channels: int, sp: int, block: int = 1) -> int:
        """Bytes of an activation with ``channels`` per group, the total padded
        to ``block`` (nCx<block>c; 1 for plain layouts)."""
        return self.mb * rnd_up(self.g * channels, block) * sp * self.dsz


@dataclass(frozen=True)
class Prim:
    """What a oneDNN primitive makes ideep allocate, in bytes.

    ``src``, ``wei``, ``dst`` name the primitive's own arguments (for
    backward-data, ``src`` is the input gradient and ``dst`` the output
    gradient): the size of the buffer ideep allocates for each, 0 where the
    caller's buffer is used as is.
    """

    name: str
    src: int
    wei: int
    dst: int
    scratch: int
    #: The result is nhwc: ``mkldnn_to_dense`` makes a channels-last tensor and
    #: copies it ``.contiguous()`` once more.
    nxc_result: bool = False
    #: Bytes of the source (backward-data: input gradient) in the primitive's
    #: format, whether or not ideep has to allocate it.
    src_fmt: int = 0


def nxc_is_plain(p: Geo, channels: int, sp: int) -> bool:
    """nhwc and nchw are the same memory descriptor when the channels or the
    spatial extent is 1 (oneDNN compares strides of non-unit dimensions only),
    so no reorder happens between them."""
    return p.g * channels == 1 or sp == 1


def least_memory(
    splits: list[tuple[int, int, int]], mem: Callable[[int, int, int], int]
) -> tuple[tuple[int, int, int], int]:
    """The thread split (minibatch, output-channel, input-channel) of least memory
    cost, the last of equals winning, starting from (1, 1, 1): the first pass of
    oneDNN's backward-weights ``balance()``."""
    best = (1, 1, 1)
    best_mem = mem(*best)
    for split in splits:
        if mem(*split) <= best_mem:
            best_mem, best = mem(*split), split
    return best, best_mem


def balance(nthr: int, job_size: int, njobs: int, reduction_size: int, max_buffer: int) -> tuple[int, int, int]:
    """``reduce_balancer_t::balance`` (``cpu_reducer.cpp``, lock free): the thread
    groups, the threads per group and the most jobs a group takes."""
    min_per_group = max(1, njobs // nthr)
    max_per_group = max(1, max_buffer // (nthr * job_size))
    ngroups = min(njobs // min_per_group, nthr)
    per_group = min(nthr // ngroups, reduction_size)
    ub = div_up(njobs, ngroups)
    cost = njobs * job_size * reduction_size
    for c in range(min_per_group, njobs):
        c_ngroups = min(njobs // c, nthr)
        c_per_group = min(nthr // c_ngroups, reduction_size)
        c_ub = div_up(njobs, c_ngroups)
        if c_per_group > 1 and c_ub > max_per_group:
            continue
        c_cost = job_size * c_ub * (div_up(reduction_size, c_per_group) + (c_per_group != 1))
        if c_cost < cost:
            ngroups, per_group, ub, cost = c_ngroups, c_per_group, c_ub, c_cost
    return ngroups, per_group, ub


def book_reducer(pad: Pad, nthr: int, job_size: int, njobs: int, reduction_size: int, max_buffer: int) -> None:
    """Book the scratchpad of a lock-free ``cpu_reducer_t<f32>``: a buffer for
    every thread of a group but the first, page aligned, and a barrier per group."""
    ngroups, per_group, ub = balance(nthr, job_size, njobs, reduction_size, max_buffer)
    if per_group > 1:
        pad.book(ngroups * (per_group - 1) * ub * job_size * 4, PAGE)
        pad.book(ngroups * BARRIER, BARRIER)


def book_reducer_2d(pad: Pad, nthr: int, job_size: int, njobs: int, reduction_size: int, max_buffer: int) -> None:
    """Book the scratchpad of a lock-free ``cpu_reducer_2d_t<f32>``: a buffer for
    every thread of a group, the first included, and a barrier per group."""
    ngroups, per_group, ub = balance(nthr, job_size, njobs, reduction_size, max_buffer)
    if per_group > 1:
        pad.book(ngroups * per_group * ub * job_size * 4)
        pad.book(ngroups * BARRIER, BARRIER)


def swap(p: Geo) -> Geo:
    """The problem with input and output exchanged (backward-data as forward)."""
    pl = tuple(e - 1 - x for e, x in zip(p.ext_k, p.p))
    return replace(p, ic=p.oc, oc=p.ic, i=p.o, o=p.i, p=pl)  # type: ignore[arg-type]


def cdiv(a: int, b: int) -> int:
    """C integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q
