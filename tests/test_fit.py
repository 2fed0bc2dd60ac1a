"""What fits (issue 26): ``tm.fit`` finds the largest size whose step fits a budget or a
GPU, ``tm.rank_gpus`` ranks GPUs by the room a step leaves.

The search is checked against every monotone figure (hypothesis), and the sizes it
finds against ``measure``: a budget set between the measured peaks of a size and the
next, fit must name that size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.fit.search import _search
from pytest_torchmem.engine.figures.gpu_profiles import CUDA_CONTEXT, usable_memory
from pytest_torchmem.engine.figures.gpu_profiles import PROFILES

_MiB = 1 << 20
_GiB = 1 << 30


# -- the search ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=300, unique=True).map(sorted),
    steps=st.lists(st.integers(0, 10**9), min_size=300, max_size=300),
    limit=st.integers(0, 10**11),
)
def test_the_search_names_the_boundary_of_any_figure_that_never_shrinks(
    sizes: list[int], steps: list[int], limit: int
) -> None:
    """Any nondecreasing figure (steps, plateaus, jumps): the largest size within the
    limit and the next one were both estimated, in at most a bisection's count and one
    guesses after the two ends and the four of the lines between them."""
    figures = dict(zip(sizes, (sum(steps[: i + 1]) for i in range(len(sizes)))))
    probes = _search(sizes, figures.__getitem__, limit, None)
    fitting = [size for size in sizes if figures[size] <= limit]
    found = [p.size for p in probes if p.fits]
    over = [p.size for p in probes if not p.fits]
    assert max(found, default=None) == max(fitting, default=None)
    if fitting and fitting[-1] != sizes[-1]:
        assert min(over) == sizes[len(fitting)]
    assert all(p.nbytes == figures[p.size] and p.fits == (p.nbytes <= limit) for p in probes)
    if len(sizes) > 1:
        assert len(probes) <= 6 + math.ceil(math.log2(len(sizes) - 1)) + 1


@pytest.mark.parametrize(
    ("figure", "most"),
    [
        # a batch: close to affine, rounded to the caching allocator's 2 MiB
        (lambda b: -(-(3 * _GiB + b * 987_654_321) // (2 * _MiB)) * 2 * _MiB, 5),
        # a sequence length under eager attention: quadratic
        (lambda n: _GiB + n * 1_000_000 + n * n * 20_000, 17),
    ],
    ids=["affine", "quadratic"],
)
def test_a_search_over_4096_sizes_takes_few_estimates(figure: Callable[[int], int], most: int) -> None:
    for limit in range(2 * _GiB, 4000 * _GiB, 97 * _GiB):
        probes = _search(range(1, 4097), figure, limit, None)
        assert len(probes) <= most, (limit, [p.size for p in probes])


# -- against measure, on this CPU -------------------------------------------------------------


def _mlp(batch: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, torch.randn(batch, 64)


def _cnn(batch: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )
    return model, torch.randn(batch, 3, 16, 16)


def _encoder(length: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return model, torch.randn(2, length, 64)


class _EagerAttention(nn.Module):
    """softmax(q k^T) v written out: the L x L scores grow with the square of the length."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(32)).softmax(dim=-1)
        return self.out(scores @ v)


