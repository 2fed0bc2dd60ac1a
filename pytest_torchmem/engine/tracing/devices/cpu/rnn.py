"""CPU rules: recurrent networks.

``nn.GRU``, ``nn.RNN`` and an ``nn.LSTM`` with ``proj_size`` run ATen's native
cells (``_rnn_impl_with_concat``, ``_lstm_impl``), which are composites of
``linear``, ``sigmoid``, ``cat``...: the fake trace sees every op they run and
needs no rule here.

A float32 or bfloat16 ``nn.LSTM`` without projections takes oneDNN's path
(``at::native::lstm`` -> ``lstm_mkldnn_stub``, aten/src/ATen/native/RNN.cpp,
when ``use_mkldnn`` holds), which the fake trace follows too since the routing
runs in C++; it calls ``mkldnn_rnn_layer`` once per layer and direction
(aten/src/ATen/native/mkldnn/RNN.cpp), and autograd its backward,
``mkldnn_rnn_layer_backward``. Their meta kernels get the outputs right
except the oneDNN workspace (the meta kernel's is empty), and see nothing of
what the kernels take from the allocator inside: the summed bias, the weights
reordered to oneDNN's layouts (ideep ``reorder_if_differ_in``), oneDNN's
scratchpad, and in backward the contiguous and zero-filled gradients, the
float32 copies of bfloat16 gradients and ideep's zero-initialised gradient
buffers.

Their sizes follow oneDNN v3.12 (the version torch 2.13 bundles), file by
file: ``src/cpu/rnn/rnn_utils.{hpp,cpp}`` (``init_conf``,
``set_workspace_sizes``, ``set_offsets``, ``set_good_strides``,
``set_expected_desc``), ``src/cpu/rnn/ref_rnn.cpp`` (``init_brgemm`` /
``init_ref``, ``init_scratchpad``), ``src/cpu/x64/rnn/rnn_brgemm_utils.cpp``
(``configure_brgemm``, ``init_scratchpad``) and
``src/common/memory_tracking.hpp`` (how bookings add up); and ideep's
``operators/lstm.hpp`` (what is reordered and allocated around the
primitive).

Modelled implementations: the reference (gemm) implementation, which oneDNN
takes for float32 training and backward and, where the CPU lacks
AVX512-BF16, for every bfloat16 LSTM; its bfloat16 inference packs the
weights for oneDNN's own GEMM, sized by that GEMM's driver
(``src/cpu/x64/gemm``: gemm_driver.cpp, gemm_partition.hpp, gemm_info.cpp,
gemv_driver.cpp, gemm_utils.hpp, gemm_pack_storage.hpp) and reordered by
``rnn_weights_reorder_t`` (src/cpu/rnn/rnn_reorders.hpp); and the brgemm
implementation without AMX, which it takes for float32 inference (AVX2 and
up) and, on AVX512-BF16 CPUs, for bfloat16 forward. ``ONEDNN_MAX_CPU_ISA``
is honoured. Not modelled, for want of a CPU to check them on (their sizes
also hang on the L2 cache size): AMX brgemm and the brgemm backward that
bfloat16 training takes on AVX512-BF16 CPUs, where these rules fall back to
the reference implementation's buffers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.profiles import ISA_LEVELS, CpuProfile
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, Inexact, OpCall, Steps, nbytes_of

aten = torch.ops.aten

# -- oneDNN's RNN primitive -------------------------------------------------------

#: ``register_space`` in rnn_utils.cpp puts each workspace and scratch region on a page.
_PAGE: Final = 4096
#: ``memory_tracking::default_alignment``: every booking gets this much room to align.
_BOOKING_ALIGN: Final = 128
#: ``sizeof(brgemm_batch_element_t)`` (two pointers, two dim_t, one dim_t).
_BRGEMM_BATCH_ELEMENT: Final = 40
_F32: Final = 4
_LSTM_GATES: Final = 4


def _rnd_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _good_ld(dim: int, dt_size: int) -> int:
    """``rnn_utils::get_good_ld``: 64-byte aligned, and not a multiple of 256
    elements (4K aliasing)."""
    ld = _rnd_up(dim, 64 // dt_size)
    return ld + 64 // dt_size if ld % 256 == 0 else ld


def _booking(nbytes: int, alignment: int = _BOOKING_ALIGN) -> int:
    """What ``registry_t::book`` adds to a scratchpad for ``nbytes``."""
    return nbytes + max(alignment, _BOOKING_ALIGN) if nbytes > 0 else 0


#: oneDNN's ISA levels that change an LSTM's buffers, lowest first, and the
#: profile level each is.
_ISA_LEVELS: Final = {
    "avx2": "avx2", "avx512_core": "avx512", "avx512_core_bf16": "avx512_bf16", "avx512_core_amx": "amx",
}


def _mayiuse(cpu: CpuProfile, isa: str) -> bool:
    return cpu.level >= ISA_LEVELS.index(_ISA_LEVELS[isa])


@dataclass(frozen=True)
class _Layer:
    """One call of oneDNN's LSTM primitive: one layer, one direction."""

    seq: int  # n_iter
    batch: int  # mb
    input_size: int  # slc
    hidden: int  # dhc = sic = dlc
    dt: int  # bytes of src, weights, states (f32 or bf16)
    bias_dt: int

    def states(self, ld: int, dt: int) -> int:
        """Bytes of a ``ws_*states*`` region: (n_layer + 1) x n_dir x (n_iter + 1) x mb x ld."""
        return 2 * (self.seq + 1) * self.batch * ld * dt


