"""The device audit: the branches CUDA dispatch takes in torch's own code, and the fake cuda device's route for each.

Torch tells its GPU branches without a GPU. On PyPI's CUDA build (no GPU present),
under torch's own ``FakeTensorMode``, a fake tensor on ``cuda`` runs the composite
ops' C++ bodies with ``is_cuda()`` true, so they take the GPU's branch, and a
dispatch mode inside the fake mode sees the ops they call. The audit runs each
sample twice so, once with its tensors on fake ``cpu`` and once on fake ``cuda``,
forward and backward, records the aten ops each dispatches, and keeps every sample
whose two lists differ: a **branch** (the ops only fake cpu ran, the ops only fake
cuda ran, per phase). The samples are OpInfo's (``op_db``: the first
:data:`SAMPLES` float32 samples of each op, as ``tests/opinfo_harness.py`` makes
them on cpu, moved to the device) and the public models of the test suite
(``tests/zoo.py``; ``tests/model_matrix.py``'s families as made).

Then the fake cuda device of this package, which never makes a cuda tensor (it
traces on fake meta tensors and its router sends the calls CUDA dispatch resolves
differently to the CUDA kernels' ops, ``engine/tracing/devices/cuda/router.py``),
runs each sample that has a branch through ``estimate(device="cuda")``, its ops
and the routes that handled a call recorded, and its **verdict** is read against
torch's branch: it *agrees* when it ran every op only fake cuda ran and none of
those only fake cpu ran (per phase, as sets of op names), else it *disagrees*;
where the reference itself cannot follow the GPU (the call asks the CUDA driver:
cuDNN's grid sampler, CTC loss, the attention backend's choice) the verdict is
the reference's limit, not the router's (:data:`REFERENCE_LIMITS`).

Noise, filtered before comparing (each a difference of how the reference is run,
not a branch of the GPU):

* ``prim.device`` (asked constantly by autograd; it runs nothing);
* **a host scalar's copy**: a ``_to_copy`` / ``copy_`` of a 0-dimensional CPU
  tensor onto the device (the masked reductions' and ``where``'s scalar
  operands, which a cuda kernel takes from the host; no branch of the op);
* in the backward, ``clone``: the backward runs by hand
  (``tests/hand_backward.py``: autograd's engine refuses fake cuda tensors on a
  build without a GPU), and a node whose saved tensors the engine would release
  before calling it (cuDNN batch norm's reserve) clones them instead.

``benchmarks/device_audit.py`` runs it and writes the table for the running
release (``tests/data/device_audit/<release>.json``, rendered in
``docs/reference/device-audit.md``); ``tests/test_cuda_device_audit.py`` checks a
release against its table.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hand_backward import backward_by_hand
from opinfo_harness import OpCallModule, _split, _usable, op_function, op_infos, op_name, samples_of, sum_of_outputs

__all__ = [
    "DATA",
    "PHASES",
    "KNOWN_DISAGREEMENTS",
    "REFERENCE_LIMITS",
    "ROUTE_TESTS",
    "SAMPLES",
    "Subject",
    "audit",
    "branch_of",
    "emulate",
    "is_cuda_build",
    "load_table",
    "model_subjects",
    "op_subjects",
    "reference",
    "verdict",
]

SCHEMA: Final = 1
#: Where each release's table is committed.
DATA: Final = Path(__file__).parent / "data" / "device_audit"
#: OpInfo samples per op, float32 (the first ones ``sample_inputs("cpu")`` makes, seeded).
SAMPLES: Final = 3
PHASES: Final = ("forward", "backward")

aten = torch.ops.aten
_PRIM_DEVICE: Final = torch.ops.prim.device.default
_COPIES: Final = (aten._to_copy.default, aten.copy_.default)
#: " at <file>:<line>:" of an ``unsupported`` entry.
_WHERE: Final = re.compile(r" at \S+:\d+:")
#: Ops the backward by hand adds (see the module's docstring), not compared there.
_HAND_BACKWARD: Final = frozenset({"aten.clone.default"})

#: Why the reference (a CUDA build without a GPU) cannot show the GPU's branch of an op:
#: words of the error of either run (fake cuda, or fake cpu where the branch is the
#: CPU's), and the reason. A branch whose fake cuda run
#: failed so is the reference's limit, not a finding about the router.
REFERENCE_LIMITS: Final = {
    "Found no NVIDIA driver": "the GPU's branch asks the CUDA driver (a cuDNN handle, the device's properties), which a machine without a GPU has not",
    "CUDA driver version is insufficient": "the GPU's branch calls the CUDA runtime (a cuDNN RNN, batch norm's update kernel), which a machine without a GPU has not",
    "hasPrimaryContext": "autograd's engine refuses fake cuda tensors without a GPU",
    # OpInfo's samples are made on cpu and moved to the device whole: a tensor a GPU run
    # keeps on the host (an index list, a length) is on the device in the reference
    "to be on cpu, but it's on cuda": "the sample's host tensor (an index or a length a GPU run keeps on the CPU) was moved to the device with the rest",
    "DataDependentOutputException": "the branch reads a tensor's values (a host scalar moved to the device, or a check of the CPU's kernel), which a fake tensor has not",
    "DynamicOutputShapeException": "the branch's output shape depends on a tensor's values, which a fake tensor has not",
}

#: Disagreements found by the audit and not fixed: op (or model) -> why the fake cuda
#: device takes another path than torch's GPU branch there, and what it costs. The
#: test fails on a disagreement not listed here, and on one listed that agrees now.
KNOWN_DISAGREEMENTS: Final = {
    "renorm": (
        "renorm's backward (FunctionsManual.cpp, renorm_backward) computes its norm in "
        "toAccumulateType(dtype, device): float32 on CUDA, float64 on the trace's meta "
        "tensors as on the CPU; the fake cuda device runs the float64 path (a float64 "
        "input-sized temporary and a copy back): an autograd node's C++ body, which the "
        "router (a torch-function mode) does not see"
    ),
    "__getitem__": (
        "indexing a GPU tensor with a Python list copies the index tensor made on the host "
        "to the device (make_info: indices on self's device); on the trace's meta tensors "
        "fake mode indexes with the host index, so the copy (a few bytes, one 512-byte "
        "block) is not charged"
    ),
}

#: The test that checks each route of the router (engine/tracing/devices/cuda/), by the
#: handler's qualified name.
ROUTE_TESTS: Final = {
    "autocast._cross_entropy": "tests/test_cuda_routing.py::test_autocast_cross_entropy_computes_log_softmax_in_half",
    "kernel_choices._batch_norm": "tests/test_cuda_routing.py::test_batch_norm_takes_cudnn_when_it_may",
    "kernel_choices._dropout": "tests/test_cuda_routing.py::test_dropout_takes_the_fused_kernel_with_a_bool_mask",
    "kernel_choices._instance_norm": "tests/test_cuda_routing.py::test_instance_norm_with_affine_parameters_goes_through_cudnn_batch_norm",
    "kernel_choices._softmax_handler.<locals>.handler": "tests/test_cuda_routing.py::test_autocast_fp32_ops_and_softmax_dtype",
    "placement._from_data": "tests/test_cuda_routing.py::test_a_tensor_made_on_the_gpu_from_python_data_is_counted",
    "placement._setitem": "tests/test_same_program.py::test_on_a_cuda_build_the_fake_gpus_forward_dispatches_torchs_own_fake_cuda_ops",
    "placement._tensor_cuda": "tests/test_cuda_device.py::test_the_process_survives_autograd_on_the_fake_cuda_device",
    "placement._tensor_to": "tests/test_cuda_routing.py::test_a_tensor_made_on_the_gpu_from_a_tensor_is_a_copy_of_it",
    "rms_norm._rms_norm": "tests/test_cuda_rms_norm.py::test_which_inputs_take_the_fused_kernel",
    "rnn._gru_cell": "tests/test_cuda_routing.py::test_rnn_cells_use_the_fused_cuda_kernels",
    "rnn._lstm_cell": "tests/test_cuda_routing.py::test_rnn_cells_use_the_fused_cuda_kernels",
    "rnn._rnn_handler.<locals>.handler": "tests/test_cuda_routing.py::test_lstm_runs_cudnn_rnn",
    "sdpa._sdpa": "tests/test_cuda_routing.py::test_sdpa_backend_priority_by_architecture",
}


def is_cuda_build() -> bool:
    """Whether this torch is a CUDA build (the reference needs one: on a CPU-only build
    autograd on a fake cuda tensor aborts the process)."""
    return torch.version.cuda is not None and torch.backends.cuda.is_built()


# -- what a sample dispatches ---------------------------------------------------------------


def _host_scalar_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A 0-dimensional CPU tensor copied onto another device (noise: see the docstring)."""
    if func not in _COPIES or not args or not isinstance(args[0], torch.Tensor):
        return False
    if func is aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
        return source.dim() == 0 and source.device.type == "cpu" and target is not None and torch.device(target).type != "cpu"
    source = args[1] if len(args) > 1 else None
    return (
        isinstance(source, torch.Tensor) and source.dim() == 0 and source.device.type == "cpu"
        and args[0].device.type != "cpu"
    )


