"""Verdicts: marker parsing, tolerances, statuses, GPU measurement, the failure message."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pytest_torchmem.engine.figures.gpu_profiles import PROFILES, GpuProfile
from pytest_torchmem.plugin.snapshots import Entry, Key
from pytest_torchmem.plugin.judging import EnvChange, Result, Status, Tolerance, judge
from pytest_torchmem.plugin.markers import MarkerError, parse_marker
from pytest_torchmem.plugin.messages import failure_message

DEVICES = ("cpu", "cuda")
KEY = Key("test_x", "default", "cpu")


def mark(*args: Any, **kwargs: Any) -> Any:
    return SimpleNamespace(args=args, kwargs=kwargs)


def entry(forward: int = 1000, backward: int = 2000, step: int = 0, **kwargs: Any) -> Entry:
    kwargs.setdefault("environment", {"torch": "2.13.0", "cpu_threads": 2})
    return Entry(forward_peak=forward, backward_peak=backward, step_peak=step, **kwargs)


def verdict(estimate: Entry, snapshot: Entry | None, **kwargs: Any) -> Result:
    options: dict[str, Any] = dict(
        nodeid="t.py::test_x",
        key=KEY,
        file="__torchmem__/t.json",
        accept='pytest --torchmem-update "t.py::test_x"',
        tolerance=Tolerance(),
        budgets={},
        update=False,
        fail_on_improvement=False,
    )
    options.update(kwargs)
    return judge(estimate=estimate, snapshot=snapshot, **options)


def test_marker_budgets_binary_and_decimal_units_exact() -> None:
    spec = parse_marker(
        [mark(forward="1.5 GiB", backward="2 GB", step=4096, peak="512 MiB")], DEVICES
    )
    assert spec.budgets == {
        "forward": 1536 * 2**20,
        "backward": 2 * 10**9,
        "step": 4096,
        "peak": 512 * 2**20,
    }
    assert spec.devices is None and spec.rtol is None and spec.atol is None


def test_marker_closest_overrides_farther_key_by_key() -> None:
    function, module = mark(peak="1 MiB", rtol=0.1), mark(peak="2 MiB", devices="cpu", atol="1 KiB")
    spec = parse_marker([function, module], DEVICES)  # iter_markers: closest first
    assert spec.budgets == {"peak": 2**20}
    assert spec.devices == ("cpu",)
    assert spec.rtol == 0.1
    assert spec.atol == 1024
    assert spec.tolerance(Tolerance(0.5, 7)) == Tolerance(0.1, 1024)
    assert parse_marker([mark()], DEVICES).tolerance(Tolerance(0.5, 7)) == Tolerance(0.5, 7)


@pytest.mark.parametrize(
    ("kwargs", "args", "message"),
    [
        ({"peak": "12 parsecs"}, (), "memory_budget(peak='12 parsecs'): unknown unit 'parsecs'"),
        ({"forward": -1}, (), "memory_budget(forward=-1): a byte size cannot be negative"),
        ({"step": 1.5}, (), "memory_budget(step=1.5): a byte size must be an int"),
        ({"devices": ("tpu",)}, (), "device 'tpu' is not modelled"),
        ({"devices": ()}, (), "devices must name at least one device"),
        ({"devices": 3}, (), "memory_budget(devices=3): devices must be a name or a tuple"),
        ({"rtol": "lots"}, (), "memory_budget(rtol='lots'): cannot read 'lots'"),
        ({"rtol": -0.1}, (), "cannot be negative, got -0.1"),
        ({"rtol": True}, (), "must be a number"),
        ({"atol": "1 parsec"}, (), "memory_budget(atol='1 parsec')"),
        ({"budget": 1}, (), "does not know 'budget'"),
        ({}, ("1 GiB",), "keyword arguments only"),
    ],
)
def test_malformed_markers_name_the_value(
    kwargs: dict[str, Any], args: tuple[Any, ...], message: str
) -> None:
    with pytest.raises(MarkerError) as info:
        parse_marker([mark(*args, **kwargs)], DEVICES)
    assert message in str(info.value)


def test_tolerance_is_atol_plus_rtol_times_reference() -> None:
    tolerance = Tolerance(rtol=0.1, atol=24)
    assert tolerance.allowed(1000) == 124
    assert (
        verdict(entry(forward=1124), entry(forward=1000), tolerance=tolerance).status
        is Status.PASSED
    )
    result = verdict(entry(forward=1125), entry(forward=1000), tolerance=tolerance)
    assert result.status is Status.REGRESSED and result.failed


def test_statuses() -> None:
    same = entry()
    assert verdict(same, entry()).status is Status.PASSED
    missing = verdict(same, None)
    assert missing.status is Status.MISSING and missing.failed
    improved = verdict(entry(backward=1500), entry())
    assert improved.status is Status.IMPROVED and not improved.failed
    strict = verdict(entry(backward=1500), entry(), fail_on_improvement=True)
    assert strict.status is Status.IMPROVED and strict.failed
    # One figure grew and another shrank: a regression.
    assert verdict(entry(forward=1001, backward=1500), entry()).status is Status.REGRESSED


def test_update_accepts_drift_and_missing_but_not_budgets() -> None:
    assert verdict(entry(), None, update=True).status is Status.NEW
    updated = verdict(entry(forward=5000), entry(), update=True)
    assert updated.status is Status.UPDATED and not updated.failed
    assert verdict(entry(), entry(), update=True).status is Status.PASSED
    over = verdict(entry(forward=5000), entry(), update=True, budgets={"peak": 4096})
    assert over.status is Status.OVER_BUDGET and over.failed
    assert not over.acceptable


def test_budgets_apply_to_each_phase_and_the_peak() -> None:
    result = verdict(
        entry(forward=1000, backward=3000, step=2500),
        None,
        budgets={"backward": 2999, "step": 2500, "peak": 2000},
    )
    assert [(b.figure, b.value, b.limit) for b in result.breaches] == [
        ("backward", 3000, 2999),
        ("peak", 3000, 2000),
    ]
    assert result.status is Status.OVER_BUDGET


def test_gpu_measurement_disagreeing_with_the_estimate_says_which_moved() -> None:
    snapshot = entry(
        forward=1000, backward=2000, measured={"forward_peak": 1000, "backward_peak": 2000}
    )
    # The estimate stayed, the measurement grew: the device model misses something.
    now = entry(forward=1000, backward=2000, measured={"forward_peak": 1000, "backward_peak": 2400})
    result = verdict(now, snapshot, measure_rtol=0.05)
    assert result.status is Status.MISMATCH and result.failed
    (mismatch,) = result.mismatches
    assert (mismatch.figure, mismatch.estimate, mismatch.measured) == ("backward", 2000, 2400)
    assert mismatch.estimate_moved == 0 and mismatch.measured_moved == 400
    message = failure_message([result])
    assert "measured 2.34 KiB on the GPU, estimated 1.95 KiB" in message
    assert "the estimate did not move since the snapshot, the measurement moved +400 B" in message
    # Within the measurement tolerance (5 % of 2400 = 120 B): no mismatch.
    close = entry(
        forward=1000, backward=2300, measured={"forward_peak": 1000, "backward_peak": 2400}
    )
    assert not verdict(close, entry(forward=1000, backward=2300)).mismatches


def test_result_json_round_trip() -> None:
    result = verdict(
        entry(forward=1500, measured={"forward_peak": 1}), entry(), budgets={"peak": 10}
    )
    assert Result.from_json(result.to_json()) == result


def _regression() -> Result:
    before = entry(
        forward=1000,
        backward=2000,
        breakdown={"activations": 500, "parameters": 400, "gradients": 400},
        modules={"(model)": (1000, 2000), "encoder": (900, 2000), "head": (1000, 1800)},
    )
    after = entry(
        forward=1000,
        backward=2600,
        breakdown={"activations": 1100, "parameters": 400, "gradients": 400},
        modules={"(model)": (1000, 2600), "encoder": (900, 2600), "head": (1000, 1850)},
    )
    return verdict(after, before, tolerance=Tolerance(0.02, 0))


def test_failure_message_default_verbosity() -> None:
    message = failure_message([_regression()], verbosity=0)
    assert message.splitlines() == [
        "torchmem: regressed on cpu: t.py::test_x [default]",
        "cpu backward peak grew: estimate 2.54 KiB, snapshot 1.95 KiB: +600 B (+30.0%), "
        "allowed \u00b140 B (rtol 0.02, atol 0 B)",
        "  categories that moved most (at the peak): activations +600 B (+120.0%)",
        "  modules that moved most (backward peak): encoder +600 B (+30.0%), head +50 B (+2.8%)",
        'snapshot: __torchmem__/t.json, key "test_x" > "default" > "cpu" (entry)',
        'accept the change with: pytest --torchmem-update "t.py::test_x"',
    ]


def test_failure_message_short_under_q_and_complete_under_vv() -> None:
    result = _regression()
    short = failure_message([result], verbosity=-1).splitlines()
    assert short == [
        "torchmem: regressed on cpu: t.py::test_x [default]",
        "cpu backward peak grew: estimate 2.54 KiB, snapshot 1.95 KiB: +600 B (+30.0%), "
        "allowed \u00b140 B (rtol 0.02, atol 0 B)",
        'accept the change with: pytest --torchmem-update "t.py::test_x"',
    ]
    full = failure_message([result], verbosity=2)
    assert "  backward        2.54 KiB        1.95 KiB        +600 B (+30.0%)" in full
    assert "  peak            2.54 KiB        1.95 KiB        +600 B (+30.0%)" in full
    assert "(model)" not in full  # the whole model always moves with the peak: noise


def test_missing_entry_message_prints_the_create_command() -> None:
    message = failure_message([verdict(entry(), None)], verbosity=0)
    assert "cpu: no snapshot entry (estimate: peak 1.95 KiB)" in message
    assert message.endswith('create the entry with: pytest --torchmem-update "t.py::test_x"')


def test_budget_message_says_update_does_not_lift_it() -> None:
    result = verdict(
        entry(forward=5000), entry(forward=5000), update=True, budgets={"forward": 4096}
    )
    message = failure_message([result], verbosity=0)
    assert (
        "cpu forward peak over budget: estimate 4.88 KiB, budget 4.00 KiB (memory_budget(forward=...)): 904 B over"
        in message
    )
    assert "--torchmem-update does not lift it" in message
    assert "accept the change" not in message


# -- stale environments ------------------------------------------------------------------


def test_entry_from_another_environment_is_stale_not_compared() -> None:
    """Regression guard: bytes recorded with other CPU kernels (thread count) are not compared."""
    snapshot = entry(forward=1000, environment={"torch": "2.13.0", "cpu_threads": 4})
    now = entry(forward=9000)  # would be a regression in the same environment
    result = verdict(now, snapshot)
    assert result.status is Status.STALE and not result.failed
    assert result.stale == (EnvChange("cpu_threads", 4, 2),)
    assert not result.moved("grew")
    assert result.acceptable
    # Asked to: the stale entry fails, and the message says what differs and how to re-record it.
    strict = verdict(now, snapshot, fail_on_stale=True)
    assert strict.status is Status.STALE and strict.failed
    assert failure_message([strict]).splitlines() == [
        "torchmem: stale on cpu: t.py::test_x [default]",
        (
            "cpu: the snapshot entry was recorded in another environment (cpu_threads 4 -> 2): "
            "its figures are not compared with this run's (estimate: peak 8.79 KiB, snapshot: "
            "peak 1.95 KiB)"
        ),
        'snapshot: __torchmem__/t.json, key "test_x" > "default" > "cpu" (entry)',
        're-record the entry on this machine with: pytest --torchmem-update "t.py::test_x"',
    ]
    assert Result.from_json(strict.to_json()) == strict


def test_stale_names_every_difference_and_budgets_still_apply() -> None:
    snapshot = entry(environment={"torch": "2.12.0", "gpu": "A100"})
    now = entry(forward=5000, environment={"torch": "2.13.0", "gpu": "H100", "extra": 1})
    result = verdict(now, snapshot, budgets={"forward": 4096})
    assert [str(change) for change in result.stale] == [
        "extra - -> 1",
        "gpu A100 -> H100",
        "torch 2.12.0 -> 2.13.0",
    ]
    assert result.status is Status.OVER_BUDGET and result.failed
    message = failure_message([result])
    assert "cpu forward peak over budget: estimate 4.88 KiB, budget 4.00 KiB" in message
    assert "recorded in another environment (extra - -> 1, gpu A100 -> H100, torch" in message


def test_update_rewrites_a_stale_entry() -> None:
    snapshot = entry(environment={"torch": "2.12.0", "cpu_threads": 2})
    result = verdict(entry(), snapshot, update=True)
    assert result.status is Status.UPDATED and not result.failed and not result.stale


def test_marker_gpu_is_checked_against_the_known_profiles() -> None:
    custom = {"RTX4070TiS": GpuProfile("RTX4070TiS", memory="16 GiB", compute_capability="8.9", sm_count=66)}
    assert parse_marker([mark(gpu="a100")], DEVICES).gpu == PROFILES["A100"]
    assert parse_marker([mark(gpu="A100"), mark(gpu="V100")], DEVICES).gpu == PROFILES["A100"]
    assert parse_marker([mark(peak=1)], DEVICES).gpu is None
    # a name of the ini table (case-insensitive), a profile line, a GpuProfile
    assert parse_marker([mark(gpu="rtx4070tis")], DEVICES, custom).gpu is custom["RTX4070TiS"]
    written = parse_marker([mark(gpu="Mine: memory=12GiB cc=8.6 sms=28")], DEVICES).gpu
    assert written == GpuProfile("Mine", memory=12 << 30, compute_capability=(8, 6), sm_count=28)
    assert parse_marker([mark(gpu=custom["RTX4070TiS"])], DEVICES).gpu is custom["RTX4070TiS"]
    with pytest.raises(MarkerError) as error:
        parse_marker([mark(gpu="TPUv5")], DEVICES, custom)
    assert str(error.value) == (
        f"memory_budget(gpu='TPUv5'): unknown GPU profile 'TPUv5'; known profiles: "
        f"{', '.join(PROFILES)}, RTX4070TiS; describe another in the ini option torchmem_gpus "
        "(NAME: memory=16GiB cc=8.9 sms=66), or use 'current' for this machine's GPU"
    )
    with pytest.raises(MarkerError) as error:
        parse_marker([mark(gpu="Mine: memory=12GiB cc=8.6")], DEVICES)
    assert str(error.value) == (
        "memory_budget(gpu='Mine: memory=12GiB cc=8.6'): GPU profile 'Mine': missing sms=; a "
        "profile needs memory, cc and sms, e.g. 'RTX4070TiS: memory=16GiB cc=8.9 sms=66'"
    )
