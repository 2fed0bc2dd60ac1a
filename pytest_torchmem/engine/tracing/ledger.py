"""The storages of one trace: each recorded once when it is made, and freed when its last reference dies.

The ledger keeps the trace's :class:`~pytest_torchmem.engine.figures.timeline.Timeline`:
every storage the step makes or finds live before it, keyed by its identity
(views and in-place results share their base's storage and cost nothing), with
a weak reference that frees it exactly when the eager program would drop its
last reference; the buffers rules add for a kernel (workspace, scratch), which
live as long as the rule says; storages resized in place; and the allocator
pool new storages are charged to (a stream's, a CUDA graph's). Who made a
storage and when (the op, the phase, the module) is told by the tracker.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Final

import torch

from pytest_torchmem.engine.user.layouts import parts
from pytest_torchmem.engine.figures.report import Category
from pytest_torchmem.engine.figures.timeline import Phase, StorageInfo, Timeline
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.user.user_code import runner_dirs, user_frames

__all__ = ["StorageLedger", "autograd_node"]

_current_autograd_node: Final = private("torch._C._current_autograd_node")
_STRIDED: Final = torch.strided


def autograd_node() -> str:
    """The name of the autograd node being run (``MmBackward0``), or ``""`` outside backward."""
    node = _current_autograd_node()
    return "" if node is None else node.name()


class StorageLedger:
    """The storages of one trace on ``device`` (see the module).

    ``record_frames`` keeps the user's frames of every allocation
    (:attr:`StorageInfo.frames`); ``on_sparse()`` is called when a sparse tensor's
    parts are recorded (the tracker looks at its ops' arguments from then on).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        record_frames: bool = False,
        module_names: list[str] | None = None,
        on_sparse: Callable[[], None] = lambda: None,
    ) -> None:
        self.device: Final = device
        self.timeline = Timeline(module_names=list(module_names or ()))
        self.record_frames: Final = record_frames
        self._outer_dirs = runner_dirs() if record_frames else ()
        self._on_sparse = on_sparse
        #: The allocator pool new storages are charged to (see StorageInfo.pool): a
        #: CUDA graph's private pool while a program compiled with CUDA graphs runs,
        #: a stream's while the program runs on a side stream (parallel=: FSDP2's).
        self.pool = 0
        self._live: dict[int, int] = {}  # storage _cdata -> sid
        self._refs: dict[int, Any] = {}  # sid -> weak reference keeping the callback
        self._on_freed = self._freed  # (one bound method for every storage's reference)
        self._resized: dict[int, int] = {}  # sid -> bytes after its last resize

    def storage(self, sid: int) -> Any:
        """The storage ``sid`` if it is live (its object), else None."""
        ref = self._refs.get(sid)
        return ref() if isinstance(ref, _StorageRef) else None

    def storage_id(self, t: torch.Tensor) -> int | None:
        """The sid of ``t``'s storage if the ledger knows it."""
        try:
            return self._live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None

    def pool_of(self, t: torch.Tensor) -> int | None:
        """The allocator pool of ``t``'s storage, if the ledger knows it."""
        sid = self.storage_id(t)
        return None if sid is None else self.timeline.storages[sid].pool

    def charge_to(self, pool: int) -> int:
        """Charge the storages made from now on to ``pool`` (a stream's, a CUDA graph's:
        see :attr:`pool`); the pool charged before."""
        before, self.pool = self.pool, pool
        return before

    def live_since(self, first: int) -> list[int]:
        """The sids of the storages made since sid ``first`` that are still live."""
        return sorted(sid for sid in self._live.values() if sid >= first)

    def track(
        self, t: torch.Tensor, category: Category | None, op: str, phase: Phase | None, module: int
    ) -> int | None:
        """Record ``t``'s storage (a sparse tensor's parts) if it is new: allocated now by
        ``op`` in ``phase`` and ``module``, or (``op`` empty) live before the step with
        the role ``category``. Its sid (a sparse tensor's first part's), or None."""
        if t.layout is not _STRIDED:
            # a sparse tensor's memory is its parts' storages (the first one's sid is returned)
            self._on_sparse()
            sids = [self.track(part, category, op, phase, module) for part in parts(t)]
            return sids[0] if sids else None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # nested: no single storage
            return None
        key = storage._cdata
        sid = self._live.get(key)
        if sid is not None:
            return sid
        pool = self.pool if op else 0
        info = StorageInfo(storage.nbytes(), category, phase, module, op, (), "", pool)
        if self.record_frames and op:
            info.frames = user_frames(stop=self._outer_dirs)
            info.node = autograd_node()
        # (an op's output is allocated as it is made; a storage adopted before the step is not)
        sid = self.timeline.new_allocation(info) if op else self.timeline.new_storage(info)
        self._watch(storage, key, sid)
        return sid

    def bind(self, t: torch.Tensor, sid: int) -> None:
        """``t``'s storage, new, is the storage ``sid`` (allocated already: a replayed
        one, replay.py): freed when its last reference dies."""
        storage = t.untyped_storage()
        self._watch(storage, storage._cdata, sid)

    def unbind(self, sid: int) -> Any:
        """Stop watching the storage ``sid`` (a replay records its free itself): its
        object, or None."""
        ref = self._refs.pop(sid, None)
        if not isinstance(ref, _StorageRef):
            return None
        if self._live.get(ref.key) == sid:
            del self._live[ref.key]
        return ref()

    def _watch(self, storage: Any, key: int, sid: int) -> None:
        self._live[key] = sid
        ref = self._refs[sid] = _StorageRef(storage, self._on_freed)
        ref.key, ref.sid = key, sid

    def holds(self, sid: int) -> bool:
        """Whether something the program holds keeps ``sid`` alive (a tensor, or an
        object :meth:`release_with` watches)."""
        return sid in self._refs

    def nbytes_now(self, sid: int) -> int:
        """The bytes of ``sid`` now (after its last resize)."""
        return self._resized.get(sid, self.timeline.storages[sid].nbytes)

    def _freed(self, ref: _StorageRef) -> None:
        key, sid = ref.key, ref.sid
        if self._live.get(key) == sid:
            del self._live[key]
        self._refs.pop(sid, None)
        self.timeline.free(sid)

    def _sized(self, t: torch.Tensor) -> tuple[int, int, int] | None:
        """``(sid, bytes now, bytes last charged)`` of ``t``'s live storage, or None."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        sid = self._live.get(storage._cdata)
        if sid is None:
            return None
        return sid, storage.nbytes(), self._resized.get(sid, self.timeline.storages[sid].nbytes)

    def storage_resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (``untyped_storage().resize_``): to 0
        it is freed, from 0 it is a new block."""
        found = self._sized(t)
        if found is None:
            return
        sid, nbytes, before = found
        if nbytes != before:
            self.timeline.resize(sid, nbytes)
            self._resized[sid] = nbytes

    def grown(self, t: torch.Tensor) -> None:
        """An op that writes ``t`` may have grown its storage (``resize_``, an ``out=``
        argument): the allocator gives a new block and frees the old one after the copy."""
        found = self._sized(t)
        if found is None:
            return
        sid, nbytes, before = found
        if nbytes > before:
            self.timeline.resize(sid, nbytes)
            self._resized[sid] = nbytes

    def workspace(
        self, nbytes: int, category: Category | None, op: str, phase: Phase | None, module: int
    ) -> int:
        """A new storage for a buffer a rule allocates for ``op`` (not yet allocated); its sid."""
        info = StorageInfo(
            nbytes=nbytes,
            category=category,
            phase=phase,
            module=module,
            op=op,
            frames=user_frames(stop=self._outer_dirs) if self.record_frames else (),
            node=autograd_node() if self.record_frames else "",
            pool=self.pool,
        )
        return self.timeline.new_storage(info)

    def scratch_since(self, first: int) -> None:
        """The storages made since sid ``first`` and freed already were a sparse or
        composite rule's scratch (a kernel's buffers, freed before it returns: workspace,
        as ``measure`` reads them)."""
        live = set(self._live.values())
        storages = self.timeline.storages
        for sid in range(first, len(storages)):
            if sid not in live and storages[sid].category is None:
                storages[sid].category = Category.WORKSPACE

    # -- storages held by something other than a tensor ---------------------------------

    def held(self, nbytes: int, op: str, phase: Phase | None, module: int) -> int:
        """A storage of ``nbytes`` allocated now, by ``op``, that no tensor of the trace
        holds (autograd's own: a saved wrapped number); freed by :meth:`release`."""
        info = StorageInfo(nbytes=nbytes, phase=phase, module=module, op=op)
        sid = self.timeline.new_storage(info)
        self.timeline.alloc(sid)
        return sid

    def release_with(self, sid: int, ref: weakref.ref[Any]) -> None:
        """Keep ``ref``, a weak reference whose callback releases ``sid``, while ``sid`` lives."""
        self._refs[sid] = ref

    def holder(self, sid: int) -> Any:
        """What keeps the storage ``sid`` that :meth:`held` made (the object of its weak
        reference: a saved wrapped number's tensor, a node's token), or None."""
        ref = self._refs.get(sid)
        return None if ref is None or isinstance(ref, _StorageRef) else ref()

    def release(self, sid: int) -> None:
        """Free the storage :meth:`held` made."""
        self._refs.pop(sid, None)
        self.timeline.free(sid)


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a tracked storage that carries its key and sid: one object
    a storage, where a callback closing over them made three more."""

    __slots__ = ("key", "sid")
    key: int
    sid: int
