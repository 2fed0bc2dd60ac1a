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

from pytest_torchmem.report import Category, Unsupported
from pytest_torchmem.tracing.rules import OUTPUTS, Alloc, Free, OpCall, RuleSet
from pytest_torchmem.timeline import Phase, StorageInfo, Timeline

__all__ = ["Tracker", "TraceAborted", "user_location"]

_META: Final = torch.device("meta")
# Ops through which torch.tensor(...) hands a freshly made real tensor to the
# fake mode, which turns it into a fake constant (its value stays known).
_LIFTS: Final = frozenset(
    {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}
)
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


class Tracker(TorchDispatchMode):
    """Records the storage timeline of the ops dispatched while it is active."""

    def __init__(self, fake_mode: FakeTensorMode, device: torch.device, rules: RuleSet) -> None:
        super().__init__()
        self.fake_mode: Final = fake_mode
        self.device: Final = device
        self.rules: Final = rules
        self.timeline = Timeline()
        self.unsupported: list[Unsupported] = []
        self.phase: Phase | None = None
        self.module = -1
        self._live: dict[int, int] = {}  # storage _cdata -> sid
        self._refs: dict[int, weakref.ref[Any]] = {}  # sid -> weak reference keeping the callback
        self._mutable: dict[Any, bool] = {}
        self._foreign: weakref.WeakKeyDictionary[torch.Tensor, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )
        self._modules: list[int] = []  # running modules, innermost last
        self._tensor_slots: dict[Any, tuple[tuple[int, str], ...]] = {}
        #: Whether Python numbers passed as tensors cost device memory (CPU only).
        self.wrapped_scalars = device.type == "cpu"

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
        info = self.timeline.storages[sid]
        if nbytes > info.nbytes:
            # The allocator gives a new block and frees the old one after the copy.
            self.timeline.resize(sid, info.nbytes + nbytes)
            self.timeline.resize(sid, nbytes)
            info.nbytes = nbytes

    # -- the step's progress (the Probe protocol of pytest_torchmem.step) ----

    def set_phase(self, phase: Phase | None) -> None:
        self.phase = phase
        self._modules.clear()
        self.module = -1
        self.timeline.phase(phase)

    def enter_module(self, index: int) -> None:
        self._modules.append(index)
        self.module = index
        self.timeline.enter(index)

    def exit_module(self, index: int) -> None:
        for pos in range(len(self._modules) - 1, -1, -1):
            if self._modules[pos] == index:
                del self._modules[pos]
                break
        self.module = self._modules[-1] if self._modules else -1
        self.timeline.exit(index)

    def assign_role(self, category: Category, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            sid = self.storage_id(t)
            if sid is not None:
                self.timeline.assign_role(sid, category)

    # -- dispatch ------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func not in _LIFTS:
            args, kwargs = self._localize(args, kwargs)
        implementation = self.rules.implementation_rule(func)
        try:
            if implementation is not None:
                out = implementation(OpCall(func, args, kwargs))
            else:
                out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            out = self._data_dependent(func, args, kwargs, exc)
        except UnsupportedOperatorException as exc:
            self._abort(func, f"fake tensors cannot run it ({exc})")

        scratch = self.rules.scratch_rule(func)
        steps = scratch(OpCall(func, args, kwargs, out)) if scratch is not None else None
        wrapped = self._wrapped_scalars(func, args, kwargs) if self.wrapped_scalars else 0
        if wrapped:
            steps = [Alloc("<wrapped scalars>", wrapped), *(steps or (OUTPUTS,))]
        if steps:
            self._run_steps(func, steps, out)
        else:
            self._record_outputs(func, out)
        return out

    def _wrapped_scalars(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Bytes of the CPU tensors that wrap Python numbers passed where ``func`` takes a Tensor.

        Eager PyTorch wraps such a number in a 0-dim CPU tensor (int64, double,
        complex128 or bool) for the duration of the call.
        """
        slots = self._tensor_slots.get(func)
        if slots is None:
            slots = self._tensor_slots[func] = tuple(
                (i, arg.name)
                for i, arg in enumerate(func._schema.arguments)
                if isinstance(arg.type, torch.TensorType)
            )
        total = 0
        for index, name in slots:
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, bool):
                total += 1
            elif isinstance(value, complex):
                total += 16
            elif isinstance(value, (int, float)):
                total += 8
        return total

    def _record_outputs(self, func: Any, out: Any) -> None:
        mutable = self._mutable.get(func)
        if mutable is None:
            mutable = self._mutable[func] = func._schema.is_mutable
        name = ""
        if isinstance(out, torch.Tensor):
            outs: Any = (out,)
        elif isinstance(out, (tuple, list)):
            outs = out
        else:
            return
        for t in outs:
            if isinstance(t, torch.Tensor):
                if mutable:
                    self._check_resize(t)
                if t.device == self.device:
                    name = name or str(func)
                    self._track(t, None, name)
            elif isinstance(t, (tuple, list)):
                self._record_outputs(func, t)

    def _run_steps(self, func: Any, steps: Any, out: Any) -> None:
        held: dict[str, int] = {}
        for step in steps:
            if step is OUTPUTS:
                self._record_outputs(func, out)
            elif isinstance(step, Alloc):
                if step.nbytes <= 0:
                    continue
                if step.tag in held:
                    raise ValueError(f"rule for {func}: buffer {step.tag!r} allocated twice")
                info = StorageInfo(
                    nbytes=step.nbytes,
                    category=Category.WORKSPACE,
                    phase=self.phase,
                    module=self.module,
                    op=str(func),
                )
                sid = self.timeline.new_storage(info)
                held[step.tag] = sid
                self.timeline.alloc(sid)
            elif isinstance(step, Free):
                sid = held.pop(step.tag, None)
                if sid is not None:
                    self.timeline.free(sid)
            else:
                raise TypeError(f"rule for {func} returned {step!r}, not Alloc, Free or OUTPUTS")
        if OUTPUTS not in steps:
            self._record_outputs(func, out)
        for sid in reversed(list(held.values())):
            self.timeline.free(sid)

    def _localize(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Move meta-device factories and tensors made outside the trace onto the fake device."""
        device = kwargs.get("device")
        if device is not None and torch.device(device) == _META:
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
            fake = fake_like(value, self.device)
            if value.requires_grad and value.is_leaf:
                fake.requires_grad_(True)
            self._foreign[value] = fake
            self.adopt(fake, Category.BUFFERS)
        return fake

    # -- what fake tensors cannot do ------------------------------------------

    def _data_dependent(self, func: Any, args: Any, kwargs: Any, exc: Exception) -> Any:
        fallback = self.rules.fallback_rule(func)
        if fallback is None:
            self._abort(func, f"output depends on tensor values ({type(exc).__name__})")
        out, reason = fallback(OpCall(func, args, kwargs))
        self.unsupported.append(Unsupported(str(func), reason, user_location()))
        return out

    def _abort(self, func: Any, reason: str) -> None:
        self.unsupported.append(
            Unsupported(str(func), f"{reason}; the trace stopped here", user_location())
        )
        raise TraceAborted(str(func))


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