def _attention(length: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return _EagerAttention(), torch.randn(2, length, 32)


def _conv_transpose(batch: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(8, 16, 4, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 4, 3, padding=1))
    return model, torch.randn(batch, 8, 8, 8)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


#: name -> (model and inputs of a size, estimate's options, the size the budget picks)
FIVE: dict[str, tuple[Callable[[int], tuple[nn.Module, Any]], dict[str, Any], int]] = {
    "mlp batch, AdamW": (_mlp, {"optimizer": _adamw}, 23),
    "cnn batch": (_cnn, {}, 9),
    "encoder sequence length, AdamW": (_encoder, {"optimizer": _adamw}, 37),
    "eager attention sequence length": (_attention, {}, 41),
    "transposed conv batch": (_conv_transpose, {}, 6),
}


@pytest.mark.parametrize("name", list(FIVE))
def test_fit_is_the_largest_size_measured_to_fit(name: str) -> None:
    """A budget between the measured peaks of a size and of the next: fit names that
    size, with the measured figures at it and at the next."""
    build, options, size = FIVE[name]
    model = build(1)[0]

    def inputs_for(n: int) -> Any:
        return build(n)[1]

    at_size = tm.measure(model, inputs_for(size), **options).peak
    at_next = tm.measure(model, inputs_for(size + 1), **options).peak
    assert at_size < at_next
    budget = (at_size + at_next) // 2
    found = tm.fit(model, inputs_for, sizes=range(1, 65), budget=budget, device="cpu", **options)
    assert (found.size, found.nbytes, found.next_size, found.next_nbytes) == (size, at_size, size + 1, at_next)
    assert found.headroom == budget - at_size and found.figure == "peak"
    assert found.report is not None and found.report.peak == at_size
    assert len(found.probes) <= 6 + math.ceil(math.log2(63)) + 1


def test_fit_takes_a_step_function_and_sizes_of_a_stride() -> None:
    def train_step(model: nn.Module, x: torch.Tensor) -> None:
        for micro in x.chunk(2):
            model(micro).sum().backward()

    model = _mlp(1)[0]
    sizes = range(8, 513, 8)
    budget = tm.estimate(train_step, (model, torch.randn(200, 64))).peak
    found = tm.fit(train_step, lambda n: (model, torch.randn(n, 64)), sizes=sizes, budget=budget, device="cpu")
    assert found.size == 200 and found.next_size == 208
    assert all(p.size in sizes for p in found.probes)


def test_what_fits_nothing_and_what_fits_everything() -> None:
    model = _mlp(1)[0]
    nothing = tm.fit(model, lambda n: torch.randn(n, 64), sizes=range(1, 9), budget=1024, device="cpu")
    assert nothing.size is None and nothing.next_size == 1 and nothing.report is None
    assert str(nothing).startswith("no size fits budget 1.00 KiB: size 1 needs ")
    everything = tm.fit(model, lambda n: torch.randn(n, 64), sizes=range(1, 9), budget="1 GiB", device="cpu")
    assert everything.size == 8 and everything.next_size is None and len(everything.probes) == 2
    assert str(everything).endswith("the largest size searched")


# -- on a GPU: the reserved peak against its usable memory --------------------------------------


def _big_linear() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(65536, 65536, bias=False)  # 16 GiB of float32 weight


def test_the_headroom_and_the_ranking_counted_by_hand() -> None:
    """Inference of a 16 GiB weight on one row (256 KiB in, 256 KiB out). Reserved, by the
    caching allocator's rules: the weight's own segment (16 GiB, a multiple of 2 MiB), one
    2 MiB segment of the small pool for the input and the output, and the cuBLAS
    workspace's segment: 32 MiB on an H100 (its size, at least 10 MiB: rounded to 2 MiB),
    8 MiB + 128 KiB on a T4 and an A100 (between 1 and 10 MiB: a 20 MiB segment). Usable:
    the GPU's memory as the device reports it (H100 81,090 MiB, A100-40GB 40,536 MiB, T4
    15,095 MiB) less the CUDA context held back. It fits the A100-40GB and the H100 (the
    most room first), not the T4."""
    x = torch.randn(1, 65536)
    rooms = tm.rank_gpus(_big_linear(), x, ["T4", "A100-40GB", "H100"], train=False)
    assert [room.gpu for room in rooms] == ["H100", "A100-40GB", "T4"]
    by_hand = {"H100": 16 * _GiB + 2 * _MiB + 32 * _MiB, "A100-40GB": 16 * _GiB + 2 * _MiB + 20 * _MiB}
    by_hand["T4"] = by_hand["A100-40GB"]
    usable = {"H100": 81_090 * _MiB - 512 * _MiB, "A100-40GB": 40_536 * _MiB - 512 * _MiB, "T4": 15_095 * _MiB - 512 * _MiB}
    for room in rooms:
        assert room.reserved_peak == by_hand[room.gpu], room
        assert room.usable == usable[room.gpu] == usable_memory(PROFILES[room.gpu])
        assert room.headroom == usable[room.gpu] - by_hand[room.gpu]
    assert [room.fits for room in rooms] == [True, True, False]
    assert str(rooms[2]) == "T4: does not fit, 16.02 GiB reserved of 14.24 GiB usable, 1.78 GiB over"
    assert CUDA_CONTEXT == 512 * _MiB


def test_fit_on_a_gpu_is_decided_by_the_reserved_peak() -> None:
    """Rows of the 16 GiB layer's input on a T4 with 2 GiB more memory (a GPU of our own):
    the largest row count whose reserved peak stays within the usable memory."""
    gpu = tm.GpuProfile("T4-18GB", memory=18 * _GiB, compute_capability=(7, 5), sm_count=40)
    found = tm.fit(_big_linear(), lambda rows: torch.randn(rows, 65536), gpu=gpu, train=False, size_name="rows")
    assert found.figure == "reserved" and found.limit == 18 * _GiB - CUDA_CONTEXT
    assert found.report is not None and found.nbytes == found.report.reserved_peak <= found.limit
    assert found.next_size == found.size + 1 and found.next_nbytes > found.limit
    assert str(found).startswith(f"rows {found.size} fits T4-18GB: ")


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({}, ValueError, "fit\\(\\) needs a target: gpu='A100-40GB'"),
        ({"budget": "1 GiB", "sizes": []}, ValueError, "sizes is empty"),
        ({"budget": "1 GiB", "sizes": [4, 2]}, ValueError, "ascending order"),
        ({"budget": "1 GiB", "sizes": [0, 2]}, ValueError, "positive integers"),
        ({"budget": "1 GiB", "sizes": 7}, TypeError, "a range or a sequence of integers"),
        ({"budget": "1 GiB", "device": "cpu", "figure": "reserved"}, ValueError, "needs device='cuda'"),
        ({"budget": "1 GiB", "figure": "allocated"}, ValueError, "figure must be 'peak' or 'reserved'"),
        ({"gpu": "H100", "device": "cpu"}, ValueError, "applies to device='cuda' only"),
        ({"budget": "lots"}, ValueError, "cannot read 'lots' as a byte size"),
        ({"gpu": "GTX 9999"}, ValueError, "unknown GPU"),
    ],
)
def test_bad_arguments_are_refused_before_any_estimate(arguments: dict[str, Any], error: type, message: str) -> None:
    def never(size: int) -> Any:
        raise AssertionError("no estimate for bad arguments")

    with pytest.raises(error, match=message):
        tm.fit(nn.Linear(2, 2), never, **arguments)


