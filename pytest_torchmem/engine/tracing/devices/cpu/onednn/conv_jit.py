"""oneDNN's direct jit convolutions: ``jit_avx512_common_conv_kernel``,
``jit_avx2_conv_kernel_f32`` and ``jit_sse41_conv_kernel_f32``."""

from __future__ import annotations

from typing import Final

from pytest_torchmem.engine.tracing.devices.cpu.onednn.common import (
    BARRIER,
    Geo,
    Pad,
    Prim,
    book_reducer,
    div_up,
    end_pad,
    least_memory,
    rnd_up,
)
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile


def avx512_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
    ic = p.ic if first or not pad else rnd_up(p.ic, 16)
    oc = rnd_up(p.oc, 16) if pad else p.oc
    if not nxc and (oc % simd or (not first and ic % simd)):
        return None
    ur_w = min(p.o[2], 28)
    tail = p.o[2] % ur_w
    if p.p[2] > ur_w or max(0, end_pad(p.p[2], p.o[2] - tail, p.i[2], p.s[2], e[2])) > ur_w:
        return None
    scratch = Pad()
    if p.bias and oc != p.oc:
        scratch.book(p.g * oc * p.dsz)
    wei = p.g * rnd_up(oc, simd) * (ic if first else rnd_up(ic, simd)) * p.ks * p.dsz
    if nxc:
        return Prim("jit:avx512_core", 0, wei, 0, scratch.size)
    src = 0 if first else p.data(ic, p.isp, simd)
    return Prim("jit:avx512_core", src, wei, p.data(oc, p.osp, simd), scratch.size)


