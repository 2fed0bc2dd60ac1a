"""Inputs and outputs as users have them: any Mapping, dataclasses, named tuples, ModelOutputs.

Every figure is checked against ``measure()`` on the same step, and the input
bytes against a count by hand (float32: 4 bytes an element).
"""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.user.containers import map_tensors, tensors_in
from pytest_torchmem.engine.user.loss import default_loss

F32 = 4


def _both(model: nn.Module, inputs: Any, **options: Any) -> tm.MemoryReport:
    """The estimate, after checking that it is complete and equals the measurement."""
    estimated = tm.estimate(model, inputs, **options)
    measured = tm.measure(model, inputs, **options)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()
    assert estimated.breakdown == measured.breakdown
    assert estimated.modules == measured.modules
    return estimated


# -- keyword inputs: any Mapping ----------------------------------------------------


class ReadOnly(Mapping[str, Any]):
    """A Mapping that is not a dict: what a library's own batch type may be."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def _batch_encoding(data: dict[str, Any]) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding(data)


MAPPINGS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "dict": dict,
    "UserDict": collections.UserDict,
    "MappingProxyType": types.MappingProxyType,
    "abc.Mapping": ReadOnly,
    "BatchEncoding": _batch_encoding,
}


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.fc(input_ids * attention_mask)


@pytest.mark.parametrize("kind", list(MAPPINGS))
def test_any_mapping_gives_keyword_inputs(kind: str) -> None:
    """Regression: a tokenizer's BatchEncoding (a UserDict, not a dict) was refused with
    ``TypeError: inputs must be a tensor, a tuple ... or a dict ..., got BatchEncoding``.
    Every Mapping is keyword arguments now, with the same figures as a dict; its two
    (2, 8) float tensors are the inputs: 2 * 64 B."""
    torch.manual_seed(0)
    model = Masked()
    data = {"input_ids": torch.randn(2, 8), "attention_mask": torch.ones(2, 8)}
    batch = MAPPINGS[kind](data)
    report = _both(model, batch)
    assert report.breakdown[tm.Category.INPUTS] == 2 * 2 * 8 * F32
    assert report.phase_peaks() == tm.estimate(model, data).phase_peaks()
    assert all(batch[key] is data[key] for key in data)  # the user's batch is untouched


# -- nested inputs: dataclasses, named tuples, lists, dicts, mappings ---------------------


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Extra:
    scale: torch.Tensor
    note: str = "kept as it is"


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    pair: Pair
    extras: list[dict[str, Any]]
    by_name: collections.UserDict  # type: ignore[type-arg]
    steps: int = 3


class Nested(nn.Module):
    """Takes a Batch and checks that each container arrives as the type the user made."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, batch: Batch) -> torch.Tensor:
        assert type(batch) is Batch and type(batch.pair) is Pair
        assert type(batch.extras[0]["extra"]) is Extra and batch.extras[0]["extra"].note == "kept as it is"
        assert type(batch.by_name) is collections.UserDict and batch.steps == 3
        h = self.fc(batch.x) * batch.pair.left + batch.pair.right.sum()
        return h * batch.extras[0]["extra"].scale + batch.by_name["bias"]


def _batch() -> Batch:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    return Batch(
        x=x,
        pair=Pair(torch.randn(4, 8), x[:, :2]),  # right: a view of x, same storage
        extras=[{"extra": Extra(torch.randn(8))}],
        by_name=collections.UserDict(bias=torch.randn(8)),
    )


def test_nested_dataclasses_named_tuples_and_mappings_are_inputs() -> None:
    """Stand-ins for every tensor in the nested containers are made and charged as
    inputs, a storage shared by two of them once: x (4, 8) 128 B with pair.right a view
    of it, pair.left 128 B, extra.scale 32 B, bias 32 B: 320 B."""
    batch = _batch()
    report = _both(Nested(), (batch,))
    assert report.breakdown[tm.Category.INPUTS] == (4 * 8 + 4 * 8 + 8 + 8) * F32


def test_the_users_inputs_are_untouched() -> None:
    batch = _batch()
    containers = [batch, batch.pair, batch.extras, batch.extras[0], batch.extras[0]["extra"], batch.by_name]
    before = [(id(c), id(t), t.clone()) for c in containers for t in tensors_in(c)]
    by_name_data = batch.by_name.data
    for entry in (tm.estimate, tm.measure):
        entry(Nested(), (batch,))
    after = [(id(c), id(t), t) for c in containers for t in tensors_in(c)]
    assert [(a, b) for a, b, _ in before] == [(a, b) for a, b, _ in after]
    assert all(torch.equal(old, new) for (_, _, old), (_, _, new) in zip(before, after))
    assert batch.by_name.data is by_name_data and not isinstance(batch.x, torch._subclasses.FakeTensor)


def test_map_tensors_copies_only_what_holds_tensors() -> None:
    """Containers with no tensor stay the same objects; one met twice is copied once."""
    shared = {"t": torch.ones(1)}
    plain = ("no", ["tensors", 1])
    value = {"a": shared, "b": shared, "plain": plain, "extra": Extra(torch.zeros(2))}
    mapped = map_tensors(lambda t: t + 1, value)
    assert mapped["plain"] is plain and mapped["a"] is mapped["b"] and mapped["a"] is not shared
    assert mapped["extra"].note == "kept as it is" and torch.equal(mapped["extra"].scale, torch.ones(2))
    assert torch.equal(shared["t"], torch.ones(1))  # the original holds its own tensor


