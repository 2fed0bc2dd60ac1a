"""A GPU census: OpInfo's samples and the model zoo measured on this GPU, the estimate beside each.

    python benchmarks/gpu_census.py                      # on a GPU: writes tests/data/gpu_census/<gpu>-torch-<release>.json
    python benchmarks/gpu_census.py --fake --out DIR     # no GPU: everything but the measurement (a placeholder)

Issue 57, item 2. For every OpInfo of ``op_db`` (``--ops`` narrows them) at float32,
bfloat16 and float16 (those the OpInfo supports on cuda), its first ``--samples``
samples become a step as ``tests/opinfo_harness.py`` makes them (the sample's
tensors are the step's inputs; it trains where a floating output requires grad);
every case of ``tests/zoo.py`` (``--models``) is run at the three dtypes too (the
model and its floating inputs cast), and with ``--public`` the public models of
``tests/test_public_models.py`` that this machine can build. Each case gets:

* ``measured``: ``tm.measure(..., device="cuda")``'s phase peaks on this GPU
  (``torch.cuda.max_memory_allocated``, reset per phase), and for an op sample
  ``raw``: the op called once more on its inputs on the GPU under ``no_grad``,
  ``reset_peak_memory_stats`` before: the bytes it was given
  (``memory_allocated`` before), returned (after less before) and its peak above
  both (``max_memory_allocated`` less after) -- the kernels' scratch;
* ``estimate``: ``tm.estimate(..., device="cuda", gpu=<this GPU's profile>)``'s phase
  peaks and its ``unsupported`` list, on the same inputs;
* ``exact``: whether every phase agrees and nothing is unsupported.

The record (JSON, one per GPU and torch release, sorted keys) names the GPU's
profile as a line of the ini table (``GpuProfile.from_device()``), so that
``tests/test_gpu_census.py`` replays every case's estimate on a machine without
a GPU: equal to the measurement where the record says exact, and to the
recorded estimate otherwise (a GPU seen once keeps checking). ``--fake`` runs
everything but the real GPU (``measured`` and ``raw`` are ``null``, the profile
``--gpu``'s), for that test and for a dry run; it writes only under ``--out``.
``--budget-s`` stops starting cases after so many seconds (the record says so).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pytest_torchmem as tm  # noqa: E402
from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile, gpu_profile  # noqa: E402
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor  # noqa: E402

#: The record's layout; a replay refuses another.
SCHEMA = 1
#: Where the records live, one per (GPU, torch release).
DATA = ROOT / "tests" / "data" / "gpu_census"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PHASES = ("forward", "backward", "step")


def release() -> str:
    """The torch release a record is for: ``major.minor`` (a CPU and a CUDA build of one
    release model the same kernels)."""
    major, minor = torch_minor()
    return f"{major}.{minor}"


def slug(name: str) -> str:
    """A GPU's name as a file name: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "gpu"


def record_path(gpu_name: str, directory: Path = DATA) -> Path:
    return directory / f"{slug(gpu_name)}-torch-{release()}.json"


def profile_line(profile: GpuProfile) -> str:
    """The profile as a line of the ini table, which ``gpu=`` reads back."""
    return f"{profile.name}: {profile.spec}"


def _peaks(report: tm.MemoryReport) -> dict[str, int]:
    return {"forward": report.forward_peak, "backward": report.backward_peak, "step": report.step_peak}


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def describe_inputs(value: Any) -> list[Any]:
    """Every tensor of ``value`` as ``[shape, dtype, stride]``, other leaves as their repr."""
    from torch.utils._pytree import tree_leaves

    out: list[Any] = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            out.append([list(leaf.shape), str(leaf.dtype).removeprefix("torch."), list(leaf.stride())])
        elif isinstance(leaf, (int, float, bool, str, type(None))):
            out.append(leaf)
        else:
            out.append(type(leaf).__name__)
    return out


# -- the cases -----------------------------------------------------------------------------