class OpLog(TorchDispatchMode):
    """Records the name of each aten op dispatched below it, noise left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is not _PRIM_DEVICE and not _host_scalar_copy(func, args, kwargs):
            self.ops.append(str(func))
        return func(*args, **kwargs)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _floats(output: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


def model_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when it is a scalar tensor, else the sum of the floating outputs
    that require grad (as ``estimate``'s default, given to both sides explicitly)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    return sum_of_outputs(output)


@dataclass(frozen=True)
class Subject:
    """One thing the audit runs: an OpInfo sample or a public model's step.

    ``make()`` gives ``(call, args, kwargs, loss)``: the callable (a module), its
    tensors' arguments (real CPU tensors, the leaves that require grad among them),
    and the loss of its output (None: forward only)."""

    name: str
    sample: str
    make: Callable[[], tuple[Any, tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor] | None]]


def _fake_args(mode: Any, value: Any, device: str) -> Any:
    """``value`` with every tensor a fake tensor on ``device`` (a leaf, requiring grad as it did)."""
    from torch.utils._pytree import tree_map_only

    def convert(t: torch.Tensor) -> torch.Tensor:
        fake = mode.from_tensor(t.detach())
        with mode:
            fake = fake.to(device)
        return fake.requires_grad_(t.requires_grad) if t.requires_grad and t.is_floating_point() else fake

    return tree_map_only(torch.Tensor, convert, value)


def reference(subject: Subject, device: str) -> dict[str, Any]:
    """The ops ``subject`` dispatches per phase on torch's fake ``device`` (``cuda``: a
    CUDA build only), and where it failed, if it did (the ops up to the failure kept)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    call, args, kwargs, loss_fn = subject.make()
    found: dict[str, Any] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    state = {
        name: _fake_args(mode, t, device)
        for name, t in [*call.named_parameters(), *call.named_buffers()]
    }
    args, kwargs = _fake_args(mode, (args, kwargs), device)
    with mode:
        log = OpLog()
        try:
            with log:
                output = functional_call(call, state, args, kwargs)
                loss = loss_fn(output) if loss_fn is not None else None
        except Exception as exc:  # noqa: BLE001 - where the reference stops is recorded
            found["forward"] = log.ops
            found["error"] = {"phase": "forward", "error": _describe(exc)}
            return found
        found["forward"] = log.ops
        del output
        if loss is None or not loss.requires_grad:
            return found
        log = OpLog()
        try:
            with log:
                backward_by_hand(loss)
        except Exception as exc:  # noqa: BLE001
            found["error"] = {"phase": "backward", "error": _describe(exc)}
        found["backward"] = [op for op in log.ops if op not in _HAND_BACKWARD]
    return found


