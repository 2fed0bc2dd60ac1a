"""Every private torch name the engine reads or replaces, in one table.

torch promises nothing of its private names (``torch._prims_common``,
``torch._inductor``, ``torch._C._...``): a minor release moves, renames or
removes them. The engine reaches them through this module only, so that each
one is written down once, with why it is used and in which releases it exists,
and is checked against the running torch when first used:

- :func:`private` resolves a dotted path (``"torch._prims_common.suggest_memory_format"``);
- :func:`replacing` replaces one at run time and always puts it back;
- :func:`private_op` gives an aten overload that only some releases have (None elsewhere).

A path missing from the running torch raises :class:`TorchPrivateError`, one
line that names it, what it served and the supported window, never an
``AttributeError`` from deep inside a rule. ``tests/test_torch_private.py``
resolves every entry on the running torch, and CI runs it on every release of
the window.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from pytest_torchmem.engine.torch_release import (
    SUPPORTED,
    TorchReleaseError,
    installed_release,
    supported_range,
)

__all__ = [
    "PRIVATE",
    "Private",
    "TorchPrivateError",
    "present",
    "private",
    "private_any",
    "private_op",
    "replacing",
]

Release = tuple[int, int]


class TorchPrivateError(TorchReleaseError):
    """A private torch name the engine needs is not in the running torch."""


@dataclass(frozen=True)
class Private:
    """One private torch name: its dotted ``path``, ``why`` the engine uses it,
    the releases that have it as used (``since``/``until``, both included;
    None: the whole window), and whether the engine replaces it at run time."""

    path: str
    why: str
    since: Release | None = None
    until: Release | None = None
    replaced: bool = False

    def expected(self, release: Release) -> bool:
        """Whether torch ``release`` (major, minor) has this name as used."""
        return (self.since is None or release >= self.since) and (
            self.until is None or release <= self.until
        )


def _entries(*entries: Private) -> dict[str, Private]:
    table: dict[str, Private] = {}
    for entry in entries:
        if entry.path in table:
            raise ValueError(f"{entry.path} is in the table twice")
        table[entry.path] = entry
    return table


#: The table: private path -> its entry.
PRIVATE: Final = _entries(
    # -- strides and memory formats (the prims' reference helpers) ------------------
    Private(
        "torch._prims_common.suggest_memory_format",
        "the memory format a kernel's output takes (conv, pool, norm, padding rules)",
    ),
    Private(
        "torch._prims_common.make_contiguous_strides_for",
        "the strides of a contiguous buffer a kernel allocates (FFT rules)",
    ),
    Private(
        "torch._prims_common.make_channels_last_strides_for",
        "the strides of a channels-last buffer a kernel allocates (conv rules)",
    ),
    Private(
        "torch._prims_common.are_strides_like_channels_last_or_false",
        "whether a tensor's strides read as channels-last (conv rules)",
    ),
    Private(
        "torch._prims_common.compute_elementwise_output_strides",
        "the strides TensorIterator gives an elementwise output (misc rules)",
    ),
    Private(
        "torch._prims_common.is_non_overlapping_and_dense_or_false",
        "whether a tensor is dense, as TensorIterator and cuBLAS ask (indexing, BLAS rules); "
        "earlier releases name it is_non_overlapping_and_dense",
        since=(2, 12),
    ),
    Private(
        "torch._prims_common.is_non_overlapping_and_dense",
        "the earlier name of is_non_overlapping_and_dense_or_false",
        until=(2, 11),
    ),
    # -- torch-function modes --------------------------------------------------------
    Private(
        "torch.overrides.redispatch_function",
        "runs a Python-level torch function's body with a routing mode active (device routers); "
        "earlier releases run a copy of the body whose own check answers no",
        since=(2, 13),
    ),
    # -- parallel (DDP, FSDP2, DTensor) -----------------------------------------------
    Private(
        "torch.testing._internal.distributed.fake_pg.FakeStore",
        "the store of the fake process group the estimate's ranks join (parallel.py)",
    ),
    Private(
        "torch.nn.parallel.distributed._verify_param_shape_across_processes",
        "DDP reads every rank's parameter shapes as data, which fake tensors have none of: "
        "skipped under the fake process group",
        replaced=True,
    ),
    Private(
        "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached",
        "DTensor runs each op on fake tensors of the global shapes to derive its output's: "
        "run out of the tracker's sight (a rank allocates nothing for it)",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._validate_no_meta_params",
        "FSDP2 refuses parameters on meta, where the fake cuda device traces: lifted for the trace",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param.free_storage",
        "FSDP2 frees an unsharded parameter with storage.resize_(0), which no dispatch mode sees",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage",
        "FSDP2 makes an unsharded parameter again with storage.resize_(nbytes), unseen as its free",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group.alloc_storage",
        "the same function as _fsdp_param.alloc_storage, imported by name into the group's module",
        replaced=True,
    ),
    Private(
        "torch._C._distributed_c10d._create_work_from_future",
        "a completed work item, returned by a collective that measure(parallel=...) ran to its end",
    ),
    Private(
        "torch.utils._python_dispatch._disable_current_modes",
        "DTensor's sharding propagation runs with the tracker's modes off",
    ),
)


def _release() -> Release:
    major, minor, _ = installed_release()
    return major, minor


def entry(path: str) -> Private:
    """The table's entry for ``path`` (a :class:`KeyError` names a path missing from it)."""
    try:
        return PRIVATE[path]
    except KeyError:
        raise KeyError(f"{path} is not in pytest_torchmem.engine.torch_private.PRIVATE: add it there") from None


