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

On the fake ``cuda`` device a :class:`Builder` (:mod:`compiled_cuda`) builds the
program with inductor's cuda backend instead. Regions with a backend other than
inductor are not followed: they run eagerly and are listed in ``unsupported``
(see :mod:`compiled`).

Nothing of this may reach the user's own compiled calls:

- the compiled modules get their compiled callables back on exit;
- our compiles run in their own dynamo cache region (``isolate_recompiles``),
  so they never count against the user's ``recompile_limit``, and their cache
  entries are invalidated on exit (dynamo keeps an invalidated entry, which
  no guard passes, and drops its code and compiled function);
- inductor's caches are off while we compile (``force_disable_caches``), so
  no no-op-kernel artifact is written to or read from the FX graph, AOTAutograd
  or autotuning caches, and each output module is loaded with ``attrs`` and
  without ``sys.modules``, which keeps it out of ``PyCodeCache``'s by-path cache;
  its file is written in a directory of ours, deleted on exit (see
  :mod:`generated_code`).
"""

from __future__ import annotations

import gc
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch
from torch import nn

from pytest_torchmem.engine.figures.report import Unsupported
from pytest_torchmem.engine.figures.timeline import Phase
from pytest_torchmem.engine.torch_compat.torch_private import present, private
from pytest_torchmem.engine.torch_compat.torch_replacing import on_this_thread, replacing, replacing_item
from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile
from pytest_torchmem.engine.user.generated_code import output_directory, remember
from pytest_torchmem.engine.tracing.inductor_device import host_vector_isa
from pytest_torchmem.engine.tracing.warm_up_runs import first_run_in_full

__all__ = [
    "AUTOTUNED",
    "NOT_FOLLOWED_REASON",
    "Builder",
    "CompiledCodeMet",
    "CompiledModules",
    "Following",
    "compiled_modules",
    "followable",
    "following_compiled",
    "no_kernels",
]

#: What the report says where inductor autotuned while the estimate compiled.
AUTOTUNED: Final = Unsupported(
    "torch.compile: autotuning",
    "inductor autotuned kernels (mode='max-autotune'): the estimate ran the candidates as "
    "no-op kernels, so its choices (ATen's kernels or inductor's C++ templates, and what they "
    "fuse) may differ from a real compile's, which times them on this CPU",
)

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
def no_kernels(loaded: list[Any], cpu: CpuProfile | None = None) -> Iterator[None]:
    """While inductor compiles: no C++ kernel is built, the output modules allocate
    through the dispatcher, and no cache is read or written (``loaded`` gets each
    output module, to be dropped from ``PyCodeCache`` afterwards); inductor builds
    for ``cpu`` (its vector width and threads), not for this host."""
    real_load: Callable[..., Any]  # PyCodeCache.load_by_key_path, bound below

    def load(key: str, path: str, linemap: Any = None, attrs: Any = None, **kwargs: Any) -> Any:
        # attrs (never None): PyCodeCache keeps modules loaded without attrs by path, and a
        # real compile of the same source would be handed this no-op module
        kwargs["set_sys_modules"] = False
        module = real_load(key, path, linemap, dict(attrs or {}), **kwargs)
        remember(path, linemap)
        for name, replacement in _DISPATCHED.items():
            if hasattr(module, name):
                setattr(module, name, replacement)
        if hasattr(module, "call"):
            module.call = first_run_in_full(module.call)
        loaded.append(module)
        return module

    async_compile = "torch._inductor.async_compile.AsyncCompile"
    options = {"force_disable_caches": True, "compile_threads": 1, **for_profile(cpu)}
    with ExitStack() as replaced:
        # the kernels compile at module load (cpp, cpp_pybinding) and are awaited by wait
        replaced.enter_context(replacing(f"{async_compile}.cpp", lambda self, *args, **kwargs: _noop_kernel()))
        replaced.enter_context(
            replacing(f"{async_compile}.cpp_pybinding", lambda self, *args, **kwargs: _noop_kernel())
        )
        replaced.enter_context(replacing(f"{async_compile}.wait", lambda self, scope: None))
        # (on this thread only: each stage of a pipeline, traced on a thread of its own,
        # loads its own output modules)
        real_load = replaced.enter_context(
            on_this_thread("torch._inductor.codecache.PyCodeCache.load_by_key_path", load)
        )
        for option, value in options.items():
            replaced.enter_context(replacing(f"torch._inductor.config.{option}", value))
        replaced.enter_context(output_directory())
        replaced.enter_context(host_vector_isa())
        replaced.enter_context(_vector_isa_of(cpu))
        replaced.enter_context(warnings.catch_warnings())
        # dynamo warns that the caches we turned off turn its profile-guided shapes off
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        yield


def for_profile(cpu: CpuProfile | None) -> dict[str, int]:
    """The inductor options that make it build for ``cpu`` rather than this host.

    Inductor's C++ backend reads the host twice: the vector ISA (``pick_vec_isa``,
    capped by ``ATEN_CPU_CAPABILITY``; ``cpp.simdlen`` names its width instead, among
    the ISAs :func:`_vector_isa_of` gives) and the intra-op threads
    (``parallel_num_threads``; ``cpp.threads`` instead),
    which sizes its kernels' loops and picks between its own kernel and ATen's for
    a summing ``scatter_reduce_`` (``needs_fallback_due_to_atomic_add_limitations``,
    one thread: its own). Its buffers (which exist, their sizes, their reuse) do
    not depend on either in the programs tested (measured at each ISA level at 1,
    2 and 4 threads); the kernels it leaves to ATen (matmuls, convolutions,
    attention) allocate as the CPU rules say for the profile.
    """
    if cpu is None:
        return {}
    width = 512 if cpu.avx512 else 256 if cpu.avx2 else 0  # 0: no vector ISA matches
    return {"cpp.simdlen": width, "cpp.threads": cpu.threads}


#: Inductor's vector ISA (``cpu_vec_isa``'s class) of each level: what it picks on such a CPU.
_VECTOR_ISA: Final = {"avx2": "VecAVX2", "avx512": "VecAVX512", "avx512_bf16": "VecAVX512", "amx": "VecAMX"}


@contextmanager
def _vector_isa_of(cpu: CpuProfile | None) -> Iterator[None]:
    """Inductor sees the profile's vector ISA as the only one this CPU has (none on the
    ``default`` level), whatever the host's: no kernel is built, so none is probed."""
    if cpu is None:
        yield
        return
    name = _VECTOR_ISA.get(cpu.isa)
    isas = [private(f"torch._inductor.cpu_vec_isa.{name}")()] if name is not None else []
    with replacing("torch._inductor.cpu_vec_isa.valid_vec_isa_list", lambda: list(isas)):
        yield