class Case:
    """One step the census runs: its key and how to make its model, inputs and options."""

    def __init__(self, key: dict[str, Any], make: Callable[[], tuple[nn.Module, Any, dict[str, Any]]]) -> None:
        self.key = key
        self.make = make

    @property
    def id(self) -> str:
        return ":".join(str(self.key[k]) for k in ("kind", "name", "dtype", "sample") if k in self.key)


def _op_db() -> list[Any]:
    from opinfo_harness import op_infos

    return op_infos()


def op_cases(patterns: list[str], dtypes: list[str], samples: int) -> Iterator[Case]:
    """OpInfo samples as steps, in ``op_db``'s order, ``samples`` of each op at each dtype."""
    from opinfo_harness import OpCallModule, _floating_outputs, _split, _usable, op_function, op_name, samples_of
    from opinfo_harness import sum_of_outputs

    for op in _op_db():
        name = op_name(op)
        if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            try:
                if dtype not in op.supported_dtypes("cuda"):
                    continue
                found = list(samples_of(op, dtype, samples))
            except Exception:  # noqa: BLE001 - OpInfo's own sample generation
                continue
            for index, sample in enumerate(found):

                def make(op: Any = op, sample: Any = sample) -> tuple[nn.Module, Any, dict[str, Any]]:
                    tensors: list[torch.Tensor] = []
                    structure = _split((sample.input, list(sample.args), dict(sample.kwargs)), tensors)
                    for t in tensors:
                        why = _usable(t)
                        if why:
                            raise _Skip(why)
                    module = OpCallModule(op_function(op), structure)
                    train = bool(
                        op.supports_autograd and dtype.is_floating_point and any(t.requires_grad for t in tensors)
                    )
                    options: dict[str, Any] = {"train": train}
                    if train:
                        options["loss_fn"] = _loss_or_nothing(sum_of_outputs, _floating_outputs)
                    return module, tuple(tensors), options

                yield Case({"kind": "op", "name": name, "dtype": dtype_name, "sample": index}, make)


class _Skip(Exception):
    """A sample that cannot be a step's input (sparse, on another device, ...)."""


def _loss_or_nothing(loss: Callable[[Any], torch.Tensor], floats: Callable[[Any], list[torch.Tensor]]) -> Any:
    """The harness's loss (the sum of the floating outputs that require grad), and a
    zero that requires nothing where there is none (an integer output of a trained op)."""

    def loss_fn(output: Any) -> torch.Tensor:
        if floats(output):
            return loss(output)
        raise _Skip("no floating output requires grad")

    return loss_fn


def _cast(value: Any, dtype: torch.dtype) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def model_cases(patterns: list[str], dtypes: list[str], public: bool) -> Iterator[Case]:
    """The zoo's cases (and the public models') at each dtype: float32 as built, the
    others with the model and its floating inputs cast."""
    from zoo import CASES

    builders: list[tuple[str, Callable[[], tuple[nn.Module, Any]], dict[str, Any]]] = [
        (case.name, case.make, case.options) for case in CASES
    ]
    if public:
        try:
            import test_public_models as models
        except Exception:  # noqa: BLE001 - transformers or torchvision missing here
            models = None
        if models is not None:
            builders += [
                (f"public {name}", lambda name=name: models._made(name), {"optimizer": models._adamw})
                for name in models.CASES
            ]
    for name, build, options in builders:
        if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        for dtype_name in dtypes:

            def make(build: Any = build, options: Any = options, dtype_name: str = dtype_name) -> tuple[nn.Module, Any, dict[str, Any]]:
                torch.manual_seed(0)
                model, inputs = build()
                if dtype_name != "float32":
                    model = model.to(DTYPES[dtype_name])
                    inputs = _cast(inputs, DTYPES[dtype_name])
                return model, inputs, dict(options)

            yield Case({"kind": "model", "name": name, "dtype": dtype_name}, make)


# -- one case ------------------------------------------------------------------------------


