"""What the code the trace runs sees of the fake cuda device: a GPU.

The fake cuda device is traced on fake ``meta`` tensors (on a CPU-only torch,
autograd on a fake ``cuda`` tensor kills the interpreter). Code branches on
what it sees: ``x.is_cuda``, ``x.device.type == "cuda"``,
``torch.cuda.is_available()``, the device's capability, whether torch was
built with CUDA, cuDNN and flash attention, and torch's own optimizers and
gradient clipping on whether a device has foreach and fused kernels. While
:func:`gpu_view` is active, on the thread that entered it (the tracing
thread; every other thread of the process keeps the real answers):

* the code of the model and its libraries sees the GPU the profile names: a
  fake tensor of the device answers ``.device`` with ``cuda:0``, ``.is_cuda``
  with True, ``.is_meta`` with False and ``.get_device()`` with 0,
  ``torch.cuda``'s queries answer as that GPU would,
  ``torch.backends.cuda.is_built()``,
  ``torch.backends.cuda.is_flash_attention_available()`` and
  ``torch.backends.cudnn.is_available()`` answer as a CUDA build does, and
  ``torch.accelerator`` and ``torch.get_device_module()`` name the GPU; its
  streams and events are the trace's (:mod:`.streams`), and ``torch.cuda``'s
  (and ``torch.accelerator``'s) memory statistics the trace's figures so far
  (:mod:`.memory_stats`); torch's own code and this package's still see
  ``meta`` (they route the step), so only callers outside them are answered
  so (:mod:`~pytest_torchmem.engine.tracing.the_program`), but for the
  DataLoader, which asks for the program whether to pin its batches; the
  tensors the program then makes on "cuda" are placed by the device's router;
* torch's own decisions by device type (:func:`torch_decides_as_on_the_gpu`):
  torch's lists of the devices that have foreach, fused and capturable
  optimizer kernels count the trace's ``meta`` device as ``cuda``, and its
  lists of the tensor types the foreach kernels take count the trace's
  stand-ins as the tensors and parameters they stand for. ``fused=True``,
  the foreach defaults, ``capturable=True``, ``clip_grad_norm_(foreach=...)``
  and ``swa_utils`` decide as on the GPU, each by torch's own code of the
  running release.

Why torch's own code keeps seeing ``meta``: it runs the step on the meta
tensors, and a torch that saw ``cuda`` would take paths that call the CUDA
runtime a CPU-only build does not have (``torch.utils.checkpoint`` saving
``torch.cuda``'s RNG state, RNN modules flattening their weights with cuDNN,
the transformer layers' inference fast paths); the decisions torch makes by a
device's kernels are answered through the lists instead, where torch keeps
them.

Not redirected (the answer stays the CPU-only build's): queries made from
C++, module attributes such as ``torch.version.cuda`` (``None``: a value
cannot tell who reads it), and code that reads a tensor's device from C++
(custom extensions).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from threading import get_ident
from types import FrameType, SimpleNamespace
from typing import Any, Final

import torch
import torch.backends.cuda
import torch.backends.cudnn
import torch.cuda.amp.common

from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile
from pytest_torchmem.engine.torch_compat.torch_private import present, private
from pytest_torchmem.engine.torch_compat.torch_replacing import appending, on_this_thread, replacing, replacing_for_readers
from pytest_torchmem.engine.tracing.devices.cuda.memory_stats import MemorySoFar
from pytest_torchmem.engine.tracing.devices.cuda.streams import CudaEvent, CudaStream, GpuStreams, StreamContext
from pytest_torchmem.engine.tracing.imports import importing
from pytest_torchmem.engine.tracing.the_program import NOT_THE_PROGRAM, TORCH_DIR, from_the_program, is_the_program, looks_it_up

__all__ = [
    "KERNEL_DEVICE_LISTS",
    "KERNEL_TYPE_LISTS",
    "autocast_opens_cuda_regions",
    "gpu_properties",
    "gpu_view",
    "torch_decides_as_on_the_gpu",
]

# torch's private names (engine/torch_compat/torch_private.py)
_FAKE_TENSOR: Final = "torch._subclasses.fake_tensor.FakeTensor"
FakeTensor: Final = private(_FAKE_TENSOR)

_CUDA: Final = torch.device("cuda", 0)


def gpu_properties(profile: GpuProfile) -> SimpleNamespace:
    """What ``torch.cuda.get_device_properties`` answers on the profile's GPU: the fields
    torch's Python side and inductor read (SMs, threads per SM, capability, warp size,
    shared memory)."""
    major, minor = profile.compute_capability
    return SimpleNamespace(
        name=profile.device_name,
        major=major,
        minor=minor,
        multi_processor_count=profile.sm_count,
        total_memory=profile.memory,
        max_threads_per_multi_processor=profile.max_threads_per_sm,
        max_threads_per_block=1024,
        regs_per_multiprocessor=65536,
        warp_size=32,
        shared_memory_per_block_optin=profile.shared_memory_per_block,
        shared_memory_per_multiprocessor=profile.shared_memory_per_block + 1024,
        L2_cache_size=50 << 20,
        gcnArchName="",
        is_integrated=False,
        is_multi_gpu_board=False,
        uuid="",
    )


@contextmanager
def gpu_view(profile: Any, streams: GpuStreams | None = None, memory: MemorySoFar | None = None) -> Iterator[None]:
    """Within a fake cuda trace: the program sees the GPU ``profile`` describes, on this
    thread; with ``streams``, its CUDA streams and events; with ``memory``, the caching
    allocator's statistics so far."""
    tracing = get_ident()
    real_device_of: Callable[[Any], torch.device]  # FakeTensor.device's getter, bound below
    real_is_cuda = torch.Tensor.is_cuda
    real_is_meta = torch.Tensor.is_meta
    real_get_device = torch.Tensor.get_device
    getframe = sys._getframe

    def device(self: FakeTensor) -> torch.device:
        # Asked thousands of times a step, mostly by torch's fake-tensor cache: the
        # caller's frame is read first, here, without _from_the_program's call.
        if getframe(1).f_code.co_filename.startswith(NOT_THE_PROGRAM) or get_ident() != tracing or importing():
            return real_device_of(self)
        seen = real_device_of(self)
        return _CUDA if seen.type == "meta" else seen

    def is_cuda(self: FakeTensor) -> bool:
        if self.fake_device.type == "meta" and from_the_program(tracing):
            return True
        return real_is_cuda.__get__(self)  # type: ignore[no-any-return]

    def is_meta(self: FakeTensor) -> bool:
        if self.fake_device.type == "meta" and from_the_program(tracing):
            return False
        return real_is_meta.__get__(self)  # type: ignore[no-any-return]

    def get_device(self: FakeTensor) -> int:
        if self.fake_device.type == "meta" and from_the_program(tracing):
            return 0
        return real_get_device(self)  # type: ignore[no-any-return]

    def record_stream(self: FakeTensor, stream: Any) -> None:
        if from_the_program(tracing):
            return None  # (streams.py: the block's allocated bytes go at its free, as here)
        return real_record_stream(self, stream)  # type: ignore[no-any-return]

    properties = gpu_properties(profile)
    answers: dict[str, Callable[..., Any]] = {
        "torch.cuda.is_available": lambda: True,
        "torch.cuda.device_count": lambda: 1,
        "torch.cuda.current_device": lambda: 0,
        "torch.cuda.get_device_capability": lambda device=None: profile.compute_capability,
        "torch.cuda.get_device_properties": lambda device=None: properties,
        "torch.cuda.get_device_name": lambda device=None: properties.name,
        "torch.cuda.is_bf16_supported": lambda including_emulation=True: profile.bf16,
        # A CUDA build: built with CUDA, cuDNN and the flash-attention kernels.
        "torch.backends.cuda.is_built": lambda: True,
        "torch.backends.cuda.is_flash_attention_available": lambda: True,
        "torch.backends.cudnn.is_available": lambda: True,
        # The one GPU is the current device, and the trace's work is done where it is made
        # (a trainer sets the device and synchronizes, as on a machine with a GPU).
        "torch.cuda.set_device": lambda device: None,
        "torch.cuda.synchronize": lambda device=None: None,
        "torch.cuda.is_current_stream_capturing": lambda: False,
        # torch.accelerator: the GPU is the current accelerator
        "torch.accelerator.is_available": lambda: True,
        "torch.accelerator.current_accelerator": lambda check_available=False: torch.device("cuda"),
        "torch.accelerator.device_count": lambda: 1,
        "torch.accelerator.current_device_index": lambda: 0,
        "torch.accelerator.current_device_idx": lambda: 0,
        "torch.accelerator.set_device_index": lambda device: None,
        "torch.accelerator.set_device_idx": lambda device: None,
        "torch.accelerator.synchronize": lambda device=None: None,
        "torch.accelerator.get_device_capability": lambda device=None: {"supported_dtypes": _cuda_dtypes()},
    }
    if streams is not None:
        answers.update(
            {
                "torch.cuda.current_stream": lambda device=None: streams.current,
                "torch.cuda.default_stream": lambda device=None: streams.default,
                "torch.cuda.set_stream": streams.set_current,
                "torch.cuda.stream": StreamContext,
                "torch.accelerator.current_stream": lambda device=None: streams.current,
                "torch.accelerator.set_stream": streams.set_current,
            }
        )
    if memory is not None:
        statistics = {
            "memory_allocated": memory.memory_allocated,
            "max_memory_allocated": memory.max_memory_allocated,
            "memory_reserved": memory.memory_reserved,
            "max_memory_reserved": memory.max_memory_reserved,
            "memory_stats": memory.memory_stats,
            "reset_peak_memory_stats": memory.reset_peaks,
            "reset_accumulated_memory_stats": lambda device=None: None,
        }
        for home in ("torch.cuda", "torch.cuda.memory", "torch.accelerator", "torch.accelerator.memory"):
            answers.update({f"{home}.{name}": answer for name, answer in statistics.items()})
        for home in ("torch.cuda", "torch.cuda.memory"):
            answers.update(
                {
                    f"{home}.mem_get_info": memory.mem_get_info,
                    f"{home}.reset_max_memory_allocated": memory.reset_peaks,
                    f"{home}.reset_max_memory_cached": memory.reset_peaks,
                    f"{home}.memory_cached": memory.memory_reserved,
                    f"{home}.max_memory_cached": memory.max_memory_reserved,
                }
            )
        for home in ("torch.accelerator", "torch.accelerator.memory"):
            answers[f"{home}.get_memory_info"] = memory.mem_get_info
    def answering(answer: Callable[..., Any], real: list[Callable[..., Any]]) -> Callable[..., Any]:
        def query(*args: Any, **kwargs: Any) -> Any:
            if from_the_program(tracing) or _asks_for_the_program(getframe(1), tracing):
                return answer(*args, **kwargs)
            return real[0](*args, **kwargs)

        return query

    def get_device_module(device: Any = None) -> Any:
        # (torch.get_device_module(): the current accelerator's module, torch.cuda on a GPU)
        return torch.cuda if device is None else real_get_device_module(device)

    def reads_it(frame: FrameType) -> bool:
        return looks_it_up(frame) and is_the_program(frame, tracing)

    with ExitStack() as replaced:
        real_device_of = replaced.enter_context(replacing(f"{_FAKE_TENSOR}.device", property(device))).fget
        replaced.enter_context(replacing(f"{_FAKE_TENSOR}.is_cuda", property(is_cuda)))
        replaced.enter_context(replacing(f"{_FAKE_TENSOR}.is_meta", property(is_meta)))
        replaced.enter_context(replacing(f"{_FAKE_TENSOR}.get_device", get_device))
        real_record_stream = replaced.enter_context(replacing(f"{_FAKE_TENSOR}.record_stream", record_stream))
        device_module = answering(get_device_module, [torch.get_device_module])
        # (dynamo keys its handler of the call by the function torch.get_device_module's
        # cache wraps, read the first time it compiles in the process: maybe now)
        wrapped = getattr(torch.get_device_module, "__wrapped__", torch.get_device_module)
        device_module.__wrapped__ = wrapped  # type: ignore[attr-defined]
        real_get_device_module = replaced.enter_context(replacing("torch.get_device_module", device_module))
        if streams is not None:
            replaced.enter_context(streams.on())
            for path, made in (
                ("torch.cuda.Stream", CudaStream),
                ("torch.cuda.Event", CudaEvent),
                ("torch.Stream", _any_stream(CudaStream)),
                ("torch.Event", _any_stream(CudaEvent)),
                ("torch.cuda.StreamContext", StreamContext),
            ):
                replaced.enter_context(replacing_for_readers(path, made, reads_it))
        replaced.enter_context(replacing_for_readers("torch.accelerator.device_index", _DeviceIndex, reads_it))
        for path, answer in answers.items():
            if not present(path):
                continue
            real: list[Callable[..., Any]] = []
            query = answering(answer, real)
            real.append(replaced.enter_context(replacing(path, query)))
            functools.update_wrapper(query, real[0])
        replaced.enter_context(generator_states_on_this_thread())
        replaced.enter_context(torch_decides_as_on_the_gpu())
        replaced.enter_context(autocast_opens_cuda_regions(profile))
        yield


