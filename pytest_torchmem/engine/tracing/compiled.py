"""Compiled regions met during a trace: never a silent eager figure.

A model compiled with ``torch.compile`` (``torch.compile(model)``,
``model.compile()``, a compiled submodule or function called in ``forward``)
runs eagerly under the tracer: dynamo does not compile frames while the
tracer's dispatch mode is active. The estimate is then the eager program's,
which can be far from the compiled one (inductor fuses pointwise ops, its
partitioner recomputes instead of saving, its memory planner reuses
buffers). Until the estimate follows the compiled pipeline, every compiled
region the step enters is listed in ``unsupported``, with where it is
defined, so that the report says plainly that its figures are eager ones.

Compiled code is entered through dynamo's ``compile_wrapper``, which installs
dynamo's frame callback; :func:`watch_compiled` notices that call.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Final

from torch import nn

from pytest_torchmem.engine.torch_compat.torch_private import entry, present, private
from pytest_torchmem.engine.torch_compat.torch_private_compiled import COMPILED_ENTRIES
from pytest_torchmem.engine.torch_compat.torch_replacing import caller_past_scoping, on_this_thread

__all__ = [
    "EAGER_REASON",
    "Held",
    "MEASURED_EAGER_REASON",
    "UNISOLATED_REASON",
    "Redirect",
    "CacheRegions",
    "eager_reason",
    "following_blocked",
    "invalidate_regions",
    "isolating",
    "measured_eager_reason",
    "region_of",
    "watch_compiled",
]

#: What the report says of a compiled region.
EAGER_REASON: Final = (
    "compiled with torch.compile: the estimate followed the eager program here, so "
    "these figures are the eager ones (inductor's fusions, recomputation and buffer "
    "reuse are not modelled)"
)

#: What a measurement's report says of a compiled region.
MEASURED_EAGER_REASON: Final = (
    "compiled with torch.compile: measure() does not yet run the compiled program's "
    "warm-up and steady state, so these figures may be the eager program's"
)


#: What both say of a compiled region on a torch without dynamo cache regions of our own.
UNISOLATED_REASON: Final = (
    "compiled with torch.compile: this torch's dynamo has no cache region of our own "
    "(isolate_recompiles, torch 2.13), and compiling here would add entries to the model's "
    "own dynamo cache and count against its recompile_limit; the region ran eagerly, so "
    "these figures are the eager ones"
)

#: Dynamo's names for cache regions of our own (torch 2.13: ``_next_isolate_recompiles_id``
#: in torch/_dynamo/eval_frame.py, ``set_eval_frame_isolate_recompiles_id`` in
#: torch/csrc/dynamo/eval_frame.c, ``_get_cache_entries_for_region``); 2.10 to 2.12 keep one
#: cache per code object, shared by every backend and counted against ``recompile_limit``
#: (torch/_dynamo/cache_size.py), with no way to remove an entry.
_ISOLATION: Final = (
    "torch._dynamo.eval_frame._next_isolate_recompiles_id",
    "torch._C._dynamo.eval_frame.set_eval_frame_isolate_recompiles_id",
    "torch._dynamo.eval_frame._get_cache_entries_for_region",
)


@functools.cache
def isolating() -> bool:
    """Whether this torch's dynamo keeps our compiles in cache regions of their own. Where
    it does not (before 2.13), no compiled region is followed or run compiled by the engine:
    each runs eagerly and is listed in ``unsupported``, and the user's caches are untouched."""
    return all(present(path) for path in _ISOLATION)


@functools.cache
def following_blocked() -> str | None:
    """The first private torch name that following a compiled program needs and this torch
    lacks (:data:`~pytest_torchmem.engine.torch_compat.torch_private.COMPILED_ENTRIES`), or None. Where
    one is missing no compiled region is followed: each runs eagerly, listed with its name."""
    return next((e.path for e in COMPILED_ENTRIES if not present(e.path)), None)


def eager_reason() -> str:
    """What an estimate's report says of a compiled region that ran eagerly."""
    missing = following_blocked()
    if missing is None:
        return EAGER_REASON
    if not isolating():
        return UNISOLATED_REASON
    return (
        f"compiled with torch.compile: this torch has no {missing} ({entry(missing).why}), "
        "which following the compiled program needs; the region ran eagerly, so these "
        "figures are the eager ones"
    )


def measured_eager_reason() -> str:
    """What a measurement's report says of a compiled region whose compiled code did not run."""
    return MEASURED_EAGER_REASON if isolating() else UNISOLATED_REASON


def region_of(wrapper_frame: Any) -> tuple[str, str]:
    """The compiled callable's name and ``file:line``, from dynamo's wrapper frame."""
    fn = wrapper_frame.f_locals.get("fn")
    try:
        fn = inspect.unwrap(fn)
    except ValueError:  # pragma: no cover - a cycle of __wrapped__
        pass
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        target: Any = type(owner).forward
        name = f"{type(owner).__qualname__}.forward"
    else:
        target = fn
        name = getattr(fn, "__qualname__", repr(fn))
    code = getattr(inspect.unwrap(target), "__code__", None) if target is not None else None
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return name, where


#: Where a compiled region the watch meets goes: the callback to run it with (the
#: region's own one, or one the trace follows it with), or None: run it eagerly, flagged;
#: or a :class:`Held` callback, with what must hold while the region runs.
Redirect = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Held:
    """A callback a region runs with, and a context entered when dynamo's
    ``compile_wrapper`` enters the region and left when it leaves it (a compiled
    function on the fake cuda device runs with the router popped, as its program was
    built: see :meth:`~pytest_torchmem.engine.tracing.compiled_cuda.CudaProgram.entering`)."""

    callback: Any
    context: Callable[[], AbstractContextManager[Any]]


