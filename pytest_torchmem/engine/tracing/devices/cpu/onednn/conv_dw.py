"""oneDNN's depthwise convolutions: ``jit_uni_dw_conv_kernel`` (avx512_core,
avx2, sse41) and ``brdgmm_dw_convolution_fwd_t``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pytest_torchmem.engine.tracing.devices.cpu.onednn.common import (
    Geo,
    Pad,
    Prim,
    div_up,
    end_pad,
    f32,
    nxc_is_plain,
    rnd_up,
)
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile

#: The ISA levels of ``jit_uni_dw_convolution_*_t``, as the implementation lists name them.
ISAS = ("avx512_core", "avx2", "sse41")


def _usable(cpu: CpuProfile, isa: str) -> bool:
    """``mayiuse(isa)`` on the modelled CPU."""
    return {"avx512_core": cpu.avx512, "avx2": cpu.avx2, "sse41": True}[isa]


def _dw_geometry_ok(p: Geo, any_ndims: bool = False) -> bool:
    return (any_ndims or p.ndims == 4) and p.g > 1 and p.ic == 1 and p.oc == 1


def brdgmm_dw(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``brdgmm_dw_convolution_fwd_t`` (avx512_core, else avx2): depthwise forward
    in nhwc (taken for channels-last data, and for 3-d ones whatever the layout),
    groups padded to the brgemm's 16 (8 on avx2) in the weights; no dilation; no
    scratchpad for f32."""
    if not cpu.avx2 or not _dw_geometry_ok(p, any_ndims=True) or p.d != (0, 0, 0):
        return None
    if not (nxc or p.ndims == 5):
        return None
    isa, block = ("avx512_core", 16) if cpu.avx512 else ("avx2", 8)
    name = f"brdgmm_dw:{isa}"
    wei = rnd_up(p.g, block) * p.ks * p.dsz
    if nxc:
        return Prim(name, 0, wei, 0, 0)
    src = 0 if nxc_is_plain(p, 1, p.isp) else p.data(1, p.isp)
    return Prim(name, src, wei, p.data(1, p.osp), 0, nxc_result=not nxc_is_plain(p, 1, p.osp))


def _block(isa: str) -> int:
    """Channels per block: 16 on avx512_core, 8 (two 4-float registers on sse41) otherwise."""
    return 16 if isa == "avx512_core" else 8


def _pads_groups(isa: str, nxc: bool) -> bool:
    """``ok_to_pad_channels``: blocked data on avx512_core and avx2 pads the groups
    to the block; sse41 needs them to be a multiple of it."""
    return not nxc and isa in ("avx512_core", "avx2")


def _groups(p: Geo, isa: str, nxc: bool) -> int | None:
    """The groups the kernel runs (padded where it pads), or None where it refuses."""
    block = _block(isa)
    if _pads_groups(isa, nxc):
        return rnd_up(p.g, block)
    if not nxc and p.g % block:
        return None
    return p.g