def test_inputs_that_are_not_a_function_of_the_size_are_refused() -> None:
    with pytest.raises(TypeError, match="a function that builds the inputs for one size"):
        tm.fit(nn.Linear(2, 2), torch.randn(2, 2), budget="1 GiB")


# -- a trace that stops ---------------------------------------------------------------------------


class _NumpyAbove(nn.Module):
    """A step the trace follows up to batch 8, and stops above it (``.numpy()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 8:
            x = torch.from_numpy(x.numpy())  # stops above 8
        return self.fc(x)


def test_a_probe_whose_trace_stops_stops_the_search() -> None:
    """A size whose trace stopped has no figure: fit cannot say whether it fits, and
    raises the stop rather than taking the partial figure (which fits any budget)."""
    seen: list[int] = []
    with pytest.raises(tm.TraceStopped, match="in Tensor.numpy") as info:
        tm.fit(
            _NumpyAbove(),
            lambda batch: torch.randn(batch, 16),
            sizes=range(1, 65),
            budget="1 GiB",
            device="cpu",
            progress=lambda probe: seen.append(probe.size),
        )
    assert info.value.entry.location.endswith(f"test_fit.py:{_line('# stops above 8')}")
    assert 64 not in seen  # (no probe made of the stopped size)


def test_rank_gpus_raises_a_stopped_trace() -> None:
    with pytest.raises(tm.TraceStopped, match="in Tensor.numpy"):
        tm.rank_gpus(_NumpyAbove(), torch.randn(16, 16), gpus=["T4", "H100"])


def _line(text: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, 1):
            if text in line and "_line(" not in line:
                return number
    raise AssertionError(text)