@dataclass(frozen=True)
class _Primitive:
    """What oneDNN asks of its caller for one LSTM layer."""

    workspace: int
    scratchpad: int
    #: Bytes of the weights in the layouts the primitive wants (layer, iter).
    weights: tuple[int, int]
    #: Whether those layouts differ from PyTorch's (so ideep reorders into new buffers).
    reorder: tuple[bool, bool]
    #: Scratchpads of those reorders (``rnn_weights_reorder_t``'s transposition buffer).
    reorder_scratch: tuple[int, int] = (0, 0)


def _uses_brgemm(cpu: CpuProfile, dt: int, prop: str) -> bool:
    """``_ref_rnn_common_t::pd_t::init``: the brgemm implementation first, else the reference one.

    ``init_brgemm`` turns down float32 training and backward, bfloat16 without
    AVX512-BF16, and any CPU below AVX2 (``brgemm_calc_isa``). The brgemm
    backward (bfloat16 on AVX512-BF16) is not modelled: the reference
    implementation's buffers stand in for it.
    """
    if prop == "backward":
        return False
    if dt == _F32:
        return prop == "forward_inference" and _mayiuse(cpu, "avx2")
    return _mayiuse(cpu, "avx512_core_bf16")


def _lstm_primitive(cpu: CpuProfile, layer: _Layer, prop: str) -> _Primitive:
    """Workspace, scratchpad and weight layouts of the LSTM primitive for ``prop``
    (``"forward_training"``, ``"forward_inference"`` or ``"backward"``)."""
    T, N, I, H, dt = layer.seq, layer.batch, layer.input_size, layer.hidden, layer.dt
    G = _LSTM_GATES
    is_fwd = prop != "backward"
    training = prop != "forward_inference"
    brgemm = _uses_brgemm(cpu, dt, prop)
    # ref_rnn.hpp: scratch_t is the accumulator type forward, the data type backward.
    scratch_dt = _F32 if is_fwd else dt

    # init_conf: leading dimensions.
    ht_ld = _good_ld(H, dt)
    gates_ld = _good_ld(G * H, dt)
    states_ld = _good_ld(max(H, I), dt)
    diff_states_ld = _good_ld(max(I, H), _F32)
    scratch_gates_ld = _good_ld(G * H, scratch_dt)
    scratch_diff_ht_ld = _good_ld(H, _F32)

    # Whether the gemms are merged across time steps (so scratch gates hold every step).
    if brgemm:
        # configure_brgemm: merged layer gemm for a single sequence (mb == 1).
        merged = N == 1 and T >= 2
    else:
        merged = (N < 128) if is_fwd else True
    n_iter_scratch_gates = T if merged else 1

    # set_workspace_sizes, in set_offsets' order: each region starts on a page.
    regions = [
        T * N * gates_ld * dt if training else 0,  # ws_gates
        T * N * ht_ld * dt if training else 0,  # ws_ht
        layer.states(states_ld, dt),  # ws_states_layer (= ws_states_iter)
        layer.states(H, dt),  # ws_states_iter_c
        layer.states(diff_states_ld, _F32) if training else 0,  # ws_diff_states_layer
        layer.states(diff_states_ld, _F32) if training else 0,  # ws_diff_states_iter
        layer.states(H, _F32) if training else 0,  # ws_diff_states_iter_c
        0,  # ws_grid_comp (lbr GRU only)
    ]
    offset = 0
    for size in regions:
        offset = _rnd_up(offset, _PAGE) + size
    workspace = offset if training else 0
    offset = 0 if training else offset
    for size in (
        scratch_dt * n_iter_scratch_gates * N * scratch_gates_ld,  # scratch_gates
        dt * N * ht_ld,  # scratch_ht
        _F32 * N * scratch_diff_ht_ld if training else 0,  # scratch_diff_ht
        0,  # scratch_cell (GRU only)
    ):
        offset = _rnd_up(offset, _PAGE) + size

    # init_scratchpad: the space above, then the weight and bias pointer arrays.
    scratchpad = _booking(offset, _PAGE)
    scratchpad += 3 * _booking(8)  # ptrs_wei_layer, _iter, _projection: one pointer each
    scratchpad += _booking(8 * layer.bias_dt)  # ptrs_bia: book<void *>(1 * bias_dt_size)
    if brgemm:
        # rnn_brgemm_base_t::init_scratchpad: one batch of K blocks per thread.
        # LSTM's K is not blocked outside AMX: one block and a tail slot per gemm,
        # twice when the layer and iteration gemms are fused (slc == sic).
        fused = I == H and not merged
        max_k_blocks = 2 * (2 if fused else 1)
        scratchpad += _booking(max_k_blocks * cpu.threads * _BRGEMM_BATCH_ELEMENT)

    # set_expected_desc: the weight layouts.
    reorder_scratch = (0, 0)
    if brgemm:
        # ldgOi32o / ldgOi16o (f32), ldgOI32o2i (bf16): output channels in blocks of
        # brgemm_calc_n_block: 2 x the simd width, 4 x for a single sequence on AVX2.
        n_block = 32 if _mayiuse(cpu, "avx512_core") or N == 1 else 16
        pad_k = 1 if dt == _F32 else 2
        weights = (
            _rnd_up(I, pad_k) * G * _rnd_up(H, n_block) * dt,
            _rnd_up(H, pad_k) * G * _rnd_up(H, n_block) * dt,
        )
        reorder = (True, True)
    elif not training and dt != _F32:
        # init_conf: bfloat16 inference packs both weights for the packed GEMM
        # (use_{layer,iter}_packed_gemm, set_pack_sizes); the layer gemm runs once
        # over every time step when merged.
        weights = (
            _bf16_pack_size(cpu.threads, G * H, N * T if merged else N, I),
            _bf16_pack_size(cpu.threads, G * H, N, H),
        )
        reorder = (True, True)
        # rnn_weights_reorder_t::pd_t::init_scratchpad: PyTorch's ldgoi is transposed
        # to ldigo before packing (key_reorder_rnn_weights_transposition).
        reorder_scratch = (_booking(I * G * H * dt), _booking(H * G * H * dt))
    else:
        # Forward: ldigo with a good leading dimension over the gates; backward:
        # ldgoi with a good leading dimension over the inputs (PyTorch's own
        # layout unless that padding changes it).
        layout = _ldigo_good if is_fwd else _ldgoi_good
        wanted = (layout(I, H, dt), layout(H, H, dt))
        weights = (_plain_bytes(wanted[0], dt), _plain_bytes(wanted[1], dt))
        reorder = (wanted[0] != _ldgoi(I, H), wanted[1] != _ldgoi(H, H))
    return _Primitive(workspace, scratchpad, weights, reorder, reorder_scratch)