def _inductor_wrapper(context: Any) -> Any:
    """The user's ``_TorchCompileInductorWrapper`` behind a dynamo context, or None
    (another backend: "eager", "aot_eager", a custom one)."""
    backend = getattr(context.callback, "_torchdynamo_orig_backend", None)
    seen = 0
    while backend is not None and seen < 8:
        if isinstance(backend, private("torch._TorchCompileInductorWrapper")):
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
    OptimizedModule = private("torch._dynamo.eval_frame.OptimizedModule")
    found = CompiledModules()
    for module in model.modules():
        if isinstance(module, OptimizedModule):
            context, attributes = module.dynamo_ctx, ("dynamo_ctx", "forward", "_forward")
        elif getattr(module, "_compiled_call_impl", None) is not None:
            context = _closure_context(module._compiled_call_impl)
            attributes = ("_compiled_call_impl",)
        else:
            continue
        if followable(context) is None:
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

    def entering(self) -> AbstractContextManager[None]:
        """What holds while a compiled function runs, as :meth:`around` holds it."""


class _FakeInductor:
    """A dynamo backend: the user's inductor compile, with no kernels and fake-run
    allocations (built by ``builder``, if given). ``compiled`` counts the graphs it
    built, ``calls`` their runs.

    Where ``fallback()`` (once the warm-up is over) a graph inductor cannot build runs
    as dynamo traced it (``failed`` says so); before, the error reaches the caller
    (the warm-up, which then gives up following)."""

    def __init__(
        self,
        wrapper: Any,
        builder: Builder | None = None,
        fallback: Callable[[], bool] = lambda: False,
        phase: Callable[[], Phase | None] = lambda: None,
    ) -> None:
        self.wrapper = wrapper
        self.builder = builder
        self.fallback = fallback
        self.failed = False
        self.compiled = 0
        self.calls = 0
        #: whether dynamo is compiling a frame of the region (DDPOptimizer runs the parts it
        #: built on fake inputs then: not the step's runs, not counted)
        self.compiling = False
        self.phase = phase
        #: the step's phase when each graph was built
        self.phases: list[Phase | None] = []
        #: the classes of the modules its graphs called (dynamo's ``nn_module_stack``)
        self.classes: set[type] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # no_kernels is on for all of following_compiled: AOTAutograd compiles the
        # backward graph lazily, at the first backward, outside this call
        for node in gm.graph.nodes:
            for entry in (node.meta.get("nn_module_stack") or {}).values():
                if isinstance(entry, tuple) and isinstance(entry[-1], type):
                    self.classes.add(entry[-1])
        try:
            if self.builder is not None:
                program = self.builder.compile(self.wrapper, gm, example_inputs)
            else:
                program = self.wrapper(gm, example_inputs)
        except Exception:
            if not self.fallback():
                raise
            self.failed = True
            return gm.forward
        self.compiled += 1
        self.phases.append(self.phase())
        return self._counted(program)

    def _counted(self, program: Callable[..., Any]) -> Callable[..., Any]:
        ref = weakref.ref(self)

        def run(*args: Any) -> Any:
            backend = ref()
            if backend is not None and not backend.compiling:
                backend.calls += 1
            return program(*args)

        # dynamo calls compiled programs with a list and reads this flag
        run._boxed_call = getattr(program, "_boxed_call", False)  # type: ignore[attr-defined]
        return run