@contextmanager
def watch_compiled(on_region: Callable[[str, str], None], redirect: Redirect | None = None) -> Iterator[None]:
    """Call ``on_region(name, location)`` whenever the code run enters a compiled region
    (but not one that ``redirect`` follows).

    ``redirect(callback, wrapper_frame)`` says how each region entered runs: the
    callback it returns (the region's own one, or one of the trace's), or None:
    then the region runs without dynamo (eagerly), and ``on_region`` is told.
    While the trace lets dynamo compile (its own warm-up step), a region of the
    user's backend would otherwise build real kernels and run them, or a cache
    entry of theirs, on fake tensors; and under a dispatch mode dynamo skips such
    a frame and marks its code skipped for good, which would leave the user's
    later real calls eager. Without ``redirect`` every region runs as compiled
    and ``on_region`` is told of each.
    """
    real = private("torch._dynamo.eval_frame._maybe_set_eval_frame")
    ran_eagerly: list[bool] = []
    # the compile_wrapper frames of the regions running with a Held context, innermost last
    held: list[tuple[Any, ExitStack]] = []

    def noticing(callback: Any) -> Any:
        caller = caller_past_scoping(sys._getframe(1))  # (on_this_thread's wrappers passed)
        if held and caller is held[-1][0]:
            # compile_wrapper puts back the callback before it: the region is left
            _, stack = held.pop()
            try:
                return real(callback)
            finally:
                stack.close()
        if callback is not None and callback is not False:
            if caller.f_code.co_name == "compile_wrapper":
                if redirect is None:
                    on_region(*region_of(caller))
                    return real(callback)
                followed = redirect(callback, caller)
                if isinstance(followed, Held):
                    stack = ExitStack()
                    stack.enter_context(followed.context())
                    held.append((caller, stack))
                    return real(followed.callback)
                if followed is not None:
                    return real(followed)
                on_region(*region_of(caller))
                ran_eagerly.append(True)
                return real(None)
        return real(callback)

    # (on this thread only: the stages of a pipeline are traced on threads of one process,
    # each inside its own watch, and a region one stage enters is that stage's)
    with (
        on_this_thread("torch._dynamo.eval_frame._maybe_set_eval_frame", noticing),
        on_this_thread(_FULLGRAPH_COUNT, _counting_eager_regions(ran_eagerly))
        if present(_FULLGRAPH_COUNT)
        else nullcontext(),
        warnings.catch_warnings(),
    ):
        # a compiled module run eagerly here meets the trace's own global module hooks, of
        # which OptimizedModule.__call__ warns (torch/_dynamo/eval_frame.py, 2.10 on): not
        # the user's concern
        warnings.filterwarnings(
            "ignore", message=r"Using `torch.compile\(module\)` when there are global hooks"
        )
        yield


_FULLGRAPH_COUNT: Final = "torch._dynamo.eval_frame.set_fullgraph_compiled_frame_count"


def _counting_eager_regions(ran_eagerly: list[bool]) -> Any:
    """``fullgraph=True``'s count of the frames dynamo compiled in a call (torch 2.12 on):
    compile_wrapper sets it to 0 before the call, reads it back (setting -1) after, and
    refuses a call that compiled none ("found no compiled frames"). A region the watch
    ran eagerly on purpose (flagged) is read back as one frame."""
    real = private(_FULLGRAPH_COUNT)

    def counting(count: int) -> int:
        before = real(count)
        if count == 0:
            ran_eagerly.clear()
        elif count < 0 and ran_eagerly:
            ran_eagerly.clear()
            return max(before, 1)
        return before  # type: ignore[no-any-return]

    return counting


class CacheRegions:
    """Dynamo cache regions of our own (as ``isolate_recompiles=True`` makes them): what is
    compiled in them never counts against the user's ``recompile_limit``, which dynamo
    counts in cache entries, invalidated ones too (a compiled optimizer step compiles once
    per optimizer). :meth:`new` opens another one (:attr:`current`); all are invalidated
    on exit, with ``reason``. Where dynamo has none (:func:`isolating`), none is opened
    (:attr:`current` stays -1) and there is nothing to invalidate."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.opened: list[int] = []
        self.current = -1

    def new(self) -> int:
        if not isolating():
            return self.current
        self.current = next(private("torch._dynamo.eval_frame._next_isolate_recompiles_id"))
        self.opened.append(self.current)
        return self.current

    def __enter__(self) -> CacheRegions:
        self.new()
        return self

    def __exit__(self, *exc: object) -> None:
        invalidate_regions(self.opened, self.reason)


def invalidate_regions(regions: list[int], reason: str) -> None:
    """Invalidate the cache entries of ``regions`` on every code object dynamo saw (dynamo
    keeps an invalidated entry, which no guard passes, and drops its code and program)."""
    if not regions:
        return
    input_codes = private("torch._dynamo.convert_frame.input_codes")
    _get_cache_entries_for_region = private("torch._dynamo.eval_frame._get_cache_entries_for_region")
    DeletedGuardManagerWrapper = private("torch._dynamo.guards.DeletedGuardManagerWrapper")
    for ref in list(input_codes.seen):
        code = ref()
        if code is None:
            continue
        for region in regions:
            for entry in _get_cache_entries_for_region(code, region):
                manager = entry.guard_manager
                extra_state = getattr(manager, "extra_state", None)
                if extra_state is not None:
                    extra_state.invalidate(entry, DeletedGuardManagerWrapper(reason))