# Plain (unblocked) weight layouts, as oneDNN describes them: the dimensions
# (layer, direction, input, gate, output) = (1, 1, K, 4, H) and their strides,
# with the strides of size-1 dimensions left out, since oneDNN ignores them
# when it compares layouts (type_helpers.hpp, blocking_desc_is_equal).
_Layout = tuple[tuple[int, int], ...]


def _layout(k: int, hidden: int, strides: tuple[int, int, int]) -> _Layout:
    """(size, stride) of the input, gate and output dimensions that are not of size 1."""
    dims = (k, _LSTM_GATES, hidden)
    return tuple((d, s) for d, s in zip(dims, strides) if d != 1)


def _ldgoi(k: int, hidden: int) -> _Layout:
    """PyTorch's ``weight_{ih,hh}`` ([4 * hidden, k]): oneDNN's plain ldgoi."""
    return _layout(k, hidden, (1, hidden * k, k))


def _ldigo_good(k: int, hidden: int, dt: int) -> _Layout:
    """``set_good_strides(ldigo)``: the input stride padded to a good leading dimension."""
    return _layout(k, hidden, (_good_ld(_LSTM_GATES * hidden, dt), hidden, 1))


def _ldgoi_good(k: int, hidden: int, dt: int) -> _Layout:
    """``set_good_strides(ldgoi)``: the output stride padded to a good leading dimension."""
    ld = _good_ld(k, dt)
    return _layout(k, hidden, (1, hidden * ld, ld))


