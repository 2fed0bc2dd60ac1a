"""A check's estimated allocation timeline as a ``torch.cuda.memory._snapshot()`` pickle.

``--torchmem-timeline DIR`` writes one file per check and device, in the
format that ``torch.cuda.memory._dump_snapshot()`` writes, so that PyTorch's
own viewers open it: https://pytorch.org/memory_viz (drag the file in) and
``python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html``.

What the file holds, for the estimated step:

* ``device_traces[0]``: every allocation and free of the step in order, as a
  real run recorded with ``torch.cuda.memory._record_memory_history()`` would
  list them (``alloc``, ``free_requested`` then ``free_completed``, and
  ``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap`` when the
  caching allocator takes or gives back device memory). The storages live
  before the step (parameters, buffers, inputs, existing gradients) come
  first, as allocations. The trace stops at the end of the step, with a
  ``snapshot`` entry (the moment ``segments`` shows).
* ``segments``: the allocator's segments and blocks at the end of the step,
  the moment the trace stops, as a ``_snapshot()`` taken then would show
  them. The viewers start from this state and undo the trace backwards to
  draw earlier moments, so it must be the state after the last trace entry
  (a state at the peak would be inconsistent with the trace after it).
* each entry's ``size`` is what the estimate charges: the caching allocator's
  block size on ``cuda`` (what ``torch.cuda.max_memory_allocated()`` and the
  report count; a real trace lists the requested bytes there, which the
  blocks' ``requested_size`` keeps), the storage's bytes on ``cpu``. The
  "Active Memory Timeline" therefore peaks at the report's ``peak``.
* ``frames``: innermost first, the op that made the storage as a synthetic
  frame (``<backward>:0:aten.mm.default (MmBackward0) -> gradients, module
  layers.0.attn``: phase, op, autograd node, category, module), then the
  user's frames (files outside torch and this package) with their lines.
* ``category`` of each allocation (parameters, activations, gradients,
  optimizer_state, ...): the viewer colours the timeline by it and shows a
  legend.
* ``time_us``: the position of the event in the estimated step (0 for the
  storages live before it), not a time.
* ``torchmem``: what the file is (test, check, device, GPU profile, peaks).

On ``cpu`` there is no caching allocator: each storage is its own segment
holding one block, at synthetic, increasing addresses (64-byte aligned, never
reused), so that the same viewers open it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from pytest_torchmem import __version__
from pytest_torchmem.engine.figures.modelled_device import is_cpu
from pytest_torchmem.engine.figures.timeline import PHASE, Charge, Frame, Phase, Timeline, replay

if TYPE_CHECKING:
    from pytest_torchmem.engine.tracing.devices.cuda.allocator import CachingAllocator, Segment
    from pytest_torchmem.engine.tracing.trace import Trace
    from pytest_torchmem.plugin.judging import Result

__all__ = ["snapshot", "timeline_filename", "trace_snapshot", "write_timeline"]

#: The viewer's own unpickler (``MemoryViz.js``) reads protocols 2 to 4.
PICKLE_PROTOCOL: Final = 4
#: Where the synthetic cpu addresses start, and their alignment (``c10::gAlignment``).
CPU_BASE_ADDRESS: Final = 1 << 40
CPU_ALIGNMENT: Final = 64
#: Where each expandable segment is shown: the simulator gives each a range wider
#: than any device (2**62 bytes without a capacity), past the integers that the
#: viewer's JavaScript numbers hold exactly (2**53); each gets its own window.
EXPANDABLE_BASE_ADDRESS: Final = 1 << 40
EXPANDABLE_WINDOW: Final = 1 << 44
#: The largest block the CUDA allocator serves from its small pool (``kSmallSize``).
_SMALL_SIZE: Final = 1 << 20
#: Longest readable part of a file name (the whole name stays under 255 bytes).
_MAX_STEM: Final = 160

_PHASE_LABELS: Final = {
    None: "<before the step>",
    Phase.FORWARD: "<forward>",
    Phase.BACKWARD: "<backward>",
    Phase.STEP: "<optimizer step>",
}
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._\-\[\]]+")


def timeline_filename(nodeid: str, name: str, device: str) -> str:
    """The file name of one check's timeline: readable, filesystem-safe, unique.

    ``tests/test_model.py::test_vit``, check ``default``, device ``cuda`` gives
    ``tests.test_model.py__test_vit__default__cuda-<digest>.pickle``. The
    readable part writes ``/`` as ``.``, ``::`` as ``__``, runs of other
    characters than letters, digits, ``._-[]`` as ``_``, and is cut when
    long; the digest (12 hex digits of the SHA-256 of the exact test id,
    check name and device) tells apart checks whose readable parts agree.
    """
    readable = "__".join(
        _UNSAFE.sub("_", part).strip("._") or "_"
        for part in (*nodeid.replace("/", ".").split("::"), name, device)
    )
    if len(readable) > _MAX_STEM:
        readable = readable[:_MAX_STEM]
    digest = hashlib.sha256(f"{nodeid}\0{name}\0{device}".encode()).hexdigest()
    return f"{readable}-{digest[:12]}.pickle"


def write_timeline(directory: Path, result: Result, traced: Trace) -> Path:
    """Write the timeline of one check on one device into ``directory``; return its path.

    The directory is made if missing; the file is written whole or not at all
    (a temporary file in the same directory, then renamed).
    """
    key = result.key
    data = trace_snapshot(traced, nodeid=result.nodeid, name=key.name)
    path = Path(directory) / timeline_filename(result.nodeid, key.name, key.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = pickle.dumps(data, protocol=PICKLE_PROTOCOL)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "xb") as stream:
            stream.write(payload)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def trace_snapshot(traced: Trace, *, nodeid: str = "", name: str = "") -> dict[str, Any]:
    """The snapshot of a traced step, replayed through its device's allocator model."""
    device = traced.device
    allocator = device.allocator(traced.context) if device.allocator is not None else None
    report = traced.report
    gpu = traced.context.gpu
    metadata = {
        "nodeid": nodeid,
        "check": name,
        "device": report.device,
        "gpu_profile": None if gpu is None or is_cpu(report.device) else str(gpu.name),
        "forward_peak": report.forward_peak,
        "backward_peak": report.backward_peak,
        "step_peak": report.step_peak,
        # the first step of a training loop (whose later steps the three peaks are)
        "first_step": None if report.first_step is None else report.first_step.to_dict(),
        "peak": report.peak,
        "reserved_peak": report.reserved_peak,
    }
    return snapshot(traced.timeline, traced.baseline, allocator, metadata=metadata)


