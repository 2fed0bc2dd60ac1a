"""What a leak check found: :class:`LeakReport`, and what holds the growth, :class:`LeakSource`.

A step run again and again (a training loop calling its step) should hold, once
its first iterations have made what they make once (an optimizer's state, a
grad scaler's scale, a lazy module's parameters, a cache that fills), the same
memory after every iteration. What it holds more after each one is a leak.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LeakReport", "LeakSource"]


@dataclass(frozen=True)
class LeakSource:
    """Tensors an iteration made that outlive the next one, grouped by where they were
    made and what holds them: ``bytes`` of them per iteration (each storage once, its own
    bytes), ``tensors`` of them."""

    bytes: int
    tensors: int
    #: Where the user's code made them: ``file:line in function`` (empty where unknown).
    made_at: str = ""
    #: The op that made them (``aten.mm.default``), and the module that ran it.
    op: str = ""
    module: str = ""
    #: What holds them, as the user's code names it (``trainer.losses``, ``train_step's
    #: history``, ``the autograd graph of total``), or empty where nothing that the step
    #: reaches does (held by torch, say).
    held_by: str = ""
    #: How: ``list`` (appended to), ``dict`` (an entry per iteration), ``attribute``,
    #: ``closure``, ``graph`` (an autograd graph a held tensor keeps), or ``unknown``.
    how: str = "unknown"
    #: The fix, where the pattern is a known one.
    fix: str = ""

    def __str__(self) -> str:
        where = f" made at {self.made_at}" if self.made_at else ""
        by = f", held by {self.held_by}" if self.held_by else ""
        return f"{self.bytes} B per iteration ({self.tensors} tensor(s){where} by {self.op or 'an op'}{by})"


@dataclass(frozen=True)
class LeakReport:
    """The memory a step holds after each of its iterations, on one device, in bytes.

    ``held[i]`` is what is live after iteration ``i + 1`` (the baseline, the model's and
    inputs' tensors, included), ``growth[i]`` what that iteration added to it (the first:
    over the baseline). Once the growth is the same from one iteration to the next
    (:attr:`steady_from`, counted from 1), it is the step's :attr:`per_iteration`
    growth: 0 for a step that does not leak. On cuda, ``reserved`` is the caching
    allocator's segments after each iteration, and its growth per iteration
    :attr:`reserved_per_iteration`; segments that grow while the allocated bytes do not
    are fragmentation (:attr:`fragmentation`).
    """

    device: str
    iterations: int
    baseline: int
    held: tuple[int, ...]
    #: The first iteration from which every iteration grows the same (None: none was
    #: reached within ``iterations``).
    steady_from: int | None
    per_iteration: int
    #: What holds the growth of the last iterations, largest first.
    sources: tuple[LeakSource, ...] = ()
    reserved: tuple[int, ...] = ()
    reserved_per_iteration: int | None = None
    profile: str | None = None
    #: What the trace could not follow exactly (as :attr:`MemoryReport.unsupported`).
    unsupported: tuple[Any, ...] = ()
    #: Run for real (``measure=True``), not traced.
    measured: bool = False
    #: What the trace replayed instead of tracing it again (the later iterations' forward
    #: and backward, and optimizer step), or why it traced them (as
    #: :attr:`MemoryReport.replayed`); reports compare equal whatever it says.
    replayed: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "held", tuple(int(b) for b in self.held))
        object.__setattr__(self, "reserved", tuple(int(b) for b in self.reserved))
        object.__setattr__(
            self, "sources", tuple(s if isinstance(s, LeakSource) else LeakSource(**s) for s in self.sources)
        )
        object.__setattr__(self, "unsupported", tuple(self.unsupported))
        object.__setattr__(self, "replayed", tuple(self.replayed))

    @property
    def growth(self) -> tuple[int, ...]:
        """What each iteration added to what is held (the first: over the baseline)."""
        before = (self.baseline, *self.held[:-1])
        return tuple(after - prior for prior, after in zip(before, self.held))

    @property
    def leaks(self) -> bool:
        """Whether the step holds more after each iteration in its steady state."""
        return self.per_iteration > 0

    @property
    def fragmentation(self) -> bool:
        """On cuda: the reserved segments grow per iteration while the allocated bytes do
        not (the caching allocator cannot reuse what it keeps)."""
        return bool(self.reserved_per_iteration) and self.per_iteration <= 0

    def to_json(self, **kwargs: Any) -> str:
        data = asdict(self)
        data["unsupported"] = [str(entry) for entry in self.unsupported]
        return json.dumps(data, **kwargs)

    @classmethod
    def from_json(cls, text: str) -> LeakReport:
        data = json.loads(text)
        data["held"] = tuple(data["held"])
        data["reserved"] = tuple(data.get("reserved", ()))
        data["sources"] = tuple(LeakSource(**s) for s in data.get("sources", ()))
        data["unsupported"] = tuple(data.get("unsupported", ()))
        data["replayed"] = tuple(data.get("replayed", ()))
        return cls(**data)
