"""What traced blocks leave for the replayed ones (block_replay.py): a block's forward and
its backward as templates of storage events (:class:`ForwardTemplate`,
:class:`BackwardTemplate`), and the group of a list's calls that one template serves
(:class:`Group`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pytest_torchmem.engine.figures.timeline import StorageInfo
from pytest_torchmem.engine.tracing.replay_events import Layout

__all__ = ["BackwardTemplate", "ForwardTemplate", "Group"]


@dataclasses.dataclass(frozen=True)
class ForwardTemplate:
    """A traced block's forward as a template."""

    events: tuple[tuple[int, int, int], ...]  # storages by rank, modules by position
    infos: tuple[StorageInfo, ...]  # by rank
    modules: tuple[int | None, ...]  # by rank: the allocating module's position, if in the block
    spec: Any  # the output's tree
    outputs: tuple[Any, ...]  # its leaves: a Layout (and requires_grad), or a plain value
    saved: frozenset[int]  # ranks alive at its end that the outputs do not hold
    kept_inputs: tuple[int, ...]  # tensor inputs (by position) its graph saves
    trailing: tuple[tuple[int, tuple[int, ...]], ...]  # inner modules given only inputs
    leading: tuple[tuple[int, tuple[int, ...]], ...]  # inner modules returning outputs
    #: what it left in the KV caches it was given (replay_caches.py): (the cache's position
    #: among the call's leaves, the attribute whose value picks the cache's layer, and that
    #: layer's attributes set: a plain value, or a Layout and requires_grad)
    writes: tuple[tuple[int, str, tuple[tuple[str, Any], ...]], ...] = ()
    #: the ranks of the tensors it left there that its graph saves too (freed when both let go)
    cached_saved: frozenset[int] = frozenset()

    def key(self) -> tuple[Any, ...]:
        infos = tuple((i.nbytes, i.category, i.phase, i.op, i.pool) for i in self.infos)
        return (self.events, infos, self.modules, str(self.spec), self.outputs, self.saved,
                self.kept_inputs, self.trailing, self.leading, self.writes, self.cached_saved)


@dataclasses.dataclass(frozen=True)
class BackwardTemplate:
    """A traced block's backward as a template: storages as ``(kind, rank)``: ``b`` made in
    it, ``f`` made in its forward, ``g`` the gradient it got, ``i`` a tensor input's."""

    events: tuple[tuple[int, Any, int], ...]
    infos: tuple[StorageInfo, ...]
    modules: tuple[int | None, ...]
    grad_out: Layout  # the gradient it got (key -1)
    grads_in: tuple[tuple[int, Layout], ...]  # (input position, layout; key -1: grad_out's)
    param_grads: tuple[tuple[Layout, Any] | None, ...]  # (its local tensor's, a DTensor's spec or None)

    def key(self) -> tuple[Any, ...]:
        infos = tuple((i.nbytes, i.category, i.phase, i.op, i.pool) for i in self.infos)
        return (self.events, infos, self.modules, self.grad_out, self.grads_in, self.param_grads)


@dataclasses.dataclass
class Group:
    """The calls of one list's blocks with one signature."""

    name: str
    size: int
    signature: Any
    last: ForwardTemplate | None = None
    forward: ForwardTemplate | None = None
    backward: BackwardTemplate | None = None
    recorded: BackwardTemplate | None = None  # the first backward recorded, awaiting its twin
    why: str | None = None  # why its blocks are traced
    start: int = 0  # the first position replayed: after the calls that made the template
    made_in: int = -1  # the serial of the forward that made the template (Tracker.forwards)
    free: tuple[str, ...] = ()  # the names of the attributes its blocks differ in (never read)
    #: the plain globals its traced calls read, with the values read (:class:`Watch`)
    globals: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = dataclasses.field(default_factory=dict)
    replayed: int = 0
    calls: int = 0
    #: a compiled block's: how often a traced call ran its compiled programs
    runs: int | None = None