@contextmanager
def generator_states_on_this_thread() -> Iterator[None]:
    """The GPU generator's state, as torch's own ``torch.random.fork_rng`` saves and
    restores it (a pipeline stage's metadata inference), on the tracing thread whoever
    asks: a host tensor, which the GPU's memory does not count. Part of the GPU view,
    and of the warm-up step of a pipeline's ranks on the fake cuda device (which has no
    GPU view: dynamo compiles there)."""
    with (
        on_this_thread("torch.cuda.get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8)),
        on_this_thread("torch.cuda.set_rng_state", lambda new_state, device="cuda": None),
    ):
        yield


#: torch's code that asks about the device on the program's behalf, and acts on the
#: answer in the program's sight: the DataLoader pins its batches where there is an
#: accelerator (``pin_memory=True``, what transformers' Trainer asks by default).
_FOR_THE_PROGRAM: Final = (os.path.join(TORCH_DIR, "utils", "data") + os.sep,)


def _asks_for_the_program(frame: FrameType, thread: int) -> bool:
    return get_ident() == thread and frame.f_code.co_filename.startswith(_FOR_THE_PROGRAM) and not importing()


class _DeviceIndex:
    """``torch.accelerator.device_index(i)``: the one GPU is current whatever ``i`` is."""

    def __init__(self, device: Any, /) -> None:
        self.idx = device

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _cuda_dtypes() -> set[torch.dtype]:
    """What ``torch.accelerator.get_device_capability()`` lists for a GPU: every dtype."""
    return {value for value in vars(torch).values() if isinstance(value, torch.dtype)}


def _any_stream(cuda_kind: type) -> type:
    """``torch.Stream`` / ``torch.Event`` for the program: made on the GPU unless another
    device is named (the current accelerator's, as on a machine with a GPU); every stream
    (event) is an instance of it, as of torch's."""
    real = torch.Stream if issubclass(cuda_kind, torch.Stream) else torch.Event

    class _Meta(type):
        def __call__(cls, device: Any = None, *args: Any, **kwargs: Any) -> Any:
            if device is None or torch.device(device).type == "cuda":
                return cuda_kind(device, *args, **kwargs) if real is torch.Stream else cuda_kind(**kwargs)
            return real(device, *args, **kwargs)

        def __instancecheck__(cls, instance: Any) -> bool:
            return isinstance(instance, real)

        def __subclasscheck__(cls, subclass: type) -> bool:
            return issubclass(subclass, real)

    return _Meta(real.__name__, (), {"__module__": "torch", "__qualname__": real.__qualname__, "__doc__": real.__doc__})


# -- torch's own decisions by device type ---------------------------------------------

#: torch's lists of the device types that have foreach, fused and capturable optimizer
#: kernels, at every place a torch module binds them (the same in torch 2.10 to 2.15:
#: ``tests/test_gpu_view.py`` finds every binding on the running torch). torch decides
#: by ``device.type in <list>``: ``_default_to_fused_or_foreach`` and
#: ``_device_dtype_check_for_fused`` (torch/optim/optimizer.py), each optimizer's
#: ``capturable`` check, ``_device_has_foreach_support`` / ``_has_foreach_support``
#: (torch/utils/_foreach_utils.py: ``clip_grad_norm_``, ``clip_grad_value_``,
#: ``get_total_norm``, ``clip_grads_with_norm_``, with the device that
#: ``torch._C._group_tensors_by_device_and_dtype`` grouped by) and swa_utils'
#: ``AveragedModel.update_parameters``.
KERNEL_DEVICE_LISTS: Final = (
    "torch.utils._foreach_utils._get_foreach_kernels_supported_devices",
    "torch.utils._foreach_utils._get_fused_kernels_supported_devices",
    "torch.optim.optimizer._get_foreach_kernels_supported_devices",
    "torch.optim.optimizer._get_fused_kernels_supported_devices",
    "torch.optim.optimizer._get_capturable_supported_devices",
    "torch.optim.swa_utils._get_foreach_kernels_supported_devices",
    *(
        f"torch.optim.{name}._get_capturable_supported_devices"
        for name in ("adadelta", "adam", "adamax", "asgd", "nadam", "radam", "rmsprop", "rprop")
    ),
)
#: torch's lists of the tensor types its foreach decisions take (``type(t) in <list>``:
#: ``torch.Tensor`` and ``nn.Parameter``; ``torch.distributed.tensor`` adds ``DTensor``).
KERNEL_TYPE_LISTS: Final = (
    "torch.optim.optimizer._foreach_supported_types",
    "torch.utils._foreach_utils._foreach_supported_types",
)


class _OnTheGpu(list):  # type: ignore[type-arg]
    """A list of device types from torch's kernel lists, in which the trace's ``meta``
    device reads as ``cuda`` (what torch does with the list then, ``remove("cuda")``
    for a kernel CUDA lacks, ``+ ["cpu"]``, holds for ``meta`` too)."""

    def __contains__(self, device_type: object) -> bool:
        # (a loop, not list.__contains__, which dynamo cannot call on a list of a subclass
        # when it compiles a region that asks: an optimizer step)
        wanted = "cuda" if device_type == "meta" else device_type
        return any(found == wanted for found in self)

    def __add__(self, other: Any) -> _OnTheGpu:
        return _OnTheGpu(list.__add__(self, other))


def _on_the_thread(tracing: int) -> bool:
    """Whether the caller runs on the tracing thread. Dynamo, compiling a region the trace
    follows (an optimizer step asks torch's device lists), cannot trace ``get_ident``
    and would break the graph there: while it compiles the answer is yes (it compiles on
    the thread that runs the region, the tracing thread for the regions the trace builds)."""
    return torch.compiler.is_compiling() or get_ident() == tracing


class _StandIns:
    """An entry of torch's foreach type lists: the trace's stand-ins (fake tensors) are
    the plain tensors and parameters they stand for, on the tracing thread only."""

    def __init__(self, thread: int) -> None:
        self.thread = thread

    def __eq__(self, other: object) -> bool:
        return other is FakeTensor and _on_the_thread(self.thread)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return "<pytest-torchmem's stand-ins, on the tracing thread>"


@contextmanager
def torch_decides_as_on_the_gpu() -> Iterator[None]:
    """On this thread, torch's decisions by a device's kernels take the trace's meta
    device for the GPU and its stand-ins for plain tensors (see :data:`KERNEL_DEVICE_LISTS`):
    one answer at the lists every such decision reads, not one per decision."""
    tracing = get_ident()

    def on_the_gpu(real: list[Callable[..., list[str]]]) -> Callable[..., list[str]]:
        def devices(*args: Any, **kwargs: Any) -> list[str]:
            found = real[0](*args, **kwargs)
            return _OnTheGpu(found) if _on_the_thread(tracing) else found

        return devices

    with ExitStack() as stack:
        for path in KERNEL_DEVICE_LISTS:
            if not present(path):
                continue
            real: list[Callable[..., list[str]]] = []
            answer = on_the_gpu(real)
            real.append(stack.enter_context(replacing(path, answer)))
            functools.update_wrapper(answer, real[0])
        stand_ins = _StandIns(tracing)
        for path in KERNEL_TYPE_LISTS:
            stack.enter_context(appending(path, stand_ins))
        yield


# -- autocast ---------------------------------------------------------------------------

#: Where ``torch.autocast`` asks whether it may enter a ``cuda`` region with a dtype.
_AUTOCAST_MODE: Final = os.path.join(TORCH_DIR, "amp", "autocast_mode.py")


@contextmanager
def autocast_opens_cuda_regions(profile: Any) -> Iterator[None]:
    """``torch.autocast("cuda", ...)`` enters enabled, as on the profile's GPU, on this thread.

    On a CPU-only torch it finds ``amp_definitely_not_available()``, warns and
    enters disabled: a region the program disables
    (``autocast("cuda", enabled=False)``) could not be told from one it
    enables. Enabled, it sets CUDA autocast's state (which casts nothing on
    the trace's meta tensors: the device's router casts as CUDA's autocast
    would) and refuses bfloat16 where the profile's GPU has none. Also for
    dynamo, which builds a compiled region's autocast in its own code.
    """
    tracing = get_ident()
    outer_unavailable: Callable[[], bool]
    outer_bf16: Callable[..., bool]

    def amp_definitely_not_available() -> bool:
        return False if get_ident() == tracing else outer_unavailable()

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        caller = sys._getframe(1).f_code.co_filename
        if get_ident() == tracing and (caller == _AUTOCAST_MODE or not caller.startswith(NOT_THE_PROGRAM)):
            return bool(profile.bf16)
        return bool(outer_bf16(including_emulation))

    unavailable = "torch.cuda.amp.common.amp_definitely_not_available"
    with (
        replacing(unavailable, amp_definitely_not_available) as outer_unavailable,
        replacing("torch.cuda.is_bf16_supported", is_bf16_supported) as outer_bf16,
    ):
        yield
