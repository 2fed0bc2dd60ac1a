"""The traced program cannot tell it is traced (issue 54): whatever it asks, it gets a real run's answer.

A program that asks whether it is traced (transformers' ``is_tracing`` asks whether a
tensor is a ``FakeTensor``) took another branch in the trace than in a real run, and
the figure was that other branch's. Here a model asks every question there is, and
allocates 1 MiB more wherever an answer says "traced": on cpu its answers and its
figures equal a real run's (``measure``); on the fake cuda device it gets a GPU's
answers: the accelerator, its streams and events, its pinned host memory, and the
caching allocator's statistics, which are the trace's own figures at the moment the
program asks.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn
from torch._guards import detect_fake_mode as bound_detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor as BoundFakeTensor
from torch._subclasses.fake_tensor import is_fake as bound_is_fake
from torch._subclasses.fake_tensor import maybe_get_fake_mode as bound_maybe_get_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as bound_current_dispatch_mode
from torch.utils._python_dispatch import is_in_torch_dispatch_mode as bound_is_in_torch_dispatch_mode
from torch.utils.data import DataLoader, TensorDataset

import pytest_torchmem as tm
from pytest_torchmem.engine.figures.gpu_profiles import usable_memory
from pytest_torchmem.engine.tracing.devices.cuda.profiles import PROFILES

#: What the traced program saw, kept where an estimate does not put it back.
_SEEN = threading.local()

MiB = 1 << 20


def _seen() -> list[Any]:
    return _SEEN.__dict__.setdefault("items", [])


def _questions(x: torch.Tensor) -> dict[str, Any]:
    """Every question a program can ask about being traced, asked as libraries ask them."""
    import torch._subclasses
    import torch._subclasses.fake_tensor
    import torch.utils._python_dispatch

    answers = {
        "isinstance FakeTensor": isinstance(x, torch._subclasses.FakeTensor),
        "isinstance fake_tensor.FakeTensor": isinstance(x, torch._subclasses.fake_tensor.FakeTensor),
        "is_fake": torch._subclasses.fake_tensor.is_fake(x),
        "maybe_get_fake_mode": torch._subclasses.fake_tensor.maybe_get_fake_mode(x),
        "detect_fake_mode": torch._guards.detect_fake_mode((x,)),
        "detect_fake_mode()": torch._guards.detect_fake_mode(),
        "is_in_torch_dispatch_mode": torch.utils._python_dispatch.is_in_torch_dispatch_mode(),
        "current dispatch mode": torch.utils._python_dispatch._get_current_dispatch_mode(),
        "is_compiling": torch.compiler.is_compiling(),
        "is_dynamo_compiling": torch.compiler.is_dynamo_compiling(),
        "is_exporting": torch.compiler.is_exporting(),
        "jit.is_tracing": torch.jit.is_tracing(),
        "jit.is_scripting": torch.jit.is_scripting(),
        "is_fx_tracing": torch.fx._symbolic_trace.is_fx_tracing(),
        "is_functional_tensor": torch._is_functional_tensor(x),
        "is_meta": x.is_meta,
        "device": x.device.type,
        # (the same, bound by name at this module's import, as torchao's MX formats bind is_fake)
        "bound isinstance FakeTensor": isinstance(x, BoundFakeTensor),
        "bound is_fake": bound_is_fake(x),
        "bound maybe_get_fake_mode": bound_maybe_get_fake_mode(x),
        "bound detect_fake_mode": bound_detect_fake_mode((x,)),
        "bound is_in_torch_dispatch_mode": bound_is_in_torch_dispatch_mode(),
        "bound current dispatch mode": bound_current_dispatch_mode(),
    }
    try:
        from transformers.utils.import_utils import is_tracing
    except ImportError:
        pass
    else:
        answers["transformers is_tracing"] = is_tracing(x)
    return answers


#: The answers that say "traced", each as the question's key and its real-run answer.
_UNTRACED = {
    "isinstance FakeTensor": False,
    "isinstance fake_tensor.FakeTensor": False,
    "is_fake": False,
    "maybe_get_fake_mode": None,
    "detect_fake_mode": None,
    "detect_fake_mode()": None,
    "is_in_torch_dispatch_mode": False,
    "current dispatch mode": None,
    "is_compiling": False,
    "is_dynamo_compiling": False,
    "is_exporting": False,
    "jit.is_tracing": False,
    "jit.is_scripting": False,
    "is_fx_tracing": False,
    "is_functional_tensor": False,
    "is_meta": False,
    "transformers is_tracing": False,
    "bound isinstance FakeTensor": False,
    "bound is_fake": False,
    "bound maybe_get_fake_mode": None,
    "bound detect_fake_mode": None,
    "bound is_in_torch_dispatch_mode": False,
    "bound current dispatch mode": None,
}

#: The names this module bound, as torch has them: an estimate binds them back.
_BOUND = {
    "BoundFakeTensor": "torch._subclasses.fake_tensor.FakeTensor",
    "bound_is_fake": "torch._subclasses.fake_tensor.is_fake",
    "bound_maybe_get_fake_mode": "torch._subclasses.fake_tensor.maybe_get_fake_mode",
    "bound_detect_fake_mode": "torch._guards.detect_fake_mode",
    "bound_is_in_torch_dispatch_mode": "torch.utils._python_dispatch.is_in_torch_dispatch_mode",
    "bound_current_dispatch_mode": "torch.utils._python_dispatch._get_current_dispatch_mode",
}


def _bound_as_torch_has_them() -> bool:
    import importlib

    def torchs(path: str) -> Any:
        module, _, name = path.rpartition(".")
        return vars(importlib.import_module(module))[name]

    return all(globals()[name] is torchs(path) for name, path in _BOUND.items())


class _Asking(nn.Module):
    """Asks every question in its forward; 1 MiB more on the device where one says "traced"."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        answers = _questions(h)
        _seen().append(answers)
        if any(answers.get(key, value) != value for key, value in _UNTRACED.items()):
            h = h + torch.zeros(MiB // 4, device=h.device)[:16]  # the "traced" branch
        return h


def test_on_cpu_the_program_gets_a_real_runs_answers_and_its_figures_are_measures() -> None:
    model, x = _Asking(), torch.randn(8, 16)
    _seen().clear()
    estimated = tm.estimate(model, x)
    traced = _seen().copy()
    _seen().clear()
    measured = tm.measure(model, x)
    real = _seen().copy()
    assert traced and traced[0] == real[0]
    assert all(answer == _UNTRACED[key] for key, answer in traced[0].items() if key in _UNTRACED), traced[0]
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert _bound_as_torch_has_them()


def test_on_cuda_the_program_gets_a_gpus_answers() -> None:
    _seen().clear()
    model = _Asking()
    report = tm.estimate(model, torch.randn(8, 16), device="cuda")
    (answers,) = _seen()
    assert answers == {key: _UNTRACED[key] for key in answers if key != "device"} | {"device": "cuda"}
    without = tm.estimate(nn.Linear(16, 16), torch.randn(8, 16), device="cuda")
    assert report.forward_peak == without.forward_peak  # (no "traced" megabyte)
    assert _bound_as_torch_has_them()


class _LazyModule:
    """An entry of ``sys.modules`` as lazy loaders make them: any attribute it lacks is an
    import, which fails here."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        raise ImportError(f"a lazy module imported {name}")


def test_an_entry_of_sys_modules_that_imports_on_every_look_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "_torchmem_lazy_module", _LazyModule())
    monkeypatch.setitem(sys.modules, "_torchmem_blocked_module", None)
    assert tm.estimate(_Asking(), torch.randn(8, 16)).phase_peaks() == tm.measure(_Asking(), torch.randn(8, 16)).phase_peaks()


class _Own(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _with_a_mode_of_its_own(model: nn.Module, x: torch.Tensor) -> None:
    import torch.utils._python_dispatch as dispatch

    mode = _Own()
    with mode:
        _seen().append(
            (dispatch.is_in_torch_dispatch_mode(), dispatch._get_current_dispatch_mode() is mode, type(mode).__name__)
        )
        model(x).sum().backward()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_dispatch_mode_the_program_enters_is_the_one_it_sees(device: str) -> None:
    _seen().clear()
    tm.estimate(_with_a_mode_of_its_own, (nn.Linear(4, 4), torch.randn(2, 4)), device=device)
    assert _seen() == [(True, True, "_Own")]


# -- the accelerator, its streams and events --------------------------------------------


def _accelerator(x: torch.Tensor) -> torch.Tensor:
    stream = torch.cuda.Stream()
    event = torch.cuda.Event(enable_timing=True)
    _seen().append(
        {
            "available": torch.accelerator.is_available(),
            "accelerator": torch.accelerator.current_accelerator(),
            "count": torch.accelerator.device_count(),
            "index": torch.accelerator.current_device_index(),
            "module": torch.get_device_module(),
            "stream is a cuda stream": isinstance(stream, torch.cuda.Stream) and isinstance(stream, torch.Stream),
            "stream device": stream.device,
            "default": torch.cuda.current_stream() == torch.cuda.default_stream(),
            "new stream is current": torch.cuda.current_stream() is stream,
            "event is an event": isinstance(event, torch.cuda.Event),
            "torch.Stream() is the GPU's": torch.Stream().device,
            "capturing": torch.cuda.is_current_stream_capturing(),
        }
    )
    with torch.cuda.stream(stream):
        current = torch.cuda.current_stream() is stream and torch.accelerator.current_stream() is stream
        y = x.cuda() * 2
        event.record()
    torch.cuda.current_stream().wait_event(event)
    y.record_stream(torch.cuda.current_stream())
    event.synchronize()
    _seen().append({"current inside": current, "after": torch.cuda.current_stream() == torch.cuda.default_stream()})
    return y


def test_on_cuda_the_program_finds_the_accelerator_and_its_streams_and_events() -> None:
    _seen().clear()
    report = tm.estimate(_accelerator, (torch.randn(4),), device="cuda")
    assert report.unsupported == ()
    assert _seen() == [
        {
            "available": True,
            "accelerator": torch.device("cuda"),
            "count": 1,
            "index": 0,
            "module": torch.cuda,
            "stream is a cuda stream": True,
            "stream device": torch.device("cuda", 0),
            "default": True,
            "new stream is current": False,
            "event is an event": True,
            "torch.Stream() is the GPU's": torch.device("cuda", 0),
            "capturing": False,
        },
        {"current inside": True, "after": True},
    ]
    # nothing of it is left outside the trace
    assert not torch.accelerator.is_available()
    with pytest.raises((RuntimeError, AssertionError)):  # (a CPU build asserts, a CUDA build finds no GPU)
        torch.cuda.current_stream()


def _two_small_tensors(side: bool) -> None:
    a = torch.empty(256, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream if side else None):
        b = torch.empty(256, device="cuda")
    del a, b


@pytest.mark.parametrize("side", [False, True])
def test_what_a_stream_allocates_comes_from_its_own_blocks(side: bool) -> None:
    """Hand count (``CUDACachingAllocator.cpp``: small requests are packed into 2 MiB
    segments, and a block is handed out only to its own stream's requests): two 1 KiB
    tensors share one segment on one stream, and take two on two streams."""
    report = tm.estimate(_two_small_tensors, (side,), device="cuda")
    assert report.peak == 2 * 1024
    assert report.reserved_peak == (4 if side else 2) * MiB


# -- the caching allocator's statistics ---------------------------------------------------


def _reads_the_statistics() -> None:
    a = torch.empty(MiB, device="cuda")  # 4 MiB (a multiple of 512 B: its own size)
    first = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    b = torch.empty(MiB // 4, device="cuda")  # 1 MiB
    second = torch.cuda.memory_allocated()
    del a
    third = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    stats = torch.cuda.memory_stats()
    _seen().append(
        {
            "first": first,
            "second": second,
            "third": third,
            "after reset": torch.cuda.max_memory_allocated(),
            "stats": (stats["allocated_bytes.all.current"], stats["allocated_bytes.all.peak"]),
            "accelerator": (torch.accelerator.memory_allocated(), torch.accelerator.max_memory_allocated()),
            "mem_get_info": torch.cuda.mem_get_info(),
        }
    )
    del b


def test_the_statistics_the_program_reads_are_the_traces_figures_at_that_moment() -> None:
    """Hand count (``CUDACachingAllocator.cpp``: ``get_pool``, ``get_allocation_size``):
    4 MiB, then 1 MiB more, then the 4 MiB freed. The 4 MiB request is a large one below
    10 MiB: a 20 MiB segment (kLargeBuffer); the 1 MiB one is the small pool's largest
    (kSmallSize): a 2 MiB segment. 20 MiB reserved after the first, 22 MiB after both."""
    _seen().clear()
    report = tm.estimate(_reads_the_statistics, (), device="cuda")
    (seen,) = _seen()
    profile = PROFILES["H100"]
    assert seen == {
        "first": (4 * MiB, 20 * MiB),
        "second": 5 * MiB,
        "third": (1 * MiB, 5 * MiB),
        "after reset": 1 * MiB,
        "stats": (1 * MiB, 1 * MiB),
        "accelerator": (1 * MiB, 1 * MiB),
        "mem_get_info": (usable_memory(profile) - 22 * MiB, profile.memory),
    }
    assert report.peak == 5 * MiB


def _loop_that_logs_its_peak(model: nn.Module, batches: list[torch.Tensor]) -> None:
    model = model.to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in batches:
        model(x.to("cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _seen().append(torch.cuda.max_memory_allocated())


def test_a_training_loop_that_logs_its_peak_logs_the_reports_peak() -> None:
    _seen().clear()
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    report = tm.estimate(_loop_that_logs_its_peak, (model, [torch.randn(32, 256) for _ in range(3)]), device="cuda")
    assert _seen() == [report.peak]


# -- pinned host memory ---------------------------------------------------------------------


def _pins_its_batches(loader: DataLoader) -> None:
    for (x,) in loader:
        _seen().append(x.is_pinned())
        x.to(torch.accelerator.current_accelerator() or "cpu", non_blocking=True)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_dataloader_pins_its_batches_where_the_device_has_an_accelerator(device: str) -> None:
    """On the fake cuda device the DataLoader finds the accelerator and pins (transformers'
    Trainer asks it to by default): no "no accelerator is found" warning, pinned batches."""
    _seen().clear()
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4, pin_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = tm.estimate(_pins_its_batches, (loader,), device=device)
    warned = any("no accelerator is found" in str(w.message) for w in caught)
    assert report.unsupported == ()
    if device == "cuda":
        assert _seen() == [True, True] and not warned
        assert report.peak == 512  # (one 64-byte batch at a time in a 512-byte block; the pinned copies are the host's)
    else:
        assert _seen() == [False, False] and warned  # as a real run on a machine without a GPU


# -- activation offloading --------------------------------------------------------------------


class _OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Activation offloading as fine-tuning libraries write it: each saved activation
    copied into a pinned host buffer on a side stream (the device's copy then goes with
    the program's last reference), brought back to the device in backward."""

    def __init__(self) -> None:
        if not torch.accelerator.is_available():
            raise RuntimeError("enable_activation_offloading should only be True when training on CUDA or XPU")
        self.compute = torch.cuda.current_stream()
        self.copies = torch.cuda.Stream()
        self.pinned: list[bool] = []

        def pack(t: torch.Tensor) -> Any:
            if t.device.type != "cuda" or isinstance(t, nn.Parameter):
                return t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=True)
            self.pinned.append(host.is_pinned())
            self.copies.wait_stream(self.compute)
            with torch.cuda.stream(self.copies):
                host.copy_(t, non_blocking=True)
                t.record_stream(self.copies)
            return ("host", host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, tuple):
                return packed[1].to("cuda", non_blocking=True)
            return packed

        super().__init__(pack, unpack)


def _offloading_step(weights: list[torch.Tensor], x: torch.Tensor, offload: bool) -> None:
    weights = [w.cuda().requires_grad_() for w in weights]
    h = x.cuda()
    hooks = _OffloadActivations() if offload else None
    with hooks if hooks is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for w in weights:
            h = (h @ w).relu()
    if hooks is not None:
        _seen().append(hooks.pinned)
    h.sum().backward()


@pytest.mark.parametrize("layers", [4, 8])
def test_activation_offloading_takes_the_saved_activations_off_the_gpu(layers: int) -> None:
    """Hand count of the forward's peak (4 MiB activations: 1024 x 1024 float32), at the
    last ReLU. Without offloading the ReLUs' outputs r1..r{n-1} are saved, and the last
    matmul's output and r{n} are live: n + 1 activations. Offloaded, each ``r`` saved is a
    pinned host copy, and a device ``r`` goes when the loop takes the next (``h``): r{n-1},
    the last matmul's output and r{n}, 3 activations. The rest (the weights, the input,
    the cuBLAS workspace) is the same both ways."""
    torch.manual_seed(0)
    weights = [torch.randn(1024, 1024) / 32 for _ in range(layers)]
    x = torch.randn(1024, 1024)
    _seen().clear()
    plain = tm.estimate(_offloading_step, (weights, x, False), device="cuda")
    offloaded = tm.estimate(_offloading_step, (weights, x, True), device="cuda")
    assert offloaded.unsupported == plain.unsupported == ()
    assert tm.estimate(nn.Linear(4, 4), torch.randn(2, 4)).host_peak is None  # (cuda only)
    assert plain.forward_peak - offloaded.forward_peak == (layers + 1 - 3) * 4 * MiB
    # the host copies, shown apart: every saved tensor's, held until backward unpacks it
    assert (plain.host_peak, offloaded.host_peak) == (0, (3 * layers - 1) * 4 * MiB)
    # every saved tensor went to a pinned host buffer: each matmul's input and weight (the
    # first's input needs no gradient: its weight is not saved) and each ReLU's output
    assert _seen() == [[True] * (3 * layers - 1)]


def _checkpointed_llama_step(model: nn.Module, batch: dict[str, torch.Tensor], offload: bool) -> None:
    model = model.to("cuda")
    model.activation_checkpointing_enable(offload=offload)  # (made where the script runs: it finds the GPU)
    model(**{name: tensor.to("cuda") for name, tensor in batch.items()}).loss.backward()


def test_transformers_activation_offloading_takes_each_checkpointed_layers_input_off_the_gpu() -> None:
    """transformers' own offloading (``activation_checkpointing_enable(offload=True)``:
    ``save_on_cpu`` around each layer's checkpoint) on a 4- and an 8-layer Llama: each layer
    more is one more checkpointed input (2 x 32 x 64 float32: 16 KiB) held on the host
    instead of the GPU at the forward's peak; the backward, which brings them back one
    layer at a time, peaks as without offloading."""
    pytest.importorskip("transformers")
    from model_matrix import made

    offloaded: dict[int, int] = {}
    for layers in (4, 8):
        model, batch, _ = made("llama", "as made", layers)
        plain = tm.estimate(_checkpointed_llama_step, (model, batch, False), device="cuda")
        off = tm.estimate(_checkpointed_llama_step, (model, batch, True), device="cuda")
        assert plain.unsupported == off.unsupported == ()
        assert off.backward_peak == plain.backward_peak
        offloaded[layers] = plain.forward_peak - off.forward_peak
    assert offloaded[8] - offloaded[4] == 4 * 2 * 32 * 64 * 4