def _resolve(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            value = getattr(value, name)
        return value
    raise ImportError(path)


_resolved: dict[str, Any] = {}


def _missing(path: str, cause: BaseException) -> TorchPrivateError:
    import torch

    why = entry(path).why
    return TorchPrivateError(
        f"torch {torch.__version__} has no {path} ({why}; {type(cause).__name__}: {cause}); "
        f"pytest-torchmem supports torch {supported_range()}"
    )


def private(path: str) -> Any:
    """The private torch object at ``path``, an entry of :data:`PRIVATE`.

    Raises :class:`TorchPrivateError` where the running torch does not have it.
    """
    try:
        return _resolved[path]
    except KeyError:
        pass
    entry(path)
    try:
        value = _resolve(path)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from None
    _resolved[path] = value
    return value


def private_any(*paths: str) -> Any:
    """The first of ``paths`` (entries of :data:`PRIVATE`: one name as releases
    spell it) that the running torch has."""
    for path in paths[:-1]:
        if present(path):
            return private(path)
    return private(paths[-1])


def present(path: str) -> bool:
    """Whether the running torch has the private name at ``path`` (an entry of :data:`PRIVATE`)."""
    try:
        private(path)
    except TorchPrivateError:
        return False
    return True


def private_op(name: str) -> Any:
    """The aten overload ``name`` (``"cholesky.default"``) where the running torch
    has it, else None: for rules of ops that some releases of the window removed
    or added (a rule registered for None is skipped)."""
    import torch

    packet, _, overload = name.partition(".")
    try:
        return getattr(getattr(torch.ops.aten, packet), overload or "default")
    except AttributeError:
        return None


@contextmanager
def replacing(path: str, value: Any) -> Iterator[Any]:
    """Replace the private torch attribute at ``path`` with ``value`` for the block,
    yielding the original; it is put back however the block ends."""
    owner_path, _, name = path.rpartition(".")
    if not entry(path).replaced:
        raise ValueError(f"{path} is not marked replaced=True in PRIVATE")
    original = private(path)
    owner = _resolve(owner_path)
    had_own = name in getattr(owner, "__dict__", {})
    own = owner.__dict__[name] if had_own else None
    setattr(owner, name, value)
    try:
        yield original
    finally:
        if had_own:
            setattr(owner, name, own)
        else:
            delattr(owner, name)


def window() -> tuple[Release, Release]:
    """The supported window, first and last minor release."""
    return SUPPORTED
