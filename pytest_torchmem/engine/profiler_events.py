"""The profiler's event tree of a measured CPU step, read into the timeline the estimate writes.

``measure(device="cpu")`` runs the step under ``torch.profiler`` with memory
profiling on, and marks its progress (phases, module entries and exits, roles,
the user's phases) with zero-length ``record_function`` ranges named
``torchmem::...`` (:data:`MARK`). :func:`read_events` walks the event tree in
time order and turns the CPU allocator's events and those marks into the same
:class:`~pytest_torchmem.engine.timeline.Timeline` the fake trace writes: each
allocation charged to the kernel (the outermost aten op that is not a
composite) it was made in, as scratch where it is freed before that kernel
returns; what dynamo allocated and freed while it compiled a frame in the step
left out; what a gloo collective made and freed unseen on its worker thread
freed where the step's thread went on.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from pytest_torchmem.engine.report import Category
from pytest_torchmem.engine.timeline import FREE, Phase, StorageInfo, Timeline
from pytest_torchmem.engine.torch_private import private

__all__ = ["ALLOCATION", "MARK", "kernel_node", "read_events"]

#: The prefix of the step's marks in the profiler's event tree.
MARK: Final = "torchmem::"
#: The profiler's name for dynamo's compile of one frame (``dynamo_timed``).
_FRAME_COMPILE: Final = "_compile.compile_inner (dynamo_timed)"
# The profiler's event tree and its allocator events (engine/torch_private.py lists
# the fields read on each event: ptr, alloc_size, extra_fields, children, ...).
ALLOCATION: Final = private("torch._C._profiler._ExtraFields_Allocation")
_Allocation: Final = ALLOCATION


def read_events(
    prof: Any, timeline: Timeline, by_ptr: dict[int, int], roles: list[tuple[Category, list[int]]], names: list[str]
) -> None:
    """Turn the profiler's allocator events and the step's marks into ``timeline``'s events.

    ``by_ptr``: the sid of each live storage by its address (the baseline's on entry);
    ``roles`` and ``names``: what the step's role and named-phase marks point to."""
    events: list[tuple[int, Any]] = []
    compiled_in_step = False
    stack = list(prof.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if isinstance(fields, _Allocation):
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, node))
        elif node.name.startswith(MARK):
            events.append((node.start_time_ns, node))
        elif node.name == _FRAME_COMPILE:
            compiled_in_step = True
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
    for at, node in events:
        fields = node.extra_fields
        if pending and (node.start_tid == step_thread or not isinstance(fields, _Allocation)):
            waiting = []
            for sid, after in pending:
                if after <= at:
                    elsewhere[sid] = len(timeline.events)
                else:
                    waiting.append((sid, after))
            pending = waiting
        if not isinstance(fields, _Allocation):
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
                timeline.named(names[number], iteration == "1")
            elif kind == "settle":
                settled = (len(timeline.events), set(by_ptr.values()))
                for sid in by_ptr.values():
                    if sid >= first:
                        timeline.assign_role(sid, Category.GRADIENTS)
            elif kind == "role":
                category, ptrs = roles[number]
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
    settled = _free_lost(timeline, by_ptr, elsewhere, settled)
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
        if not isinstance(fields, _Allocation):
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
        if parent.name == _FRAME_COMPILE:
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


def _free_lost(
    timeline: Timeline, by_ptr: dict[int, int], elsewhere: dict[int, int], settled: tuple[int, set[int]] | None
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
    Returns ``settled`` with its index moved past the frees put before it.
    """
    live = set(by_ptr.values())
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
    """The outermost aten op above ``node`` that is a kernel, not a composite."""
    found = None
    parent = node.parent
    while parent is not None:
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
            isinstance(fields, _Allocation)
            and fields.ptr == ptr
            and fields.alloc_size < 0
            and child.start_time_ns > node.start_time_ns
            and child.start_time_ns <= end
        ):
            return True
        stack.extend(child.children)
    return False
