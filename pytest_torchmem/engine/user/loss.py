"""The loss a training step backpropagates: the model's own, or the sum of its output.

Shared by the step (:mod:`~pytest_torchmem.engine.step.built_in`), a pipeline's last stage
(:mod:`~pytest_torchmem.engine.parallel.pipeline`) and the advice that reruns a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pytest_torchmem.engine.user.containers import tensors_in

__all__ = ["check_loss", "default_loss"]


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` (attribute or key) when it is a scalar tensor, else the sum of
    every floating-point tensor in ``output`` (in tuples, lists, mappings, dataclasses,
    named tuples, ``ModelOutput`` objects, nested)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    floats = [t for t in tensors_in(output) if t.is_floating_point()]
    if not floats:
        raise ValueError(
            f"the model's output ({type(output).__name__}) holds no floating-point tensor "
            "to sum as a loss; pass loss_fn=... to say how to reduce it"
        )
    total = floats[0].sum()
    for t in floats[1:]:
        total = total + t.sum()
    return total


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar tensor, got one of shape {tuple(loss.shape)}; "
            "reduce it, e.g. with .sum() or .mean()"
        )
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad, so there is nothing to backpropagate: "
            "no parameter or input that requires grad reached it (pass train=False "
            "to trace the forward only)"
        )
