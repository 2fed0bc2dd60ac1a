"""Helpers shared by the rule tests: thread counts, rule buffers, estimate == measure."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices.cpu import CPU
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


def assert_exact(model: nn.Module, inputs: Any, **options: Any) -> None:
    """``estimate`` and ``measure`` agree in every phase, and the estimate is complete."""
    estimated = tm.estimate(model, inputs, **options)
    measured = tm.measure(model, inputs, **options)
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()


def assert_exact_with_breakdown(
    fn: Callable[..., torch.Tensor], params: tuple[torch.Tensor, ...]
) -> None:
    """:func:`assert_exact` for ``fn(*params)``, and the same bytes in every category
    (a gradient copied by ``AccumulateGrad`` shows there, if not always in the peaks)."""
    model = Lambda(fn, params)
    estimated, measured = tm.estimate(model, ()), tm.measure(model, ())
    assert estimated.unsupported == ()
    assert estimated.phase_peaks() == measured.phase_peaks()
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
