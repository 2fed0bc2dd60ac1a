"""The dispatch mode that records every storage the fake step allocates and frees.

It sits above :class:`FakeTensorMode`: each aten op runs on fake tensors, and
the tracker records the storages of its outputs that it has not seen before
(views and in-place results share their base's storage and cost nothing).
Frees come from weak references to the storages, so a storage dies exactly
when the eager program would drop its last reference. Per-op rules of the
device model add kernel scratch and replace kernels that fake tensors cannot
run.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.utils.weak import WeakIdKeyDictionary

from pytest_torchmem.engine.layouts import COMPRESSED, parts
from pytest_torchmem.engine.report import Category, Unsupported
from pytest_torchmem.engine.timeline import Phase, StorageInfo, Timeline
from pytest_torchmem.engine.torch_private import private
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    CheckRule,
    CompositeRule,
    REPLICA,
    Formula,
    FormulaCall,
    Free,
    ImplementationRule,
    Inexact,
    Keep,
    OpCall,
    Output,
    RuleSet,
    ScratchRule,
    TraceContext,
)
from pytest_torchmem.engine.tracing.sparse_calls import (
    eager_refusal,
    fake_sparse_like,
    quiet_meta_failures,
    sparse_among,
    sparse_in,
)
from pytest_torchmem.engine.tracing.user_code import location_in, runner_dirs, user_frames, user_location
from pytest_torchmem.engine.tracing.values import ABSORBING, KnownValues, ValueKind, value_kind

__all__ = [
    "Tracker",
    "TraceAborted",
    "autograd_node",
]

# torch's private names (engine/torch_private.py), bound once: the dispatch reads them per op.
_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")
_DisableTorchDispatch: Final = private("torch._C._DisableTorchDispatch")
_set_eval_frame: Final = private("torch._C._dynamo.eval_frame.set_eval_frame")
_current_autograd_node: Final = private("torch._C._current_autograd_node")
_len_torch_dispatch_stack: Final = private("torch._C._len_torch_dispatch_stack")
_unset_dispatch_mode: Final = private("torch._C._unset_dispatch_mode")
_set_dispatch_mode: Final = private("torch._C._set_dispatch_mode")
_storage_use_count: Final = private("torch._C._storage_Use_Count")
_SavedTensor: Final = private("torch._C._autograd.SavedTensor")
_has_kernel_for: Final = private("torch._C._dispatch_has_kernel_for_dispatch_key")
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
FakeTensorMode: Final = private("torch._subclasses.fake_tensor.FakeTensorMode")
UnsupportedOperatorException: Final = private("torch._subclasses.fake_tensor.UnsupportedOperatorException")
TorchDispatchMode: Final = private("torch.utils._python_dispatch.TorchDispatchMode")

# Ops through which torch.tensor(...) hands a freshly made real tensor to the
# fake mode, which turns it into a fake constant (its value stays known).
_LIFTS: Final = frozenset(
    {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}
)
_PRIM_DEVICE: Final = torch.ops.prim.device.default
#: The buffer of the Python numbers an op got in Tensor slots, wrapped as tensors.
_WRAPPED_TAG: Final = "<wrapped scalars>"
_ADD: Final = torch.ops.aten.add.Tensor
_STRIDED: Final = torch.strided
_BACKWARD: Final = Phase.BACKWARD
_FAKE_KEY: Final = private("torch._C._TorchDispatchModeKey.FAKE")
#: The tensor types the fake mode is told an op has (it reads the arguments themselves).
_FAKE_TYPES: Final = (FakeTensor,)
#: Marks (in ``Node.metadata``) a replayed view node given the as_strided_backward hook.
_AS_STRIDED_MARK: Final = "torchmem_as_strided_backward"
#: The wrapped numbers (in ``Node.metadata``) the node inside a CopySlices saved.
_SAVED_NUMBERS: Final = "torchmem_saved_numbers"
#: Tokens (in ``Node.metadata``) that die with the node.
_TOKENS: Final = "torchmem_tokens"
#: Whether a backward node's ``apply`` is running (in ``Node.metadata``): set by
#: the node's prehook, cleared by its post hook (see ``_note_running_node``).
_RUNNING: Final = "torchmem_running"
_MADE: Final = ValueKind.MADE
_COMPUTED: Final = ValueKind.COMPUTED
#: Whether a node's own formula runs unrecorded (in ``Node.metadata``): its eager
#: replica (a :class:`Formula`) runs in the post hook instead.
_SILENT: Final = "torchmem_silent"
#: The most view ops between a view written in place and its base that are modelled.
_MAX_VIEW_CHAIN: Final = 16
# Inside __torch_dispatch__, the C++ use counts of an argument include the
# references the dispatcher and the Python binding hold: a tensor that only
# autograd's input buffer holds shows these counts (checked in the tests
# against the real engine's in-place accumulation).
_BUFFER_ONLY_USE_COUNT: Final = 4
_BUFFER_ONLY_STORAGE_USE_COUNT: Final = 2


#: What fake tensors raise for an op they cannot run, where a real tensor would run it.
_CANNOT_RUN: Final = (
    UnsupportedOperatorException,
    private("torch._subclasses.fake_tensor.UnsupportedFakeTensorException"),
    private("torch._subclasses.fake_tensor.UnsupportedMutationAliasingException"),
)
#: Tensor types the tracker handles itself; other subclasses (DTensor) dispatch first.
_PLAIN_TYPES: Final = frozenset({torch.Tensor, FakeTensor, torch.nn.Parameter})
#: What fake tensors raise where the program asks a question only values answer.
_NEEDS_VALUES: Final = (
    private("torch._subclasses.fake_tensor.DataDependentOutputException"),
    private("torch._subclasses.fake_tensor.DynamicOutputShapeException"),
)
# Messages of the errors a fake tensor raises where a real one has no reason to:
# C++ code reading its values (c10's TensorImpl and StorageImpl), Tensor.numpy(),
# an op with no fake or meta kernel (torch.library's custom ops, the dispatcher).
_FAKE_LIMITS: Final = (
    "data is not allocated yet",
    "Cannot access data pointer of Tensor",
    "Cannot access storage of",
    ".numpy() is not supported for tensor subclasses",
    "Not available for 'meta' device type",
    "no fake impl",
    "'Meta' backend",
)


class TraceAborted(Exception):
    """Raised inside the trace when an op can be neither run nor modelled."""


def fake_tensor_limit(exc: BaseException) -> bool:
    """Whether ``exc`` comes from what fake tensors lack (values, a fake kernel),
    not from the traced program: the real step has no reason to raise it."""
    if isinstance(exc, (*_CANNOT_RUN, *_NEEDS_VALUES)):
        return True
    if not isinstance(exc, (RuntimeError, NotImplementedError)):
        return False
    text = str(exc)
    return any(limit in text for limit in _FAKE_LIMITS)


def autograd_node() -> str:
    """The name of the autograd node being run (``MmBackward0``), or ``""`` outside backward."""
    node = _current_autograd_node()
    return "" if node is None else node.name()


@dataclass(frozen=True, slots=True)
class _OpFacts:
    """What an op's schema tells the tracker (the same in every trace)."""

    name: str
    localize: bool
    mutable: bool
    tensor_slots: tuple[tuple[int, str], ...]
    written_slots: tuple[tuple[int, str], ...]
    values: ValueKind


