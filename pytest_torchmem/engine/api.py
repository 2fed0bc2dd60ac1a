"""The public entry points: :func:`estimate`, :func:`measure` and :func:`every_rank`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile, gpu_profile
from pytest_torchmem.engine.figures.modelled_device import ModelledDevice
from pytest_torchmem.engine.figures.report import MemoryReport
from pytest_torchmem.engine.torch_compat.torch_release import require_supported_torch

if TYPE_CHECKING:  # imported when called, after the torch release is checked
    from torch import nn

    from pytest_torchmem.engine.every_rank import RankFigures
    from pytest_torchmem.engine.parallel.mesh import Parallel
    from pytest_torchmem.engine.step.built_in import LossFn, OptimizerFactory
    from pytest_torchmem.engine.step.request import StepRequest
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import CpuProfile

__all__ = ["check_profiles", "estimate", "every_rank", "measure", "with_profiles"]


def estimate(
    model: nn.Module | Callable[..., Any],
    inputs: Any,
    *,
    device: str = "cpu",
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    train: bool = True,
    keep_output: bool = False,
    gpu: str | GpuProfile | None = None,
    cpu: str | CpuProfile | None = None,
    compile: bool | Mapping[str, Any] | None = None,
    parallel: Parallel | None = None,
) -> MemoryReport:
    """Estimate the memory of one step of ``model`` on ``inputs`` with fake tensors.

    The step is forward, ``loss_fn`` and ``loss.backward()`` (``train=True``),
    then ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` when
    ``optimizer`` (a callable ``params -> Optimizer``) is given; with
    ``train=False`` it is the forward alone under ``torch.no_grad()``.
    ``model`` may hold real or meta-device tensors; it is left exactly as it
    was, and no real memory in proportion to the model or its activations is
    allocated.

    ``inputs``: a tensor, a tuple (positional arguments) or a mapping (keyword
    arguments: a dict, a tokenizer's ``BatchEncoding``, any ``Mapping``); the
    tensors may sit in nested lists, tuples, mappings, dataclasses and named
    tuples. The default loss is ``output.loss`` (attribute or key) when it is
    a scalar tensor, else the sum of every floating-point tensor in the
    output, wherever it sits.

    ``keep_output``: ``False`` releases the model's output before
    ``backward()``, as a loop that keeps only the loss does; ``True`` holds it
    to the end of the step (through backward and the optimizer step), as
    ``out = model(**batch); out.loss.backward(); opt.step()`` does.

    ``device="cuda"`` needs no GPU: the step is traced on fake tensors and
    charged through a model of CUDA's caching allocator, following the GPU
    ``gpu`` names: a name from :data:`pytest_torchmem.engine.figures.gpu_profiles.PROFILES`
    (default ``"H100"``), a :class:`~pytest_torchmem.GpuProfile` made from a GPU's
    properties (``tm.GpuProfile("RTX4070TiS", memory="16 GiB",
    compute_capability="8.9", sm_count=66)``), or ``"current"``: this machine's
    GPU (:meth:`~pytest_torchmem.GpuProfile.from_device`).

    ``device="cpu"`` models the CPU ``cpu`` names: ``None`` (or ``"host"``) this
    host as the process runs now (what :func:`measure` sees), or a profile
    ``"<isa level>:<intra-op threads>"`` such as ``"avx2:4"``, or a
    :class:`~pytest_torchmem.CpuProfile`; under a named profile the figures are
    the same on every host.

    ``compile``: ``True`` or a dict of ``torch.compile``'s ``mode``, ``dynamic``,
    ``fullgraph`` and ``options`` checks an eager ``model`` as
    ``torch.compile(model, **compile)`` runs it (``model`` itself is not
    compiled); a compiled model (``torch.compile(model)``, ``model.compile()``,
    compiled submodules and functions) is estimated as compiled without it. On
    both devices the estimate follows the program inductor builds (on cuda its
    triton kernels' buffers and the wrapper's reuse, without a GPU); what it
    cannot follow (torch 2.10 to 2.12, a region dynamo gives up on) runs eagerly
    and is listed in ``unsupported``, never an eager figure in silence.

    ``model`` may also be a step function (any callable that is not a module):
    ``estimate(train_step, (model, batch, opt))`` runs ``train_step(model, batch,
    opt)`` with the modules, tensors, optimizers, LR schedulers and grad scalers
    among its arguments as stand-ins (left as they were); its forward, backward
    and optimizer steps are recognised where they run, and each phase's figure is
    the highest of its iterations (:mod:`~pytest_torchmem.engine.step.step_function`).
    ``loss_fn``, ``optimizer``, ``train``, ``keep_output``, ``compile`` and
    ``parallel`` are the built-in step's, and do not apply to it. A callable that
    cannot take ``inputs`` (the model's factory passed in place of the model) is
    refused with a ``TypeError`` that says so.

    A torch outside the supported window raises
    :class:`~pytest_torchmem.engine.torch_compat.torch_release.TorchReleaseError` at once.
    """
    require_supported_torch()
    from pytest_torchmem.engine.step.request import as_compiled, step_request
    from pytest_torchmem.engine.tracing.trace import trace_request

    request = step_request(
        "estimate", model, inputs, device, loss_fn, optimizer, train, keep_output, compile, parallel
    )
    check_profiles(request.device, gpu, cpu)
    check_parallel(parallel, request.model)
    request = with_profiles(as_compiled(request), gpu, cpu)
    if parallel is not None and parallel.rank == "max":
        from pytest_torchmem.engine.every_rank import request_ranks

        return request_ranks(request)[0].report
    return trace_request(request).report


def every_rank(
    model: nn.Module,
    inputs: Any,
    *,
    parallel: Parallel,
    device: str = "cpu",
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    train: bool = True,
    keep_output: bool = False,
    gpu: str | GpuProfile | None = None,
    cpu: str | CpuProfile | None = None,
    compile: bool | Mapping[str, Any] | None = None,
) -> tuple[RankFigures, ...]:
    """The figures of every distinct rank of ``parallel``'s mesh, the worst first: the
    rank that runs out of memory first (on cuda: the highest reserved peak, with the
    room it leaves on ``gpu``; on cpu: the highest peak). Each entry lists the ranks it
    stands for (those whose figures are equal to its own); ``parallel.rank`` is not read.

    The options are :func:`estimate`'s; :mod:`~pytest_torchmem.engine.every_rank`
    says which ranks are traced."""
    require_supported_torch()
    from pytest_torchmem.engine.every_rank import request_ranks
    from pytest_torchmem.engine.step.request import as_compiled, step_request

    request = step_request(
        "every_rank", model, inputs, device, loss_fn, optimizer, train, keep_output, compile, parallel
    )
    check_profiles(request.device, gpu, cpu)
    if parallel is None:
        raise TypeError("every_rank() needs parallel=tm.Parallel(mesh=..., apply=...)")
    check_parallel(parallel, request.model)
    return request_ranks(with_profiles(as_compiled(request), gpu, cpu))


def check_parallel(parallel: Any, model: Any = None) -> None:
    from pytest_torchmem.engine.parallel.mesh import Parallel
    from pytest_torchmem.engine.step.step_function import StepFunction

    if parallel is not None and not isinstance(parallel, Parallel):
        raise TypeError(
            "parallel must be a pytest_torchmem.Parallel, e.g. "
            f"parallel=tm.Parallel(mesh={{'dp': 8}}, apply=fn), got {type(parallel).__name__}"
        )
    if parallel is not None and isinstance(model, StepFunction):
        raise ValueError(
            "parallel= checks a model's built-in step on one rank; a step function with "
            "parallel= is not supported yet: check the rank's model with the built-in step"
        )


def measure(
    model: nn.Module | Callable[..., Any],
    inputs: Any,
    *,
    device: str = "cpu",
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    train: bool = True,
    keep_output: bool = False,
    compile: bool | Mapping[str, Any] | None = None,
    parallel: Parallel | None = None,
) -> MemoryReport:
    """Run one step of ``model`` for real and report the memory it took.

    The same step as :func:`estimate`, with the same ``inputs`` and
    ``keep_output``. On ``"cpu"`` every allocation and free
    is read from the PyTorch profiler's allocator events; on ``"cuda"`` from
    ``torch.cuda``'s peak statistics. The model's parameters, buffers and
    gradients are cloned first, so the model itself is left as it was. The
    report's ``profile`` names the machine measured: this host's CPU profile
    (``"avx2:2"``; None where the host is no level the CPU rules model), or the GPU.

    ``parallel`` (cpu only): the mesh's ranks run as real processes on this
    machine over gloo (world size at most 4), each measured as above; the
    report is the memory of ``parallel.rank``.

    A step function (``estimate``'s) runs for real on copies of its arguments'
    tensors, with twins of its optimizers, schedulers and scalers.

    ``compile`` (``estimate``'s): the step of ``torch.compile(model, **compile)``,
    in its steady state (a warm-up step compiles first); dynamo's cache
    entries of a measurement are its own, invalidated when it returns.
    """
    require_supported_torch()
    from pytest_torchmem.engine.parallel.real_ranks import settle_autograd_threads
    from pytest_torchmem.engine.measuring.runs import measure_step
    from pytest_torchmem.engine.step.request import as_compiled, step_request

    settle_autograd_threads()  # before any fake mode: forked ranks can run backward
    request = step_request(
        "measure", model, inputs, device, loss_fn, optimizer, train, keep_output, compile, parallel
    )
    check_parallel(parallel, request.model)
    return measure_step(as_compiled(request))


def check_profiles(device: ModelledDevice, gpu: Any, cpu: Any) -> None:
    """``gpu=`` applies to ``device="cuda"`` only, ``cpu=`` to ``"cpu"`` only."""
    if gpu is not None and not device.is_cuda:
        raise ValueError(f"gpu={gpu!r} applies to device='cuda' only, not {device.kind!r}")
    if cpu is not None and not device.is_cpu:
        raise ValueError(f"cpu={cpu!r} applies to device='cpu' only, not {device.kind!r}")


def with_profiles(request: StepRequest, gpu: Any, cpu: Any) -> StepRequest:
    """``request`` with its device's profile resolved, once, from the entry point's ``gpu=``
    (a name or a :class:`GpuProfile`; None: :data:`~pytest_torchmem.engine.figures.gpu_profiles.DEFAULT_GPU`)
    or ``cpu=`` (a profile's name or a ``CpuProfile``; None: this host, as this process runs
    now; under ``parallel=``, this host at one intra-op thread: each rank is a process of
    its own, as torchrun starts it, with ``OMP_NUM_THREADS=1``, and as
    ``measure(parallel=...)`` runs it), the one its device follows; the other must be None
    (:func:`check_profiles`)."""
    check_profiles(request.device, gpu, cpu)
    if request.device.is_cuda:
        return dataclasses.replace(request, device=request.device.following(gpu=gpu_profile(gpu)))
    from pytest_torchmem.engine.tracing.devices.cpu.profiles import cpu_profile

    profile = cpu_profile(cpu)
    if cpu is None and request.parallel is not None:
        profile = dataclasses.replace(profile, threads=1)
    return dataclasses.replace(request, device=request.device.following(cpu=profile))
