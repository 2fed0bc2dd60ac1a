"""The memory of one rank of a parallel run: :class:`Parallel`, and running ``apply``.

``parallel=Parallel(mesh={"dp": 8}, apply=fn, rank=0)`` asks for one rank of
a run over a device mesh of that shape. ``apply(model, mesh)`` parallelizes
the model (DDP, ``fully_shard``, ``parallelize_module``, the user's own
function) and returns the module the step runs. It runs on a copy of the
model whose tensors are the step's stand-ins, never on the user's model.

What ``apply`` leaves alive on the rank counts from the start of the step, as
parameters do: the storages of the parameters and buffers of the module it
returns (sharded parameters: DTensor local shards) as parameters and buffers,
any other storage it made and left alive (DDP's gradient buckets) as
gradients. The estimate runs ``apply`` over a fake process group of ``world``
ranks (no processes); ``measure`` over real gloo processes.
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, overload

import torch
from torch import nn

from pytest_torchmem.engine.torch_compat.torch_private import private

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pytest_torchmem.engine.user.model_state import ModelTensors

__all__ = [
    "Parallel",
    "applied",
    "entered_per_iteration",
    "excepthook_kept",
    "fake_world",
    "local_tensors",
    "model_copy",
]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Parallel:
    """One rank of a run over a device mesh.

    ``mesh``: dimension names to sizes, outermost first (``{"dp": 2, "tp": 4}``);
    the world size is their product. ``apply(model, mesh) -> model``
    parallelizes the model over a ``DeviceMesh`` of that shape with those
    dimension names. ``rank``: the rank reported, or ``"max"`` for the worst
    of the distinct ranks (:func:`~pytest_torchmem.engine.api.every_rank`:
    the highest reserved peak on cuda, the highest peak on cpu).

    Pipeline parallel: ``schedule`` (a schedule class of
    ``torch.distributed.pipelining``: ``ScheduleGPipe``, ``Schedule1F1B``,
    ``ScheduleInterleaved1F1B``, ...) and ``microbatches`` (the micro-batches
    each step splits the batch into); the mesh then has a dimension named
    ``pipeline`` (``"pp"``), and ``apply`` returns the rank's ``PipelineStage``
    (or a list of them, for a schedule of several stages per rank), built as
    the training code builds it.

    ``train_context(model, mesh, *args, **kwargs) -> context manager``: the
    context each iteration's forward and backward run in on the rank (not the
    optimizer step), as torchtitan's ``train_context`` wraps them; it is called
    with what ``apply`` returned, the mesh and the step's inputs as the model
    is called with them. Context parallel:
    ``lambda model, mesh, x: context_parallel(mesh["cp"], buffers=[x],
    buffer_seq_dims=[1])``; tensor parallel's ``loss_parallel()``. Inputs the
    context reshapes in place (``no_restore_buffers``) come back whole to the
    next iteration, as the loop's next batch does.
    """

    mesh: Mapping[str, int]
    apply: Callable[[nn.Module, Any], Any]
    rank: int | Literal["max"] = 0
    schedule: type | None = None
    microbatches: int | None = None
    pipeline: str = "pp"
    train_context: Callable[..., AbstractContextManager[Any]] | None = None
    _shape: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mapping) or not self.mesh:
            raise TypeError(
                f"Parallel(mesh=...) takes a dict of dimension names to sizes, e.g. "
                f"mesh={{'dp': 8}}, got {self.mesh!r}"
            )
        shape: list[tuple[str, int]] = []
        for name, size in self.mesh.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(
                    f"Parallel(mesh=...): dimension names must be identifiers such as 'dp', got {name!r}"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"Parallel(mesh=...): the size of dimension {name!r} must be a positive int, got {size!r}"
                )
            shape.append((name, size))
        object.__setattr__(self, "_shape", tuple(shape))
        object.__setattr__(self, "mesh", MappingProxyType(dict(shape)))
        if not callable(self.apply):
            raise TypeError(
                "Parallel(apply=...) must be a callable (model, mesh) -> model, e.g. "
                "apply=lambda model, mesh: DistributedDataParallel(model, "
                f"process_group=mesh.get_group()), got {type(self.apply).__name__}"
            )
        if self.train_context is not None and not callable(self.train_context):
            raise TypeError(
                "Parallel(train_context=...) must be a callable (model, mesh, *args, **kwargs) -> "
                "context manager, e.g. train_context=lambda model, mesh, x: context_parallel("
                f"mesh['cp'], buffers=[x], buffer_seq_dims=[1]), got {type(self.train_context).__name__}"
            )
        self._check_schedule()
        rank = self.rank
        if rank != "max" and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"Parallel(rank=...) must be an int or 'max', got {rank!r}")
        if isinstance(rank, int) and not 0 <= rank < self.world:
            raise ValueError(
                f"Parallel(rank={rank}) is outside the mesh {self.key}: "
                f"ranks run from 0 to {self.world - 1}"
            )

    def _check_schedule(self) -> None:
        if self.schedule is None:
            if self.microbatches is not None:
                raise ValueError(
                    "Parallel(microbatches=...) is the micro-batch count of a pipeline schedule; "
                    "pass the schedule too, e.g. schedule=torch.distributed.pipelining.ScheduleGPipe"
                )
            return
        from pytest_torchmem.engine.parallel.pipeline import check_schedule

        check_schedule(self.schedule, self.microbatches, self.pipeline, dict(self._shape))

    def __reduce__(self) -> tuple[Any, ...]:
        # the mesh is a read-only view, which does not pickle (spawned ranks get a copy)
        return (
            Parallel,
            (
                dict(self._shape),
                self.apply,
                self.rank,
                self.schedule,
                self.microbatches,
                self.pipeline,
                self.train_context,
            ),
        )

    @property
    def pipelined(self) -> bool:
        """Whether the run is pipeline parallel (a schedule was given)."""
        return self.schedule is not None

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s coordinate along each dimension of the mesh."""
        coords: dict[str, int] = {}
        rest = rank
        for name, size in reversed(self._shape):
            coords[name] = rest % size
            rest //= size
        return {name: coords[name] for name, _ in self._shape}

    def rank_at(self, coordinates: Mapping[str, int]) -> int:
        """The rank at ``coordinates`` (one per dimension)."""
        rank = 0
        for name, size in self._shape:
            rank = rank * size + coordinates[name]
        return rank

    def pipeline_peers(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s pipeline, stage by stage (its own among them)."""
        coords = self.coordinates(rank)
        return [self.rank_at({**coords, self.pipeline: stage}) for stage in range(self.mesh[self.pipeline])]

    @property
    def world(self) -> int:
        """The number of ranks."""
        total = 1
        for _, size in self._shape:
            total *= size
        return total

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._shape)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self._shape)

    @property
    def key(self) -> str:
        """The mesh as text, ``"dp=2,tp=4"``: how snapshot entries tell meshes apart; a
        pipeline's schedule and micro-batches follow (``"pp=2,dp=2,Schedule1F1Bx4"``)."""
        mesh = ",".join(f"{name}={size}" for name, size in self._shape)
        if self.schedule is None:
            return mesh
        return f"{mesh},{self.schedule.__name__}x{self.microbatches}"


#: The allocator pool (``StorageInfo.pool``) of the first side stream a program makes
#: on the fake cuda device; the next ones count up. 0 is the default stream and 1 a
#: CUDA graph's private pool (``compiled_cuda.GRAPH_POOL``).
FIRST_STREAM_POOL: Final = 2


@contextmanager
def excepthook_kept() -> Iterator[None]:
    """``sys.excepthook`` is the user's again after the block.

    ``init_process_group`` replaces it with a hook that prefixes every line of an
    uncaught exception's traceback with ``[rankN]:`` and calls the hook before it;
    the fake worlds of an estimate (one per traced rank, from several threads at
    once under a pipeline) would leave one such layer per world in the user's
    process. Kept around the whole estimate, not each world: the threads' worlds
    replace it in any order."""
    hook = sys.excepthook
    try:
        yield
    finally:
        sys.excepthook = hook


@contextmanager
def fake_world(
    parallel: Parallel,
    rank: int,
    device_type: str,
    resized: Callable[[torch.Tensor], None],
    streamed: Callable[[int], int],
) -> Iterator[DeviceMesh]:
    """A ``DeviceMesh`` of ``parallel``'s shape over a fake process group, as rank ``rank``.

    The fake group is this process's default group for the duration of the
    block (``torch.distributed`` keeps one per process), so the block refuses
    to run where one exists already. ``resized(tensor)`` is told of every
    storage FSDP2 frees or re-allocates in place (``storage.resize_``, which
    no dispatch mode sees). On the fake cuda device, ``streamed(pool)`` is
    called when the program makes one of its streams current (FSDP2's
    all-gather and reduce-scatter streams) and when it leaves it: new storages
    are charged to that stream's pool from then on (0: the default stream); it
    returns the pool charged before.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available():
        raise RuntimeError("parallel= needs torch.distributed, which this build of torch lacks")
    if dist.is_initialized():
        raise RuntimeError(
            "estimate(parallel=...) runs over a fake process group of its own, and this "
            "process already has a default process group; call it from a process that "
            "has not called torch.distributed.init_process_group()"
        )
    fake_store = private("torch.testing._internal.distributed.fake_pg.FakeStore")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=parallel.world)
    try:
        mesh = init_device_mesh(device_type, parallel.sizes, mesh_dim_names=parallel.names)
        with (
            _fake_tensor_checks_skipped(),
            _storage_resizes_seen(resized),
            _chunks_made_as_read(),
            _device_handle(device_type, streamed),
            _bucket_rebuild_indices_real(),
        ):
            yield mesh
    finally:
        dist.destroy_process_group()


class _MetaStream(torch.cpu.Stream):
    """A stream of the fake cuda device: the CPU's (its waits and events do nothing),
    told apart as ``meta``'s, with the allocator pool its allocations are charged to.

    torch 2.15's FSDP2 records a reduce-scatter's output on the stream that
    reads it, by the stream's id, device index and device type
    (``record_grad_output_stream`` in
    ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, for every
    buffer not on the CPU; the op does nothing but where a backend registers
    it, and none registers ``meta``; CUDA does not either: a freed block stays
    mapped); the CPU's stream has none of the three. 2.10 to 2.14 record no
    stream there.
    """

    def __init__(self, priority: int = -1, pool: int = 0) -> None:
        super().__init__(priority)
        meta = torch.Stream(device="meta")
        self.stream_id = meta.stream_id
        self.device_index = meta.device_index
        self.device_type = meta.device_type
        #: The caching allocator's free blocks are kept per stream: what is allocated
        #: while this stream is current is charged to this pool (0: the default stream).
        self.pool = pool

    def record_event(self, event: Any = None) -> Any:
        """An event recorded on the stream, always complete, returned as a CUDA stream's
        ``record_event`` returns one (the CPU's returns None): FSDP2's hybrid sharding
        (HSDP) keeps its all-reduce's event, and refuses a device not ``cpu`` without one."""
        event = torch.cpu.Event() if event is None else event
        event.record(self)
        return event


class _MetaDeviceHandle(types.ModuleType):
    """``torch.meta`` for the block: the device module FSDP2 asks the mesh's device type for.

    The fake cuda device traces on ``meta``, and ``torch.distributed`` finds a
    device's streams, events and current index as ``getattr(torch, type)``,
    which ``meta`` has none of. This one answers as the CPU's does: events
    that are always complete, no index (``meta``, not ``meta:0``, so what
    FSDP2 allocates is on the traced device). Every collective completes when
    it is issued on the fake process group, so the order of the program's
    calls is the schedule the estimate defines.

    Its streams are the caching allocator's: each stream the program makes
    (FSDP2: the all-gather copy-in, all-gather, reduce-scatter and all-reduce
    streams) has a pool of its own, and what is allocated while it is current
    (``with handle.stream(s)``) is charged to it, as ``DeviceCachingAllocator``
    keys its free blocks by the allocation stream (``get_free_block``): a block
    freed on the CPU returns to its own stream's free blocks and no other
    stream's request takes it (``c10/cuda/CUDACachingAllocator.cpp``).
    No block is recorded on another stream (``recordStream``): FSDP2 orders
    reuse with events and held references instead, and ProcessGroupNCCL stashes
    a collective's tensors rather than recording them (2.10 to 2.14 say
    ``TORCH_NCCL_AVOID_RECORD_STREAMS is the default now``; 2.15 has no such
    setting), so the replay of the program's allocations and frees in order is
    what the allocator sees.
    """

    Event = torch.cpu.Event
    StreamContext = torch.cpu.StreamContext

    def __init__(self) -> None:
        super().__init__("torch.meta")
        self._default = _MetaStream()
        #: Each tracing thread's ``streamed`` (a pipeline's ranks trace on threads of their own).
        self._streamed: dict[int, Callable[[int], int]] = {}
        self._next_pool = FIRST_STREAM_POOL

    def Stream(self, priority: int = -1) -> _MetaStream:  # noqa: N802 - torch.cuda.Stream's place
        """A new stream, with an allocator pool of its own."""
        stream = _MetaStream(priority, self._next_pool)
        self._next_pool += 1
        return stream

    @staticmethod
    def current_device() -> None:
        return None

    def current_stream(self, device: Any = None) -> Any:
        current = torch.cpu.current_stream(device)
        return current if isinstance(current, _MetaStream) else self._default

    @contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        """``torch.cuda.stream(stream)``: ``stream`` is current for the block, and
        what is allocated in it is charged to its pool."""
        if stream is None:
            yield
            return
        pool = stream.pool if isinstance(stream, _MetaStream) else 0
        streamed = self._streamed.get(threading.get_ident(), lambda pool: 0)
        before = streamed(pool)
        try:
            with torch.cpu.stream(stream):
                yield
        finally:
            streamed(before)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def set_device(device: Any) -> None:
        return None


@contextmanager
def _device_handle(device_type: str, streamed: Callable[[int], int]) -> Iterator[None]:
    """``torch.meta`` for the block when the trace is on ``meta`` (the fake cuda device),
    and FSDP2's refusal of parameters on ``meta`` lifted."""
    if device_type != "meta":
        yield
        return
    from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

    thread = threading.get_ident()
    handle = getattr(torch, "meta", None)
    if isinstance(handle, _MetaDeviceHandle):  # another rank of a pipeline, on its own thread
        handle._streamed[thread] = streamed
        try:
            yield
        finally:
            del handle._streamed[thread]
        return
    if handle is not None:
        yield
        return
    # the traced tensors are on meta: FSDP2 takes them for parameters not yet materialized
    validate = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._validate_no_meta_params"
    handle = _MetaDeviceHandle()
    handle._streamed[thread] = streamed
    # (torch has no attribute meta: the table's entry is marked added, and it is deleted after)
    with replacing(validate, lambda self: None), replacing("torch.meta", handle):
        yield


@contextmanager
def _fake_tensor_checks_skipped() -> Iterator[None]:
    """What ``torch.distributed`` does for its own bookkeeping, kept out of the trace.

    DDP compares parameter shapes across ranks by reading them as data, which
    fake tensors have none of; every rank holds the same model here, so the
    check is skipped. DTensor derives each op's global output shape by running
    it on fake tensors of the global shapes, under the fake mode it finds
    active: on a rank that costs no memory, so it runs under a fake mode of
    its own, out of the tracker's sight. The meshes made on the way (a
    sub-mesh, FSDP2's mesh of ``reshard_after_forward=k`` groups) are real
    tensors; FSDP2's CPU offload, whose host memory the trace does not count
    apart, is refused where FSDP2 takes a parameter with its policy.
    """
    from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

    disabled = private("torch.utils._python_dispatch._disable_current_modes")
    verify = "torch.nn.parallel.distributed._verify_param_shape_across_processes"
    propagate = "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached"
    propagated = private(propagate)

    def unseen(self: Any, op_schema: Any) -> Any:
        with disabled():
            return propagated(self, op_schema)

    mesh_class = private("torch.distributed.device_mesh.DeviceMesh")
    slice_mesh = mesh_class.__getitem__
    mesh_tensor = mesh_class.mesh.fget
    make_mesh = mesh_class.__init__

    def new_mesh(self: Any, *args: Any, **kwargs: Any) -> None:
        # a mesh made while the step runs (FSDP2 of DTensor parameters concatenates the
        # tensor-parallel mesh with its own): its rank coordinates from real tensors
        with disabled():
            make_mesh(self, *args, **kwargs)

    def sub_mesh(self: Any, names: Any) -> Any:
        with disabled():
            return slice_mesh(self, names)

    def mesh_of(self: Any) -> Any:
        with disabled():
            return mesh_tensor(self)

    offload = "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.__init__"
    fsdp_param_init = private(offload)
    fsdp_param_signature = inspect.signature(fsdp_param_init)

    def no_offload(self: Any, *args: Any, **kwargs: Any) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy

        bound = fsdp_param_signature.bind_partial(self, *args, **kwargs).arguments
        if isinstance(bound.get("offload_policy"), CPUOffloadPolicy):
            raise NotImplementedError(
                "estimate(parallel=...) does not follow FSDP2's CPU offload "
                "(fully_shard(offload_policy=CPUOffloadPolicy())) yet: its shards, gradients and "
                "optimizer state live in pinned host memory, which the trace does not count apart "
                "from the device's; estimate without the offload policy for what the device "
                "would hold without it"
            )
        fsdp_param_init(self, *args, **kwargs)

    post_forward = "torch.distributed.fsdp._fully_shard._fully_shard._get_post_forward_mesh_info"
    post_forward_mesh_info = private(post_forward)

    def post_forward_mesh(*args: Any, **kwargs: Any) -> Any:
        # (reshard_after_forward=k: FSDP2 reshapes its mesh's rank tensor into k-rank groups
        # for a mesh of its own, bookkeeping made of real tensors)
        with disabled():
            return post_forward_mesh_info(*args, **kwargs)

    with (
        replacing(verify, lambda *args, **kwargs: None),
        replacing(propagate, unseen),
        # a mesh's bookkeeping (its ranks, a dimension's sub-mesh: mesh["dp"], a mesh made in
        # apply) is real tensors
        replacing("torch.distributed.device_mesh.DeviceMesh.__getitem__", sub_mesh),
        replacing("torch.distributed.device_mesh.DeviceMesh.mesh", property(mesh_of)),
        replacing("torch.distributed.device_mesh.DeviceMesh.__init__", new_mesh),
        replacing(post_forward, post_forward_mesh),
        replacing(offload, no_offload),
    ):
        yield


class _RealIndexTensors(private("torch.utils._python_dispatch.TorchDispatchMode")):  # type: ignore[misc]
    """Small integer tensors made with ``empty`` are real, made with every mode off
    (what DDP's reducer writes its new bucket order into while it rebuilds its buckets);
    every other op goes on to the modes below."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        dtype = kwargs.get("dtype")
        if func is torch.ops.aten.empty.memory_format and dtype is not None and not dtype.is_floating_point:
            with private("torch.utils._python_dispatch._disable_current_modes")():
                return func(*args, **{**kwargs, "device": "cpu"})
        return func(*args, **kwargs)


@contextmanager
def _bucket_rebuild_indices_real() -> Iterator[None]:
    """DDP rebuilds its gradient buckets in the first forward of a training loop's
    second step, in the order the gradients became ready (``Reducer._rebuild_buckets``):
    C++ writes the new bucket indices and sizes into integer tensors it makes for the
    purpose and broadcasts from rank 0, which fake tensors (no data) cannot hold; they
    are made real (a few bytes each: the parameters' count), and the new buckets, fake
    as the old ones were, are charged when they are made, the old ones freed."""
    from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

    path = "torch._C._distributed_c10d.Reducer._rebuild_buckets"
    rebuild = private(path)

    def rebuild_buckets(reducer: Any) -> bool:
        with _RealIndexTensors():
            return bool(rebuild(reducer))

    with replacing(path, rebuild_buckets):
        yield


@contextmanager
def _storage_resizes_seen(resized: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """FSDP2 frees an unsharded parameter with ``storage.resize_(0)`` and makes it
    again with ``storage.resize_(nbytes)``: storage methods, not ops, so they are
    reported to ``resized`` as they happen."""
    from pytest_torchmem.engine.torch_compat.torch_replacing import on_this_thread

    fsdp = "torch.distributed.fsdp._fully_shard."
    # on this thread only: a pipeline's ranks trace on threads of their own, each told of its own
    free = private(fsdp + "_fsdp_param.free_storage")
    alloc = private(fsdp + "_fsdp_param.alloc_storage")

    def free_storage(tensor: torch.Tensor) -> None:
        free(tensor)
        resized(tensor)

    def alloc_storage(tensor: torch.Tensor) -> None:
        alloc(tensor)
        resized(tensor)

    with (
        on_this_thread(fsdp + "_fsdp_param.free_storage", free_storage),
        on_this_thread(fsdp + "_fsdp_param.alloc_storage", alloc_storage),
        on_this_thread(fsdp + "_fsdp_param_group.alloc_storage", alloc_storage),
    ):
        yield


class _Chunks(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, count, dim)`` padded with empty tensors to ``count`` (FSDP2's
    ``_chunk_with_empty``), each chunk made when it is read: the same views, of ``narrow``.

    FSDP2 cuts each parameter into one chunk per rank to keep its own rank's and read
    the first's size: made all at once, a 70B model's parameters over 64 ranks are
    ninety thousand fake views, 40% of its estimate."""

    def __init__(self, tensor: torch.Tensor, count: int, dim: int) -> None:
        self._tensor, self._count, self._dim = tensor, count, dim
        self._size = tensor.size(dim)
        self._step = -(-self._size // count)  # torch.chunk's: the last chunk takes what is left
        self._made = -(-self._size // self._step)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(index)
        if index >= self._made:
            return self[0].new_empty(0)
        start = index * self._step
        return self._tensor.narrow(self._dim, start, min(self._step, self._size - start))


@contextmanager
def _chunks_made_as_read() -> Iterator[None]:
    """FSDP2's parameters cut into their ranks' chunks one chunk at a time, as read
    (:class:`_Chunks`)."""
    from pytest_torchmem.engine.torch_compat.torch_replacing import on_this_thread

    path = "torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty"
    chunk_with_empty = private(path)

    def chunks(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
        if tensor.size(dim) == 0 or num_chunks <= 0:
            return chunk_with_empty(tensor, num_chunks, dim)  # type: ignore[no-any-return]
        return _Chunks(tensor, num_chunks, dim)

    with on_this_thread(path, chunks):
        yield


def model_copy(model: nn.Module, model_tensors: ModelTensors, standins: Mapping[int, torch.Tensor]) -> nn.Module:
    """A copy of ``model`` that holds the stand-ins in its tensors' places (shared, not copied)."""
    memo: dict[int, Any] = {}
    for slot in model_tensors.slots:
        memo[id(slot.tensor)] = standins[id(slot.tensor)]
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise TypeError(
            f"parallel= runs apply on a copy of the model (copy.deepcopy), and copying "
            f"{type(model).__name__} failed: {exc}; make the model deep-copyable "
            "(hold no locks, open files or generators in its attributes)"
        ) from exc


def applied(parallel: Parallel, model: nn.Module, mesh: Any) -> nn.Module:
    """Run ``parallel.apply`` on ``model`` and check what it returns (a pipeline's
    stages: in a :class:`~pytest_torchmem.engine.parallel.pipeline.Pipelined` module)."""
    result = parallel.apply(model, mesh)
    if parallel.pipelined:
        from pytest_torchmem.engine.parallel.pipeline import Pipelined

        return Pipelined.of(result, parallel)
    if not isinstance(result, nn.Module):
        raise TypeError(
            "Parallel(apply=...) must return the parallelized model (an nn.Module), "
            f"got {type(result).__name__}; end it with 'return model'"
        )
    return result


def entered_per_iteration(
    parallel: Parallel | None, model: nn.Module, mesh: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[], AbstractContextManager[Any]]:
    """The context the rank's forward and backward run in each iteration
    (``parallel.train_context`` called on what ``apply`` returned, the mesh and the step's
    inputs; checked as it is entered), or one that does nothing."""
    made = parallel.train_context if parallel is not None else None
    if made is None:
        return nullcontext
    from pytest_torchmem.engine.parallel.pipeline import Pipelined

    if isinstance(model, Pipelined):
        model = model.applied

    @contextmanager
    def context() -> Iterator[None]:
        entered = made(model, mesh, *args, **kwargs)
        if not isinstance(entered, AbstractContextManager):  # (any object with __enter__ and __exit__)
            raise TypeError(
                "Parallel(train_context=...) must return a context manager (the block each "
                "iteration's forward and backward run in), got "
                f"{type(entered).__name__}; e.g. return context_parallel(mesh['cp'], "
                "buffers=[x], buffer_seq_dims=[1])"
            )
        with _sdpa_as_it_was(), entered:
            yield

    return context


@contextmanager
def _sdpa_as_it_was() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` as it was, after the block: ``context_parallel``
    patches it for ring attention, and torch 2.10 to 2.12 leave the patch (and ring
    attention's DTensor handlers) in place when the block raises; undone then with
    torch's own undoing."""
    functional = torch.nn.functional
    before = functional.scaled_dot_product_attention
    try:
        yield
    finally:
        if functional.scaled_dot_product_attention is not before:
            private(
                "torch.distributed.tensor.experimental._context_parallel._attention."
                "_disable_context_parallel_dispatcher_impl"
            )()


def local_tensors(tensors: Any) -> list[torch.Tensor]:
    """The rank's own tensors: a DTensor's local shard, any other tensor itself."""
    module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before its import
    if module is None:
        return list(tensors)
    dtensor = module.DTensor
    return [t._local_tensor if isinstance(t, dtensor) else t for t in tensors]
