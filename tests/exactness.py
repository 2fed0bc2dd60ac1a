"""Helpers shared by the rule tests: thread counts, rule buffers, estimate == measure."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import torch
from torch import nn

from profiled import every_peak

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cpu import CPU
from pytest_torchmem.engine.tracing.devices.cpu.base import NATIVE_INSTRUCTIONS
from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.rules import Alloc, OpCall, RuleSet


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[int]:
    """Run with ``n`` intra-op threads, then restore the process's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def rule_buffers(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, rules: RuleSet = CPU
) -> dict[str, int]:
    """The non-empty buffers (tag -> bytes) the scratch rule of ``op`` gives for fake ``args``."""
    kwargs = kwargs or {}
    out = op(*args, **kwargs)
    steps = rules.scratch_rule(op)(OpCall(op, args, kwargs, out))  # type: ignore[misc]
    return {s.tag: s.nbytes for s in steps if isinstance(s, Alloc) and s.nbytes}


class Lambda(nn.Module):
    """``fn(*parameters, *inputs, *buffers)`` as a module."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        params: tuple[torch.Tensor, ...] = (),
        buffers: tuple[torch.Tensor, ...] = (),
    ) -> None:
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList(nn.Parameter(p.detach().clone()) for p in params)
        self.names = []
        for i, b in enumerate(buffers):
            self.register_buffer(f"b{i}", b.detach().clone())
            self.names.append(f"b{i}")

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(*self.params, *inputs, *(getattr(self, n) for n in self.names))


#: What the estimate says of a bfloat16/float16 kernel that the modelled CPU runs
#: on native instructions (the avx512_bf16 and amx levels; ``cpu.base.native_kernel_gap``).
NATIVE_GAP: Final = NATIVE_INSTRUCTIONS


def flagged_native(estimated: tm.MemoryReport) -> bool:
    """The estimate flags a reduced-precision kernel that this host runs natively
    (and nothing else): there the rules do not claim exactness, and the estimate
    must say so; a kernel not flagged still fails an exactness test. The same
    tests are exact on the ``avx512`` level, which ``.ci/run`` reaches on such a
    host with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``."""
    flagged = [u for u in estimated.unsupported if NATIVE_GAP in u.reason]
    if flagged:
        others = [u for u in estimated.unsupported if NATIVE_GAP not in u.reason]
        assert others == [], others
    return bool(flagged)


def skip_where_native(estimated: tm.MemoryReport) -> None:
    """Skip an exactness test where :func:`flagged_native`."""
    if flagged_native(estimated):
        reason = next(u for u in estimated.unsupported if NATIVE_GAP in u.reason)
        pytest.skip(f"not modelled on this host's level: {reason}")


def assert_exact(model: nn.Module, inputs: Any, **options: Any) -> None:
    """``estimate`` and ``measure`` agree in every phase, and the estimate is complete."""
    estimated = tm.estimate(model, inputs, **options)
    skip_where_native(estimated)
    measured = tm.measure(model, inputs, **options)
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(measured)


def assert_exact_with_breakdown(
    fn: Callable[..., torch.Tensor], params: tuple[torch.Tensor, ...]
) -> None:
    """:func:`assert_exact` for ``fn(*params)``, and the same bytes in every category
    (a gradient copied by ``AccumulateGrad`` shows there, if not always in the peaks)."""
    model = Lambda(fn, params)
    estimated = tm.estimate(model, ())
    skip_where_native(estimated)
    measured = tm.measure(model, ())
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(measured)
    assert estimated.breakdown == measured.breakdown


def assert_fn_exact(
    fn: Callable[..., torch.Tensor],
    params: tuple[torch.Tensor, ...] = (),
    inputs: tuple[torch.Tensor, ...] = (),
    buffers: tuple[torch.Tensor, ...] = (),
    **options: Any,
) -> None:
    """:func:`assert_exact` for ``fn(*params, *inputs, *buffers)``."""
    torch.manual_seed(0)
    assert_exact(Lambda(fn, params, buffers), inputs, **options)


def _release_gaps() -> dict[str, tuple[frozenset[str], str]]:
    """tests/release_gaps.txt: ``nodeid<TAB>releases<TAB>why`` per line."""
    gaps: dict[str, tuple[frozenset[str], str]] = {}
    for line in Path(__file__).with_name("release_gaps.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            nodeid, releases, why = line.split("\t")
            gaps[nodeid] = (frozenset(releases.split(",")), why)
    return gaps


_RELEASE_GAPS: Final = _release_gaps()


def release_gap(nodeid: str) -> str | None:
    """Why the test ``nodeid`` is a known gap of the running torch release
    (tests/release_gaps.txt), or None where it is not one."""
    releases, why = _RELEASE_GAPS.get(nodeid, (frozenset(), ""))
    return why if "{}.{}".format(*torch_minor()) in releases else None
