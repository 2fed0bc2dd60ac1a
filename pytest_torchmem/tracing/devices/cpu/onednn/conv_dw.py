"""oneDNN's depthwise convolutions: ``jit_uni_dw_conv_kernel`` (avx512_core,
avx2, sse41) and ``brdgmm_dw_convolution_fwd_t``."""

from __future__ import annotations

from dataclasses import replace

from pytest_torchmem.tracing.devices.cpu.onednn.common import Geo, Pad, Prim, div_up, end_pad, nxc_is_plain, rnd_up
from pytest_torchmem.tracing.devices.cpu.profiles import CpuProfile


def _dw_geometry_ok(p: Geo, any_ndims: bool = False) -> bool:
    return (any_ndims or p.ndims == 4) and p.g > 1 and p.ic == 1 and p.oc == 1


def brdgmm_dw(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``brdgmm_dw_convolution_fwd_t``: depthwise forward in nhwc (taken for
    channels-last data, and for 3-d ones whatever the layout), groups padded to
    16 in the weights; no dilation; no scratchpad for f32."""
    if not cpu.avx512 or not _dw_geometry_ok(p, any_ndims=True) or p.d != (0, 0, 0):
        return None
    if not (nxc or p.ndims == 5):
        return None
    wei = rnd_up(p.g, 16) * p.ks * p.dsz
    if nxc:
        return Prim("brdgmm_dw:avx512_core", 0, wei, 0, 0)
    src = 0 if nxc_is_plain(p, 1, p.isp) else p.data(1, p.isp)
    return Prim(
        "brdgmm_dw:avx512_core", src, wei, p.data(1, p.osp), 0, nxc_result=not nxc_is_plain(p, 1, p.osp),
    )


def dw_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
    if p.p[2] > ur_w or max(0, end_pad(p.p[2], p.o[2] - tail, p.i[2], p.s[2], e[2])) > ur_w:
        return None
    g = rnd_up(p.g, simd)
    scratch = Pad()
    if p.bias and g != p.g:
        scratch.book(g * 4)
    data = replace(p, g=g)
    name = "jit_dw:avx512_core" if simd == 16 else "jit_dw:avx2"
    return Prim(name, data.data(1, p.isp), g * p.ks * p.dsz, data.data(1, p.osp), scratch.size)


def dw_bwd_d(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``jit_uni_dw_conv_bwd_data_kernel_t::init_conf``: as forward, no
    dilation, no scratchpad."""
    if not _dw_geometry_ok(p) or p.d != (0, 0, 0):
        return None
    simd = 16 if cpu.avx512 else 8
    g = rnd_up(p.g, simd)
    name = "jit_dw:avx512_core" if simd == 16 else "jit_dw:avx2"
    if nxc:
        return Prim(name, 0, g * p.ks * p.dsz, 0, 0)
    data = replace(p, g=g)
    return Prim(name, data.data(1, p.isp), g * p.ks * p.dsz, data.data(1, p.osp), 0)


def dw_bwd_w(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
    g = rnd_up(p.g, simd)
    name = "jit_dw:avx512_core" if simd == 16 else "jit_dw:avx2"
    if nxc:
        # harness_nxc (partition_nthr_nxc): threads over channel blocks, images
        # and output rows; every thread but one reduces into its own buffer
        nb_ch = div_up(p.g, simd)
        ch_outer = div_up(nb_ch, min(nb_ch, min(4, 31 // (2 * p.k[2]))))
        threads = min(cpu.threads, ch_outer * p.mb * p.o[1])
        scratch = Pad()
        if threads > 1:
            scratch.book(g * p.ks * (threads - 1) * 4, 4)
            if p.bias:
                scratch.book(p.g * (threads - 1) * 4, 4)
        return Prim(name, 0, g * p.ks * p.dsz, 0, scratch.size)
    nthr_g = min(g // simd, cpu.threads)
    nthr_mb = min(max(1, cpu.threads // nthr_g), p.mb)
    scratch = Pad()
    if nthr_mb > 1:
        scratch.book(g * p.ks * (nthr_mb - 1) * 4, 4)
        if p.bias:
            scratch.book(g * (nthr_mb - 1) * 4, 4)
    data = replace(p, g=g)
    return Prim(name, data.data(1, p.isp), g * p.ks * p.dsz, data.data(1, p.osp), scratch.size)
