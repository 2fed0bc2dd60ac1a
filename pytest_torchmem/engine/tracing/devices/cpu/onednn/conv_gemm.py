"""oneDNN's gemm-based convolutions (``gemm_convolution_utils``): im2col columns
and per-thread buffers around an sgemm, on plain and channels-last layouts.

Every direction refuses a scratchpad above ``scratchpad_limit`` (:func:`_limit`),
and oneDNN then runs its reference convolution (``conv_ref``); backward-data and
backward-weights first shrink the columns to a block of output rows that fits.
"""

from __future__ import annotations

from pytest_torchmem.engine.tracing.devices.cpu.onednn.common import (
    Geo,
    Pad,
    Prim,
    cdiv,
    div_up,
    f32,
    rnd_up,
)
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile


def _limit(p: Geo, cpu: CpuProfile) -> int:
    """``scratchpad_limit``: 1 GiB, or 15 times the source, weights and destination
    bytes per thread if less."""
    src = p.mb * p.g * p.ic * p.isp * 4
    dst = p.mb * p.g * p.oc * p.osp * 4
    wei = p.g * p.oc * p.ic * p.ks * 4
    return min(1 << 30, 15 * cpu.threads * (src + wei + dst))


def _fitted_columns(p: Geo, cpu: CpuProfile, pad: Pad, threads: int, im2col: int, coef: float) -> int:
    """The columns of a backward pass once they fit what the limit leaves: when
    ``threads * im2col`` floats do not, ``os_block`` becomes ``max(simd_w, coef *
    max_os_block)`` rows of ``ic * ks`` (``coef``: 0.1 backward-data, 0.05
    backward-weights, C floats)."""
    available = _limit(p, cpu) - pad.size
    if im2col == 0 or available >= threads * im2col * 4:
        return im2col
    per_row = p.ic * p.ks
    max_os_block = available // (4 * threads * per_row)
    os_block = max(cpu.simd, int(f32(f32(max_os_block) * f32(coef))))
    return per_row * os_block


