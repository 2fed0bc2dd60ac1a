"""CUDA routing: real fake-``cuda`` dispatch (a CUDA build of torch) against the CPU-only emulation.

``estimate(device="cuda")`` never creates a ``cuda`` tensor: it traces on fake
meta tensors and its router sends the calls that CUDA dispatch resolves
differently (dropout, batch norm, the attention backend, RNNs, ...) to the
CUDA kernels' ops. This script checks those decisions against what a CUDA
build of torch dispatches for fake tensors that really are on ``cuda``, for
every model of the zoo (``tests/zoo.py``), op by op::

    # once: a CUDA build of torch in a virtual environment outside the repository
    python3 -m venv /work/venv-cuda
    /work/venv-cuda/bin/pip install torch==2.14.1 tabulate numpy
    /work/venv-cuda/bin/pip install -e /work/main --no-deps

    # record the reference traces with the CUDA build, then compare with the emulation
    /work/venv-cuda/bin/python benchmarks/cuda_routing.py record --out /tmp/ref.json
    python benchmarks/cuda_routing.py compare /tmp/ref.json [--json findings.json]
    # or both at once (run with the project's interpreter); --extra adds the x_* models
    python benchmarks/cuda_routing.py all --cuda-python /work/venv-cuda/bin/python [--extra] [--json F]
    # how far a backward by hand is from autograd's engine (any torch, emulation side)
    python benchmarks/cuda_routing.py check-hand [--extra]

``record`` (CUDA build only) runs each model in its own process (a crash in
C++ costs one model, not the run) and records, per phase, the aten ops that
dispatch produced with their outputs (shape, dtype, device, storage bytes,
whether the storage is new) and every failure with its error. The step goes
through the project's own tracer (``trace``, its tracker wrapped to log
each op, as ``benchmarks/kernel_diff.py`` does) with a device model whose
trace device is ``cuda:0`` itself: no router, no implementation rules, the
CUDA scratch rules and the caching-allocator model kept so that the byte
figures read like ``estimate``'s. What a CUDA build without a GPU cannot do
is worked around where that leaves dispatch's decisions intact, and said so
in the output:

* autograd's engine refuses cuda tensors ("hasPrimaryContext expects a valid
  device index"): the backward runs *by hand*, each autograd node called from
  Python in the engine's order. The ops are the backward formulas CUDA
  dispatch picks; live bytes are not the engine's (saved tensors are kept to
  the end), so only the bytes the ops allocate are compared there.
  ``check-hand`` measures the method against the engine on the emulation: the
  same ops and bytes, but for a clone of the cuDNN batch-norm / RNN reserve
  (``retain_variables``: the engine releases a node's variables before
  calling it, Python cannot) and for checkpointing (no graph task: the
  non-reentrant kind recomputes per unpack, the reentrant kind calls the
  engine and fails). Where the backward fails, the optimizer step is probed
  alone, the parameters given fake gradients.
* ``torch.autocast("cuda")`` disables itself without a GPU: the extra autocast
  models enter it through the functions ``torch.autocast`` calls.
* torch.optim's foreach default rejects fake tensors: the reference takes the
  emulation's optimizer defaults (foreach), as a GPU would pick.

The record also holds the emulation traced under the same torch, to tell
routing differences from differences between torch versions.

``compare`` (any torch) traces the same models with ``estimate(device="cuda")``
and aligns the two op sequences per phase (views left out unless
``--all-ops``): every block that differs is a routing decision, classified as
a gap in the emulation or as a limitation of the reference (a CUDA build
without a GPU cannot choose the attention backend, for one); ops that agree
but whose outputs differ, or come in another order, are listed too. Byte
figures per phase are compared where both ran.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import torch
from torch import nn

from hand_backward import backward_by_hand

SCHEMA: Final = 1
PHASES: Final = ("forward", "backward", "step")
#: Seconds one model may take to record (in its own process).
CASE_TIMEOUT: Final = 600


# -- extra models: routing decisions the zoo does not reach ---------------------------


#: Set while the reference is traced: see :func:`_cuda_autocast`.
_REFERENCE_AUTOCAST: list[bool] = [False]


@contextmanager
def _cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast("cuda", dtype)``; for the reference on a machine without a GPU,
    the same state set through the functions ``torch.autocast`` itself calls.

    ``torch.autocast.__init__`` disables itself when ``torch.cuda.is_available()``
    is false ("CUDA is not available ... Disabling autocast"), so without a GPU
    the CUDA build would trace no autocast at all; the C++ autocast kernels
    (the AutocastCUDA dispatch key of the fake cuda tensors) run all the same.
    """
    if not (_REFERENCE_AUTOCAST[0] and not torch.cuda.is_available()):
        with torch.autocast("cuda", dtype=dtype):
            yield
        return
    prev = torch.is_autocast_enabled("cuda")
    prev_dtype = torch.get_autocast_dtype("cuda")
    prev_cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", prev)
        torch.set_autocast_dtype("cuda", prev_dtype)
        torch.set_autocast_cache_enabled(prev_cache)


