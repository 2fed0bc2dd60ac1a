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

import os
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from pytest_torchmem.report import Category, Unsupported
from pytest_torchmem.tracing.rules import (
    OUTPUTS,
    Alloc,
    Free,
    ImplementationRule,
    Inexact,
    Keep,
    OpCall,
    RuleSet,
    ScratchRule,
    TraceContext,
)
from pytest_torchmem.timeline import Frame, Phase, StorageInfo, Timeline

__all__ = ["Tracker", "TraceAborted", "user_location", "user_frames"]

# Ops through which torch.tensor(...) hands a freshly made real tensor to the
# fake mode, which turns it into a fake constant (its value stays known).
_LIFTS: Final = frozenset(
    {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}
)
_PRIM_DEVICE: Final = torch.ops.prim.device.default
_ADD: Final = torch.ops.aten.add.Tensor
# Inside __torch_dispatch__, the C++ use counts of an argument include the
# references the dispatcher and the Python binding hold: a tensor that only
# autograd's input buffer holds shows these counts (checked in the tests
# against the real engine's in-place accumulation).
_BUFFER_ONLY_USE_COUNT: Final = 4
_BUFFER_ONLY_STORAGE_USE_COUNT: Final = 2
_OWN_DIRS: Final = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(os.path.abspath(torch.__file__)),
)


class TraceAborted(Exception):
    """Raised inside the trace when an op can be neither run nor modelled."""


