"""The timeline analysis on hand-written event sequences."""

from __future__ import annotations

from pytest_torchmem.engine.figures.report import Category, ModulePeak
from pytest_torchmem.engine.figures.timeline import Charge, Phase, StorageInfo, Timeline, analyze, replay


def _timeline() -> tuple[Timeline, list[int]]:
    tl = Timeline(module_names=["(model)", "fc"])
    param = tl.new_storage(StorageInfo(100, Category.PARAMETERS))
    inp = tl.new_storage(StorageInfo(10, Category.INPUTS))
    return tl, [param, inp]


def test_phase_peaks_breakdown_and_modules() -> None:
    tl, baseline = _timeline()
    tl.phase(Phase.FORWARD)
    tl.enter(0)
    tl.enter(1)
    act = tl.new_storage(StorageInfo(50, phase=Phase.FORWARD))
    tl.alloc(act)
    tmp = tl.new_storage(StorageInfo(30, phase=Phase.FORWARD))
    tl.alloc(tmp)  # live 190: forward peak
    tl.free(tmp)
    tl.exit(1)
    tl.exit(0)
    tl.phase(Phase.BACKWARD)
    tl.enter(1)
    grad = tl.new_storage(StorageInfo(100, phase=Phase.BACKWARD))
    tl.alloc(grad)  # live 260: overall peak
    tl.exit(1)
    tl.free(act)
    ws = tl.new_storage(StorageInfo(5, Category.WORKSPACE, phase=Phase.BACKWARD))
    tl.alloc(ws)
    tl.free(ws)
    tl.assign_role(grad, Category.GRADIENTS)
    tl.phase(None)

    result = analyze(tl, baseline)
    assert result.baseline == 110
    assert result.phase_peaks == (190, 260, 0)
    assert result.breakdown[Category.GRADIENTS] == 100
    assert result.breakdown[Category.ACTIVATIONS] == 50
    assert result.breakdown[Category.PARAMETERS] == 100
    assert sum(result.breakdown.values()) == 260
    assert result.modules == {"(model)": ModulePeak(190, 0), "fc": ModulePeak(190, 260)}


def test_a_loop_reports_its_last_iteration_and_its_first_beside() -> None:
    """Two iterations: the phase peaks are the second's (the state the first step made
    alive from its start), the first's are ``first_step``; the breakdown is at the larger."""
    tl, baseline = _timeline()
    state = None
    for iteration in (1, 2):
        tl.phase(Phase.FORWARD, iteration)
        act = tl.new_storage(StorageInfo(50, phase=Phase.FORWARD))
        tl.alloc(act)  # forward: 160, then 160 + 20 of state
        tl.phase(Phase.BACKWARD, iteration)
        grad = tl.new_storage(StorageInfo(100, phase=Phase.BACKWARD))
        tl.alloc(grad)  # backward: 260, then 280
        tl.free(act)
        tl.assign_role(grad, Category.GRADIENTS)
        tl.phase(Phase.STEP, iteration)
        if state is None:
            state = tl.new_storage(StorageInfo(20, phase=Phase.STEP))
            tl.alloc(state)
            tl.assign_role(state, Category.OPTIMIZER_STATE)
        tmp = tl.new_storage(StorageInfo(40, phase=Phase.STEP))
        tl.alloc(tmp)  # step: 270 both times
        tl.free(tmp)
        tl.free(grad)  # zero_grad(set_to_none=True)
    tl.phase(None)

    result = analyze(tl, baseline)
    assert result.first_step == (160, 260, 270)
    assert result.phase_peaks == (180, 280, 270)
    assert result.breakdown[Category.OPTIMIZER_STATE] == 20
    assert sum(result.breakdown.values()) == 280


def test_one_iteration_has_no_first_step() -> None:
    tl, baseline = _timeline()
    tl.phase(Phase.FORWARD)
    tl.phase(None)
    assert analyze(tl, baseline).first_step is None


def test_resize_counts_both_blocks_while_copying() -> None:
    tl, baseline = _timeline()
    tl.phase(Phase.FORWARD)
    buf = tl.new_storage(StorageInfo(40, phase=Phase.FORWARD))
    tl.alloc(buf)
    tl.resize(buf, 80)
    tl.free(buf)
    tl.phase(None)
    assert analyze(tl, baseline).phase_peaks[0] == 110 + 120


def test_the_first_role_in_category_order_wins() -> None:
    tl, _ = _timeline()
    sid = tl.new_storage(StorageInfo(8, phase=Phase.STEP))
    tl.assign_role(sid, Category.OPTIMIZER_STATE)
    tl.assign_role(sid, Category.GRADIENTS)
    assert tl.category_of(sid) == Category.GRADIENTS
    assert tl.category_of(tl.new_storage(StorageInfo(8, phase=Phase.FORWARD))) == Category.ACTIVATIONS
    assert tl.category_of(tl.new_storage(StorageInfo(8, phase=Phase.STEP))) == Category.TEMPORARIES


def test_live_at_phase_start_counts_toward_its_peak() -> None:
    tl, baseline = _timeline()
    tl.phase(Phase.FORWARD)
    tl.phase(Phase.BACKWARD)
    tl.phase(Phase.STEP)
    tl.phase(None)
    assert analyze(tl, baseline).phase_peaks == (110, 110, 110)


def test_replay_lists_every_change_of_the_live_bytes() -> None:
    tl, baseline = _timeline()
    tl.phase(Phase.FORWARD)  # event 0
    buf = tl.new_storage(StorageInfo(40, phase=Phase.FORWARD))
    tl.alloc(buf)  # 1
    tl.alloc(buf)  # 2: already live, not counted again
    tl.resize(buf, 80)  # 3: the new block, then the old one given back
    tl.free(buf)  # 4
    tl.free(buf)  # 5: already free
    tl.phase(None)
    assert list(replay(tl, baseline)) == [
        Charge(-1, 0, 100, None),
        Charge(-1, 1, 10, None),
        Charge(1, buf, 40, None),
        Charge(3, buf, 80, None),
        Charge(3, buf, -40, None),
        Charge(4, buf, -80, None),
    ]
    running = peak = 0
    for charge in replay(tl, baseline):
        running += charge.nbytes
        peak = max(peak, running)
    assert peak == analyze(tl, baseline).phase_peaks[0] == 230


def _a_step(nbytes: int, freed_after: list[int]) -> Timeline:
    tl, _ = _timeline()
    tl.phase(Phase.FORWARD)
    kept = tl.new_allocation(StorageInfo(nbytes, phase=Phase.FORWARD))
    other = tl.new_allocation(StorageInfo(20, phase=Phase.FORWARD))
    tl.phase(None)
    for sid in freed_after:  # what Python lets go of after the step, in an order of its own
        tl.free([kept, other][sid])
    return tl


def test_the_digest_is_the_steps_events_and_sizes_until_it_ended() -> None:
    assert _a_step(40, []).digest() == _a_step(40, [1, 0]).digest() == _a_step(40, [0, 1]).digest()
    assert _a_step(40, []).digest() != _a_step(41, []).digest()  # one byte more
    moved = _a_step(40, [])
    moved.events[-3], moved.events[-2] = moved.events[-2], moved.events[-3]  # the same allocations, in another order
    assert moved.digest() != _a_step(40, []).digest()
    assert len(_a_step(40, []).digest()) == 16
