"""CUDA autocast's op lists per torch release (lower precision, fp32, promote, banned) and the casts they make.

``aten/src/ATen/autocast_mode.cpp``/``.h``: the lower-precision, fp32,
fp32-with-dtype, promote and banned lists of the ``AutocastCUDA`` kernels, with
the cache of cast leaf weights (``cached_cast``, kept by the router); the C++
composites that hide listed ops are replayed (``cross_entropy_loss``:
``log_softmax`` in the input dtype, ``nll_loss`` in fp32; ``_cudnn_rnn``:
AutocastRNN.cpp's fp16 casts, in :mod:`.rnn`). The router applies
:data:`AUTOCAST`'s policy to a call before its route, while a CUDA autocast
region is active.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor as _release
from pytest_torchmem.engine.tracing.devices.cuda.routes import (
    LinalgFunctions,
    NNFunctions,
    Router,
    TensorBase,
    VariableFunctions,
    bind,
    eligible,
    route,
)

__all__ = ["AUTOCAST", "Policy", "autocast_policy"]

Policy = Callable[[Router, torch.dtype, tuple[Any, ...], dict[str, Any]], "tuple[tuple[Any, ...], dict[str, Any]]"]


def _cast_all(router: Router, to: torch.dtype, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast every eligible argument, last argument first: autocast's wrapper casts
    them in a C++ pack expansion, which GCC evaluates right to left (a CUDA build
    casts ``linear``'s bias, then weight, then input; ``benchmarks/cuda_routing.py``)."""
    values = [*args, *kwargs.values()]
    cast = [router.cast(value, to, lower) for value in reversed(values)][::-1]
    return tuple(cast[: len(args)]), dict(zip(kwargs, cast[len(args) :]))


def _lower_precision(router: Router, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy::lower_precision_fp``: every eligible tensor to the autocast dtype."""
    return _cast_all(router, lower, lower, args, kwargs)


def _fp32(router: Router, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy::fp32``: every eligible tensor to float32."""
    return _cast_all(router, torch.float32, lower, args, kwargs)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def _fp32_set_opt_dtype(router: Router, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy::fp32_set_opt_dtype``: when the first argument is eligible and no
    dtype was given, the op is asked for a float32 result."""
    if not eligible(_first_tensor(args, kwargs)):
        return args, kwargs
    if kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args):
        return args, kwargs
    return args, {**kwargs, "dtype": torch.float32}


def _promote(router: Router, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy::promote``: the widest eligible type (float32 if any eligible
    argument is float32, else the autocast dtype) for every eligible tensor."""
    to = lower
    for a in (*args, *kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        if any(eligible(t) and t.dtype == torch.float32 for t in items):
            to = torch.float32
    return _cast_all(router, to, lower, args, kwargs)


def _banned(router: Router, lower: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``CastPolicy`` ``banned`` (binary_cross_entropy): autocast refuses it."""
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast."
    )


_LOWER_PRECISION_OPS: Final = (
    "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d "
    "convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm "
    "chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
    "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention "
    "cudnn_convolution cudnn_convolution_transpose __matmul__ __rmatmul__"
)
_FP32_OPS: Final = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__ __rpow__ "
    "softplus layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity "
    "poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d nll_loss_nd hinge_embedding_loss kl_div "
    "l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss "
    "triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist _cdist_forward "
    "renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d "
    "_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d "
    "upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
)
#: fp32-list entries of some releases only (each release's AutocastCUDA kernels, as
#: ``torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA")`` lists them):
#: ``rms_norm`` from 2.12 (beside ``native_layer_norm`` in ``AT_FORALL_FP32``),
#: ``linalg_matrix_sqrth`` from 2.14 (new then; it refuses half types).
_FP32_OPS_SINCE: Final = {"rms_norm": (2, 12), "linalg_matrix_sqrth": (2, 14)}
_FP32_SET_OPT_DTYPE_OPS: Final = (
    "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm"
)
_PROMOTE_OPS: Final = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"


def _bindings(name: str) -> list[Any]:
    """The C-level callables that are bindings of the aten op ``name``."""
    found = []
    homes: list[tuple[Any, str]] = [
        (VariableFunctions, name),
        (NNFunctions, name),
        (TensorBase, name),
    ]
    if name.startswith("linalg_"):
        homes.append((LinalgFunctions, name))
    for home, attr in homes:
        func = getattr(home, attr, None)
        if func is not None and type(func) is not types.FunctionType and func not in found:
            found.append(func)
    return found


def _table() -> dict[Any, Policy]:
    table: dict[Any, Policy] = {}
    for names, policy in (
        (_LOWER_PRECISION_OPS, _lower_precision),
        (_FP32_OPS, _fp32),
        (" ".join(n for n, since in _FP32_OPS_SINCE.items() if _release() >= since), _fp32),
        (_FP32_SET_OPT_DTYPE_OPS, _fp32_set_opt_dtype),
        (_PROMOTE_OPS, _promote),
        ("binary_cross_entropy", _banned),
    ):
        for name in names.split():
            for func in _bindings(name):
                table.setdefault(func, policy)
    return table


#: Torch-function entry point -> autocast policy, for the ops autocast_mode.cpp lists for CUDA.
AUTOCAST: Final[dict[Any, Policy]] = _table()


def autocast_policy(func: Any) -> str | None:
    """The name of the autocast policy applied to ``func`` on cuda (for tests and docs)."""
    policy = AUTOCAST.get(func)
    return None if policy is None else policy.__name__.lstrip("_")


@route(NNFunctions.cross_entropy_loss)
def _cross_entropy(router: Router, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cross_entropy_loss`` (LossNLL.cpp) under CUDA autocast: the composite calls
    ``log_softmax(self, 1, self.scalar_type())`` (its dtype given, so it stays in
    the input dtype) and ``nll_loss_nd`` -> ``nll_loss`` (fp32 list: the log
    probabilities are cast to float32). Other targets and label smoothing run as traced."""
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    input, target, weight, reduction, ignore_index, smoothing = bind(
        args, kwargs, names, (None, 1, -100, 0.0)
    )
    if (
        router.autocast_dtype() is None
        or not eligible(input)
        or input.dim() < 1
        or target.is_floating_point()
        or smoothing > 0.0
    ):
        return func(*args, **kwargs)
    lower = router.autocast_dtype()
    assert lower is not None
    class_dim = 0 if input.dim() == 1 else 1
    logp = torch.log_softmax(input, class_dim, dtype=input.dtype)
    logp = router.cast(logp, torch.float32, lower)
    weight = router.cast(weight, torch.float32, lower)
    return NNFunctions.nll_loss_nd(logp, target, weight, reduction, ignore_index)