def gemm_bwd_w(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
    limit = _limit(p, cpu)
    thr_mem = 4 * cpu.threads * wei_bytes + 4 * cpu.threads * p.ic * p.ks * cpu.simd
    outer = thr_mem < limit and os_ // cpu.threads < 256 and (p.mb != 1 or p.g > 2)
    threads = cpu.threads if outer else 1
    scratch = Pad()
    scratch.book(threads * wei_bytes * 4)
    if scratch.size > limit:
        return None
    scratch.book(threads * _fitted_columns(p, cpu, scratch, threads, im2col, 0.05) * 4)
    if scratch.size > limit:
        return None
    return Prim("gemm:jit", 0, wei_bytes, 0, scratch.size)


def _gemm_fwd_blocks(p: Geo, cpu: CpuProfile) -> tuple[int, int]:
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
    k_sum = f32(8 + 1 + 1 + 1 + 1 + 1 + 0.5 + 1)

    def max_icb_of(ocb: int, osb: int, oc_per_thr: int, os_per_thr: int) -> int:
        block_out = ocb * osb
        inp_row = sh * sw * osb
        if im2col:
            col_row = ks * osb
            if osb >= os_per_thr:
                max_icb = l2 // (inp_row + col_row)
                if ocb < oc_per_thr:
                    max_icb = min(max_icb, cdiv(l2 - block_out, col_row + ks * ocb))
            else:
                max_icb = cdiv(l2 - block_out, inp_row + col_row + ks * oc_per_thr)
        else:
            max_icb = l2 // inp_row if osb >= os_per_thr else l2 // (inp_row + ks * oc_per_thr)
        if max_icb < ic and im2col:
            max_icb = cdiv(l2 - block_out, inp_row + ks * osb + ks * oc_per_thr)
        return max_icb

    def try_cfg(nthr_oc: int, ocb: int, osb: int) -> None:
        max_oc = div_up(oc, nthr_oc)
        min_oc = max(1, oc // nthr_oc)
        max_os = div_up(spatial, cpu.threads // nthr_oc)
        ocb = max(8, min(max_oc, ocb))
        osb = max(simd, min(max_os, osb))
        min_os = div_up(spatial, div_up(cpu.threads, nthr_oc))
        if oc % nthr_oc > cpu.threads % nthr_oc:
            max_thr = max_oc * max_os
        else:
            max_thr = max(max_oc * min_os, min_oc * max_os)
        min_os2 = max(1, spatial // div_up(cpu.threads, nthr_oc))
        if cpu.threads % nthr_oc > oc % nthr_oc:
            min_thr = min_oc * min_os2
        else:
            min_thr = min(max_oc * min_os2, min_oc * (spatial // (cpu.threads // nthr_oc)))
        thr_disb = f32(min_thr / max_thr)
        oc_per_thr, os_per_thr = max_oc, max_os
        ocb = min(oc_per_thr, ocb)
        os_max = min(os_, os_per_thr)
        osb = min(os_max, osb)
        max_ic_block = max_icb_of(ocb, osb, oc_per_thr, os_per_thr)
        mac = 20 if max_ic_block < 1 else 1
        max_ic_block = max(1, max_ic_block)
        icb = max(1, ic // div_up(ic, max_ic_block))
        nb_ic = div_up(ic, icb)
        kb = icb * ks
        kb_al = rnd_up(kb, simd)
        out_ops = mac * oc_per_thr * rnd_up(os_per_thr, simd) * (1 if icb == ic else 2 * nb_ic - 1)
        osb_al = rnd_up(osb, simd)
        inp_size = ic * rnd_up(os_per_thr * sh * sw, simd)
        inp_ops = mac * ks * inp_size
        col_ops = 0
        if im2col:
            tail = f32(osb_al / osb)
            col_ops = int(f32(mac * f32(f32(ks * inp_size * tail) + f32(ks * inp_size * tail))))
            if sw != 1:
                col_ops = int(f32(col_ops * 8.0))
        wei_ops = mac * oc_per_thr * rnd_up(k_dim, simd)
        mem_eff = f32(f32(f32(f32(os_per_thr / simd) * oc_per_thr) * k_dim) / (inp_ops + col_ops + wei_ops + out_ops))
        oc_disb = f32(oc_per_thr / rnd_up(oc_per_thr, ocb))
        os_disb = f32(os_max / rnd_up(os_max, osb))
        ic_disb = f32(ic / rnd_up(ic, icb))
        reg_disb = f32(osb / rnd_up(osb, 3 * simd))
        gemm_eff = f32(f32(f32(osb * ocb) * kb) / f32(f32(oc_per_thr * os_per_thr) * k_dim))
        calc_eff = f32(f32(f32(osb / simd) * ocb * kb) / (osb_al * kb + ocb * kb_al + ocb * osb_al))
        prod = f32(f32(thr_disb) ** 8)
        for f in (oc_disb, os_disb, ic_disb, reg_disb, mem_eff, f32(gemm_eff ** 0.5), calc_eff):
            prod = f32(prod * f)
        eff = f32(prod ** f32(1.0 / k_sum))
        if eff > best["eff"]:
            best.update(eff=eff, nthr_oc=nthr_oc, ocb=ocb, osb=osb, icb=icb)

    def explore(nthr_oc: int, ocb: int, osb: int) -> None:
        try_cfg(nthr_oc, ocb, osb)
        try_cfg(nthr_oc, ocb // 8 * 8, osb // 48 * 48)
        try_cfg(nthr_oc, rnd_up(ocb, 8), osb // 48 * 48)
        try_cfg(nthr_oc, rnd_up(ocb, 8), rnd_up(osb, simd))
        try_cfg(nthr_oc, rnd_up(ocb, 8), rnd_up(osb, 48))

    for nthr_oc in range(1, cpu.threads + 1):
        max_oc_thr = div_up(oc, nthr_oc)
        max_os_thr = div_up(spatial, cpu.threads // nthr_oc)
        if im2col:
            try_cfg(nthr_oc, max_oc_thr, max_os_thr)
            if best["ocb"] == max_oc_thr and best["osb"] == max_os_thr and best["icb"] == ic:
                continue
            a_k = sh * sw + ks
            b_k = ks * max_oc_thr
            icb = ic
            ocb = max(8, min(max_oc_thr, cdiv(l2 - a_k * icb * simd - b_k * icb, simd)))
            osb = max(simd, min(max_os_thr, cdiv(l2 - b_k * icb, a_k * icb + ocb)))
            explore(nthr_oc, ocb, osb)
            icb_max = max(1, l2 // (2 * 8 * a_k + 2 * b_k))
            if icb_max < ic:
                icb = ic // max(1, ic // icb_max)
                osb = max(1, cdiv(l2 - 2 * b_k * icb, 2 * icb * a_k))
                ocb = l2 // 2 // osb
                if ocb > max_oc_thr:
                    ocb = max_oc_thr
                    osb = max(simd, min(max_os_thr, cdiv(l2 - b_k * icb, a_k * icb + ocb)))
                elif osb > max_os_thr:
                    osb = max_os_thr
                    ocb = max(8, min(max_oc_thr, cdiv(l2 - a_k * icb * osb - b_k * icb, osb)))
                explore(nthr_oc, ocb, osb)
            ocb, icb = max_oc_thr, ic
            osb = max(simd, cdiv(l2 - b_k * icb, a_k * icb + ocb) // simd * simd)
            explore(nthr_oc, ocb, osb)
        else:
            explore(nthr_oc, max_oc_thr, cdiv(l2 - ks * ic, sh * sw * ic))
    return best["icb"], best["osb"]


def gemm_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
        outer_eff = f32(outer_work / rnd_up(outer_work, cpu.threads))
        inner_work = div_up(os_, simd) * div_up(p.oc, simd)
        inner_eff = f32(inner_work / rnd_up(inner_work, cpu.threads))
        outer = (
            os_ // cpu.threads < 512 and (p.o[0] != 1 or p.mb != 1 or p.g > 2)
            and (f32(outer_eff / inner_eff) >= 1.0 or os_ * p.ic * p.oc // cpu.threads < 64 * 1024)
        )
    scratch = Pad()
    scratch.book((cpu.threads if outer else 1) * im2col * 4)
    if scratch.size > _limit(p, cpu):
        return None
    return Prim("gemm:jit", 0, 0, p.data(p.oc, p.osp), scratch.size)


def gemm_bwd_d(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
    outer_eff = f32(outer_work / rnd_up(outer_work, cpu.threads))
    inner_work = div_up(is_, simd) * div_up(p.ic, simd)
    inner_eff = f32(inner_work / rnd_up(inner_work, cpu.threads))
    outer = (
        (os_ // cpu.threads < 512 or ks < 64) and (p.mb != 1 or p.g > 2)
        and (f32(outer_eff / inner_eff) >= 1.0 or is_ * p.ic * p.oc // cpu.threads < 64 * 1024)
    )
    threads = cpu.threads if outer else 1
    scratch = Pad()
    scratch.book(threads * _fitted_columns(p, cpu, scratch, threads, im2col, 0.1) * 4)
    if scratch.size > _limit(p, cpu):
        return None
    src = p.data(p.ic, p.isp)
    return Prim("gemm:jit", src, 0, 0, scratch.size, src_fmt=src)


def gemm_nspc_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
        h_block = max(1, min(div_up(l2, row), oh))
        w_block = ow
        if h_block == 1:
            col = ic * ks * 4 + 2 * (ic + oc) * 4
            w_block = max(1, min(div_up(l2, col), ow))
        if h_block != oh:
            h_block = max(1, h_block // 4 * 4)
        if w_block != ow:
            w_block = max(1, w_block // simd * simd)
        thr_eff = 0.0
        if w_block == ow:
            while True:
                work = p.g * p.mb * p.o[0] * div_up(oh, h_block)
                disb = f32(oh / rnd_up(oh, h_block))
                thr_eff = f32(f32(f32(work / rnd_up(work, cpu.threads)) + disb) / 2)
                if thr_eff >= f32(0.9):
                    break
                h_block = 0 if h_block < 4 else (h_block - 4) // 4 * 4
                if h_block <= 0:
                    break
        if thr_eff < f32(0.9):
            h_block = 1
            while True:
                work = p.g * p.mb * oh * div_up(ow, w_block)
                disb = f32(ow / rnd_up(ow, w_block))
                thr_eff = f32(f32(f32(work / rnd_up(work, cpu.threads)) + disb) / 2)
                if thr_eff > f32(0.9):
                    break
                w_block = 0 if w_block < simd else (w_block - simd) // simd * simd
                if w_block <= 0:
                    break
        h_block, w_block = max(1, h_block), max(1, w_block)
        inner = div_up(os_, simd) * div_up(oc, simd)
        oh_block, ow_block = oh, ow
        if thr_eff >= f32(f32(inner / rnd_up(inner, cpu.threads)) / 2):
            oh_block, ow_block, outer = h_block, w_block, True
        if oh_block != 1:
            ow_block = ow
        im2col = ic * ks * oh_block * ow_block
    if not outer and p.ndims != 5:
        outer_work = p.g * p.mb
        inner = div_up(is_, simd) * div_up(ic, simd)
        ratio = f32(f32(outer_work / rnd_up(outer_work, cpu.threads)) / f32(inner / rnd_up(inner, cpu.threads)))
        outer = (depthwise or (is_ // cpu.threads < 64 and p.mb != 1)) and (
            ratio >= 1.0 or os_ * ic * oc // cpu.threads < 64 * 1024
        )
    threads = cpu.threads if outer else 1
    scratch = Pad()
    scratch.book(threads * im2col * 4)
    scratch.book(threads * p.i[0] * is_ * ic * 4)
    if scratch.size > _limit(p, cpu):
        return None
    return Prim("gemm:jit", 0, hwio_reorder(p), 0, scratch.size)


def gemm_nspc_bwd_d(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
    inner = div_up(is_, simd) * div_up(ic, simd)
    ratio = f32(f32(outer_work / rnd_up(outer_work, cpu.threads)) / f32(inner / rnd_up(inner, cpu.threads)))
    outer = p.ndims != 5 and (depthwise or (is_ // cpu.threads < 64 and p.mb != 1)) and (
        ratio >= 1.0 or is_ * ic * oc // cpu.threads < 64 * 1024
    )
    threads = cpu.threads if outer else 1
    scratch = Pad()
    scratch.book(threads * im2col * 4)
    if p.g > 1:
        scratch.book(threads * is_ * p.i[0] * ic * 4)
    if scratch.size > _limit(p, cpu):
        return None
    return Prim("gemm:jit", 0, hwio_reorder(p), 0, scratch.size, src_fmt=p.data(ic, p.isp))


def gemm_nspc_bwd_w(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``gemm_convolution_bwd_weights_t`` on channels-last data: per-thread
    im2col columns, weight accumulators (``book<float>(nthr *
    weights_d.size())``) and transposed source copies, under outer threading."""
    if not nxc:
        return None
    ic, ks = p.ic, p.ks
    os_, is_ = p.o[1] * p.o[2], p.i[1] * p.i[2]
    trivial = p.o == p.i and p.s == (1, 1, 1) and ks == 1
    im2col = 0 if trivial else ic * ks * os_
    wei_bytes = p.g * p.oc * ic * ks * 4
    limit = _limit(p, cpu)
    thr_mem = cpu.threads * (4 * im2col + 4 * p.i[0] * is_ * ic + 4 * wei_bytes)
    outer = thr_mem < limit and os_ // cpu.threads < 256 and (p.mb != 1 or p.g > 2)
    threads = cpu.threads if outer else 1
    scratch = Pad()
    scratch.book(threads * im2col * 4)
    scratch.book(threads * wei_bytes * 4)
    scratch.book(threads * p.i[0] * is_ * ic * 4)
    if scratch.size > limit:
        return None
    return Prim("gemm:jit", 0, wei_bytes, 0, scratch.size, nxc_result=True)


def hwio_reorder(p: Geo) -> int:
    """Bytes of the weights reorder into hwio (hwigo): none when the caller's
    channels-last weights (ohwi) already have those strides, oneDNN comparing
    the strides of non-unit dimensions only: one input channel per group of a 1x1
    kernel, or, without groups, one output channel."""
    same = (p.ic == 1 and p.ks == 1) or (p.g == 1 and p.oc == 1)
    return 0 if same else p.g * p.oc * p.ic * p.ks * p.dsz
