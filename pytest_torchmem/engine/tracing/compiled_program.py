"""The program inductor builds for a compiled module, run on fake cpu tensors.

``torch.compile`` changes a step's memory: AOTAutograd's partitioner saves
other tensors for backward than eager autograd does, inductor fuses chains of
pointwise ops into one kernel (no intermediate buffers) and reuses a dead
buffer for a new one of the same size. To estimate the compiled program, the
trace runs that program itself: each compiled module of the model
(``torch.compile(model)``, ``model.compile()``, compiled submodules) is
compiled again, with the user's options (mode, options, dynamic, fullgraph),
by a backend that runs inductor to the end (its graphs, partition, lowering,
fusion, buffer plan and Python wrapper) but compiles no kernel: every C++
kernel is a no-op, and the wrapper's allocations go through the dispatcher
(``torch.empty_strided`` and ``as_strided``), where the fake mode and the
tracker see them. Kernels only write into buffers the wrapper allocated; what
they compute does not matter to memory.

Only the ``cpu`` device is followed: inductor's cuda path (triton) cannot run
on a CPU-only torch. Compiled *functions* (``torch.compile(fn)``) and regions
with a backend other than inductor are not followed: they run eagerly and are
listed in ``unsupported`` (see :mod:`compiled`).

Nothing of this may reach the user's own compiled calls:

- the compiled modules get their compiled callables back on exit;
- our compiles run in their own dynamo cache region (``isolate_recompiles``),
  so they never count against the user's ``recompile_limit``, and their cache
  entries are invalidated on exit (dynamo keeps an invalidated entry, which
  no guard passes, and drops its code and compiled function);
- inductor's caches are off while we compile (``force_disable_caches``), so
  no no-op-kernel artifact is written to or read from the FX graph, AOTAutograd
  or autotuning caches, and each output module is loaded with ``attrs`` and
  without ``sys.modules``, which keeps it out of ``PyCodeCache``'s by-path cache.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch
from torch import nn

from pytest_torchmem.engine.report import Unsupported
from pytest_torchmem.engine.tracing.inductor_device import host_vector_isa

__all__ = [
    "NOT_FOLLOWED_REASON",
    "CompiledModules",
    "Following",
    "compiled_modules",
    "following_compiled",
    "no_kernels",
    "not_followed",
]

#: What a compiled module's region says when its program could not be followed.
NOT_FOLLOWED_REASON: Final = (
    "compiled with torch.compile: the estimate could not follow the compiled program here "
    "and followed the eager one, so these figures are the eager ones"
)


def _noop_kernel(*args: Any, **kwargs: Any) -> Callable[..., None]:
    def run(*args: Any, **kwargs: Any) -> None:
        return None

    return run


def _empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Inductor's ``empty_strided_cpu``, dispatched (the C++ one allocates real memory
    without the dispatcher: no fake tensor, nothing seen)."""
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret(t: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int) -> torch.Tensor:
    """Inductor's ``reinterpret_tensor``, dispatched (the C++ one makes a plain meta
    tensor of a fake one: the view would leave the fake mode's sight)."""
    return t.as_strided(size, stride, t.storage_offset() + offset)


#: The names in an output module that allocate or view outside the dispatcher.
_DISPATCHED: Final[dict[str, Callable[..., torch.Tensor]]] = {
    "empty_strided_cpu": _empty_strided,
    "empty_strided_cpu_pinned": _empty_strided,
    "reinterpret_tensor": _reinterpret,
}


