"""Inductor's questions about the hardware, answered without it.

* :func:`as_the_gpu`: while inductor lowers, schedules and writes a graph
  for ``cuda`` on a machine without a GPU (a CPU-only torch, no triton), its
  device queries (``torch.cuda.get_device_properties``, dynamo's device
  interface, ``DeviceProperties``) answer as the GPU of a profile, no triton
  kernel is compiled, and each output module is loaded to run on the trace's
  fake tensors: its allocations through the dispatcher, its device guards and
  streams doing nothing.
* :func:`unguarded`: meanwhile, the Tensor methods whose Python binding sets
  the CUDA device before its op run the op without it (a CPU-only torch has
  no CUDA device guard).
* :func:`host_vector_isa`: the vector ISAs inductor's C++ backend may use on
  this host, read from the CPU's flags instead of compiling and loading a
  probe program per ISA (seconds each, a large part of a small program's build).

Every replacement goes through :mod:`pytest_torchmem.engine.torch_compat.torch_private` (each an
entry of its table) and is undone when its context ends.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Final

import torch
from torch.overrides import TorchFunctionMode

from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_replacing import on_this_thread, replacing, replacing_item
from pytest_torchmem.engine.tracing.devices.cuda.gpu_view import gpu_properties
from pytest_torchmem.engine.user.generated_code import remember
from pytest_torchmem.engine.tracing.warm_up_runs import first_run_in_full

__all__ = ["Enter", "as_the_gpu", "host_vector_isa", "unguarded"]

# torch's private names (engine/torch_compat/torch_private.py)
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")

_GPU: Final = torch.device("cuda", 0)


# -- the GPU that inductor's cuda backend asks about ---------------------------------


def _interface(profile: GpuProfile) -> type:
    """Dynamo's ``CudaInterface`` for the profile's GPU (device 0, available, triton
    capable): the device queries of inductor's lowering and scheduling."""
    CudaInterface = private("torch._dynamo.device_interface.CudaInterface")
    props = gpu_properties(profile)
    capability = props.major * 10 + props.minor

    class Worker:
        set_device = staticmethod(lambda device: None)
        current_device = staticmethod(lambda: 0)
        get_device_properties = staticmethod(lambda device=None: props)

    class ProfileInterface(CudaInterface):  # type: ignore[misc]
        pass

    ProfileInterface.Worker = Worker  # type: ignore[assignment]
    for name, value in {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "get_device_properties": lambda device=None: props,
        "is_available": lambda: True,
        "get_compute_capability": lambda device=None: capability,
        "is_triton_capable": lambda device=None: True,
        "raise_if_triton_unavailable": lambda device=None: None,
        "is_bf16_supported": lambda including_emulation=False: props.major >= 8,
        "set_device": lambda device: None,
    }.items():
        setattr(ProfileInterface, name, staticmethod(value))
    return ProfileInterface