def _plain_bytes(layout: _Layout, dt: int) -> int:
    """``memory_desc_wrapper::size`` of a plain layout: its largest dimension x stride."""
    return max((d * s for d, s in layout), default=1) * dt


# -- oneDNN's packed bfloat16 GEMM (src/cpu/x64/gemm) -------------------------------------

#: gemm_pack_storage_t: data blocks (and the kernels' overrun) are page aligned.
_PACK_ALIGN: Final = 0x1000
#: gemm_info_t::jit_init, bfloat16 on avx512_core (no AVX512-BF16, no AMX).
_BF16_UM, _BF16_UN, _BF16_UK = 48, 8, 1
_BF16_BM, _BF16_BK = 9984, 768
_BF16_BK_TRADITIONAL = 384
#: get_vector_length<float>() on avx512_core.
_F32_VLEN: Final = 16
#: gemm_pack_storage_t's headers: sizeof(header_t), sizeof(matrix_header_t) without its
#: slice array, sizeof(slice_header_t); each header rounded to 0x20 bytes.
_PACK_HEADER, _PACK_MATRIX_HEADER, _PACK_SLICE_HEADER = 104, 8, 48


def _pack_headers(nthr: int) -> int:
    """``gemm_pack_storage_t::setup``: the header, then a matrix and a sums header of
    one slice per thread."""
    return _rnd_up(_PACK_HEADER, 0x20) + 2 * _rnd_up(
        _PACK_MATRIX_HEADER + _PACK_SLICE_HEADER * nthr, 0x20
    )


