"""oneDNN's reference convolutions (``ref_convolution_*_t``): what runs when no other
implementation accepts the problem (the gemm-based ones refuse a scratchpad over
their limit). nhwc data and oihw weights forward and backward-data, nchw data and
oihw weights backward-weights; no f32 scratchpad."""

from __future__ import annotations

from pytest_torchmem.engine.tracing.devices.cpu.onednn.common import Geo, Prim, nxc_is_plain
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile


def _oihw_reorder(p: Geo, nxc: bool) -> int:
    """Channels-last weights (ohwi) reordered into oihw, unless the two have the same
    strides in every non-unit dimension (one input channel, or a 1x1 kernel)."""
    same = not nxc or p.ic == 1 or p.ks == 1
    return 0 if same else p.g * p.oc * p.ic * p.ks * p.dsz


def _nhwc(p: Geo, channels: int, sp: int, nxc: bool) -> int:
    """Bytes of a plain activation reordered into nhwc (none if already, or the same)."""
    return 0 if nxc or nxc_is_plain(p, channels, sp) else p.data(channels, sp)


def _nchw(p: Geo, channels: int, sp: int, nxc: bool) -> int:
    return p.data(channels, sp) if nxc and not nxc_is_plain(p, channels, sp) else 0


def ref_fwd(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim:
    """``ref_convolution_fwd_t``: an nhwc result, which ideep allocates unless it
    writes a channels-last output in place (then made dense, and contiguous
    where nhwc and nchw differ)."""
    return Prim(
        "ref:any", _nhwc(p, p.ic, p.isp, nxc), _oihw_reorder(p, nxc), 0 if nxc else p.data(p.oc, p.osp), 0,
        nxc_result=not nxc and not nxc_is_plain(p, p.oc, p.osp),
    )


def ref_bwd_d(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim:
    """``ref_convolution_bwd_data_t``: the input gradient made in nhwc."""
    src = p.data(p.ic, p.isp)
    return Prim(
        "ref:any", 0 if nxc else src, _oihw_reorder(p, nxc), _nhwc(p, p.oc, p.osp, nxc), 0,
        nxc_result=not nxc and not nxc_is_plain(p, p.ic, p.isp), src_fmt=src,
    )


def ref_bwd_w(p: Geo, cpu: CpuProfile, nxc: bool) -> Prim:
    """``ref_convolution_bwd_weights_t``: nchw data, plain weight gradients."""
    return Prim(
        "ref:any", _nchw(p, p.ic, p.isp, nxc), p.g * p.oc * p.ic * p.ks * p.dsz, _nchw(p, p.oc, p.osp, nxc), 0,
    )
