"""Reading a profiled CPU step into a timeline: the step's marks and the allocator's events between them.

``measure(device="cpu")`` runs the step under ``torch.profiler`` with
``profile_memory=True``. :class:`MarkingProbe` marks the step's phases, module
entries and exits and roles with zero-length ``record_function`` ranges named
``torchmem::...``; :func:`read_events` walks the profiler's event tree and
turns those marks and every allocation and free of the CPU allocator into the
same :class:`~pytest_torchmem.engine.figures.timeline.Timeline` the fake trace writes:
each allocation charged to the kernel it was made in (a scratch buffer when it
is freed before that kernel returns), what a collective's threads made and
freed out of sight freed where the step's thread went on, what dynamo made and
freed while it compiled left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch
from torch.autograd.profiler import record_function

from pytest_torchmem.engine.user.layouts import parts
from pytest_torchmem.engine.figures.report import Category
from pytest_torchmem.engine.figures.timeline import FREE, Phase, StorageInfo, Timeline
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.imports import IMPORTING

__all__ = ["FRAME_COMPILE", "MARK", "Allocation", "MarkingProbe", "PhaseListener", "kernel_node", "read_events"]

#: The prefix of the step's marks in the profiler's event tree.
MARK: Final = "torchmem::"
#: The profiler's range around a tensor subclass's ``__torch_dispatch__`` (the
#: dispatcher's Python fallback, ``PythonFallbackKernel.cpp``).
_SUBCLASS_DISPATCH: Final = "PythonSubclass"
#: The profiler's name for dynamo's compile of one frame (``dynamo_timed``).
FRAME_COMPILE: Final = "_compile.compile_inner (dynamo_timed)"
# The profiler's event tree and its allocator events (engine/torch_compat/torch_private.py lists
# the fields read on each event: ptr, alloc_size, extra_fields, children, ...).
Allocation = private("torch._C._profiler._ExtraFields_Allocation")


class PhaseListener(Protocol):
    """Told the phase of the step as the probe marks it."""

    phase: Phase | None


@dataclass
class MarkingProbe:
    """Marks the step's progress in the profiler's event tree."""

    roles: list[tuple[Category, list[int]]] = field(default_factory=list)
    #: the names of the user's phases (tm.phase), by their marks' index
    names: list[str] = field(default_factory=list)
    #: told the phase too (which compiled regions a step enters where)
    seen: PhaseListener | None = None

    @staticmethod
    def _mark(text: str) -> None:
        with record_function(MARK + text):
            pass

    def set_phase(self, phase: Phase | None, iteration: int = 1) -> None:
        if self.seen is not None:
            self.seen.phase = phase
        self._mark(f"phase:{-1 if phase is None else int(phase)}:{iteration}")

    def enter_module(self, index: int) -> None:
        self._mark(f"enter:{index}")

    def exit_module(self, index: int) -> None:
        self._mark(f"exit:{index}")

    def name_phase(self, name: str, begin: bool) -> None:
        if name not in self.names:
            self.names.append(name)
        self._mark(f"named:{self.names.index(name)}:{int(begin)}")

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def iteration_done(self, iteration: int) -> None:
        self._mark(f"iteration:{iteration}")

    def settle(self) -> None:
        """Mark the end of ``apply``: what it made and left alive is a gradient buffer
        unless a later role says otherwise."""
        self._mark("settle:0")

    def assign_role(self, category: Category, tensors: Iterable[torch.Tensor]) -> None:
        # A zero tensor (the gradient of sgn, say) has no memory and no data pointer; a
        # sparse one's memory is in its parts.
        ptrs = [
            part.untyped_storage().data_ptr()
            for t in tensors
            if not t._is_zerotensor()
            for part in parts(t)
        ]
        self.roles.append((category, ptrs))
        self._mark(f"role:{len(self.roles) - 1}")


def read_events(prof: Any, timeline: Timeline, by_ptr: dict[int, int], probe: MarkingProbe) -> None:
    """Turn the profiler's allocator events and marks into timeline events."""
    events: list[tuple[int, Any]] = []
    compiled_in_step = False
    stack = list(prof.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if isinstance(fields, Allocation):
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, node))
        elif node.name.startswith(MARK):
            events.append((node.start_time_ns, node))
        elif node.name == FRAME_COMPILE:
            compiled_in_step = True
        elif node.name == IMPORTING:
            continue  # a module's own code, run as it is imported: not the step's
        stack.extend(node.children)
    events.sort(key=lambda pair: pair[0])
    if compiled_in_step:
        events = _without_compile_temporaries(events)

    phase: Phase | None = None
    started = False
    first = len(timeline.storages)
    settled: tuple[int, set[int]] | None = None
    module = -1
    step_thread: int | None = None  # the thread of the marks: the step's
    # a collective's own storages (made inside its op, or by a gloo thread running it): the
    # timeline index where the step's thread went on after the collective
    elsewhere: dict[int, int] = {}
    pending: list[tuple[int, int]] = []  # (sid, time the step's thread goes on after)
    reused: set[int] = set()  # a collective's storages whose address was taken again
    for at, node in events:
        fields = node.extra_fields
        if pending and (node.start_tid == step_thread or not isinstance(fields, Allocation)):
            waiting = []
            for sid, after in pending:
                if after <= at:
                    elsewhere[sid] = len(timeline.events)
                else:
                    waiting.append((sid, after))
            pending = waiting
        if not isinstance(fields, Allocation):
            step_thread = node.start_tid
            kind, _, value = node.name[len(MARK) :].partition(":")
            value, _, iteration = value.partition(":")
            number = int(value)
            if kind == "phase":
                started = True
                phase = None if number < 0 else Phase(number)
                timeline.phase(phase, int(iteration))
            elif kind == "enter":
                module = number
                timeline.enter(number)
            elif kind == "exit":
                timeline.exit(number)
            elif kind == "named":
                timeline.named(probe.names[number], iteration == "1")
            elif kind == "iteration":
                timeline.mark(number)
            elif kind == "settle":
                settled = (len(timeline.events), set(by_ptr.values()))
                for sid in by_ptr.values():
                    if sid >= first:
                        timeline.assign_role(sid, Category.GRADIENTS)
            elif kind == "role":
                category, ptrs = probe.roles[number]
                for ptr in ptrs:
                    sid = by_ptr.get(ptr)
                    if sid is not None:
                        timeline.assign_role(sid, category)
            continue
        if not started:
            continue
        size = fields.alloc_size
        if size > 0:
            info = StorageInfo(
                size,
                Category.WORKSPACE if _is_scratch(node) else None,
                phase=phase,
                module=module,
                op=_kernel_name(node),
            )
            unseen = by_ptr.get(fields.ptr)
            if unseen is not None:  # its address is taken again: it was freed, out of sight
                _freed_unseen(timeline, unseen, elsewhere, pending, reused)
            sid = timeline.new_storage(info)
            by_ptr[fields.ptr] = sid
            timeline.alloc(sid)
            if node.start_tid != step_thread:
                pending.append((sid, 0))
            else:
                collective = _collective_of(node)
                if collective is not None:
                    pending.append((sid, collective.end_time_ns))
        elif size < 0:
            sid = by_ptr.pop(fields.ptr, None)
            if sid is not None:
                timeline.free(sid)
    elsewhere.update((sid, len(timeline.events)) for sid, _ in pending)
    settled = _free_lost(timeline, by_ptr, elsewhere, settled, reused)
    if settled is not None:
        _free_released(timeline, settled, first)