def _f32(value: float) -> float:
    """``value`` rounded to a C ``float``."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _adjust_thread_count(m: int, n: int, k: int, nthrs: int) -> int:
    """``adjust_thread_count<float>`` (gemm_driver.cpp): fewer threads for small gemms."""
    if n > 50 and m <= 10:  # sgemm on avx512_core keeps every thread
        return nthrs
    gemm_cycles = m * n * k / (2.0 * 2.0 * _F32_VLEN) * 2.0
    i = nthrs
    if nthrs <= 4:
        omp_cycles = 3.0e3
        if gemm_cycles < omp_cycles:
            return 1
        while i > 1:
            if omp_cycles * i < gemm_cycles * (i - 1):
                break
            i -= 1
    else:
        if gemm_cycles < 4.0e3 + 2 * 5.0e2:
            return 1
        while i > 1:
            omp_cycles = 4.0e3 + i * 5.0e2
            if omp_cycles * i < gemm_cycles * (i - 1):
                break
            i -= 2 if i < 10 else 4 if i < 30 else 8
    return max(i, 1)


def _partition_2d_minblk_with_primes(
    m: int, n: int, block_m: int, block_n: int, min_m: int, min_n: int, um: int, un: int,
    nthr: int, use_aspect_ratio: bool,
) -> tuple[int, int]:
    """``partition_2d_minblk_with_primes`` (gemm_partition.hpp)."""
    part_m = max(1, m // block_m)
    part_n = max(1, n // block_n)
    if part_m == 1 and part_n >= nthr:
        return 1, min(part_n, nthr)
    if part_n == 1 and part_m >= nthr:
        return min(part_m, nthr), 1
    num_parts = part_m * part_n
    nthr_ite = nthr
    nthr_m = nthr_n = 1
    band_m, band_n = m, n
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29):
        finished = False
        while nthr_ite % p == 0 and not finished:
            nthr_ite //= p
            nthr_m_ite, nthr_n_ite = nthr_m * p, nthr_n * p
            band_m_ite, band_n_ite = band_m // p, band_n // p

            def try_partition(bm: int, bn: int, pick_small: bool) -> bool:
                nonlocal nthr_m, nthr_n, band_m, band_n
                ratio_m = _f32(_f32(band_m_ite) / _f32(bm))
                ratio_n = _f32(_f32(band_n_ite) / _f32(bn))
                do_m = do_n = False
                if ratio_m < 1.0 and ratio_n >= 1.0:
                    do_n = True
                elif ratio_m >= 1.0 and ratio_n < 1.0:
                    do_m = True
                elif ratio_m >= 1.0 and ratio_n >= 1.0:
                    if use_aspect_ratio:
                        ratio_goal = _f32(_f32(um) / _f32(un))
                        inverse = _f32(1.0 / ratio_goal)
                        try_m = _f32(_f32(_f32(band_m_ite) / _f32(band_n)) * inverse)
                        try_n = _f32(_f32(_f32(band_m) / _f32(band_n_ite)) * inverse)
                        if pick_small:
                            do_m, do_n = ratio_m < ratio_n, not ratio_m < ratio_n
                        else:
                            closer_m = abs(try_m - 1.0) < abs(try_n - 1.0)
                            do_m, do_n = closer_m, not closer_m
                    else:
                        first = (ratio_m < ratio_n) == pick_small
                        do_m, do_n = first, not first
                if do_m:
                    nthr_m, band_m = nthr_m_ite, band_m_ite
                elif do_n:
                    nthr_n, band_n = nthr_n_ite, band_n_ite
                return do_m or do_n

            if num_parts < nthr:
                num_parts *= p
                if try_partition(min_m, min_n, True):
                    continue
            if try_partition(block_m, block_n, False):
                continue
            if try_partition(min_m, min_n, True):
                continue
            finished = True
        if finished:
            break
    return nthr_m, nthr_n


def _partition_2d_minblk(
    m: int, n: int, block_m: int, block_n: int, min_m: int, min_n: int, um: int, un: int,
    nthr: int, use_aspect_ratio: bool,
) -> tuple[int, int]:
    """``partition_2d_minblk`` (gemm_partition.hpp)."""
    part_m = max(1, m // min_m)
    part_n = max(1, n // min_n)
    if part_m == 1:
        return 1, min(max(1, -(-n // min_n)), nthr)
    if part_n == 1:
        return min(max(1, -(-m // min_m)), nthr), 1
    nthr_m = nthr_n = 0
    thresh = min(0.95 * nthr, float(part_m * part_n))
    nthr_new = nthr
    while nthr_new > nthr // 2:
        if nthr_m * nthr_n >= thresh:
            break
        nthr_m, nthr_n = _partition_2d_minblk_with_primes(
            m, n, block_m, block_n, min_m, min_n, um, un, nthr_new, use_aspect_ratio
        )
        nthr_new -= 1
    return nthr_m, nthr_n


def _choose_blocking(size: int, nthr: int, block_init: int, align: int) -> tuple[int, int, int]:
    """``choose_blocking`` in set_thread_opts_pack: ``(thread size, block, threads)``."""
    thread = -(-size // nthr)
    num_blk = -(-thread // block_init)
    block = _rnd_up(-(-thread // num_blk), align)
    thread = num_blk * block
    if thread * nthr > size:
        nthr = -(-size // thread)
    return thread, block, nthr


def _bf16_pack_size(threads: int, m: int, n: int, k: int) -> int:
    """``gemm_bf16bf16f32_pack_get_size("A", "N", "N", m, n, k)``: the bytes of matrix A
    packed for ``dnnl_get_max_threads()`` (``threads``) threads (gemm_driver's measuring run:
    adjust_thread_count, set_thread_opts_pack, get_m_padd / get_k_padd, then
    gemm_pack_storage_t::finalize)."""
    if n == 1 or m == 1:
        # jump_to_gemv -> prep_gemm_pack: one unblocked, transposed copy with a
        # padded leading dimension (get_ld_padd), for one thread.
        ld = _rnd_up(k, 1024) + 32 if k != 1 else 1
        data = _rnd_up(ld * m * 2, _PACK_ALIGN)
        return _rnd_up(_pack_headers(1), _PACK_ALIGN) + data + _PACK_ALIGN
    nthrs = _adjust_thread_count(m, n, k, threads)
    # set_thread_opts_pack: k split only when m and n leave threads idle.
    nthr_k = 1
    if m // 64 + n // 64 < nthrs:
        nk = 1
        while nk <= 4 and k >= 257 * nk:
            if nthrs % nk == 0:
                nthr_k = nk
            nk += 1
        if nthr_k < 4 and k >= m * 4 and k >= n * 4 and nthrs > 10:
            nk = 1
            while nk <= 4 and k >= 257 * nk:
                if nthrs % nk <= 2:
                    nthr_k = nk
                nk += 1
    thread_k, block_k, nthr_k = _choose_blocking(k, nthr_k, _BF16_BK, max(_BF16_UK, 4))
    nthr_m, nthr_n = _partition_2d_minblk(
        m, n, 64, 64, 32, 32, _BF16_UM, _BF16_UN, nthrs // nthr_k, True
    )
    thread_m, block_m, nthr_m = _choose_blocking(m, nthr_m, _BF16_BM, _F32_VLEN)
    # update_blocking: the packed blocks follow the threads' blocks.
    bm, bk = block_m, block_k
    offset = _pack_headers(nthrs)
    # One slice of A per (m, k) thread pair, each blocked by (m_padd, k_padd).
    for ithr_k in range(nthr_k):
        for ithr_m in range(nthr_m):
            rows = min(thread_m, m - ithr_m * thread_m)
            cols = min(thread_k, k - ithr_k * thread_k)
            m_padd = _rnd_up(min(max(rows, _BF16_UM), bm), _BF16_UM)
            if cols <= _BF16_BK_TRADITIONAL:
                k_padd = max(128, _rnd_up(cols, _BF16_UK))
            elif cols < 2 * bk:
                k_padd = _rnd_up((cols + 1) // 2, _BF16_UK)
            else:
                k_padd = bk
            blocks = -(-rows // m_padd) * -(-cols // k_padd)
            block = _rnd_up(m_padd * k_padd * 2, _PACK_ALIGN)
            offset = _rnd_up(offset, _PACK_ALIGN) + blocks * block
    return offset + _PACK_ALIGN


# -- the ATen kernels ------------------------------------------------------------



def _layer(
    input: torch.Tensor, weight_ih: torch.Tensor, bias_ih: torch.Tensor, has_biases: bool
) -> _Layer:
    """``RNNParams``: the layer input is (seq, batch, features), whatever batch_first says."""
    hidden = weight_ih.shape[0] // _LSTM_GATES
    bias_dt = (bias_ih if has_biases else weight_ih).element_size()
    return _Layer(
        seq=input.shape[0],
        batch=input.shape[1],
        input_size=input.shape[2],
        hidden=hidden,
        dt=input.element_size(),
        bias_dt=bias_dt,
    )


def _bias_bytes(layer: _Layer) -> int:
    """``_shuffle_bias`` (``bias_ih + bias_hh``) or the zero bias: 4 x hidden elements."""
    return _LSTM_GATES * layer.hidden * layer.bias_dt


def _is_lstm(call: OpCall, mode_index: int) -> bool:
    # ideep::rnn_kind::LSTM; only LSTM reaches these kernels (lstm_mkldnn_stub).
    return call.args[mode_index] == 2


def _weight_reorders(primitive: _Primitive) -> list[Any]:
    """ideep's ``reorder_if_differ_in`` for each weight: a buffer in the primitive's
    layout, filled by a reorder that may take a scratchpad of its own."""
    steps: list[Any] = []
    for name, nbytes, reorder, scratch in zip(
        ("weights_layer", "weights_iter"),
        primitive.weights,
        primitive.reorder,
        primitive.reorder_scratch,
    ):
        if reorder:
            steps.append(Alloc(name, nbytes))
            if scratch:
                tag = f"{name} reorder scratchpad"
                steps += [Alloc(tag, scratch), Free(tag)]
    return steps


@CPU.implementation(aten.mkldnn_rnn_layer.default)
def _mkldnn_rnn_layer_outputs(call: OpCall) -> Any:
    """``at::native::mkldnn_rnn_layer``: the meta kernel's outputs, with the workspace
    oneDNN asks for (``pd.workspace_desc().get_size()`` bytes) when grad mode is on."""
    output, hy, cy, workspace = call.default()
    if torch.is_grad_enabled() and _is_lstm(call, 9):
        input, weight_ih, bias_ih = call.args[0], call.args[1], call.args[3]
        layer = _layer(input, weight_ih, bias_ih, call.args[12])
        nbytes = _lstm_primitive(profile_of(call), layer, "forward_training").workspace
        workspace = input.new_empty((nbytes,), dtype=torch.uint8)
    return output, hy, cy, workspace


def _onednn_3_7_gap() -> list[Inexact]:
    """torch 2.10 bundles oneDNN 3.7.1, whose LSTM primitive asks another scratchpad
    than the oneDNN 3.10 to 3.12 these rules follow (torch 2.11 to 2.15): larger in
    float32 inference (18,688 to 70,912 B more per layer in 8 shapes measured at one
    thread), and in most training steps. Its formula was not found, so every oneDNN
    LSTM layer is listed there, never a figure that may be low in silence."""
    if torch_minor() != (2, 10):
        return []
    return [
        Inexact(
            "torch 2.10's oneDNN (3.7.1) sizes the LSTM scratchpad otherwise than the "
            "modelled oneDNN 3.10-3.12 (torch 2.11 on); the figure may be low by about "
            "the scratchpad counted"
        )
    ]


@CPU.scratch(aten.mkldnn_rnn_layer.default)
def _mkldnn_rnn_layer_scratch(call: OpCall) -> Steps | None:
    """``at::native::mkldnn_rnn_layer``: the summed bias, then ideep's
    ``lstm_forward_{training,inference}::compute``: the weights reordered to the
    primitive's layouts and its scratchpad."""
    if not _is_lstm(call, 9):
        return None
    input, weight_ih, weight_hh, bias_ih = call.args[:4]
    layer = _layer(input, weight_ih, bias_ih, call.args[12])
    prop = "forward_training" if torch.is_grad_enabled() else "forward_inference"
    primitive = _lstm_primitive(profile_of(call), layer, prop)
    steps: list[Any] = [*_onednn_3_7_gap(), OUTPUTS]
    # _shuffle_weight: weight.contiguous().
    for name, weight in (("weight_ih", weight_ih), ("weight_hh", weight_hh)):
        if not weight.is_contiguous():
            steps.append(Alloc(f"{name} contiguous", nbytes_of(weight)))
    steps.append(Alloc("bias", _bias_bytes(layer)))
    steps += _weight_reorders(primitive)
    steps.append(Alloc("scratchpad", primitive.scratchpad))
    return steps


