"""Reading the profiler's event tree into a timeline: what a thread other than the
step's freed, out of the profiler's sight (engine/measuring/profiler_events.py).

The profiler's memory reporting is per thread: a storage whose last reference a gloo
worker thread lets go of is freed where the profiler does not see it. These trees are
built by hand (the profiler's own nodes cannot be made from Python), the allocator's
events in them as the profiler gives them: an address, a size, a thread, a parent.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pytest_torchmem.engine.measuring import profiler_events
from pytest_torchmem.engine.measuring.profiler_events import MARK, MarkingProbe, read_events
from pytest_torchmem.engine.figures.timeline import Phase, StorageInfo, Timeline, analyze

STEP_THREAD = 1
GLOO_THREAD = 2


@dataclass
class _Allocation:  # the fields read of torch._C._profiler._ExtraFields_Allocation
    ptr: int
    alloc_size: int
    device: torch.device = torch.device("cpu")


@pytest.fixture(autouse=True)
def _allocations_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler_events, "Allocation", _Allocation)


def _node(name: str, at: int, end: int | None = None, fields: Any = None, tid: int = STEP_THREAD) -> Any:
    return SimpleNamespace(
        name=name, start_time_ns=at, end_time_ns=at if end is None else end,
        extra_fields=fields, start_tid=tid, parent=None, children=[],
    )  # fmt: skip


def _under(parent: Any, *children: Any) -> Any:
    for child in children:
        child.parent = parent
        parent.children.append(child)
    return parent


def _alloc(at: int, ptr: int, size: int, tid: int = STEP_THREAD) -> Any:
    return _node("[memory]", at, fields=_Allocation(ptr, size), tid=tid)


def _read(*roots: Any) -> Timeline:
    timeline = Timeline(module_names=["block"])
    tree = SimpleNamespace(kineto_results=SimpleNamespace(experimental_event_tree=lambda: list(roots)))
    read_events(tree, timeline, {}, MarkingProbe())
    return timeline


def _expected(*steps: tuple[str, int]) -> Timeline:
    """The timeline the step wrote, by hand: ("alloc", nbytes), ("free", sid), ("enter", module)."""
    timeline = Timeline()
    timeline.phase(Phase.BACKWARD, 1)
    for kind, value in steps:
        if kind == "alloc":
            timeline.alloc(timeline.new_storage(StorageInfo(value, None, phase=Phase.BACKWARD, module=-1, op="")))
        elif kind == "free":
            timeline.free(value)
        else:
            timeline.enter(value)
    timeline.phase(None, 1)
    return timeline


def _events(timeline: Timeline) -> list[tuple[int, int, int]]:
    return list(timeline.events)


def test_a_collectives_clone_freed_unseen_whose_address_is_taken_again_dies_where_the_step_went_on() -> None:
    # gloo's reduce-scatter clones its input inside its op, and its work item holds the
    # clone; when the worker thread lets go of the item last, the clone is freed on that
    # thread, unseen. The step's next 66,304-byte allocation then takes its address: the
    # clone was dead by then, and (as the estimate has it) from the collective's end on.
    collective = _under(_node("c10d::_reduce_scatter_base_", 20, end=50), _alloc(30, ptr=0xA000, size=66304))
    timeline = _read(
        _node(f"{MARK}phase:1:1", 10),
        collective,
        _node(f"{MARK}enter:0", 60),  # the step's thread goes on after the collective
        _alloc(70, ptr=0xA000, size=66304),
        _alloc(80, ptr=0xA000, size=-66304),
        _node(f"{MARK}phase:-1:1", 90),
    )
    expected = _expected(("alloc", 66304), ("free", 0), ("enter", 0), ("alloc", 66304), ("free", 1))
    assert _events(timeline) == _events(expected)
    assert analyze(timeline, []).phase_peaks == (0, 66304, 0)


def test_a_storage_freed_unseen_elsewhere_dies_before_its_address_is_taken_again() -> None:
    # made by the step (not inside a collective), its last reference let go of by another
    # thread: freed at the latest where an allocation takes its address again
    timeline = _read(
        _node(f"{MARK}phase:1:1", 10),
        _alloc(20, ptr=0xB000, size=4096),
        _node(f"{MARK}enter:0", 30),
        _alloc(40, ptr=0xB000, size=1024),
        _node(f"{MARK}phase:-1:1", 50),
    )
    expected = _expected(("alloc", 4096), ("enter", 0), ("free", 0), ("alloc", 1024))
    assert _events(timeline) == _events(expected)


def test_a_worker_threads_own_allocation_dies_where_the_step_went_on() -> None:
    # made and freed on gloo's thread (the all-gather's flat output): the profiler sees
    # the allocation, not the free; it dies where the step's thread goes on
    timeline = _read(
        _node(f"{MARK}phase:1:1", 10),
        _alloc(20, ptr=0xC000, size=512, tid=GLOO_THREAD),
        _node(f"{MARK}enter:0", 30),
        _alloc(40, ptr=0xC000, size=512),
        _node(f"{MARK}phase:-1:1", 50),
    )
    expected = _expected(("alloc", 512), ("free", 0), ("enter", 0), ("alloc", 512))
    assert _events(timeline) == _events(expected)