@dataclass
class _Region:
    """One compiled region the trace follows: our backend and dynamo callback for it,
    its cache region, where it is defined, and what its backend had done by the end
    of the warm-up: the programs built, its runs, and its runs in the warm-up's last
    try (None: first met after it, in the traced step)."""

    backend: _FakeInductor
    callback: Any
    region: int
    place: tuple[str, str]
    warm: tuple[int, int, int] | None = None
    #: its runs before the warm-up's last try began (trace.py runs a warm-up that failed
    #: again: warm_up_started)
    runs_before: int = 0
    #: the callback the region's frames run with (:func:`_collected_after_compile`)
    entered: Any = None

    def __post_init__(self) -> None:
        if self.entered is None:
            self.entered = _collected_after_compile(self.callback, self.backend)


def _collected_after_compile(callback: Any, backend: _FakeInductor) -> Callable[..., Any]:
    """Dynamo's ``callback``, with the garbage of each compile of ``backend`` collected once
    the compile is done.

    Dynamo's compile of a frame leaves its translators and output graph in reference
    cycles that hold the frame's locals (torch 2.15: the optimizer step's ``grads``), and
    collects the young generations when the compile is done (``run_gc_after_compile``).
    A compile the trace follows allocates more than a real one, so those cycles can be
    older by then, and would hold the step's gradients past ``zero_grad`` into the next
    iteration of the loop; here they are collected in full, as a real compile leaves them.

    The callback runs with no dispatch mode, as dynamo runs its compiles: its branch for
    a frame inside DDP's forward (``DDPOptimizer``, which splits the graph at DDP's
    buckets, torch 2.10 to 2.15) leaves the modes on, and the trace's tracker, above
    AOTAutograd's functional mode, would take its ops (they fail) and charge its runs
    of the compiled parts on fake inputs.
    """
    disabled = private("torch.utils._python_dispatch._disable_current_modes")

    def run(*args: Any, **kwargs: Any) -> Any:
        compiled, compiling = backend.compiled, backend.compiling
        backend.compiling = True
        try:
            with disabled():
                result = callback(*args, **kwargs)
        finally:
            backend.compiling = compiling
        if backend.compiled != compiled:
            gc.collect()
        return result

    return run


