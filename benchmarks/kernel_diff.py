"""Kernel by kernel: what the fake trace records against what the CPU allocator did.

A developer's tool for finding CPU kernel scratch that needs a rule::

    python benchmarks/kernel_diff.py            # the built-in demo models
    python -c "from benchmarks.kernel_diff import kernel_diff; ..."

For one step of a model it lists, in order, each op the fake trace saw with the
bytes it allocated (outputs and rule scratch) and, beside it, the real kernel's
allocations read from the profiler (``+n`` allocated, ``-n`` freed inside the
kernel), and marks the rows that differ.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

import pytest_torchmem as tm
from pytest_torchmem.engine.measuring import profiler_events, runs as measuring
from pytest_torchmem.engine.step.request import step_request
from pytest_torchmem.engine.tracing import tracker as tracker_module


@dataclass
class Kernel:
    name: str
    deltas: list[int] = field(default_factory=list)

    @property
    def allocs(self) -> list[int]:
        return sorted(d for d in self.deltas if d > 0)

    @property
    def inner_peak(self) -> int:
        live = top = 0
        for d in self.deltas:
            live += d
            top = max(top, live)
        return top

    def key(self) -> str:
        return self.name.replace("aten::", "").replace("aten.", "").split(".")[0]


def real_kernels(model: torch.nn.Module, inputs: Any, **kwargs: Any) -> list[Kernel]:
    """Allocator events of a real step, grouped by the kernel that made them."""
    found: list[tuple[int, str, int, int]] = []
    request = step_request("measure", model, inputs, kwargs.pop("device", "cpu"),
                           kwargs.pop("loss_fn", None), kwargs.pop("optimizer", None),
                           kwargs.pop("train", True))
    prof, _, _ = measuring.profile_cpu_step(request)
    stack = list(prof.kineto_results.experimental_event_tree())
    # (the stand-ins are copied under the profiler, before the step's first mark)
    started = min(
        (node.start_time_ns for node in _nodes(prof) if node.name.startswith(profiler_events.MARK + "phase:")),
        default=0,
    )
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if (
            isinstance(fields, profiler_events.Allocation)
            and fields.device.type == "cpu"
            and node.start_time_ns >= started
        ):
            kernel = profiler_events.kernel_node(node)
            found.append(
                (node.start_time_ns, kernel.name if kernel else "(no kernel)", id(kernel), fields.alloc_size)
            )
        stack.extend(node.children)
    found.sort()
    kernels: list[Kernel] = []
    last = None
    for _, name, ident, size in found:
        if ident != last or not kernels:
            kernels.append(Kernel(name))
            last = ident
        kernels[-1].deltas.append(size)
    return kernels


def _nodes(prof: Any) -> list[Any]:
    found, stack = [], list(prof.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.children)
    return found


class _LoggingTracker(tracker_module.Tracker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernels: list[Kernel] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        start = len(self.timeline.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        deltas = []
        for kind, sid, nbytes in self.timeline.events[start:]:
            if kind == 0:
                deltas.append(nbytes)
            elif kind == 1:
                deltas.append(-self.timeline.storages[sid].nbytes)
        if deltas:
            self.kernels.append(Kernel(str(func), deltas))
        return out


def fake_kernels(model: torch.nn.Module, inputs: Any, **kwargs: Any) -> list[Kernel]:
    """Allocations of the fake trace, grouped by the op that made them."""
    made: list[_LoggingTracker] = []
    original = tracker_module.Tracker

    def factory(*a: Any, **k: Any) -> _LoggingTracker:
        t = _LoggingTracker(*a, **k)
        made.append(t)
        return t

    from pytest_torchmem.engine.tracing import trace

    trace.Tracker = factory  # type: ignore[assignment, misc]
    try:
        tm.estimate(model, inputs, **kwargs)
    finally:
        trace.Tracker = original  # type: ignore[misc]
    return made[0].kernels


def kernel_diff(model: torch.nn.Module, inputs: Any, *, only_diff: bool = False, **kwargs: Any) -> int:
    """Print fake and real kernels side by side; return the number of rows that differ."""
    fake = fake_kernels(model, inputs, **kwargs)
    fake = [k for k in fake if k.allocs]
    real = [k for k in real_kernels(model, inputs, **dict(kwargs)) if k.allocs]
    matcher = difflib.SequenceMatcher(a=[k.key() for k in fake], b=[k.key() for k in real], autojunk=False)
    bad = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        rows = max(i2 - i1, j2 - j1)
        for r in range(rows):
            f = fake[i1 + r] if i1 + r < i2 else None
            g = real[j1 + r] if j1 + r < j2 else None
            same = (
                f is not None
                and g is not None
                and f.allocs == g.allocs
                and f.inner_peak == g.inner_peak
            )
            if not same:
                bad += 1
            if only_diff and same:
                continue
            mark = "  " if same else "!!"
            left = f"{f.key()} {f.deltas}" if f else ""
            right = f"{g.key()} {g.deltas}" if g else ""
            print(f"{mark} {left:<60} | {right}")
    return bad


def _demo() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(16 * 32 * 32, 10),
    )
    kernel_diff(model, torch.randn(4, 3, 32, 32))


if __name__ == "__main__":
    _demo() if len(sys.argv) == 1 else None
