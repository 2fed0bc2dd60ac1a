"""CPU rules: the random samplers ``multinomial`` and ``normal``
(``aten/src/ATen/native/Distributions.cpp``, ``DistributionTemplates.h``), torch 2.10 to 2.15.

Their draws change values, never sizes: what they allocate follows from the
shapes, including the checks on the probabilities and standard deviations
(``aminmax``, ``min`` and comparisons with wrapped numbers, read back with
``.item()``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pytest_torchmem.engine.torch_compat.torch_release import torch_minor
from pytest_torchmem.engine.tracing.devices.cpu.base import CPU, profile_of
from pytest_torchmem.engine.tracing.devices.cpu.misc import arg, promotion_casts
from pytest_torchmem.engine.tracing.devices.cpu.reduce import sum_steps
from pytest_torchmem.engine.tracing.rules import OUTPUTS, Alloc, Free, OpCall, Steps, nbytes_of

aten = torch.ops.aten


def _compare(t: torch.Tensor, value: Any, tag: str, numel: int = 1) -> list[Alloc | Free]:
    """``x op value`` for ``x`` of ``t``'s dtype and ``numel`` elements: the wrapped number,
    its cast to the common dtype, the bool result (``tag``, left to the caller)."""
    wrapped = f"{tag}: wrapped {value!r}"
    casts = [Alloc(f"{tag}: {c.tag}", c.nbytes) for c in promotion_casts([t, value])]
    return [
        Alloc(wrapped, 8),
        *casts,
        Alloc(tag, numel),
        Free(wrapped),
        *(Free(c.tag) for c in casts),
    ]


@CPU.scratch(aten.multinomial.default)
def _multinomial(call: OpCall) -> Steps:
    """``multinomial_out``: the output; with replacement and more than one sample,
    ``multinomial_with_replacement`` keeps a cumulative distribution of one row
    (``float``, ``double`` for a ``double`` input). Otherwise the Gumbel-max path:
    the probabilities checked ``min >= 0 & max < inf`` (:func:`_valid_probabilities`),
    ``sum == 0`` over the last dim (``any`` of it for rows, kept to the end, and its
    negation), then ``q = empty_like(self)`` and, for several samples, ``topk``'s
    values beside the output; what the check kept freed last."""
    self, n_sample = arg(call, 0, "self"), arg(call, 1, "num_samples")
    replacement = arg(call, 2, "replacement", False)
    if call.out.numel() == 0:
        return [OUTPUTS]
    if replacement and n_sample != 1:
        dist = self.shape[-1] * (8 if self.dtype == torch.float64 else 4)
        return [OUTPUTS, Alloc("cumulative distribution", dist), Free("cumulative distribution")]
    isz, threads = self.element_size(), profile_of(call).threads
    rows = self.shape[0] if self.dim() == 2 else 1
    steps: list[Any] = [
        OUTPUTS,
        *_valid_probabilities(self),
        Alloc("sum", rows * isz),
        *sum_steps(threads, self, rows, self.dtype, "sum"),
        *_compare(self, 0, "sum == 0", rows),
    ]
    if self.dim() == 2:
        steps += [
            Alloc("any", 1),
            *sum_steps(threads, (rows, torch.bool), 1, torch.bool, "any"),
            Free("sum == 0"),
        ]
    steps += [Free("sum"), Alloc("~", 1), Free("~"), Alloc("q", nbytes_of(self))]
    if n_sample != 1:
        steps += [Alloc("topk values", call.out.numel() * isz), Free("topk values")]
    return [*steps, Free("q")]


def _valid_probabilities(self: torch.Tensor) -> list[Alloc | Free]:
    """The check ``min >= 0 & max < inf`` of the probabilities, its ``&`` kept to the
    end. From torch 2.12 one ``aminmax``, whose two results live to the end; up to 2.11
    ``(self.min() >= 0) & (self.max() < inf)``, whose temporaries but the ``&`` go
    with the expression, last made first freed (the profiler's order on 2.10 and 2.11)."""
    isz = self.element_size()
    if torch_minor() < (2, 12):
        return [
            Alloc("min", isz),
            *_compare(self, 0, "min >= 0"),
            Alloc("max", isz),
            *_compare(self, math.inf, "max < inf"),
            Alloc("&", 1),
            Free("max < inf"),
            Free("max"),
            Free("min >= 0"),
            Free("min"),
        ]
    return [
        Alloc("aminmax: min", isz),
        Alloc("aminmax: max", isz),
        *_compare(self, 0, "min >= 0"),
        *_compare(self, math.inf, "max < inf"),
        Alloc("&", 1),
        Free("min >= 0"),
        Free("max < inf"),
    ]


def _std_check(std: torch.Tensor, tag: str) -> list[Alloc | Free]:
    """``CHECK_NORMAL_TENSOR_STD``: ``std.min().ge(0).item()`` (``min`` copies a
    non-contiguous input) unless ``std`` is empty."""
    if std.numel() == 0:
        return []
    copy = [] if std.is_contiguous() else [Alloc(f"{tag}: min's contiguous copy", nbytes_of(std))]
    return [
        Alloc(f"{tag}: min", std.element_size()),
        *copy,
        *(Free(c.tag) for c in copy),
        *_compare(std, 0, f"{tag}: >= 0"),
        Free(f"{tag}: >= 0"),
        Free(f"{tag}: min"),
    ]


@CPU.scratch(aten.normal.Tensor_Tensor, aten.normal.float_Tensor, aten.normal.Tensor_float)
def _normal(call: OpCall) -> Steps:
    """``normal_impl`` / ``normal_out_impl`` (``DistributionTemplates.h``): with a tensor of
    standard deviations it is checked before the output is made and again after;
    with a number, ``std_tensor = empty_like(output)`` is made beside the output; a
    number mean becomes ``at::full({}, mean)``. The draws and the ``mul_``/``add_``
    that scale them run in place."""
    mean, std = arg(call, 0, "mean"), arg(call, 1, "std")
    if not isinstance(std, torch.Tensor):
        return [OUTPUTS, Alloc("std_tensor", nbytes_of(call.out)), Free("std_tensor")]
    steps: list[Any] = [*_std_check(std, "check"), OUTPUTS, *_std_check(std, "check again")]
    if not isinstance(mean, torch.Tensor):
        steps += [Alloc("mean_tensor", std.element_size()), Free("mean_tensor")]
    return steps