@CPU.implementation(aten.mkldnn_rnn_layer_backward.default)
def _mkldnn_rnn_layer_backward_outputs(call: OpCall) -> Any:
    """``at::native::mkldnn_rnn_layer_backward``'s outputs: float32 gradients of the
    input, weights, bias and states.

    The kernel returns the bias gradient twice, the second time as a clone made
    after its scratch is freed; here both are the same tensor, as in the meta
    kernel, and autograd's ``AccumulateGrad`` then copies it (after the kernel's
    peak, as the real clone is made). The meta kernel cannot be used as it is:
    FakeTensorMode's dispatch cache rebuilds cached outputs without that
    aliasing, so repeated traces would disagree.
    """
    if not _is_lstm(call, 14):
        return call.default()
    input, weight_ih, weight_hh, bias_ih, _bias_hh, hx, cx = call.args[:7]
    f32 = torch.float32
    diff_x = input.new_empty(input.shape, dtype=f32)
    diff_weight_ih = weight_ih.new_empty(weight_ih.shape, dtype=f32)
    diff_weight_hh = weight_hh.new_empty(weight_hh.shape, dtype=f32)
    # _shuffle_bias(weight2, weight3) or the zero bias: 4 x hidden (bias_ih's
    # first dimension, also when has_biases is false and zeros of weight_ih's
    # shape stand in for it).
    diff_bias = bias_ih.new_empty((bias_ih.shape[0],), dtype=f32)
    diff_hx = hx.new_empty(hx.shape, dtype=f32)
    diff_cx = cx.new_empty(cx.shape, dtype=f32)
    return diff_x, diff_weight_ih, diff_weight_hh, diff_bias, diff_bias, diff_hx, diff_cx