def dw_fwd(isa: str) -> Callable[[Geo, CpuProfile, bool], Prim | None]:
    def impl(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
        """``jit_uni_dw_conv_fwd_kernel_t<isa>::init_conf``: nChw16c (nChw8c below
        avx512_core) data and Goihw16g (8g) weights, the groups padded to the block
        (avx512_core, avx2; a multiple of it on sse41), channels-last data in place;
        the width unroll (6, 4, 3 by ISA; fewer where the channels-last rows alias
        in the cache) bounds the padding; a padded bias when groups are padded."""
        if not _usable(cpu, isa) or not _dw_geometry_ok(p):
            return None
        e, pr = p.ext_k, p.pr
        if e[2] <= p.p[2] or e[2] <= pr[2] or e[1] <= p.p[1] or e[1] <= pr[1]:
            return None
        ur_w = {"avx512_core": 6, "avx2": 4, "sse41": 3}[isa]
        ur_w = min(ur_w, p.o[2])
        if nxc:
            nb_ch = div_up(p.g, _block(isa))
            nb_ch_blocking = min(nb_ch, {"avx512_core": 4, "avx2": 3, "sse41": 2}[isa])
            resrc_ur_w = (31 - p.k[2] + p.s[2]) // (nb_ch_blocking + p.s[2])
            if isa == "avx512_core" and p.s[2] < p.k[2] <= 5 and p.d[2] == 0 and resrc_ur_w >= 2:
                ur_w = min(p.o[2], resrc_ur_w)
            if (p.g * p.i[2] * p.dsz) % 1024 == 0:  # cache aliasing
                ur_w = min(ur_w, 7 if p.o[2] > 7 else 4)
        tail = p.o[2] % ur_w
        if p.p[2] > ur_w or max(0, end_pad(p.p[2], p.o[2] - tail, p.i[2], p.s[2], e[2])) > ur_w:
            return None
        g = _groups(p, isa, nxc)
        if g is None:
            return None
        block = _block(isa)
        wei = rnd_up(g, block) * p.ks * p.dsz
        scratch = Pad()
        if p.bias and g != p.g:
            scratch.book(g * 4)
        if nxc:
            return Prim(f"jit_dw:{isa}", 0, wei, 0, scratch.size)
        data = replace(p, g=g)
        return Prim(f"jit_dw:{isa}", data.data(1, p.isp), wei, data.data(1, p.osp), scratch.size)

    return impl


def dw_bwd_d(isa: str) -> Callable[[Geo, CpuProfile, bool], Prim | None]:
    def impl(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
        """``jit_uni_dw_conv_bwd_data_kernel_t<isa>::init_conf``: as forward, no
        dilation, no scratchpad."""
        if not _usable(cpu, isa) or not _dw_geometry_ok(p) or p.d != (0, 0, 0):
            return None
        g = _groups(p, isa, nxc)
        if g is None:
            return None
        wei = rnd_up(g, _block(isa)) * p.ks * p.dsz
        if nxc:
            return Prim(f"jit_dw:{isa}", 0, wei, 0, 0, src_fmt=p.data(1, p.isp))
        data = replace(p, g=g)
        src = data.data(1, p.isp)
        return Prim(f"jit_dw:{isa}", src, wei, data.data(1, p.osp), 0, src_fmt=src)

    return impl


def dw_bwd_w(isa: str) -> Callable[[Geo, CpuProfile, bool], Prim | None]:
    def impl(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
        """``jit_uni_dw_conv_bwd_weights_kernel_t<isa>::init_conf``: blocked layouts use
        the mb-reduction harness (``nthr_g = min(nb_ch, nthr)`` threads on groups,
        the rest on the minibatch, each extra one with its own weights and bias
        buffer); channels-last data the nxc harness (``partition_nthr_nxc``:
        threads over channel blocks, images and rows, one reduction buffer per
        extra thread)."""
        if not _usable(cpu, isa) or not _dw_geometry_ok(p) or p.d != (0, 0, 0):
            return None
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
        g = _groups(p, isa, nxc)
        if g is None:
            return None
        block = _block(isa)
        name = f"jit_dw:{isa}"
        wei = rnd_up(g, block) * p.ks * p.dsz
        if nxc:
            nb_ch = div_up(p.g, block)
            fast = isa in ("avx512_core", "avx2")
            max_reg = 31 if isa == "avx512_core" else 15
            unroll = min(4 if fast else 1, max_reg // (2 * p.k[2]))
            ch_outer = div_up(nb_ch, min(nb_ch, unroll))
            threads = _partition_nxc(cpu.threads, ch_outer, p.mb, p.o[1])
            scratch = Pad()
            if threads > 1:
                scratch.book(rnd_up(p.g, block) * p.ks * (threads - 1) * 4, 4)
                if p.bias:
                    scratch.book(p.g * (threads - 1) * 4, 4)
            return Prim(name, 0, wei, 0, scratch.size)
        nthr_g = min(g // block, cpu.threads)
        nthr_mb = min(max(1, cpu.threads // nthr_g), p.mb)
        scratch = Pad()
        if nthr_mb > 1:
            scratch.book(g * p.ks * (nthr_mb - 1) * 4, 4)
            if p.bias:
                scratch.book(g * (nthr_mb - 1) * 4, 4)
        data = replace(p, g=g)
        return Prim(name, data.data(1, p.isp), wei, data.data(1, p.osp), scratch.size)

    return impl


def _partition_nxc(nthreads: int, ch_outer: int, mb: int, oh: int) -> int:
    """The threads ``partition_nthr_nxc`` (``prioritize_threading``) puts to work:
    the split of channel blocks, images and output-row blocks that uses the most
    threads, then the least imbalanced."""
    best_eff, best_imbalance, best_total = 0.0, 1.0, 1
    for g in range(min(ch_outer, nthreads), 0, -1):
        per_g = nthreads // g
        for m in range(min(mb, per_g), 0, -1):
            avail_oh = min(oh, per_g // m)
            under = False
            for oh_block in range(oh, 0, -1):
                g_block, mb_block, oh_blocks = div_up(ch_outer, g), div_up(mb, m), div_up(oh, oh_block)
                nthr_oh = min(avail_oh, oh_blocks)
                total = g * m * nthr_oh
                eff = f32(total / nthreads)
                if under and avail_oh < oh_blocks:
                    break
                imbalance = f32(
                    f32(f32(abs(g_block * g - ch_outer) / ch_outer) * (mb * oh))
                    + f32(f32(abs(mb_block * m - mb) / mb) * (ch_outer * oh))
                    + f32(f32(abs(oh_block * nthr_oh - oh) / oh) * (ch_outer * mb))
                )
                if best_eff <= eff:
                    if best_eff == eff and best_imbalance <= imbalance:
                        continue
                    best_eff, best_imbalance, best_total = eff, imbalance, total
                under = oh_block * nthr_oh < oh
    return best_total
