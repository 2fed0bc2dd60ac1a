"""The ranks of one pipeline traced together: a thread per stage, their sends and receives delivered.

A rank of a pipeline-parallel run does not run alone: the first step of a
schedule agrees on the stages' metadata with the neighbouring stages (the
shapes of the activations each receives; from torch 2.12, a vote on how to
infer them), and every micro-batch's activations and gradients go from one
stage to the next. On a fake process group a receive gets nothing, so one
rank's trace cannot go on by itself. The ranks of its pipeline (the ranks
that share its coordinates on the other dimensions of the mesh) are traced
with it, each on a thread of its own with its own fake mode, tracker and
process group (``torch.distributed``'s world made thread-local, as torch's own
threaded tests make it), and what one sends is delivered to the other:

- a tensor: its shape and dtype are checked against the receiving buffer
  (a mismatch is the program's error, as a real run's garbled data would
  be), and the values the sender's trace knows (a vote, an object's size)
  become the receiver's;
- an object (``send_object_list``): the object itself, copied.

A rank estimated alone needs of its peers only what it cannot know by itself:
the stages' metadata, which they agree on as the schedule sets its stages up
at the first step. Its peers are traced that far only (``traced``: the ranks
traced through the step); from then on a receive from one of them fills its
buffer with bytes of values the trace does not know, as the buffer the
receiving stage made for it says (a rank's memory is its own buffers; what
fills them moves no byte of its). Where the rank's trace then needed a
tensor value it did not know (perhaps one of those), or a peer was asked
for more than bytes (an object), the caller traces the whole pipeline again.

Every collective of the other dimensions runs on each thread's fake process
group as on a lone rank's. The threads run the user's schedule as it is
written; what makes them wait is only a receive whose send has not come. They
take turns: one thread traces at a time, until it waits (:meth:`PipelineGroup.running`). A
rank that fails stops the others (their receives raise), and a pipeline
whose every rank waits for a message no rank will send is reported as such.

The trace's contexts (layers.py) are entered by each thread in stage order,
all before any step starts, and left in the reverse order once every step
ended: the replacements of torch's functions nest, each thread's own ones
acting on its thread only (``on_this_thread``). A pipeline that follows
compiled code does so twice, in rounds: its warm-up step's contexts (the
step that builds the stages' programs), then its traced step's.
"""

from __future__ import annotations

import copy
import math
import threading
import types
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import P2P_FUNCTIONS, present, private

_no_modes: Final = private("torch.utils._python_dispatch._disable_current_modes")
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")

__all__ = ["PeerGone", "PipelineDeadlock", "PipelineGroup", "PipelinePeerFailed", "SetUpOnly"]

_get_current_dispatch_mode_stack: Final = private("torch.utils._python_dispatch._get_current_dispatch_mode_stack")


class PipelinePeerFailed(RuntimeError):
    """Another rank of the pipeline failed, so this one's receive will never come."""


class PipelineDeadlock(RuntimeError):
    """Every rank of the pipeline waits for a message no rank sends."""


class SetUpOnly(BaseException):
    """A rank traced for its stages' set-up only ends here, its neighbours told what they
    needed (not an error: a ``BaseException``, which no trace takes for the program's)."""


class PeerGone(RuntimeError):
    """A rank traced for its set-up only was asked for more than a tensor's bytes: the
    pipeline is traced again, every rank through the step."""


class _Done:
    """A completed (or, for a receive, completing on ``wait``) piece of work. A send's
    work holds its tensor as long as the work lives, as a process group's does (gloo's
    ``SendWork`` keeps the tensor it sends; NCCL's work its outputs)."""

    def __init__(self, finish: Callable[[], None] | None = None, holds: torch.Tensor | None = None) -> None:
        self._finish = finish
        self._holds = holds

    def wait(self, timeout: Any = None) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def get_future(self) -> Any:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(None)
        return future