@CPU.scratch(aten.mkldnn_rnn_layer_backward.default)
def _mkldnn_rnn_layer_backward(call: OpCall) -> Steps | None:
    """``at::native::mkldnn_rnn_layer_backward``.

    Before its outputs: the gradients made contiguous (or zeros where
    undefined), the summed bias, a copy of ``cx`` when it shares ``hx``'s
    storage. After them: float32 copies of bfloat16 gradients, then ideep's
    ``lstm_backward::compute``: weights reordered where the backward layout
    differs, zero-initialised float32 weight and bias gradients in the
    primitive's layouts, and the scratchpad. ``diff_b2``, the clone of the
    bias gradient made last, is left to ``AccumulateGrad`` (see
    :func:`_mkldnn_rnn_layer_backward_outputs`).
    """
    if not _is_lstm(call, 14):
        return None
    (input, weight_ih, weight_hh, bias_ih, _bias_hh, hx, cx, output, _hy, _cy) = call.args[:10]
    grad_output, grad_hy, grad_cy = call.args[10:13]
    if grad_output is None and grad_hy is None and grad_cy is None:
        return None
    layer = _layer(input, weight_ih, bias_ih, call.args[17])
    steps: list[Any] = _onednn_3_7_gap()
    for name, grad, like in (
        ("grad_output", grad_output, output),
        ("grad_hy", grad_hy, hx),
        ("grad_cy", grad_cy, cx),
    ):
        if grad is None:
            steps.append(Alloc(f"{name} zeros", nbytes_of(like)))
        elif not grad.is_contiguous():
            steps.append(Alloc(f"{name} contiguous", nbytes_of(grad)))
    for name, weight in (("weight_ih", weight_ih), ("weight_hh", weight_hh)):
        if not weight.is_contiguous():
            steps.append(Alloc(f"{name} contiguous", nbytes_of(weight)))
    steps.append(Alloc("bias", _bias_bytes(layer)))
    if _same_storage(hx, cx):
        steps.append(Alloc("cx clone", nbytes_of(cx)))
    steps.append(OUTPUTS)
    if input.dtype != torch.float32:
        # grad_y_, grad_hy_, grad_cy_: float32 copies for the primitive.
        steps.append(Alloc("grad_y f32", output.numel() * _F32))
        steps.append(Alloc("grad_hy f32", hx.numel() * _F32))
        steps.append(Alloc("grad_cy f32", cx.numel() * _F32))
    primitive = _lstm_primitive(profile_of(call), layer, "backward")
    steps += _weight_reorders(primitive)
    # The weight gradients' layout: ldigo with a good leading dimension, float32
    # (cpu_rnn_pd.hpp, set_default_params for format any).
    G, H = _LSTM_GATES, layer.hidden
    for name, k in (("diff_weights_layer", layer.input_size), ("diff_weights_iter", H)):
        steps.append(Alloc(name, _plain_bytes(_ldigo_good(k, H, _F32), _F32)))
    steps.append(Alloc("diff_bias", G * H * _F32))
    steps.append(Alloc("scratchpad", primitive.scratchpad))
    return steps


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return False