@contextmanager
def no_kernels(loaded: list[Any]) -> Iterator[None]:
    """While inductor compiles: no C++ kernel is built, the output modules allocate
    through the dispatcher, and no cache is read or written (``loaded`` gets each
    output module, to be dropped from ``PyCodeCache`` afterwards)."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    from torch._inductor import codecache

    compiler = async_compile.AsyncCompile
    saved = {name: compiler.__dict__[name] for name in ("cpp", "cpp_pybinding", "wait")}
    real_load = codecache.PyCodeCache.__dict__["load_by_key_path"]

    def load(key: str, path: str, linemap: Any = None, attrs: Any = None, **kwargs: Any) -> Any:
        # attrs (never None): PyCodeCache keeps modules loaded without attrs by path, and a
        # real compile of the same source would be handed this no-op module
        kwargs["set_sys_modules"] = False
        module = real_load.__func__(codecache.PyCodeCache, key, path, linemap, dict(attrs or {}), **kwargs)
        for name, replacement in _DISPATCHED.items():
            if hasattr(module, name):
                setattr(module, name, replacement)
        loaded.append(module)
        return module

    # the kernels compile at module load (cpp, cpp_pybinding) and are awaited by wait
    compiler.cpp = lambda self, *args, **kwargs: _noop_kernel()  # type: ignore[method-assign]
    compiler.cpp_pybinding = lambda self, *args, **kwargs: _noop_kernel()  # type: ignore[method-assign]
    compiler.wait = lambda self, scope: None  # type: ignore[method-assign]
    codecache.PyCodeCache.load_by_key_path = staticmethod(load)  # type: ignore[method-assign,assignment]
    try:
        with inductor_config.patch(force_disable_caches=True, compile_threads=1), host_vector_isa():
            yield
    finally:
        for name, value in saved.items():
            setattr(compiler, name, value)
        codecache.PyCodeCache.load_by_key_path = real_load  # type: ignore[method-assign]


def _inductor_wrapper(context: Any) -> Any:
    """The user's ``_TorchCompileInductorWrapper`` behind a dynamo context, or None
    (another backend: "eager", "aot_eager", a custom one)."""
    backend = getattr(context.callback, "_torchdynamo_orig_backend", None)
    seen = 0
    while backend is not None and seen < 8:
        if isinstance(backend, torch._TorchCompileInductorWrapper):
            return backend
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
        seen += 1
    return None


@dataclass
class _Compiled:
    """One compiled module, and how to put its compiled callable back."""

    module: nn.Module
    #: the module's own attributes that we replace, and their values (absent: None)
    saved: dict[str, Any]
    context: Any


@dataclass
class CompiledModules:
    """The compiled modules of a model that the trace follows (inductor's); the others
    run eagerly, flagged by the watch of :mod:`compiled`."""

    followed: list[_Compiled] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.followed)


def compiled_modules(model: nn.Module) -> CompiledModules:
    """The model's compiled modules: those compiled with inductor are followed."""
    from torch._dynamo.eval_frame import OptimizedModule

    found = CompiledModules()
    for module in model.modules():
        if isinstance(module, OptimizedModule):
            context, attributes = module.dynamo_ctx, ("dynamo_ctx", "forward", "_forward")
        elif getattr(module, "_compiled_call_impl", None) is not None:
            context = _closure_context(module._compiled_call_impl)
            attributes = ("_compiled_call_impl",)
        else:
            continue
        wrapper = _inductor_wrapper(context) if context is not None else None
        if wrapper is None or wrapper.config.get("cpp_wrapper"):
            continue  # run eagerly and flagged by the watch, as before
        saved = {name: module.__dict__.get(name) for name in attributes}
        found.followed.append(_Compiled(module, saved, context))
    return found


def _closure_context(compiled: Any) -> Any:
    """The dynamo context of a function compiled with ``torch.compile`` (``self`` of
    dynamo's ``compile_wrapper``)."""
    code = getattr(compiled, "__code__", None)
    if code is None or "self" not in code.co_freevars or compiled.__closure__ is None:
        return None
    return compiled.__closure__[code.co_freevars.index("self")].cell_contents


class Builder(Protocol):
    """How a device other than cpu builds and enters a compiled module's program (the
    fake cuda device's: :class:`~pytest_torchmem.engine.tracing.compiled_cuda.CudaProgram`)."""

    def compile(self, wrapper: Any, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The program of one graph, in place of ``wrapper(gm, example_inputs)``."""

    def around(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """The compiled module's callable, as the traced step calls it."""


class _FakeInductor:
    """A dynamo backend: the user's inductor compile, with no kernels and fake-run
    allocations. ``compiled`` counts the graphs it built, ``calls`` their runs."""

    def __init__(self, wrapper: Any, builder: Builder | None = None) -> None:
        self.wrapper = wrapper
        self.builder = builder
        self.compiled = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # no_kernels is on for all of following_compiled: AOTAutograd compiles the
        # backward graph lazily, at the first backward, outside this call
        if self.builder is not None:
            program = self.builder.compile(self.wrapper, gm, example_inputs)
        else:
            program = self.wrapper(gm, example_inputs)
        self.compiled += 1
        return self._counted(program)

    def _counted(self, program: Callable[..., Any]) -> Callable[..., Any]:
        ref = weakref.ref(self)

        def run(*args: Any) -> Any:
            backend = ref()
            if backend is not None:
                backend.calls += 1
            return program(*args)

        # dynamo calls compiled programs with a list and reads this flag
        run._boxed_call = getattr(program, "_boxed_call", False)  # type: ignore[attr-defined]
        return run


@dataclass
class Following:
    """What :func:`following_compiled` set up: our dynamo callbacks and backends, and
    for each backend the compiled module's name and ``file:line``."""

    callbacks: list[Any] = field(default_factory=list)
    backends: list[_FakeInductor] = field(default_factory=list)
    regions: list[int] = field(default_factory=list)
    places: list[tuple[str, str]] = field(default_factory=list)
    put_backs: list[Callable[[], None]] = field(default_factory=list)

    def is_ours(self, callback: Any) -> bool:
        return any(callback is ours for ours in self.callbacks)

    def abandon(self) -> None:
        """Stop following: the compiled modules get the user's callables back (the watch
        then runs them eagerly, flagged)."""
        for put_back in self.put_backs:
            put_back()
        self.callbacks.clear()

    def calls_by_backend(self) -> list[int]:
        return [backend.calls for backend in self.backends]


def not_followed(following: Following, warm_calls: list[int]) -> list[Unsupported]:
    """The followed modules whose compiled programs did not all run in the traced step
    as they ran in the warm-up (a guard failed, dynamo skipped a frame): eager figures."""
    flagged = []
    if not following.callbacks:  # abandoned: the watch flagged what ran
        return flagged
    for backend, before, (name, where) in zip(following.backends, warm_calls, following.places):
        if backend.calls - before != before:
            flagged.append(Unsupported(f"torch.compile: {name}", NOT_FOLLOWED_REASON, where))
    return flagged


def _place(module: nn.Module) -> tuple[str, str]:
    """The compiled module's ``Class.forward`` and where it is defined."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{type(module).__qualname__}.forward", where


@contextmanager
def following_compiled(found: CompiledModules, builder: Builder | None = None) -> Iterator[Following]:
    """Give each followed compiled module a compiled callable of its own options and
    the fake inductor backend (whose programs ``builder`` builds and enters, if given);
    on exit put the user's back and drop our cache entries."""
    from torch._dynamo import external_utils, trace_rules
    from torch._dynamo import config as dynamo_config

    following = Following()
    loaded: list[Any] = []
    with ExitStack() as restore:
        restore.callback(_drop_loaded, loaded)
        restore.callback(_invalidate, following.regions)
        restore.enter_context(no_kernels(loaded))
        for compiled in found.followed:
            restore.callback(_put_back, compiled)
            following.put_backs.append(lambda compiled=compiled: _put_back(compiled))  # type: ignore[misc]
            context = compiled.context
            backend = _FakeInductor(_inductor_wrapper(context), builder)
            optimized = torch._dynamo.optimize(
                backend,
                nopython=bool(context.fullgraph),
                dynamic=context._dynamic,
                isolate_recompiles=True,  # our own cache region: the user's limit is untouched
            )
            following.callbacks.append(optimized.callback)
            following.backends.append(backend)
            following.regions.append(optimized._isolate_recompiles_id)

            def ours(call: Callable[..., Any], optimized: Any = optimized) -> Callable[..., Any]:
                compiled = optimized(call)
                return builder.around(compiled) if builder is not None else compiled

            module = compiled.module
            following.places.append(_place(getattr(module, "_orig_mod", module)))
            if "_compiled_call_impl" in compiled.saved:
                module._compiled_call_impl = ours(module._call_impl)
                continue
            # as OptimizedModule._initialize, with our context
            inner = module._orig_mod
            forward = inner.forward
            if dynamo_config.wrap_top_frame or (
                isinstance(forward, type(inner.__init__)) and trace_rules.check(forward)
            ):
                module.__dict__["forward"] = ours(external_utils.wrap_inline(inner))
            else:
                module.__dict__["forward"] = ours(inner.__call__)
            if hasattr(inner, "_initialize_hook"):
                module.__dict__["_forward"] = module.__dict__["forward"]
                module.__dict__["forward"] = module._call_lazy_check
        yield following


def _put_back(compiled: _Compiled) -> None:
    for name, value in compiled.saved.items():
        if value is None:
            compiled.module.__dict__.pop(name, None)
        else:
            compiled.module.__dict__[name] = value


def _invalidate(regions: list[int]) -> None:
    """Invalidate the cache entries of our regions on every code object dynamo saw."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _get_cache_entries_for_region
    from torch._dynamo.guards import DeletedGuardManagerWrapper

    reason = "pytest-torchmem: an estimate's fake program, not for real runs"
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


def _drop_loaded(loaded: list[Any]) -> None:
    """Forget our output modules in ``PyCodeCache`` (it keeps every module it loaded)."""
    from torch._inductor import codecache

    ours = {id(module) for module in loaded}
    codecache.PyCodeCache.modules[:] = [m for m in codecache.PyCodeCache.modules if id(m) not in ours]
    loaded.clear()