def estimate_case(case: Case, gpu: str) -> dict[str, Any]:
    """The estimate of ``case`` on the fake cuda device following ``gpu`` (a profile line):
    ``inputs``, ``train``, ``estimate`` and ``unsupported``, or ``error``/``skipped``."""
    out: dict[str, Any] = {}
    try:
        model, inputs, options = case.make()
    except _Skip as skip:
        return {"skipped": str(skip)}
    except Exception as exc:  # noqa: BLE001
        return {"error": "make: " + _describe(exc)}
    out["inputs"] = describe_inputs(inputs)
    out["train"] = bool(options.get("train", True))
    try:
        try:
            report = tm.estimate(model, inputs, device="cuda", gpu=gpu, **options)
        except tm.TraceStopped as stopped:
            report = stopped.report
    except _Skip as skip:
        return {**out, "skipped": str(skip)}
    except Exception as exc:  # noqa: BLE001 - recorded: the replay sees the same
        return {**out, "error": "estimate: " + _describe(exc)}
    out["estimate"] = _peaks(report)
    # where in this checkout's code is not part of the record (another machine's paths)
    out["unsupported"] = sorted(re.sub(r" at \S+:\d+", "", str(entry))[:300] for entry in report.unsupported)
    return out


def _nbytes(value: Any) -> int:
    from torch.utils._pytree import tree_leaves

    seen: set[int] = set()
    total = 0
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
            storage = leaf.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def measure_case(case: Case) -> dict[str, Any]:
    """``case`` run on this GPU: ``measured`` (``tm.measure``'s phase peaks) and, for an
    op sample, ``raw`` (the op's call alone: given, returned, scratch)."""
    out: dict[str, Any] = {}
    try:
        model, inputs, options = case.make()
        out["measured"] = _peaks(tm.measure(model, inputs, device="cuda", **options))
    except _Skip as skip:
        return {"skipped": str(skip)}
    except Exception as exc:  # noqa: BLE001
        return {"measure_error": _describe(exc)}
    if case.key["kind"] == "op":
        try:
            model, inputs, _ = case.make()
            device = torch.device("cuda", torch.cuda.current_device())
            on_gpu = tuple(t.detach().to(device) for t in inputs)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            with torch.no_grad():
                result = model(*on_gpu)
            torch.cuda.synchronize(device)
            peak, after = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
            out["raw"] = {
                "given": before,
                "given_bytes": _nbytes(on_gpu),
                "returned": after - before,
                "returned_bytes": _nbytes(result),
                "scratch": peak - after,
            }
            del result, on_gpu
        except Exception as exc:  # noqa: BLE001
            out["raw_error"] = _describe(exc)
    return out