class CompiledCodeMet(BaseException):
    """A trace that does not follow met, in the step's forward, a compiled function it could
    follow (:attr:`Following.met`): the trace is given up at its next op, since the step is
    traced again, following (a ``BaseException``: the step's own ``except Exception``
    clauses let it through)."""

    def __init__(self, phase: Phase) -> None:
        super().__init__(phase)
        self.phase = phase


@dataclass
class Following:
    """What :func:`following_compiled` set up: the compiled regions the trace follows.

    Compiled modules are followed from the start; on cpu (no ``builder``) compiled
    functions (and compiled optimizer steps) too, when the step first calls them,
    through :meth:`redirect`.
    Inactive (``active=False``), nothing is followed: :attr:`met` then says in which
    phase the step first called a compiled function that could have been.
    """

    active: bool = True
    #: builds and enters the programs on a device other than cpu (then only compiled
    #: modules are followed)
    builder: Builder | None = None
    regions: list[_Region] = field(default_factory=list)
    #: every dynamo cache region opened for a followed region (invalidated on exit)
    cache_regions: list[int] = field(default_factory=list)
    put_backs: list[Callable[[], None]] = field(default_factory=list)
    #: the compiled functions met so far, by ``id`` of their dynamo context (kept alive)
    functions: dict[int, tuple[Any, _Region]] = field(default_factory=dict)
    #: the region of each followed compiled module, by ``id``
    module_regions: dict[int, _Region] = field(default_factory=dict)
    #: the compiled functions met so far, by their code object (see :meth:`_compiled_alike`)
    compiled_code: dict[Any, list[tuple[Any, Any, _Region]]] = field(default_factory=dict)
    #: the earliest phase of the step in which a compiled function of inductor was met
    #: while not following (None: none was)
    met: Phase | None = None
    #: called when :attr:`met` is first set, in a trace that gives up then (it arms the
    #: tracker's :meth:`give_up_if_met`: :class:`CompiledCodeMet`, and the step is traced
    #: again, following); None: the trace goes on
    on_met: Callable[[], None] | None = None
    #: the phase of the step now (the trace's tracker's)
    phase: Callable[[], Phase | None] = lambda: None
    #: called before a compiled function runs followed (the trace's router steps aside)
    entering: Callable[[], None] = lambda: None
    #: whether the warm-up step is over (a region first built later falls back on failure)
    warmed: bool = False
    #: the modes that make what runs visible to the trace, for code dynamo runs with
    #: them popped (an optimizer's state, made while dynamo compiles its step; None: the
    #: trace does not follow)
    visible: Callable[[], Any] | None = None
    #: inductor's count of autotuned kernel choices when following began
    autotuned: int = 0
    #: the optimizers whose _init_group dynamo calls with :attr:`visible` (torch 2.15)
    optimizers: weakref.WeakSet[torch.optim.Optimizer] = field(default_factory=weakref.WeakSet)

    def redirect(self, callback: Any, wrapper_frame: Any) -> Any:
        """The callback a compiled region entered through ``wrapper_frame`` (dynamo's
        ``compile_wrapper``) runs with: ours, or None (eagerly, flagged)."""
        for region in self.regions:
            if callback is region.callback:
                return region.entered
        context = wrapper_frame.f_locals.get("self")
        wrapper = followable(context)
        if wrapper is None:
            return None
        if not self.active:
            phase = self.phase()
            phase = Phase.FORWARD if phase is None else phase
            self.met = phase if self.met is None else min(self.met, phase)
            if self.on_met is not None:
                self.on_met()  # (a trace that gives up does so at its next op)
            return None
        known = self.functions.get(id(context))
        if known is None:
            known = self._compiled_alike(context, wrapper, wrapper_frame)
        if known is None:
            from pytest_torchmem.engine.tracing.compiled import region_of

            if self.warmed and self.phase() != Phase.STEP:
                # first met in the traced step before the optimizer step: AOTAutograd would
                # compile its backward lazily, under the tracker; it runs eagerly, flagged
                return None

            _, region = self._follow(context, wrapper, region_of(wrapper_frame))
            self.functions[id(context)] = (context, region)
            self._alike(wrapper_frame).append((context, wrapper, region))
        else:
            region = known[1]
        set_eval_frame_isolate_recompiles_id = private(
            "torch._C._dynamo.eval_frame.set_eval_frame_isolate_recompiles_id"
        )
        self.entering()
        # compile_wrapper set the user's region and puts back the one before it on exit
        set_eval_frame_isolate_recompiles_id(region.region)
        if self.builder is not None:
            # entered as the builder enters a compiled module (with no torch-function mode)
            from pytest_torchmem.engine.tracing.compiled import Held

            return Held(region.entered, self.builder.entering)
        return region.entered

    def _alike(self, wrapper_frame: Any) -> list[tuple[Any, Any, _Region]]:
        """The followed compiles of the function ``wrapper_frame`` (dynamo's
        ``compile_wrapper``) calls: ``(context, inductor wrapper, region)``."""
        code = getattr(wrapper_frame.f_locals.get("fn"), "__code__", None)
        return self.compiled_code.setdefault(code, []) if code is not None else []

    def _compiled_alike(
        self, context: Any, wrapper: Any, wrapper_frame: Any
    ) -> tuple[Any, _Region] | None:
        """The region of an earlier ``torch.compile`` of the same function with the same
        options, which a new one shares: dynamo keeps compiled code on the function's code
        object, so ``torch.compile(fn)(...)`` called anew each step (torchao's optimizers,
        per parameter) compiles once and runs that program after (guards passing), and
        so do our compiles in the region."""
        for other, other_wrapper, region in self._alike(wrapper_frame):
            if (
                other.fullgraph == context.fullgraph
                and other._dynamic == context._dynamic
                and other_wrapper == wrapper
            ):
                self.functions[id(context)] = (context, region)
                return context, region
        return None

    def _follow(self, context: Any, wrapper: Any, place: tuple[str, str]) -> tuple[Any, _Region]:
        backend = _FakeInductor(wrapper, self.builder, fallback=lambda: self.warmed, phase=lambda: self.phase())
        ours = private("torch._dynamo.optimize")(
            backend,
            nopython=bool(context.fullgraph),
            dynamic=context._dynamic,
            isolate_recompiles=True,  # our own cache region: the user's limit is untouched
        )
        region = _Region(backend, ours.callback, ours._isolate_recompiles_id, place)
        self.regions.append(region)
        self.cache_regions.append(region.region)
        return ours, region

    def program_runs(self) -> int:
        """How many times the followed regions' programs have run."""
        return sum(region.backend.calls for region in self.regions)

    def compiled_classes(self) -> frozenset[type]:
        """The classes of the modules the followed regions' graphs called (a block of one
        of them runs inside compiled code)."""
        return frozenset(kind for region in self.regions for kind in region.backend.classes)

    def give_up_if_met(self, phase: Phase | None) -> None:
        """Raise :class:`CompiledCodeMet` where this trace gives up on meeting a compiled
        function it could follow, met in the forward, and the step is still there (the
        tracker asks at each op: raised there, it unwinds the user's code as an error of
        the op would, and the compiled region's own state is put back by dynamo)."""
        if self.met is Phase.FORWARD and phase in (None, Phase.FORWARD):
            raise CompiledCodeMet(self.met)

    def warm_up_started(self) -> None:
        """Note where each region's backend stands as a try of the warm-up step begins
        (a warm-up that failed runs again: its runs there are the last try's)."""
        for region in self.regions:
            region.runs_before = region.backend.calls

    def warm_up_done(self) -> None:
        """Note what each region's backend did in the warm-up step."""
        for region in self.regions:
            backend = region.backend
            region.warm = (backend.compiled, backend.calls, backend.calls - region.runs_before)
        self.warmed = True

    def abandon(self) -> None:
        """Stop following: the compiled modules get the user's callables back (the watch
        then runs them eagerly, flagged)."""
        for put_back in self.put_backs:
            put_back()
        self.regions.clear()
        self.module_regions.clear()
        self.functions.clear()
        self.compiled_code.clear()
        self.active = False

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Let the trace see the state a compiled step of ``optimizer`` makes: dynamo
        calls the optimizer's ``_init_group`` itself while it compiles the step, with
        every dispatch mode popped."""
        init_group = getattr(optimizer, "_init_group", None)
        if init_group is None or self.visible is None:
            return
        if present(_INIT_GROUP_HANDLER):
            # torch 2.15: dynamo finds its handler of _init_group on the optimizer's class,
            # and would trace a function of the instance instead (see _init_group_seen)
            self.optimizers.add(optimizer)
            return
        visible = self.visible

        def seen_init_group(*args: Any, **kwargs: Any) -> Any:
            with visible():
                return init_group(*args, **kwargs)

        optimizer._init_group = seen_init_group  # type: ignore[method-assign]

    def not_followed(self) -> list[Unsupported]:
        """The followed regions whose compiled programs did not run in the traced step
        as they ran in the warm-up (a guard failed and dynamo built another program, or
        skipped the frame), and those first built in the traced step that inductor could
        not build: eager figures."""
        # on cuda the builder says what it autotunes (CudaProgram's gaps)
        autotuned = self.cache_regions and self.builder is None and _autotuned() > self.autotuned
        flagged = [AUTOTUNED] if autotuned else []
        for region in self.regions:
            backend = region.backend
            if region.warm is None:
                wrong = backend.failed or backend.calls == 0
            else:
                compiled, calls, warm_runs = region.warm
                late = backend.phases[compiled:]
                if late and all(phase is Phase.STEP for phase in late):
                    # built anew in the optimizer step (a step function's optimizer holds
                    # the traced step's tensors, on which the warm-up's guards fail):
                    # compiled there with every mode popped, as the built-in step's
                    # optimizer step is, and followed
                    wrong = backend.failed or backend.calls == calls
                else:
                    wrong = backend.compiled != compiled or backend.calls - calls != warm_runs
            if wrong:
                name, where = region.place
                flagged.append(Unsupported(f"torch.compile: {name}", NOT_FOLLOWED_REASON, where))
        return flagged


#: Dynamo's handler of an optimizer's ``_init_group`` (torch 2.15), and the table of its
#: handlers by name where dynamo finds it.
_INIT_GROUP_HANDLER: Final = "torch._dynamo.variables.optimizer.OptimizerVariable._init_group"
_INIT_GROUP_HANDLERS: Final = "torch._dynamo.variables.optimizer.OptimizerVariable.tp_methods"


@contextmanager
def _init_group_seen(following: Following) -> Iterator[None]:
    """On torch 2.15, dynamo's handler of ``_init_group`` (which calls the optimizer's own,
    eagerly, while it compiles the step) runs with the trace's modes visible for the
    optimizers :meth:`Following.prepare_optimizer` was given."""
    if not present(_INIT_GROUP_HANDLER):
        yield
        return
    real = private(_INIT_GROUP_HANDLERS)["_init_group"]

    def handler(variable: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if following.visible is not None and variable.value in following.optimizers:
            with following.visible():
                return real.handler(variable, tx, args, kwargs)
        return real.handler(variable, tx, args, kwargs)

    with replacing_item(_INIT_GROUP_HANDLERS, "_init_group", type(real)(handler)):
        yield


def followable(context: Any) -> Any:
    """The inductor wrapper of a dynamo context the trace can follow (inductor's, without
    ``cpp_wrapper``), or None. None on a torch that lacks a private name following needs
    (:func:`~pytest_torchmem.engine.tracing.compiled.following_blocked`): dynamo's cache
    regions of our own before 2.13, without which our compiles would go to the user's own
    cache; the region runs eagerly, flagged."""
    from pytest_torchmem.engine.tracing.compiled import following_blocked

    if following_blocked() is not None:
        return None
    wrapper = _inductor_wrapper(context) if context is not None and hasattr(context, "callback") else None
    if wrapper is None or wrapper.config.get("cpp_wrapper"):
        return None
    return wrapper


def _place(module: nn.Module) -> tuple[str, str]:
    """The compiled module's ``Class.forward`` and where it is defined."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{type(module).__qualname__}.forward", where