class PipelineGroup:
    """The threads of one pipeline's ranks: their messages, turns and failures."""

    def __init__(self, ranks: Sequence[int], traced: Collection[int] | None = None) -> None:
        self.ranks = list(ranks)
        #: The ranks traced through the step (the others, through their set-up only).
        self.traced = set(self.ranks if traced is None else traced)
        #: The ranks whose set-up is done and who trace no further.
        self._set_up: set[int] = set()
        #: How many receives a rank traced no further answered (with bytes of unknown values).
        self.answered = 0
        self._cond = threading.Condition()
        self._boxes: dict[tuple[int, int], deque[Any]] = {}
        self._entered = 0
        #: How many times each rank (by index) entered its contexts (a rank that follows
        #: compiled code enters its warm-up step's, then its traced step's).
        self._rounds: dict[int, int] = {}
        #: The ranks (by index) inside their contexts.
        self._inside: set[int] = set()
        self._waiting = 0
        self._alive = len(self.ranks)
        self._waits: dict[str, tuple[str, Callable[[], bool]]] = {}
        self.failed: BaseException | None = None
        #: The thread that runs now (None: none): one rank's thread runs at a time.
        self._running: threading.Thread | None = None

    # -- turns, failures and waiting -------------------------------------------

    @contextmanager
    def running(self) -> Iterator[None]:
        """Run the block as one of the pipeline's ranks: one rank's thread runs at a time, and
        gives the turn up only while it waits (for a message, for its turn to set up).

        The threads' work is Python's, under one interpreter lock: run side by side, every
        op a thread dispatches hands the lock over to another thread (torch's bindings
        release it around their C++ calls), and each thread's ops took 2.4 times the
        processor time they took alone (the 405B shape's pipeline of 16 stages)."""
        with self._cond:
            self._take_turn()
        try:
            yield
        finally:
            with self._cond:
                self._give_turn()

    def _take_turn(self) -> None:
        """(holding the condition)"""
        me = threading.current_thread()
        while self._running not in (None, me):
            self._cond.wait()
        self._running = me

    def _give_turn(self) -> None:
        """(holding the condition)"""
        if self._running is threading.current_thread():
            self._running = None
            self._cond.notify_all()

    @contextmanager
    def _waiting_turn(self) -> Iterator[Callable[[], None]]:
        """(holding the condition) The block waits by the function it is given, the turn
        given up meanwhile; the thread that had the turn takes it back after the block."""
        mine = self._running is threading.current_thread()

        def wait() -> None:
            self._give_turn()
            self._cond.wait()

        try:
            yield wait
        finally:
            if mine:
                self._take_turn()

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding the condition) until ``ready()``; raise where no rank can make it so."""
        self._waiting += 1
        self._waits[threading.current_thread().name] = (what, ready)
        try:
            with self._waiting_turn() as wait:
                while not ready():
                    if self.failed is not None:
                        raise PipelinePeerFailed(
                            f"another rank of the pipeline failed while this one waited for {what}"
                        ) from None
                    # (a waiter whose wait is over, but which has not woken yet, will go on)
                    if self._waiting >= self._alive and not any(r() for _, r in self._waits.values()):
                        waits = "; ".join(f"{name} for {it}" for name, (it, _) in sorted(self._waits.items()))
                        self.failed = PipelineDeadlock(
                            f"every rank of the pipeline {self.ranks} waits ({waits}): the "
                            "stages' schedules do not send what the others receive; check that every "
                            "rank builds the same schedule and that each stage's index is its "
                            "pipeline coordinate"
                        )
                        self._cond.notify_all()
                        raise self.failed
                    wait()
        finally:
            self._waiting -= 1
            self._waits.pop(threading.current_thread().name, None)

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.failed is None:
                self.failed = exc
            self._cond.notify_all()

    def finished(self) -> None:
        """A rank's thread ends (done or failed): the others no longer count on it."""
        with self._cond:
            self._alive -= 1
            self._cond.notify_all()

    # -- turns of the contexts ---------------------------------------------------

    @contextmanager
    def layered(self, index: int, layers: AbstractContextManager[Any]) -> Iterator[Any]:
        """Enter ``layers`` in stage order, wait until every rank entered, and leave them in
        the reverse order once the later stages left theirs. Every rank enters its layers
        as often (once, or where the pipeline follows compiled code, for its warm-up step
        and again for its traced step): a round begins once every rank left the last."""
        with self._cond:
            rounds = self._rounds.get(index, 0)
            self._rounds[index] = rounds + 1
            first = rounds * len(self.ranks)  # (the entries of the rounds before)
            self._wait_for(lambda: self._entered == first + index, "its turn to set up")
        with layers as value:
            with self._cond:
                self._inside.add(index)
                self._entered += 1
                self._cond.notify_all()
            try:
                with self._cond:
                    self._wait_for(lambda: self._entered == first + len(self.ranks), "the other ranks to set up")
                yield value
            except SetUpOnly:
                raise
            except BaseException as exc:
                self.fail(exc)  # before this rank waits to leave: the others stop waiting for it
                raise
            finally:
                with self._cond:
                    # leaving is never refused for a peer's failure: the contexts unwind in order
                    self._alive -= 1  # a rank waiting to leave sends nothing more
                    self._cond.notify_all()
                    with self._waiting_turn() as wait:
                        while any(other > index for other in self._inside):
                            wait()
                    self._alive += 1
                    self._inside.discard(index)
                    self._cond.notify_all()

    # -- messages ------------------------------------------------------------------

    def set_up_done(self, rank: int) -> None:
        """``rank``'s schedule has set its stages up (metadata, receive buffers): a rank
        traced for its set-up only ends (:class:`SetUpOnly`), and answers its neighbours'
        later receives with bytes of unknown values (a receive's buffer is the receiver's)."""
        if rank in self.traced:
            return
        with self._cond:
            self._set_up.add(rank)
            self._cond.notify_all()
        raise SetUpOnly

    def post(self, src: int, dst: int, payload: Any) -> None:
        with self._cond:
            if dst not in self._set_up:  # (a rank traced no further reads nothing more)
                self._boxes.setdefault((src, dst), deque()).append(payload)
                self._cond.notify_all()

    def take(self, src: int, dst: int) -> Any:
        with self._cond:
            box = self._boxes.setdefault((src, dst), deque())
            self._wait_for(lambda: bool(box) or src in self._set_up, f"a message from rank {src}")
            if box:
                return box.popleft()
            self.answered += 1
            return ("unknown", None)

    # -- torch.distributed's point-to-point functions, delivered -----------------------

    @contextmanager
    def delivering(self) -> Iterator[None]:
        """``torch.distributed``'s point-to-point functions deliver between the threads for
        the block (and a thread-local world of process groups), entered once for all."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

        world = private("torch.testing._internal.distributed.multi_threaded_pg.ThreadLocalWorld")
        isolation = private("torch._C._distributed_c10d._set_thread_isolation_mode")
        functions = self._functions()
        with ExitStack() as stack:
            stack.enter_context(replacing("torch.distributed.distributed_c10d._world", world()))
            isolation(True)
            stack.callback(isolation, False)
            for module in (dist, distributed_c10d):
                for name in P2P_FUNCTIONS:
                    stack.enter_context(replacing(f"{module.__name__}.{name}", functions[name]))
            stack.enter_context(_ddp_forward_per_thread())
            stack.enter_context(replacing("torch.distributed.pipelining.schedules.dist", _Delivered(dist)))
            initialize = "torch.distributed.pipelining.schedules._PipelineSchedule._initialize_pp_stages"
            stack.enter_context(replacing(initialize, self._set_up_then(private(initialize))))
            releasable = "torch.distributed.pipelining.stage._PipelineStageBase._output_slot_is_releasable"
            if present(releasable):
                stack.enter_context(replacing(releasable, _plain_outputs_releasable(private(releasable))))
            yield

    def _set_up_then(self, initialize: Callable[..., Any]) -> Callable[..., Any]:
        """The schedule's set-up of its stages, after which a rank traced for its set-up
        only ends."""
        import torch.distributed as dist

        def initialize_pp_stages(schedule: Any, *args: Any, **kwargs: Any) -> Any:
            done = initialize(schedule, *args, **kwargs)
            self.set_up_done(dist.get_rank())
            return done

        return initialize_pp_stages

    def _functions(self) -> dict[str, Callable[..., Any]]:
        import torch.distributed as dist

        def peer(rank: Any, group: Any, group_rank: Any) -> int:
            if rank is not None:
                return int(rank)
            if group is None:
                return int(group_rank)
            return int(dist.get_global_rank(group, group_rank))

        def isend(tensor: torch.Tensor, dst: Any = None, group: Any = None, tag: int = 0, group_dst: Any = None) -> _Done:
            self.post(dist.get_rank(), peer(dst, group, group_dst), ("tensor", _sent(tensor)))
            return _Done(holds=tensor)

        def irecv(tensor: torch.Tensor, src: Any = None, group: Any = None, tag: int = 0, group_src: Any = None) -> _Done:
            me, source = dist.get_rank(), peer(src, group, group_src)
            return _Done(lambda: _received(tensor, self.take(source, me), source))

        def send(tensor: torch.Tensor, dst: Any = None, group: Any = None, tag: int = 0, group_dst: Any = None) -> None:
            isend(tensor, dst, group, tag, group_dst)

        def recv(tensor: torch.Tensor, src: Any = None, group: Any = None, tag: int = 0, group_src: Any = None) -> int:
            irecv(tensor, src, group, tag, group_src).wait()
            return peer(src, group, group_src)

        def batch_isend_irecv(ops: list[Any]) -> list[_Done]:
            # the sends first: a batch's receives may wait for a peer's batch that waits for them
            works = [isend(op.tensor, op.peer, op.group, op.tag) for op in ops if op.op is isend]
            works += [irecv(op.tensor, op.peer, op.group, op.tag) for op in ops if op.op is irecv]
            return works

        def send_object_list(objects: list[Any], dst: Any = None, group: Any = None, device: Any = None, group_dst: Any = None, **_: Any) -> None:
            with _no_modes():  # the objects' tensors (none, in torch's own use) out of the trace
                sent = copy.deepcopy(objects)
            self.post(dist.get_rank(), peer(dst, group, group_dst), ("objects", sent))

        def recv_object_list(objects: list[Any], src: Any = None, group: Any = None, device: Any = None, group_src: Any = None, **_: Any) -> int:
            source = peer(src, group, group_src)
            kind, got = self.take(source, dist.get_rank())
            if kind == "unknown":
                raise PeerGone(
                    f"rank {dist.get_rank()} receives objects from rank {source} after their "
                    "stages were set up"
                )
            if kind != "objects" or len(got) != len(objects):
                raise RuntimeError(
                    f"rank {dist.get_rank()} received {kind} from rank {source} where it expected "
                    f"{len(objects)} objects: the stages' schedules do not match"
                )
            objects[:] = got
            return 0

        return {
            "send": send,
            "recv": recv,
            "isend": isend,
            "irecv": irecv,
            "batch_isend_irecv": batch_isend_irecv,
            "send_object_list": send_object_list,
            "recv_object_list": recv_object_list,
        }


def _plain_outputs_releasable(releasable: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """torch 2.15's ``_output_slot_is_releasable``, a fake tensor answered as the plain
    tensor it stands for: its other checks read the stage alone (the last stage, DDP,
    a ``dw_builder``), so they are asked of a plain empty tensor in its place."""
    with _no_modes():
        plain = torch.empty(0)

    def output_slot_is_releasable(stage: Any, output: Any) -> Any:
        return releasable(stage, plain if type(output) is FakeTensor else output)

    return output_slot_is_releasable


class _Delivered(types.ModuleType):
    """``torch.distributed`` as the pipelining schedules see it while the pipeline's ranks
    trace: the process groups' backend is not ``"fake"`` (torch 2.14 and later decide
    the stages' metadata without their vote over a fake group, which cannot deliver it:
    this one does), everything else torch.distributed's own."""

    def __init__(self, dist: types.ModuleType) -> None:
        super().__init__(dist.__name__)
        self._dist = dist

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def get_backend(self, group: Any = None) -> str:
        backend = self._dist.get_backend(group)
        return "delivered" if backend == "fake" else backend


