"""oneDNN's brgemm convolutions: ``brgemm_convolution_fwd_t``,
``brgemm_1x1_convolution_fwd_t``, ``brgemm_convolution_bwd_t`` and
``brgemm_convolution_bwd_strided_t`` (avx512_core and avx2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pytest_torchmem.engine.tracing.devices.cpu.onednn.common import (
    BATCH_ELEMENT,
    PAGE,
    Geo,
    Pad,
    Prim,
    div_up,
    nxc_is_plain,
    rnd_up,
    swap,
)
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile


def brg_bwd_strided(p: Geo, cpu: CpuProfile, nxc: bool, simd: int = 16) -> Prim | None:
    """``brgemm_convolution_bwd_strided_t`` (``brgemm_convolution_bwd_utils``):
    strided backward-data (and, through ``brg_deconv``, strided transposed
    convolutions) in nhwc, with per-thread brgemm batches (40-byte elements
    rounded to a page), per-thread copies of the output gradient padded by
    the kernel overflow (``inp_buffer``) and their masks, page aligned."""
    if p.s == (1, 1, 1) or p.d != (0, 0, 0) or not (cpu.avx512 if simd == 16 else cpu.avx2):
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
    scratch = Pad()
    batch = div_up(rnd_up(p.ks * BATCH_ELEMENT, PAGE), BATCH_ELEMENT) * BATCH_ELEMENT
    scratch.book(cpu.threads * batch, PAGE)
    inp = rnd_up(padded[0] * padded[1] * padded[2] * p.g * p.oc, PAGE)
    scratch.book(cpu.threads * inp * p.dsz, PAGE)
    scratch.book(cpu.threads * PAGE, PAGE)  # masks: one byte per block, rounded to a page
    if uneven:
        # out_buffer: one row block (iw_block <= iw rounded up to the stride)
        iw_block = rnd_up(p.i[2], p.s[2])
        scratch.book(cpu.threads * rnd_up(iw_block * p.s[2] * p.ic * p.g, PAGE) * p.dsz, PAGE)
    ic_block = _brg_ic_block(p, simd)
    wei = p.g * p.oc * rnd_up(p.ic, ic_block) * p.ks * p.dsz
    src = p.data(p.ic, p.isp)
    plain_src = nxc or nxc_is_plain(p, p.ic, p.isp)
    plain_dst = nxc or nxc_is_plain(p, p.oc, p.osp)
    return Prim(
        "brgconv_strided", 0 if nxc else src, wei, 0 if plain_dst else p.data(p.oc, p.osp),
        scratch.size, nxc_result=not plain_src, src_fmt=src,
    )


def _brg_ic_block(p: Geo, simd: int) -> int:
    """The input-gradient channel block of the brgemm backward-data kernel
    (its weights are padded to it). ``fast_check_ic_block`` admits 48 only for
    a large output (and 48-divisible channels); among the rest the blocking
    search (``est_eff``) was seen to keep 48 when admitted, else the largest
    block up to 32 -- even when it pads, e.g. 48 channels to 64 (verified on
    avx512_core for 24..208 channels)."""
    rnd = rnd_up(p.ic, simd)
    if simd == 16 and rnd % 48 == 0 and rnd <= 384 and p.osp > 81 * p.s[0] * p.s[1] * p.s[2]:
        return 48
    return min(32, simd * min(div_up(p.ic, simd), 4))


def brg_bwd_strided_avx2(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``brgemm_convolution_bwd_strided_t<avx2>`` (8-channel vectors), also
    reached on AVX512 by grouped convolutions with 9..16 output channels per
    group, which the avx512_core variant refuses."""
    prim = brg_bwd_strided(p, cpu, nxc, simd=8)
    return replace(prim, name="brgconv_strided:avx2") if prim is not None else None


def _usable(cpu: CpuProfile, isa: str) -> bool:
    return cpu.avx512 if isa == "avx512_core" else cpu.avx2


def _oc_block(p: Geo, isa: str) -> int:
    """The output-channel block of the brgemm blocking search (its weights are
    padded to it): the largest of 4, 3, 2, 1 vectors that divides the channels."""
    if isa == "avx512_core":
        return 64 if p.oc % 64 == 0 else 48 if p.oc % 48 == 0 else 32 if p.oc % 32 == 0 else 16
    return 32 if p.oc % 32 == 0 else 24 if p.oc % 24 == 0 else 16 if p.oc % 16 == 0 else 8


def brg_fwd_nxc(isa: str) -> Callable[[Geo, CpuProfile, bool], Prim | None]:
    def impl(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
        """``brgemm_convolution_fwd_t<isa>`` / ``brgemm_1x1_convolution_fwd_t<isa>``
        for channels-last f32 (oneDNN gives them only nhwc data for training):
        a page of brgemm batch elements per thread; weights in Ohwi16o-like
        blocks padded to the output-channel block. Depthwise convolutions are
        refused, and on avx512_core grouped ones with at most 16 input channels
        per group (``allow_perf_heuristics``)."""
        if not nxc or not _usable(cpu, isa) or min(p.p) < 0:
            return None
        if p.g > 1 and p.ic == 1 and p.oc == 1:
            return None
        if isa == "avx512_core" and p.g > 1 and p.ic <= 16:
            return None
        scratch = Pad()
        batch = div_up(rnd_up(p.ks * BATCH_ELEMENT, PAGE), BATCH_ELEMENT) * BATCH_ELEMENT
        scratch.book(cpu.threads * batch, PAGE)
        wei = p.g * rnd_up(p.oc, _oc_block(p, isa)) * p.ic * p.ks * p.dsz
        return Prim(f"brg_conv_fwd:{isa}", 0, wei, 0, scratch.size)

    return impl


def brg_bwd_nxc(isa: str) -> Callable[[Geo, CpuProfile, bool], Prim | None]:
    fwd_impl = brg_fwd_nxc(isa)

    def impl(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
        """``brgemm_convolution_bwd_t<isa>``: unit-stride channels-last
        backward-data, run as a forward brgemm convolution over the swapped
        problem (its scratchpad nested)."""
        if not nxc or p.s != (1, 1, 1):
            return None
        fwd = fwd_impl(swap(p), cpu, True)
        if fwd is None:
            return None
        scratch = Pad()
        scratch.book(fwd.scratch)
        return Prim(f"brg_conv_bwd:{isa}", 0, fwd.wei, 0, scratch.size)

    return impl