def user_location() -> str:
    """``file:line`` of the innermost frame outside torch and this package."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_OWN_DIRS) and not filename.startswith("<"):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def user_frames(limit: int = 16) -> tuple[Frame, ...]:
    """The frames outside torch and this package, innermost first (at most ``limit``)."""
    frames: list[Frame] = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        filename = code.co_filename
        if not filename.startswith(_OWN_DIRS) and not filename.startswith("<"):
            frames.append(Frame(filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(frames)


@dataclass(frozen=True, slots=True)
class _OpPlan:
    """What the tracker needs to know about an op, worked out once per op."""

    name: str
    localize: bool
    implementation: ImplementationRule | None
    scratch: ScratchRule | None
    mutable: bool
    #: ``(position, name)`` of the arguments the schema types as Tensor.
    tensor_slots: tuple[tuple[int, str], ...]


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
        self.fake_mode: Final = fake_mode
        self.device: Final = device
        self.rules: Final = rules
        self.context: Final = context or TraceContext(device.type)
        self.aliases: Final = aliases
        self._optimizer_hook = optimizer_hook
        self.record_frames: Final = record_frames
        self.timeline = Timeline()
        self.unsupported: list[Unsupported] = []
        self.phase: Phase | None = None
        self.module = -1
        self._live: dict[int, int] = {}  # storage _cdata -> sid
        self._refs: dict[int, weakref.ref[Any]] = {}  # sid -> weak reference keeping the callback
        self._plans: dict[Any, _OpPlan] = {}
        self._resized: dict[int, int] = {}  # sid -> bytes after its last resize
        self._inexact: set[Unsupported] = set()
        # Keyed by identity: a WeakKeyDictionary compares keys with ==, which on
        # tensors is an elementwise op (it fails on a closure's labels tensor).
        self._foreign: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._modules: list[int] = []  # running modules, innermost last
        #: Whether Python numbers passed as tensors cost device memory (CPU only).
        self.wrapped_scalars = device.type == "cpu" if wraps_numbers is None else wraps_numbers
        # Ops that took Python numbers in Tensor slots while autograd was recording:
        # (weak refs to their outputs, the outputs' nodes before the op, the slots'
        # names), settled once autograd has attached the op's node.
        self._pending_numbers: list[tuple[list[weakref.ref[Any]], list[Any], list[str]]] = []
        self._saved_numbers: set[int] = set()  # _cdata of wrapped numbers autograd saved

    # -- storages -----------------------------------------------------------

    def storage_id(self, t: torch.Tensor) -> int | None:
        """The sid of ``t``'s storage if the tracker knows it."""
        try:
            return self._live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None

    def adopt(self, t: torch.Tensor, category: Category) -> int | None:
        """Register ``t``'s storage as live before the step, with a fixed role."""
        return self._track(t, category, op="")

    def _track(self, t: torch.Tensor, category: Category | None, op: str) -> int | None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
            return None
        key = storage._cdata
        sid = self._live.get(key)
        if sid is not None:
            return sid
        info = StorageInfo(
            nbytes=storage.nbytes(),
            category=category,
            phase=self.phase,
            module=self.module,
            op=op,
            frames=user_frames() if self.record_frames and op else (),
        )
        sid = self.timeline.new_storage(info)
        self._live[key] = sid
        self._refs[sid] = weakref.ref(storage, self._freed_callback(key, sid))
        if op:
            self.timeline.alloc(sid)
        return sid

    def _freed_callback(self, key: int, sid: int) -> Callable[[Any], None]:
        def freed(_ref: Any) -> None:
            if self._live.get(key) == sid:
                del self._live[key]
            self._refs.pop(sid, None)
            self.timeline.free(sid)

        return freed

    def _check_resize(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        sid = self._live.get(storage._cdata)
        if sid is None:
            return
        nbytes = storage.nbytes()
        if nbytes > self._resized.get(sid, self.timeline.storages[sid].nbytes):
            # The allocator gives a new block and frees the old one after the copy.
            self.timeline.resize(sid, nbytes)
            self._resized[sid] = nbytes

    # -- the step's progress (the Probe protocol of pytest_torchmem.step) ----

    def set_phase(self, phase: Phase | None) -> None:
        self._settle_numbers(final=True)
        self.phase = phase
        self._modules.clear()
        self.module = -1
        self.timeline.phase(phase)

    def enter_module(self, index: int) -> None:
        self._settle_numbers()
        self._modules.append(index)
        self.module = index
        self.timeline.enter(index)

    def exit_module(self, index: int) -> None:
        self._settle_numbers()
        for pos in range(len(self._modules) - 1, -1, -1):
            if self._modules[pos] == index:
                del self._modules[pos]
                break
        self.module = self._modules[-1] if self._modules else -1
        self.timeline.exit(index)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._optimizer_hook is not None:
            self._optimizer_hook(optimizer, self.context)

    def assign_role(self, category: Category, tensors: Iterable[torch.Tensor]) -> None:
        self._settle_numbers()
        for t in tensors:
            sid = self.storage_id(t)
            if sid is not None:
                self.timeline.assign_role(sid, category)

    # -- dispatch ------------------------------------------------------------

    def _plan(self, func: Any) -> _OpPlan:
        plan = self._plans.get(func)
        if plan is None:
            plan = self._plans[func] = _OpPlan(
                name=str(func),
                localize=func not in _LIFTS,
                implementation=self.rules.implementation_rule(func),
                scratch=self.rules.scratch_rule(func),
                mutable=func._schema.is_mutable,
                tensor_slots=tuple(
                    (i, arg.name)
                    for i, arg in enumerate(func._schema.arguments)
                    if isinstance(arg.type, torch.TensorType)
                ),
            )
        return plan

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:
            # Asked constantly by autograd and C++ code; it allocates nothing.
            return args[0].fake_device
        kwargs = kwargs or {}
        if self._pending_numbers:
            self._settle_numbers()
        plan = self._plan(func)
        if plan.localize:
            args, kwargs = self._localize(args, kwargs)
        if func is _ADD and self._accumulates_in_place(args, kwargs):
            # Autograd's input buffer adds a second gradient in place on plain
            # tensors; on fake ones it cannot tell, so it is done here.
            return args[0].add_(args[1])
        try:
            if plan.implementation is not None:
                out = plan.implementation(OpCall(func, args, kwargs, context=self.context))
            else:
                out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            out = self._data_dependent(func, args, kwargs, exc)
        except UnsupportedOperatorException as exc:
            self._abort(func, f"fake tensors cannot run it ({exc})")

        steps = (
            plan.scratch(OpCall(func, args, kwargs, out, self.context))
            if plan.scratch is not None
            else None
        )
        numbers = (
            self._wrapped_numbers(plan, args, kwargs)
            if self.wrapped_scalars and plan.tensor_slots
            else []
        )
        if numbers:
            numbers = self._fresh_numbers(numbers)
        wrapped = sum(_number_nbytes(value) for _, value in numbers)
        if wrapped:
            steps = [Alloc("<wrapped scalars>", wrapped), *(steps or (OUTPUTS,))]
        if steps:
            self._run_steps(plan, steps, out)
        else:
            self._record_outputs(plan, out)
        if numbers and torch.is_grad_enabled():
            self._remember_numbers(args, kwargs, out, [name for name, _ in numbers])
        return out

    def _accumulates_in_place(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this ``add`` is autograd's input buffer summing two gradients in place.

        The engine (``InputBuffer::accumulate``) does ``old.add_(new)`` when grad
        mode is off and it holds the last reference to ``old`` and its storage,
        which is dense; otherwise ``old + new``. Fake tensors count as tensor
        subclasses, for which the engine always takes the second branch.
        """
        if kwargs or len(args) != 2 or torch.is_grad_enabled() or self.phase != Phase.BACKWARD:
            return False
        old, new = args
        if (
            type(old) is not FakeTensor
            or type(new) is not FakeTensor
            or torch._C._current_autograd_node() is None
            or old.shape != new.shape
            or old.dtype != new.dtype
            or not _dense(old)
        ):
            return False
        return (
            old._use_count() == _BUFFER_ONLY_USE_COUNT
            and torch._C._storage_Use_Count(old.untyped_storage()._cdata)
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
            if _number_nbytes(value):
                found.append((name, value))
        return found

    # -- wrapped numbers that autograd saves --------------------------------------
    #
    # The wrapped-number tensor of ``x / 3.0`` is saved by ``DivBackward0`` (its
    # ``other``): it lives on until the backward node releases it, and the
    # backward's ``grad / other`` reuses it instead of wrapping a new one. The
    # fake trace sees plain Python numbers, but autograd saves the same real
    # wrapped tensors during the trace, so their lifetimes can be followed.

    def _fresh_numbers(self, numbers: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``numbers`` less those the running backward node unpacked from its saved ones."""
        node = torch._C._current_autograd_node()
        if node is None or not self._saved_numbers:
            return numbers
        saved = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:  # released
                    continue
                if isinstance(value, torch.Tensor) and value._cdata in self._saved_numbers:
                    with torch._C._DisableTorchDispatch():  # a real tensor: read it directly
                        saved.append(value.item())
        fresh = []
        for name, value in numbers:
            if value in saved:
                saved.remove(value)
            else:
                fresh.append((name, value))
        return fresh

    def _remember_numbers(self, args: Any, kwargs: Any, out: Any, names: list[str]) -> None:
        inputs = [*args, *kwargs.values()]
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return
        results = out if isinstance(out, (tuple, list)) else (out,)
        outs = [t for t in results if isinstance(t, torch.Tensor)]
        if outs:
            # An in-place op's output keeps its old node until autograd rebases it.
            before = [t.grad_fn for t in outs]
            self._pending_numbers.append(([weakref.ref(t) for t in outs], before, names))

    def _settle_numbers(self, final: bool = False) -> None:
        """Charge the wrapped numbers that the last ops' backward nodes saved, until released.

        Called before the next op (or step event), once autograd has attached the
        node to the op's outputs; nothing is allocated in between.
        """
        pending, self._pending_numbers = self._pending_numbers, []
        for refs, before, names in pending:
            outs = [(t, old) for t, old in zip((r() for r in refs), before) if t is not None]
            node = next((t.grad_fn for t, old in outs if t.grad_fn not in (None, old)), None)
            if node is None:
                if outs and not final:  # autograd has not attached the op's node yet
                    self._pending_numbers.append((refs, before, names))
                continue
            for name in names:
                try:
                    saved = getattr(node, f"_saved_{name}", None)
                except RuntimeError:
                    continue
                if (
                    not isinstance(saved, torch.Tensor)
                    or isinstance(saved, FakeTensor)
                    or saved.dim() != 0
                    or saved._cdata in self._saved_numbers
                ):
                    continue
                self._charge_saved_number(saved)

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
                if t.device == self.device:
                    self._track(t, None, plan.name)
            elif isinstance(t, (tuple, list)):
                self._record_outputs(plan, t)

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
                sid = self._workspace(plan, step.nbytes)
                held[step.tag] = sid
                self.timeline.alloc(sid)
            elif isinstance(step, Free):
                sid = held.pop(step.tag, None)
                if sid is not None:
                    self.timeline.free(sid)
            elif isinstance(step, Inexact):
                self._report_inexact(plan.name, step.reason)
            elif isinstance(step, Keep):
                if step.nbytes > 0:
                    self.timeline.alloc(self._workspace(plan, step.nbytes))
            else:
                raise TypeError(
                    f"rule for {plan.name} returned {step!r}, "
                    "not Alloc, Free, Keep, Inexact or OUTPUTS"
                )
        if OUTPUTS not in steps:
            self._record_outputs(plan, out)
        for sid in reversed(list(held.values())):
            self.timeline.free(sid)

    def _workspace(self, plan: _OpPlan, nbytes: int) -> int:
        """A new storage for a buffer a rule allocates; its sid."""
        info = StorageInfo(
            nbytes=nbytes,
            category=Category.WORKSPACE,
            phase=self.phase,
            module=self.module,
            op=plan.name,
            frames=user_frames() if self.record_frames else (),
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
        if any(_needs_faking(a) for a in args):
            args = tuple(self._fake_foreign(a) for a in args)
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
            fake = fake_like(value, self._device_for(value.device))
            if value.requires_grad and value.is_leaf:
                fake.requires_grad_(True)
            self._foreign[value] = fake
            self.adopt(fake, Category.BUFFERS)
        return fake

    # -- what fake tensors cannot do ------------------------------------------

    def _report_inexact(self, op: str, reason: str) -> None:
        """List ``op`` in ``unsupported`` once per reason and source line."""
        entry = Unsupported(op, reason, user_location())
        if entry not in self._inexact:
            self._inexact.add(entry)
            self.unsupported.append(entry)

    def _data_dependent(self, func: Any, args: Any, kwargs: Any, exc: Exception) -> Any:
        fallback = self.rules.fallback_rule(func)
        if fallback is None:
            self._abort(func, f"output depends on tensor values ({type(exc).__name__})")
        out, reason = fallback(OpCall(func, args, kwargs, context=self.context))
        self.unsupported.append(Unsupported(str(func), reason, user_location()))
        return out

    def _abort(self, func: Any, reason: str) -> None:
        self.unsupported.append(
            Unsupported(str(func), f"{reason}; the trace stopped here", user_location())
        )
        raise TraceAborted(str(func))


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


def _needs_faking(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not isinstance(value, FakeTensor)
    if isinstance(value, (list, tuple)):
        return any(_needs_faking(v) for v in value)
    return False


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