class _AutocastCuda(nn.Module):
    """The zoo's ``autocast`` case autocasts on ``cpu``; this one on ``cuda``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _cuda_autocast(self.dtype):
            return self.body(x).float()


def _extra_cases() -> list[Any]:
    from zoo import Case, cnn_bn, lstm, mlp

    def cnn_bn_half() -> tuple[nn.Module, Any]:
        model, x = cnn_bn()
        return model.half(), x.half()

    def cnn_bn_bf16() -> tuple[nn.Module, Any]:
        model, x = cnn_bn()
        return model.to(torch.bfloat16), x.to(torch.bfloat16)

    def mlp_half() -> tuple[nn.Module, Any]:
        model, x = mlp()
        return model.half(), x.half()

    def attention_half() -> tuple[nn.Module, Any]:
        from zoo import Attention

        return Attention(fused=True).half(), torch.randn(4, 32, 64).half()

    def lstm_half() -> tuple[nn.Module, Any]:
        model, x = lstm()
        return model.half(), x.half()

    def cnn_bn_eval() -> tuple[nn.Module, Any]:
        model, x = cnn_bn()
        return model.eval(), x

    def lstm_eval() -> tuple[nn.Module, Any]:
        model, x = lstm()
        return model.eval(), x

    def first(out: Any) -> torch.Tensor:
        return out[0].sum()

    return [
        Case("x_cnn_bn_eval", cnn_bn_eval, {"train": False}),
        Case("x_cnn_bn_half", cnn_bn_half),
        Case("x_cnn_bn_bf16", cnn_bn_bf16),
        Case("x_dropout_half", mlp_half),
        Case("x_attention_half", attention_half),
        Case("x_lstm_half", lstm_half, {"loss_fn": first}),
        Case("x_lstm_eval", lstm_eval, {"loss_fn": first, "train": False}),
        Case("x_autocast_cuda_bf16", lambda: (_AutocastCuda(torch.bfloat16), torch.randn(32, 64))),
        Case("x_autocast_cuda_fp16", lambda: (_AutocastCuda(torch.float16), torch.randn(32, 64))),
    ]


def all_cases(extra: bool) -> list[Any]:
    from zoo import CASES

    return list(CASES) + (_extra_cases() if extra else [])


def select_cases(names: list[str], extra: bool) -> list[Any]:
    cases = all_cases(extra or any(name.startswith("x_") for name in names))
    if not names:
        return cases
    known = {case.name: case for case in cases}
    missing = [name for name in names if name not in known]
    if missing:
        raise SystemExit(f"unknown case(s): {', '.join(missing)}; known: {', '.join(known)}")
    return [known[name] for name in names]


# -- the op log -------------------------------------------------------------------------


def _phase_name(phase: Any) -> str:
    return "outside" if phase is None else PHASES[int(phase)]


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _logging_tracker_class() -> type:
    """A :class:`Tracker` that also logs each op it dispatches (made lazily: the
    import is the project's)."""
    from pytest_torchmem.engine.figures.report import Category
    from pytest_torchmem.engine.tracing import tracker as tracker_module

    prim_device = torch.ops.prim.device.default

    class LoggingTracker(tracker_module.Tracker):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.ops: list[dict[str, Any]] = []
            self.baseline: list[int] = []
            self.raised: list[dict[str, Any]] = []
            self._tracing = False

        def adopt(self, t: torch.Tensor, category: Any) -> int | None:
            sid = super().adopt(t, category)
            # Storages adopted before the first op are the step's baseline (as in
            # trace); later ones are foreign tensors, never charged.
            if sid is not None and not self._tracing and sid not in self.baseline:
                self.baseline.append(sid)
            return sid

        def set_phase(self, phase: Any) -> None:
            self._tracing = True
            super().set_phase(phase)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is prim_device:
                return super().__torch_dispatch__(func, types, args, kwargs)
            self._tracing = True
            start = len(self.timeline.events)
            phase = _phase_name(self.phase)
            module = self.module
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            except BaseException as exc:
                # Not necessarily a failure of the step: callers may catch it. Kept
                # by id only (a traceback would keep the trace's tensors alive).
                self.raised.append(
                    {"id": id(exc), "phase": phase, "op": str(func), "error": _describe(exc),
                     "aborted": type(exc).__name__ == "TraceAborted"}
                )
                self.ops.append(
                    {"op": str(func), "phase": phase, "module": module, "view": _is_view(func),
                     "outs": [], "ws": 0, "failed": _describe(exc)}
                )
                raise
            new: set[int] = set()
            workspace = 0
            for kind, sid, nbytes in self.timeline.events[start:]:
                if kind in (0, 2):  # ALLOC, RESIZE
                    if self.timeline.storages[sid].category == Category.WORKSPACE:
                        workspace += nbytes
                    else:
                        new.add(sid)
            outs = []
            for t in _tensors(out):
                try:
                    nbytes = t.untyped_storage().nbytes()
                except (RuntimeError, NotImplementedError):
                    nbytes = -1
                sid = self.storage_id(t)
                outs.append(
                    [list(t.shape), str(t.dtype).replace("torch.", ""),
                     "dev" if t.device == self.device else t.device.type, nbytes,
                     sid is not None and sid in new]
                )
            record: dict[str, Any] = {
                "op": str(func), "phase": phase, "module": module, "view": _is_view(func),
                "outs": outs, "ws": workspace,
            }
            if self.rules.implementation_rule(func) is not None:
                record["impl"] = True
            self.ops.append(record)
            return out

    return LoggingTracker


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


@contextmanager
def _logging_trace() -> Iterator[list[Any]]:
    """While active, every ``trace`` uses a logging tracker; yields the trackers made."""
    from pytest_torchmem.engine.tracing import trace

    made: list[Any] = []
    cls = _logging_tracker_class()

    def factory(*args: Any, **kwargs: Any) -> Any:
        tracker = cls(*args, **kwargs)
        made.append(tracker)
        return tracker

    original = trace.Tracker
    trace.Tracker = factory  # type: ignore[assignment, misc]
    try:
        yield made
    finally:
        trace.Tracker = original  # type: ignore[misc]


def _metrics(tracker: Any, allocator: Any) -> dict[str, dict[str, int]]:
    """Per phase: bytes allocated by ops (``allocated``; ``workspace`` of them by the
    CUDA rules' workspaces), live bytes at its start, its peak (storage bytes) and
    its peak through the caching-allocator model (block bytes)."""
    from pytest_torchmem.engine.figures.report import Category
    from pytest_torchmem.engine.figures.timeline import ALLOC, FREE, PHASE, RESIZE, analyze

    timeline = tracker.timeline
    size = {sid: timeline.storages[sid].nbytes for sid in tracker.baseline}
    live = sum(size.values())
    found: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for kind, a, b in timeline.events:
        if kind == ALLOC or kind == RESIZE:
            if kind == ALLOC and a in size:
                continue
            old = size.get(a, 0)
            size[a] = b
            live += b
            if current is not None:
                current["allocated"] += b
                if timeline.storages[a].category == Category.WORKSPACE:
                    current["workspace"] += b
                current["peak"] = max(current["peak"], live)
            live -= old
        elif kind == FREE:
            live -= size.pop(a, 0)
        elif kind == PHASE:
            current = None
            if a >= 0:
                current = found.setdefault(
                    PHASES[a], {"allocated": 0, "workspace": 0, "start": live, "peak": live}
                )
    peaks = analyze(timeline, list(tracker.baseline), allocator).phase_peaks
    for name, figures in found.items():
        figures["rise"] = figures["peak"] - figures["start"]
        figures["outputs"] = figures["allocated"] - figures["workspace"]
        figures["peak_blocks"] = peaks[PHASES.index(name)]
    return found


def _phase_status(options: dict[str, Any], failure: dict[str, Any] | None, aborted: bool) -> dict[str, str]:
    wanted = ["forward"]
    if options.get("train", True):
        wanted.append("backward")
        if options.get("optimizer") is not None:
            wanted.append("step")
    status = {phase: ("ok" if phase in wanted else "n/a") for phase in PHASES}
    if failure is not None:
        where = failure["phase"]
        if where == "outside":
            where = "forward"
        bad = False
        for phase in wanted:
            if phase == where:
                status[phase] = "aborted" if aborted else "failed"
                bad = True
            elif bad:
                status[phase] = "not reached"
    return status


def trace_case(case: Any, device: Any, *, gpu: str | None = None) -> dict[str, Any]:
    """One step of ``case`` through the project's tracer on ``device`` (a DeviceModel), logged."""
    from pytest_torchmem.engine.step.request import step_request
    from pytest_torchmem.engine.figures.stopped import TraceStopped
    from pytest_torchmem.engine.tracing.devices.cuda import caching_allocator
    from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
    from pytest_torchmem.engine.tracing.rules import TraceContext
    from pytest_torchmem.engine.tracing.trace import trace

    model, inputs = case.make()
    options = dict(case.options)
    request = step_request(
        "estimate", model, inputs, "cuda", options.get("loss_fn"), options.get("optimizer"),
        options.get("train", True),
    )
    report = None
    error = None
    with _logging_trace() as made, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.perf_counter()
        try:
            report = trace(
                request.model, request.args, request.kwargs, device=device,
                loss_fn=request.loss_fn, optimizer=request.optimizer, train=request.train,
                gpu=gpu_profile(gpu),
            ).report
        except TraceStopped as stopped:  # the step's partial report: where it stopped is logged
            report = stopped.report
        except Exception as exc:  # noqa: BLE001 - the reference's failures are findings
            error = exc
        seconds = time.perf_counter() - started
    if not made:
        raise RuntimeError(f"no tracker was made ({_describe(error) if error else 'no error'})")
    tracker = made[0]
    failure = _failure(tracker, error)
    aborted = failure is not None and error is None
    result: dict[str, Any] = {
        "status": _phase_status(options, failure, aborted),
        "failure": failure,
        "ops": tracker.ops,
        "modules": _module_labels(request.model, tracker.timeline.module_names),
        "metrics": _metrics(tracker, caching_allocator(TraceContext("cuda"))),
        "warnings": _warnings(caught),
        "seconds": round(seconds, 3),
        "unsupported": [_unsupported(u) for u in tracker.unsupported],
    }
    if report is not None:
        result["report"] = report.phase_peaks()
    rule_errors = getattr(device.rules, "errors", None)
    if rule_errors:
        result["rule_errors"] = list(rule_errors)
    return result


def _failure(tracker: Any, error: BaseException | None) -> dict[str, Any] | None:
    """Where the step stopped: the op that raised ``error`` (or the op the tracer
    gave up on), or, for an error raised between ops, the phase it was in."""
    if error is None:
        stopped = [r for r in tracker.raised if r["aborted"]]
        return {k: stopped[-1][k] for k in ("phase", "op", "error")} if stopped else None
    tracker.set_phase(None)
    chain = []
    cause: BaseException | None = error
    while cause is not None and len(chain) < 8:
        chain.append(id(cause))
        cause = cause.__cause__ or cause.__context__
    for r in reversed(tracker.raised):
        if r["id"] in chain:
            return {"phase": r["phase"], "op": r["op"], "error": _describe(error), "where": _where(error)}
    # raised between ops: autograd's engine, Python code of the model or of torch
    return {"phase": _phase_name(_last_phase(tracker)), "op": None, "error": _describe(error),
            "where": _where(error)}


def _module_labels(model: nn.Module, names: list[str]) -> list[str]:
    """``name (Class)`` for each module index of the trace (ModuleTracker's order)."""
    kinds: list[str] = []
    seen: set[int] = set()
    for _, module in model.named_modules():
        if id(module) not in seen:
            seen.add(id(module))
            kinds.append(type(module).__name__)
    if len(kinds) != len(names):
        return list(names)
    return [f"{name} ({kind})" for name, kind in zip(names, kinds)]


def _unsupported(entry: Any) -> str:
    """An ``unsupported`` entry without its location (here always this script's
    logging frame, which the tracker takes for user code)."""
    return f"{entry.op}: {entry.reason}" if hasattr(entry, "reason") else str(entry)


def _last_phase(tracker: Any) -> Any:
    """The phase the step was in when it stopped: the last phase event before the end."""
    from pytest_torchmem.engine.figures.timeline import PHASE, Phase

    phases = [a for kind, a, _ in tracker.timeline.events if kind == PHASE and a >= 0]
    return Phase(phases[-1]) if phases else None


def _where(exc: BaseException) -> str:
    """The innermost frames of the traceback outside this file, short."""
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if not f.filename.endswith("cuda_routing.py")]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