def branch_of(cpu: dict[str, Any], cuda: dict[str, Any]) -> dict[str, Any] | None:
    """Per phase, the ops fake cuda ran more often than fake cpu and the reverse (op ->
    count: ``cpu``, ``cuda``), and the ops only one of them ran at all (``only cpu``,
    ``only cuda``: what the verdict compares); None when they dispatched the same ops
    and failed (or not) alike."""
    found: dict[str, Any] = {}
    for phase in PHASES:
        c, g = Counter(cpu.get(phase, [])), Counter(cuda.get(phase, []))
        if c != g:
            found[phase] = {
                "cpu": dict(sorted((c - g).items())),
                "cuda": dict(sorted((g - c).items())),
                "only cpu": sorted(set(c) - set(g)),
                "only cuda": sorted(set(g) - set(c)),
            }
    errors = cpu.get("error"), cuda.get("error")
    if errors[0] != errors[1]:
        found["errors"] = {"cpu": errors[0], "cuda": errors[1]}
    return found or None


# -- what the fake cuda device does -----------------------------------------------------------


@contextlib.contextmanager
def _recording() -> Iterator[dict[str, Any]]:
    """While active, each op the tracker dispatches is recorded with its phase, and each
    route of the cuda router that handles a call by its handler's name."""
    from pytest_torchmem.engine.tracing.devices.cuda.routes import ROUTES
    from pytest_torchmem.engine.tracing.tracker import Tracker

    record: dict[str, Any] = {"forward": [], "backward": [], "routes": set()}
    dispatch = Tracker.__torch_dispatch__
    names = ("forward", "backward", "step")

    def logged(self: Any, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        phase = getattr(self, "phase", None)
        if phase is not None and int(phase) < 2 and func is not _PRIM_DEVICE and not _host_scalar_copy(func, args, kwargs or {}):
            record[names[int(phase)]].append(str(func))
        return dispatch(self, func, types, args, kwargs)

    def noted(handler: Any) -> Any:
        name = f"{handler.__module__.rsplit('.', 1)[-1]}.{handler.__qualname__}"

        def route(*a: Any, **k: Any) -> Any:
            record["routes"].add(name)
            return handler(*a, **k)

        return route

    with mock.patch.object(Tracker, "__torch_dispatch__", logged), mock.patch.dict(
        ROUTES, {func: noted(handler) for func, handler in ROUTES.items()}
    ):
        yield record


def emulate(subject: Subject) -> dict[str, Any]:
    """The ops ``subject`` dispatches per phase in ``estimate(device="cuda")``, the routes
    that handled its calls and the estimate's ``unsupported`` entries."""
    import pytest_torchmem as tm

    call, args, kwargs, loss_fn = subject.make()
    options: dict[str, Any] = {"train": loss_fn is not None}
    if loss_fn is not None:
        options["loss_fn"] = loss_fn
    inputs: Any = kwargs if kwargs else args
    found: dict[str, Any] = {}
    with _recording() as record, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            try:
                report = tm.estimate(call, inputs, device="cuda", **options)
            except tm.TraceStopped as stopped:
                report = stopped.report
            # (without where in the sample's code each was met: a path of this machine)
            found["unsupported"] = [_WHERE.sub(":", str(u), count=1) for u in report.unsupported]
        except Exception as exc:  # noqa: BLE001 - a tracer failure is a finding
            found["error"] = _describe(exc)
    found["forward"], found["backward"] = record["forward"], record["backward"]
    found["routes"] = sorted(record["routes"])
    return found


def verdict(branch: dict[str, Any], emulated: dict[str, Any]) -> dict[str, Any]:
    """The fake cuda device against torch's branch.

    ``agrees``: in each phase it ran every op only fake cuda ran and none of those only
    fake cpu ran; ``disagrees`` (with the ops it ``missed`` and the cpu ops it ran,
    ``extra``); ``listed`` where it disagrees but its estimate lists ``unsupported``
    entries; ``reference limit`` where the reference cannot show the GPU's branch
    (:data:`REFERENCE_LIMITS`, :func:`reference_fallback`); ``counts`` where the two
    references ran the same ops, some more often (not judged)."""
    result: dict[str, Any] = {"routes": emulated.get("routes", [])}
    if emulated.get("unsupported"):
        result["unsupported"] = emulated["unsupported"]
    errors = branch.get("errors", {})
    limit = (
        _reference_limit((errors.get("cuda") or {}).get("error", ""))
        or _reference_limit((errors.get("cpu") or {}).get("error", ""))
        or reference_fallback(branch, emulated)
    )
    if limit:
        result.update(verdict="reference limit", why=limit)
        return result
    if emulated.get("error"):
        result.update(verdict="disagrees", why=f"estimate raised {emulated['error']}")
        return result
    missing: dict[str, list[str]] = {}
    extra: dict[str, list[str]] = {}
    judged = False
    for phase in PHASES:
        if phase not in branch:
            continue
        ran = set(emulated.get(phase, []))
        gpu, cpu = set(branch[phase]["only cuda"]), set(branch[phase]["only cpu"])
        judged = judged or bool(gpu or cpu)
        if gpu - ran:
            missing[phase] = sorted(gpu - ran)
        if cpu & ran:
            extra[phase] = sorted(cpu & ran)
    if not judged and "errors" not in branch:
        result["verdict"] = "counts"
    elif not missing and not extra and "errors" not in branch:
        result["verdict"] = "agrees"
    else:
        result.update(verdict="listed" if emulated.get("unsupported") else "disagrees", missing=missing, extra=extra)
    return result


_SDPA_CPU: Final = "aten._scaled_dot_product_flash_attention_for_cpu.default"
#: What the CUDA attention kernels' ops are named by (flash, efficient, cuDNN).
_ATTENTION_KERNEL: Final = "aten._scaled_dot_product_"


def reference_fallback(branch: dict[str, Any], emulated: dict[str, Any]) -> str:
    """Why the reference's branch is not the GPU's where it is not ('' where it is).

    Scaled-dot-product attention: ``sdp::select_sdp_backend`` reads the device's
    capability, so without a GPU every fused backend is refused and fake cuda runs
    the math composite where fake cpu runs its flash kernel; the fake cuda device
    picks the backend the profile's GPU and the inputs allow (``sdpa.py``). Where
    that is a CUDA attention kernel the reference cannot judge it; where it is the
    math path too, the two are compared as any other branch."""
    forward = branch.get("forward", {})
    if _SDPA_CPU in forward.get("only cpu", []) and not any("_scaled_dot_product" in op for op in forward.get("only cuda", [])):
        kernels = sorted({op for op in emulated.get("forward", []) if _ATTENTION_KERNEL in op})
        if kernels:
            return (
                "without a GPU torch's attention backend check refuses every fused kernel (it reads the "
                "device's capability) and runs the math path; the fake cuda device runs the profile's "
                f"GPU's choice: {', '.join(kernels)}"
            )
    return ""


def _reference_limit(error: str) -> str:
    for words, why in REFERENCE_LIMITS.items():
        if words in error:
            return why
    return ""


# -- the subjects ---------------------------------------------------------------------------


def _op_subject(op: Any, index: int, sample: Any) -> Subject | None:
    tensors: list[torch.Tensor] = []
    structure = _split((sample.input, list(sample.args), dict(sample.kwargs)), tensors)
    if any(_usable(t) for t in tensors):
        return None
    fn = op_function(op)
    shapes = ", ".join(str(tuple(t.shape)) for t in tensors)

    def make() -> tuple[Any, tuple[Any, ...], dict[str, Any], Any]:
        module = OpCallModule(fn, structure)
        copies = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)
        return module, copies, {}, sum_of_outputs if _trains(module, copies) else None

    return Subject(op_name(op), f"{index}: {shapes}", make)


