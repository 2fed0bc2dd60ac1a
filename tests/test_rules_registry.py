"""The per-op rule registry."""

from __future__ import annotations

import pytest
import torch

from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, OpCall, RuleSet

aten = torch.ops.aten


def test_duplicates_are_refused_naming_the_op() -> None:
    rules = RuleSet("test")

    @rules.scratch(aten.mm.default)
    def first(call: OpCall) -> list[object]:
        return [OUTPUTS]

    with pytest.raises(ValueError, match=r"aten.mm.default already has a scratch rule \(.*first\)"):
        rules.scratch(aten.mm.default)(lambda call: [])


def test_a_packet_registers_every_overload() -> None:
    rules = RuleSet("test")
    rules.scratch(aten.add)(lambda call: [Alloc("x", 1)])
    assert rules.scratch_rule(aten.add.Tensor) is rules.scratch_rule(aten.add.Scalar)
    assert "aten.add.Tensor" in rules.ops()["scratch"]


def test_copies_are_independent() -> None:
    rules = RuleSet("a")
    other = rules.copy("b")
    other.fallback(aten.nonzero.default)(lambda call: (None, ""))
    assert rules.fallback_rule(aten.nonzero.default) is None
    assert other.device == "b"


def test_composite_rules_are_a_kind_of_their_own() -> None:
    """A composite rule (run with the tracker active) is registered, listed, copied and
    refused twice like the other kinds; the CPU rules trace ``linalg_pinv``'s parts."""
    rules = RuleSet("test")
    rules.composite(aten.linalg_pinv.atol_rtol_tensor)(lambda call: None)
    assert rules.ops()["composite"] == ["aten.linalg_pinv.atol_rtol_tensor"]
    assert rules.copy().composite_rule(aten.linalg_pinv.atol_rtol_tensor) is not None
    with pytest.raises(ValueError, match="already has a composite rule"):
        rules.composite(aten.linalg_pinv.atol_rtol_tensor)(lambda call: None)
    from pytest_torchmem.engine.tracing.devices.cpu import CPU

    assert CPU.composite_rule(aten.linalg_pinv.atol_rtol_tensor) is not None


def test_only_aten_ops() -> None:
    with pytest.raises(TypeError, match="registered for aten ops"):
        RuleSet("x").scratch("mm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one op"):
        RuleSet("x").scratch()
