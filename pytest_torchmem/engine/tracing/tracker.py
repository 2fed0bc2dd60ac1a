"""The dispatch mode that runs the fake step op by op, and tells the ledger what each op allocates.

It sits above :class:`FakeTensorMode`: each aten op runs on fake tensors (its
fake kernel, or a rule of the device model in its place), and the tracker
records the storages of its outputs that it has not seen before (views and
in-place results share their base's storage and cost nothing), with the
kernel's scratch that the device's rules add. Where an op cannot run on fake
tensors, the values the trace knows run it, or the trace stops (:attr:`Tracker.stop`,
:mod:`.stops`).

Its rooms: :mod:`.ledger` keeps the storages (made, freed, resized);
:mod:`.op_plans` works out once what each op's schema and the device's rules
say; :mod:`.autograd_eager` makes autograd on fake tensors do what it does on
plain ones; :mod:`.fake_limits` tells what fake tensors cannot do from the
program's own errors; :mod:`.on_values` runs an op they cannot run on the values the
trace knows.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

import torch
from torch.utils.weak import WeakIdKeyDictionary

from pytest_torchmem.engine.user.layouts import COMPRESSED, parts
from pytest_torchmem.engine.figures.report import Category, Unsupported
from pytest_torchmem.engine.figures.timeline import ENTER as _ENTER
from pytest_torchmem.engine.figures.timeline import EXIT as _EXIT
from pytest_torchmem.engine.figures.timeline import Phase
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.autograd_eager import AutogradAsEager
from pytest_torchmem.engine.tracing.fake_limits import (
    NEEDS_VALUES,
    TraceAborted,
    UnsupportedOperatorException,
    fake_tensor_limit,
    first_line,
)
from pytest_torchmem.engine.tracing.ledger import StorageLedger, autograd_node
from pytest_torchmem.engine.tracing.on_values import OnValues
from pytest_torchmem.engine.tracing.op_plans import OpPlan, OpPlanner, number_nbytes, wrapped_numbers, written
from pytest_torchmem.engine.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    Inexact,
    Keep,
    OpCall,
    Output,
    RuleSet,
    TraceContext,
)
from pytest_torchmem.engine.tracing.stops import (
    CANNOT_RUN,
    COMPRESSED_SPARSE,
    Stop,
    stop_of,
    stopped_here,
)
from pytest_torchmem.engine.tracing.sparse_calls import (
    eager_refusal,
    fake_sparse_like,
    quiet_meta_failures,
    sparse_among,
    sparse_in,
)
from pytest_torchmem.engine.user.user_code import user_location
from pytest_torchmem.engine.tracing.values import ABSORBING, KnownValues, ValueKind

__all__ = [
    "Tracker",
    "TraceAborted",
    "autograd_node",
    "fake_like",
    "fake_tensor_limit",
]

# torch's private names (engine/torch_compat/torch_private.py), bound once: the dispatch reads them per op.
_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")
_set_eval_frame: Final = private("torch._C._dynamo.eval_frame.set_eval_frame")
_len_torch_dispatch_stack: Final = private("torch._C._len_torch_dispatch_stack")
_unset_dispatch_mode: Final = private("torch._C._unset_dispatch_mode")
_set_dispatch_mode: Final = private("torch._C._set_dispatch_mode")
_has_kernel_for: Final = private("torch._C._dispatch_has_kernel_for_dispatch_key")
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
FakeTensorMode: Final = private("torch._subclasses.fake_tensor.FakeTensorMode")
TorchDispatchMode: Final = private("torch.utils._python_dispatch.TorchDispatchMode")

_PRIM_DEVICE: Final = torch.ops.prim.device.default
#: A profiler's range (``record_function``'s enter and exit; FSDP2 marks each of its hooks
#: with one): no tensor in or out, nothing allocated.
_PROFILER_RANGES: Final = frozenset(
    {torch.ops.profiler._record_function_enter_new.default, torch.ops.profiler._record_function_exit._RecordFunction}
)
_no_modes: Final = private("torch.utils._python_dispatch._disable_current_modes")
#: The buffer of the Python numbers an op got in Tensor slots, wrapped as tensors.
_WRAPPED_TAG: Final = "<wrapped scalars>"
_ADD: Final = torch.ops.aten.add.Tensor
_STRIDED: Final = torch.strided
_BACKWARD: Final = Phase.BACKWARD
_FAKE_KEY: Final = private("torch._C._TorchDispatchModeKey.FAKE")
#: The tensor types the fake mode is told an op has (it reads the arguments themselves).
_FAKE_TYPES: Final = (FakeTensor,)
_MADE: Final = ValueKind.MADE
_COMPUTED: Final = ValueKind.COMPUTED
_SEEDED: Final = ValueKind.SEEDED
_EXCHANGED: Final = ValueKind.EXCHANGED
#: Tensor types the tracker handles itself; other subclasses (DTensor) dispatch first.
_PLAIN_TYPES: Final = frozenset({torch.Tensor, FakeTensor, torch.nn.Parameter})


def _skipped_by_dynamo() -> None:
    """Have dynamo's frame callback pass over ``Tracker.__torch_dispatch__`` (once)."""
    dispatch = Tracker.__torch_dispatch__
    if not getattr(dispatch, "_torchdynamo_disable", False):
        skip = private("torch._dynamo.decorators.skip")  # imports dynamo: at first use
        skip(dispatch)