def _trains(module: Any, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether the real op on CPU gives a floating output that requires grad."""
    try:
        return bool(_floats(module(*tensors)))
    except Exception:  # noqa: BLE001 - the sample's own failure shows in both references
        return False


def op_subjects(names: set[str] | None = None, limit: int = SAMPLES) -> Iterator[Subject]:
    """OpInfo's samples (float32, the first ``limit`` of each op), of the ops ``names``."""
    for op in op_infos():
        name = op_name(op)
        if names is not None and name not in names:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = list(samples_of(op, torch.float32, limit))
        except Exception:  # noqa: BLE001 - OpInfo's own sample generation failed
            continue
        for index, sample in enumerate(samples):
            subject = _op_subject(op, index, sample)
            if subject is not None:
                yield subject


def model_subjects(names: set[str] | None = None, matrix: bool = True) -> Iterator[Subject]:
    """The public models: tests/zoo.py's cases (their loss; forward only where they do
    not train) and, with ``matrix``, tests/model_matrix.py's families as made."""
    import zoo

    for case in zoo.CASES:
        name = f"zoo:{case.name}"
        if names is not None and name not in names:
            continue
        if case.options.get("optimizer") is not None or case.name in ("autocast", "bf16"):
            continue  # the step and autocast regions are not the audit's (ops of the model)

        def make(case: Any = case) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any]:
            model, x = case.make()
            args = x if isinstance(x, tuple) else (x,)
            train = case.options.get("train", True)
            if not train:
                model.eval()
            return model, args, {}, (case.options.get("loss_fn") or model_loss) if train else None

        yield Subject(name, "the zoo's batch", make)
    if not matrix:
        return
    try:
        import model_matrix
    except ImportError:
        return
    for family in model_matrix.FAMILIES:
        name = f"model_matrix:{family}"
        if names is not None and name not in names:
            continue

        def make_family(family: str = family) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any]:
            model, batch, _ = model_matrix.made(family, "as made")
            if isinstance(batch, dict) and set(batch) == {"x"}:
                return model, (batch["x"],), {}, model_matrix.loss_of
            return model, (), dict(batch), model_matrix.loss_of

        yield Subject(name, "as made", make_family)


