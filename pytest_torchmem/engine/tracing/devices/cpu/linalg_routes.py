"""The CPU router's linear-algebra routes: composites that take another path for a
tensor subclass, which fake tensors are (``LinearAlgebra.cpp``,
``BatchLinearAlgebra.cpp``, torch 2.13).

* **Values only.** ``linalg_svdvals``, ``linalg_eigvalsh`` and ``svd(compute_uv=False)``
  compute the singular or eigen vectors only when the input may need a
  gradient (``_may_require_fw_or_bw_grad``: grad mode and ``requires_grad``, or
  a tensor subclass). Where the real input needs none, these calls and the
  composites that call them (``matrix_rank``, ``cond``, ``matrix_norm``,
  ``linalg.norm``, ``nuclear_norm``) run with :data:`VALUES_ONLY` counted in the
  trace's memo; the CPU rules of ``_linalg_svd`` and ``_linalg_eigh`` then skip
  the vectors, as the real kernels do.
* **eigvals.** ``linalg_eigvals`` calls ``linalg_eig`` (values and vectors) for a
  subclass, ``_linalg_eigvals`` (no vectors, no finiteness check) otherwise.
* **matrix_rank.** ``matrix_rank_impl`` sums ``S > tol`` into the ``int64`` result
  it allocated first (``sum_out``); for a subclass it allocates the sum anew.
  The route runs the composite's steps here, with ``sum(..., out=result)``.
  (``out=`` results are resized by ``sum``, as ``resize_output`` would.)
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.tracing.rules import TraceContext

__all__ = ["VALUES_ONLY", "values_only", "LINALG_ROUTES"]

#: Key of :attr:`TraceContext.memo`: how many routed values-only calls are running.
VALUES_ONLY: Final = "cpu.linalg.values_only"


def values_only(memo: dict[str, Any]) -> bool:
    """Whether a routed composite whose real input needs no gradient is running."""
    return memo.get(VALUES_ONLY, 0) > 0


def _input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _needs_grad(t: torch.Tensor | None) -> bool:
    """``_may_require_fw_or_bw_grad`` of a plain tensor (forward AD aside)."""
    return t is None or (torch.is_grad_enabled() and t.requires_grad)


class _ValuesOnly:
    """Counts a values-only call in the trace's memo while it runs."""

    def __init__(self, context: TraceContext) -> None:
        self.memo = context.memo

    def __enter__(self) -> None:
        self.memo[VALUES_ONLY] = self.memo.get(VALUES_ONLY, 0) + 1

    def __exit__(self, *exc: object) -> None:
        self.memo[VALUES_ONLY] -= 1


def _values(context: TraceContext, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _needs_grad(_input(args, kwargs)):
        return func(*args, **kwargs)
    with _ValuesOnly(context):
        return func(*args, **kwargs)


def _svd(context: TraceContext, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``svd(A, some, compute_uv)``: values only when ``compute_uv`` is false."""
    compute_uv = args[2] if len(args) > 2 else kwargs.get("compute_uv", True)
    if compute_uv:
        return func(*args, **kwargs)
    return _values(context, func, args, kwargs)


def _eigvals(context: TraceContext, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    A = _input(args, kwargs)
    if _needs_grad(A) or set(kwargs) - {"input"} or len(args) != (0 if "input" in kwargs else 1):
        return func(*args, **kwargs)
    return torch.ops.aten._linalg_eigvals.default(A)


def _epsilon(dtype: torch.dtype) -> float:
    """``_get_epsilon`` of the real dtype of ``dtype``."""
    real = torch.empty((), dtype=dtype, device="meta").real.dtype if dtype.is_complex else dtype
    return torch.finfo(real).eps


def _matrix_rank(context: TraceContext, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``linalg_matrix_rank`` (``LinearAlgebra.cpp``), step by step: the ``int64``
    result (or ``out``), ``get_atol_rtol``, the singular (or absolute eigen) values,
    ``tol = max(atol, rtol * max(S))`` and ``sum_out(result, S > tol, -1)``. Arguments
    no overload takes run as they are (and raise as they do)."""
    bound = dict(zip(("A", "tol", "hermitian"), args))
    for key, value in kwargs.items():
        bound["A" if key == "input" else key] = value
    A, tol, out = bound.get("A"), bound.get("tol"), bound.get("out")
    atol, rtol, hermitian = bound.get("atol"), bound.get("rtol"), bound.get("hermitian", False)
    tolerances = (tol, atol, rtol)
    tensors = any(isinstance(v, torch.Tensor) for v in tolerances)
    if (
        not isinstance(A, torch.Tensor)
        or set(bound) - {"A", "tol", "atol", "rtol", "hermitian", "out"}
        or not isinstance(hermitian, bool)
        or (tol is not None and (atol is not None or rtol is not None))
        or (tensors and not all(v is None or isinstance(v, torch.Tensor) for v in tolerances))
        or A.dim() < 2
        or A.is_complex()
    ):
        return _values(context, func, args, kwargs)
    with _ValuesOnly(context) if not _needs_grad(A) else _Nothing():
        result = out if out is not None else torch.empty(A.shape[:-2], dtype=torch.long, device=A.device)
        if isinstance(tol, torch.Tensor):
            atol_t, rtol_t = tol, torch.zeros((), dtype=tol.dtype, device=tol.device)
        elif tol is not None:
            atol_t, rtol_t = _atol_rtol(A, tol, 0.0, tensors=False)
        else:
            atol_t, rtol_t = _atol_rtol(A, atol, rtol, tensors or atol is rtol is None)
        if A.numel() == 0:
            return result.fill_(0)
        if not hermitian:
            S = torch.linalg.svdvals(A)
            max_S = S.narrow(-1, 0, 1)
        else:
            S = torch.linalg.eigvalsh(A).abs()
            max_S = S.amax(dim=-1, keepdim=True)
        limit = torch.max(atol_t.unsqueeze(-1), rtol_t.unsqueeze(-1) * max_S)
        return torch.sum(S > limit, dim=-1, out=result)


def _atol_rtol(A: torch.Tensor, atol: Any, rtol: Any, tensors: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_atol_rtol`` (``LinearAlgebra.cpp``): the ``Tensor?`` overload (also the
    one both ``None`` bind to) or the ``float?`` one."""
    options: dict[str, Any] = {"dtype": torch.float64, "device": A.device}
    default = _epsilon(A.dtype) * max(A.shape[-1], A.shape[-2])
    if not tensors:
        rtol_value = rtol if rtol is not None else (0.0 if atol is not None and atol > 0.0 else default)
        return (
            torch.full((), atol if atol is not None else 0.0, **options),
            torch.full((), rtol_value, **options),
        )
    atol_t = atol if atol is not None else torch.zeros((), **options)
    if rtol is not None:
        return atol_t, rtol
    default_rtol = torch.full((), default, **options)
    if atol is None:
        return atol_t, default_rtol
    zeros = torch.zeros((), **options)
    return atol_t, torch.where(atol > 0, zeros, default_rtol)


class _Nothing:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


#: torch function -> route (``(context, func, args, kwargs) -> result``).
LINALG_ROUTES: Final[dict[Any, Any]] = {
    torch.linalg.svdvals: _values,
    torch.linalg.eigvalsh: _values,
    torch.linalg.cond: _values,
    torch.linalg.matrix_norm: _values,
    torch.linalg.norm: _values,
    torch.nuclear_norm: _values,
    torch.svd: _svd,
    torch.Tensor.svd: _svd,
    torch.linalg.eigvals: _eigvals,
    torch.linalg.matrix_rank: _matrix_rank,
}
