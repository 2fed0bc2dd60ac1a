"""The program's CUDA streams and events on the fake cuda device.

A CPU-only torch has no CUDA streams (``torch.cuda.Stream`` is a dummy class,
``torch.cuda.current_stream()`` raises "Torch not compiled with CUDA enabled"),
and a CUDA build without a GPU asks the runtime for a device. Code that
overlaps copies with compute (activation offloading, prefetching, a
side-stream all-reduce) makes streams and events, switches the current stream
and records tensors on streams. On the fake cuda device, while the GPU view is
on, the program gets the streams and events of this module
(:class:`GpuStreams`, one per trace):

* a stream is a ``torch.Stream`` of the ``cuda`` device, index 0, with an id of
  its own; the first is the default stream. Each has the caching allocator's
  pool of its own: what is allocated while it is current is charged to it
  (``DeviceCachingAllocator`` keys its free blocks by the allocation stream:
  ``get_free_block``), and a freed block returns to its own stream's blocks;
* waits, events and synchronisation complete when they are issued: the order
  of the program's calls is the schedule the estimate defines, the device's
  work is not modelled in time (``Event.elapsed_time`` answers 0.0 ms);
* ``Tensor.record_stream(s)`` keeps nothing from the figures: the allocator
  counts a block as freed when its tensor is (``free`` takes its bytes off
  ``allocated_bytes`` at once; only its reuse waits for the recorded streams'
  events, which here have completed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import torch

__all__ = [
    "CUDA_DEVICE_TYPE",
    "PROGRAM_STREAM_POOL",
    "CudaEvent",
    "CudaStream",
    "GpuStreams",
    "StreamContext",
    "streams_of_the_trace",
]

#: ``c10::DeviceType::CUDA``, as ``torch.Stream.device_type`` reports it.
CUDA_DEVICE_TYPE: Final = 1
_CUDA: Final = torch.device("cuda", 0)

#: The allocator pool of the program's first stream besides the default one (FSDP2's
#: streams, made through its device handle, count up from 2: ``engine/parallel/mesh.py``).
PROGRAM_STREAM_POOL: Final = 1024

#: The trace's streams, by tracing thread (a pipeline's ranks trace on threads of their own).
_TRACES: dict[int, GpuStreams] = {}


def streams_of_the_trace() -> GpuStreams:
    """The streams of the trace on this thread."""
    try:
        return _TRACES[threading.get_ident()]
    except KeyError:
        raise RuntimeError("CUDA streams are made only while a fake cuda trace runs on this thread") from None


class CudaStream(torch.Stream):
    """A stream of the fake cuda device (see the module)."""

    pool: int

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> CudaStream:
        # (the meta device's stream underneath: nothing is queued anywhere)
        stream = super().__new__(cls, device="meta", priority=priority)
        trace = streams_of_the_trace()
        stream.pool, stream._id = trace.new_pool()
        stream._priority = priority
        return stream

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _CUDA

    @property
    def device_index(self) -> int:  # type: ignore[override]
        return 0

    @property
    def device_type(self) -> int:  # type: ignore[override]
        return CUDA_DEVICE_TYPE

    @property
    def stream_id(self) -> int:  # type: ignore[override]
        return self._id

    @property
    def priority(self) -> int:
        return self._priority

    @property
    def cuda_stream(self) -> int:
        """The ``cudaStream_t`` as an integer: 0 for the default stream."""
        return 0 if self.pool == 0 else 0x7F0000000000 + 0x100 * self._id

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> CudaEvent:
        event = CudaEvent() if event is None else event
        event.record(self)
        return event  # type: ignore[no-any-return]

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def is_capturing(self) -> bool:
        return False

    def __enter__(self) -> CudaStream:
        streams_of_the_trace().enter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        streams_of_the_trace().leave()

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return hash((CUDA_DEVICE_TYPE, self._id))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device={self.device} cuda_stream={self.cuda_stream:#x}>"


class CudaEvent(torch.Event):
    """An event of the fake cuda device: complete as soon as it is recorded."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs: Any) -> CudaEvent:
        event = super().__new__(cls, device="cpu")
        event._recorded = False
        return event

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _CUDA

    def record(self, stream: Any = None) -> None:  # type: ignore[override]
        self._recorded = True

    def wait(self, stream: Any = None) -> None:  # type: ignore[override]
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Any) -> float:  # type: ignore[override]
        return 0.0

    def __repr__(self) -> str:
        return f"<torch.cuda.Event {'recorded' if self._recorded else 'uninitialized'}>"


class StreamContext:
    """``torch.cuda.stream(s)`` / ``torch.cuda.StreamContext(s)``: ``s`` is the current
    stream for the block (None: nothing changes)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        if self.stream is not None:
            streams_of_the_trace().enter(self.stream)

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            streams_of_the_trace().leave()


class GpuStreams:
    """The streams of one fake cuda trace: their pools, and the current one.

    ``charge_to(pool)`` makes the tracker charge what is allocated from then on to
    ``pool`` and returns the pool charged before (``Tracker.charge_to``). The default
    stream's pool is 0; the program's other streams get ``first_pool``, then the
    next ones, in the order they are made (FSDP2's streams, made through its device
    handle, have pools of their own below: ``engine/parallel/mesh.py``)."""

    def __init__(self, charge_to: Callable[[int], int], first_pool: int = PROGRAM_STREAM_POOL) -> None:
        self._charge_to = charge_to
        self._first_pool = first_pool
        self._made = 0
        self._entered: list[tuple[Any, int]] = []
        self.default: CudaStream | None = None

    def new_pool(self) -> tuple[int, int]:
        """``(pool, stream id)`` of a new stream: the first is the default stream."""
        made, self._made = self._made, self._made + 1
        return (0 if made == 0 else self._first_pool + made - 1), made

    @property
    def current(self) -> CudaStream:
        if self._entered:
            return self._entered[-1][0]
        assert self.default is not None
        return self.default

    def enter(self, stream: Any) -> None:
        """``stream`` is current until :meth:`leave`."""
        pool = getattr(stream, "pool", 0)
        self._entered.append((stream, self._charge_to(pool)))

    def leave(self) -> None:
        _, before = self._entered.pop()
        self._charge_to(before)

    def set_current(self, stream: Any) -> None:
        """``torch.cuda.set_stream(stream)``: current from now on (until the block that
        made another current ends)."""
        pool = getattr(stream, "pool", 0)
        if self._entered:
            _, before = self._entered[-1]
            self._charge_to(pool)
            self._entered[-1] = (stream, before)
        else:
            before = self._charge_to(pool)
            self._entered.append((stream, before))

    @contextmanager
    def on(self) -> Iterator[GpuStreams]:
        """These streams are the trace's on this thread, for the block."""
        thread = threading.get_ident()
        outer = _TRACES.get(thread)
        _TRACES[thread] = self
        try:
            if self.default is None:
                self.default = CudaStream()
            yield self
        finally:
            while self._entered:
                self.leave()
            if outer is None:
                del _TRACES[thread]
            else:
                _TRACES[thread] = outer
