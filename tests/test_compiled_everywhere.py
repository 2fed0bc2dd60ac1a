"""Compiled code wherever the traced code reaches it (issue 55): compiled modules a step
function reaches, compiled functions it calls (a loss, a chunked loss), on both devices.

On cpu each figure is ``measure``'s, byte for byte; on cuda there is no GPU to measure,
so a compiled function is checked by hand, and the others against the eager program,
whose figures differ where the programs do (a figure equal to the eager one would be
the eager program's, silently). What is not followed is listed, never given as the
compiled program's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from following import follows_compiled
from profiled import every_peak
from replay_checks import import_transformers

pytestmark = follows_compiled


def _compiled_entries(report: tm.MemoryReport) -> list[str]:
    return [entry.op for entry in report.unsupported if entry.op.startswith("torch.compile")]


# -- a compiled function, called in a step function ----------------------------------


@torch.compile
def _sin_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x * w).sum()


class _Weight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1024))


def test_a_compiled_function_in_a_step_function_checked_by_hand() -> None:
    """``sin(x * w).sum()`` over 1024 fp32 values, a compiled function the step calls.

    The program is the compiled module's of test_compiled_cuda's hand count: the
    partitioner saves x and w (no ``mul``), inductor fuses the forward into one
    reduction writing a scalar (one 512-byte block) and the backward into one kernel
    writing w's gradient.

    cuda forward: w 4096 + x 4096 + the loss 512 = 8704;
    backward: 8704 + autograd's ones 512 + w's gradient 4096 = 13312.
    Eagerly ``mul`` and ``sin`` make 4096 bytes each, and SinBackward keeps ``mul``:
    forward 8704 + 2 x 4096 = 16896 (its backward 4608 above that).
    """
    torch.manual_seed(0)
    model, x = _Weight(), torch.randn(1024)

    def step(x: torch.Tensor) -> None:
        _sin_sum(x, model.w).backward()

    def eager_step(x: torch.Tensor) -> None:
        torch.sin(x * model.w).sum().backward()

    report = tm.estimate(step, (x,), device="cuda")
    assert report.unsupported == ()
    assert (report.forward_peak, report.backward_peak) == (8704, 13312)
    eager = tm.estimate(eager_step, (x,), device="cuda")
    assert (eager.forward_peak, eager.backward_peak) == (16896, 16896 + 4608)
    on_cpu = tm.estimate(step, (x,))
    assert on_cpu.unsupported == ()
    assert every_peak(on_cpu) == every_peak(tm.measure(step, (x,)))


def test_a_trace_that_meets_a_compiled_function_in_its_forward_gives_up_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first trace does not follow (nothing compiled was found before the step ran);
    once its forward meets a compiled function it could follow, it stops at its next op,
    and the step is traced again, following, from the start: a model's whole eager step
    is not traced for nothing (a Llama-3-8B-shaped FSDP2 rank with its layers compiled
    took 3.6 times its eager estimate, 2.2 times once the first trace gave up)."""
    from pytest_torchmem.engine.tracing import trace as tracing
    from pytest_torchmem.engine.tracing.compiled_program import CompiledCodeMet

    real = tracing._trace
    outcomes: list[str] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            result = real(*args, **kwargs)
        except CompiledCodeMet:
            outcomes.append("gave up")
            raise
        outcomes.append("followed" if kwargs["follow"] else "traced")
        return result

    monkeypatch.setattr(tracing, "_trace", counted)
    torch.manual_seed(0)
    model, x = _Weight(), torch.randn(1024)

    def step(x: torch.Tensor) -> None:
        _sin_sum(x, model.w).backward()

    assert tm.estimate(step, (x,)).unsupported == ()
    assert outcomes == ["gave up", "followed"]


# -- a compiled loss: per-chunk cross-entropy over a large vocabulary -----------------


def _cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = h @ weight.t()
    return nn.functional.cross_entropy(logits.float(), labels, reduction="sum")


_compiled_cross_entropy = torch.compile(_cross_entropy)


