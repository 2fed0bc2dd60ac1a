"""The trace's side of sparse tensors: which calls have them, and what a call on one raises.

A call with a sparse argument is traced by the device's sparse rules
(``rules.py``); these helpers tell the tracker which calls those are (cheaply:
it asks only once a sparse tensor is in the step), fake a sparse tensor met
outside the model and the inputs, and find, where the fake kernel of a call on
a sparse tensor refuses it, what the real kernel raises for the same arguments:
the program's error (``nn.LayerNorm`` on a sparse input raises eagerly), not
the fake kernel's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import torch

from pytest_torchmem.engine.user.layouts import parts, sparse_like
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.rules import OpCall
from pytest_torchmem.engine.tracing.values import MAX_NUMEL

__all__ = ["eager_refusal", "fake_sparse_like", "quiet_meta_failures", "sparse_among", "sparse_in"]

# torch's private names (engine/torch_compat/torch_private.py)
_DisableTorchDispatch: Final = private("torch._C._DisableTorchDispatch")
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
FakeTensorMode: Final = private("torch._subclasses.fake_tensor.FakeTensorMode")

_STRIDED: Final = torch.strided


def sparse_among(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a tensor among an op's arguments (or in a list of them) is sparse."""
    for value in args:
        kind = type(value)
        if kind is FakeTensor:
            if value.layout is not _STRIDED:
                return True
        elif kind is list or kind is tuple:
            if sparse_among(value, {}):
                return True
        elif isinstance(value, torch.Tensor) and value.layout is not _STRIDED:
            return True
    return bool(kwargs) and sparse_among(tuple(kwargs.values()), {})


def sparse_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The sparse tensors among an op's arguments (and in lists of them)."""
    found = []
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.layout is not _STRIDED:
                found.append(t)
    return found


def fake_sparse_like(
    t: torch.Tensor, device: torch.device, fake_part: Callable[[torch.Tensor, torch.device], torch.Tensor]
) -> torch.Tensor | None:
    """A fake COO tensor like the real ``t``, its parts made by ``fake_part(part, device)``
    (with a fake mode active); None for another layout (which then fails as fake
    tensors do)."""
    if t.layout is not torch.sparse_coo:
        return None
    with _DisableTorchDispatch():  # the real tensor's own parts
        held = parts(t)
    return sparse_like(t, tuple(fake_part(part, device) for part in held), device)


class _MetaFailure(logging.Filter):
    """Drops the fake mode's log of a meta kernel that raised: the trace reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


_META_FAILURE: Final = _MetaFailure()


@contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """The fake mode logs (at error level, with a traceback) every meta kernel that
    raises; for an op on a sparse tensor the trace says what happened instead."""
    log = logging.getLogger(FakeTensorMode.__module__)
    log.addFilter(_META_FAILURE)
    try:
        yield
    finally:
        log.removeFilter(_META_FAILURE)


def eager_refusal(call: OpCall) -> BaseException | None:
    """What the real kernel raises for ``call``'s arguments, run on small real stand-ins
    of them (zeros; a sparse tensor with no element), or None where it accepts them or
    they are too large to make (more than ``values.MAX_NUMEL`` elements)."""
    try:
        args, kwargs = _probe_args(call.args), _probe_args(call.kwargs)
    except OverflowError:
        return None
    try:
        with _DisableTorchDispatch(), torch.no_grad():
            call.func(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the real kernel's refusal is what is wanted
        return exc
    return None


def _probe_args(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _probe_args(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_probe_args(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    with _DisableTorchDispatch():
        if value.layout is torch.sparse_coo:
            return torch.sparse_coo_tensor(
                torch.zeros((value.sparse_dim(), 0), dtype=torch.long),
                torch.zeros((0, *value.shape[value.sparse_dim() :]), dtype=value.dtype),
                value.shape,
                check_invariants=False,
            )
        if value.layout is not _STRIDED or value.numel() > MAX_NUMEL:
            raise OverflowError
        return torch.zeros(value.shape, dtype=value.dtype).requires_grad_(value.requires_grad)
