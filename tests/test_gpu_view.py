"""The model's code sees a GPU on the fake cuda device, and nothing of it leaks out."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _get_fused_kernels_supported_devices,
    _has_foreach_support,
)

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cuda.profiles import PROFILES


#: What a model's forward saw, kept where an estimate does not put it back (it leaves the
#: user's model as it was, the attributes its forward writes included).
_SEEN = threading.local()


class _Branches(nn.Module):
    """Takes a "GPU path" (an extra 1 MiB buffer on the device) only where it sees a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        _SEEN.items = []

    @property
    def seen(self) -> list[dict[str, Any]]:
        return _SEEN.items

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        seen = {
            "is_cuda": h.is_cuda,
            "device": str(h.device),
            "index": h.get_device(),
            "available": torch.cuda.is_available(),
        }
        if h.device.type == "cuda":
            seen.update(
                capability=torch.cuda.get_device_capability(),
                bf16=torch.cuda.is_bf16_supported(),
                name=torch.cuda.get_device_properties(h.device).name,
                memory=torch.cuda.get_device_properties(0).total_memory,
                count=torch.cuda.device_count(),
                built=torch.backends.cuda.is_built(),
                flash=torch.backends.cuda.is_flash_attention_available(),
                cudnn=torch.backends.cudnn.is_available(),
            )
            scratch = torch.empty(2**18, device=h.device)  # 1 MiB on the GPU
            h = h + scratch[:8] + torch.zeros(8).cuda() + torch.zeros(8).to(h.device)
        _SEEN.items.append(seen)
        return h


@pytest.mark.parametrize("gpu", ["H100", "T4"])
def test_the_program_sees_the_profiles_gpu(gpu: str) -> None:
    model = _Branches()
    report = tm.estimate(model, torch.randn(4, 8), device="cuda", gpu=gpu, train=False)
    profile = PROFILES[gpu]
    assert model.seen == [
        {
            "is_cuda": True,
            "device": "cuda:0",
            "index": 0,
            "available": True,
            "capability": profile.compute_capability,
            "bf16": profile.sm >= 80,
            "name": f"NVIDIA {gpu}",
            "memory": profile.memory,
            "count": 1,
            "built": True,
            "flash": True,
            "cudnn": True,
        }
    ]
    plain = tm.estimate(nn.Linear(8, 8), torch.randn(4, 8), device="cuda", gpu=gpu, train=False)
    assert report.forward_peak - plain.forward_peak >= 2**20  # the GPU path ran, and was charged
    assert report.unsupported == ()


def test_on_cpu_the_program_sees_the_cpu() -> None:
    model = _Branches()
    tm.estimate(model, torch.randn(4, 8), train=False)
    # the machine as it is (what measure(device="cpu") runs in): a GPU where one is (seen
    # on an H100, stop 47), none here
    available = torch.cuda.is_available()
    assert model.seen == [{"is_cuda": False, "device": "cpu", "index": -1, "available": available}]


def test_nothing_leaks_out_of_the_trace_even_on_an_error() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert x.is_cuda and torch.cuda.is_available()
            raise KeyError("the user's")

    queries = {
        (module, name): getattr(module, name)
        for module, name in (
            (torch.cuda, "is_available"),
            (torch.cuda, "get_device_properties"),
            (torch.backends.cuda, "is_built"),
            (torch.backends.cudnn, "is_available"),
        )
    }
    available = torch.cuda.is_available(), torch.backends.cuda.is_built()
    with pytest.raises(KeyError, match="the user's"):
        tm.estimate(Fails(), torch.randn(2), device="cuda", train=False)
    assert {key: getattr(*key) for key in queries} == queries
    assert (torch.cuda.is_available(), torch.backends.cuda.is_built()) == available
    assert "is_cuda" not in FakeTensor.__dict__ and "get_device" not in FakeTensor.__dict__
    assert isinstance(FakeTensor.__dict__["device"], property)
    with tm_fake_meta() as fake:
        assert fake.device.type == "meta" and not fake.is_cuda and fake.get_device() == -1


def tm_fake_meta() -> Any:
    from contextlib import contextmanager

    from torch._subclasses.fake_tensor import FakeTensorMode

    @contextmanager
    def made() -> Any:
        with FakeTensorMode() as mode:
            yield mode.from_tensor(torch.empty(2, device="meta"))

    return made()


def _real_answers(fake: torch.Tensor, standin: list[torch.Tensor]) -> dict[str, Any]:
    """What another thread reads of the process's GPU and of fake tensors."""
    return {
        "available": torch.cuda.is_available(),
        "count": torch.cuda.device_count(),
        "built": torch.backends.cuda.is_built(),
        "cudnn": torch.backends.cudnn.is_available(),
        "flash": torch.backends.cuda.is_flash_attention_available(),
        "own fake": (str(fake.device), fake.is_cuda, fake.get_device()),
        # torch's decisions by a device's kernels (torch/utils/_foreach_utils.py)
        "meta has foreach kernels": _device_has_foreach_support(torch.device("meta")),
        "fake tensors take foreach": _has_foreach_support([fake], torch.device("cpu")),
        "fused devices": _get_fused_kernels_supported_devices(),
        "trace's tensor": [(str(t.device), t.is_cuda, t.get_device()) for t in standin],
    }