def _chunked_loss_step(
    loss: Callable[..., torch.Tensor], body: nn.Module, head: nn.Linear, chunks: int
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A step that computes its loss chunk by chunk, the standard way to keep float32
    logits over a large vocabulary from being made all at once."""

    def step(x: torch.Tensor, labels: torch.Tensor) -> None:
        h = body(x)
        total = h.new_zeros((), dtype=torch.float32)
        for part, part_labels in zip(h.chunk(chunks), labels.chunk(chunks)):
            total = total + loss(part, head.weight, part_labels)
        (total / labels.numel()).backward()

    return step


def _loss_case(vocab: int, dtype: torch.dtype, tokens: int = 256, width: int = 64) -> tuple[Any, ...]:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(width, width), nn.GELU()).to(dtype)
    head = nn.Linear(width, vocab, bias=False).to(dtype)
    x = torch.randn(tokens, width, dtype=dtype)
    labels = torch.randint(0, vocab, (tokens,))
    return body, head, x, labels


def test_a_compiled_chunked_loss_equals_measure_on_cpu() -> None:
    body, head, x, labels = _loss_case(vocab=4096, dtype=torch.float32)
    step = _chunked_loss_step(_compiled_cross_entropy, body, head, chunks=4)
    estimated = tm.estimate(step, (x, labels))
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(tm.measure(step, (x, labels)))
    eager = tm.estimate(_chunked_loss_step(_cross_entropy, body, head, chunks=4), (x, labels))
    assert every_peak(eager) != every_peak(estimated)


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_compiled_loss_keeps_no_float32_logits_at_a_128k_vocabulary(chunks: int) -> None:
    """The float32 question at Llama 3's vocabulary (128,256) with bfloat16 logits, on cuda,
    in one chunk and in four (a chunk is a view at another offset: dynamo compiles twice,
    as on a GPU): followed, not listed.

    What the forward keeps grows with the vocabulary, per token: the eager loss keeps its
    float32 log-softmax for backward (4 bytes a token and vocabulary entry; the float32
    copy and the bfloat16 logits are let go of), inductor keeps the bfloat16 logits (2
    bytes) and recomputes the float32 values in backward: no float32 logits tensor is kept.
    Read as the growth of the forward's peak from half the vocabulary to all of it, less
    the head's weight (64 bfloat16 a vocabulary entry), so that everything that does not
    grow with it (the cuBLAS workspace, the body) drops out; what else changes with it
    (the last chunk's temporaries, where the peak falls) stays within a fraction of a
    byte a token for the compiled loss, within two for the eager one (measured: 1.98 and
    2.11 compiled, 10.07 and 5.65 eager, in one chunk and four)."""
    tokens, vocab = 256, 128_256

    def forward_growth(loss: Callable[..., torch.Tensor]) -> float:
        peaks = []
        for v in (vocab // 2, vocab):
            body, head, x, labels = _loss_case(vocab=v, dtype=torch.bfloat16, tokens=tokens)
            report = tm.estimate(_chunked_loss_step(loss, body, head, chunks), (x, labels), device="cuda")
            assert report.unsupported == ()
            peaks.append(report.forward_peak)
        return ((peaks[1] - peaks[0]) / (vocab // 2) - 64 * 2) / tokens

    compiled, eager = forward_growth(_compiled_cross_entropy), forward_growth(_cross_entropy)
    assert 2 - 0.5 < compiled < 2 + 1, compiled  # the bfloat16 logits, no float32 (4 more)
    assert 4 <= eager < 4 + 2 + 4 + 1, eager  # the float32 log-softmax, and at most one chunk's temporaries


# -- layers compiled one by one, reached from a step function --------------------------


def _llama(compile_layers: str | None) -> tuple[nn.Module, torch.Tensor]:
    """transformers' Llama (3 layers, width 128), its decoder layers compiled one by one as
    recipes do (``layer.compile()``, or ``torch.compile(layer)`` put in its place)."""
    transformers = import_transformers()
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if compile_layers == "layer.compile()":
            layer.compile()
        elif compile_layers == "torch.compile(layer)":
            layers[i] = torch.compile(layer)
    return model, torch.randint(0, 512, (1, 128))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("how", ["layer.compile()", "torch.compile(layer)"])
def test_layers_compiled_one_by_one_through_a_step_function_equal_measure(how: str) -> None:
    """The recipe's own loop (a step function), on cpu: transformers' decoder reads its
    mask's values outside the compiled layers (``find_packed_sequence_indices``), which
    the warm-up that builds the programs knows as the traced step does."""
    model, ids = _llama(how)
    optimizer = torch.optim.AdamW(model.parameters())
    estimated = tm.estimate(_train_step, (model, optimizer, ids))
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(tm.measure(_train_step, (model, optimizer, ids)))
    eager, _ = _llama(None)
    eager_report = tm.estimate(_train_step, (eager, torch.optim.AdamW(eager.parameters()), ids))
    assert every_peak(eager_report) != every_peak(estimated)


def test_layers_compiled_one_by_one_through_a_step_function_are_followed_on_cuda() -> None:
    model, ids = _llama("layer.compile()")
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = tm.estimate(_train_step, (model, optimizer, ids), device="cuda")
    assert _compiled_entries(compiled) == []
    eager, _ = _llama(None)
    eager_report = tm.estimate(_train_step, (eager, torch.optim.AdamW(eager.parameters()), ids), device="cuda")
    assert compiled.forward_peak < eager_report.forward_peak


# -- a compiled optimizer step, in a step function -------------------------------------


def _mlp_and_batch() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)), torch.randn(64, 256)


#: The ways users compile an optimizer step (None: eagerly).
COMPILED_STEPS = ["opt.step = torch.compile(opt.step)", "a compiled function that steps it"]


def _adamw_step(
    how: str | None,
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], None], torch.Tensor]:
    """The MLP's training step with AdamW, as a step function writes it, its optimizer
    step compiled ``how`` (one of :data:`COMPILED_STEPS`) or eager: the model, the
    optimizer, the step and its batch."""
    model, x = _mlp_and_batch()
    optimizer = torch.optim.AdamW(model.parameters())
    stepper: Callable[[], Any] = optimizer.step
    if how == COMPILED_STEPS[0]:
        optimizer.step = torch.compile(optimizer.step)  # type: ignore[method-assign]
        stepper = optimizer.step
    elif how == COMPILED_STEPS[1]:
        stepper = torch.compile(lambda: optimizer.step())

    def step(x: torch.Tensor) -> None:
        model(x).square().mean().backward()
        stepper()
        optimizer.zero_grad()

    return model, optimizer, step, x


@pytest.mark.parametrize("how", COMPILED_STEPS)
def test_a_compiled_optimizer_step_in_a_step_function_equals_measure_on_cpu(how: str) -> None:
    """The optimizer holds the traced step's tensors, on which the guards of the program
    the warm-up built fail: dynamo builds it again in the optimizer step, where it is
    compiled with every mode popped (as the built-in step's is) and followed, not listed.
    The compiled step's peak is the measured one, and below the eager step's (foreach
    AdamW's intermediate lists, which inductor fuses away)."""
    model, optimizer, step, x = _adamw_step(how)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimated = tm.estimate(step, (x,))
    # (dynamo traces the optimizer's global hooks into the compiled step: the trace's own
    # run outside its graphs, where dynamo would break the graph and warn of what it met)
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message)[:200] for w in caught]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.state == {}
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(tm.measure(step, (x,)))

    _, _, eager_step, x = _adamw_step(None)
    assert estimated.step_peak < tm.estimate(eager_step, (x,)).step_peak


@pytest.mark.parametrize("how", COMPILED_STEPS)
def test_a_compiled_optimizer_step_in_a_step_function_is_followed_on_cuda(how: str) -> None:
    """On a GPU dynamo makes a compiled optimizer step capturable where its parameters
    are on cuda (``OptimizerVariable._set_capturable``; ``_safe_to_set_capturable`` from
    2.15): AdamW's state, made while dynamo compiles, has its step counters on the GPU
    (four one-element tensors, a 512-byte block each), not on the host; inductor then
    updates parameters and state in place, with no buffer of its own. Eager foreach
    AdamW keeps its counters on the host and makes one list of the parameters' size
    (``_foreach_sqrt`` of exp_avg_sq) at its peak.

    Parameters 256x512 + 512 + 512x256 + 256 floats: 1,051,648 bytes (every tensor a
    whole number of blocks): the compiled step's peak is that much below the eager
    one's, less the four counters (2,048 bytes).
    """
    model, optimizer, step, x = _adamw_step(how)
    parameters = 1_051_648
    assert sum(p.nbytes for p in model.parameters()) == parameters
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = tm.estimate(step, (x,), device="cuda")
    # (dynamo compiles the step through the fake GPU's answers, and breaks no graph there)
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message)[:200] for w in caught]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.state == {}
    assert optimizer.param_groups[0]["capturable"] is False  # the user's optimizer, as it was
    assert compiled.unsupported == ()

    _, _, eager_step, x = _adamw_step(None)
    eager = tm.estimate(eager_step, (x,), device="cuda")
    # (at each step's peak the rest is alike: parameters, gradients, exp_avg, exp_avg_sq)
    assert eager.step_peak - compiled.step_peak == parameters - 4 * 512


def test_the_built_in_steps_compiled_optimizer_step_is_followed_on_cuda() -> None:
    """The built-in step's optimizer compiled as PyTorch's tutorial compiles it
    (``opt.step = torch.compile(opt.step)`` in the factory): followed on cuda as in a
    step function, its peak the eager one's less the parameters' bytes (the eager step's
    ``_foreach_sqrt`` list), plus the four step counters made on the GPU (2,048 bytes)."""

    def compiled(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(params)
        optimizer.step = torch.compile(optimizer.step)  # type: ignore[method-assign]
        return optimizer

    def loss(output: torch.Tensor) -> torch.Tensor:
        return output.square().mean()

    model, x = _mlp_and_batch()
    report = tm.estimate(model, x, device="cuda", optimizer=compiled, loss_fn=loss)
    eager = tm.estimate(model, x, device="cuda", optimizer=torch.optim.AdamW, loss_fn=loss)
    assert report.unsupported == ()
    assert eager.step_peak - report.step_peak == 1_051_648 - 4 * 512