def _op_facts(func: Any) -> _OpFacts:
    """The :class:`_OpFacts` of ``func``, worked out once per process."""
    found = _FACTS.get(id(func))
    if found is None or found[0] is not func:
        arguments = func._schema.arguments
        facts = _OpFacts(
            name=str(func),
            localize=func not in _LIFTS,
            mutable=func._schema.is_mutable,
            tensor_slots=tuple(
                (i, arg.name) for i, arg in enumerate(arguments) if isinstance(arg.type, torch.TensorType)
            ),
            written_slots=tuple(
                (i, arg.name)
                for i, arg in enumerate(arguments)
                if arg.alias_info is not None and arg.alias_info.is_write
            ),
            values=value_kind(func),
        )
        found = _FACTS[id(func)] = (func, facts)
    return found[1]


#: :func:`_op_facts` by ``id(op)``, with the op (which keeps the id its own).
_FACTS: dict[int, tuple[Any, _OpFacts]] = {}


@dataclass(frozen=True, slots=True)
class _OpPlan:
    """What the tracker needs to know about an op, worked out once per op and trace."""

    #: The op (held, so that its id, the plan's key, stays its own).
    func: Any
    name: str
    localize: bool
    implementation: ImplementationRule | None
    scratch: ScratchRule | None
    mutable: bool
    #: ``(position, name)`` of the arguments the schema types as Tensor.
    tensor_slots: tuple[tuple[int, str], ...]
    #: ``(position, name)`` of the arguments the op writes into.
    written_slots: tuple[tuple[int, str], ...] = ()
    #: Refuses what the real kernel refuses (raises its error), if the op has such a rule.
    check: CheckRule | None = None
    #: Runs the op's composite kernel with the tracker active, if the op has such a rule.
    composite: CompositeRule | None = None
    #: How its outputs' values are known.
    values: ValueKind = ValueKind.OPAQUE
    #: The eager backward formula of the node it makes, if the device replaces it.
    formula: Formula | None = None
    #: Whether it is the op's plan for sparse arguments (see Tracker._sparse_plan).
    sparse: bool = False


def _skipped_by_dynamo() -> None:
    """Have dynamo's frame callback pass over ``Tracker.__torch_dispatch__`` (once)."""
    dispatch = Tracker.__torch_dispatch__
    if not getattr(dispatch, "_torchdynamo_disable", False):
        skip = private("torch._dynamo.decorators.skip")  # imports dynamo: at first use
        skip(dispatch)