def test_another_thread_never_sees_the_gpu_view() -> None:
    """Regression (issue 27, item 6): while ``estimate(device="cuda")`` ran, every thread
    of the process saw a GPU (``torch.cuda.is_available()`` True, ``device_count()`` 1,
    a fake meta tensor's ``.device`` ``cuda:0``): a background thread that chose
    ``"cuda" if torch.cuda.is_available()`` crashed. The view is the tracing thread's
    only: a thread that polls each time the traced forward, a backward hook and the
    optimizer step are held waiting for it reads the real answers every time, torch's
    lists of the devices and tensor types with foreach and fused kernels included."""
    import threading

    from torch._subclasses.fake_tensor import FakeTensorMode

    inside = threading.Semaphore(0)  # the traced code is held at a poll point (or the end)
    polled = threading.Semaphore(0)  # the other thread has read its answers there
    held: list[torch.Tensor] = []
    seen_in_trace: list[tuple[str, bool]] = []

    def poll_point(where: str, t: torch.Tensor) -> None:
        seen_in_trace.append((where, t.is_cuda and torch.cuda.is_available() and torch.cuda.device_count() == 1))
        held[:] = [t]
        inside.release()
        assert polled.acquire(timeout=600), "the polling thread never answered"
        held.clear()

    class Held(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.linear(x)
            poll_point("forward", h)
            h.register_hook(lambda grad: poll_point("backward", grad))
            return h

    class HeldSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            poll_point("step", self.param_groups[0]["params"][0])
            return super().step(closure)

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.empty(2, device="meta"))
    before = _real_answers(fake, [])
    answers: list[dict[str, Any]] = []
    failures: list[BaseException] = []
    done = False

    def poller() -> None:
        try:
            while inside.acquire(timeout=600) and not done:
                answers.append(_real_answers(fake, held))
                polled.release()
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)
            polled.release()

    thread = threading.Thread(target=poller)
    thread.start()
    try:
        tm.estimate(Held(), torch.randn(4, 8), device="cuda", optimizer=lambda p: HeldSGD(p, lr=0.1))
    finally:
        done = True
        inside.release()
        thread.join()
    assert not failures, failures
    assert {where for where, _ in seen_in_trace} == {"forward", "backward", "step"}
    assert all(gpu for _, gpu in seen_in_trace)  # the traced code did see the GPU
    assert len(answers) == len(seen_in_trace)
    for answer in answers:
        assert answer["trace's tensor"] == [("meta", False, -1)]
        assert {**answer, "trace's tensor": []} == before


def test_every_binding_of_torchs_kernel_lists_is_answered() -> None:
    """torch decides whether a device has foreach, fused and capturable optimizer kernels
    by lists its modules import by name; the GPU view answers at each binding
    (gpu_view.KERNEL_DEVICE_LISTS). Every torch module loaded that binds one of the
    three helpers, or the foreach type lists, is listed there (a release that adds a
    binding fails here, not silently on a user's step)."""
    import importlib
    import sys

    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    from pytest_torchmem.engine.tracing.devices.cuda.gpu_view import KERNEL_DEVICE_LISTS, KERNEL_TYPE_LISTS

    for name in ("torch.optim", "torch.optim.swa_utils", "torch.nn.utils.clip_grad", "torch.amp"):
        importlib.import_module(name)
    helpers = {
        id(foreach_utils._get_foreach_kernels_supported_devices),
        id(foreach_utils._get_fused_kernels_supported_devices),
        id(optimizer._get_capturable_supported_devices),
    }
    lists = {id(foreach_utils._foreach_supported_types), id(optimizer._foreach_supported_types)}
    bound, typed = set(), set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch" or name.startswith("torch.")):
            continue
        if name.startswith("torch.distributed.tensor"):
            continue  # adds DTensor to the type lists at import: an alias of each, not a decision
        for attr, value in list(vars(module).items()):
            if id(value) in helpers:
                bound.add(f"{name}.{attr}")
            elif id(value) in lists:
                typed.add(f"{name}.{attr}")
    assert bound == set(KERNEL_DEVICE_LISTS)
    assert typed == set(KERNEL_TYPE_LISTS)


def test_torchs_kernel_lists_are_put_back() -> None:
    """However the trace ends, torch's lists are as they were: the helpers are torch's
    own again and the type lists hold what they held (DTensor's entry included)."""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    helpers = (
        foreach_utils._get_foreach_kernels_supported_devices,
        foreach_utils._get_fused_kernels_supported_devices,
        optimizer._get_capturable_supported_devices,
    )
    types = (list(foreach_utils._foreach_supported_types), list(optimizer._foreach_supported_types))

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("the user's")

    with pytest.raises(KeyError, match="the user's"):
        tm.estimate(Fails(), torch.randn(4), device="cuda", optimizer=lambda p: torch.optim.AdamW(p, fused=True))
    tm.estimate(nn.Linear(4, 4), torch.randn(2, 4), device="cuda", optimizer=lambda p: torch.optim.AdamW(p, fused=True))
    assert (
        foreach_utils._get_foreach_kernels_supported_devices,
        foreach_utils._get_fused_kernels_supported_devices,
        optimizer._get_capturable_supported_devices,
    ) == helpers
    assert (list(foreach_utils._foreach_supported_types), list(optimizer._foreach_supported_types)) == types
    assert "meta" not in foreach_utils._get_foreach_kernels_supported_devices()
