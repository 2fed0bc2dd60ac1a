"""The trace runs the program a real run runs (issue 54): the same ops, in the same order, and the same figures.

Over public model families (decoders with and without grouped-query attention,
sliding-window and alternating layers, mixtures of experts; encoders;
encoder-decoders; vision and speech; torchvision) and the configurations users
train them with (``tests/model_matrix.py``), one training step (forward, loss,
backward) is run for real on the CPU under ``measure`` and traced by ``estimate``
on the fake cpu device, each recording the ATen ops it dispatches
(``tests/same_program.py``). The traced sequence (op, argument shapes and dtypes,
in order) equals the real run's, and every figure equals ``measure``'s. Six layers
deep, where block replay replays repeated blocks, the built-in step's figures with
replay on equal ``measure``'s (where they do not, every block is traced too, to tell
replay's share from the trace's; ``replayed`` says what replay did). A divergence
names the first op that differs and the lines of code that chose each.

The README's command checks a row of each kind; CI's exhaustive run the whole
matrix (``python tests/test_same_program.py`` prints it as a table).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Iterator
from typing import Any, Final

import pytest
import torch
from exactness import NATIVE_GAP
from model_matrix import CONFIGURATIONS, FAMILIES, cases, loss_of, made, step_context
from profiled import every_peak
from same_program import first_difference, recorded, recording

import pytest_torchmem as tm

pytest.importorskip("transformers", reason="the model families are transformers'")

#: (peft asks transformers 5 by the name it deprecated; peft sets fan_in_fan_out itself on
#: GPT-2's Conv1D layers, as LoRA's users leave it)
pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False but the target module is `Conv1D`:UserWarning"),
]


def step(model: Any, batch: dict[str, Any], configuration: str, label: str | None = None) -> None:
    """One training step as a script writes it: forward (under the configuration's
    autocast) and the loss, then backward; its ops recorded under ``label``."""
    positional = FAMILIES_BY_MODEL.get(type(model).__name__) == "torchvision"
    with recording(label) if label else contextlib.nullcontext():
        with step_context(CONFIGURATIONS[configuration]):
            output = model(batch["pixel_values"]) if positional else model(**batch)
            loss = loss_of(output)
        loss.backward()


#: torchvision's models take the images positionally.
FAMILIES_BY_MODEL = {"ResNet": "torchvision"}


@contextlib.contextmanager
def replay(on: bool) -> Iterator[None]:
    before = os.environ.get("TORCHMEM_REPLAY")
    os.environ["TORCHMEM_REPLAY"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCHMEM_REPLAY"]
        else:
            os.environ["TORCHMEM_REPLAY"] = before


#: A bfloat16/float16 convolution oneDNN runs (the avx512 level, without native
#: bfloat16): its scratch is not modelled, and the estimate lists it.
LOW_PRECISION_CONVOLUTION: Final = "oneDNN's bfloat16/float16 convolution kernels is not modelled"


def _reduced_precision(reason: str) -> bool:
    return NATIVE_GAP in reason or LOW_PRECISION_CONVOLUTION in reason


def check(family: str, configuration: str) -> dict[str, Any]:
    """Run the case for real (its ops recorded, then measured: a dispatch mode in a real
    run has tensors of its own, the 8-byte scalars Python dispatch wraps) and traced:
    what each gave."""
    model, batch, _ = made(family, configuration)
    step(copy.deepcopy(model), batch, configuration, "real")
    real = recorded("real")
    measured = tm.measure(step, (model, batch, configuration))
    with replay(False):
        estimated = tm.estimate(step, (model, batch, configuration, "traced"))
    traced = recorded("traced")
    return {
        "ops": len(real),
        "difference": first_difference(real, traced),
        "measured": every_peak(measured),
        "estimated": every_peak(estimated),
        "unsupported": estimated.unsupported,
        # (a reduced-precision kernel this host runs natively, or a bfloat16 convolution
        # oneDNN runs: there the estimate says it is not exact, and lists what follows)
        "reduced precision": [u.reason for u in estimated.unsupported if _reduced_precision(u.reason)],
    }


def check_replay(family: str, configuration: str, layers: int) -> dict[str, Any]:
    """The case ``layers`` deep through the built-in step, where block replay replays
    repeated blocks: measured for real and traced with replay; where the two differ, traced
    again with every block, to tell replay's share from the trace's."""
    model, batch, _ = made(family, configuration, layers)
    positional = FAMILIES_BY_MODEL.get(type(model).__name__) == "torchvision"
    arguments = batch["pixel_values"] if positional else batch
    measured = tm.measure(model, arguments, loss_fn=loss_of)
    with replay(True):
        replayed = tm.estimate(model, arguments, loss_fn=loss_of)
    result = {
        "measured": every_peak(measured),
        "replayed": every_peak(replayed),
        "unsupported": replayed.unsupported,
        "replay lines": replayed.replayed,
    }
    if result["replayed"] != result["measured"]:
        with replay(False):
            result["every block"] = every_peak(tm.estimate(model, arguments, loss_fn=loss_of))
    return result


#: The rows the README's command checks: a decoder without its cache and checkpointed, a
#: sliding-window decoder on a padded batch, a mixture of experts, an encoder with eager
#: attention, an encoder-decoder with LoRA adapters (CI's exhaustive run checks the rest).
QUICK = (
    ("llama", "no cache"),
    ("llama", "checkpointed"),
    ("mistral", "padded"),
    ("qwen2-moe", "as made"),
    ("bert", "eager attention"),
    ("t5", "lora"),
)


#: What the trace does not follow yet, each stopping with one line that names it.
STOPS = {
    # transformers' CTC loss: ctc_loss's C++ body reads the lengths' values on the host
    "wav2vec2": "ctc_loss reads its lengths in C++ (DataDependentOutputException): the trace stops there",
}


def _marks(case: tuple[str, str]) -> Any:
    marks: list[Any] = [] if case in QUICK else [pytest.mark.exhaustive]
    if case[0] in STOPS:
        marks.append(pytest.mark.xfail(reason=STOPS[case[0]], raises=tm.TraceStopped, strict=True))
    return pytest.param(*case, id=f"{case[0]}-{case[1]}", marks=marks)


@pytest.mark.parametrize(("family", "configuration"), [_marks(case) for case in cases()])
def test_the_trace_dispatches_the_real_runs_ops_and_its_figures_are_measures(family: str, configuration: str) -> None:
    result = check(family, configuration)
    assert result["difference"] is None, result["difference"]
    if result["reduced precision"]:
        assert len(result["reduced precision"]) == len(result["unsupported"]), result["unsupported"]
        pytest.skip(f"not modelled on this host's level: {result['reduced precision'][0]}")
    assert result["unsupported"] == ()
    assert result["estimated"] == result["measured"]


#: Block replay replays six or more repeated blocks: the matrix's models made 6 layers deep,
#: in the configurations that change what a block does (its cache, its checkpoint, its
#: mask, its adapters).
REPLAYED = ("as made", "no cache", "checkpointed", "padded", "lora")
QUICK_REPLAYED = (("llama", "no cache"),)


def _replay_marks(case: tuple[str, str]) -> Any:
    marks: list[Any] = [] if case in QUICK_REPLAYED else [pytest.mark.exhaustive]
    if case[0] in STOPS:
        marks.append(pytest.mark.xfail(reason=STOPS[case[0]], raises=tm.TraceStopped, strict=True))
    return pytest.param(*case, id=f"{case[0]}-{case[1]}", marks=marks)


@pytest.mark.parametrize(
    ("family", "configuration"),
    [_replay_marks(case) for case in cases() if case[1] in REPLAYED and FAMILIES[case[0]].depth],
)
def test_six_layers_deep_block_replay_gives_the_traced_figures(family: str, configuration: str) -> None:
    """Replayed, every figure is measure's (where it is not, the message gives the figures
    of the trace of every block beside them: replay's doing, or the trace's)."""
    result = check_replay(family, configuration, layers=6)
    assert result["unsupported"] == ()
    assert result["replayed"] == result["measured"], (result.get("every block"), result["replay lines"])


# -- on cuda: torch's own fake cuda tensors as the oracle ------------------------------------

#: Cases whose forward reads no tensor value (torch's fake mode, unlike the trace, knows
#: none: BART's SDPA mask, ViT's and Llama's forwards read one).
ORACLE_CASES = (
    *((family, "eager attention") for family in ("bert", "distilbert", "gpt2", "bart", "whisper")),
    *((family, "as made") for family in ("bert", "distilbert", "gpt2", "whisper")),
)


def _forward(model: Any, batch: dict[str, Any], label: str) -> None:
    """The forward and loss as a script on a GPU runs them (model and batch moved there)."""
    model = model.to("cuda")
    with recording(label):
        loss_of(model(**{name: tensor.to("cuda") for name, tensor in batch.items()}))


def _torchs_fake_cuda_forward(family: str, configuration: str, batch: dict[str, Any]) -> list[Any]:
    """The ops of the same forward under torch's own ``FakeTensorMode`` on ``cuda`` (the
    model made there), the program answered as a real run by the trace's own real-run
    view (transformers asks whether its tensors are fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from same_program import OpRecorder

    from pytest_torchmem.engine.tracing.real_run_view import real_run_view

    ops: list[Any] = []
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        with torch.device("cuda"):
            model, _, _ = made(family, configuration)
        model.train()
        fake = {name: mode.from_tensor(tensor).to("cuda") for name, tensor in batch.items()}
        with real_run_view(mode), OpRecorder(ops):
            loss_of(model(**fake))
    return ops


@pytest.mark.skipif(
    torch.version.cuda is None,
    reason="a CPU build's fake cuda tensors abort under autograd (DESIGN's hazards); CI's CUDA builds run it",
)
@pytest.mark.parametrize(("family", "attention"), ORACLE_CASES)
def test_on_a_cuda_build_the_fake_gpus_forward_dispatches_torchs_own_fake_cuda_ops(family: str, attention: str) -> None:
    """On a CUDA build (no GPU needed), torch's own fake cuda tensors run the composites'
    C++ bodies with ``is_cuda()`` true: the GPU's branches (dropout's ``native_dropout``,
    the norms' kernels). The fake cuda device's forward dispatches the same ops, in order.
    Without a GPU torch's scaled-dot-product attention falls back to its math path (the
    backend check asks the device), where the fake GPU picks a GPU's kernel: with SDPA the
    two agree up to the first attention, and part there."""
    model, batch, _ = made(family, attention)
    tm.estimate(_forward, (model, batch, "fake gpu"), device="cuda")
    ours = recorded("fake gpu")
    torchs = _torchs_fake_cuda_forward(family, attention, batch)
    difference = first_difference(torchs, ours)
    if attention == "eager attention":
        assert difference is None, difference
    else:
        first_attention = next(i for i, op in enumerate(ours) if "scaled_dot_product" in op.name)
        assert difference is not None and difference.startswith(f"op {first_attention} of"), difference


if __name__ == "__main__":  # the matrix as a table
    from torchvision_import import import_torchvision

    import_torchvision()
    rows = []
    for family, configuration in cases():
        try:
            result = check(family, configuration)
        except Exception as exc:  # noqa: BLE001 - the table says what stopped
            rows.append((family, configuration, "-", f"error: {str(exc).splitlines()[0][:100]}"))
            print(*rows[-1], sep=" | ", flush=True)
            continue
        verdict = []
        if result["difference"]:
            verdict.append("ops differ: " + result["difference"].splitlines()[1].strip()[:100])
        if result["reduced precision"]:
            verdict.append("reduced precision not modelled on this level: figures not compared")
        elif result["unsupported"]:
            verdict.append(f"{len(result['unsupported'])} unsupported")
        if result["estimated"] != result["measured"] and not result["reduced precision"]:
            gap = {k: result["estimated"][k] - result["measured"][k] for k in result["measured"]}
            verdict.append(f"estimate - measure {gap}")
        rows.append((family, configuration, result["ops"], "; ".join(verdict) or "equal"))
        print(*rows[-1], sep=" | ", flush=True)
    sys.exit(0)