def _ur_w_fits(p: Geo, ur_w: int, regs: int) -> bool:
    """The width unroll of the avx2/sse41 forward kernels (``init_conf``): the left
    padding within one unroll, and a right padding beyond one unroll handled by a
    larger one (``r_pad_no_tail``), if the registers allow it."""
    e = p.ext_k
    ur_w = min(ur_w, p.o[2])
    if p.p[2] > ur_w:
        return False
    if p.k[2] > 7 and not ((p.p[1] == 0 and p.p[2] == 0) or (p.s[1] == 1 and p.s[2] == 1)):
        return False
    tail = p.o[2] % ur_w
    r_pad = max(0, end_pad(p.p[2], p.o[2] - tail, p.i[2], p.s[2], e[2]))
    if r_pad > ur_w * p.s[2] and p.o[2] // ur_w > 1:
        ur_w = min(r_pad // p.s[2] + tail, min(p.o[2], regs // 2))
        tail = p.o[2] % ur_w
        r_pad = max(0, end_pad(p.p[2], p.o[2] - tail, p.i[2], p.s[2], e[2]))
        if ur_w < max(p.p[2], r_pad):
            return False
    return True


def _outside(p: Geo) -> bool:
    """``kernel_outside_src``: a padding as large as the (dilated) kernel."""
    return any(ek <= pl or ek <= r for ek, pl, r in zip(p.ext_k, p.p, p.pr))


def avx2_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``jit_avx2_conv_fwd_kernel_f32_t::init_conf`` (AVX or better): nCx8c data
    and OIx8i8o weights, channels padded to 8 with one group; a flat source
    (fewer than 8 channels in all) stays nchw with Oxi8o weights; channels-last
    data in place (weights padded to their blocks). Scratchpad: the padded bias."""
    if not cpu.avx2 or _outside(p):
        return None
    flat = p.ic < 8
    if flat and p.g * p.ic >= 8:
        return None  # the pd picks blocked formats from the total channels, the kernel wants flat
    pad = p.g == 1 and not nxc
    ic = rnd_up(p.ic, 8) if pad and not flat else p.ic
    oc = rnd_up(p.oc, 8) if pad else p.oc
    if not nxc and (oc % 8 or (not flat and ic % 8)):
        return None
    if not _ur_w_fits(p, 3, 15):
        return None
    scratch = Pad()
    if p.bias and oc != p.oc:
        scratch.book(oc * p.dsz)
    wei = p.g * rnd_up(oc, 8) * (ic if flat else rnd_up(ic, 8)) * p.ks * p.dsz
    if nxc:
        return Prim("jit:avx2", 0, wei, 0, scratch.size, src_fmt=p.data(p.ic, p.isp))
    src = 0 if flat else p.data(ic, p.isp, 8)
    return Prim("jit:avx2", src, wei, p.data(oc, p.osp, 8), scratch.size)


def sse41_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``jit_sse41_conv_fwd_kernel_f32_t::init_conf`` (1-d and 2-d): nCx8c data and
    OIx8i8o weights, nothing padded (channels a multiple of 8); a flat source
    (3 channels in all) stays nchw with Oxi8o weights; channels-last data in
    place. No scratchpad."""
    if p.ndims != 4 or _outside(p):
        return None
    flat = p.ic == 3
    if flat and p.g * p.ic != 3:
        return None
    if p.oc % 8 or (not flat and p.ic % 8):
        return None
    if not _ur_w_fits(p, 3, 15):
        return None
    wei = p.g * p.oc * p.ic * p.ks * p.dsz
    if nxc:
        return Prim("jit:sse41", 0, wei, 0, 0, src_fmt=p.data(p.ic, p.isp))
    src = 0 if flat else p.data(p.ic, p.isp, 8)
    return Prim("jit:sse41", src, wei, p.data(p.oc, p.osp, 8), 0)


def avx512_bwd_d(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
    ic = rnd_up(p.ic, 16) if pad else p.ic
    oc = rnd_up(p.oc, 16) if pad else p.oc
    wei = p.g * rnd_up(oc, simd) * rnd_up(ic, simd) * p.ks * p.dsz
    if nxc:
        return Prim("jit:avx512_core", 0, wei, 0, 0, src_fmt=p.data(p.ic, p.isp))
    src = p.data(ic, p.isp, simd)
    return Prim("jit:avx512_core", src, wei, p.data(oc, p.osp, simd), 0, src_fmt=src)


def avx2_bwd_d(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``jit_avx2_conv_bwd_data_kernel_f32_t::init_conf``: nCx8c data with the
    channels padded to 8 with one group (channels-last data in place), OIx8o8i
    weights padded to their blocks, equal height and width strides, a width
    unroll and input-channel blocking that fit 15 registers; no scratchpad."""
    if not cpu.avx2 or p.s[1] != p.s[2] or p.s[0] != 1:
        return None
    if (p.d[2] and p.s[2] != 1) or (p.d[1] and p.s[1] != 1):
        return None
    if p.ic < 8 and p.k[2] > 3 and p.s[2] > 1:
        return None  # "gemm-based convolution performs better"
    if _outside(p):
        return None
    pad = p.g == 1 and not nxc
    ic = rnd_up(p.ic, 8) if pad else p.ic
    oc = rnd_up(p.oc, 8) if pad else p.oc
    if not nxc and (ic % 8 or oc % 8):
        return None
    if not _avx2_bwd_d_blocking(p, div_up(ic, 8)):
        return None
    wei = p.g * rnd_up(oc, 8) * rnd_up(ic, 8) * p.ks * p.dsz
    if nxc:
        return Prim("jit:avx2", 0, wei, 0, 0, src_fmt=p.data(p.ic, p.isp))
    return Prim("jit:avx2", p.data(ic, p.isp, 8), wei, p.data(oc, p.osp, 8), 0)


def _avx2_bwd_d_blocking(p: Geo, nb_ic: int) -> bool:
    """The search for the width unroll and input-channel blocking with the most
    FMAs (``ur_w * nb_ic_blocking + ur_w / stride_w <= 15`` registers), then the
    overflow and tail checks of the backward-data kernel."""
    sw, iw = p.s[2], p.i[2]
    e = p.ext_k[2]
    if sw + 1 > 15:
        return False
    l_overflow = max(0, (e - 1 - p.p[2]) // sw)
    best, ur_w = 0, 1
    for b in range(1, 5):
        if nb_ic % b:
            continue
        u = sw
        while u * b + u // sw <= 15 and u < iw + sw:
            ur = min(u, iw)
            if not (l_overflow * sw > ur and ur != iw):
                nfmas = div_up(ur, sw) * b
                if nfmas > best or (nfmas == best and ur_w < ur):
                    best, ur_w = nfmas, ur
            u += sw
    if best == 0:
        return False
    tail = iw % ur_w
    r_pad = p.pr[2]
    numerator = e - 1 - r_pad - tail
    r_overflow = max(0, int(numerator / sw))  # C division
    if r_overflow * sw > ur_w:
        return False
    return not (iw > ur_w and (ur_w % sw or r_pad + tail < 0))


_MIN_OH_REDUCE: Final = 9


def avx512_bwd_w(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
    oc = rnd_up(p.oc, 16) if pad else p.oc
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
        ic = rnd_up(p.ic, 16) if pad else p.ic
        if not nxc and ic % 16:
            return None
    harness = "3d" if p.ndims == 5 else "mb"
    if p.d[1] == 0 and p.ndims == 4 and p.o[1] > _MIN_OH_REDUCE and not hw_transp and not nxc:
        harness = "2d"
    nb_ic, nb_oc = div_up(ic, ic_block), div_up(oc, 16)
    threads, nthr_mb = _jit_bwd_w_balance(p, cpu.threads, harness, hw_transp, ic_block, nb_ic, nb_oc)
    scratch = Pad()
    if nthr_mb > 1:
        wei = p.g * rnd_up(oc, 16) * rnd_up(ic, ic_block) * p.ks
        scratch.book((wei + p.g * rnd_up(oc, 16)) * (nthr_mb - 1) * 4)
        scratch.book(BARRIER, BARRIER)
    if p.bias and p.oc % 16:
        scratch.book(p.g * rnd_up(oc, 16) * 4)
    if p.bias:
        book_reducer(scratch, threads, 16, p.g * nb_oc, p.mb, threads * 3 * 5 * 5 * 16 * 16)
    src = 0 if first or nxc else p.data(ic, p.isp, 16)  # a first convolution reads nchw
    dst = 0 if nxc else p.data(oc, p.osp, 16)
    wei_b = p.g * rnd_up(oc, 16) * rnd_up(ic, ic_block) * p.ks * p.dsz
    return Prim("jit:avx512_core", src, wei_b, dst, scratch.size)


def _jit_bwd_w_balance(
    p: Geo, nthreads: int, harness: str, hw_transp: bool, ic_block: int, nb_ic: int, nb_oc: int
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
            div_up(p.mb * ih_red, nmb) * div_up(nb_ic, nic) * ic_block * ih_no * iw * p.i[0]
            // p.s[0] // p.s[1] // p.s[2]
            + div_up(p.mb * oh_red, nmb) * div_up(nb_oc, noc) * 16 * oh_no * ow * p.o[0]
            + 8 * div_up(nb_oc, noc) * div_up(nb_ic, nic) * p.ks * ic_block * 16
        )

    def comp(nmb: int, noc: int, nic: int) -> int:
        return div_up(p.mb * oh_red, nmb) * div_up(nb_oc, noc) * div_up(nb_ic, nic)

    splits = [
        (nmb, noc, min(nthr // nmb // noc, nb_ic))
        for nmb in range(1, min(nthr, p.mb * p.o[0] * nthr_oh_reduce) + 1)
        for noc in range(1, min(nthr // nmb, nb_oc) + 1)
    ]
    best, best_mem = least_memory(splits, mem)
    best_comp = comp(*best)
    for split in splits:
        c = comp(*split)
        if (c <= best_comp and (hw_transp or mem(*split) < 1.1 * best_mem)) or 4 * c <= 3 * best_comp:
            best_comp, best = c, split
    nmb, noc, nic = best
    if nthreads // 2 < nmb < nthreads:
        nmb = min(p.mb * p.o[0] * nthr_oh_reduce, nthreads)
    return nmb * p.g * noc * nic, nmb


def avx2_bwd_w(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``jit_avx2_conv_bwd_weights_kernel_f32_t::init_conf`` (also taken on
    AVX512 when the avx512 kernel refuses, e.g. 4..15 input channels): 8-channel
    blocks (a flat nchw source when ic == 3), channels padded to 8 with one
    group, channels-last data in place (weights padded to their blocks); a
    padded bias; weights and bias gradients of the threads sharing a group of
    jobs go through ``cpu_reducer_t``."""
    if not cpu.avx2 or p.d != (0, 0, 0):
        return None
    e = p.ext_k
    pr = tuple(max(0, x) for x in p.pr)
    if not (p.p[1] < e[1] and pr[1] < e[1] and p.p[2] < e[2] and pr[2] < e[2] and p.p[0] == 0 and pr[0] == 0):
        return None
    flat = p.ic == 3
    if flat and p.g > 1:
        return None  # the pd picks blocked formats from the total channels, the kernel wants flat
    pad = p.g == 1 and not nxc
    oc = rnd_up(p.oc, 8) if pad else p.oc
    ic = rnd_up(p.ic, 8) if pad and not flat else p.ic
    if not nxc and (oc % 8 or (not flat and ic % 8)):
        return None
    if not (p.k[2] < 14 and p.k[1] <= p.i[1] and p.p[1] < p.k[1] and p.k[0] <= p.i[0]):
        return None
    ic_block = ic if flat else 8
    nb_ic, nb_oc = div_up(ic, ic_block), div_up(oc, 8)
    scratch = Pad()
    if p.bias and p.oc % 8:
        scratch.book(p.g * rnd_up(oc, 8) * 4)
    if p.bias:
        book_reducer(scratch, cpu.threads, 8, p.g * nb_oc, p.mb, 1 << 21)
    book_reducer(scratch, cpu.threads, p.ks * ic_block * 8, p.g * nb_ic * nb_oc, p.mb * p.o[0], 1 << 21)
    wei = p.g * rnd_up(oc, 8) * (ic if flat else rnd_up(ic, 8)) * p.ks * p.dsz
    if nxc:
        return Prim("jit:avx2", 0, wei, 0, scratch.size)
    src = 0 if flat else p.data(ic, p.isp, 8)
    return Prim("jit:avx2", src, wei, p.data(oc, p.osp, 8), scratch.size)