def _without_compile_temporaries(events: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """``events`` without the allocations dynamo made and freed while it compiled a frame
    in the step (its copies of the RNG state, the constants it evaluates), and their frees.

    Only a compiled optimizer step compiles in the measured step (its optimizer is
    new there); what the compile leaves alive (the state it makes, calling the
    optimizer's ``_init_group``) stays.
    """
    open_in_compile: dict[int, tuple[Any, int]] = {}  # ptr -> (alloc node, end of its compile)
    dropped: set[int] = set()
    for at, node in events:
        fields = node.extra_fields
        if not isinstance(fields, Allocation):
            continue
        if fields.alloc_size > 0:
            compile_node = _compile_of(node)
            if compile_node is not None:
                open_in_compile[fields.ptr] = (node, compile_node.end_time_ns)
            else:
                open_in_compile.pop(fields.ptr, None)
        elif fields.alloc_size < 0:
            found = open_in_compile.pop(fields.ptr, None)
            if found is not None and at <= found[1]:
                dropped.update((id(found[0]), id(node)))
    if not dropped:
        return events
    return [(at, node) for at, node in events if id(node) not in dropped]


def _compile_of(node: Any) -> Any:
    """The dynamo compile of a frame an allocation was made in, or None."""
    parent = node.parent
    while parent is not None:
        if parent.name == FRAME_COMPILE:
            return parent
        parent = parent.parent
    return None


def _collective_of(node: Any) -> Any:
    """The ``c10d`` op an allocation was made in, or None."""
    parent = node.parent
    while parent is not None:
        if parent.name.startswith("c10d::"):
            return parent
        parent = parent.parent
    return None


def _freed_unseen(
    timeline: Timeline, sid: int, elsewhere: dict[int, int], pending: list[tuple[int, int]], reused: set[int]
) -> None:
    """Free ``sid``, whose address an allocation takes again: it was freed where the
    profiler did not see it.

    A collective's own storage (the clone of its input gloo's reduce-scatter
    makes, held by its work item) is freed where the step's thread went on after
    the collective (:func:`_free_lost`), at the latest here; any other is freed
    here, before the allocation that took its address.
    """
    waiting = [entry for entry in pending if entry[0] != sid]
    if len(waiting) < len(pending):
        pending[:] = waiting
        elsewhere[sid] = len(timeline.events)
    if sid in elsewhere:
        reused.add(sid)
    else:
        timeline.free(sid)


def _free_lost(
    timeline: Timeline,
    by_ptr: dict[int, int],
    elsewhere: dict[int, int],
    settled: tuple[int, set[int]] | None,
    reused: set[int],
) -> tuple[int, set[int]] | None:
    """Free, where the step's thread went on after it, what a collective made and
    freed unseen.

    A gloo collective's own buffers (the reduce-scatter's copy of its input,
    made by its op; the all-gather's flat output, made by the worker thread
    that runs it, with the profiler's state) belong to its work item, which
    gloo's worker thread lets go of at a time of its own: when the step's
    thread holds it no more, they are freed on the worker thread, where the
    profiler, whose memory reporting is per thread, does not see it. As the
    estimate, a collective's own buffers die when it completes: before the
    step's thread does anything more.
    ``reused``: such storages whose address an allocation took again (no longer
    in ``by_ptr``).
    Returns ``settled`` with its index moved past the frees put before it.
    """
    live = set(by_ptr.values()) | reused
    lost = sorted(((index, sid) for sid, index in elsewhere.items() if sid in live), reverse=True)
    for index, sid in lost:
        timeline.events.insert(index, (FREE, sid, 0))
    for ptr in [ptr for ptr, sid in by_ptr.items() if sid in elsewhere]:
        del by_ptr[ptr]
    if settled is None:
        return None
    index, at_settle = settled
    return index + sum(1 for at, _ in lost if at <= index), at_settle


#: Roles of the storages the step holds from the end of ``apply`` on.
_HELD_ROLES: Final = frozenset({Category.PARAMETERS, Category.BUFFERS})


def _free_released(timeline: Timeline, settled: tuple[int, set[int]], first: int) -> None:
    """Free, at the end of ``apply``, what the step does not hold from there on.

    ``apply`` replaces the model's tensors (``distribute_tensor`` scatters a
    full parameter and keeps a shard): what the step does not hold when
    ``apply`` returns (the model's parameters and buffers, the inputs, and
    what ``apply`` made and left alive: DDP's buckets) is freed there, as the
    estimate frees it. The collectives' own tensors die in sight
    (:class:`FreedOnThisThread`, :func:`_free_lost`); what ``apply`` made on
    the step's thread and whose free is never seen is held by the program to
    the end (a bucket whose reducer was dropped while a gloo thread still held
    its last all-reduce).
    """
    index, live = settled
    kept = {sid for sid, role in timeline.roles.items() if role in _HELD_ROLES}
    kept.update(sid for sid in live if timeline.storages[sid].category == Category.INPUTS)
    released = {sid for sid in live if sid not in kept and sid < first}
    if not released:
        return
    later = [event for event in timeline.events[index:] if not (event[0] == FREE and event[1] in released)]
    timeline.events[index:] = [(FREE, sid, 0) for sid in sorted(released)] + later


_COMPOSITE: dict[str, bool] = {}


def _is_composite(name: str) -> bool:
    """Whether the profiled op ``name`` (no overload name) is CompositeImplicitAutograd.

    The fake trace sees such an op's parts, not the op. The profiler does not
    say which overload ran: the default one if the op has it, else the op is
    composite when every overload but the ``out=`` ones is (``aten::lstm``'s
    ``input`` and ``data``, ``aten::softmax.int``).
    """
    found = _COMPOSITE.get(name)
    if found is None:
        found = _has_composite_kernel(name)
        if found is None:
            namespace, _, op = name.partition("::")
            try:
                overloads = getattr(getattr(torch.ops, namespace), op).overloads()
            except (AttributeError, RuntimeError):
                overloads = []
            kinds = [_has_composite_kernel(f"{name}.{o}") for o in overloads if not o.endswith("out")]
            known = [kind for kind in kinds if kind is not None]
            found = bool(known) and all(known)
        _COMPOSITE[name] = found
    return found


def _has_composite_kernel(name: str) -> bool | None:
    """None when there is no operator ``name``."""
    try:
        return private("torch._C._dispatch_has_kernel_for_dispatch_key")(name, "CompositeImplicitAutograd")
    except RuntimeError:
        return None


def kernel_node(node: Any) -> Any:
    """The outermost aten op above ``node`` that is a kernel, not a composite, below
    any tensor subclass's Python dispatch: the ops a wrapper subclass (torchao's float8
    tensors) runs for an op on it are kernels of their own, as the fake trace sees them."""
    found = None
    parent = node.parent
    while parent is not None:
        if parent.name == _SUBCLASS_DISPATCH:
            break
        if parent.name.startswith("aten::") and not _is_composite(parent.name):
            found = parent
        parent = parent.parent
    return found


def _kernel_name(node: Any) -> str:
    kernel = kernel_node(node)
    return kernel.name if kernel is not None else ""


def _is_scratch(node: Any) -> bool:
    """True when the allocation is freed before its kernel returns."""
    kernel = kernel_node(node)
    if kernel is None:
        return False
    ptr = node.extra_fields.ptr
    end = kernel.end_time_ns
    stack = list(kernel.children)
    while stack:
        child = stack.pop()
        fields = child.extra_fields
        if (
            isinstance(fields, Allocation)
            and fields.ptr == ptr
            and fields.alloc_size < 0
            and child.start_time_ns > node.start_time_ns
            and child.start_time_ns <= end
        ):
            return True
        stack.extend(child.children)
    return False
