"""PyTorch's OpInfo samples of common ops through estimate() and measure().

A fast subset of ``benchmarks/opinfo.py``: the first two float32 CPU samples of
each op below become one-op models (``tests/opinfo_harness.py``); ``estimate``
must never raise where the real op runs, and for the ops in ``EXACT`` every
phase peak must equal ``measure``'s.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("expecttest", reason="torch's OpInfo database needs expecttest")

from pytest_torchmem.engine.torch_compat.torch_release import installed_release

from opinfo_harness import OpResult, Outcome, op_infos, op_name, run_op

SAMPLES = 2

#: The deprecations torch warns of as OpInfo's samples call the deprecated ops they cover.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore:torch\.\w+ is deprecated in favor of torch\.linalg:UserWarning"),
    pytest.mark.filterwarnings("ignore:stft with return_complex=False is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:A window was not provided:UserWarning"),
    pytest.mark.filterwarnings(r"ignore:index_reduce\(\) is in beta:UserWarning"),
]

#: Common ops whose samples the estimate matches byte for byte.
_EXACT = (
    "add",
    "sub",
    "mul",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "einsum",
    "nn.functional.linear",
    "nn.functional.relu",
    "nn.functional.silu",
    "nn.functional.leaky_relu",
    "nn.functional.hardswish",
    "nn.functional.elu",
    "nn.functional.glu",
    "sigmoid",
    "tanh",
    "exp",
    "rsqrt",
    "pow",
    "softmax",
    "log_softmax",
    "nn.functional.layer_norm",
    "nn.functional.group_norm",
    "nn.functional.batch_norm",
    "nn.functional.normalize",
    "nn.functional.conv1d",
    "nn.functional.conv2d",
    "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d",
    "nn.functional.adaptive_avg_pool2d",
    "nn.functional.pad.constant",
    "nn.functional.interpolate.nearest",
    "nn.functional.interpolate.bilinear",
    "nn.functional.embedding",
    "nn.functional.dropout",
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.cross_entropy",
    "nn.functional.nll_loss",
    "nn.functional.mse_loss",
    "nn.functional.binary_cross_entropy_with_logits",
    "cat",
    "stack",
    "reshape",
    "transpose",
    "permute",
    "flatten",
    "split",
    "expand",
    "sum",
    "mean",
    "var",
    "amax",
    "logsumexp",
    "cumsum",
    "where",
    "clamp",
    # their backward's masked_fill_ in place from torch 2.14 (autograd_paths)
    "clamp_max",
    "clamp_min",
    "fmax",
    "fmin",
    "tril",
    # backward formulas that scatter into zeros in place (autograd_paths)
    "max.reduction_with_dim",
    "topk",
    "sort",
    "index_select",
    "__getitem__",
    # LAPACK-backed linear algebra (cpu.linalg, cpu.qr, cpu.spectral)
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "geqrf",
    "linalg.cholesky",
    "linalg.cholesky_ex",
    "linalg.cond",
    "linalg.det",
    "linalg.eig",
    "linalg.eigh",
    "linalg.eigvals",
    "linalg.eigvalsh",
    "linalg.inv",
    "linalg.inv_ex",
    "linalg.ldl_factor",
    "linalg.ldl_factor_ex",
    "linalg.ldl_solve",
    "linalg.lu",
    "linalg.lu_factor",
    "linalg.lu_factor_ex",
    "linalg.lu_solve",
    "linalg.matrix_rank",
    "linalg.matrix_rank.hermitian",
    "linalg.pinv",
    "linalg.pinv.hermitian",
    "linalg.pinv.singular",
    "linalg.qr",
    "linalg.slogdet",
    "linalg.solve",
    "linalg.solve_ex",
    "linalg.solve_triangular",
    "linalg.svd",
    "linalg.svdvals",
    "linalg.tensorinv",
    "linalg.tensorsolve",
    "logdet",
    "lu",
    "lu_solve",
    "lu_unpack",
    "norm.nuc",
    "pca_lowrank",
    "pinverse",
    "qr",
    "svd",
    "svd_lowrank",
    # MKL's FFTs: _exec_fft's input copies (cpu/fft.py)
    "fft.fft",
    "fft.fft2",
    "fft.fftn",
    "fft.hfft",
    "fft.hfft2",
    "fft.hfftn",
    "fft.ifft",
    "fft.ifft2",
    "fft.ifftn",
    "fft.ihfft",
    "fft.ihfft2",
    "fft.ihfftn",
    "fft.irfft",
    "fft.irfft2",
    "fft.irfftn",
    "fft.rfft",
    "fft.rfft2",
    "fft.rfftn",
    "stft",
    # indexing and reduction kernels' counts, masks and casts (cpu/indexing.py, cpu/reduce.py)
    "count_nonzero",
    "index_reduce.mean",
    "scatter_reduce.mean",
    "_segment_reduce.lengths",
    "_segment_reduce.offsets",
    "_unsafe_masked_index",
    "_unsafe_masked_index_put_accumulate",
    "nn.functional.embedding_bag",
    "multinomial",
    "normal",
    "normal.number_mean",
    # value-dependent: exact on the values the trace knows (values.py)
    "nonzero",
    "nonzero_static",
    "argwhere",
    "masked_select",
    "combinations",
    "index_put",
    "index_fill",
    "unique",
    "unique_consecutive",
    "item",
    "narrow",
    "tensor_split",
    "equal",
    "allclose",
    "cov",
    "corrcoef",
    "nn.functional.gaussian_nll_loss",
    "nn.functional.ctc_loss",
    # backward formulas that pick their algorithm by values (cpu/formulas.py)
    "cumprod",
    "masked.cumprod",
    "linalg.vander",
    "prod",
    "masked_fill",
    "max.reduction_no_dim",
    "min.reduction_no_dim",
    "median",
    "nanmedian",
    # kernels followed op by op, missing meta kernels, and their scratch (issue 10)
    "tile",
    "repeat",
    "index_copy",
    "histc",
    "histogram",
    "histogramdd",
    "nn.functional.bilinear",
    "nn.functional.soft_margin_loss",
    "nn.functional.binary_cross_entropy",
    "nn.functional.multi_margin_loss",
    "nn.functional.multilabel_margin_loss",
    "nn.functional.linear_cross_entropy.chunked",
    "nn.functional.linear_cross_entropy.chunked_none",
    "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d",
    "nn.functional.conv_transpose3d",
    "_upsample_bilinear2d_aa",
)

#: OpInfos torch 2.14 dropped with their aten ops (``aten.cholesky``,
#: ``aten.qr``: ``torch.cholesky``/``torch.qr`` became Python wrappers of the
#: linalg ops, whose OpInfos stay in ``EXACT``); the list follows each release.
_UNTIL_2_13 = frozenset({"cholesky", "qr"})

#: OpInfos of ``F.linear_cross_entropy``, new in torch 2.13
#: (torch/nn/functional.py:3698 of 2.13.0; absent from 2.10-2.12).
_SINCE_2_13 = frozenset(
    {"nn.functional.linear_cross_entropy.chunked", "nn.functional.linear_cross_entropy.chunked_none"}
)


def _in_release(name: str) -> bool:
    release = installed_release()[:2]
    if name in _UNTIL_2_13:
        return release <= (2, 13)
    if name in _SINCE_2_13:
        return release >= (2, 13)
    return True


EXACT = tuple(name for name in _EXACT if _in_release(name))

#: Common ops traced without raising whose samples are not yet exact, and why.
TRACED = (
    "nn.functional.gelu",  # oneDNN reorders a broadcast output gradient (sum's backward)
    "matrix_exp",  # the Taylor degree and scaling are chosen from the norms (listed)
    "linalg.householder_product",  # backward keeps per-column gradients for a cat (listed)
    "ormqr",  # the same backward (listed)
    "isin",  # the sort-based kernel's unique copies (value-dependent)
    "masked_scatter",  # its backward's masked_select (value-dependent)
)


@pytest.fixture(scope="module")
def ops() -> dict[str, Any]:
    return {op_name(op): op for op in op_infos()}


def _explain(result: OpResult) -> str:
    lines = [f"{result.op} ({result.dtype}): {result.outcome}"]
    for i, sample in enumerate(result.samples):
        lines.append(
            f"  sample {i}: {sample.outcome} estimate={sample.estimate} measure={sample.measure} "
            f"{sample.error} {sample.unsupported}"
        )
    return "\n".join(lines)


def _compared(result: OpResult) -> list[Outcome]:
    return [
        s.outcome
        for s in result.samples
        if s.outcome not in (Outcome.MEASURE_FAILED, Outcome.SKIPPED)
    ]


@pytest.mark.parametrize("name", EXACT)
def test_estimate_equals_measure(ops: dict[str, Any], name: str) -> None:
    result = run_op(ops[name], torch.float32, limit=SAMPLES)
    compared = _compared(result)
    assert compared, _explain(result)
    assert all(outcome is Outcome.EXACT for outcome in compared), _explain(result)


@pytest.mark.parametrize("name", TRACED)
def test_estimate_does_not_raise(ops: dict[str, Any], name: str) -> None:
    result = run_op(ops[name], torch.float32, limit=SAMPLES)
    compared = _compared(result)
    assert compared, _explain(result)
    assert Outcome.RAISED not in compared, _explain(result)


def test_lists_name_real_opinfos(ops: dict[str, Any]) -> None:
    """A renamed OpInfo would otherwise drop out of the subset unnoticed."""
    assert not set(EXACT + TRACED) - set(ops)