@contextmanager
def _ddp_forward_per_thread() -> Iterator[None]:
    """DDP's "module in forward" (which dynamo reads to split a compiled graph at its
    buckets) of each thread's own: torch keeps it in one class attribute, saved and
    restored around each forward, and ranks' forwards interleaved on threads would leave
    one rank's DDP module there after the estimate (every later ``torch.compile`` then
    splits its graphs for it)."""
    from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

    local = threading.local()

    @contextmanager
    def inside_ddp_forward(module: Any) -> Iterator[None]:
        before = getattr(local, "active", None)
        local.active = module
        try:
            yield
        finally:
            local.active = before

    ddp = "torch.nn.parallel.distributed.DistributedDataParallel"
    with (
        replacing(f"{ddp}._inside_ddp_forward", inside_ddp_forward),
        replacing(f"{ddp}._get_active_ddp_module", classmethod(lambda cls: getattr(local, "active", None))),
    ):
        yield


def _tracker() -> Any:
    from pytest_torchmem.engine.tracing.tracker import Tracker

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, Tracker):
            return mode
    return None


def _sent(tensor: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, torch.Tensor | None]:
    """What a send delivers: the tensor's shape, dtype and real value where the trace
    knows it (a copy, made with every mode off: the rank's trace never sees it, and
    nothing it holds waits on when the receiving thread takes the message)."""
    tracker = _tracker()
    value = tracker.values.of(tensor) if tracker is not None else None
    if value is None:
        return tuple(tensor.shape), tensor.dtype, None
    with _no_modes():
        return tuple(tensor.shape), tensor.dtype, value.clone()


def _received(tensor: torch.Tensor, message: tuple[str, Any], source: int) -> None:
    kind, payload = message
    if kind == "unknown":  # from a rank traced no further: the buffer's bytes, values unknown
        tracker = _tracker()
        if tracker is not None:
            tracker.values.forget(tensor)
        return
    if kind != "tensor":
        raise RuntimeError(f"received {kind} from rank {source} where a tensor was expected")
    shape, dtype, value = payload
    # (a process group moves bytes: a 0-d tensor fills a buffer of one element)
    if math.prod(shape) * dtype.itemsize != tensor.numel() * tensor.element_size():
        raise RuntimeError(
            f"rank {source} sent a tensor of shape {list(shape)} ({dtype}) into a buffer of shape "
            f"{list(tensor.shape)} ({tensor.dtype}): the stages do not agree on what passes between them"
        )
    tracker = _tracker()
    if tracker is None:
        return
    if value is None or dtype != tensor.dtype:
        tracker.values.forget(tensor)
    else:
        with _no_modes():
            value = value.reshape(tensor.shape)
        tracker.values.know(tensor, value)