def run_case(case: Case, gpu: str, fake: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": case.id, **case.key}
    entry.update(estimate_case(case, gpu))
    if "skipped" in entry:
        return entry
    if fake:
        entry["measured"] = None  # the placeholder: no GPU here
        entry["exact"] = False
        return entry
    entry.update(measure_case(case))
    entry["exact"] = bool(
        entry.get("estimate") is not None
        and entry.get("measured") is not None
        and not entry.get("unsupported")
        and entry["estimate"] == entry["measured"]
    )
    return entry


# -- replay (tests/test_gpu_census.py) -------------------------------------------------------


def cases_by_id(record: dict[str, Any]) -> dict[str, Case]:
    """The cases of ``record``, made again on this machine, by id."""
    ops = sorted({c["name"] for c in record["cases"] if c["kind"] == "op"})
    models = sorted({c["name"] for c in record["cases"] if c["kind"] == "model"})
    samples = 1 + max((c.get("sample", 0) for c in record["cases"] if c["kind"] == "op"), default=0)
    dtypes = sorted({c["dtype"] for c in record["cases"]})
    found: dict[str, Case] = {}
    if ops:
        found.update((case.id, case) for case in op_cases(ops, dtypes, samples))
    if models:
        public = any(name.startswith("public ") for name in models)
        found.update((case.id, case) for case in model_cases(models, dtypes, public))
    return found


def replay(entry: dict[str, Any], case: Case | None, gpu: str) -> str:
    """Why ``entry``'s estimate, made again here, disagrees with the record ('' when it
    agrees): the measurement where the record is exact, else the recorded estimate (an
    estimate that became the measurement agrees too)."""
    if case is None:
        return f"{entry['id']}: not made on this machine (the op or the model is missing here)"
    again = estimate_case(case, gpu)
    if "skipped" in entry or "skipped" in again:
        return "" if ("skipped" in entry) == ("skipped" in again) else f"{entry['id']}: skipped {again.get('skipped') or entry.get('skipped')}"
    if again.get("inputs") != entry.get("inputs"):
        return f"{entry['id']}: the inputs differ: {again.get('inputs')} here, {entry.get('inputs')} recorded"
    if "error" in entry or "error" in again:
        return "" if again.get("error") == entry.get("error") else f"{entry['id']}: {again.get('error')} here, {entry.get('error')} recorded"
    estimate = again["estimate"]
    measured = entry.get("measured")
    if entry.get("exact"):
        if estimate != measured or again["unsupported"]:
            return f"{entry['id']}: estimate {estimate} (unsupported {again['unsupported']}), measured {measured} on the GPU"
        return ""
    if estimate == entry.get("estimate") or (measured is not None and estimate == measured and not again["unsupported"]):
        return ""
    return f"{entry['id']}: estimate {estimate} here, {entry.get('estimate')} recorded (measured {measured})"


# -- the command -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", "--dry-run", dest="fake", action="store_true", help="no GPU: estimates beside a placeholder")
    parser.add_argument("--gpu", default="H100", help="--fake's profile (a name or an ini line); on a GPU its own")
    parser.add_argument("--ops", default="*", help="comma-separated OpInfo names or patterns; '' for none")
    parser.add_argument("--models", default="*", help="comma-separated zoo case names or patterns; '' for none")
    parser.add_argument("--public", action="store_true", help="the public models too (transformers, torchvision)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--samples", type=int, default=1, help="samples of each op at each dtype")
    parser.add_argument("--budget-s", type=float, default=None, help="start no case after so many seconds")
    parser.add_argument("--out", default=None, help="the record's folder (tests/data/gpu_census on a GPU)")
    options = parser.parse_args(argv)
    if options.fake:
        if options.out is None:
            parser.error("--fake writes placeholders: name the folder with --out (never tests/data/gpu_census)")
        profile = gpu_profile(options.gpu)
        device_name = None
    else:
        if not torch.cuda.is_available():
            print("gpu_census.py measures on a GPU, and torch.cuda.is_available() is False here; --fake runs the rest")
            return 2
        profile = GpuProfile.from_device()
        device_name = torch.cuda.get_device_name()
    gpu = profile_line(profile)
    split = lambda text: [p.strip() for p in text.split(",") if p.strip()]  # noqa: E731
    dtypes = split(options.dtypes)
    warnings.filterwarnings("ignore")
    cases: list[Case] = []
    if options.ops:
        cases += op_cases(split(options.ops), dtypes, options.samples)
    if options.models:
        cases += model_cases(split(options.models), dtypes, options.public)
    start = time.perf_counter()
    entries: list[dict[str, Any]] = []
    stopped = None
    for number, case in enumerate(cases):
        if options.budget_s is not None and time.perf_counter() - start > options.budget_s:
            stopped = f"the budget of {options.budget_s:g} s ran out after {number} of {len(cases)} cases"
            break
        entry = run_case(case, gpu, options.fake)
        entries.append(entry)
        verdict = entry.get("skipped") and "skipped" or entry.get("error") or ("exact" if entry.get("exact") else "")
        print(f"{case.id:<60} {verdict or {k: entry.get(k) for k in ('estimate', 'measured')}}", flush=True)
    record = {
        "schema": SCHEMA,
        "gpu": {"name": profile.name, "line": gpu, "device": device_name},
        "torch": torch.__version__,
        "release": release(),
        "fake": options.fake,
        "stopped": stopped,
        "seconds": round(time.perf_counter() - start, 1),
        "cases": entries,
    }
    path = record_path(profile.name, Path(options.out) if options.out else DATA)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    exact = sum(1 for e in entries if e.get("exact"))
    print(f"{len(entries)} cases, {exact} exact, in {record['seconds']} s: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