def test_batch_encoding_keeps_its_attributes_in_the_copy() -> None:
    transformers = pytest.importorskip("transformers")
    seen: list[Any] = []

    class TakesEncoding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, batch: Any) -> torch.Tensor:
            seen.append((type(batch), batch.n_sequences, batch.input_ids.shape))
            return self.fc(batch["input_ids"])

    batch = transformers.BatchEncoding({"input_ids": torch.randn(3, 4)}, n_sequences=1)
    report = _both(TakesEncoding(), (batch,))
    assert report.breakdown[tm.Category.INPUTS] == 3 * 4 * F32
    assert seen == [(transformers.BatchEncoding, 1, torch.Size([3, 4]))] * 2


# -- outputs: the default loss finds the tensors wherever they are -----------------------


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    extra: dict[str, Any]


class Halves(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


def _model_output(**fields: Any) -> Any:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    return outputs.BaseModelOutputWithPooling(**fields)


#: Output kind -> (how the model wraps h, tanh(h) and the int argmax; the loss a user
#: would write for it: the sum of the floating tensors, h first).
OUTPUTS: dict[str, tuple[Callable[..., Any], Callable[[Any], torch.Tensor]]] = {
    "tuple": (lambda h, g, ids: (h, (g, ids)), lambda out: out[0].sum() + out[1][0].sum()),
    "NamedTuple": (lambda h, g, ids: Halves(h, g), lambda out: out.first.sum() + out.second.sum()),
    "dataclass": (
        lambda h, g, ids: Out(h, {"more": [g], "ids": ids}),
        lambda out: out.hidden.sum() + out.extra["more"][0].sum(),
    ),
    "list-of-dataclass": (
        lambda h, g, ids: [Out(h, {"g": Halves(g, g[:0])})],
        lambda out: out[0].hidden.sum() + out[0].extra["g"].first.sum() + out[0].extra["g"].second.sum(),
    ),
    "ModelOutput": (
        lambda h, g, ids: _model_output(last_hidden_state=h, pooler_output=g),
        lambda out: out.last_hidden_state.sum() + out.pooler_output.sum(),
    ),
}


class Wraps(nn.Module):
    def __init__(self, wrap: Callable[..., Any]) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> Any:
        h = self.fc(x)
        return self.wrap(h, torch.tanh(h), h.argmax(-1))


@pytest.mark.parametrize("kind", list(OUTPUTS))
def test_default_loss_sums_every_floating_tensor_of_the_output(kind: str) -> None:
    """Regression: outputs that are dataclasses hid their tensors from the default
    loss ("holds no floating-point tensor"). The default loss is the sum of the
    floating tensors, h then tanh(h) (the int argmax left out): the same step, byte for
    byte, as ``loss_fn=lambda out: h.sum() + tanh(h).sum()``."""
    torch.manual_seed(0)
    wrap, loss_fn = OUTPUTS[kind]
    model, x = Wraps(wrap), torch.randn(4, 8)
    report = _both(model, x)
    assert report.phase_peaks() == tm.estimate(model, x, loss_fn=loss_fn).phase_peaks()


def test_default_loss_values() -> None:
    h, g = torch.randn(2, 3), torch.randn(3)
    assert torch.equal(default_loss(Out(h, {"g": [g], "n": torch.ones(2, dtype=torch.long)})), h.sum() + g.sum())
    loss = torch.tensor(1.5)

    @dataclasses.dataclass
    class WithLoss:
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    assert default_loss(WithLoss(h, loss)) is loss  # the attribute, as ModelOutput.loss
    assert torch.equal(default_loss(WithLoss(h)), h.sum())  # loss None: the sum
    assert default_loss({"loss": loss, "logits": h}) is loss
    outputs = pytest.importorskip("transformers.modeling_outputs")
    assert default_loss(outputs.CausalLMOutput(loss=loss, logits=h)) is loss
    assert torch.equal(default_loss(outputs.CausalLMOutput(logits=h)), h.sum())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> Out:
        return Out(torch.relu(self.fc(x)), {})


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(), Block()

    def forward(self, x: torch.Tensor) -> Out:
        return self.second(self.first(x).hidden)


def test_modules_returning_dataclasses_are_followed_through_backward() -> None:
    """A module's backward is found from the gradients of its outputs: tensors in a
    dataclass output count (before, such modules had no backward figure)."""
    torch.manual_seed(0)
    report = _both(Blocks(), torch.randn(8, 16))
    assert report.modules["first"].backward > 0 and report.modules["second"].backward > 0


# -- bad input -------------------------------------------------------------------------


class NoRebuild(ReadOnly):
    def __init__(self, data: Mapping[str, Any], required: int) -> None:
        super().__init__(data)


@pytest.mark.parametrize(
    ("inputs", "error", "match"),
    [
        (types.MappingProxyType({1: torch.ones(2, 8)}), TypeError, "string keys, got 1"),
        (Halves(torch.ones(2, 8), torch.ones(2, 8)), TypeError, "takes 2 positional arguments"),
        (Out(torch.ones(2, 8), {}), TypeError, r"got Out; pass \(inputs,\) to give it to the model"),
        (
            (NoRebuild({"x": torch.ones(2, 8)}, 0),),
            TypeError,
            r"cannot copy the NoRebuild in the inputs .* NoRebuild\(dict\) failed .* pass a dict",
        ),
    ],
    ids=["int-key", "namedtuple-is-positional", "dataclass-at-top", "mapping-not-rebuildable"],
)
@pytest.mark.parametrize("entry", [tm.estimate, tm.measure], ids=["estimate", "measure"])
def test_bad_inputs_are_named(entry: Any, inputs: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        entry(nn.Linear(8, 2), inputs)


def test_inputs_that_contain_themselves_are_refused() -> None:
    loop: list[Any] = [torch.ones(2, 8)]
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        tm.estimate(nn.Linear(8, 2), (loop,))