class Tracker(TorchDispatchMode):
    """Records the storage timeline of the ops dispatched while it is active."""

    def __init__(
        self,
        fake_mode: FakeTensorMode,
        device: torch.device,
        rules: RuleSet,
        *,
        context: TraceContext | None = None,
        aliases: frozenset[str] = frozenset({"meta"}),
        wraps_numbers: bool | None = None,
        optimizer_hook: Callable[[torch.optim.Optimizer, TraceContext], None] | None = None,
        record_frames: bool = False,
    ) -> None:
        """Track the storages of fake tensors on ``device`` (the trace device).

        ``aliases`` are device types the traced program may name that stand for
        the modelled device (factories and ``.to()`` with them land on
        ``device``); ``wraps_numbers`` says whether Python numbers passed as
        tensors cost device memory (CPU only, the default on a CPU trace).
        ``record_frames`` keeps the user's frames of every allocation in the
        timeline (:attr:`StorageInfo.frames`), for reports that show them.
        """
        super().__init__()
        _skipped_by_dynamo()
        self.fake_mode: Final = fake_mode
        self.device: Final = device
        self.rules: Final = rules
        self.context: Final = context or TraceContext(device.type)
        #: The values of small tensors the trace knows (see values.py).
        self.values: Final = KnownValues()
        self.context.values = self.values
        self.context.tracer = self
        self.aliases: Final = aliases
        self._optimizer_hook = optimizer_hook
        self.record_frames: Final = record_frames
        self._outer_dirs = runner_dirs() if record_frames else ()
        self.timeline = Timeline()
        self.unsupported: list[Unsupported] = []
        self.phase: Phase | None = None
        self.module = -1
        self._live: dict[int, int] = {}  # storage _cdata -> sid
        self._refs: dict[int, weakref.ref[Any]] = {}  # sid -> weak reference keeping the callback
        self._on_freed = self._freed  # (one bound method for every storage's reference)
        self._plans: dict[int, _OpPlan] = {}  # id(op) -> plan
        self._sparse_plans: dict[int, _OpPlan] = {}  # id(op) -> its plan for sparse arguments
        #: Whether a sparse tensor has been met (until then no op's arguments are looked at).
        self.sparse = False
        self._resized: dict[int, int] = {}  # sid -> bytes after its last resize
        self._inexact: set[Unsupported] = set()
        # The first stand-in given for a value-dependent op, if any (see stopped_by).
        self._assumed: Unsupported | None = None
        # Keyed by identity: a WeakKeyDictionary compares keys with ==, which on
        # tensors is an elementwise op (it fails on a closure's labels tensor).
        self._foreign: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._modules: list[int] = []  # running modules, innermost last
        #: The allocator pool new storages are charged to (see StorageInfo.pool): a
        #: CUDA graph's private pool while a program compiled with CUDA graphs runs,
        #: a stream's while the program runs on a side stream (parallel=: FSDP2's).
        self.pool = 0
        #: Whether Python numbers passed as tensors cost device memory (CPU only).
        self.wrapped_scalars = device.type == "cpu" if wraps_numbers is None else wraps_numbers
        # Ops that took Python numbers in Tensor slots while autograd was recording:
        # (weak refs to their outputs, the outputs' nodes before the op, the slots'
        # names, a probe for a node out of reach), settled once autograd has
        # attached the op's node.
        self._pending_numbers: list[
            tuple[list[weakref.ref[Any]], list[Any], list[str], _NumbersProbe]
        ] = []
        self._saved_numbers: set[int] = set()  # _cdata of wrapped numbers autograd saved
        # Views an in-place op wrote into while autograd was recording (weak refs),
        # whose regenerated nodes are settled once autograd has rebased them.
        self._pending_views: list[weakref.ref[Any]] = []
        # Outputs of ops whose node gets an eager formula (weak refs), settled once
        # autograd has attached the node; how many such nodes run unrecorded now.
        self._pending_formulas: list[tuple[weakref.ref[Any], Formula]] = []
        self._silent = 0
        # Inside decomposed(): composite ops run their CompositeImplicitAutograd kernel.
        self._decomposing = 0

    # -- storages -----------------------------------------------------------

    def storage_id(self, t: torch.Tensor) -> int | None:
        """The sid of ``t``'s storage if the tracker knows it."""
        try:
            return self._live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None

    def pool_of(self, t: torch.Tensor) -> int | None:
        """The allocator pool of ``t``'s storage, if the tracker knows it."""
        sid = self.storage_id(t)
        return None if sid is None else self.timeline.storages[sid].pool

    def charge(self, t: torch.Tensor, op: str) -> None:
        """Record ``t``'s storages (a sparse tensor's parts) as allocated now by ``op``,
        where a rule made them out of the trace's sight (the new parts an in-place
        sparse op gives its tensor); storages the trace knows cost nothing."""
        device = t.fake_device if type(t) is FakeTensor else t.device
        if device == self.device:
            self._track(t, None, op)

    def charge_to(self, pool: int) -> int:
        """Charge the storages made from now on to ``pool`` (a stream's, a CUDA graph's:
        see :attr:`pool`); the pool charged before."""
        before, self.pool = self.pool, pool
        return before

    def live_since(self, first: int) -> list[int]:
        """The sids of the storages made since sid ``first`` that are still live."""
        return sorted(sid for sid in self._live.values() if sid >= first)

    def adopt(self, t: torch.Tensor, category: Category) -> int | None:
        """Register ``t``'s storage as live before the step, with a fixed role."""
        return self._track(t, category, op="")

    def _track(self, t: torch.Tensor, category: Category | None, op: str) -> int | None:
        if t.layout is not _STRIDED:
            # a sparse tensor's memory is its parts' storages (the first one's sid is returned)
            self.sparse = True
            sids = [self._track(part, category, op) for part in parts(t)]
            return sids[0] if sids else None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # nested: no single storage
            return None
        key = storage._cdata
        sid = self._live.get(key)
        if sid is not None:
            return sid
        pool = self.pool if op else 0
        info = StorageInfo(storage.nbytes(), category, self.phase, self.module, op, (), "", pool)
        if self.record_frames and op:
            info.frames = user_frames(stop=self._outer_dirs)
            info.node = autograd_node()
        # (an op's output is allocated as it is made; a storage adopted before the step is not)
        sid = self.timeline.new_allocation(info) if op else self.timeline.new_storage(info)
        self._live[key] = sid
        ref = self._refs[sid] = _StorageRef(storage, self._on_freed)
        ref.key, ref.sid = key, sid
        return sid

    def _freed(self, ref: _StorageRef) -> None:
        key, sid = ref.key, ref.sid
        if self._live.get(key) == sid:
            del self._live[key]
        self._refs.pop(sid, None)
        self.timeline.free(sid)

    def _sized(self, t: torch.Tensor) -> tuple[int, int, int] | None:
        """``(sid, bytes now, bytes last charged)`` of ``t``'s live storage, or None."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        sid = self._live.get(storage._cdata)
        if sid is None:
            return None
        return sid, storage.nbytes(), self._resized.get(sid, self.timeline.storages[sid].nbytes)

    def storage_resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (``untyped_storage().resize_``): to 0
        it is freed, from 0 it is a new block."""
        found = self._sized(t)
        if found is None:
            return
        sid, nbytes, before = found
        if nbytes != before:
            self.timeline.resize(sid, nbytes)
            self._resized[sid] = nbytes

    def _check_resize(self, t: torch.Tensor) -> None:
        found = self._sized(t)
        if found is None:
            return
        sid, nbytes, before = found
        if nbytes > before:
            # The allocator gives a new block and frees the old one after the copy.
            self.timeline.resize(sid, nbytes)
            self._resized[sid] = nbytes

    # -- the step's progress (the Probe protocol of pytest_torchmem.engine.step) ----

    def set_phase(self, phase: Phase | None, iteration: int = 1) -> None:
        self._settle_numbers(final=True)
        self._settle_views()
        self._settle_formulas()
        self.phase = phase
        self._modules.clear()
        self.module = -1
        self.timeline.phase(phase, iteration)

    def enter_module(self, index: int) -> None:
        self._settle_pending()
        self._modules.append(index)
        self.module = index
        self.timeline.enter(index)

    def exit_module(self, index: int) -> None:
        self._settle_pending()
        for pos in range(len(self._modules) - 1, -1, -1):
            if self._modules[pos] == index:
                del self._modules[pos]
                break
        self.module = self._modules[-1] if self._modules else -1
        self.timeline.exit(index)

    def name_phase(self, name: str, begin: bool) -> None:
        self._settle_pending()
        self.timeline.named(name, begin)

    def _settle_pending(self) -> None:
        # (on each module entry and exit, forward and backward: mostly nothing is pending)
        if self._pending_numbers:
            self._settle_numbers()
        if self._pending_views:
            self._settle_views()
        if self._pending_formulas:
            self._settle_formulas()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._optimizer_hook is not None:
            self._optimizer_hook(optimizer, self.context)

    def assign_role(self, category: Category, tensors: Iterable[torch.Tensor]) -> None:
        with _DisableTorchFunction():  # see __torch_dispatch__
            self._settle_numbers()
            for t in tensors:
                for part in parts(t) if t.layout is not _STRIDED else (t,):
                    sid = self.storage_id(part)
                    if sid is not None:
                        self.timeline.assign_role(sid, category)

    # -- dispatch ------------------------------------------------------------

    def _plan(self, func: Any) -> _OpPlan:
        # Keyed by id: an OpOverload hashes in Python, a cost paid on every op; the
        # plan holds its op, so the id stays its own while the plan exists.
        plan = self._plans.get(id(func))
        if plan is None:
            facts = _op_facts(func)
            plan = self._plans[id(func)] = _OpPlan(
                func=func,
                name=facts.name,
                localize=facts.localize,
                implementation=self.rules.implementation_rule(func),
                scratch=self.rules.scratch_rule(func),
                check=self.rules.check_rule(func),
                composite=self.rules.composite_rule(func),
                mutable=facts.mutable,
                tensor_slots=facts.tensor_slots,
                written_slots=facts.written_slots,
                values=facts.values,
                formula=self.rules.formula_rule(func),
            )
        return plan

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo; this one
        # does the same itself at a fraction of that wrapper's cost, paid on every
        # op (4,370 calls in a GPT-2-small step): dynamo skips its frame (see
        # __init__) and it turns dynamo's frame callback off for what it calls.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:
            # Asked constantly by autograd and C++ code; it allocates nothing.
            return args[0].fake_device
        prior = _set_eval_frame(None)  # dynamo never traces the tracker's own code
        try:
            # Nor does a torch-function mode (a device's router) see its tensor
            # queries: thousands of calls a step, each a trip through Python.
            with _DisableTorchFunction():
                return self._dispatch(func, types, args, kwargs)
        finally:
            _set_eval_frame(prior)

    def _dispatch(self, func, types, args, kwargs):  # type: ignore[no-untyped-def]
        if not _PLAIN_TYPES.issuperset(types):
            # A tensor subclass (DTensor) runs its own dispatch first; its ops on
            # its local tensors come back here.
            return NotImplemented
        kwargs = kwargs or {}
        if self._silent and self._in_silent_node():
            return func(*args, **kwargs)  # a formula replaced by its eager replica
        if self._decomposing and _composite(func) and self.rules.implementation_rule(func) is None:
            # Called below autograd (by a composite's kernel, a rule's own calls), a
            # CompositeImplicitAutograd op reaches this mode whole; fake tensors would
            # decompose it out of sight.
            with self:  # (the mode is popped while it dispatches: its ops come back here)
                return func.decompose(*args, **kwargs)
        if not func.is_view:
            # Not on a view op: autograd may be regenerating a view's node, replaying
            # its view ops while it holds the view's lock, which grad_fn would take.
            if self._pending_numbers:
                self._settle_numbers()
            if self._pending_views:
                self._settle_views()
            if self._pending_formulas:
                self._settle_formulas()
        plan = self._plan(func)
        if plan.localize:
            args, kwargs = self._localize(args, kwargs)
        if self.sparse and sparse_among(args, kwargs):
            plan = self._sparse_plan(plan)
        if func is _ADD and self._accumulates_in_place(args, kwargs):
            # Autograd's input buffer adds a second gradient in place on plain
            # tensors; on fake ones it cannot tell, so it is done here.
            return args[0].add_(args[1])
        if func is not _ADD and self.phase is _BACKWARD:
            self._note_running_node()
        if plan.check is not None:  # the real kernel's refusal, raised as the program's error
            plan.check(OpCall(func, args, kwargs, context=self.context))
        real_out = needs_values = cannot_run = None
        first = len(self.timeline.storages) if plan.sparse else -1
        try:
            if plan.composite is not None:
                # the parts come back through this mode, each traced with its own rules
                with self.decomposed():
                    out = plan.composite(OpCall(func, args, kwargs, context=self.context))
            elif plan.implementation is not None:
                out = plan.implementation(OpCall(func, args, kwargs, context=self.context))
            else:
                out = self.fake_kernel(func, args, kwargs)
        except _NEEDS_VALUES as exc:
            # The fake kernel's frames, kept by the traceback (in reference cycles that
            # only the garbage collector breaks), hold the op's arguments: cleared, so
            # that the arguments die when the program drops them, not at a collection.
            traceback.clear_frames(exc.__traceback__)
            needs_values = type(exc).__name__
        except (RuntimeError, NotImplementedError) as exc:
            # Anything else the fake kernel raises is the program's error (a shape
            # mismatch the real kernel raises too), unless fake tensors caused it.
            if not fake_tensor_limit(exc):
                raise
            cannot_run = (
                "it has no fake or meta kernel"
                if isinstance(exc, UnsupportedOperatorException)
                else _first_line(exc)
            )
        if cannot_run is not None:
            # where every argument's value is known, the op runs on them
            known, real_out = self.values.run(func, plan.values, args, kwargs)
            if not known:
                self._abort(func, f"fake tensors cannot run it ({cannot_run})")
            out = self._from_values(plan, real_out, args)
        elif needs_values is not None:
            out, real_out = self._data_dependent(plan, args, kwargs, needs_values)

        # (most ops have no scratch rule: no OpCall is made for them)
        steps = (
            self._scratch(plan, OpCall(func, args, kwargs, out, self.context))
            if plan.scratch is not None
            else None
        )
        numbers = (
            self._wrapped_numbers(plan, args, kwargs)
            if self.wrapped_scalars and plan.tensor_slots
            else None
        )
        if numbers:
            numbers = self._fresh_numbers(numbers)
            wrapped = sum(_number_nbytes(value) for _, value in numbers)
            if wrapped:
                steps = [Alloc(_WRAPPED_TAG, wrapped), *(steps or (OUTPUTS,))]
        if steps:
            self._run_steps(plan, steps, out)
        else:
            self._record_outputs(plan, out)
        if first >= 0:
            self._scratch_since(first)
        if numbers and torch.is_grad_enabled():
            self._remember_numbers(func, args, kwargs, out, numbers)
        if plan.written_slots and torch.is_grad_enabled():
            self._remember_views(plan, args, kwargs)
        if plan.formula is not None and torch.is_grad_enabled():
            first = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(first, torch.Tensor):
                self._pending_formulas.append((weakref.ref(first), plan.formula))
        values = self.values
        known = values.known
        if (
            real_out is not None
            or plan.values is _MADE
            or (
                known
                and (
                    plan.written_slots
                    or (
                        plan.values is _COMPUTED
                        # (the first argument, looked up inline: most ops stop here)
                        and (not args or type(args[0]) is not FakeTensor or id(args[0]) in known)
                        and values.all_known(args, kwargs)
                    )
                    or func in ABSORBING  # one known argument may decide it
                )
            )
        ):
            written = _written(plan, args, kwargs) if plan.written_slots else ()
            values.after(func, plan.values, args, kwargs, out, written, real_out)
        return out

    def _sparse_plan(self, plan: _OpPlan) -> _OpPlan:
        """``plan`` for a call with a sparse argument: the device's sparse rule makes its
        outputs (the dense rules' scratch, checks and composites are for dense
        arguments); without one, :meth:`unfollowed_sparse` (see rules.py)."""
        found = self._sparse_plans.get(id(plan.func))
        if found is None:
            rule = self.rules.sparse_rule(plan.func)
            found = self._sparse_plans[id(plan.func)] = dataclasses.replace(
                plan,
                implementation=rule if rule is not None else self.unfollowed_sparse,
                scratch=None,
                check=None,
                composite=None,
                formula=None,
                sparse=True,
            )
        return found

    def _scratch_since(self, first: int) -> None:
        """The storages made since sid ``first`` and freed already were a sparse rule's
        scratch (a kernel's buffers, freed before it returns: workspace, as ``measure``
        reads them)."""
        live = set(self._live.values())
        storages = self.timeline.storages
        for sid in range(first, len(storages)):
            if sid not in live and storages[sid].category is None:
                storages[sid].category = Category.WORKSPACE

    def unfollowed_sparse(self, call: OpCall, what: str = "") -> Any:
        """A call with a sparse argument that no rule of the device follows (``what``: the
        case a rule leaves out): on a compressed sparse tensor the trace stops (fake
        tensors have no kernels for them); on a COO one its fake kernel runs, listed."""
        layouts = sorted({str(t.layout).removeprefix("torch.") for t in sparse_in(call.args, call.kwargs)})
        if any(t.layout in COMPRESSED for t in sparse_in(call.args, call.kwargs)):
            self._abort(
                call.func,
                f"an op on a {', '.join(layouts)} tensor: fake tensors have no kernels for "
                "compressed sparse tensors (measure() runs it)",
            )
        what = what or f"an op on a {', '.join(layouts)} tensor"
        self._report_inexact(
            str(call.func),
            f"{what} is not followed by the {self.rules.device} model: its fake kernel does not "
            "know how many elements a sparse result holds, nor what the kernel allocates",
        )
        try:
            with quiet_meta_failures():
                return call.default()
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            if fake_tensor_limit(exc):
                raise
            # the fake kernel's own refusal; the real kernel's is the program's error (asked
            # of the host's kernel: on the cpu trace only)
            traceback.clear_frames(exc.__traceback__)
            refused = eager_refusal(call) if self.device.type == "cpu" else None
            if refused is not None:
                raise refused from None
            self._abort(call.func, f"fake tensors cannot run it on a sparse tensor ({_first_line(exc)})")

    def fake_kernel(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` below the tracker: the fake mode's kernel.

        Called from the tracker's dispatch, with no other dispatch mode between it
        and the fake mode, the fake mode's ``dispatch`` is called directly, as the
        dispatcher would call it (the fake mode unset while it runs): without the
        trip through the C++ dispatcher and the fake mode's statistics and dynamo
        wrappers (~6 us an op: 7 ms of GPT-2 small's 1,200 ops). Anywhere else (a
        user's dispatch mode active, or a tensor subclass the fake mode refuses)
        the op is called as usual.
        """
        if _len_torch_dispatch_stack() == 1:  # the fake mode alone
            mode = _unset_dispatch_mode(_FAKE_KEY)
            if mode is self.fake_mode:
                try:
                    out = mode.dispatch(func, _FAKE_TYPES, args, kwargs)
                finally:
                    _set_dispatch_mode(mode)
                if out is not NotImplemented:
                    return out
            elif mode is not None:
                _set_dispatch_mode(mode)
        return func(*args, **kwargs)

    def _note_running_node(self) -> None:
        """Mark the backward node running this op as inside its ``apply``.

        ``Engine::evaluate_function`` (``torch/csrc/autograd/engine.cpp``) adds a
        node's outputs into the next nodes' input buffers under the same current
        node as its ``apply``, after the post hooks. An ``add`` of the backward
        formula itself (``var_mean_backward``'s ``gself + aux``, ``i1e``'s
        ``self.sgn() + result.reciprocal()``) is always out of place, and must not
        be taken for the buffer's in-place accumulation: the node's first other op
        registers a prehook and a post hook that say whether ``apply`` runs. A node
        whose ``apply`` dispatched no other op before an ``add`` is not known, and
        the use counts decide as before.
        """
        node = _current_autograd_node()
        if node is None:
            return
        meta = node.metadata
        if _RUNNING in meta:
            return
        meta[_RUNNING] = True

        def started(*_: Any) -> None:
            meta[_RUNNING] = True

        def finished(*_: Any) -> None:
            meta[_RUNNING] = False

        node.register_prehook(started)
        node.register_hook(finished)

    def _accumulates_in_place(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this ``add`` is autograd's input buffer summing two gradients in place.

        The engine (``InputBuffer::accumulate``) does ``old.add_(new)`` when grad
        mode is off and it holds the last reference to ``old`` and its storage,
        which is dense; otherwise ``old + new``. Fake tensors count as tensor
        subclasses, for which the engine always takes the second branch. Not while
        the node's ``apply`` runs (``_note_running_node``): that ``add`` is the
        formula's.
        """
        if kwargs or len(args) != 2 or torch.is_grad_enabled() or self.phase != Phase.BACKWARD:
            return False
        old, new = args
        node = _current_autograd_node()
        if (
            type(old) is not FakeTensor
            or type(new) is not FakeTensor
            or node is None
            or node.metadata.get(_RUNNING, False)
            or old.shape != new.shape
            or old.dtype != new.dtype
            or old.layout is not _STRIDED
            or new.layout is not _STRIDED
            or not _dense(old)
        ):
            return False
        return (
            old._use_count() == _BUFFER_ONLY_USE_COUNT
            and _storage_use_count(old.untyped_storage()._cdata)
            == _BUFFER_ONLY_STORAGE_USE_COUNT
        )

    def _wrapped_numbers(
        self, plan: _OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[str, Any]]:
        """``(slot name, value)`` of the Python numbers passed where the op takes a Tensor.

        Eager PyTorch wraps such a number in a 0-dim CPU tensor (int64, double,
        complex128 or bool) for the duration of the call.
        """
        found = []
        for index, name in plan.tensor_slots:
            value = args[index] if index < len(args) else kwargs.get(name)
            # (mostly a fake tensor, told apart by its type alone)
            if type(value) is not FakeTensor and _number_nbytes(value):
                found.append((name, value))
        return found

    @contextmanager
    def decomposed(self) -> Iterator[None]:
        """Run ops through the trace from inside a rule (a kernel's own calls to
        other ops, written out in Python): the trace's dispatch is entered again,
        and a composite op runs its ``CompositeImplicitAutograd`` kernel, as below
        autograd eagerly (inside a dispatch mode autograd's keys are excluded, and
        the mode would see the composite op whole)."""
        self._decomposing += 1
        try:
            with self:
                yield
        finally:
            self._decomposing -= 1

    # -- backward formulas run as eagerly ------------------------------------------
    #
    # Some backward formulas pick another algorithm for tensor subclasses, which
    # fake tensors are, than eagerly (``cumprod_backward``: by ``(input == 0).any()``
    # on plain tensors, always the masked one on subclasses). The device gives
    # such an op a :class:`Formula`, a Python replica of the eager formula: its
    # node gets hooks where autograd made it, the node's own formula then runs
    # unrecorded, and the replica runs in the post hook, through the trace, its
    # gradients replacing the node's.

    def _in_silent_node(self) -> bool:
        node = _current_autograd_node()
        return node is not None and node.metadata.get(_SILENT, False)

    def _settle_formulas(self) -> None:
        pending, self._pending_formulas = self._pending_formulas, []
        for ref, formula in pending:
            t = ref()
            node = None if t is None else t.grad_fn
            if node is None or node.name() != formula.node or _SILENT in node.metadata:
                continue
            self._replace_formula(node, formula)

    def _replace_formula(self, node: Any, formula: Formula) -> None:
        meta = node.metadata
        meta[_SILENT] = False
        # the hooks say when apply runs (see _note_running_node), registered here
        # rather than from inside the node, where the post hooks are being run
        meta[_RUNNING] = False

        # (the hooks find the node as the engine's current one: holding it in their
        # closures would make a cycle that keeps its saved tensors until a collection)
        def started(grads: Any) -> None:
            meta[_RUNNING] = True
            node = _current_autograd_node()
            call = FormulaCall(node, tuple(grads), (), self.context)
            if all(_saved_without_hooks(node, f"_saved_{name}") is not None for name in formula.saved):
                if formula.applies(call):
                    meta[_SILENT] = True
                    self._silent += 1

        def finished(grad_inputs: Any, grads: Any) -> Any:
            if not meta.get(_SILENT, False):
                meta[_RUNNING] = False
                return None
            meta[_SILENT] = False
            self._silent -= 1
            needed = tuple(g is not None for g in grad_inputs)
            meta[REPLICA] = True
            node = _current_autograd_node()
            try:
                replaced = formula.backward(FormulaCall(node, tuple(grads), needed, self.context))
            finally:
                meta[_RUNNING] = meta[REPLICA] = False
            return tuple(replaced)

        node.register_prehook(started)
        node.register_hook(finished)

    # -- wrapped numbers that autograd saves --------------------------------------
    #
    # The wrapped-number tensor of ``x / 3.0`` is saved by ``DivBackward0`` (its
    # ``other``): it lives on until the backward node releases it, and the
    # backward's ``grad / other`` reuses it instead of wrapping a new one. The
    # fake trace sees plain Python numbers, but autograd saves the same real
    # wrapped tensors during the trace, so their lifetimes can be followed.

    def _fresh_numbers(self, numbers: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``numbers`` less those the running backward node unpacked from its saved ones."""
        node = _current_autograd_node()
        if node is None:
            return numbers
        # (CopySlices runs the node of an in-place op on a view, which saved these)
        saved = list(node.metadata.get(_SAVED_NUMBERS, ())) if _is_copy_slices(node) else []
        for attr in dir(node) if self._saved_numbers else ():
            if attr.startswith("_saved_"):
                value = _saved_without_hooks(node, attr)
                if isinstance(value, torch.Tensor) and value._cdata in self._saved_numbers:
                    with _DisableTorchDispatch():  # a real tensor: read it directly
                        saved.append(value.item())
        fresh = []
        for name, value in numbers:
            if value in saved:
                saved.remove(value)
            else:
                fresh.append((name, value))
        return fresh

    def _remember_numbers(
        self, func: Any, args: Any, kwargs: Any, out: Any, numbers: list[tuple[str, Any]]
    ) -> None:
        inputs = [*args, *kwargs.values()]
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return
        results = out if isinstance(out, (tuple, list)) else (out,)
        outs = [t for t in results if isinstance(t, torch.Tensor)]
        if outs:
            # An in-place op's output keeps its old node until autograd rebases it.
            before = [t.grad_fn for t in outs]
            probe = _NumbersProbe(func, args, kwargs, numbers)
            names = [name for name, _ in numbers]
            self._pending_numbers.append(([weakref.ref(t) for t in outs], before, names, probe))

    def _settle_numbers(self, final: bool = False) -> None:
        """Charge the wrapped numbers that the last ops' backward nodes saved, until released.

        Called before the next op (or step event), once autograd has attached the
        node to the op's outputs; nothing is allocated in between.
        """
        pending, self._pending_numbers = self._pending_numbers, []
        for refs, before, names, probe in pending:
            outs = [(t, old) for t, old in zip((r() for r in refs), before) if t is not None]
            node = next((t.grad_fn for t, old in outs if t.grad_fn not in (None, old)), None)
            if node is None:
                if outs and not final:  # autograd has not attached the op's node yet
                    self._pending_numbers.append((refs, before, names, probe))
                continue
            copy_slices = _copy_slices_of_write(probe, [t for t, _ in outs])
            if copy_slices is not None:
                # An in-place op on a view: its node is inside CopySlices, out of reach.
                for value in probe.saved():
                    self._charge_number_until(value, copy_slices)
                continue
            for name in names:
                saved = _saved_without_hooks(node, f"_saved_{name}")
                if (
                    not isinstance(saved, torch.Tensor)
                    or isinstance(saved, FakeTensor)
                    or saved.dim() != 0
                    or saved._cdata in self._saved_numbers
                ):
                    continue
                self._charge_saved_number(saved)

    def _charge_number_until(self, value: Any, node: Any) -> None:
        """Charge the wrapped number ``value`` that the CopySlices ``node`` holds (in its
        in-place op's node), which its backward reuses, until the node has run or is
        destroyed (a graph dropped unrun: a checkpoint's recomputation)."""
        info = StorageInfo(
            nbytes=_number_nbytes(value),
            phase=self.phase,
            module=self.module,
            op="<saved wrapped scalar>",
        )
        sid = self.timeline.new_storage(info)
        self.timeline.alloc(sid)
        node.metadata.setdefault(_SAVED_NUMBERS, []).append(value)
        held = [True]

        def release(*_: Any) -> None:
            if held.pop() if held else False:
                self._refs.pop(sid, None)
                self.timeline.free(sid)

        node.register_hook(release)
        # The node's metadata dies with it: a token there tells when.
        token = _Token()
        node.metadata.setdefault(_TOKENS, []).append(token)
        self._refs[sid] = weakref.ref(token, release)

    def _charge_saved_number(self, saved: torch.Tensor) -> None:
        key = saved._cdata
        info = StorageInfo(
            nbytes=saved.element_size(), phase=self.phase, module=self.module, op="<saved wrapped scalar>"
        )
        sid = self.timeline.new_storage(info)
        self.timeline.alloc(sid)
        self._saved_numbers.add(key)

        def released(_ref: Any) -> None:
            self._saved_numbers.discard(key)
            self._refs.pop(sid, None)
            self.timeline.free(sid)

        self._refs[sid] = weakref.ref(saved, released)

    # -- views written in place --------------------------------------------------
    #
    # An in-place op on a view makes autograd rebase the view's history: the base
    # gets a CopySlices node and the view a regenerated node. For a plain strided
    # tensor that node is an AsStridedBackward0, whose as_strided_backward puts the
    # gradient into a new zeroed tensor the size of the base's storage; for a
    # tensor subclass (fake tensors) autograd replays the view ops from the base
    # instead (ViewBackward0, TransposeBackward0...), which allocate nothing. The
    # replayed nodes are given hooks that return what as_strided_backward returns.

    def _remember_views(self, plan: _OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for index, name in plan.written_slots:
            t = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(t, FakeTensor) and t._is_view():
                self._pending_views.append(weakref.ref(t))

    def _settle_views(self) -> None:
        pending, self._pending_views = self._pending_views, []
        for ref in pending:
            view = ref()
            base = None if view is None else view._base
            node = None if view is None else view.grad_fn
            if base is None or node is None or _AS_STRIDED_MARK in node.metadata:
                continue
            chain = _replay_chain(node, base)
            if not chain:
                continue
            # The first replayed node gets the view's gradient, the last one (next
            # to CopySlices) returns the base's: one hook takes it, the other
            # answers as as_strided_backward would.
            node.metadata[_AS_STRIDED_MARK] = True
            taken: list[torch.Tensor] = []
            node.register_prehook(_taken_by(taken))
            chain[-1].register_hook(_as_strided_backward(base, view, taken))

    def _record_outputs(self, plan: _OpPlan, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            outs: Any = (out,)
        elif isinstance(out, (tuple, list)):
            outs = out
        else:
            return
        for t in outs:
            if isinstance(t, torch.Tensor):
                if plan.mutable:
                    self._check_resize(t)
                # A fake tensor's device, read without the Python property (and the
                # fake cuda device's GPU view of it): outside a kernel it is fake_device.
                device = t.fake_device if type(t) is FakeTensor else t.device
                if t.layout is not _STRIDED and not self._follows_sparse_output(plan):
                    self._report_inexact(
                        plan.name,
                        "it makes a sparse tensor from dense ones, which the "
                        f"{self.rules.device} model does not follow: its fake kernel does not know "
                        "how many elements it holds",
                    )
                if device == self.device and not t._is_zerotensor():
                    # (a zero tensor, sgn's gradient say, has no memory)
                    self._track(t, None, plan.name)
            elif isinstance(t, (tuple, list)):
                self._record_outputs(plan, t)

    def _follows_sparse_output(self, plan: _OpPlan) -> bool:
        """Whether the sparse output of ``plan``'s op is modelled: a sparse rule made it,
        or the device has a rule for the op (its author made it), or the op has one for
        sparse arguments (a constructor from parts, which the fake kernel follows)."""
        return (
            plan.implementation is not None
            or plan.scratch is not None
            or self.rules.sparse_rule(plan.func) is not None
        )

    def _run_steps(self, plan: _OpPlan, steps: Any, out: Any) -> None:
        held: dict[str, int] = {}
        for step in steps:
            if step is OUTPUTS:
                self._record_outputs(plan, out)
            elif isinstance(step, Alloc):
                if step.nbytes <= 0:
                    continue
                if step.tag in held:
                    raise ValueError(f"rule for {plan.name}: buffer {step.tag!r} allocated twice")
                # Python numbers are wrapped by the binding before the kernel runs:
                # not kernel scratch, but a short-lived activation or temporary.
                category = None if step.tag == _WRAPPED_TAG else Category.WORKSPACE
                sid = self._workspace(plan, step.nbytes, category)
                held[step.tag] = sid
                self.timeline.alloc(sid)
            elif isinstance(step, Free):
                sid = held.pop(step.tag, None)
                if sid is not None:
                    self.timeline.free(sid)
            elif isinstance(step, Inexact):
                self._report_inexact(plan.name, step.reason)
            elif isinstance(step, Output):
                outs = out if isinstance(out, (tuple, list)) else (out,)
                if step.index < len(outs) and outs[step.index] is not None:
                    self._record_outputs(plan, outs[step.index])
            elif isinstance(step, Keep):
                if step.nbytes > 0:
                    self.timeline.alloc(self._workspace(plan, step.nbytes))
            else:
                raise TypeError(
                    f"rule for {plan.name} returned {step!r}, "
                    "not Alloc, Free, Keep, Inexact, Output or OUTPUTS"
                )
        if OUTPUTS not in steps:
            self._record_outputs(plan, out)
        for sid in reversed(list(held.values())):
            self.timeline.free(sid)

    def _workspace(
        self, plan: _OpPlan, nbytes: int, category: Category | None = Category.WORKSPACE
    ) -> int:
        """A new storage for a buffer a rule allocates; its sid."""
        info = StorageInfo(
            nbytes=nbytes,
            category=category,
            phase=self.phase,
            module=self.module,
            op=plan.name,
            frames=user_frames(stop=self._outer_dirs) if self.record_frames else (),
            node=autograd_node() if self.record_frames else "",
            pool=self.pool,
        )
        return self.timeline.new_storage(info)

    def _device_for(self, device: torch.device) -> torch.device:
        """Where a tensor the program puts on ``device`` lives in the trace."""
        return self.device if device.type in self.aliases else device

    def _localize(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Move factories naming the modelled device, and tensors made outside the
        trace, onto the trace device."""
        device = kwargs.get("device")
        if device is not None:
            device = torch.device(device)
            if device.type in self.aliases:
                kwargs = {**kwargs, "device": self.device}
        for a in args:
            # (a loop, not any() over a generator: this runs on every op, and most
            # arguments are fake tensors or plain values, told apart by type alone)
            kind = type(a)
            if kind is not FakeTensor and kind not in _INERT and _needs_faking(a):
                return tuple(self._fake_foreign(a) for a in args), kwargs
        return args, kwargs

    def _fake_foreign(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self._fake_foreign(v) for v in value)
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            return value
        fake = self._foreign.get(value)
        if fake is None:
            # Live before the step but outside the model's parameters, buffers and
            # attributes (a closure's tensor, say): known, so that in-place writes
            # into it allocate nothing, but not charged, as a real run cannot see it.
            if value.layout in COMPRESSED:
                self.flag(
                    Unsupported(
                        f"a {str(value.layout).removeprefix('torch.')} tensor",
                        "it comes from outside the model and the inputs, and fake tensors "
                        "cannot hold a compressed sparse tensor; the trace stopped here",
                        user_location(),
                    )
                )
                raise TraceAborted(str(value.layout))
            fake = (
                fake_sparse_like(value, self._device_for(value.device), fake_like)
                if value.layout is not _STRIDED
                else None
            )
            if fake is None:
                fake = fake_like(value, self._device_for(value.device))
            if value.requires_grad and value.is_leaf:
                fake.requires_grad_(True)
            self._foreign[value] = fake
            self.adopt(fake, Category.BUFFERS)
            self.values.adopt([(fake, value)])
        return fake

    # -- what fake tensors cannot do ------------------------------------------

    def compiled_region(self, name: str, location: str) -> None:
        """The step entered ``name``, compiled with torch.compile, which ran eagerly here."""
        from pytest_torchmem.engine.tracing.compiled import eager_reason

        self.flag(Unsupported(f"torch.compile: {name}", eager_reason(), location))

    def flag(self, entry: Unsupported) -> None:
        """List ``entry`` in ``unsupported``, once."""
        if entry not in self._inexact:
            self._inexact.add(entry)
            self.unsupported.append(entry)

    def _report_inexact(self, op: str, reason: str) -> None:
        """List ``op`` in ``unsupported`` once per reason and source line."""
        entry = Unsupported(op, reason, user_location())
        if entry not in self._inexact:
            self._inexact.add(entry)
            self.unsupported.append(entry)

    def _scratch(self, plan: _OpPlan, call: OpCall) -> Any:
        """The steps of ``plan``'s scratch rule, or ``None``. A rule that fails (a case
        its author did not foresee) costs the op its scratch, listed in ``unsupported``,
        not the trace."""
        if plan.scratch is None:
            return None
        try:
            return plan.scratch(call)
        except Exception as exc:  # noqa: BLE001 - a rule's bug is reported, not raised
            self._report_inexact(
                plan.name, f"its memory rule failed ({_first_line(exc)}); only its outputs counted"
            )
            return None

    def _data_dependent(self, plan: _OpPlan, args: Any, kwargs: Any, why: str) -> tuple[Any, Any]:
        """The outputs of a value-dependent op, and their real values (or ``None``):
        run on the values where the trace knows every argument's, else the op's
        fallback rule (exact where the values it needs are known)."""
        func = plan.func
        known, real = self.values.run(func, plan.values, args, kwargs)
        if known:
            return self._from_values(plan, real, args), real
        fallback = self.rules.fallback_rule(func)
        if fallback is None:
            self._abort(func, f"output depends on tensor values ({why})")
        out, reason = fallback(OpCall(func, args, kwargs, context=self.context))
        if reason is not None:
            entry = Unsupported(str(func), reason, user_location())
            self.unsupported.append(entry)
            if self._assumed is None:
                self._assumed = entry
        return out, None

    def _from_values(self, plan: _OpPlan, real: Any, args: Any) -> Any:
        """Fake outputs like ``real``, the op's outputs run on the values. The device
        model vouches for the kernel's other buffers where it has a rule for the op
        (a scratch rule, or a fallback written for it); otherwise the op is listed."""
        if plan.scratch is None and self.rules.fallback_rule(plan.func) is None:
            self._report_inexact(
                plan.name,
                "its outputs were made from the tensors' values (fake tensors cannot run it); "
                "what its kernel allocates beside them is not modelled",
            )
        return self._faked(real, args)

    def _faked(self, real: Any, args: Any) -> Any:
        """Fake tensors with the geometry (and storage size) of the real outputs ``real``."""
        if isinstance(real, (tuple, list)):
            return type(real)(self._faked(r, args) for r in real)
        if not isinstance(real, torch.Tensor):
            return real
        device = next(
            (a.fake_device for a in _tensors_in(args) if type(a) is FakeTensor), self.device
        )
        # (not fake_like: FakeTensorMode's dispatch cache keeps the storage given to
        # set_, which would never be freed)
        out = torch.empty(
            real.untyped_storage().nbytes() // real.element_size(), dtype=real.dtype, device=device
        )
        return out.as_strided_(real.shape, real.stride(), real.storage_offset())

    def _abort(self, func: Any, reason: str) -> None:
        self.unsupported.append(
            Unsupported(str(func), f"{reason}; the trace stopped here", user_location())
        )
        raise TraceAborted(str(func))

    def stopped_by(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised out of the traced step, is the trace's failure rather
        than the program's; if so it is listed in ``unsupported`` (the trace stopped).

        The trace's: :class:`TraceAborted` (already listed); what fake tensors lack
        (:func:`fake_tensor_limit`: values read by C++ code or ``.numpy()``, a fake
        kernel); and any exception raised after a stand-in for a value-dependent op
        (``.item()``, ``nonzero``) was used, since the real values could have taken
        the program elsewhere. Everything else (the user's own exceptions, a shape
        error the real kernel raises too) is the program's and propagates unchanged.
        """
        if isinstance(exc, TraceAborted):
            return True
        if not isinstance(exc, Exception):
            return False
        where = location_in(exc)
        if fake_tensor_limit(exc):
            op = "Tensor.numpy" if ".numpy()" in str(exc) else "(tensor values)"
            reason = f"fake tensors cannot run it ({_first_line(exc)})"
        elif self._assumed is not None:
            op = type(exc).__name__
            assumed = self._assumed
            reason = (
                f"{_first_line(exc)}, raised after {assumed.op}"
                f"{f' at {assumed.location}' if assumed.location else ''} "
                "was given a stand-in value"
            )
        else:
            return False
        self.unsupported.append(Unsupported(op, f"{reason}; the trace stopped here", where))
        return True


class _NumbersProbe:
    """Which Python numbers an op's backward node saves, found by running the op on
    0-dim real tensors: autograd decides from the op and from which inputs require
    grad, not from values. Used where the node is out of reach (inside CopySlices)."""

    def __init__(self, func: Any, args: Any, kwargs: Any, numbers: list[tuple[str, Any]]) -> None:
        self.func = func
        self.args = tuple(_probe_spec(a) for a in args)
        self.kwargs = tuple((k, _probe_spec(v)) for k, v in kwargs.items())
        self.numbers = tuple(numbers)

    def saved(self) -> list[Any]:
        """The numbers the op's node saves (saved-tensor hooks never get a wrapped
        number: SavedVariable in torch/csrc/autograd/saved_variable.cpp)."""
        key = (self.func, self.args, self.kwargs, self.numbers)
        found = _PROBED.get(key)
        if found is None:
            # In a thread of its own: none of the trace's modes, dispatch-key
            # exclusions or grad mode, which are thread-local.
            box: list[list[Any]] = []
            worker = threading.Thread(target=lambda: box.append(self._run()), daemon=True)
            worker.start()
            worker.join()
            found = box[0] if box else []
            if len(_PROBED) >= _PROBED_MAX:
                _PROBED.clear()
            _PROBED[key] = found
        return found

    def _run(self) -> list[Any]:
        try:
            args = tuple(_probe_value(a) for a in self.args)
            kwargs = {k: _probe_value(v) for k, v in self.kwargs}
            out = self.func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - what 0-dim tensors cannot run is not probed
            return []
        results = out if isinstance(out, (tuple, list)) else (out,)
        node = next((t.grad_fn for t in results if isinstance(t, torch.Tensor) and t.grad_fn), None)
        if node is None:
            return []
        return [
            value
            for name, value in self.numbers
            if isinstance(getattr(node, f"_saved_{name}", None), torch.Tensor)
        ]


#: _NumbersProbe's answers by (op, argument specs, numbers).
_PROBED: dict[Any, list[Any]] = {}
_PROBED_MAX: Final = 4096
_PROBE_TENSOR: Final = object()


class _Token:
    """An object to hold a weak reference to."""


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a tracked storage that carries its key and sid: one object
    a storage, where a callback closing over them made three more."""

    __slots__ = ("key", "sid")
    key: int
    sid: int


def _probe_spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (_PROBE_TENSOR, value.dtype, value.requires_grad)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return (_PROBE_TENSOR, None, False)  # not probed
    return value


def _probe_value(spec: Any) -> Any:
    if isinstance(spec, tuple) and len(spec) == 3 and spec[0] is _PROBE_TENSOR:
        _, dtype, requires_grad = spec
        if dtype is None:
            raise TypeError("a list of tensors")
        t = torch.zeros((), dtype=dtype, requires_grad=requires_grad)
        return t.clone() if requires_grad else t  # not a leaf, which in-place ops refuse
    return spec


def _is_copy_slices(node: Any) -> bool:
    return node.name().endswith("CopySlices")  # torch::autograd::CopySlices


def _copy_slices_of_write(probe: _NumbersProbe, outs: list[torch.Tensor]) -> Any:
    """The CopySlices node that an in-place op on a view gave its base, if it was one."""
    if not probe.func._schema.is_mutable:
        return None
    for t in outs:
        base = t._base
        if base is not None and base.grad_fn is not None and _is_copy_slices(base.grad_fn):
            return base.grad_fn
    return None


def _taken_by(taken: list[torch.Tensor]) -> Callable[[Any], None]:
    """A pre hook that puts the node's first gradient into ``taken``."""

    def hook(grad_outputs: Any) -> None:
        taken.append(grad_outputs[0])

    return hook


def _replay_chain(node: Any, base: torch.Tensor) -> list[Any]:
    """The nodes from ``node`` down to the CopySlices of ``base`` (excluded), if ``node``
    is a view's regenerated node (a replay: one node per view op from the base)."""
    copy_slices = base.grad_fn
    if copy_slices is None or not _is_copy_slices(copy_slices):
        return []
    chain = [node]
    while len(chain) <= _MAX_VIEW_CHAIN:
        nexts = chain[-1].next_functions
        if len(nexts) != 1 or nexts[0][0] is None:
            return []
        if nexts[0][0] is copy_slices:
            return chain
        chain.append(nexts[0][0])
    return []


def _as_strided_backward(
    base: torch.Tensor, view: torch.Tensor, taken: list[torch.Tensor]
) -> Callable[..., Any]:
    """A post hook for the last replayed node of ``view``: the gradient of ``base`` as
    the AsStridedBackward0 of a plain tensor makes it from the view's gradient
    (``taken``) (``as_strided_backward`` in torch/csrc/autograd/FunctionsManual.cpp,
    for views without overlapping memory)."""
    base_geometry = (tuple(base.shape), base.stride(), base.storage_offset())
    view_geometry = (tuple(view.shape), view.stride(), view.storage_offset())

    def hook(grad_inputs: Any, grad_outputs: Any) -> Any:
        grad, replayed = (taken.pop() if taken else None), grad_inputs[0]
        if not isinstance(grad, torch.Tensor) or not isinstance(replayed, torch.Tensor):
            return None
        if replayed.untyped_storage()._cdata != grad.untyped_storage()._cdata:
            return None  # the replay allocated its result, as as_strided_backward does
        if 0 in base_geometry[0] or 0 in view_geometry[0]:
            return None
        shared = min(base_geometry[2], view_geometry[2])
        base_offset, view_offset = base_geometry[2] - shared, view_geometry[2] - shared
        size = max(
            _min_storage_size(base_geometry[0], base_geometry[1], base_offset),
            _min_storage_size(view_geometry[0], view_geometry[1], view_offset),
        )
        storage = grad.new_zeros(size)
        storage.as_strided(view_geometry[0], view_geometry[1], view_offset).copy_(grad)
        return (storage.as_strided(base_geometry[0], base_geometry[1], base_offset),)

    return hook


def _min_storage_size(sizes: tuple[int, ...], strides: tuple[int, ...], offset: int) -> int:
    return offset + 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (fake-tensor messages run to many lines)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _saved_without_hooks(node: Any, attr: str) -> Any:
    """The tensor a backward node saved as ``attr``, if it has no unpack hook (else None).

    Reading a saved tensor runs its unpack hook: a non-reentrant checkpoint
    recomputes its forward there. Wrapped numbers are saved without hooks.
    """
    raw = getattr(node, "_raw" + attr, None)
    if not isinstance(raw, _SavedTensor):
        return None
    try:
        if raw.unpack_hook is not None:
            return None
        return getattr(node, attr)
    except RuntimeError:  # released
        return None


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of its storage with no gaps or overlaps."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _number_nbytes(value: Any) -> int:
    """Bytes of the 0-dim tensor ATen wraps the Python number ``value`` in (0 if not one)."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, complex):
        return 16
    if isinstance(value, (int, float)):
        return 8
    return 0


@functools.cache
def _composite(func: Any) -> bool:
    """Whether ``func`` has a ``CompositeImplicitAutograd`` kernel."""
    return _has_kernel_for(func.name(), "CompositeImplicitAutograd")


def _tensors_in(values: Any) -> Iterable[Any]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _written(plan: _OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments ``plan``'s op writes into."""
    return tuple(
        args[index] if index < len(args) else kwargs.get(name) for index, name in plan.written_slots
    )


def _needs_faking(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not isinstance(value, FakeTensor)
    if isinstance(value, (list, tuple)):
        for v in value:  # (sizes, mostly: ints, told apart by type alone)
            kind = type(v)
            if kind is not FakeTensor and kind not in _INERT and _needs_faking(v):
                return True
    return False


#: Argument types that are never tensors nor hold any.
_INERT: Final = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)


def fake_like(
    t: torch.Tensor, device: torch.device, storage: torch.UntypedStorage | None = None
) -> torch.Tensor:
    """A fake tensor on ``device`` with ``t``'s metadata, sharing no real memory.

    Call it with a :class:`FakeTensorMode` active. ``storage`` is a fake storage
    to view (so that tensors sharing a real storage share a fake one); by
    default a new one of ``t``'s storage size is made.
    """
    if storage is None:
        storage = torch.empty(
            t.untyped_storage().nbytes(), dtype=torch.uint8, device=device
        ).untyped_storage()
    fake = torch.empty(0, dtype=t.dtype, device=device)
    fake.set_(storage, t.storage_offset(), t.shape, t.stride())
    return fake
