"""What a replay compares between the region it recorded and the one it stands in for:
objects' state and torch's global switches, as values (replay.py, optimizer_replay.py)."""

from __future__ import annotations

from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.step.built_in import ModuleTracker
from pytest_torchmem.engine.torch_compat.torch_private import private

__all__ = ["IMMUTABLE", "global_hooks", "hooked_modules", "model_state", "neutral", "own_hooks", "parameter_hooks", "switches", "tensor_state", "value_state"]

#: The types of the values compared by value (replay_watch.py keeps globals of these too).
IMMUTABLE: Final = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)
_PLAIN: Final = frozenset(IMMUTABLE)  # (the common case, looked up before isinstance)
_GLOBAL_HOOKS: Final = "torch.nn.modules.module."


def model_state(model: nn.Module) -> tuple[Any, ...]:
    """Every module's attributes, as a value: plain values by value, tensors by identity
    and layout, other objects by identity (and size, for containers)."""
    state: list[Any] = []
    add = state.append
    plain = _PLAIN
    for module in model.modules():
        for name, value in module.__dict__.items():
            if type(value) in plain:
                add((name, value))
            elif name in ("_parameters", "_buffers"):
                add(tuple((key, tensor_state(t)) for key, t in value.items()))
            elif name == "_modules":
                add(tuple((key, id(m)) for key, m in value.items()))
            else:
                add((name, value_state(value)))
    return tuple(state)


def neutral(hook: Any) -> bool:
    """Whether ``hook`` is one of the engine's own that a replay may skip: it, or the
    object it is bound to, says so (``REPLAY_NEUTRAL``): a step function's ``PhaseWatch``,
    whose module pre-hooks and hooks count the depth of module calls in pairs, which a
    replayed block's inner modules skip together; the world's watch, whose global
    pre-hook refuses a module the walk did not reach (a traced block's were all called)."""
    return (getattr(hook, "REPLAY_NEUTRAL", False) is True
            or getattr(getattr(hook, "__self__", None), "REPLAY_NEUTRAL", False) is True)


def own_hooks(module: nn.Module) -> list[Any]:
    """The forward and backward hooks ``module`` carries of its own (not the global ones,
    nor the engine's :func:`neutral` ones)."""
    return [
        hook
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                      module._backward_hooks)
        for hook in hooks.values()
        if not neutral(hook)
    ]


def global_hooks() -> bool:
    """Whether a module hook of the user's is registered for every module
    (``register_module_forward_hook``, ...): the traces' own module trackers add a global
    pre-hook and a global hook each (a pipeline's ranks trace on threads of one process)."""
    return any(
        not isinstance(getattr(hook, "__self__", None), ModuleTracker) and not neutral(hook)
        for kind in ("forward_pre_hooks", "forward_hooks", "backward_hooks", "backward_pre_hooks")
        for hook in private(f"{_GLOBAL_HOOKS}_global_{kind}").values()
    )


def parameter_hooks(module: nn.Module) -> bool:
    """Whether one of ``module``'s parameters carries a hook of its own (on its gradient,
    or after it accumulates)."""
    return any(
        getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)
        for p in module.parameters()
    )


def hooked_modules(model: nn.Module) -> bool:
    """Whether one of ``model``'s modules carries forward or backward hooks of its own."""
    return any(own_hooks(m) for m in model.modules())


def tensor_state(t: Any) -> Any:
    if t is None:
        return None
    return (id(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.requires_grad)


def value_state(value: Any) -> Any:
    if type(value) in _PLAIN or isinstance(value, IMMUTABLE):
        return value
    if isinstance(value, torch.Tensor):
        return tensor_state(value)
    if isinstance(value, (list, dict, set, tuple)):
        return (type(value), id(value), len(value))
    return (type(value), id(value))


def switches() -> tuple[Any, ...]:
    """torch's global switches a forward and backward may follow."""
    cuda = torch.backends.cuda
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        *(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")),
        *(torch.get_autocast_dtype(device) for device in ("cpu", "cuda")),
        torch.is_autocast_cache_enabled(),
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
        cuda.matmul.allow_tf32,
        torch.backends.cudnn.enabled,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.allow_tf32,
        torch.backends.mkldnn.enabled,
    )