class _NoKernel:
    """A triton kernel that is never compiled: its launches do nothing."""

    def run(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


@contextmanager
def as_the_gpu(
    profile: GpuProfile, trace_device: torch.device, enter: Enter | None = None
) -> Iterator[None]:
    """While inductor lowers, schedules and writes a graph for cuda: the device queries
    answer as the profile's GPU (``torch.cuda``'s on this thread only), no triton kernel
    is compiled, and each output module is loaded to run on the trace's fake tensors
    (see :func:`_load`; ``enter`` wraps its ``call``)."""
    props = gpu_properties(profile)
    interface = _interface(profile)
    real_create: Any  # DeviceProperties.create, bound below

    def create(cls: type, device: torch.device) -> Any:
        if device.type != "cuda":
            return real_create.__func__(cls, device)
        return cls(
            type="cuda",
            index=0,
            multi_processor_count=props.multi_processor_count,
            cc=props.major * 10 + props.minor,
            major=props.major,
            regs_per_multiprocessor=props.regs_per_multiprocessor,
            max_threads_per_multi_processor=props.max_threads_per_multi_processor,
            max_threads_per_block=props.max_threads_per_block,
            warp_size=props.warp_size,
        )

    private("torch._dynamo.device_interface.get_interface_for_device")("cpu")  # registers the built-in ones first

    def load(key: str, path: str, linemap: Any = None, attrs: Any = None, **kwargs: Any) -> Any:
        remember(path, linemap)
        return _load(key, path, attrs, trace_device, enter)

    with ExitStack() as replaced:
        real_create = replaced.enter_context(
            replacing("torch._inductor.runtime.hints.DeviceProperties.create", classmethod(create))
        )
        replaced.enter_context(on_this_thread("torch.cuda.get_device_properties", lambda device=None: props))
        replaced.enter_context(
            on_this_thread("torch.cuda.get_device_capability", lambda device=None: (props.major, props.minor))
        )
        for path, value in (
            # the scheduler refuses a cuda graph without triton; no triton kernel is compiled here
            ("torch._inductor.scheduler.has_triton", lambda: True),
            ("torch.utils._triton.triton_hash_with_backend", lambda: "0" * 64),
            ("torch._inductor.async_compile.AsyncCompile.triton", lambda self, *args, **kwargs: _NoKernel()),
            ("torch._inductor.codecache.PyCodeCache.load_by_key_path", staticmethod(load)),
        ):
            replaced.enter_context(replacing(path, value))
        for name in ("cuda", "cuda:0"):
            replaced.enter_context(replacing_item("torch._dynamo.device_interface.device_interfaces", name, interface))
        yield


# -- the Python bindings that set the device ------------------------------------------

aten = torch.ops.aten


def _invert(self: torch.Tensor) -> torch.Tensor:
    # (the binding's TypeError for a float tensor comes from the binding itself)
    if self.dtype.is_floating_point or self.dtype.is_complex:
        return torch.Tensor.__invert__(self)
    return aten.bitwise_not.default(self)


def _contiguous(self: torch.Tensor, *, memory_format: torch.memory_format = torch.contiguous_format) -> Any:
    return aten.contiguous.default(self, memory_format=memory_format)


def _copy_(self: torch.Tensor, other: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return aten.copy_.default(self, other, non_blocking)


def _nonzero(self: torch.Tensor, *, as_tuple: bool = False) -> Any:
    return tuple(aten.nonzero_numpy.default(self)) if as_tuple else aten.nonzero.default(self)


#: Tensor methods whose binding (python_variable_methods.cpp) sets the device of
#: ``self`` (``OptionalDeviceGuard device_guard(device_of(self))``) before its one op
#: (``dispatch_invert``, ``dispatch_contiguous``, ``dispatch_copy_``,
#: ``dispatch_nonzero``/``dispatch_nonzero_numpy``), and that op without the guard.
_GUARDED: Final[dict[Any, Callable[..., Any]]] = {
    torch.Tensor.__invert__: _invert,
    torch.Tensor.contiguous: _contiguous,
    torch.Tensor.copy_: _copy_,
    torch.Tensor.nonzero: _nonzero,
}


def _lookup_seed(seeds: torch.Tensor, index: int) -> torch.Tensor:
    """Inductor's ``inductor_lookup_seed``: its meta kernel indexes (``seeds[index]``)."""
    return aten.clone.default(aten.select.int(seeds, 0, index))


@functools.cache
def _unguarded_calls() -> dict[Any, Callable[..., Any]]:
    """The calls of :data:`_GUARDED`, and inductor's ops whose meta kernel indexes a
    tensor (a Tensor method whose binding sets the device): each without the guard."""
    private("torch._inductor.inductor_prims")  # registers the prims

    return {**_GUARDED, torch.ops.prims.inductor_lookup_seed.default: _lookup_seed}


class _Unguarded(TorchFunctionMode):
    """The calls of :func:`_unguarded_calls`, on a fake ``cuda`` tensor, run their op
    without the binding's device guard (see :func:`unguarded`); every other call as it is."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        unguarded = _unguarded_calls().get(func)
        if unguarded is not None and args and _fake_cuda(args[0]):
            return unguarded(*args, **kwargs)
        return func(*args, **kwargs)


def _fake_cuda(t: Any) -> bool:
    return isinstance(t, FakeTensor) and t.fake_device.type == "cuda"


class _UnguardedDecompositions(dict):  # type: ignore[type-arg]
    """``torch._decomp.decomposition_table`` as FakeTensorMode reads it while a cuda
    graph is built: each decomposition runs with :class:`_Unguarded` active (its name
    and module kept: FakeTensorMode checks them, ``torch_decomp_decompositions``)."""

    def __getitem__(self, op: Any) -> Callable[..., Any]:
        return _unguarded_decomposition(super().__getitem__(op))

    def get(self, op: Any, default: Any = None) -> Any:
        return self[op] if op in self else default


def _unguarded_decomposition(decomposition: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(decomposition)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _Unguarded():
            return decomposition(*args, **kwargs)

    return run


@contextmanager
def unguarded() -> Iterator[None]:
    """While inductor builds a graph on fake ``cuda`` tensors: the Tensor methods whose
    Python binding sets the CUDA device before its op (:data:`_GUARDED`) run the op
    without it, in inductor's passes and in the decompositions FakeTensorMode runs.

    A CPU-only torch has no CUDA guard implementation: ``OptionalDeviceGuard`` on a
    cuda device raises "PyTorch is not linked with support for cuda devices"
    (``c10::impl::getDeviceGuardImpl``) before the op reaches the fake mode. Three
    places of a cuda build call such methods on fake cuda tensors:

    * inductor's own passes: ``reinplace_inplaceable_ops`` checks a scatter it
      rewrites with ``tmp.copy_(src)`` (reinplace.py);
    * inductor's fake-value propagation of its random ops (a dropout's):
      ``inductor_lookup_seed``'s meta kernel indexes the seeds (``seeds[index]``),
      run here as ``select`` (:func:`_unguarded_calls`);
    * FakeTensorMode, for an op with no meta kernel of its own, runs its Python
      decomposition on the fake tensors themselves, whose device is ``cuda`` there
      (``_dispatch_impl``), and some call such a method: ``_unsafe_masked_index`` and
      ``_unsafe_masked_index_put_accumulate`` (``masked_fill(~mask, ...)``), which
      ``embedding_dense_backward`` and ``slice_scatter`` decompose to. The fake mode
      dispatches with the torch-function mode of the call that reached it popped,
      so each decomposition is run with the mode entered again: FakeTensorMode reads
      ``torch._decomp.decomposition_table`` at each dispatch, and reads this one's
      wrapped entries while the context lasts (the table itself is not changed).

    On a GPU the guard selects the tensor's device, which is the current one: the op
    is the same. Not covered (these still raise, and the region is listed as not
    followed): indexing (``THPVariable_getitem``/``setitem`` guard too),
    ``new``/``new_tensor``, and the conversions to Python numbers (``item``, ``int``)."""
    real = private("torch._decomp.decomposition_table")
    with replacing("torch._decomp.decomposition_table", _UnguardedDecompositions(real)), _Unguarded():
        yield


# -- the output module, run on the trace's tensors ------------------------------------

#: Import lines of a cuda output module that a CPU-only torch cannot run, and what
#: stands for them (the names bound after loading, in :func:`_load`).
_IMPORTS: Final = {
    "import triton": "triton = None",
    "import triton.language as tl": "tl = None",
    "from torch._C import _cuda_getCurrentRawStream as get_raw_stream": "get_raw_stream = None",
}


class _DeviceGuard:
    """``torch.cuda._DeviceGuard``: one device, nothing to switch."""

    def __init__(self, index: int) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _Cuda:
    """What an output module calls of ``torch.cuda`` while it runs."""

    _DeviceGuard = _DeviceGuard

    @staticmethod
    def set_device(index: int) -> None:
        return None


class _Torch:
    """``torch`` as an output module sees it: ``torch.cuda`` is :class:`_Cuda`."""

    cuda = _Cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _copy_if_misaligned(t: torch.Tensor) -> torch.Tensor:
    """``copy_if_misaligned`` (dynamo's guards): an input whose data is not 16-byte
    aligned is cloned with its strides into a fresh block (blocks are aligned, so the
    offset tells)."""
    if (t.storage_offset() * t.element_size()) % 16 == 0:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _reinterpret(t: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int) -> torch.Tensor:
    return t.as_strided(size, stride, t.storage_offset() + offset)


#: Wraps an output module's ``call(args)``.
Enter = Callable[[Callable[[list[Any]], Any]], Callable[[list[Any]], Any]]


def _load(
    key: str, path: str, attrs: Any, trace_device: torch.device, enter: Enter | None
) -> types.ModuleType:
    """Load an output module written for cuda so that it runs on the trace's fake
    tensors: its cuda allocations are made on ``trace_device`` through the dispatcher,
    its host ones on fake cpu tensors, and its device guards and streams do nothing;
    ``enter`` wraps its ``call``."""
    with open(path) as source:
        lines = [_IMPORTS.get(line, line) for line in source.read().splitlines()]
    module = types.ModuleType(f"pytest_torchmem_compiled_{key}")
    module.__file__ = path
    module.key = key  # type: ignore[attr-defined]
    exec(compile("\n".join(lines), path, "exec", dont_inherit=True), module.__dict__)

    def empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=trace_device)

    def empty_strided_cpu(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    def device(type: str, index: int | None = None) -> torch.device:  # noqa: A002 - torch.device's name
        return trace_device if type == "cuda" else torch.device(type, index) if index is not None else torch.device(type)

    for name, value in {
        "torch": _Torch(),
        "device": device,
        "empty_strided_cuda": empty_strided,
        "empty_strided_cpu": empty_strided_cpu,
        "empty_strided_cpu_pinned": empty_strided_cpu,
        "reinterpret_tensor": _reinterpret,
        "copy_if_misaligned": _copy_if_misaligned,
        "get_raw_stream": lambda index: 0,
    }.items():
        setattr(module, name, value)
    for name, value in (attrs or {}).items():
        setattr(module, name, value)
    if enter is not None:
        module.call = enter(module.call)  # type: ignore[attr-defined]
    if hasattr(module, "call"):
        module.call = first_run_in_full(module.call)
    return module


@contextmanager
def host_vector_isa() -> Iterator[None]:
    """Inductor's vector ISAs of this host from the CPU's flags (``x86_isa_checker``),
    each trusted to build (``cpp.vec_isa_ok``), as if probed: ``valid_vec_isa_list``
    compiles and loads a small program per ISA the CPU has, once per process. A list
    the process already probed is kept; this one is not cached, so a real compile
    after the estimate probes as it would have."""
    import platform

    real: Any  # cpu_vec_isa.valid_vec_isa_list, bound below

    def valid_vec_isa_list() -> list[Any]:
        if real.cache_info().currsize or platform.machine() not in ("x86_64", "AMD64"):
            return real()
        flags = private("torch._inductor.cpu_vec_isa.x86_isa_checker")()
        return [
            isa
            for isa in private("torch._inductor.cpu_vec_isa.supported_vec_isa_list")
            if all(flag in flags for flag in str(isa).split())
        ]

    with (
        replacing("torch._inductor.cpu_vec_isa.valid_vec_isa_list", valid_vec_isa_list) as real,
        replacing("torch._inductor.config.cpp.vec_isa_ok", True),
    ):
        yield
