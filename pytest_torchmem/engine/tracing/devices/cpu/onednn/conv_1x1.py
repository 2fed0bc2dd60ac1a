"""oneDNN's 1x1 convolutions: ``jit_avx512_common_1x1_conv_kernel``,
``jit_avx2_1x1_conv_kernel_f32`` and ``jit_sse41_1x1_conv_kernel_f32``, with
their reduce-to-unit-stride copies (``rtus``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_torchmem.engine.tracing.devices.cpu.onednn.common import (
    BARRIER,
    Geo,
    Pad,
    Prim,
    best_divider,
    book_reducer,
    book_reducer_2d,
    div_up,
    f32,
    least_memory,
    rnd_up,
)
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile

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


def _1x1_applicable(p: Geo) -> tuple[bool, bool]:
    """``rtus_prepare`` then the 1x1 checks: ``(applicable, reduce_src)``."""
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


def _1x1_conf(p: Geo, cpu: CpuProfile, prop: str, nxc: bool = False) -> _OneByOne:
    """The thread count, reduction split and blockings of the 1x1 kernel."""
    rtus = _1x1_applicable(p)[1]
    ic, oc = (p.ic, p.oc) if nxc else (rnd_up(p.ic, 16), rnd_up(p.oc, 16))
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
        nb_bcast, nb_load, nb_reduce = div_up(bcast_dim, ur), div_up(load_dim, 16), div_up(reduce_dim, 16)
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
            load_blocking = div_up(nb_load, lgc) * 16
        return _OneByOne(threads, 1, rtus, nb_reduce, div_up(load_blocking, 16), 0, is_)
    # backward weights
    reduce_dim = is_
    reduce_block = best_divider(reduce_dim, 7, 16, True)
    if reduce_dim % reduce_block:
        reduce_block = best_divider(p.i[2], 4, p.i[2], False)
    if reduce_block > 256:
        reduce_block = 1
    nb_bcast, nb_load, nb_reduce = div_up(ic, 16), div_up(oc, 16), div_up(reduce_dim, reduce_block)
    threads, nthr_mb = _1x1_bwd_w_balance(p, cpu.threads, nb_bcast, nb_load, nb_reduce, reduce_block)
    bcast_blocking = best_divider(nb_bcast, 5, nb_bcast, False)
    return _OneByOne(threads, nthr_mb, rtus, nb_reduce, 0, bcast_blocking, is_)


def _1x1_load_groups(
    p: Geo, nthr: int, nb_load: int, nb_bcast: int, ur: int, load_dim: int, reduce_dim: int,
    load_size: int, bcast_size: int,
) -> tuple[int, int]:
    """``load_grp_count`` and ``load_blocking`` of the 1x1 forward/backward-data conf."""
    load_blocking = load_dim
    if nthr <= 28 and p.mb < nthr and nb_load * nb_bcast > nthr:
        ratio = f32(load_size / bcast_size)
        best_lgc = nthr if ratio > 1 else 1
        best = float("inf")

        def cost(lb: int, tg: int, mem_k: float) -> float:
            bb = p.mb * div_up(nb_bcast, tg)
            calc = f32(f32(bb * ur) * (lb * 16)) * reduce_dim
            memsz = f32(bb * ur + lb * 16) * reduce_dim
            return f32(f32(0.01 * calc) + f32(mem_k * memsz))

        for i in range(nthr):
            lgc = nthr - i if ratio > 1 else i + 1
            min_lb, max_lb = nb_load // lgc, div_up(nb_load, lgc)
            min_tg, max_tg = nthr // lgc, div_up(nthr, lgc)
            mem_k = 1.0 if max_tg == 1 else f32(1.3)
            if nthr % lgc < nb_load % lgc:
                c = cost(max_lb, min_tg, mem_k)
            else:
                c = max(cost(max_lb, max_tg, mem_k), cost(min_lb, min_tg, mem_k))
            if c < best:
                best_lgc, best = lgc, c
        return best_lgc, div_up(nb_load, best_lgc) * 16
    lgc = div_up(nthr, p.mb * nb_bcast)
    lgc = best_divider(nthr, lgc, 2 * lgc, False)
    return lgc, load_blocking


def _1x1_small_threads(p: Geo, nthr: int, nb_load: int, nb_bcast: int, ur: int, lgc: int) -> tuple[int, int]:
    """The thread-count reduction of the 1x1 conf for tiny problems."""

    def eff(load_chunk: int, n: int) -> float:
        groups = div_up(nb_load, load_chunk)
        per = div_up(n, groups)
        bcast_per = div_up(p.mb * nb_bcast, per) * ur
        load_per = load_chunk * 16
        norm = f32((bcast_per + load_per) / 2.0)
        data = f32(bcast_per * load_per / f32(norm * norm))
        over = f32(max(1, n // groups) / div_up(n, groups))
        within = f32(p.mb * nb_bcast / rnd_up(p.mb * nb_bcast, per))
        load = f32(nb_load / rnd_up(nb_load, groups))
        return f32(f32(data + f32(over * within)) + load)

    def chunk(n: int) -> int:
        best, best_lgc = -1.0, 1
        for lc in range(1, nb_load + 1):
            groups = div_up(nb_load, lc)
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
    p: Geo, nthreads: int, nb_bcast: int, nb_load: int, nb_reduce: int, reduce_block: int
) -> tuple[int, int]:
    """``jit_avx512_common_1x1_conv_kernel_t::balance``: ``(nthr, nthr_mb)``, the
    split of least memory cost (unlike the direct kernel, no compute-cost step)."""
    if nthreads < p.g:
        return 1, 1
    nthr = nthreads // p.g

    def mem(nmb: int, noc: int, nic: int) -> int:
        return (
            div_up(p.mb * nb_reduce, nmb) * div_up(nb_bcast, nic) * 16 * reduce_block // p.s[1] // p.s[2]
            + div_up(p.mb * nb_reduce, nmb) * div_up(nb_load, noc) * 16 * reduce_block
            + 12 * div_up(nb_load, noc) * div_up(nb_bcast, nic) * 16 * 16
        )

    splits = [
        (nmb, noc, min(nthr // nmb // noc, nb_bcast))
        for nmb in range(1, min(nthr, p.mb * nb_reduce) + 1)
        for noc in range(1, min(nthr // nmb, nb_load) + 1)
    ]
    best, best_mem = least_memory(splits, mem)
    nmb, noc, nic = best
    if nthreads // 2 < nmb < nthreads:
        nmb = min(p.mb, nthreads)
    return nmb * p.g * noc * nic, nmb


def avx512_1x1(prop: str) -> Any:
    def impl(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
        ic, oc = (p.ic, p.oc) if nxc else (rnd_up(p.ic, 16), rnd_up(p.oc, 16))
        scratch = Pad()
        if prop == "bwd_w":
            if p.bias and p.oc % 16:
                scratch.book(rnd_up(oc, 16) * 4)
            scratch.book(rnd_up(oc, 16) * rnd_up(ic, 16) * (conf.nthr_mb - 1) * 4)
            if conf.nthr_mb > 1:
                scratch.book(BARRIER, BARRIER)
            if p.bias:
                book_reducer(scratch, conf.nthr, 16, div_up(oc, 16), p.mb, conf.nthr * 3 * 5 * 5 * 16 * 16)
        elif p.bias and prop == "fwd" and oc != p.oc:
            scratch.book(oc * 4)
        if rtus:
            if nxc:
                scratch.book(conf.nthr * conf.is_ * p.ic * 4)
            else:
                factor = {"fwd": conf.nb_reduce, "bwd_d": conf.nb_load_blocking_max, "bwd_w": conf.nb_bcast_blocking}[prop]
                scratch.book(conf.nthr * factor * conf.is_ * 16 * 4)
        wei = rnd_up(oc, 16) * rnd_up(ic, 16) * p.dsz
        if nxc:
            return Prim("jit_1x1:avx512_core", 0, wei, 0, scratch.size, src_fmt=p.data(p.ic, p.isp))
        src = p.data(ic, p.isp, 16)
        return Prim("jit_1x1:avx512_core", src, wei, p.data(oc, p.osp, 16), scratch.size, src_fmt=src)

    return impl


def _halve_blocks(blocks: int, limit: int) -> int:
    """The blocking loop of the avx2/sse41 1x1 backward-weights conf: halve, or
    divide by three, while above ``limit`` blocks."""
    while blocks > limit:
        if blocks % 2 == 0:
            blocks //= 2
        elif blocks % 3 == 0:
            blocks //= 3
        else:
            break
    return blocks


def avx2_1x1(prop: str) -> Callable[[Geo, CpuProfile, bool], Prim | None]:
    def impl(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
        """``jit_avx2_1x1_convolution_*_t`` (``jit_avx2_1x1_conv_kernel_f32_t::init_conf``):
        nCx8c data with the channels padded to 8 (channels-last data in place),
        OIx8i8o weights; a strided source is first copied to unit stride per
        thread (``rtus_prepare_space_info``: ``nb_reduce``, 18 or
        ``nb_bcast_blocking`` blocks of 8 channels, by direction); a padded bias;
        backward-weights reduces the images and rows the threads split through a
        ``cpu_reducer_2d_t`` (every thread of a group, the first included, has
        its own jobs' weights) and the bias through a ``cpu_reducer_t``."""
        if not cpu.avx2:
            return None
        ok, rtus = _1x1_applicable(p)
        if not ok:
            return None
        nthr = cpu.threads
        ic, oc = (p.ic, p.oc) if nxc else (rnd_up(p.ic, 8), rnd_up(p.oc, 8))
        os_ = p.osp
        is_ = os_ if rtus else p.isp
        scratch = Pad()
        if p.bias and prop != "bwd_d" and (oc != p.oc or (prop == "bwd_w" and nxc and p.oc % 8)):
            scratch.book(rnd_up(oc, 8) * 4)
        if prop == "bwd_w":
            nb_load, nb_bcast = div_up(oc, 8), div_up(ic, 8)
            nb_load_blocking = nb_load if nxc and oc % 8 else _halve_blocks(nb_load, 32)
            small = is_ <= 1024
            nb_bcast_blocking = (
                nb_bcast if nxc and not (ic % 8 == 0 and small) else _halve_blocks(nb_bcast, 17 if nxc else 9)
            )
            job_size = nb_load_blocking * nb_bcast_blocking * 8 * 8
            njobs = div_up(nb_load, nb_load_blocking) * div_up(nb_bcast, nb_bcast_blocking)
            max_buffer = nthr * job_size * 8
            if rtus:
                _book_rtus(scratch, nthr, is_, p.ic if nxc else nb_bcast_blocking * 8, nxc)
            if p.bias:
                book_reducer(scratch, nthr, 8, nb_load, p.mb, max_buffer)
            book_reducer_2d(scratch, nthr, job_size, njobs, p.mb * os_, max_buffer)
        elif rtus:
            factor = div_up(ic, 8) if prop == "fwd" else 18
            _book_rtus(scratch, nthr, is_, p.ic if nxc else factor * 8, nxc)
        wei = rnd_up(oc, 8) * rnd_up(ic, 8) * p.dsz
        if nxc:
            return Prim("jit_1x1:avx2", 0, wei, 0, scratch.size, src_fmt=p.data(p.ic, p.isp))
        src = p.data(ic, p.isp, 8)
        return Prim("jit_1x1:avx2", src, wei, p.data(oc, p.osp, 8), scratch.size, src_fmt=src)

    return impl


def _book_rtus(pad: Pad, nthr: int, is_: int, channels: int, nxc: bool) -> None:
    """``rtus_prepare_space_info``: per thread, the unit-stride copy of ``channels``
    channels of the source (all of them in nhwc; ``factor`` blocks of
    ``ic_block`` in blocked layouts)."""
    pad.book(nthr * is_ * channels * 4)


def sse41_1x1_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``jit_sse41_1x1_convolution_fwd_t``: unit stride, no padding, channels a
    multiple of 8 (nothing padded), nCx8c data (nhwc in place) and OIhw8i8o
    weights; no scratchpad."""
    if p.ks != 1 or p.g != 1 or p.ndims != 4 or p.s != (1, 1, 1) or any(p.p) or p.o != p.i:
        return None
    if p.ic % 8 or p.oc % 8:
        return None
    wei = p.oc * p.ic * p.dsz
    if nxc:
        return Prim("jit_1x1:sse41", 0, wei, 0, 0, src_fmt=p.data(p.ic, p.isp))
    src = p.data(p.ic, p.isp, 8)
    return Prim("jit_1x1:sse41", src, wei, p.data(p.oc, p.osp, 8), 0, src_fmt=src)