# -- the audit ------------------------------------------------------------------------------


def audit(subjects: Iterator[Subject], *, judge: bool = True, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Each subject on fake cpu and fake cuda; for each that branches, the fake cuda
    device's verdict (with ``judge``). A CUDA build only."""
    if not is_cuda_build():
        raise RuntimeError("the device audit needs a CUDA build of torch (see tests/device_audit.py)")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    count = 0
    alike: Counter[str] = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for subject in subjects:
            count += 1
            cpu, cuda = reference(subject, "cpu"), reference(subject, "cuda")
            branch = branch_of(cpu, cuda)
            if branch is None:
                if cpu.get("error"):
                    # failed alike on both devices: what it did not reach is not compared
                    alike[f"{cpu['error']['phase']}: {cpu['error']['error'][:120]}"] += 1
                continue
            row: dict[str, Any] = {"name": subject.name, "sample": subject.sample, **branch}
            if judge:
                row.update(verdict(branch, emulate(subject)))
            rows.append(row)
            if progress is not None:
                progress(f"{subject.name} [{subject.sample}]: {row.get('verdict', 'branch')}")
    return {
        "schema": SCHEMA,
        "torch": torch.__version__,
        "subjects": count,
        "seconds": round(time.perf_counter() - started, 1),
        # the commonest errors of samples that failed alike on both devices
        "failed alike": dict(alike.most_common(8)),
        "failed alike count": sum(alike.values()),
        "rows": rows,
    }


def table_path(release: str) -> Path:
    return DATA / f"{release}.json"


def load_table(release: str) -> dict[str, Any] | None:
    path = table_path(release)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def row_key(row: dict[str, Any]) -> tuple[str, str]:
    return row["name"], row["sample"]


def branch_signature(row: dict[str, Any]) -> dict[str, Any]:
    """What a row says of torch (its branch), without the fake cuda device's verdict:
    the ops only one device ran, per phase, and the errors' types."""
    found: dict[str, Any] = {
        phase: {side: row[phase][side] for side in ("only cpu", "only cuda")} for phase in PHASES if phase in row
    }
    if "errors" in row:
        found["errors"] = {
            side: None if error is None else (error["phase"], error["error"].split(":")[0])
            for side, error in row["errors"].items()
        }
    return found
