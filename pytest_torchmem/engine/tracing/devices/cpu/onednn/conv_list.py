"""oneDNN's convolution implementation lists (``cpu_convolution_list.cpp``, f32):
the first implementation that accepts a problem runs it, as oneDNN's primitive
descriptor iterator does; deconvolutions run through convolutions."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Final

from pytest_torchmem.engine.tracing.devices.cpu.onednn import (
    conv_1x1,
    conv_brgemm,
    conv_dw,
    conv_gemm,
    conv_jit,
    conv_ref,
)
from pytest_torchmem.engine.tracing.devices.cpu.onednn.common import Geo, Pad, Prim, swap
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile

__all__ = ["FWD", "BWD_D", "BWD_W", "pick", "deconv_fwd", "deconv_bwd_d", "deconv_bwd_w"]

# -- oneDNN: implementation lists (cpu_convolution_list.cpp, f32) ------------------------------


#: Forward, in oneDNN's order for x64 f32; each implementation refuses what its
#: ISA (``mayiuse``) or its conditions exclude. Left out: ``ip_convolution``
#: and ``jit_uni_ncsp_convolution`` (avx512_core, plain layouts only, which
#: PyTorch never asks for); ``ref_convolution`` accepts anything.
FWD: Final = (
    conv_dw.brdgmm_dw,
    conv_brgemm.brg_fwd_nxc("avx512_core"),
    conv_dw.dw_fwd("avx512_core"),
    conv_1x1.avx512_1x1("fwd"),
    conv_jit.avx512_fwd,
    conv_dw.dw_fwd("avx2"),
    conv_brgemm.brg_fwd_nxc("avx2"),
    conv_1x1.avx2_1x1("fwd"),
    conv_dw.dw_fwd("sse41"),
    conv_1x1.sse41_1x1_fwd,
    conv_jit.avx2_fwd,
    conv_jit.sse41_fwd,
    conv_gemm.gemm_fwd,
    conv_gemm.gemm_nspc_fwd,
    conv_ref.ref_fwd,
)
BWD_D: Final = (
    conv_brgemm.brg_bwd_nxc("avx512_core"),
    conv_brgemm.brg_bwd_strided,
    conv_dw.dw_bwd_d("avx512_core"),
    conv_1x1.avx512_1x1("bwd_d"),
    conv_jit.avx512_bwd_d,
    conv_brgemm.brg_bwd_nxc("avx2"),
    conv_brgemm.brg_bwd_strided_avx2,
    conv_dw.dw_bwd_d("avx2"),
    conv_1x1.avx2_1x1("bwd_d"),
    conv_dw.dw_bwd_d("sse41"),
    conv_jit.avx2_bwd_d,
    conv_gemm.gemm_bwd_d,
    conv_gemm.gemm_nspc_bwd_d,
    conv_ref.ref_bwd_d,
)
BWD_W: Final = (
    conv_dw.dw_bwd_w("avx512_core"),
    conv_1x1.avx512_1x1("bwd_w"),
    conv_jit.avx512_bwd_w,
    conv_dw.dw_bwd_w("avx2"),
    conv_1x1.avx2_1x1("bwd_w"),
    conv_dw.dw_bwd_w("sse41"),
    conv_jit.avx2_bwd_w,
    conv_gemm.gemm_bwd_w,
    conv_gemm.gemm_nspc_bwd_w,
    conv_ref.ref_bwd_w,
)


@functools.lru_cache(maxsize=4096)
def pick(impls: tuple[Any, ...], p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """The first implementation of the list that accepts the problem on ``cpu``
    (oneDNN's primitive descriptor iterator)."""
    for impl in impls:
        prim = impl(p, cpu, nxc)
        if prim is not None:
            return prim
    return None


def deconv_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
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
        prim = conv_brgemm.brg_bwd_strided(conv, cpu, nxc) or conv_brgemm.brg_bwd_strided(conv, cpu, nxc, simd=8)
        if prim is not None:
            prim = replace(prim, src=prim.dst, dst=prim.src)
    elif p.s == (1, 1, 1) and nxc:
        prim = conv_brgemm.brg_fwd_nxc("avx512_core")(swap(conv), cpu, nxc) or conv_brgemm.brg_fwd_nxc("avx2")(
            swap(conv), cpu, nxc
        )
    if prim is not None:
        scratch = Pad()
        scratch.book(prim.scratch)
        return replace(prim, name="brg_deconv", scratch=scratch.size)
    prim = pick(BWD_D, conv, cpu, nxc)
    if prim is None:
        return None
    scratch = Pad()
    scratch.book(prim.scratch)
    if p.bias:
        scratch.book(prim.src_fmt or prim.src)
    return replace(prim, name="conv:any+" + prim.name, src=prim.dst, dst=prim.src, scratch=scratch.size)


def deconv_bwd_d(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``ref_deconvolution_bwd_data_t``: the forward of the swapped convolution
    (src: the output gradient, dst: the input gradient), scratchpad nested."""
    conv = replace(p, ic=p.oc, oc=p.ic, i=p.o, o=p.i, bias=False)
    prim = pick(FWD, conv, cpu, nxc)
    if prim is None:
        return None
    scratch = Pad()
    scratch.book(prim.scratch)
    return replace(prim, name="conv:any+" + prim.name, scratch=scratch.size)


def deconv_bwd_w(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim | None:
    """``ref_deconvolution_bwd_weights_t``: backward-weights of the swapped
    convolution (src: the output gradient, diff_dst: the input), without
    bias (the deconvolution sums it itself), scratchpad nested."""
    conv = replace(p, ic=p.oc, oc=p.ic, i=p.o, o=p.i, bias=False)
    prim = pick(BWD_W, conv, cpu, nxc)
    if prim is None:
        return None
    scratch = Pad()
    scratch.book(prim.scratch)
    return replace(prim, name="conv:any+" + prim.name, scratch=scratch.size)
