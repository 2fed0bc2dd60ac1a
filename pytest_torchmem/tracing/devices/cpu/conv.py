"""CPU rules: convolutions (``aten.convolution`` and ``aten.convolution_backward``).

What a CPU convolution takes from the allocator depends on the backend ATen
picks and, for oneDNN, on the primitive implementation oneDNN picks. The rules
follow torch 2.13 and the oneDNN it bundles (v3.12, commit 80afa71) layer by
layer:

1. **ATen** (``aten/src/ATen/native/Convolution.cpp``): ``_select_conv_backend``
   with ``ConvParams::use_mkldnn`` chooses oneDNN ("mkldnn") or a slow path
   (``thnn_conv2d``, ``slow_conv_dilated2d``, ``slow_conv_transpose2d``,
   ``slow_conv3d``); a 1-d convolution runs as a 2-d one on a contiguous input;
   the backend's memory format decides the ``.contiguous(fmt)`` copies.
2. **mkldnn glue** (``aten/src/ATen/native/mkldnn/Conv.cpp`` and ideep's
   ``convolution_forward``/``_backward_data``/``_backward_weights``): oneDNN
   chooses the memory formats, so ideep reorders the source, the weights and
   the incoming gradient into them, allocates the result in its format, books
   the primitive's scratchpad, and ``mkldnn_to_dense`` copies the result into
   a dense tensor (a channels-last result is copied ``.contiguous()`` again).
3. **oneDNN** (``src/cpu/cpu_convolution_list.cpp`` and each implementation's
   ``init_conf``/``init_scratchpad``): the first implementation that accepts
   the problem decides the formats (channel-blocked nChw16c with channels
   padded to the block, nhwc for brgemm kernels) and the scratchpad, e.g.
   per-thread weight-gradient reduction buffers (``jit:avx512_core``
   backward-weights, whose thread split ``balance()`` depends on
   ``num_threads()``), reduce-to-unit-stride copies (``jit_1x1``), per-thread
   input buffers and brgemm batches (``brgconv_strided``). A booking of ``n``
   bytes costs ``n`` plus its alignment (128 bytes; 4096 for page-aligned
   buffers and for barriers).

Verified on AVX512 (``cpu_capability() == "AVX512"``: oneDNN's avx512_core,
16-channel blocks) at 1 and 2 threads, float32 (oneDNN and slow paths) and
float64 (slow paths), against the allocator events of the real kernels. The
AVX2 implementations (8-channel blocks) that AVX512 machines also reach
(``jit:avx2`` backward-weights for 4..15 input channels, ``brgconv_strided:avx2``
for grouped 9..16 channels) were verified; an AVX2-only machine's own choices
follow the same source but were not run. The per-core L2 size some blockings
read is taken from sysfs (1 MiB here, verified through a blocked gemm).

Not modelled (the op's outputs are counted, its scratch is not): bfloat16 and
float16 convolutions (oneDNN's ``jit_bf16`` kernels), ``slow_conv_transpose3d``
and NNPACK (reached only with oneDNN disabled); brgemm forward
convolutions that copy their input (``exec_trans``/"relo": channels-last with
one input channel, or padding reaching ``stride * kw``) -- their input buffer
is missing; 3-d strided backward-data that the brgemm blocking search refuses
for a single channel is taken by ``brgconv_strided`` here rather than
``jit:avx512_core``.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import torch
import torch._prims_common

from pytest_torchmem.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.tracing.devices.cpu.blas import onednn_supports
from pytest_torchmem.tracing.devices.cpu.profiles import CpuProfile
from pytest_torchmem.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Output, Step

aten = torch.ops.aten

# -- arithmetic as oneDNN writes it ---------------------------------------------------


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _rnd_up(a: int, b: int) -> int:
    return _div_up(a, b) * b


def _f32(x: float) -> float:
    """``x`` rounded to a C ``float`` (oneDNN's heuristics compare floats)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _end_pad(start: int, dst: int, src: int, stride: int, ext_k: int) -> int:
    """oneDNN ``calculate_end_padding``."""
    return (dst - 1) * stride + ext_k - (src + start)


def _best_divider(value: int, lo: int, hi: int, find_max: bool) -> int:
    """oneDNN ``best_divider`` (jit_uni_1x1_conv_utils.hpp)."""
    hi = max(1, min(hi, value))
    lo = max(1, min(lo, hi))
    best, x = float("inf"), hi
    for div in range(hi, lo - 1, -1):
        r = _rnd_up(value, div)
        loss = _f32((r - value) / r)
        if (find_max and loss < best) or (not find_max and loss <= best):
            best, x = loss, div
    return x


_P4K: Final = 4096
#: ``simple_barrier::ctx_t``: 4096 bytes, 4096-aligned (CTX_ALIGNMENT off Windows).
_BARRIER: Final = 4096
#: sizeof(brgemm_batch_element_t): two pointers, two dim_t of padding, one dim_t.
_BATCH_ELEMENT: Final = 40


class _Pad:
    """oneDNN ``memory_tracking::registry_t``: a booking costs its size plus its
    alignment (at least 128); empty bookings cost nothing."""

    def __init__(self) -> None:
        self.size = 0

    def book(self, nbytes: int, align: int = 128) -> None:
        if nbytes > 0:
            self.size += nbytes + max(align, 128)


# -- the problem as oneDNN sees it ----------------------------------------------------


@dataclass(frozen=True)
class _Geo:
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
            _end_pad(p, o, i, s, e) for p, o, i, s, e in zip(self.p, self.o, self.i, self.s, self.ext_k)
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
        return self.mb * _rnd_up(self.g * channels, block) * sp * self.dsz


@dataclass(frozen=True)
class _Prim:
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


def _nxc_is_plain(p: _Geo, channels: int, sp: int) -> bool:
    """nhwc and nchw are the same memory descriptor when the channels or the
    spatial extent is 1 (oneDNN compares strides of non-unit dimensions only),
    so no reorder happens between them."""
    return p.g * channels == 1 or sp == 1


# -- oneDNN: jit direct convolutions (jit_avx512_common_conv_kernel, jit_avx2_conv_kernel)


def _jit_fwd(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_avx512_common_conv_fwd_kernel_t::init_conf``: nCx16c data and
    OIx16i16o weights, the channels padded to 16 when there is one group; a
    first convolution (ic < 16, one group) reads the nchw source with Oxi16o
    weights; grouped channels that are not multiples of 16 use 8- or 4-channel
    blocks. Channels-last data is used in place (only the weights are
    reordered, padded to their blocks). Scratchpad: the padded bias."""
    if not cpu.avx512:
        return None
    e, pr = p.ext_k, p.pr
    if any(ek <= pl or ek <= r for ek, pl, r in zip(e, p.p, pr)):
        return None
    first = p.ic < 16 and p.g == 1
    simd = 16
    lower = p.g > 1 and not first and (p.ic % 16 or p.oc % 16) and (not nxc or (p.ic < 16 and p.oc < 16))
    if lower:
        simd = next((c for c in (8, 4) if p.ic % c == 0 and p.oc % c == 0), 16)
    pad = p.g == 1 and not nxc
    ic = p.ic if first or not pad else _rnd_up(p.ic, 16)
    oc = _rnd_up(p.oc, 16) if pad else p.oc
    if not nxc and (oc % simd or (not first and ic % simd)):
        return None
    ur_w = min(p.o[2], 28)
    tail = p.o[2] % ur_w
    if p.p[2] > ur_w or max(0, _end_pad(p.p[2], p.o[2] - tail, p.i[2], p.s[2], e[2])) > ur_w:
        return None
    scratch = _Pad()
    if p.bias and oc != p.oc:
        scratch.book(p.g * oc * p.dsz)
    wei = p.g * _rnd_up(oc, simd) * (ic if first else _rnd_up(ic, simd)) * p.ks * p.dsz
    if nxc:
        return _Prim("jit:avx512_core", 0, wei, 0, scratch.size)
    src = 0 if first else p.data(ic, p.isp, simd)
    return _Prim("jit:avx512_core", src, wei, p.data(oc, p.osp, simd), scratch.size)


def _avx2_fwd(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_avx2_conv_fwd_kernel_f32_t::init_conf``: nCx8c data and OIx8i8o
    weights, channels padded to 8 with one group; a flat (ic < 8) source stays
    nchw with Oxi8o weights. Scratchpad: the padded bias."""
    if nxc:
        return None
    e, pr = p.ext_k, p.pr
    if any(ek <= pl or ek <= r for ek, pl, r in zip(e, p.p, pr)):
        return None
    flat = p.ic < 8
    if flat and p.g * p.ic >= 8:
        return None  # the pd picks blocked formats from the total channels, the kernel wants flat
    ic = p.ic if flat or p.g > 1 else _rnd_up(p.ic, 8)
    oc = _rnd_up(p.oc, 8) if p.g == 1 else p.oc
    if oc % 8 or (not flat and ic % 8):
        return None
    scratch = _Pad()
    if p.bias and oc != p.oc:
        scratch.book(p.g * oc * p.dsz)
    src = 0 if flat else p.data(ic, p.isp, 8)
    return _Prim("jit:avx2", src, p.g * oc * ic * p.ks * p.dsz, p.data(oc, p.osp, 8), scratch.size)


def _jit_bwd_d(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_avx512_common_conv_bwd_data_kernel_f32_t::init_conf``: nCx16c
    gradients and OIx16o16i weights, channels padded to 16 when there is one
    group (8- or 4-channel blocks for grouped channels); channels-last data in
    place; no dilation with strides; no scratchpad."""
    if not cpu.avx512:
        return None
    if any(d and s != 1 for d, s in zip(p.d, p.s)):
        return None
    e, pr = p.ext_k, p.pr
    if any(ek <= pl or ek <= r for ek, pl, r in zip(e, p.p, pr)):
        return None
    simd = 16
    if p.g > 1 and (p.ic % 16 or p.oc % 16) and (not nxc or (p.ic < 16 and p.oc < 16)):
        simd = next((c for c in (8, 4) if p.ic % c == 0 and p.oc % c == 0), 0 if not nxc else 16)
        if not simd:
            return None
    pad = p.g == 1 and not nxc
    ic = _rnd_up(p.ic, 16) if pad else p.ic
    oc = _rnd_up(p.oc, 16) if pad else p.oc
    wei = p.g * _rnd_up(oc, simd) * _rnd_up(ic, simd) * p.ks * p.dsz
    if nxc:
        return _Prim("jit:avx512_core", 0, wei, 0, 0, src_fmt=p.data(p.ic, p.isp))
    src = p.data(ic, p.isp, simd)
    return _Prim("jit:avx512_core", src, wei, p.data(oc, p.osp, simd), 0, src_fmt=src)


def _avx2_bwd_d(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_avx2_conv_bwd_data_kernel_f32_t::init_conf``: nCx8c, channels
    padded to 8 with one group, equal height and width strides; no scratchpad."""
    if nxc or p.s[1] != p.s[2] or p.s[0] != 1:
        return None
    if (p.d[2] and p.s[2] != 1) or (p.d[1] and p.s[1] != 1):
        return None
    if p.ic < 8 and p.k[2] > 3 and p.s[2] > 1:
        return None
    e, pr = p.ext_k, p.pr
    if any(ek <= pl or ek <= r for ek, pl, r in zip(e, p.p, pr)):
        return None
    ic = _rnd_up(p.ic, 8) if p.g == 1 else p.ic
    oc = _rnd_up(p.oc, 8) if p.g == 1 else p.oc
    if ic % 8 or oc % 8:
        return None
    return _Prim("jit:avx2", p.data(ic, p.isp, 8), p.g * oc * ic * p.ks * p.dsz, p.data(oc, p.osp, 8), 0)


_MIN_OH_REDUCE: Final = 9


def _jit_bwd_w(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_avx512_common_conv_bwd_weights_kernel_f32_t::init_conf``: when
    ``balance()`` splits the minibatch (or the output rows) between ``nthr_mb``
    threads, every thread but one accumulates into its own copy of the weights
    and bias, synchronised by a barrier; the bias gradient of the other
    threads goes through ``cpu_reducer_t``; a padded bias when oc is padded."""
    if not cpu.avx512:
        return None
    e = p.ext_k
    pr = tuple(max(0, x) for x in p.pr)
    if (p.d[1] and p.s[1] != 1) or (p.d[0] and p.s[0] != 1) or (p.d[1] and e[1] > p.i[1]):
        return None
    if p.ndims == 5 and p.d[0]:
        return None
    hw_transp = (
        not nxc and p.ndims == 4 and 14 <= p.k[2] < 20 and p.o[2] == 1 and p.k[2] == p.i[2]
        and p.s[1] == p.s[2] == 1 and p.d[1] == p.d[2] == 0 and not any(p.p) and not any(pr)
    )
    first = p.ic < 16 and p.g == 1
    pad = not nxc and p.g == 1
    oc = _rnd_up(p.oc, 16) if pad else p.oc
    if not nxc and oc % 16:
        return None
    max_pad_h = e[1] // 2
    if not (
        p.p[2] < e[2] and pr[2] < e[2] and p.p[1] <= max_pad_h and pr[1] <= max_pad_h
        and p.p[0] < e[0] and pr[0] < e[0] and (p.p[0] == 0 or p.k[0] < p.i[0] + p.p[0])
        and p.p[2] <= 28 and pr[2] <= 28
    ):
        return None
    if not hw_transp and p.k[2] > 14:
        return None
    if first:
        if not nxc and p.ic not in (1, 2, 3):
            return None
        ic_block = ic = p.ic
    else:
        ic_block = 16
        ic = _rnd_up(p.ic, 16) if pad else p.ic
        if not nxc and ic % 16:
            return None
    harness = "3d" if p.ndims == 5 else "mb"
    if p.d[1] == 0 and p.ndims == 4 and p.o[1] > _MIN_OH_REDUCE and not hw_transp and not nxc:
        harness = "2d"
    nb_ic, nb_oc = _div_up(ic, ic_block), _div_up(oc, 16)
    threads, nthr_mb = _jit_bwd_w_balance(p, cpu.threads, harness, hw_transp, ic_block, nb_ic, nb_oc)
    scratch = _Pad()
    if nthr_mb > 1:
        wei = p.g * _rnd_up(oc, 16) * _rnd_up(ic, ic_block) * p.ks
        scratch.book((wei + p.g * _rnd_up(oc, 16)) * (nthr_mb - 1) * 4)
        scratch.book(_BARRIER, _BARRIER)
    if p.bias and p.oc % 16:
        scratch.book(p.g * _rnd_up(oc, 16) * 4)
    if p.bias:
        _reducer(scratch, threads, 16, p.g * nb_oc, p.mb, threads * 3 * 5 * 5 * 16 * 16)
    src = 0 if first or nxc else p.data(ic, p.isp, 16)  # a first convolution reads nchw
    dst = 0 if nxc else p.data(oc, p.osp, 16)
    wei_b = p.g * _rnd_up(oc, 16) * _rnd_up(ic, ic_block) * p.ks * p.dsz
    return _Prim("jit:avx512_core", src, wei_b, dst, scratch.size)


def _least_memory(
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


def _jit_bwd_w_balance(
    p: _Geo, nthreads: int, harness: str, hw_transp: bool, ic_block: int, nb_ic: int, nb_oc: int
) -> tuple[int, int]:
    """``jit_avx512_common_conv_bwd_weights_kernel_f32_t::balance``:
    ``(nthr, nthr_mb)``, the thread split of least memory then compute cost."""
    if nthreads < p.g:
        return nthreads, 1
    nthr = nthreads // p.g
    ih, oh = (p.i[2], p.o[2]) if hw_transp else (p.i[1], p.o[1])
    iw, ow = (p.i[1], p.o[1]) if hw_transp else (p.i[2], p.o[2])
    two_d = harness == "2d"
    ih_red, oh_red = (ih, oh) if two_d else (1, 1)
    ih_no, oh_no = (1, 1) if two_d else (ih, oh)
    nthr_oh_reduce = max(1, oh_red // _MIN_OH_REDUCE)

    def mem(nmb: int, noc: int, nic: int) -> int:
        return (
            _div_up(p.mb * ih_red, nmb) * _div_up(nb_ic, nic) * ic_block * ih_no * iw * p.i[0]
            // p.s[0] // p.s[1] // p.s[2]
            + _div_up(p.mb * oh_red, nmb) * _div_up(nb_oc, noc) * 16 * oh_no * ow * p.o[0]
            + 8 * _div_up(nb_oc, noc) * _div_up(nb_ic, nic) * p.ks * ic_block * 16
        )

    def comp(nmb: int, noc: int, nic: int) -> int:
        return _div_up(p.mb * oh_red, nmb) * _div_up(nb_oc, noc) * _div_up(nb_ic, nic)

    splits = [
        (nmb, noc, min(nthr // nmb // noc, nb_ic))
        for nmb in range(1, min(nthr, p.mb * p.o[0] * nthr_oh_reduce) + 1)
        for noc in range(1, min(nthr // nmb, nb_oc) + 1)
    ]
    best, best_mem = _least_memory(splits, mem)
    best_comp = comp(*best)
    for split in splits:
        c = comp(*split)
        if (c <= best_comp and (hw_transp or mem(*split) < 1.1 * best_mem)) or 4 * c <= 3 * best_comp:
            best_comp, best = c, split
    nmb, noc, nic = best
    if nthreads // 2 < nmb < nthreads:
        nmb = min(p.mb * p.o[0] * nthr_oh_reduce, nthreads)
    return nmb * p.g * noc * nic, nmb


def _reducer(pad: _Pad, nthr: int, job_size: int, njobs: int, reduction_size: int, max_buffer: int) -> None:
    """Book the scratchpad of a lock-free ``cpu_reducer_t<f32>``
    (``reduce_balancer_t::balance``): a buffer for every thread of a group but
    the first, page aligned, and a barrier per group."""
    min_per_group = max(1, njobs // nthr)
    max_per_group = max(1, max_buffer // (nthr * job_size))
    ngroups = min(njobs // min_per_group, nthr)
    per_group = min(nthr // ngroups, reduction_size)
    ub = _div_up(njobs, ngroups)
    cost = njobs * job_size * reduction_size
    for c in range(min_per_group, njobs):
        c_ngroups = min(njobs // c, nthr)
        c_per_group = min(nthr // c_ngroups, reduction_size)
        c_ub = _div_up(njobs, c_ngroups)
        if c_per_group > 1 and c_ub > max_per_group:
            continue
        c_cost = job_size * c_ub * (_div_up(reduction_size, c_per_group) + (c_per_group != 1))
        if c_cost < cost:
            ngroups, per_group, ub, cost = c_ngroups, c_per_group, c_ub, c_cost
    if per_group > 1:
        pad.book(ngroups * (per_group - 1) * ub * job_size * 4, _P4K)
        pad.book(ngroups * _BARRIER, _BARRIER)


def _avx2_bwd_w(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_avx2_conv_bwd_weights_kernel_f32_t::init_conf`` (also taken on
    AVX512 when the avx512 kernel refuses, e.g. 4..15 input channels): 8-channel
    blocks (a flat nchw source when ic == 3); weights and bias gradients of
    the threads sharing a group of jobs go through ``cpu_reducer_t``."""
    if p.d != (0, 0, 0) or nxc:
        return None
    e = p.ext_k
    pr = tuple(max(0, x) for x in p.pr)
    if not (p.p[1] < e[1] and pr[1] < e[1] and p.p[2] < e[2] and pr[2] < e[2] and p.p[0] == 0 and pr[0] == 0):
        return None
    flat = p.ic == 3
    if flat and p.g > 1:
        return None  # the pd picks blocked formats from the total channels, the kernel wants flat
    oc = _rnd_up(p.oc, 8) if p.g == 1 else p.oc
    ic = p.ic if flat or p.g > 1 else _rnd_up(p.ic, 8)
    if oc % 8 or (not flat and ic % 8):
        return None
    if not (p.k[2] < 14 and p.k[1] <= p.i[1] and p.p[1] < p.k[1] and p.k[0] <= p.i[0]):
        return None
    ic_block = ic if flat else 8
    nb_ic, nb_oc = _div_up(ic, ic_block), _div_up(oc, 8)
    scratch = _Pad()
    if p.bias and p.oc % 8:
        scratch.book(p.g * oc * 4)
    if p.bias:
        _reducer(scratch, cpu.threads, 8, p.g * nb_oc, p.mb, 1 << 21)
    _reducer(scratch, cpu.threads, p.ks * ic_block * 8, p.g * nb_ic * nb_oc, p.mb * p.o[0], 1 << 21)
    src = 0 if flat else p.data(ic, p.isp, 8)
    wei = p.g * oc * ic * p.ks * p.dsz
    return _Prim("jit:avx2", src, wei, p.data(oc, p.osp, 8), scratch.size)


# -- oneDNN: 1x1 convolutions (jit_avx512_common_1x1_conv_kernel) ------------------------


@dataclass(frozen=True)
class _OneByOne:
    """The parts of ``jit_avx512_common_1x1_conv_kernel_t::init_conf`` that size
    the scratchpad."""

    nthr: int
    nthr_mb: int
    reduce_src: bool  # reduce-to-unit-stride copies of a strided source
    nb_reduce: int
    nb_load_blocking_max: int
    nb_bcast_blocking: int
    is_: int  # spatial size the kernel reads (after unit-stride reduction)


def _1x1_applicable(p: _Geo) -> tuple[bool, bool]:
    """``rtus_prepare`` then the 1x1 checks: ``(applicable, reduce_src)``."""
    if p.ks != 1 or p.g != 1 or p.ic % 16 and True:
        pass
    if p.ks != 1 or p.g != 1:
        return False, False
    strided = p.s != (1, 1, 1)
    rtus = (
        p.ndims == 4 and strided and not any(p.p)
        and all(o * s == i for o, s, i in zip(p.o[1:], p.s[1:], p.i[1:]))
    )
    unit = rtus or (not strided)
    if not unit or any(p.p) or (not rtus and p.o != p.i):
        return False, False
    return True, rtus


def _1x1_conf(p: _Geo, cpu: CpuProfile, prop: str, nxc: bool = False) -> _OneByOne:
    """The thread count, reduction split and blockings of the 1x1 kernel."""
    rtus = _1x1_applicable(p)[1]
    ic, oc = (p.ic, p.oc) if nxc else (_rnd_up(p.ic, 16), _rnd_up(p.oc, 16))
    os_ = p.osp
    is_ = os_ if rtus else p.isp
    if prop in ("fwd", "bwd_d"):
        reduce_dim, load_dim = (ic, oc) if prop == "fwd" else (oc, ic)
        bcast_dim = is_ if prop == "fwd" else os_
        spatial = p.o[0] * p.o[1] if prop == "fwd" else p.i[0] * p.i[1]
        if 8 * p.mb // cpu.threads >= 1 or (nxc and p.mb == 1):
            max_regs, min_regs = 9, 6
            if 128 < load_dim < 256 and 10 < spatial < 28:
                max_regs, min_regs = 6, 5
            expl = True
        else:
            max_regs, min_regs, expl = 30, 9, False
        ur = 1
        for u in range(max_regs, min_regs - 1, -1):
            if (spatial >= 14 and spatial % u == 0) or (spatial < 14 and os_ % u == 0):
                ur = u
                break
        if ur == 1:
            ur = min(max_regs, os_)
            tail = os_ % max_regs
            for u in range(max_regs, min_regs - 1, -1):
                t = os_ % u
                if t > tail or t == 0:
                    ur, tail = u, t
                    if t == 0:
                        break
        nb_bcast, nb_load, nb_reduce = _div_up(bcast_dim, ur), _div_up(load_dim, 16), _div_up(reduce_dim, 16)
        threads = cpu.threads
        load_size = load_dim * reduce_dim
        bcast_size = p.mb * bcast_dim * reduce_dim
        lgc, load_blocking = _1x1_load_groups(p, threads, nb_load, nb_bcast, ur, load_dim, reduce_dim, load_size, bcast_size)
        if expl and bcast_dim <= 64 and load_size >= cpu.l2 // 4:
            lgc = max(lgc, 4)
        elif bcast_dim <= 49 and p.mb <= threads and load_dim > 512 and load_dim // reduce_dim >= 4:
            lgc, load_blocking = max(lgc, 2), 16
        if 4 * bcast_size < 8192 and p.mb < threads and nb_load * nb_bcast < threads:
            threads, lgc = _1x1_small_threads(p, threads, nb_load, nb_bcast, ur, lgc)
            load_blocking = _div_up(nb_load, lgc) * 16
        return _OneByOne(threads, 1, rtus, nb_reduce, _div_up(load_blocking, 16), 0, is_)
    # backward weights
    reduce_dim = is_
    reduce_block = _best_divider(reduce_dim, 7, 16, True)
    if reduce_dim % reduce_block:
        reduce_block = _best_divider(p.i[2], 4, p.i[2], False)
    if reduce_block > 256:
        reduce_block = 1
    nb_bcast, nb_load, nb_reduce = _div_up(ic, 16), _div_up(oc, 16), _div_up(reduce_dim, reduce_block)
    threads, nthr_mb = _1x1_bwd_w_balance(p, cpu.threads, nb_bcast, nb_load, nb_reduce, reduce_block)
    bcast_blocking = _best_divider(nb_bcast, 5, nb_bcast, False)
    return _OneByOne(threads, nthr_mb, rtus, nb_reduce, 0, bcast_blocking, is_)


def _1x1_load_groups(
    p: _Geo, nthr: int, nb_load: int, nb_bcast: int, ur: int, load_dim: int, reduce_dim: int,
    load_size: int, bcast_size: int,
) -> tuple[int, int]:
    """``load_grp_count`` and ``load_blocking`` of the 1x1 forward/backward-data conf."""
    load_blocking = load_dim
    if nthr <= 28 and p.mb < nthr and nb_load * nb_bcast > nthr:
        ratio = _f32(load_size / bcast_size)
        best_lgc = nthr if ratio > 1 else 1
        best = float("inf")

        def cost(lb: int, tg: int, mem_k: float) -> float:
            bb = p.mb * _div_up(nb_bcast, tg)
            calc = _f32(_f32(bb * ur) * (lb * 16)) * reduce_dim
            memsz = _f32(bb * ur + lb * 16) * reduce_dim
            return _f32(_f32(0.01 * calc) + _f32(mem_k * memsz))

        for i in range(nthr):
            lgc = nthr - i if ratio > 1 else i + 1
            min_lb, max_lb = nb_load // lgc, _div_up(nb_load, lgc)
            min_tg, max_tg = nthr // lgc, _div_up(nthr, lgc)
            mem_k = 1.0 if max_tg == 1 else _f32(1.3)
            if nthr % lgc < nb_load % lgc:
                c = cost(max_lb, min_tg, mem_k)
            else:
                c = max(cost(max_lb, max_tg, mem_k), cost(min_lb, min_tg, mem_k))
            if c < best:
                best_lgc, best = lgc, c
        return best_lgc, _div_up(nb_load, best_lgc) * 16
    lgc = _div_up(nthr, p.mb * nb_bcast)
    lgc = _best_divider(nthr, lgc, 2 * lgc, False)
    return lgc, load_blocking


def _1x1_small_threads(p: _Geo, nthr: int, nb_load: int, nb_bcast: int, ur: int, lgc: int) -> tuple[int, int]:
    """The thread-count reduction of the 1x1 conf for tiny problems."""

    def eff(load_chunk: int, n: int) -> float:
        groups = _div_up(nb_load, load_chunk)
        per = _div_up(n, groups)
        bcast_per = _div_up(p.mb * nb_bcast, per) * ur
        load_per = load_chunk * 16
        norm = _f32((bcast_per + load_per) / 2.0)
        data = _f32(bcast_per * load_per / _f32(norm * norm))
        over = _f32(max(1, n // groups) / _div_up(n, groups))
        within = _f32(p.mb * nb_bcast / _rnd_up(p.mb * nb_bcast, per))
        load = _f32(nb_load / _rnd_up(nb_load, groups))
        return _f32(_f32(data + _f32(over * within)) + load)

    def chunk(n: int) -> int:
        best, best_lgc = -1.0, 1
        for lc in range(1, nb_load + 1):
            groups = _div_up(nb_load, lc)
            if groups > n:
                continue
            e = eff(lc, n)
            if e > best:
                best, best_lgc = e, groups
        return best_lgc

    best, overall, best_n = -1.0, lgc, nthr
    for n in range(nthr // 2, 0, -1):
        c = chunk(n)
        e = eff(c, n)
        if best < e:
            best, overall, best_n = e, c, n
    return best_n, overall


def _1x1_bwd_w_balance(
    p: _Geo, nthreads: int, nb_bcast: int, nb_load: int, nb_reduce: int, reduce_block: int
) -> tuple[int, int]:
    """``jit_avx512_common_1x1_conv_kernel_t::balance``: ``(nthr, nthr_mb)``, the
    split of least memory cost (unlike the direct kernel, no compute-cost step)."""
    if nthreads < p.g:
        return 1, 1
    nthr = nthreads // p.g

    def mem(nmb: int, noc: int, nic: int) -> int:
        return (
            _div_up(p.mb * nb_reduce, nmb) * _div_up(nb_bcast, nic) * 16 * reduce_block // p.s[1] // p.s[2]
            + _div_up(p.mb * nb_reduce, nmb) * _div_up(nb_load, noc) * 16 * reduce_block
            + 12 * _div_up(nb_load, noc) * _div_up(nb_bcast, nic) * 16 * 16
        )

    splits = [
        (nmb, noc, min(nthr // nmb // noc, nb_bcast))
        for nmb in range(1, min(nthr, p.mb * nb_reduce) + 1)
        for noc in range(1, min(nthr // nmb, nb_load) + 1)
    ]
    best, best_mem = _least_memory(splits, mem)
    nmb, noc, nic = best
    if nthreads // 2 < nmb < nthreads:
        nmb = min(p.mb, nthreads)
    return nmb * p.g * noc * nic, nmb


def _jit_1x1(prop: str) -> Any:
    def impl(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
        """``jit_avx512_common_1x1_convolution_*_t``: nCx16c data with the
        channels padded to 16 (channels-last data in place); a strided source
        is first copied to unit stride per thread (``rtus_prepare_space_info``);
        backward-weights splits the reduction like the direct kernel
        (``balance``: one weights copy per extra thread, a barrier, the bias
        reducer)."""
        if not cpu.avx512:
            return None
        ok, rtus = _1x1_applicable(p)
        if not ok:
            return None
        conf = _1x1_conf(p, cpu, prop, nxc)
        ic, oc = (p.ic, p.oc) if nxc else (_rnd_up(p.ic, 16), _rnd_up(p.oc, 16))
        scratch = _Pad()
        if prop == "bwd_w":
            if p.bias and p.oc % 16:
                scratch.book(_rnd_up(oc, 16) * 4)
            scratch.book(_rnd_up(oc, 16) * _rnd_up(ic, 16) * (conf.nthr_mb - 1) * 4)
            if conf.nthr_mb > 1:
                scratch.book(_BARRIER, _BARRIER)
            if p.bias:
                _reducer(scratch, conf.nthr, 16, _div_up(oc, 16), p.mb, conf.nthr * 3 * 5 * 5 * 16 * 16)
        elif p.bias and prop == "fwd" and oc != p.oc:
            scratch.book(oc * 4)
        if rtus:
            if nxc:
                scratch.book(conf.nthr * conf.is_ * p.ic * 4)
            else:
                factor = {"fwd": conf.nb_reduce, "bwd_d": conf.nb_load_blocking_max, "bwd_w": conf.nb_bcast_blocking}[prop]
                scratch.book(conf.nthr * factor * conf.is_ * 16 * 4)
        wei = _rnd_up(oc, 16) * _rnd_up(ic, 16) * p.dsz
        if nxc:
            return _Prim("jit_1x1:avx512_core", 0, wei, 0, scratch.size, src_fmt=p.data(p.ic, p.isp))
        src = p.data(ic, p.isp, 16)
        return _Prim("jit_1x1:avx512_core", src, wei, p.data(oc, p.osp, 16), scratch.size, src_fmt=src)

    return impl


# -- oneDNN: depthwise convolutions (jit_uni_dw_conv_kernel_utils) -------------------------


def _dw_geometry_ok(p: _Geo, any_ndims: bool = False) -> bool:
    return (any_ndims or p.ndims == 4) and p.g > 1 and p.ic == 1 and p.oc == 1


def _brdgmm_dw(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``brdgmm_dw_convolution_fwd_t``: depthwise forward in nhwc (taken for
    channels-last data, and for 3-d ones whatever the layout), groups padded to
    16 in the weights; no dilation; no scratchpad for f32."""
    if not cpu.avx512 or not _dw_geometry_ok(p, any_ndims=True) or p.d != (0, 0, 0):
        return None
    if not (nxc or p.ndims == 5):
        return None
    wei = _rnd_up(p.g, 16) * p.ks * p.dsz
    if nxc:
        return _Prim("brdgmm_dw:avx512_core", 0, wei, 0, 0)
    src = 0 if _nxc_is_plain(p, 1, p.isp) else p.data(1, p.isp)
    return _Prim(
        "brdgmm_dw:avx512_core", src, wei, p.data(1, p.osp), 0, nxc_result=not _nxc_is_plain(p, 1, p.osp),
    )


def _jit_dw_fwd(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_uni_dw_conv_fwd_kernel_t::init_conf``: nChw16c data and Goihw16g
    weights, groups padded to 16; a padded bias when groups are padded."""
    if nxc or not _dw_geometry_ok(p):
        return None
    simd = 16 if cpu.avx512 else 8
    e, pr = p.ext_k, p.pr
    if e[2] <= p.p[2] or e[2] <= pr[2] or e[1] <= p.p[1] or e[1] <= pr[1]:
        return None
    ur_w = min(6 if simd == 16 else 4, p.o[2])
    tail = p.o[2] % ur_w
    if p.p[2] > ur_w or max(0, _end_pad(p.p[2], p.o[2] - tail, p.i[2], p.s[2], e[2])) > ur_w:
        return None
    g = _rnd_up(p.g, simd)
    scratch = _Pad()
    if p.bias and g != p.g:
        scratch.book(g * 4)
    data = replace(p, g=g)
    name = "jit_dw:avx512_core" if simd == 16 else "jit_dw:avx2"
    return _Prim(name, data.data(1, p.isp), g * p.ks * p.dsz, data.data(1, p.osp), scratch.size)


def _jit_dw_bwd_d(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_uni_dw_conv_bwd_data_kernel_t::init_conf``: as forward, no
    dilation, no scratchpad."""
    if not _dw_geometry_ok(p) or p.d != (0, 0, 0):
        return None
    simd = 16 if cpu.avx512 else 8
    g = _rnd_up(p.g, simd)
    name = "jit_dw:avx512_core" if simd == 16 else "jit_dw:avx2"
    if nxc:
        return _Prim(name, 0, g * p.ks * p.dsz, 0, 0)
    data = replace(p, g=g)
    return _Prim(name, data.data(1, p.isp), g * p.ks * p.dsz, data.data(1, p.osp), 0)


def _jit_dw_bwd_w(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``jit_uni_dw_conv_bwd_weights_kernel_t::init_conf``: blocked layouts use
    the mb-reduction harness (``nthr_g = min(nb_ch, nthr)`` threads on groups,
    the rest on the minibatch, each extra one with its own weights and bias
    buffer); channels-last data the nxc harness (threads over channel blocks,
    images and rows, one reduction buffer per extra thread)."""
    if not _dw_geometry_ok(p) or p.d != (0, 0, 0):
        return None
    simd = 16 if cpu.avx512 else 8
    pr = tuple(max(0, x) for x in p.pr)
    max_h, max_w = p.k[1] // 2, p.k[2] // 2
    if not (p.k[2] <= 3 and p.s[2] <= p.k[2]):
        return None
    if not (
        p.p[1] <= max_h and pr[1] <= max_h and p.p[2] <= max_w and pr[2] <= max_w
        and p.i[1] >= p.k[1] + (-p.p[1]) % p.s[1]
        and (p.p[1] <= 1 or p.p[1] % p.s[1] == 0) and (pr[1] <= 1 or pr[1] % p.s[1] == 0)
    ):
        return None
    g = _rnd_up(p.g, simd)
    name = "jit_dw:avx512_core" if simd == 16 else "jit_dw:avx2"
    if nxc:
        # harness_nxc (partition_nthr_nxc): threads over channel blocks, images
        # and output rows; every thread but one reduces into its own buffer
        nb_ch = _div_up(p.g, simd)
        ch_outer = _div_up(nb_ch, min(nb_ch, min(4, 31 // (2 * p.k[2]))))
        threads = min(cpu.threads, ch_outer * p.mb * p.o[1])
        scratch = _Pad()
        if threads > 1:
            scratch.book(g * p.ks * (threads - 1) * 4, 4)
            if p.bias:
                scratch.book(p.g * (threads - 1) * 4, 4)
        return _Prim(name, 0, g * p.ks * p.dsz, 0, scratch.size)
    nthr_g = min(g // simd, cpu.threads)
    nthr_mb = min(max(1, cpu.threads // nthr_g), p.mb)
    scratch = _Pad()
    if nthr_mb > 1:
        scratch.book(g * p.ks * (nthr_mb - 1) * 4, 4)
        if p.bias:
            scratch.book(g * (nthr_mb - 1) * 4, 4)
    data = replace(p, g=g)
    return _Prim(name, data.data(1, p.isp), g * p.ks * p.dsz, data.data(1, p.osp), scratch.size)


# -- oneDNN: brgemm convolutions --------------------------------------------------------------


def _brg_bwd_strided(p: _Geo, cpu: CpuProfile, nxc: bool, simd: int = 16) -> _Prim | None:
    """``brgemm_convolution_bwd_strided_t`` (``brgemm_convolution_bwd_utils``):
    strided backward-data (and, through ``brg_deconv``, strided transposed
    convolutions) in nhwc, with per-thread brgemm batches (40-byte elements
    rounded to a page), per-thread copies of the output gradient padded by
    the kernel overflow (``inp_buffer``) and their masks, page aligned."""
    if p.s == (1, 1, 1) or p.d != (0, 0, 0) or (simd == 16 and not cpu.avx512):
        return None
    if p.g > 1 and p.oc <= simd:
        return None  # grouped convolutions with small oc
    uneven = p.i[2] % p.s[2] != 0
    e = p.ext_k
    pr = p.pr
    ovf_l = tuple(max(0, e[j] - 1 - p.p[j]) // p.s[j] for j in range(3))
    ovf_r = tuple(max(0, e[j] - 1 - pr[j]) // p.s[j] for j in range(3))
    ovf_r = (max(0, p.k[0] - 1 - pr[0]) // p.s[0], ovf_r[1], ovf_r[2])
    padded = [p.o[j] + ovf_l[j] + ovf_r[j] for j in range(3)]
    scratch = _Pad()
    batch = _div_up(_rnd_up(p.ks * _BATCH_ELEMENT, _P4K), _BATCH_ELEMENT) * _BATCH_ELEMENT
    scratch.book(cpu.threads * batch, _P4K)
    inp = _rnd_up(padded[0] * padded[1] * padded[2] * p.g * p.oc, _P4K)
    scratch.book(cpu.threads * inp * p.dsz, _P4K)
    scratch.book(cpu.threads * _P4K, _P4K)  # masks: one byte per block, rounded to a page
    if uneven:
        # out_buffer: one row block (iw_block <= iw rounded up to the stride)
        iw_block = _rnd_up(p.i[2], p.s[2])
        scratch.book(cpu.threads * _rnd_up(iw_block * p.s[2] * p.ic * p.g, _P4K) * p.dsz, _P4K)
    ic_block = _brg_ic_block(p, simd)
    wei = p.g * p.oc * _rnd_up(p.ic, ic_block) * p.ks * p.dsz
    src = p.data(p.ic, p.isp)
    plain_src = nxc or _nxc_is_plain(p, p.ic, p.isp)
    plain_dst = nxc or _nxc_is_plain(p, p.oc, p.osp)
    return _Prim(
        "brgconv_strided", 0 if nxc else src, wei, 0 if plain_dst else p.data(p.oc, p.osp),
        scratch.size, nxc_result=not plain_src, src_fmt=src,
    )


def _brg_ic_block(p: _Geo, simd: int) -> int:
    """The input-gradient channel block of the brgemm backward-data kernel
    (its weights are padded to it). ``fast_check_ic_block`` admits 48 only for
    a large output (and 48-divisible channels); among the rest the blocking
    search (``est_eff``) was seen to keep 48 when admitted, else the largest
    block up to 32 -- even when it pads, e.g. 48 channels to 64 (verified on
    avx512_core for 24..208 channels)."""
    rnd = _rnd_up(p.ic, simd)
    if simd == 16 and rnd % 48 == 0 and rnd <= 384 and p.osp > 81 * p.s[0] * p.s[1] * p.s[2]:
        return 48
    return min(32, simd * min(_div_up(p.ic, simd), 4))


def _brg_bwd_strided_avx2(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``brgemm_convolution_bwd_strided_t<avx2>`` (8-channel vectors), also
    reached on AVX512 by grouped convolutions with 9..16 output channels per
    group, which the avx512_core variant refuses."""
    prim = _brg_bwd_strided(p, cpu, nxc, simd=8)
    return replace(prim, name="brgconv_strided:avx2") if prim is not None else None


def _brg_fwd_nxc(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``brgemm_convolution_fwd_t`` / ``brgemm_1x1_convolution_fwd_t`` for
    channels-last f32 (oneDNN gives them only nhwc data for training): a page
    of brgemm batch elements per thread; weights in OIhw16i16o-like blocks
    padded to the output-channel block."""
    if not nxc or not cpu.avx512 or min(p.p) < 0:
        return None
    if p.g > 1 and p.ic <= 16:
        return None  # grouped convolutions with small ic, depthwise: perf heuristics
    scratch = _Pad()
    batch = _div_up(_rnd_up(p.ks * _BATCH_ELEMENT, _P4K), _BATCH_ELEMENT) * _BATCH_ELEMENT
    scratch.book(cpu.threads * batch, _P4K)
    oc_block = 64 if p.oc % 64 == 0 else 48 if p.oc % 48 == 0 else 32 if p.oc % 32 == 0 else 16
    wei = p.g * _rnd_up(p.oc, oc_block) * p.ic * p.ks * p.dsz
    return _Prim("brg_conv_fwd:avx512_core", 0, wei, 0, scratch.size)


def _brg_bwd_nxc(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``brgemm_convolution_bwd_t``: unit-stride channels-last backward-data,
    run as a forward brgemm convolution over the swapped problem (its
    scratchpad nested)."""
    if not nxc or p.s != (1, 1, 1):
        return None
    fwd = _brg_fwd_nxc(_swap(p), cpu, True)
    if fwd is None:
        return None
    scratch = _Pad()
    scratch.book(fwd.scratch)
    return _Prim("brg_conv_bwd:avx512_core", 0, fwd.wei, 0, scratch.size)


def _swap(p: _Geo) -> _Geo:
    """The problem with input and output exchanged (backward-data as forward)."""
    pl = tuple(e - 1 - x for e, x in zip(p.ext_k, p.p))
    return replace(p, ic=p.oc, oc=p.ic, i=p.o, o=p.i, p=pl)  # type: ignore[arg-type]


# -- oneDNN: gemm-based convolution (gemm_convolution_utils) --------------------------------


def _gemm_bwd_w(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``gemm_convolution_bwd_weights_t`` on plain (ncsp) layouts: with outer
    threading (small spatial, several images or groups) every thread gets
    im2col columns (``ic * ks * os`` floats, none for a 1x1 unit-stride
    unpadded convolution) and a weights accumulator, booked as
    ``book<float>(nthr * weights_d.size())`` -- that is, four times its bytes."""
    if nxc:
        return None
    os_ = p.o[1] * p.o[2]  # per output depth slice
    trivial = p.o == p.i and p.s == (1, 1, 1) and p.ks == 1
    im2col = 0 if trivial else p.ic * p.ks * os_
    wei_bytes = p.g * p.oc * p.ic * p.ks * 4
    outer = os_ // cpu.threads < 256 and (p.mb != 1 or p.g > 2)
    threads = cpu.threads if outer else 1
    scratch = _Pad()
    scratch.book(threads * wei_bytes * 4)
    scratch.book(threads * im2col * 4)
    return _Prim("gemm:jit", 0, wei_bytes, 0, scratch.size)


def _cdiv(a: int, b: int) -> int:
    """C integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _gemm_fwd_blocks(p: _Geo, cpu: CpuProfile) -> tuple[int, int]:
    """The ``(ic_block, os_block)`` search of ``gemm_convolution_utils::init_conf``
    for plain-layout forward convolutions (blocking applicable, outer threading)."""
    ic, oc, ks = p.ic, p.oc, p.ks
    os_ = p.o[1] * p.o[2]
    sh, sw = p.s[1], p.s[2]
    spatial = p.mb * p.g * p.o[0] * os_
    k_dim = ic * ks
    simd = cpu.simd
    l2 = cpu.l2 // 4
    im2col = not (p.o == p.i and p.s == (1, 1, 1) and ks == 1)
    best = {"eff": 0.0, "nthr_oc": 1, "ocb": 1, "osb": 1, "icb": ic}
    k_sum = _f32(8 + 1 + 1 + 1 + 1 + 1 + 0.5 + 1)

    def max_icb_of(ocb: int, osb: int, oc_per_thr: int, os_per_thr: int) -> int:
        block_out = ocb * osb
        inp_row = sh * sw * osb
        if im2col:
            col_row = ks * osb
            if osb >= os_per_thr:
                max_icb = l2 // (inp_row + col_row)
                if ocb < oc_per_thr:
                    max_icb = min(max_icb, _cdiv(l2 - block_out, col_row + ks * ocb))
            else:
                max_icb = _cdiv(l2 - block_out, inp_row + col_row + ks * oc_per_thr)
        else:
            max_icb = l2 // inp_row if osb >= os_per_thr else l2 // (inp_row + ks * oc_per_thr)
        if max_icb < ic and im2col:
            max_icb = _cdiv(l2 - block_out, inp_row + ks * osb + ks * oc_per_thr)
        return max_icb

    def try_cfg(nthr_oc: int, ocb: int, osb: int) -> None:
        max_oc = _div_up(oc, nthr_oc)
        min_oc = max(1, oc // nthr_oc)
        max_os = _div_up(spatial, cpu.threads // nthr_oc)
        ocb = max(8, min(max_oc, ocb))
        osb = max(simd, min(max_os, osb))
        min_os = _div_up(spatial, _div_up(cpu.threads, nthr_oc))
        if oc % nthr_oc > cpu.threads % nthr_oc:
            max_thr = max_oc * max_os
        else:
            max_thr = max(max_oc * min_os, min_oc * max_os)
        min_os2 = max(1, spatial // _div_up(cpu.threads, nthr_oc))
        if cpu.threads % nthr_oc > oc % nthr_oc:
            min_thr = min_oc * min_os2
        else:
            min_thr = min(max_oc * min_os2, min_oc * (spatial // (cpu.threads // nthr_oc)))
        thr_disb = _f32(min_thr / max_thr)
        oc_per_thr, os_per_thr = max_oc, max_os
        ocb = min(oc_per_thr, ocb)
        os_max = min(os_, os_per_thr)
        osb = min(os_max, osb)
        max_ic_block = max_icb_of(ocb, osb, oc_per_thr, os_per_thr)
        mac = 20 if max_ic_block < 1 else 1
        max_ic_block = max(1, max_ic_block)
        icb = max(1, ic // _div_up(ic, max_ic_block))
        nb_ic = _div_up(ic, icb)
        kb = icb * ks
        kb_al = _rnd_up(kb, simd)
        out_ops = mac * oc_per_thr * _rnd_up(os_per_thr, simd) * (1 if icb == ic else 2 * nb_ic - 1)
        osb_al = _rnd_up(osb, simd)
        inp_size = ic * _rnd_up(os_per_thr * sh * sw, simd)
        inp_ops = mac * ks * inp_size
        col_ops = 0
        if im2col:
            tail = _f32(osb_al / osb)
            col_ops = int(_f32(mac * _f32(_f32(ks * inp_size * tail) + _f32(ks * inp_size * tail))))
            if sw != 1:
                col_ops = int(_f32(col_ops * 8.0))
        wei_ops = mac * oc_per_thr * _rnd_up(k_dim, simd)
        mem_eff = _f32(_f32(_f32(_f32(os_per_thr / simd) * oc_per_thr) * k_dim) / (inp_ops + col_ops + wei_ops + out_ops))
        oc_disb = _f32(oc_per_thr / _rnd_up(oc_per_thr, ocb))
        os_disb = _f32(os_max / _rnd_up(os_max, osb))
        ic_disb = _f32(ic / _rnd_up(ic, icb))
        reg_disb = _f32(osb / _rnd_up(osb, 3 * simd))
        gemm_eff = _f32(_f32(_f32(osb * ocb) * kb) / _f32(_f32(oc_per_thr * os_per_thr) * k_dim))
        calc_eff = _f32(_f32(_f32(osb / simd) * ocb * kb) / (osb_al * kb + ocb * kb_al + ocb * osb_al))
        prod = _f32(_f32(thr_disb) ** 8)
        for f in (oc_disb, os_disb, ic_disb, reg_disb, mem_eff, _f32(gemm_eff ** 0.5), calc_eff):
            prod = _f32(prod * f)
        eff = _f32(prod ** _f32(1.0 / k_sum))
        if eff > best["eff"]:
            best.update(eff=eff, nthr_oc=nthr_oc, ocb=ocb, osb=osb, icb=icb)

    def explore(nthr_oc: int, ocb: int, osb: int) -> None:
        try_cfg(nthr_oc, ocb, osb)
        try_cfg(nthr_oc, ocb // 8 * 8, osb // 48 * 48)
        try_cfg(nthr_oc, _rnd_up(ocb, 8), osb // 48 * 48)
        try_cfg(nthr_oc, _rnd_up(ocb, 8), _rnd_up(osb, simd))
        try_cfg(nthr_oc, _rnd_up(ocb, 8), _rnd_up(osb, 48))

    for nthr_oc in range(1, cpu.threads + 1):
        max_oc_thr = _div_up(oc, nthr_oc)
        max_os_thr = _div_up(spatial, cpu.threads // nthr_oc)
        if im2col:
            try_cfg(nthr_oc, max_oc_thr, max_os_thr)
            if best["ocb"] == max_oc_thr and best["osb"] == max_os_thr and best["icb"] == ic:
                continue
            a_k = sh * sw + ks
            b_k = ks * max_oc_thr
            icb = ic
            ocb = max(8, min(max_oc_thr, _cdiv(l2 - a_k * icb * simd - b_k * icb, simd)))
            osb = max(simd, min(max_os_thr, _cdiv(l2 - b_k * icb, a_k * icb + ocb)))
            explore(nthr_oc, ocb, osb)
            icb_max = max(1, l2 // (2 * 8 * a_k + 2 * b_k))
            if icb_max < ic:
                icb = ic // max(1, ic // icb_max)
                osb = max(1, _cdiv(l2 - 2 * b_k * icb, 2 * icb * a_k))
                ocb = l2 // 2 // osb
                if ocb > max_oc_thr:
                    ocb = max_oc_thr
                    osb = max(simd, min(max_os_thr, _cdiv(l2 - b_k * icb, a_k * icb + ocb)))
                elif osb > max_os_thr:
                    osb = max_os_thr
                    ocb = max(8, min(max_oc_thr, _cdiv(l2 - a_k * icb * osb - b_k * icb, osb)))
                explore(nthr_oc, ocb, osb)
            ocb, icb = max_oc_thr, ic
            osb = max(simd, _cdiv(l2 - b_k * icb, a_k * icb + ocb) // simd * simd)
            explore(nthr_oc, ocb, osb)
        else:
            explore(nthr_oc, max_oc_thr, _cdiv(l2 - ks * ic, sh * sw * ic))
    return best["icb"], best["osb"]


def _gemm_fwd(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``gemm_convolution_fwd_t`` on plain layouts (the fallback when the jit
    kernels refuse: padding as large as the kernel, group widths that are not
    multiples of 4 or 8...): plain source and weights, a plain result, and
    per-thread im2col columns sized by the blocking search (``ic_block * ks *
    os_block`` floats) under outer threading, or all of them otherwise."""
    if nxc:
        return None
    os_ = p.o[1] * p.o[2]
    ks = p.ks
    im2col = 0 if (p.o == p.i and p.s == (1, 1, 1) and ks == 1) else p.ic * ks * os_
    simd = cpu.simd
    spatial = p.mb * p.g * p.o[0] * os_
    applicable = (
        p.ndims != 5
        and (not im2col or spatial >= cpu.threads * simd or os_ < p.mb * p.g * p.o[0]
             or (p.s[2] == 1 and p.ic * ks <= 0.05 * p.oc))
        and (im2col or (p.ic // p.oc < 42 and p.ic * p.oc * p.i[1] * p.i[2] < 1024))
    )
    if applicable:
        icb, osb = _gemm_fwd_blocks(p, cpu)
        outer = True
        if im2col:
            im2col = icb * ks * osb
    else:
        outer_work = p.g * p.mb * p.o[0]
        outer_eff = _f32(outer_work / _rnd_up(outer_work, cpu.threads))
        inner_work = _div_up(os_, simd) * _div_up(p.oc, simd)
        inner_eff = _f32(inner_work / _rnd_up(inner_work, cpu.threads))
        outer = (
            os_ // cpu.threads < 512 and (p.o[0] != 1 or p.mb != 1 or p.g > 2)
            and (_f32(outer_eff / inner_eff) >= 1.0 or os_ * p.ic * p.oc // cpu.threads < 64 * 1024)
        )
    scratch = _Pad()
    scratch.book((cpu.threads if outer else 1) * im2col * 4)
    return _Prim("gemm:jit", 0, 0, p.data(p.oc, p.osp), scratch.size)


def _gemm_bwd_d(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``gemm_convolution_bwd_data_t`` on plain layouts: per-thread im2col
    columns (``ic * ks * os`` floats) with outer threading."""
    if nxc:
        return None
    os_ = p.o[1] * p.o[2]
    is_ = p.i[1] * p.i[2]
    ks = p.ks
    im2col = 0 if (p.o == p.i and p.s == (1, 1, 1) and ks == 1) else p.ic * ks * os_
    simd = cpu.simd
    outer_work = p.g * p.mb
    outer_eff = _f32(outer_work / _rnd_up(outer_work, cpu.threads))
    inner_work = _div_up(is_, simd) * _div_up(p.ic, simd)
    inner_eff = _f32(inner_work / _rnd_up(inner_work, cpu.threads))
    outer = (
        (os_ // cpu.threads < 512 or ks < 64) and (p.mb != 1 or p.g > 2)
        and (_f32(outer_eff / inner_eff) >= 1.0 or is_ * p.ic * p.oc // cpu.threads < 64 * 1024)
    )
    scratch = _Pad()
    scratch.book((cpu.threads if outer else 1) * im2col * 4)
    src = p.data(p.ic, p.isp)
    return _Prim("gemm:jit", src, 0, 0, scratch.size, src_fmt=src)


def _gemm_nspc_fwd(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``gemm_convolution_fwd_t`` on channels-last data: hwio weights, per-thread
    im2col columns (blocked over output rows/columns when they fit the cache)
    and a per-thread transposed copy of the source (``key_conv_gemm_imtr``)."""
    if not nxc:
        return None
    ic, oc, ks = p.ic, p.oc, p.ks
    oh, ow = p.o[1], p.o[2]
    os_, is_ = oh * ow, p.i[1] * p.i[2]
    simd = cpu.simd
    trivial = p.o == p.i and p.s == (1, 1, 1) and ks == 1
    im2col = 0 if trivial else ic * ks * os_
    depthwise = ic == 1 and oc == 1 and p.g != 1
    l2 = cpu.l2 // 4
    outer = False
    if im2col and p.ndims != 5 and p.d[1] == p.d[2] == 0 and not depthwise and oc * ic * p.k[1] * p.k[2] < l2 // 2:
        row = (ic * ow * ks * 4 + 2 * (ic * p.i[2] + oc * ow) * 4) * 5 + oc * ow * 4 + ic * p.i[2] * 4
        h_block = max(1, min(_div_up(l2, row), oh))
        w_block = ow
        if h_block == 1:
            col = ic * ks * 4 + 2 * (ic + oc) * 4
            w_block = max(1, min(_div_up(l2, col), ow))
        if h_block != oh:
            h_block = max(1, h_block // 4 * 4)
        if w_block != ow:
            w_block = max(1, w_block // simd * simd)
        thr_eff = 0.0
        if w_block == ow:
            while True:
                work = p.g * p.mb * p.o[0] * _div_up(oh, h_block)
                disb = _f32(oh / _rnd_up(oh, h_block))
                thr_eff = _f32(_f32(_f32(work / _rnd_up(work, cpu.threads)) + disb) / 2)
                if thr_eff >= _f32(0.9):
                    break
                h_block = 0 if h_block < 4 else (h_block - 4) // 4 * 4
                if h_block <= 0:
                    break
        if thr_eff < _f32(0.9):
            h_block = 1
            while True:
                work = p.g * p.mb * oh * _div_up(ow, w_block)
                disb = _f32(ow / _rnd_up(ow, w_block))
                thr_eff = _f32(_f32(_f32(work / _rnd_up(work, cpu.threads)) + disb) / 2)
                if thr_eff > _f32(0.9):
                    break
                w_block = 0 if w_block < simd else (w_block - simd) // simd * simd
                if w_block <= 0:
                    break
        h_block, w_block = max(1, h_block), max(1, w_block)
        inner = _div_up(os_, simd) * _div_up(oc, simd)
        oh_block, ow_block = oh, ow
        if thr_eff >= _f32(_f32(inner / _rnd_up(inner, cpu.threads)) / 2):
            oh_block, ow_block, outer = h_block, w_block, True
        if oh_block != 1:
            ow_block = ow
        im2col = ic * ks * oh_block * ow_block
    if not outer and p.ndims != 5:
        outer_work = p.g * p.mb
        inner = _div_up(is_, simd) * _div_up(ic, simd)
        ratio = _f32(_f32(outer_work / _rnd_up(outer_work, cpu.threads)) / _f32(inner / _rnd_up(inner, cpu.threads)))
        outer = (depthwise or (is_ // cpu.threads < 64 and p.mb != 1)) and (
            ratio >= 1.0 or os_ * ic * oc // cpu.threads < 64 * 1024
        )
    threads = cpu.threads if outer else 1
    scratch = _Pad()
    scratch.book(threads * im2col * 4)
    scratch.book(threads * p.i[0] * is_ * ic * 4)
    return _Prim("gemm:jit", 0, _hwio_reorder(p), 0, scratch.size)


def _gemm_nspc_bwd_d(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``gemm_convolution_bwd_data_t`` on channels-last data: per-thread im2col
    columns and, for groups, per-thread accumulators of the input gradient."""
    if not nxc:
        return None
    ic, oc, ks = p.ic, p.oc, p.ks
    os_, is_ = p.o[1] * p.o[2], p.i[1] * p.i[2]
    simd = cpu.simd
    trivial = p.o == p.i and p.s == (1, 1, 1) and ks == 1
    im2col = 0 if trivial else ic * ks * os_ * p.o[0]
    depthwise = ic == 1 and oc == 1 and p.g != 1
    outer_work = p.g * p.mb
    inner = _div_up(is_, simd) * _div_up(ic, simd)
    ratio = _f32(_f32(outer_work / _rnd_up(outer_work, cpu.threads)) / _f32(inner / _rnd_up(inner, cpu.threads)))
    outer = p.ndims != 5 and (depthwise or (is_ // cpu.threads < 64 and p.mb != 1)) and (
        ratio >= 1.0 or is_ * ic * oc // cpu.threads < 64 * 1024
    )
    threads = cpu.threads if outer else 1
    scratch = _Pad()
    scratch.book(threads * im2col * 4)
    if p.g > 1:
        scratch.book(threads * is_ * p.i[0] * ic * 4)
    return _Prim("gemm:jit", 0, _hwio_reorder(p), 0, scratch.size, src_fmt=p.data(ic, p.isp))


def _gemm_nspc_bwd_w(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``gemm_convolution_bwd_weights_t`` on channels-last data: per-thread
    im2col columns, weight accumulators (``book<float>(nthr *
    weights_d.size())``) and transposed source copies, under outer threading."""
    if not nxc:
        return None
    ic, ks = p.ic, p.ks
    os_, is_ = p.o[1] * p.o[2], p.i[1] * p.i[2]
    trivial = p.o == p.i and p.s == (1, 1, 1) and ks == 1
    im2col = 0 if trivial else ic * ks * os_
    outer = os_ // cpu.threads < 256 and (p.mb != 1 or p.g > 2)
    threads = cpu.threads if outer else 1
    wei_bytes = p.g * p.oc * ic * ks * 4
    scratch = _Pad()
    scratch.book(threads * im2col * 4)
    scratch.book(threads * wei_bytes * 4)
    scratch.book(threads * p.i[0] * is_ * ic * 4)
    return _Prim("gemm:jit", 0, wei_bytes, 0, scratch.size, nxc_result=True)


def _hwio_reorder(p: _Geo) -> int:
    """Bytes of the weights reorder into hwio (hwigo): none when the caller's
    channels-last weights (ohwi) already have those strides, which happens
    only when one of the channel dimensions is 1."""
    same = p.g == 1 and (p.oc == 1 or p.ic == 1) and p.ks == 1
    return 0 if same else p.g * p.oc * p.ic * p.ks * p.dsz


# -- oneDNN: implementation lists (cpu_convolution_list.cpp, f32) ------------------------------

_FWD: Final = (_brdgmm_dw, _brg_fwd_nxc, _jit_dw_fwd, _jit_1x1("fwd"), _jit_fwd, _avx2_fwd, _gemm_fwd, _gemm_nspc_fwd)
_BWD_D: Final = (
    _brg_bwd_nxc, _brg_bwd_strided, _jit_dw_bwd_d, _jit_1x1("bwd_d"), _jit_bwd_d,
    _brg_bwd_strided_avx2, _avx2_bwd_d, _gemm_bwd_d, _gemm_nspc_bwd_d,
)
_BWD_W: Final = (_jit_dw_bwd_w, _jit_1x1("bwd_w"), _jit_bwd_w, _avx2_bwd_w, _gemm_bwd_w, _gemm_nspc_bwd_w)


@functools.lru_cache(maxsize=4096)
def _pick(impls: tuple[Any, ...], p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """The first implementation of the list that accepts the problem on ``cpu``
    (oneDNN's primitive descriptor iterator)."""
    for impl in impls:
        prim = impl(p, cpu, nxc)
        if prim is not None:
            return prim
    return None


def _deconv_fwd(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """oneDNN deconvolution forward (``p`` is the deconvolution: src its input,
    dst its output). ``brg_deconv`` (avx512_core, else avx2) runs a strided one
    whose output divides by the strides as the backward-data of the swapped
    convolution (``brgconv_strided``), and a unit-stride channels-last one as
    a brgemm forward convolution, scratchpad nested; otherwise
    ``ref_deconvolution_fwd_t`` runs the first backward-data implementation
    (``conv:any+``, scratchpad nested, plus an f32 copy of the convolution's
    result in its format to add a bias the convolution cannot add)."""
    conv = replace(p, ic=p.oc, oc=p.ic, i=p.o, o=p.i)
    even = all(i % s == 0 for i, s in zip(conv.i, conv.s))
    prim = None
    if p.s != (1, 1, 1) and even:
        prim = _brg_bwd_strided(conv, cpu, nxc) or _brg_bwd_strided(conv, cpu, nxc, simd=8)
        if prim is not None:
            prim = replace(prim, src=prim.dst, dst=prim.src)
    elif p.s == (1, 1, 1) and nxc:
        prim = _brg_fwd_nxc(_swap(conv), cpu, nxc)
    if prim is not None:
        scratch = _Pad()
        scratch.book(prim.scratch)
        return replace(prim, name="brg_deconv", scratch=scratch.size)
    prim = _pick(_BWD_D, conv, cpu, nxc)
    if prim is None:
        return None
    scratch = _Pad()
    scratch.book(prim.scratch)
    if p.bias:
        scratch.book(prim.src_fmt or prim.src)
    return replace(prim, name="conv:any+" + prim.name, src=prim.dst, dst=prim.src, scratch=scratch.size)


def _deconv_bwd_d(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``ref_deconvolution_bwd_data_t``: the forward of the swapped convolution
    (src: the output gradient, dst: the input gradient), scratchpad nested."""
    conv = replace(p, ic=p.oc, oc=p.ic, i=p.o, o=p.i, bias=False)
    prim = _pick(_FWD, conv, cpu, nxc)
    if prim is None:
        return None
    scratch = _Pad()
    scratch.book(prim.scratch)
    return replace(prim, name="conv:any+" + prim.name, scratch=scratch.size)


def _deconv_bwd_w(p: _Geo, cpu: CpuProfile, nxc: bool) -> _Prim | None:
    """``ref_deconvolution_bwd_weights_t``: backward-weights of the swapped
    convolution (src: the output gradient, diff_dst: the input), without
    bias (the deconvolution sums it itself), scratchpad nested."""
    conv = replace(p, ic=p.oc, oc=p.ic, i=p.o, o=p.i, bias=False)
    prim = _pick(_BWD_W, conv, cpu, nxc)
    if prim is None:
        return None
    scratch = _Pad()
    scratch.book(prim.scratch)
    return replace(prim, name="conv:any+" + prim.name, scratch=scratch.size)



# -- ATen: backend selection (Convolution.cpp) ---------------------------------------------


@dataclass(frozen=True)
class _Conv:
    """One ``aten.convolution`` call, normalised as ``_convolution`` does."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int
    #: The input is 3-d: ATen views it as 4-d after ``input.contiguous()``.
    conv1d: bool

    @property
    def dim(self) -> int:
        return len(self.stride)

    def weight_shape(self) -> tuple[int, ...]:
        w = tuple(self.weight.shape)
        return (w[0], w[1], 1, w[2]) if self.conv1d else w

    def input_shape(self) -> tuple[int, ...]:
        x = tuple(self.input.shape)
        return (x[0], x[1], 1, x[2]) if self.conv1d else x


def _expand(value: Sequence[int] | int, dim: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * dim
    value = tuple(int(v) for v in value)
    return value * dim if len(value) == 1 else value


def _conv(input: torch.Tensor, weight: torch.Tensor, bias: bool, args: Sequence[Any]) -> _Conv:
    stride, padding, dilation, transposed, output_padding, groups = args
    dim = weight.dim() - 2
    c = _Conv(
        input, weight, bias, _expand(stride, dim), _expand(padding, dim), _expand(dilation, dim),
        bool(transposed), _expand(output_padding, dim), int(groups), weight.dim() == 3,
    )
    if c.conv1d:  # ConvParams::view1d_as_2d
        c = replace(
            c, stride=(1, *c.stride), padding=(0, *c.padding), dilation=(1, *c.dilation),
            output_padding=(0, *c.output_padding),
        )
    return c


def _mkldnn_enabled() -> bool:
    return torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()


def _backend(c: _Conv, cpu: CpuProfile) -> str:
    """``_select_conv_backend`` for CPU tensors."""
    x, w = c.input_shape(), c.weight_shape()
    if x[0] == 0 or x[1] == 0:
        return "empty"
    dtype = c.input.dtype
    strided = any(s != 1 for s in c.stride)
    dilated = any(d != 1 for d in c.dilation)
    big_output_padding = any(op >= s for op, s in zip(c.output_padding, c.stride))
    mkldnn = False
    if _mkldnn_enabled() and not (c.transposed and big_output_padding):
        if dtype == torch.bfloat16 and onednn_supports(cpu, dtype):
            mkldnn = True
        elif dtype == torch.float32:
            mkldnn = (
                strided or dilated or x[0] >= 16 or w[-1] != 1 or w[-2] != 1 or cpu.threads > 1
            ) and (
                c.groups > 1 or (w[-1] > 3 and w[-2] > 3) or x[0] > 1
                or x[0] * x[1] * x[2] * x[3] > 20480
            )
    if mkldnn:
        return "mkldnn_transpose" if c.transposed else "mkldnn"
    nd = len(x)
    if not c.transposed and nd == 5 and not dilated:
        return "slow3d"
    if c.transposed:
        return "slow_transpose2d" if nd == 4 else "slow_transpose3d"
    if nd == 4:
        if dilated:
            return "slow_dilated2d"
        if _nnpack(c, x, w):
            return "nnpack"
        return "slow2d"
    return "slow_dilated3d"


def _nnpack(c: _Conv, x: tuple[int, ...], w: tuple[int, ...]) -> bool:
    """``ConvParams::use_nnpack`` (reached only when oneDNN is off)."""
    return (
        torch._C._get_nnpack_enabled() and torch._nnpack_available() and c.input.dtype == torch.float32
        and w[2] < 17 and w[3] < 17 and c.padding[0] < w[2] and c.padding[1] < w[3] and x[0] >= 16
    )


def _suggests_cl(t: torch.Tensor) -> bool:
    """``Tensor::suggest_memory_format()`` is channels-last (2-d or 3-d)."""
    if t.dim() not in (4, 5):
        return False
    fmt = torch._prims_common.suggest_memory_format(t)
    return fmt in (torch.channels_last, torch.channels_last_3d)


def _view4d_suggests_cl(t: torch.Tensor) -> bool:
    """``_suggests_cl`` of ``view4d(t.contiguous())``, the 4-d view ``_convolution``
    makes of a 1-d convolution's operands: ``unsqueeze(2)`` gives the new size-1
    dim the stride ``size[2] * stride[2]``, so a ``(N, 1, L)`` input whose channel
    stride is 1 suggests channels last."""
    shape = tuple(t.shape)
    strides = tuple(t.stride()) if t.is_contiguous() else (shape[1] * shape[2], shape[2], 1)
    shape4, strides4 = (shape[0], shape[1], 1, shape[2]), (strides[0], strides[1], shape[2] * strides[2], strides[2])
    return torch._prims_common.are_strides_like_channels_last_or_false(shape4, strides4)


def _channels_last(c: _Conv, backend: str) -> bool:
    """``determine_backend_memory_format``: channels-last for oneDNN when the
    input or the weight suggests it (never for float64), and for the slow 2-d
    paths (``thnn_conv_use_channels_last``); a 1-d convolution asks its 4-d views."""
    suggests = _view4d_suggests_cl if c.conv1d else _suggests_cl
    if backend.startswith("mkldnn"):
        return c.input.dtype != torch.float64 and (suggests(c.input) or suggests(c.weight))
    if backend in ("slow2d", "slow_dilated2d", "slow_transpose2d"):
        return (c.conv1d or c.input.dim() == 4) and (suggests(c.input) or suggests(c.weight))
    return False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _contiguous_copy(t: torch.Tensor, cl: bool) -> int:
    """Bytes ``t.contiguous(fmt)`` allocates (0 when ``t`` already is)."""
    if t.dim() == 4 and cl:
        fmt = torch.channels_last
    elif t.dim() == 5 and cl:
        fmt = torch.channels_last_3d
    else:
        fmt = torch.contiguous_format
    return 0 if t.is_contiguous(memory_format=fmt) else _nbytes(t)


def _geo(c: _Conv, out_spatial: Sequence[int], *, deconv: bool = False) -> _Geo:
    """The oneDNN problem of a convolution (for a transposed one: of the
    deconvolution, whose src is the input and dst the output)."""
    x, w = c.input_shape(), c.weight_shape()
    g = c.groups
    if deconv:
        ic, oc = x[1] // g, w[1]
    else:
        ic, oc = x[1] // g, w[0] // g
    nd = len(x)

    def three(v: Sequence[int], fill: int) -> tuple[int, int, int]:
        v = tuple(v)
        return (fill,) * (3 - len(v)) + v  # type: ignore[return-value]

    return _Geo(
        mb=x[0], g=g, ic=ic, oc=oc, i=three(x[2:], 1), o=three(out_spatial, 1), k=three(w[2:], 1),
        s=three(c.stride, 1), p=three(c.padding, 0), d=three([d - 1 for d in c.dilation], 0),
        ndims=nd, bias=c.bias, dsz=c.input.element_size(),
    )


# -- the steps of each backend -----------------------------------------------------------------


class _Steps:
    """A little builder for a rule's steps, with generated tags."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._n = 0

    def alloc(self, nbytes: int, name: str) -> str | None:
        if nbytes <= 0:
            return None
        self._n += 1
        tag = f"{name}#{self._n}"
        self.steps.append(Alloc(tag, nbytes))
        return tag

    def free(self, *tags: str | None) -> None:
        for tag in tags:
            if tag is not None:
                self.steps.append(Free(tag))

    def outputs(self) -> None:
        self.steps.append(OUTPUTS)

    def output(self, index: int, nbytes: int) -> None:
        """The op's output ``index`` is made here (when it has bytes)."""
        if nbytes > 0:
            self.steps.append(Output(index))


def _mkldnn_forward(s: _Steps, c: _Conv, cpu: CpuProfile, out: torch.Tensor) -> bool:
    """``mkldnn_convolution`` / ``mkldnn_convolution_transpose`` on float32;
    returns False when no implementation is modelled."""
    cl = _channels_last(c, "mkldnn")
    out_sp = tuple(out.shape[2:]) if not c.conv1d else (1, out.shape[2])
    p = _geo(c, out_sp, deconv=c.transposed)
    if p.dsz != 4:
        return False
    prim = _deconv_fwd(p, cpu, cl) if c.transposed else _pick(_FWD, p, cpu, cl)
    if prim is None:
        return False
    if cl:  # the output is allocated first and handed to oneDNN
        s.outputs()
    scratch = s.alloc(prim.scratch, "scratchpad")
    src = s.alloc(prim.src, "src reorder")
    wei = s.alloc(prim.wei, "weights reorder")
    dst = s.alloc(prim.dst, "dst")
    s.free(wei, src, scratch)
    if not cl:
        # mkldnn_to_dense: a dense tensor in the public form of oneDNN's
        # format; an nhwc one is then copied .contiguous() into the output
        first = s.alloc(_nbytes(out) if prim.nxc_result else 0, "dense nhwc")
        s.outputs()
        s.free(first, dst)
    return True


def _mkldnn_backward(
    s: _Steps, c: _Conv, cpu: CpuProfile, grad_output: torch.Tensor, mask: Sequence[bool], outs: Any
) -> bool:
    """``mkldnn_convolution_backward`` / ``..._transpose_backward`` on float32."""
    cl = _channels_last(c, "mkldnn")
    out_sp = tuple(grad_output.shape[2:]) if not c.conv1d else (1, grad_output.shape[2])
    p = _geo(c, out_sp, deconv=c.transposed)
    if p.dsz != 4:
        return False
    data = weights = None
    if mask[0]:
        data = _deconv_bwd_d(p, cpu, cl) if c.transposed else _pick(_BWD_D, p, cpu, cl)
        if data is None:
            return False
    if mask[1] or mask[2]:
        weights = _deconv_bwd_w(p, cpu, cl) if c.transposed else _pick(_BWD_W, p, cpu, cl)
        if weights is None:
            return False
    go_copy = s.alloc(_contiguous_copy(grad_output, cl), "grad_output contiguous")
    grad_input = _nbytes(outs[0]) if mask[0] and outs[0] is not None else 0
    if data is not None:
        if cl:
            s.output(0, grad_input)
        if c.transposed:  # forward of the swapped convolution: src is the output gradient
            go, wei, gi, scratch_b = data.src, data.wei, data.dst, data.scratch
            scratch = s.alloc(scratch_b, "scratchpad")
            go_t = s.alloc(go, "grad_output reorder")
            wei_t = s.alloc(wei, "weights reorder")
            gi_t = s.alloc(gi, "grad_input")
            s.free(wei_t, go_t, scratch)
        else:
            go_t = s.alloc(data.dst, "grad_output reorder")
            wei_t = s.alloc(data.wei, "weights reorder")
            gi_t = s.alloc(data.src, "grad_input")
            scratch = s.alloc(data.scratch, "scratchpad")
            s.free(scratch, wei_t, go_t)
        if not cl:
            if data.nxc_result:
                first = s.alloc(grad_input, "dense nhwc")
                s.output(0, grad_input)
                s.free(first)
            else:
                s.output(0, grad_input)
            s.free(gi_t)
    if weights is not None:
        go_t = s.alloc(weights.dst, "grad_output reorder")
        src_t = s.alloc(weights.src, "input reorder")
        gw_t = s.alloc(weights.wei, "grad_weight")
        scratch = s.alloc(weights.scratch, "scratchpad")
        gb_t = s.alloc(p.g * p.oc * p.dsz if mask[2] else 0, "grad_bias")
        s.free(scratch, src_t, go_t)
        gw_bytes = _nbytes(outs[1]) if mask[1] and outs[1] is not None else 0
        if cl:
            # mkldnn_to_dense(grad_w).to(channels_last); hwio weights are
            # first copied .contiguous() by mkldnn_to_dense
            dense = s.alloc(gw_bytes, "dense grad_weight")
            plain = s.alloc(gw_bytes if weights.nxc_result else 0, "contiguous grad_weight")
            s.free(dense if weights.nxc_result else None)
            s.outputs()
            s.free(plain if weights.nxc_result else dense)
        else:
            dense = s.alloc(gw_bytes if weights.nxc_result else 0, "dense grad_weight")
            s.outputs()
            s.free(dense)
        s.free(gw_t, gb_t)
    else:
        s.outputs()
    s.free(go_copy)
    return True


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass(frozen=True)
class _Slow:
    """One group of a slow-path convolution, as the nogroup kernels see it."""

    kind: str
    n: int
    c: int  # input channels (of this group)
    oc: int  # output channels (of this group)
    in_sp: int
    out_sp: int
    ks: int
    item: int
    unit: bool  # 1x1, unit stride, no padding (no im2col)
    channels_last: bool

    @property
    def columns(self) -> int:
        """im2col columns of all images (``thnn_conv2d``, ``slow_conv3d``)."""
        return 0 if self.unit else self.n * self.c * self.ks * self.out_sp * self.item


def _slow(c: _Conv, backend: str, out_spatial: Sequence[int]) -> _Slow:
    x, w = c.input_shape(), c.weight_shape()
    g = 1 if backend == "slow3d" else c.groups  # slow_conv3d handles groups itself
    oc = w[1] if c.transposed else w[0] // g
    unit = _prod(w[2:]) == 1 and all(v == 1 for v in c.stride) and all(v == 0 for v in c.padding)
    if c.transposed:
        unit = unit and all(v == 1 for v in c.dilation)
    if backend == "slow3d":
        unit = unit and c.groups == 1  # compute_columns3d views the input only without groups
    return _Slow(
        backend, x[0], x[1] // g, oc, _prod(x[2:]), _prod(out_spatial), _prod(w[2:]),
        c.input.element_size(), unit, _channels_last(c, backend),
    )


def _slow_forward_group(s: _Steps, k: _Slow, output: Any) -> Any:
    """The forward of one group; ``output()`` allocates the result (the op's
    outputs, or one group's result) and returns its tag."""
    if k.kind in ("slow2d", "slow3d"):
        # compute_columns2d / slow_conv3d: columns of every image, then the output
        cols = s.alloc(k.columns, "columns")
        tag = output()
        s.free(cols)
    elif k.kind in ("slow_dilated2d", "slow_dilated3d"):
        tag = output()
        cols = s.alloc(k.c * k.ks * k.out_sp * k.item, "columns")  # one image
        s.free(cols)
    else:  # slow_conv_transpose2d: columns of every image, even for 1x1
        tag = output()
        cols = s.alloc(k.n * k.oc * k.ks * k.in_sp * k.item, "columns")
        s.free(cols)
    return tag


def _slow_backward_group(s: _Steps, k: _Slow, mask: Sequence[bool], go_copy: int, output: Any) -> Any:
    """The backward of one group (``slow_conv2d_backward_cpu``,
    ``slow_conv3d_backward_cpu``, ``slow_conv_dilated*_backward_cpu``,
    ``slow_conv_transpose*_backward_cpu``); ``output(i)`` allocates gradient
    ``i`` and returns its tag. ``go_copy``: bytes of ``grad_output.contiguous()``."""
    tags: list[Any] = []
    if k.kind in ("slow_dilated2d", "slow_dilated3d"):
        go = s.alloc(go_copy, "grad_output contiguous")
        for i in range(3):
            if mask[i]:
                tags.append(output(i))
        cols = s.alloc(k.c * k.ks * k.out_sp * k.item, "columns")
        if mask[2]:  # grad_bias += grad_output_n.sum(dims), one image at a time
            s.free(s.alloc(k.oc * k.item, "bias sum"))
        s.free(cols, go)
        return tags
    if mask[0]:
        go = s.alloc(go_copy, "grad_output contiguous")
        tags.append(output(0))
        if k.kind == "slow3d":  # fgrad_input: always allocated
            s.free(s.alloc(k.n * k.c * k.ks * k.out_sp * k.item, "grad columns"))
        elif k.kind in ("slow_transpose2d", "slow_transpose3d"):
            s.free(s.alloc(0 if k.unit else k.oc * k.ks * k.in_sp * k.item, "grad columns"))
        # slow_conv2d: the input gradient's columns come from new[], not the allocator
        s.free(go)
    if mask[2]:
        tags.append(output(2))
    if mask[1]:
        tags.append(output(1))
        go = s.alloc(go_copy, "grad_output contiguous")
        if k.kind in ("slow_transpose2d", "slow_transpose3d"):
            cols = s.alloc(0 if k.unit else k.oc * k.ks * k.in_sp * k.item, "columns")
        else:
            cols = s.alloc(k.columns, "columns")
        s.free(cols, go)
    return tags


_SLOW: Final = frozenset(
    {"slow2d", "slow3d", "slow_dilated2d", "slow_dilated3d", "slow_transpose2d"}
)


def _subtensor_copy(t: torch.Tensor, groups: int) -> int:
    """Bytes of one group's ``subtensor(t, 1, groups, g)`` (``Convolution.cpp``):
    ``t.narrow(1, n * g, n).contiguous(t.suggest_memory_format())``, a copy unless
    the slice already is (one image of a contiguous tensor)."""
    fmt = torch.channels_last if _suggests_cl(t) else torch.contiguous_format
    if t.dim() == 5 and fmt == torch.channels_last:
        fmt = torch.channels_last_3d
    part = t.narrow(1, 0, t.shape[1] // groups)
    return 0 if part.is_contiguous(memory_format=fmt) else _nbytes(t) // groups


def _slow_forward(s: _Steps, c: _Conv, backend: str, out: torch.Tensor) -> None:
    """``_convolution`` on a slow path: ``input.contiguous(fmt)``, then per
    group (``subtensor``: a contiguous copy of the group's input channels) the
    nogroup kernel, and ``at::cat`` of the groups' results."""
    out_sp = tuple(out.shape[2:]) if not c.conv1d else (1, out.shape[2])
    k = _slow(c, backend, out_sp)
    x_copy = s.alloc(0 if c.conv1d else _contiguous_copy(c.input, k.channels_last), "input contiguous")
    w_copy = s.alloc(_contiguous_copy(c.weight, k.channels_last), "weight contiguous")
    if c.groups == 1 or backend == "slow3d":
        _slow_forward_group(s, k, s.outputs)
    else:
        group_out = _nbytes(out) // c.groups
        per_group_in = 0 if k.n == 1 else _nbytes(c.input) // c.groups
        results = []
        for _ in range(c.groups):
            x_g = s.alloc(per_group_in, "input group")
            results.append(_slow_forward_group(s, k, lambda: s.alloc(group_out, "group output")))
            s.free(x_g)
        s.outputs()
        s.free(*results)
    s.free(w_copy, x_copy)


def _slow_backward(s: _Steps, c: _Conv, backend: str, grad_output: torch.Tensor, mask: Sequence[bool], outs: Any) -> None:
    """``convolution_backward`` on a slow path, per group like the forward
    (copies of the group's output gradient and input), gradients concatenated."""
    out_sp = tuple(grad_output.shape[2:]) if not c.conv1d else (1, grad_output.shape[2])
    k = _slow(c, backend, out_sp)
    x_copy = s.alloc(0 if c.conv1d else _contiguous_copy(c.input, k.channels_last), "input contiguous")
    w_copy = s.alloc(_contiguous_copy(c.weight, k.channels_last), "weight contiguous")
    sizes = [_nbytes(o) if o is not None else 0 for o in outs]
    if c.groups == 1 or backend == "slow3d":

        def output(i: int) -> Any:
            s.output(i, sizes[i])  # the gradients, in the kernel's order

        go_copy = _contiguous_copy(grad_output, k.channels_last)
        _slow_backward_group(s, k, mask, go_copy, output)
        s.outputs()
    else:
        g = c.groups
        go_g = _subtensor_copy(grad_output, g)
        x_g_bytes = 0 if k.n == 1 else _nbytes(c.input) // g
        per: list[list[Any]] = [[], [], []]
        for _ in range(g):
            gog = s.alloc(go_g, "grad_output group")
            x_g = s.alloc(x_g_bytes, "input group")

            def output(i: int) -> Any:
                tag = s.alloc(sizes[i] // g, "group gradient")
                per[i].append(tag)
                return tag

            _slow_backward_group(s, k, mask, 0, output)
            s.free(x_g, gog)
        s.outputs()
        s.free(*per[2], *per[1], *per[0])
    s.free(w_copy, x_copy)


def _convolution_steps(call: OpCall) -> list[Step] | None:
    input, weight, bias = call.args[0], call.args[1], call.args[2]
    c = _conv(input, weight, bias is not None, call.args[3:9])
    cpu = profile_of(call)
    backend = _backend(c, cpu)
    s = _Steps()
    one_d = s.alloc(_contiguous_copy(input, False) if c.conv1d else 0, "input contiguous")
    if backend.startswith("mkldnn"):
        cl = _channels_last(c, backend)
        x_copy = s.alloc(0 if c.conv1d else _contiguous_copy(input, cl), "input contiguous")
        w_copy = s.alloc(_contiguous_copy(weight, cl), "weight contiguous")
        if input.dtype != torch.float32 or not _mkldnn_forward(s, c, cpu, call.out):
            return None
        s.free(w_copy, x_copy)
    elif backend in _SLOW:
        _slow_forward(s, c, backend, call.out)
    else:
        return None
    s.free(one_d)
    return s.steps


def _convolution_backward_steps(call: OpCall) -> list[Step] | None:
    grad_output, input, weight = call.args[0], call.args[1], call.args[2]
    mask = call.args[10]
    c = _conv(input, weight, bool(mask[2]), call.args[4:10])
    cpu = profile_of(call)
    backend = _backend(c, cpu)
    s = _Steps()
    one_d = s.alloc(_contiguous_copy(input, False) if c.conv1d else 0, "input contiguous")
    if backend.startswith("mkldnn"):
        cl = _channels_last(c, backend)
        x_copy = s.alloc(0 if c.conv1d else _contiguous_copy(input, cl), "input contiguous")
        w_copy = s.alloc(_contiguous_copy(weight, cl), "weight contiguous")
        if input.dtype != torch.float32 or not _mkldnn_backward(s, c, cpu, grad_output, mask, call.out):
            return None
        s.free(w_copy, x_copy)
    elif backend in _SLOW:
        _slow_backward(s, c, backend, grad_output, mask, call.out)
    else:
        return None
    s.free(one_d)
    return s.steps


def _steps_or_default(steps: list[Step] | None) -> list[Step]:
    return steps if steps is not None else [OUTPUTS]


_LOW_PRECISION_GAP: Final = Inexact(
    "the scratch of oneDNN's bfloat16/float16 convolution kernels is not modelled; "
    "only the outputs are counted"
)


def _flag_low_precision(call: OpCall, steps: list[Step]) -> list[Step]:
    if call.args[0].dtype in (torch.bfloat16, torch.float16):
        return [_LOW_PRECISION_GAP, *steps]
    return steps


@CPU.scratch(aten.convolution.default)
def _convolution(call: OpCall) -> list[Step]:
    """``at::_convolution`` on the CPU: oneDNN's reorders, result buffer and
    scratchpad (``mkldnn_convolution``), or the slow paths' im2col columns."""
    return _flag_low_precision(call, _steps_or_default(_convolution_steps(call)))


@CPU.scratch(aten.convolution_backward.default)
def _convolution_backward(call: OpCall) -> list[Step]:
    """``at::convolution_backward`` on the CPU: the contiguous output
    gradient, oneDNN's backward-data then backward-weights primitives (each
    with its reorders, result buffers and scratchpad), or the slow paths'
    columns."""
    return _flag_low_precision(call, _steps_or_default(_convolution_backward_steps(call)))