def snapshot(
    timeline: Timeline,
    baseline: list[int],
    allocator: CachingAllocator | None = None,
    *,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``_snapshot()`` dictionary of ``timeline`` from the live ``baseline`` storages.

    With ``allocator`` (a fresh CUDA caching-allocator model) every storage
    is charged its block, at the block's address; without one (cpu) every
    storage is a segment of its own at a synthetic address.
    """
    writer = _Writer(timeline, allocator)
    data: dict[str, Any] = {
        "segments": writer.run(baseline),
        "device_traces": [writer.entries],
    }
    if allocator is not None:
        data["allocator_settings"] = _allocator_settings(allocator)
    data["torchmem"] = {
        "what": "estimated allocation timeline of one step (fake tensors, no real run)",
        "pytest_torchmem": __version__,
        **(metadata or {}),
    }
    return data


def _allocator_settings(allocator: CachingAllocator) -> dict[str, Any]:
    """The ``allocator_settings`` of a real snapshot, for the settings modelled."""
    config = allocator.config
    return {
        "max_split_size": config.max_split_size if config.max_split_size < 1 << 63 else -1,
        "garbage_collection_threshold": config.garbage_collection_threshold,
        "expandable_segments": config.expandable_segments,
        "roundup_power2_divisions": {
            str(1 << i): divisions for i, divisions in enumerate(config.roundup_power2_divisions)
        },
    }


class _Allocation(NamedTuple):
    """One live allocation as the file shows it."""

    address: int
    size: int
    requested: int
    stream: int
    frames: list[dict[str, Any]]


class _Writer:
    """One replay of a timeline into trace entries and the final segments."""

    def __init__(self, timeline: Timeline, allocator: CachingAllocator | None) -> None:
        self.timeline = timeline
        self.allocator = allocator
        self.entries: list[dict[str, Any]] = []
        #: Segment events of the malloc being replayed (they get its frames).
        self.pending: list[dict[str, Any]] = []
        #: sid -> its live allocations, oldest first (a resize holds two for a moment).
        self.live: dict[int, list[_Allocation]] = {}
        #: Shown address of a segment (or mapped pages) -> the frames of the malloc that made it.
        self.segment_frames: dict[int, list[dict[str, Any]]] = {}
        #: Simulator address of an expandable segment -> where it is shown.
        self.windows: dict[int, int] = {}
        self.next_address = CPU_BASE_ADDRESS
        self.time = 0
        # Frames shared between entries: pickle writes each object once.
        self._frame_dicts: dict[Frame, dict[str, Any]] = {}
        self._frames: dict[int, list[dict[str, Any]]] = {}

    # -- replay ---------------------------------------------------------------------

    def run(self, baseline: list[int]) -> list[dict[str, Any]]:
        """Replay the step (up to its end); return the segments at its end."""
        timeline = self.timeline
        end = next(
            (i for i, (kind, a, _) in enumerate(timeline.events) if kind == PHASE and a < 0),
            len(timeline.events),
        )
        # What follows the end of the step is the tracer letting go of its stand-ins.
        step = replace(timeline, events=timeline.events[:end])
        if self.allocator is not None:
            self.allocator.observer = self._segment_event
        try:
            for charge in replay(step, baseline, self.allocator):
                self.time = charge.index + 1
                if charge.nbytes > 0:
                    self._alloc(charge)
                elif charge.nbytes < 0:
                    self._free(charge)
        finally:
            if self.allocator is not None:
                self.allocator.observer = None
        self.time = end + 1
        segments = self._cpu_segments() if self.allocator is None else self._cuda_segments()
        # The moment the segments show, as a real trace marks a _snapshot() call. Its
        # category is "unknown" because MemoryViz.js fails on a legend without one
        # ("snapshot.categores.push('unknown')", a typo in every version so far).
        self.entries.append(self._entry("snapshot", 0, 0, 0, [], category="unknown"))
        return segments

    def _entry(
        self,
        action: str,
        address: int,
        size: int,
        stream: int,
        frames: list[dict[str, Any]],
        category: str | None = None,
    ) -> dict[str, Any]:
        entry = {
            "action": action,
            "addr": address,
            "size": size,
            "stream": stream,
            "time_us": self.time,
            "frames": frames,
        }
        if category is not None:
            entry["category"] = category
        return entry

    def _segment_event(self, action: str, segment: Segment, address: int, size: int) -> None:
        """The allocator took or gave back device memory (inside a malloc)."""
        self.pending.append(self._entry(action, self._shown(segment, address), size, segment.stream, []))

    def _shown(self, segment: Segment, address: int) -> int:
        """Where the simulator's ``address`` in ``segment`` is shown."""
        if not segment.expandable:
            return address
        window = self.windows.get(segment.address)
        if window is None:
            window = EXPANDABLE_BASE_ADDRESS + len(self.windows) * EXPANDABLE_WINDOW
            self.windows[segment.address] = window
        return window + address - segment.address

    def _alloc(self, charge: Charge) -> None:
        sid = charge.sid
        frames = self._frames_of(sid)
        block = charge.block
        if block is not None:
            address = self._shown(block.segment, block.address)
            allocation = _Allocation(address, block.size, block.requested, block.stream, frames)
        else:  # no caching allocator: a segment of its own at the next address
            address, size = self.next_address, charge.nbytes
            self.next_address += -(-size // CPU_ALIGNMENT) * CPU_ALIGNMENT
            allocation = _Allocation(address, size, size, 0, frames)
            self.pending.append(self._entry("segment_alloc", address, size, 0, []))
        for entry in self.pending:
            entry["frames"] = frames
            entry["time_us"] = self.time
            if entry["action"] in ("segment_alloc", "segment_map"):
                self.segment_frames[entry["addr"]] = frames
        self.entries += self.pending
        self.pending = []
        category = self.timeline.category_of(sid).value
        self.entries.append(
            self._entry("alloc", address, allocation.size, allocation.stream, frames, category)
        )
        self.live.setdefault(sid, []).append(allocation)

    def _free(self, charge: Charge) -> None:
        allocations = self.live[charge.sid]
        address, size, _, stream, frames = allocations.pop(0)
        if not allocations:
            del self.live[charge.sid]
        self.entries.append(self._entry("free_requested", address, size, stream, frames))
        self.entries.append(self._entry("free_completed", address, size, stream, frames))
        if self.allocator is None:
            self.entries.append(self._entry("segment_free", address, size, stream, frames))

    # -- the state at the end ---------------------------------------------------------

    def _live(self) -> list[_Allocation]:
        return sorted(
            (allocation for allocations in self.live.values() for allocation in allocations),
            key=lambda allocation: allocation.address,
        )

    def _cpu_segments(self) -> list[dict[str, Any]]:
        """One segment per live storage, holding it."""
        segments = []
        for address, size, requested, stream, frames in self._live():
            blocks = [_block(address, size, requested, True, frames)]
            small = size <= _SMALL_SIZE
            segments.append(_segment(address, size, stream, small, False, frames, blocks))
        return segments

    def _cuda_segments(self) -> list[dict[str, Any]]:
        """Each segment (each mapped run of an expandable one) with its blocks by address."""
        assert self.allocator is not None
        owners = {allocation.address: allocation.frames for allocation in self._live()}
        segments = []
        for segment in self.allocator.segments:
            run: list[dict[str, Any]] = []
            for block in segment.blocks():
                if not block.mapped:
                    if run:
                        segments.append(self._mapped_run(segment, run))
                    run = []
                    continue
                address = self._shown(segment, block.address)
                if block.allocated:
                    run.append(_block(address, block.size, block.requested, True, owners[address]))
                else:
                    run.append(_block(address, block.size, 0, False, []))
            if run:
                segments.append(self._mapped_run(segment, run))
        return segments

    def _mapped_run(self, segment: Segment, blocks: list[dict[str, Any]]) -> dict[str, Any]:
        address = blocks[0]["address"]
        return _segment(
            address,
            sum(block["size"] for block in blocks),
            segment.stream,
            segment.small,
            segment.expandable,
            self.segment_frames.get(address, []),
            blocks,
        )

    # -- frames -------------------------------------------------------------------------

    def _frames_of(self, sid: int) -> list[dict[str, Any]]:
        """The frames of a storage: what made it (synthetic), then the user's, innermost first."""
        frames = self._frames.get(sid)
        if frames is None:
            info = self.timeline.storages[sid]
            category = self.timeline.category_of(sid).value
            if info.op:
                what = info.op + (f" ({info.node})" if info.node else "") + f" -> {category}"
                if 0 <= info.module < len(self.timeline.module_names):
                    what += f", module {self.timeline.module_names[info.module]}"
            else:
                what = category
            frames = [{"filename": _PHASE_LABELS[info.phase], "line": 0, "name": what}]
            frames += [self._frame_dict(frame) for frame in info.frames]
            self._frames[sid] = frames
        return frames

    def _frame_dict(self, frame: Frame) -> dict[str, Any]:
        found = self._frame_dicts.get(frame)
        if found is None:
            found = self._frame_dicts[frame] = {
                "filename": frame.filename,
                "line": frame.line,
                "name": frame.name,
            }
        return found


def _block(
    address: int, size: int, requested: int, allocated: bool, frames: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "address": address,
        "size": size,
        "requested_size": requested,
        "state": "active_allocated" if allocated else "inactive",
        "frames": frames,
    }


def _segment(
    address: int,
    total_size: int,
    stream: int,
    small: bool,
    expandable: bool,
    frames: list[dict[str, Any]],
    blocks: list[dict[str, Any]],
) -> dict[str, Any]:
    allocated = sum(block["size"] for block in blocks if block["state"] == "active_allocated")
    return {
        "device": 0,
        "address": address,
        "total_size": total_size,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(block["requested_size"] for block in blocks),
        "stream": stream,
        "segment_type": "small" if small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": expandable,
        "frames": frames,
        "blocks": blocks,
    }