@contextmanager
def following_compiled(
    found: CompiledModules,
    cpu: CpuProfile | None = None,
    builder: Builder | None = None,
    *,
    phase: Callable[[], Phase | None] = lambda: None,
    entering: Callable[[], None] = lambda: None,
    visible: Callable[[], Any] | None = None,
) -> Iterator[Following]:
    """Give each followed compiled module a compiled callable of its own options and
    the fake inductor backend (whose programs ``builder`` builds and enters, if given),
    and follow the compiled functions the step calls (on cpu: built for ``cpu``); on
    exit put the user's callables back and drop our cache entries. ``phase``,
    ``entering`` and ``visible``: the trace's, as :class:`Following` takes them."""
    dynamo_config = private("torch._dynamo.config")
    following = Following(
        builder=builder, autotuned=_autotuned(), phase=phase, entering=entering, visible=visible
    )
    loaded: list[Any] = []
    with ExitStack() as restore:
        restore.callback(_drop_loaded, loaded)
        restore.callback(_invalidate, following)
        restore.enter_context(no_kernels(loaded, cpu))
        restore.enter_context(_init_group_seen(following))
        # modules of one class compiled alike share one of our cache regions, as they share
        # the user's: dynamo keeps compiled code on the code object, and a block's program,
        # built for the first of them, runs for the others where its guards pass (the
        # parameters are the graph's inputs), so that identical blocks compile once
        alike: dict[tuple[type, bool, Any], list[tuple[Any, Any, _Region]]] = {}
        for compiled in found.followed:
            restore.callback(_put_back, compiled)
            following.put_backs.append(lambda compiled=compiled: _put_back(compiled))  # type: ignore[misc]
            module = compiled.module
            inner_module = getattr(module, "_orig_mod", module)
            context, wrapper = compiled.context, _inductor_wrapper(compiled.context)
            kind = alike.setdefault((type(inner_module), bool(context.fullgraph), context._dynamic), [])
            optimized, region = next(
                ((made, made_for) for other, made, made_for in kind if other == wrapper), (None, None)
            )
            if optimized is None:
                optimized, region = following._follow(context, wrapper, _place(inner_module))
                kind.append((wrapper, optimized, region))
            following.module_regions[id(module)] = region

            def ours(call: Callable[..., Any], optimized: Any = optimized) -> Callable[..., Any]:
                compiled_call = optimized(call)
                return builder.around(compiled_call) if builder is not None else compiled_call

            if "_compiled_call_impl" in compiled.saved:
                module._compiled_call_impl = ours(module._call_impl)
                continue
            # as OptimizedModule._initialize, with our context
            inner = module._orig_mod
            forward = inner.forward
            if dynamo_config.wrap_top_frame or (
                isinstance(forward, type(inner.__init__)) and private("torch._dynamo.trace_rules.check")(forward)
            ):
                module.__dict__["forward"] = ours(private("torch._dynamo.external_utils.wrap_inline")(inner))
            else:
                module.__dict__["forward"] = ours(inner.__call__)
            if hasattr(inner, "_initialize_hook"):
                module.__dict__["_forward"] = module.__dict__["forward"]
                module.__dict__["forward"] = module._call_lazy_check
        yield following


def _autotuned() -> int:
    """How many times inductor has benchmarked kernel choices in this process."""
    return private("torch._dynamo.utils.counters")["inductor"]["select_algorithm_autotune"]


def _put_back(compiled: _Compiled) -> None:
    for name, value in compiled.saved.items():
        if value is None:
            compiled.module.__dict__.pop(name, None)
        else:
            compiled.module.__dict__[name] = value


def _invalidate(following: Following) -> None:
    from pytest_torchmem.engine.tracing.compiled import invalidate_regions

    reason = "pytest-torchmem: an estimate's fake program, not for real runs"
    invalidate_regions(following.cache_regions, reason)


def _drop_loaded(loaded: list[Any]) -> None:
    """Forget our output modules in ``PyCodeCache`` (it keeps every module it loaded)."""
    ours = {id(module) for module in loaded}
    modules = private("torch._inductor.codecache.PyCodeCache").modules
    modules[:] = [m for m in modules if id(m) not in ours]
    loaded.clear()