def _warnings(caught: list[Any]) -> list[str]:
    seen: list[str] = []
    for w in caught:
        text = str(w.message).strip().splitlines()[0][:300] if str(w.message).strip() else ""
        if "NumPy" in text or text in seen:
            continue
        seen.append(text)
    return seen


def step_probe(case: Any, device: Any, prepare: Callable[[Any, Any], None] | None) -> dict[str, Any]:
    """The optimizer step alone: parameters on ``device`` with fake gradients, then
    ``optimizer.step()`` and ``zero_grad(set_to_none=True)``, logged."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pytest_torchmem.engine.user.model_state import collect, convert, substituted
    from pytest_torchmem.engine.figures.report import Category
    from pytest_torchmem.engine.figures.timeline import Phase
    from pytest_torchmem.engine.tracing.devices.cuda import caching_allocator
    from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
    from pytest_torchmem.engine.tracing.rules import TraceContext
    from pytest_torchmem.engine.tracing.trace import adopt, fake_standins

    model, _ = case.make()
    where = device.trace_device
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    fakes = fake_standins(where)
    model_tensors = collect(model)
    with fake_mode:
        standins = convert(model_tensors, (), {}, fakes)
        trainable = [p for p in standins.parameters if p.requires_grad]
        for p in trainable:
            p.grad = torch.empty_like(p)
    context = TraceContext("cuda", gpu=gpu_profile(None))
    tracker = _logging_tracker_class()(
        fake_mode, where, device.rules, context=context, aliases=device.aliases,
        wraps_numbers=device.wraps_numbers, optimizer_hook=prepare,
    )
    adopt(tracker, standins)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with substituted(model_tensors, standins.model), fake_mode, tracker:
                opt = case.options["optimizer"](trainable)
                tracker.prepare_optimizer(opt)
                tracker.set_phase(Phase.STEP)
                opt.step()
                tracker.assign_role(
                    Category.OPTIMIZER_STATE,
                    [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
                )
                opt.zero_grad(set_to_none=True)
                tracker.set_phase(None)
                groups = [
                    {k: v for k, v in g.items() if k in ("foreach", "fused", "capturable")}
                    for g in opt.param_groups
                ]
                del opt
        except Exception as exc:  # noqa: BLE001 - reported
            error = exc
    failure = _failure(tracker, error) if error is not None else None
    return {
        "status": {"step": "failed" if failure else "ok"},
        "failure": failure,
        "ops": tracker.ops,
        "modules": [],
        "metrics": _metrics(tracker, caching_allocator(context)),
        "warnings": _warnings(caught),
        "groups": groups if error is None else [],
        "unsupported": [_unsupported(u) for u in tracker.unsupported],
    }


# -- backward without autograd's engine ------------------------------------------------
#
# On a CUDA build without a GPU, autograd's engine refuses cuda tensors before it
# runs any node ("hasPrimaryContext expects a valid device index"): the backward runs
# by hand (tests/hand_backward.py, shared with the device audit), each node called
# from Python in the engine's order.


class _HandBackward:
    """A torch-function mode (made lazily) that runs ``Tensor.backward`` by hand."""

    @staticmethod
    def make(used: list[bool]) -> Any:
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                if func is torch.Tensor.backward:
                    used.append(True)
                    gradient = kwargs.get("gradient", args[1] if len(args) > 1 else None)
                    return backward_by_hand(args[0], gradient)
                return func(*args, **kwargs)

        return Mode()


# -- record (a CUDA build of torch) -----------------------------------------------------


def reference_device(by_hand: list[bool] | None = None) -> Any:
    """The device model of the reference: fake tensors on ``cuda:0`` itself.

    No router (dispatch decides) and no implementation rules (they stand in for
    kernels; the reference must show what dispatch runs); the CUDA scratch and
    fallback rules and the caching-allocator model stay, so that its byte
    figures read like ``estimate``'s. Optimizer defaults: the emulation's
    (foreach), since torch.optim's own choice rejects fake tensors
    (``type(p) in (Tensor, Parameter)``) where it picks foreach for real cuda
    ones. With ``by_hand`` (a list, appended to when used), ``Tensor.backward``
    runs without autograd's engine (:func:`backward_by_hand`).
    """
    from pytest_torchmem.engine.tracing.devices import DEVICES, DeviceModel
    from pytest_torchmem.engine.tracing.devices.cuda import prepare_optimizer
    from pytest_torchmem.engine.tracing.rules import RuleSet

    emulation = DEVICES["cuda"]

    class DispatchOnly(RuleSet):
        def __init__(self, base: RuleSet) -> None:
            super().__init__(base.device)
            self._base = base
            #: Scratch rules that raised: the reference goes on without their bytes.
            self.errors: list[str] = []

        def scratch_rule(self, func: Any) -> Any:
            rule = self._base.scratch_rule(func)
            if rule is None:
                return None

            def guarded(call: Any) -> Any:
                try:
                    return rule(call)
                except Exception as exc:  # noqa: BLE001 - a rule's bug is not dispatch's
                    message = f"{func}: {_describe(exc)}"
                    if message not in self.errors:
                        self.errors.append(message)
                    return None

            return guarded

        def implementation_rule(self, func: Any) -> Any:
            return None

        def fallback_rule(self, func: Any) -> Any:
            return self._base.fallback_rule(func)

    return DeviceModel(
        "cuda",
        trace_device=torch.device("cuda", 0),
        rules=DispatchOnly(emulation.rules),
        aliases=frozenset({"cuda"}),
        wraps_numbers=False,
        allocator=emulation.allocator,
        router=None if by_hand is None else (lambda context: _HandBackward.make(by_hand)),
        prepare_optimizer=prepare_optimizer,
    )


def code_fingerprint() -> str:
    """A hash of the package's sources: whether two runs traced the same emulation."""
    import hashlib

    import pytest_torchmem

    digest = hashlib.sha256()
    package = Path(pytest_torchmem.__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "code": code_fingerprint(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    try:
        facts["cudnn"] = torch.backends.cudnn.version()
    except Exception as exc:  # noqa: BLE001
        facts["cudnn"] = _describe(exc)
    facts["cuda_available"] = torch.cuda.is_available()
    facts["device_count"] = torch.cuda.device_count()
    if facts["cuda_available"]:
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["capability"] = list(torch.cuda.get_device_capability(0))
    return facts


def record_case(case: Any, by_hand: bool = True) -> dict[str, Any]:
    """Reference trace, step probe and the emulation under this torch, for one case."""
    from pytest_torchmem.engine.tracing.devices import DEVICES
    from pytest_torchmem.engine.tracing.devices.cuda import prepare_optimizer

    found: dict[str, Any] = {"options": sorted(case.options), "code": code_fingerprint()}
    used: list[bool] = []
    # Without a GPU the engine refuses cuda tensors: the backward runs by hand there.
    hand = used if by_hand and not torch.cuda.is_available() else None
    for key, device in (("reference", reference_device(hand)), ("emulation", DEVICES["cuda"])):
        _REFERENCE_AUTOCAST[0] = key == "reference"
        try:
            found[key] = trace_case(case, device)
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            found[key] = {"crashed": _describe(exc), "traceback": traceback.format_exc()[-3000:]}
        finally:
            _REFERENCE_AUTOCAST[0] = False
        if key == "reference" and used and isinstance(found[key].get("status"), dict):
            found[key]["by_hand"] = True
    reference = found["reference"]
    if (
        case.options.get("optimizer") is not None
        and "status" in reference
        and reference["status"]["step"] != "ok"
    ):
        # foreach as a GPU's default: torch.optim's _default_to_fused_or_foreach
        # requires type(p) in (Tensor, Parameter), which a FakeTensor is not.
        try:
            found["step_probe"] = step_probe(case, reference_device(), prepare_optimizer)
        except Exception as exc:  # noqa: BLE001
            found["step_probe"] = {"crashed": _describe(exc), "traceback": traceback.format_exc()[-3000:]}
    return found


def cmd_record(args: argparse.Namespace) -> int:
    if torch.version.cuda is None:
        print(
            f"record needs a CUDA build of torch; this interpreter ({sys.executable}) has "
            f"torch {torch.__version__}. See the module docstring for the setup.",
            file=sys.stderr,
        )
        return 2
    cases = select_cases(args.cases, args.extra)
    facts = build_facts()
    print(
        f"recording {len(cases)} models with torch {facts['torch']} (CUDA {facts['cuda']}, "
        f"cuDNN {facts['cudnn']}), GPU available: {facts['cuda_available']}",
        flush=True,
    )
    data: dict[str, Any] = {"schema": SCHEMA, "build": facts, "cases": {}}
    for case in cases:
        started = time.perf_counter()
        if args.in_process:
            entry = record_case(case, by_hand=not args.engine_only)
        else:
            entry = _record_in_child(case.name, args.timeout, args.engine_only)
        data["cases"][case.name] = entry
        ref = entry.get("reference", {})
        status = ref.get("status") or {"error": entry.get("died") or ref.get("crashed")}
        print(f"  {case.name:<24} {time.perf_counter() - started:6.1f}s  {_status_line(status)}", flush=True)
    _write_json(Path(args.out), data)
    print(f"wrote {args.out}")
    return 0


def _status_line(status: dict[str, str]) -> str:
    return "  ".join(f"{k}:{status[k]}" for k in PHASES if k in status and status[k] != "n/a")


def _record_in_child(name: str, timeout: float, engine_only: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        command = [sys.executable, str(Path(__file__).resolve()), "_record-case", name, "--out", str(out)]
        if engine_only:
            command.append("--engine-only")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
        except subprocess.TimeoutExpired:
            return {"died": f"timed out after {timeout:.0f} s"}
        if done.returncode != 0 or not out.exists():
            how = (
                f"killed by signal {-done.returncode}" if done.returncode < 0
                else f"exit status {done.returncode}"
            )
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            return {"died": f"process {how}: {tail}"}
        return json.loads(out.read_text())


def cmd_record_case(args: argparse.Namespace) -> int:
    (case,) = select_cases([args.case], extra=True)
    _write_json(Path(args.out), record_case(case, by_hand=not args.engine_only))
    return 0


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


# -- compare ----------------------------------------------------------------------------


def short(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def _signature(record: dict[str, Any]) -> list[str]:
    return [
        f"{dtype}{shape}{'' if device == 'dev' else '@' + device}:{nbytes}{'' if new else '(old)'}"
        for shape, dtype, device, nbytes, new in record["outs"]
    ]


#: Routing families: an op name (short form) belongs to the first family naming
#: a part of it. The kind says how to read a difference in that family.
FAMILIES: Final = (
    ("attention backend", ("scaled_dot_product", "_safe_softmax", "_efficient_attention",
                           "_flash_attention", "_cudnn_attention")),
    ("dropout", ("dropout", "bernoulli")),
    ("batch norm", ("batch_norm",)),
    ("rnn", ("_cudnn_rnn", "rnn", "lstm", "gru")),
    ("embedding", ("embedding",)),
    ("optimizer", ("_foreach_", "_fused_")),
    ("convolution", ("convolution", "conv")),
    ("matmul", ("mm", "addmm", "bmm", "matmul", "baddbmm")),
    ("softmax / norm", ("softmax", "layer_norm", "group_norm")),
    ("dtype casts", ("_to_copy", "to_copy")),
)


def family(ops: list[str]) -> str:
    for name, parts in FAMILIES:
        if any(part in short(op) for op in ops for part in parts):
            return name
    return "other"


@dataclass
class Decision:
    """A block of ops where reference and emulation disagree (or agree, for routed families)."""

    phase: str
    reference: tuple[str, ...]
    emulation: tuple[str, ...]
    family: str
    kind: str = ""
    note: str = ""
    count: int = 0
    modules: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase, "reference": list(self.reference), "emulation": list(self.emulation),
            "family": self.family, "kind": self.kind, "note": self.note, "count": self.count,
            "modules": sorted(self.modules),
        }


GAP: Final = "routing gap (emulation)"
HAND: Final = "backward by hand (unverified)"
LIMIT: Final = "reference limitation"
OUTPUTS: Final = "same op, outputs differ"
ORDER: Final = "same ops, other order"
DRIFT: Final = "torch version drift"


def classify(decision: Decision, reference_build: dict[str, Any], reference_warnings: list[str]) -> None:
    ref, emu = decision.reference, decision.emulation
    no_gpu = not reference_build.get("cuda_available", False)
    if any("Disabling autocast" in w for w in reference_warnings) and (
        decision.family == "dtype casts" or decision.kind == OUTPUTS
    ):
        decision.kind = LIMIT
        decision.note = (
            "torch.autocast('cuda') disabled itself in the reference (no GPU): "
            + (decision.note or "dtype casts")
        )
        return
    if decision.kind in (OUTPUTS, ORDER):
        decision.note = decision.note or "same op on both sides; its outputs differ"
        return
    if decision.family == "attention backend" and no_gpu and not any(
        "_scaled_dot_product_" in op for op in ref
    ):
        decision.kind = LIMIT
        decision.note = (
            "CUDA build without a GPU: sdp_utils cannot query the device, so SDPA takes the "
            "math path; the emulation's backend choice is not checked by this reference"
        )
        return
    if decision.family == "optimizer" and any("_foreach_" in op for op in emu) and not any(
        "_foreach_" in op for op in ref
    ):
        decision.kind = LIMIT
        decision.note = (
            "fake tensors fail torch.optim's type(p) in (Tensor, Parameter) check, so the "
            "reference runs the single-tensor loop where a GPU defaults to foreach"
        )
        return
    decision.kind = GAP
    decision.note = (
        "CUDA dispatch picks this from the tensor's device type and the libraries' versions, "
        "which the CUDA build decides as a GPU would"
    )


#: Families whose backward op follows from the forward op's routing (derivatives.yaml).
_ROUTED: Final = frozenset({"attention backend", "dropout", "batch norm", "rnn", "embedding"})


def _by_hand(decision: Decision) -> None:
    """Re-read a difference found in a backward run by hand."""
    if decision.reference and set(decision.reference) == {"clone"} and not decision.emulation:
        decision.kind = HAND
        decision.note = (
            "derivatives.yaml clones a reserve space when retain_variables (cuDNN batch norm, "
            "cuDNN RNN); the engine calls will_release_variables() before the node, Python cannot"
        )
    elif decision.family not in _ROUTED and decision.kind == GAP:
        decision.kind = HAND
        decision.note = (
            "outside autograd's engine (no graph task: checkpoint recomputes per unpack; "
            "no saved-tensor release): not a routing decision"
        )


def _aligned(ref_ops: list[dict[str, Any]], emu_ops: list[dict[str, Any]]) -> Iterator[tuple[str, list, list]]:
    matcher = difflib.SequenceMatcher(
        a=[r["op"] for r in ref_ops], b=[r["op"] for r in emu_ops], autojunk=False
    )
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        yield tag, ref_ops[i1:i2], emu_ops[j1:j2]


def _module_name(trace: dict[str, Any], record: dict[str, Any]) -> str:
    names = trace.get("modules") or []
    index = record.get("module", -1)
    return names[index] if 0 <= index < len(names) else "-"


#: Ops a backward by hand cannot tell apart from the engine's: the engine's input
#: buffer sums two gradients in place or not by use counts that differ there.
_ENGINE_SAME: Final = {"aten.add_.Tensor": "aten.add.Tensor", "aten.add.Tensor": "aten.add.Tensor"}


def compare_phase(
    phase: str,
    reference: dict[str, Any],
    emulation: dict[str, Any],
    *,
    all_ops: bool,
    build: dict[str, Any],
    same: dict[str, str] | None = None,
) -> tuple[list[Decision], list[Decision], dict[str, int]]:
    """Decisions that differ, routed decisions that agree, and op counts, for one phase.

    ``same`` maps op names to the name they are compared as.
    """

    def ops(trace: dict[str, Any]) -> list[dict[str, Any]]:
        found = [r for r in trace["ops"] if r["phase"] == phase and (all_ops or not r["view"])]
        if same:
            found = [
                {**r, "op": same[r["op"]], "outs": [o[:4] + [None] for o in r["outs"]]}
                if r["op"] in same or r["op"] in same.values() else r
                for r in found
            ]
            found = [{**r, "op": same.get(r["op"], r["op"])} for r in found]
        return found

    ref_ops, emu_ops = ops(reference), ops(emulation)
    differ: dict[tuple[Any, ...], Decision] = {}
    agree: dict[tuple[Any, ...], Decision] = {}

    def add(table: dict, key: tuple, decision: Decision, module: str) -> None:
        found = table.setdefault(key, decision)
        found.count += 1
        found.modules.add(module)

    for tag, refs, emus in _aligned(ref_ops, emu_ops):
        if tag == "equal":
            # A run of the same op whose outputs are the same multiset in another
            # order (autocast's argument casts, say) is one decision, not several.
            start = 0
            while start < len(refs):
                end = start
                while end < len(refs) and refs[end]["op"] == refs[start]["op"]:
                    end += 1
                run_r = [_signature(r) for r in refs[start:end]]
                run_e = [_signature(e) for e in emus[start:end]]
                if end - start > 1 and run_r != run_e and sorted(run_r) == sorted(run_e):
                    name = short(refs[start]["op"])
                    decision = Decision(
                        phase, (name,) * (end - start), (name,) * (end - start), family([name]), ORDER,
                        "reference " + ", ".join(x[0] for x in run_r) + " | emulation "
                        + ", ".join(x[0] for x in run_e),
                    )
                    add(differ, (phase, name, tuple(map(tuple, run_r)), tuple(map(tuple, run_e))),
                        decision, _module_name(reference, refs[start]))
                    for i in range(start, end):
                        emus[i] = refs[i]  # compared: same outputs, other order
                start = end
            for r, e in zip(refs, emus):
                sig_r, sig_e = _signature(r), _signature(e)
                fam = family([r["op"]])
                if sig_r != sig_e:
                    pairs = [
                        f"out{i}: {a} vs {b}"
                        for i, (a, b) in enumerate(zip(sig_r, sig_e)) if a != b
                    ]
                    if len(sig_r) != len(sig_e):
                        pairs.append(f"{len(sig_r)} vs {len(sig_e)} outputs")
                    decision = Decision(phase, (short(r["op"]),), (short(e["op"]),), fam, OUTPUTS,
                                        "; ".join(pairs))
                    add(differ, (phase, r["op"], tuple(sig_r), tuple(sig_e)), decision,
                        _module_name(reference, r))
                elif fam not in ("other", "matmul", "dtype casts", "convolution", "softmax / norm"):
                    add(agree, (phase, r["op"]), Decision(phase, (short(r["op"]),), (short(e["op"]),), fam,
                                                          "agrees"), _module_name(reference, r))
            continue
        ref_names = tuple(short(r["op"]) for r in refs)
        emu_names = tuple(short(e["op"]) for e in emus)
        decision = Decision(phase, ref_names, emu_names, family(list(ref_names + emu_names)))
        module = _module_name(reference, refs[0]) if refs else _module_name(emulation, emus[0])
        add(differ, (phase, ref_names, emu_names), decision, module)
    for decision in differ.values():
        classify(decision, build, reference.get("warnings", []))
        if same is not None:
            _by_hand(decision)
    return list(differ.values()), list(agree.values()), {"reference": len(ref_ops), "emulation": len(emu_ops)}


def compare_case(
    name: str, entry: dict[str, Any], emulation: dict[str, Any], build: dict[str, Any], all_ops: bool
) -> dict[str, Any]:
    """Findings for one model: per phase the status, the decisions and the bytes."""
    result: dict[str, Any] = {"name": name, "phases": {}, "differ": [], "agree": [], "drift": []}
    reference = entry.get("reference", {})
    if "died" in entry or "crashed" in reference:
        result["reference_error"] = entry.get("died") or reference.get("crashed")
        return result
    if "crashed" in emulation:
        result["emulation_error"] = emulation["crashed"]
        return result
    probe = entry.get("step_probe")
    for phase in PHASES:
        ref_status = reference["status"][phase]
        ref_trace = reference
        source = "step"
        if reference.get("by_hand") and phase != "forward" and ref_status == "ok":
            ref_status = "ok (by hand)" if phase == "backward" else "ok (after)"
            source = "by hand"
        if phase == "step" and probe is not None and "status" in probe:
            ref_status = "ok (probe)" if probe["status"]["step"] == "ok" else "failed (probe)"
            ref_trace = probe
            source = "probe"
        emu_status = emulation["status"][phase]
        row: dict[str, Any] = {"reference": ref_status, "emulation": emu_status}
        for side, trace in (("reference", ref_trace), ("emulation", emulation)):
            failure = trace.get("failure")
            if failure and (failure["phase"] == phase or (failure["phase"] == "outside" and phase == "forward")):
                row[f"{side}_error"] = failure["error"]
                row[f"{side}_failed_at"] = failure.get("op") or failure.get("where")
        if ref_status == "n/a":
            result["phases"][phase] = row
            continue
        both = ref_status.startswith("ok") and emu_status == "ok"
        if both:
            differ, agree, counts = compare_phase(
                phase, ref_trace, emulation, all_ops=all_ops, build=build,
                same=_ENGINE_SAME if source == "by hand" else None,
            )
            result["differ"] += [d.as_dict() for d in differ]
            result["agree"] += [d.as_dict() for d in agree]
            row["ops"] = counts
        # Bytes: [reference, emulation], the reference's only where its phase ran.
        # The probe's baseline holds no activations or loss: only the step's own
        # allocations (allocated, rise) compare there.
        ref_m = ref_trace["metrics"].get(phase, {}) if ref_status.startswith("ok") else {}
        emu_m = emulation["metrics"].get(phase, {})
        # A backward by hand keeps every saved tensor to the end: only the bytes its
        # ops allocate compare, and in the step after it the rise above its start.
        # By hand, no op runs inside an autograd node, so the rules' per-thread
        # workspaces (the engine's device thread) differ: op outputs compare.
        keys = {
            "probe": ("outputs", "workspace", "rise"),
            "by hand": ("outputs", "workspace") if phase == "backward" else ("outputs", "workspace", "rise"),
        }.get(source, ("outputs", "workspace", "rise", "peak", "peak_blocks"))
        row["bytes"] = {key: [ref_m.get(key), emu_m.get(key)] for key in keys}
        result["phases"][phase] = row
    return result


def drift(
    name: str, mine: dict[str, Any], theirs: dict[str, Any], all_ops: bool, note: str
) -> list[dict[str, Any]]:
    """Op blocks where the emulation under this torch differs from the emulation under
    the reference's torch (no routing involved: torch versions, or builds)."""
    found = []
    if "ops" not in mine or "ops" not in theirs:
        return found
    for phase in PHASES:
        differ, _, _ = compare_phase(
            phase, theirs, mine, all_ops=all_ops, build={"cuda_available": True}
        )
        for decision in differ:
            decision.kind = DRIFT
            decision.note = note
            found.append(decision.as_dict())
    return found


def cmd_check_hand(args: argparse.Namespace) -> int:
    """How far a backward by hand is from autograd's engine, where the engine runs.

    Traces each model with the emulation's device model twice, the backward run
    by the engine and by :func:`backward_by_hand`, and compares the ops of the
    backward and the step as ``compare`` does for a backward by hand.
    """
    from contextlib import ExitStack

    from tabulate import tabulate

    from pytest_torchmem.engine.tracing.devices import DEVICES, DeviceModel

    emulation = DEVICES["cuda"]
    rows = []
    for case in select_cases(args.cases, args.extra):
        used: list[bool] = []

        def router(context: Any, used: list[bool] = used) -> Any:
            stack = ExitStack()
            if emulation.router is not None:
                stack.enter_context(emulation.router(context))
            stack.enter_context(_HandBackward.make(used))
            return stack

        hand_device = DeviceModel(**{**emulation.__dict__, "router": router})
        engine, hand = trace_case(case, emulation), trace_case(case, hand_device)
        for phase in ("backward", "step"):
            if engine["status"][phase] == "n/a":
                continue
            if engine["status"][phase] != "ok" or hand["status"][phase] != "ok":
                rows.append([case.name, phase, engine["status"][phase], hand["status"][phase], "", ""])
                continue
            differ, _, counts = compare_phase(
                phase, engine, hand, all_ops=args.all_ops, build={"cuda_available": True}, same=_ENGINE_SAME
            )
            text = "; ".join(
                f"{_ops_text(d['reference'], 40)} -> {_ops_text(d['emulation'], 40)}"
                + (f" ({d['note'][:60]})" if d["kind"] in (OUTPUTS, ORDER) else "")
                for d in map(Decision.as_dict, differ)
            )
            outputs = [engine["metrics"][phase]["outputs"], hand["metrics"][phase]["outputs"]]
            rows.append([case.name, phase, f"{counts['reference']}/{counts['emulation']}",
                         _pair(outputs), "same" if not differ else text[:150], bool(used)])
    print(tabulate(rows, headers=["model", "phase", "ops engine/hand", "op outputs B engine/hand",
                                  "differences (engine -> by hand)", "by hand"]))
    return 0


def emulation_trace(case: Any) -> dict[str, Any]:
    from pytest_torchmem.engine.tracing.devices import DEVICES

    try:
        return trace_case(case, DEVICES["cuda"])
    except Exception as exc:  # noqa: BLE001
        return {"crashed": _describe(exc), "traceback": traceback.format_exc()[-3000:]}


def cmd_compare(args: argparse.Namespace) -> int:
    data = json.loads(Path(args.reference).read_text())
    if data.get("schema") != SCHEMA:
        raise SystemExit(f"{args.reference}: schema {data.get('schema')}, expected {SCHEMA}")
    build = data["build"]
    names = args.cases or list(data["cases"])
    missing = [n for n in names if n not in data["cases"]]
    if missing:
        raise SystemExit(f"not in {args.reference}: {', '.join(missing)}")
    cases = {case.name: case for case in all_cases(extra=True)}
    here = {"torch": torch.__version__, "cuda": torch.version.cuda, "code": code_fingerprint()}
    findings: dict[str, Any] = {
        "schema": SCHEMA, "reference_build": build, "emulation_build": here, "cases": {},
    }
    codes = {entry.get("code", build.get("code")) for entry in data["cases"].values()}
    if codes != {here["code"]}:
        drift_note = (
            "the package's code changed since the record (and the torch build may differ): "
            "record again to tell routing from drift"
        )
    elif build["torch"] != here["torch"]:
        drift_note = f"same code as recorded; torch {build['torch']} there, {here['torch']} here"
    else:
        drift_note = "same code and torch as recorded"
    findings["drift_note"] = drift_note
    for name in names:
        entry = data["cases"][name]
        if name not in cases:
            print(f"{name}: recorded but no longer defined here; skipped", file=sys.stderr)
            continue
        emulation = emulation_trace(cases[name])
        found = compare_case(name, entry, emulation, build, args.all_ops)
        theirs = entry.get("emulation", {})
        if "ops" in theirs:
            found["drift"] = drift(name, emulation, theirs, args.all_ops, drift_note)
            # Same code, other torch: a difference that the emulation traced under the
            # reference's torch does not show comes from the torch version, not routing.
            same_torch = None
            if entry.get("code") == here["code"] and build["torch"] != here["torch"] and "status" in theirs:
                same_torch = compare_case(name, entry, theirs, build, args.all_ops)
            if same_torch is not None:
                keys = {_key(d) for d in same_torch["differ"]}
                for d in found["differ"]:
                    d["same_torch"] = _key(d) in keys
        found["code_changed"] = entry.get("code", build.get("code")) != here["code"]
        found["reference_warnings"] = entry.get("reference", {}).get("warnings", [])
        found["reference_rule_errors"] = entry.get("reference", {}).get("rule_errors", [])
        found["emulation_rules"] = dict(Counter(
            short(r["op"]) for r in emulation.get("ops", []) if r.get("impl")
        ))
        found["reference_unsupported"] = entry.get("reference", {}).get("unsupported", [])
        found["emulation_unsupported"] = emulation.get("unsupported", [])
        findings["cases"][name] = found
    print_findings(findings, max_rows=args.max_rows)
    if args.json:
        _write_json(Path(args.json), findings)
        print(f"\nwrote {args.json}")
    return 0


def _key(d: dict[str, Any]) -> tuple[Any, ...]:
    note = d["note"] if d["kind"] == OUTPUTS else ""
    return (d["phase"], tuple(d["reference"]), tuple(d["emulation"]), note)


# -- printing ---------------------------------------------------------------------------


def _ops_text(ops: list[str] | tuple[str, ...], width: int = 60) -> str:
    if not ops:
        return "-"
    counts = Counter(ops)
    if len(ops) > 6 and len(counts) < len(ops):
        text = ", ".join(f"{op}×{n}" if n > 1 else op for op, n in counts.items())
    else:
        text = ", ".join(ops)
    return text if len(text) <= width else text[: width - 1] + "…"


def _bytes(value: Any) -> str:
    return "-" if value is None else f"{value:,}"


def _pair(values: list[Any]) -> str:
    return "/".join(_bytes(v) for v in values)


def print_findings(findings: dict[str, Any], *, max_rows: int) -> None:
    from tabulate import tabulate

    ref, emu = findings["reference_build"], findings["emulation_build"]
    print(
        f"reference: torch {ref['torch']} (CUDA {ref.get('cuda')}, cuDNN {ref.get('cudnn')}), "
        f"fake tensors on cuda:0, GPU present: {ref.get('cuda_available')}"
    )
    print(f"emulation: torch {emu['torch']}, estimate(device='cuda') (fake meta tensors + router)")
    print(f"package code now {emu.get('code')}; {findings['drift_note']}\n")
    summary = []
    for name, found in findings["cases"].items():
        print(f"== {name} ==")
        if "reference_error" in found or "emulation_error" in found:
            side = "reference" if "reference_error" in found else "emulation"
            message = found.get("reference_error") or found.get("emulation_error")
            print(f"  {side} could not run: {message}\n")
            summary.append([name, "-", "-", "-", "-", f"{side} failed", "", ""])
            continue
        rows = []
        failures = []
        for phase, row in found["phases"].items():
            if row["reference"] == "n/a":
                continue
            ops = row.get("ops")
            b = row.get("bytes", {})
            if "peak_blocks" in b:
                peak = _pair(b["peak_blocks"])
            elif "rise" in b:
                peak = "rise " + _pair(b["rise"])
            else:
                peak = "-"
            rows.append([
                phase, row["reference"], row["emulation"],
                f"{ops['reference']}/{ops['emulation']}" if ops else "-",
                _pair(b.get("outputs", [None, None])), _pair(b.get("workspace", [None, None])), peak,
            ])
            for side in ("reference", "emulation"):
                if f"{side}_error" in row:
                    at = row.get(f"{side}_failed_at")
                    failures.append(f"  {side} {phase}: {row[side + '_error']}" + (f" (at {at})" if at else ""))
        print(tabulate(rows, headers=["phase", "reference", "emulation", "ops ref/emu",
                                      "op outputs B ref/emu", "workspace B ref/emu", "peak B ref/emu"]))
        for line in failures:
            print(line)
        differ = found["differ"]
        if differ:
            table = []
            for d in differ[:max_rows]:
                mark = "" if d.get("same_torch", True) else " (not with the reference's torch)"
                table.append([d["phase"], d["count"], _ops_text(d["reference"]), _ops_text(d["emulation"]),
                              d["family"], d["kind"] + mark, _ops_text(sorted(d["modules"]), 30)])
                if d["kind"] in (OUTPUTS, ORDER):
                    table.append(["", "", "", "", "", d["note"][:100], ""])
            print()
            print(tabulate(table, headers=["phase", "n", "reference ops", "emulation ops", "family", "kind",
                                           "modules"]))
            if len(differ) > max_rows:
                print(f"  ... {len(differ) - max_rows} more (see --json)")
        if found["agree"]:
            agreed = Counter()
            for d in found["agree"]:
                agreed[f"{d['reference'][0]} ({d['phase']})"] += d["count"]
            print("\n  routed ops that agree: " + ", ".join(f"{k} ×{n}" for k, n in agreed.items()))
        if found.get("drift"):
            print(f"  emulation drift between torch builds: {len(found['drift'])} block(s): "
                  + "; ".join(f"{_ops_text(d['reference'], 30)} -> {_ops_text(d['emulation'], 30)}"
                              for d in found["drift"][:3]))
        warn = [w for w in found.get("reference_warnings", []) if w]
        if warn:
            print("  reference warnings: " + " | ".join(w[:150] for w in warn[:3]))
        if found.get("code_changed"):
            print("  ! the package's code changed since this model was recorded: the CUDA rules' "
                  "workspaces (and so the peaks) may differ for that reason alone; record again")
        if found.get("reference_rule_errors"):
            print("  CUDA scratch rules that raised in the reference (skipped there): "
                  + "; ".join(found["reference_rule_errors"])[:300])
        if found.get("emulation_rules"):
            print("  emulation implementation rules used: "
                  + ", ".join(f"{k} ×{n}" for k, n in found["emulation_rules"].items()))
        for side in ("reference", "emulation"):
            if found.get(f"{side}_unsupported"):
                print(f"  {side} unsupported: " + "; ".join(found[f"{side}_unsupported"])[:300])
        print()
        fwd = found["phases"]["forward"].get("bytes", {}).get("peak_blocks", [None, None])
        kinds = Counter(d["kind"] for d in differ)
        kinds[LIMIT] += kinds.pop(HAND, 0)
        summary.append([
            name,
            found["phases"]["forward"]["reference"],
            found["phases"]["backward"]["reference"],
            found["phases"]["step"]["reference"],
            "/".join(_bytes(v) for v in fwd),
            kinds.get(GAP, 0), kinds.get(LIMIT, 0), kinds.get(OUTPUTS, 0) + kinds.get(ORDER, 0),
        ])
    print("== summary ==")
    print(tabulate(summary, headers=["model", "ref forward", "ref backward", "ref step",
                                     "forward peak B ref/emu", "gaps", "ref limits", "outputs/order differ"]))
    decisions: dict[tuple[Any, ...], list[str]] = {}
    for name, found in findings["cases"].items():
        for d in found["differ"]:
            key = (d["family"], d["kind"], _ops_text(d["reference"], 45), _ops_text(d["emulation"], 45))
            decisions.setdefault(key, []).append(name)
    if decisions:
        print()
        rows = [[fam, kind, r, e, len(names), _ops_text(sorted(set(names)), 50)]
                for (fam, kind, r, e), names in sorted(decisions.items())]
        print(tabulate(rows, headers=["family", "kind", "reference ops", "emulation ops", "blocks", "models"]))
    failed: dict[str, list[str]] = {}
    for name, found in findings["cases"].items():
        for phase, row in found["phases"].items():
            for side in ("reference", "emulation"):
                if f"{side}_error" in row:
                    failed.setdefault(f"{side} {phase}: {row[side + '_error'][:110]}", []).append(name)
    if failed:
        print()
        print(tabulate([[k, len(v), _ops_text(v, 70)] for k, v in sorted(failed.items())],
                       headers=["phases that did not run", "models", "which"]))
    agreed = Counter()
    for found in findings["cases"].values():
        for d in found["agree"]:
            agreed[d["reference"][0]] += d["count"]
    if agreed:
        print("\nrouted ops on which both agree: " + ", ".join(f"{k} ×{n}" for k, n in sorted(agreed.items())))


# -- all --------------------------------------------------------------------------------


def cmd_all(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp()) / "cuda_reference.json"
    command = [args.cuda_python, str(Path(__file__).resolve()), "record", "--out", str(out), *args.cases]
    if args.extra:
        command.append("--extra")
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, check=False)
    if done.returncode != 0:
        return done.returncode
    compare = argparse.Namespace(
        reference=str(out), cases=args.cases, json=args.json, all_ops=args.all_ops, max_rows=args.max_rows
    )
    return cmd_compare(compare)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{record,compare,all,check-hand}")

    rec = sub.add_parser("record", help="record reference traces (run with a CUDA build of torch)")
    rec.add_argument("cases", nargs="*", help="zoo case names (default: all)")
    rec.add_argument("--out", required=True, help="JSON file to write")
    rec.add_argument("--extra", action="store_true", help="also the extra routing models (x_*)")
    rec.add_argument("--in-process", action="store_true", help="no subprocess per model")
    rec.add_argument("--timeout", type=float, default=CASE_TIMEOUT, help="seconds per model")
    rec.add_argument("--engine-only", action="store_true",
                     help="no backward by hand where autograd's engine refuses (no GPU)")
    rec.set_defaults(run=cmd_record)

    check = sub.add_parser("check-hand", help="backward by hand against autograd's engine (emulation)")
    check.add_argument("cases", nargs="*", help="zoo case names (default: all)")
    check.add_argument("--extra", action="store_true", help="also the extra routing models (x_*)")
    check.add_argument("--all-ops", action="store_true", help="compare views too")
    check.set_defaults(run=cmd_check_hand)

    one = sub.add_parser("_record-case")  # one model, in the child process of record
    one.add_argument("case")
    one.add_argument("--out", required=True)
    one.add_argument("--engine-only", action="store_true")
    one.set_defaults(run=cmd_record_case)

    for name, helptext in (
        ("compare", "compare a recorded reference with estimate(device='cuda') under this torch"),
        ("all", "record with --cuda-python, then compare with this interpreter"),
    ):
        p = sub.add_parser(name, help=helptext)
        if name == "compare":
            p.add_argument("reference", help="file written by record")
            p.add_argument("--cases", nargs="*", default=[], help="only these models")
            p.set_defaults(run=cmd_compare)
        else:
            p.add_argument("cases", nargs="*", help="zoo case names (default: all)")
            p.add_argument("--cuda-python", required=True, help="interpreter with a CUDA build of torch")
            p.add_argument("--out", help="where to keep the recorded reference (default: a temp file)")
            p.add_argument("--extra", action="store_true", help="also the extra routing models (x_*)")
            p.set_defaults(run=cmd_all)
        p.add_argument("--json", help="write the findings to this JSON file")
        p.add_argument("--all-ops", action="store_true", help="compare views too")
        p.add_argument("--max-rows", type=int, default=25, help="differences shown per model")
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
