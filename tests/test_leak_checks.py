"""The leak check (tm.leaks): growth per iteration, exact against real runs, and what holds it.

Each pattern of tests/leak_patterns.py runs as a loop runs it: its growth per
iteration is its hand count (tests/leak_patterns.py: GROWTH) and, on cpu, what
``measure=True`` reads from the profiler's allocator events over the same
iterations, to the byte, after every iteration; what the first iterations make once
(an optimizer's state, a scaler, a lazy module) is no leak. The user's objects are
as they were after every check (tests/fingerprint.py).
"""

from __future__ import annotations

import pytest
import torch
from fingerprint import fingerprint
from following import follows_compiled
from leak_patterns import GROWTH, LEAKS, NOT_LEAKS, Caching, batch, growing_batches, mlp

import pytest_torchmem as tm
from pytest_torchmem.engine.leaks.check import steady_state

MiB = 2**20


def cuda_block(nbytes: int) -> int:
    """What a storage of ``nbytes`` costs under CUDA's caching allocator (small ones: a
    multiple of 512 B; none here is larger than 1 MiB)."""
    return max(512, -(-nbytes // 512) * 512)


@pytest.mark.parametrize("name", LEAKS)
def test_each_leak_grows_by_its_hand_count_and_as_measure_reads_it(name: str) -> None:
    step, args, holder = LEAKS[name]()
    before = fingerprint(step, args)
    estimated = tm.leaks(step, args)
    measured = tm.leaks(step, args, measure=True)
    assert fingerprint(step, args) == before
    assert estimated.held == measured.held  # after every iteration, to the byte
    assert estimated.per_iteration == measured.per_iteration == sum(GROWTH[name])
    assert estimated.leaks and estimated.steady_from is not None and estimated.unsupported == ()
    # what holds it: all of it, named as the code names it, with the fix
    assert sum(source.bytes for source in estimated.sources) == estimated.per_iteration
    for source in estimated.sources:
        assert holder in source.held_by, source
        assert source.fix and source.held_by in source.fix
        assert "leak_patterns.py:" in source.made_at


@pytest.mark.parametrize("name", LEAKS)
def test_each_leak_on_the_fake_gpu_grows_by_its_blocks(name: str) -> None:
    step, args, holder = LEAKS[name]()
    before = fingerprint(step, args)
    report = tm.leaks(step, args, device="cuda")
    assert fingerprint(step, args) == before
    blocks = sum(cuda_block(nbytes) for nbytes in GROWTH[name])
    assert report.per_iteration == blocks
    assert sum(source.bytes for source in report.sources) == blocks
    assert all(holder in source.held_by for source in report.sources)
    assert report.reserved_per_iteration == 0 and not report.fragmentation


@pytest.mark.parametrize("name", NOT_LEAKS)
def test_what_the_first_iterations_make_once_is_no_leak(name: str) -> None:
    step, args = NOT_LEAKS[name]()[:2]
    before = fingerprint(step, args)
    estimated = tm.leaks(step, args)
    measured = tm.leaks(step, args, measure=True)
    on_gpu = tm.leaks(step, args, device="cuda")
    assert fingerprint(step, args) == before
    assert estimated.held == measured.held
    assert estimated.growth[0] > 0  # (it does make something in its first iteration)
    for report in (estimated, measured, on_gpu):
        assert report.per_iteration == 0 and not report.leaks and report.sources == ()
        assert report.steady_from is not None
    assert on_gpu.reserved_per_iteration == 0 and not on_gpu.fragmentation


def test_segments_that_grow_while_nothing_is_held_are_fragmentation() -> None:
    report = tm.leaks(growing_batches, (torch.randn(4), [0]), device="cuda")
    assert report.per_iteration == 0 and not report.leaks
    # a new segment for each batch (32 MiB more each time: larger than any cached block),
    # beside the 2 MiB segment of small blocks that holds the input
    assert report.reserved == tuple(2 * MiB + 32 * MiB * n * (n + 1) // 2 for n in range(1, 5))
    assert report.reserved_per_iteration == 4 * 32 * MiB
    assert report.fragmentation


def test_the_built_in_step_is_checked_as_a_loop_runs_it() -> None:
    model, x = Caching(), batch()
    before = fingerprint(model, x)
    kept = tm.leaks(model, x)
    assert kept.held == tm.leaks(model, x, measure=True).held
    assert kept.per_iteration == sum(GROWTH["a module appends its activations"])
    assert [source.held_by for source in kept.sources] == ["model.activations"]
    assert fingerprint(model, x) == before
    model, x = mlp(), batch()
    adamw = tm.leaks(model, x, optimizer=lambda p: torch.optim.AdamW(p))
    assert adamw.held == tm.leaks(model, x, optimizer=lambda p: torch.optim.AdamW(p), measure=True).held
    assert adamw.per_iteration == 0 and adamw.growth[0] >= 2 * sum(p.numel() * 4 for p in model.parameters())
    assert fingerprint(model, x) == fingerprint(mlp(), batch())


@follows_compiled
def test_a_compiled_model_is_checked_as_its_compiled_program_runs() -> None:
    model, x = Caching(), batch()
    compiled = torch.compile(model)
    before = fingerprint(model, x)
    kept = tm.leaks(compiled, x)
    assert kept.unsupported == ()  # (the compiled program followed, not the eager one)
    assert kept.held == tm.leaks(compiled, x, measure=True).held
    assert kept.per_iteration == sum(GROWTH["a module appends its activations"])
    assert [source.held_by for source in kept.sources] == ["model.activations"]
    assert fingerprint(model, x) == before


def test_a_steady_state_reached_late_runs_more_iterations() -> None:
    def fills_three_times(x: torch.Tensor, cache: list[torch.Tensor]) -> None:
        if len(cache) < 3:
            cache.append(x.clone())

    report = tm.leaks(fills_three_times, (batch(), []))
    assert report.iterations == 8  # four showed no steady state (the third grew, the fourth not)
    assert report.growth[1:] == (2048, 2048, 0, 0, 0, 0, 0)
    assert report.steady_from == 4 and report.per_iteration == 0
    assert tm.leaks(fills_three_times, (batch(), []), iterations=5).held == report.held[:5]


def test_iterations_must_show_a_steady_state() -> None:
    step, args = NOT_LEAKS["AdamW's state"]()
    with pytest.raises(ValueError, match="iterations must be an int of at least 3"):
        tm.leaks(step, args, iterations=2)
    with pytest.raises(ValueError, match="gpu= and cpu= apply to the estimate only"):
        tm.leaks(step, args, measure=True, gpu="H100")


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        ((10, 10, 10, 10), (2, 0)),
        # leaking from the first iteration on (the steady state is counted from the second:
        # the first is the one that makes what is made once)
        ((10, 20, 30, 40), (2, 10)),
        ((50, 60, 70, 80), (2, 10)),  # the first made more (its state), then 10 each
        ((10, 20, 20, 30), (None, 10)),  # no steady state: the last two differ
        ((10, 20, 30, 30), (None, 0)),
    ],
)
def test_steady_state(held: tuple[int, ...], expected: tuple[int | None, int]) -> None:
    assert steady_state(0, held) == expected


def test_a_leak_report_round_trips_through_json() -> None:
    step, args, _ = LEAKS["a module appends its activations"]()
    report = tm.leaks(step, args)
    assert tm.LeakReport.from_json(report.to_json()) == report