class Tracker(OnValues, TorchDispatchMode):
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
        module_names: Sequence[str] = (),
        runs_compiled_code: bool = False,
    ) -> None:
        """Track the storages of fake tensors on ``device`` (the trace device).

        ``aliases`` are device types the traced program may name that stand for
        the modelled device (factories and ``.to()`` with them land on
        ``device``); ``wraps_numbers`` says whether Python numbers passed as
        tensors cost device memory (CPU only, the default on a CPU trace).
        ``optimizer_hook(optimizer, context)`` is told of each optimizer the step
        makes. ``record_frames`` keeps the user's frames of every allocation in the
        timeline (:attr:`StorageInfo.frames`), for reports that show them;
        ``module_names``: the names of the modules the step reports by index
        (``enter_module``). ``runs_compiled_code``: dynamo runs compiled code while
        the tracker is active (the trace follows compiled regions), so the tracker
        ignores compile internals, as dynamo asks of a mode it may run under.
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
        #: Told the end of each iteration of a repeated step (a leak check's look at what it
        #: keeps), after the timeline marks it.
        self.at_iteration_end: Callable[[int, Tracker], None] | None = None
        self._runs_compiled_code = runs_compiled_code
        #: The storages (see ledger.py); the timeline is the ledger's.
        self.ledger: Final = StorageLedger(
            device, record_frames=record_frames, module_names=list(module_names), on_sparse=self._met_sparse
        )
        self.timeline: Final = self.ledger.timeline
        #: On the fake cuda device (traced on ``meta``), the host storages the step makes
        #: (pinned buffers, offloaded activations, batches made on the CPU): not the GPU's
        #: memory, kept apart (the report's ``host_peak``); None on cpu.
        self.host: Final = StorageLedger(torch.device("cpu")) if device.type == "meta" else None
        self.record_frames: Final = record_frames
        self.unsupported: list[Unsupported] = []
        #: How many ops needed tensor values the trace did not know (each then stopped
        #: the trace or followed the op's fallback rule).
        self.values_missed = 0
        self.phase: Phase | None = None
        self.module = -1
        #: The plans of the trace's ops (see op_plans.py).
        self.planner: Final = OpPlanner(rules, self.unfollowed_sparse)
        # (bound once: the dispatch calls them on every op)
        self._plan = self.planner.plan
        self._sparse_plan = self.planner.sparse_plan
        self._track = self.ledger.track
        self._eager: Final = AutogradAsEager(self.ledger, self.context)
        #: Whether a sparse tensor has been met (until then no op's arguments are looked at).
        self.sparse = False
        self._inexact: set[Unsupported] = set()
        # The first stand-in given for a value-dependent op, if any (see stopped_by).
        self._assumed: Unsupported | None = None
        #: What stopped the trace (the first stop), if it stopped: the step's figures are
        #: then no estimate (the trace raises TraceStopped), even where the step caught
        #: the stop and went on.
        self.stop: Stop | None = None
        # Keyed by identity: a WeakKeyDictionary compares keys with ==, which on
        # tensors is an elementwise op (it fails on a closure's labels tensor).
        self._foreign: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._modules: list[int] = []  # running modules, innermost last
        #: Whether Python numbers passed as tensors cost device memory (CPU only).
        self.wrapped_scalars = device.type == "cpu" if wraps_numbers is None else wraps_numbers
        # Inside decomposed(): composite ops run their CompositeImplicitAutograd kernel.
        self._decomposing = 0
        #: How many ops needed tensor values (a value-dependent op, or one only values run).
        self.value_reads = 0
        #: How many of them read values that another iteration of the step may not give
        #: alike (not :meth:`KnownValues.settled`).
        self.unsettled_reads = 0
        #: Told of each op (``watch(-1, -1)``) and each module's entry and exit
        #: (``watch(ENTER or EXIT, index)``) before it is recorded, while set (block_replay.py
        #: watches a block's backward).
        self.watch: Callable[[int, int], None] | None = None
        #: Asked at each op with the step's phase: raises where the trace gives up (a trace
        #: that does not follow, having met a compiled function it could follow:
        #: ``Following.give_up_if_met``, set once it met one).
        self.gives_up: Callable[[Phase | None], None] | None = None
        #: A forward's serial: bumped each time the phase is set, and at each forward of a
        #: pipeline stage's micro-batch (:meth:`new_forward`).
        self.forwards = 0
        #: Whether a pipeline's stages are being set up: their metadata inferred by a forward
        #: and a backward that run in the step's forward phase.
        self.setting_up = False

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        # torch reads it on the mode when it is entered (TorchDispatchMode.__enter__)
        return self._runs_compiled_code

    def _met_sparse(self) -> None:
        self.sparse = True

    # -- storages (the ledger's) ---------------------------------------------------------

    @property
    def pool(self) -> int:
        """The allocator pool new storages are charged to (:attr:`StorageLedger.pool`)."""
        return self.ledger.pool

    def storage_id(self, t: torch.Tensor) -> int | None:
        """The sid of ``t``'s storage if the tracker knows it."""
        return self.ledger.storage_id(t)

    def pool_of(self, t: torch.Tensor) -> int | None:
        """The allocator pool of ``t``'s storage, if the tracker knows it."""
        return self.ledger.pool_of(t)

    def charge(self, t: torch.Tensor, op: str) -> None:
        """Record ``t``'s storages (a sparse tensor's parts) as allocated now by ``op``,
        where a rule made them out of the trace's sight (the new parts an in-place
        sparse op gives its tensor); storages the trace knows cost nothing."""
        device = t.fake_device if type(t) is FakeTensor else t.device
        if device == self.device:
            self._track(t, None, op, self.phase, self.module)

    def charge_to(self, pool: int) -> int:
        """Charge the storages made from now on to ``pool`` (a stream's, a CUDA graph's);
        the pool charged before."""
        return self.ledger.charge_to(pool)

    def live_since(self, first: int) -> list[int]:
        """The sids of the storages made since sid ``first`` that are still live."""
        return self.ledger.live_since(first)

    def adopt(self, t: torch.Tensor, category: Category) -> list[int]:
        """Register ``t``'s storage (a sparse tensor's: each of its parts') as live before
        the step, with a fixed role; the sids of those it had not registered yet."""
        if t.layout is not _STRIDED:
            self._met_sparse()  # (its ops' arguments are looked at from here on)
            return [sid for part in parts(t) for sid in self.adopt(part, category)]
        sid = self._track(t, category, "", self.phase, self.module)
        return [] if sid is None else [sid]

    def storage_resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (``untyped_storage().resize_``): to 0
        it is freed, from 0 it is a new block."""
        self.ledger.storage_resized(t)

    # -- the step's progress (the Probe protocol of pytest_torchmem.engine.step.built_in) ----

    def new_forward(self) -> None:
        """A forward of its own begins within the phase (a pipeline stage's micro-batch: its
        graph, and its backward, are its own)."""
        self.forwards += 1

    def set_phase(self, phase: Phase | None, iteration: int = 1) -> None:
        self._eager.settle(self.phase, self.module, final=True)
        self.forwards += 1
        self.phase = phase
        self._modules.clear()
        self.module = -1
        self.timeline.phase(phase, iteration)

    def enter_module(self, index: int) -> None:
        self._eager.settle_pending(self.phase, self.module)
        if self.watch is not None:
            self.watch(_ENTER, index)
        self._modules.append(index)
        self.module = index
        self.timeline.enter(index)

    def exit_module(self, index: int) -> None:
        self._eager.settle_pending(self.phase, self.module)
        if self.watch is not None:
            self.watch(_EXIT, index)
        for pos in range(len(self._modules) - 1, -1, -1):
            if self._modules[pos] == index:
                del self._modules[pos]
                break
        self.module = self._modules[-1] if self._modules else -1
        self.timeline.exit(index)

    def running_modules(self) -> tuple[int, ...]:
        """The modules running now, innermost last."""
        return tuple(self._modules)

    def resume(self, phase: Phase | None, modules: Sequence[int]) -> None:
        """Take up the step where replayed events left it (replay.py): in ``phase``,
        ``modules`` running, innermost last."""
        self.phase = phase
        self._modules[:] = modules
        self.module = self._modules[-1] if self._modules else -1

    def quiet(self) -> bool:
        """Whether nothing the last ops left is pending (autograd's bookkeeping, a
        composite's decomposition): a point the step can be replayed from."""
        eager = self._eager
        return not (
            eager.pending_numbers or eager.pending_views or eager.pending_formulas or eager.silent or self._decomposing
        )

    def name_phase(self, name: str, begin: bool) -> None:
        self._eager.settle_pending(self.phase, self.module)
        self.timeline.named(name, begin)

    def iteration_done(self, iteration: int) -> None:
        self._eager.settle(self.phase, self.module, final=True)
        self.timeline.mark(iteration)
        if self.at_iteration_end is not None:
            self.at_iteration_end(iteration, self)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._optimizer_hook is not None:
            self._optimizer_hook(optimizer, self.context)

    def assign_role(self, category: Category, tensors: Iterable[torch.Tensor]) -> None:
        with _DisableTorchFunction():  # see __torch_dispatch__
            self._eager.settle_numbers(self.phase, self.module)
            for t in tensors:
                # (a sparse tensor's memory is in its parts, a wrapper subclass's in its inner tensors)
                plain = type(t) in _PLAIN_TYPES and t.layout is _STRIDED
                for part in (t,) if plain else parts(t):
                    sid = self.ledger.storage_id(part)
                    if sid is not None:
                        self.timeline.assign_role(sid, category)

    # -- dispatch ------------------------------------------------------------

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
        if self.gives_up is not None:
            self.gives_up(self.phase)
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
        if self.watch is not None:
            self.watch(-1, -1)
        eager = self._eager
        if eager.silent and eager.in_silent_node():
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
            if eager.pending_numbers or eager.pending_views or eager.pending_formulas:
                eager.settle_pending(self.phase, self.module)
        if func in _PROFILER_RANGES:
            # run as it is, the fake tensors' mode off: its dispatch of an op without tensors
            # took five sixths of the op's time, thousands of times a pipeline's step
            with _no_modes():
                return func(*args, **kwargs)
        plan = self._plan(func)
        if plan.localize:
            args, kwargs = self._localize(args, kwargs)
        if self.sparse and sparse_among(args, kwargs):
            plan = self._sparse_plan(plan)
        if func is _ADD and eager.accumulates_in_place(args, kwargs, self.phase):
            # Autograd's input buffer adds a second gradient in place on plain
            # tensors; on fake ones it cannot tell, so it is done here.
            summed = args[0].add_(args[1])
            if self.values.known:
                self.values.rewritten(func, _COMPUTED, args, kwargs, summed)
            return summed
        if func is not _ADD and self.phase is _BACKWARD:
            eager.note_running_node()
        if plan.check is not None:  # the real kernel's refusal, raised as the program's error
            plan.check(OpCall(func, args, kwargs, context=self.context))
        real_out = needs_values = cannot_run = None
        # (what a sparse or composite rule's ops make and free is its kernel's scratch)
        first = len(self.timeline.storages) if plan.sparse or plan.composite is not None else -1
        try:
            if plan.composite is not None:
                # the parts come back through this mode, each traced with its own rules
                with self.decomposed():
                    out = plan.composite(OpCall(func, args, kwargs, context=self.context))
            elif plan.implementation is not None:
                out = plan.implementation(OpCall(func, args, kwargs, context=self.context))
            else:
                out = self.fake_kernel(func, args, kwargs)
        except NEEDS_VALUES as exc:
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
                else first_line(exc)
            )
        if cannot_run is not None or needs_values is not None or plan.reads_values:
            # (a fake constant's .item() is answered without needing values: read all the same)
            self.value_reads += 1
            if not self.values.settled(args, kwargs):
                self.unsettled_reads += 1
        if cannot_run is not None:
            out, real_out = self._ran_on_values(plan, args, kwargs, cannot_run)
        elif needs_values is not None:
            out, real_out = self._data_dependent(plan, args, kwargs, needs_values)

        # (most ops have no scratch rule: no OpCall is made for them)
        steps = (
            self._scratch(plan, OpCall(func, args, kwargs, out, self.context))
            if plan.scratch is not None
            else None
        )
        numbers = wrapped_numbers(plan, args, kwargs) if self.wrapped_scalars and plan.tensor_slots else None
        if numbers:
            numbers = eager.fresh_numbers(numbers)
            wrapped = sum(number_nbytes(value) for _, value in numbers)
            if wrapped:
                steps = [Alloc(_WRAPPED_TAG, wrapped), *(steps or (OUTPUTS,))]
        if steps:
            self._run_steps(plan, steps, out)
        else:
            self._record_outputs(plan, out)
        if first >= 0:
            self.ledger.scratch_since(first)
        if numbers and torch.is_grad_enabled():
            eager.remember_numbers(func, args, kwargs, out, numbers)
        if plan.written_slots and torch.is_grad_enabled():
            eager.remember_views(plan.written_slots, args, kwargs)
        if plan.formula is not None and torch.is_grad_enabled():
            eager.remember_formula(out, plan.formula)
        values = self.values
        known = values.known
        if (
            known
            and plan.implementation is not None
            and plan.values is _COMPUTED
            and not plan.written_slots
            and type(out) is FakeTensor
            and args
            and type(args[0]) is FakeTensor
            and not func.is_view
            and out.layout is _STRIDED
            and args[0].layout is _STRIDED
            and out.untyped_storage()._cdata == args[0].untyped_storage()._cdata
        ):
            # a rule ran the op in place into its first argument, as eager does
            values.rewritten(func, plan.values, args, kwargs, out)
        elif (
            real_out is not None
            or plan.values is _MADE
            or plan.values is _SEEDED
            or (
                plan.values is _EXCHANGED
                and type(args[0]) is FakeTensor
                and id(args[0]) in known
            )
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
            done = written(plan, args, kwargs) if plan.written_slots else ()
            values.after(func, plan.values, args, kwargs, out, done, real_out)
        return out

    def unfollowed_sparse(self, call: OpCall, what: str = "") -> Any:
        """A call with a sparse argument that no rule of the device follows (``what``: the
        case a rule leaves out): on a compressed sparse tensor the trace stops (fake
        tensors have no kernels for them); on a COO one its fake kernel runs, listed."""
        layouts = sorted({str(t.layout).removeprefix("torch.") for t in sparse_in(call.args, call.kwargs)})
        if any(t.layout in COMPRESSED for t in sparse_in(call.args, call.kwargs)):
            self._abort(call.func, f"an op on a {', '.join(layouts)} tensor", COMPRESSED_SPARSE)
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
            reason = f"fake tensors cannot run it on a sparse tensor ({first_line(exc)})"
            self._abort(call.func, reason, CANNOT_RUN)

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

    # -- an op's outputs and a rule's buffers -------------------------------------

    def _record_outputs(self, plan: OpPlan, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            outs: Any = (out,)
        elif isinstance(out, (tuple, list)):
            outs = out
        else:
            return
        for t in outs:
            if isinstance(t, torch.Tensor):
                if plan.mutable:
                    self.ledger.grown(t)
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
                    self._track(t, None, plan.name, self.phase, self.module)
                elif self.host is not None and device.type == "cpu" and t.layout is _STRIDED:
                    self.host.track(t, None, plan.name, self.phase, self.module)
            elif isinstance(t, (tuple, list)):
                self._record_outputs(plan, t)

    def _follows_sparse_output(self, plan: OpPlan) -> bool:
        """Whether the sparse output of ``plan``'s op is modelled: a sparse rule made it,
        or the device has a rule for the op (its author made it), or the op has one for
        sparse arguments (a constructor from parts, which the fake kernel follows)."""
        return (
            plan.implementation is not None
            or plan.scratch is not None
            or self.rules.sparse_rule(plan.func) is not None
        )

    def _run_steps(self, plan: OpPlan, steps: Any, out: Any) -> None:
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

    def _workspace(self, plan: OpPlan, nbytes: int, category: Category | None = Category.WORKSPACE) -> int:
        """A new storage for a buffer a rule allocates; its sid."""
        return self.ledger.workspace(nbytes, category, plan.name, self.phase, self.module)

    def _scratch(self, plan: OpPlan, call: OpCall) -> Any:
        """The steps of ``plan``'s scratch rule, or ``None``. A rule that fails (a case
        its author did not foresee) costs the op its scratch, listed in ``unsupported``,
        not the trace."""
        if plan.scratch is None:
            return None
        try:
            return plan.scratch(call)
        except Exception as exc:  # noqa: BLE001 - a rule's bug is reported, not raised
            self._report_inexact(
                plan.name, f"its memory rule failed ({first_line(exc)}); only its outputs counted"
            )
            return None

    # -- tensors made outside the trace ---------------------------------------------

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
                self._stopped(
                    stopped_here(
                        f"a {str(value.layout).removeprefix('torch.')} tensor",
                        "it comes from outside the model and the inputs, and fake tensors "
                        "cannot hold a compressed sparse tensor",
                        user_location(),
                        COMPRESSED_SPARSE,
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

    def _abort(self, func: Any, reason: str, advice: str) -> None:
        """Stop the trace at ``func`` (see :attr:`stop`)."""
        self._stopped(stopped_here(str(func), reason, user_location(), advice))
        raise TraceAborted(str(func))

    def _stopped(self, stop: Stop) -> None:
        self.unsupported.append(stop.entry)
        if self.stop is None:
            self.stop = stop

    def stopped_by(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised out of the traced step, is the trace's failure rather
        than the program's; if so the trace stopped (:attr:`stop`), and what stopped it is
        listed in ``unsupported``.

        The trace's: :class:`TraceAborted` (already listed); what fake tensors lack
        (values read by C++ code or ``.numpy()``, a fake kernel); and any exception raised
        after a stand-in for a value-dependent op (``.item()``, ``nonzero``) was used, since
        the real values could have taken the program elsewhere (:func:`.stops.stop_of`).
        Everything else (the user's own exceptions, a shape error the real kernel raises
        too) is the program's and propagates unchanged.
        """
        if isinstance(exc, TraceAborted):
            return True
        stop = stop_of(exc, self._assumed, self.context.device, self.device)
        if stop is None:
            return False
        self._stopped(stop)
        return True


@functools.cache
def _composite(func: Any) -> bool:
    """Whether ``func`` has a ``CompositeImplicitAutograd`` kernel."""
    return _has_kernel_for(func.name(), "CompositeImplicitAutograd")


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
