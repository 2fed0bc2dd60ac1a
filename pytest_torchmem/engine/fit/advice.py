"""What to change when a step does not fit: :func:`advise`, each suggestion an estimate.

For a step over its budget (or its GPU's usable memory), ``tm.advise`` estimates
changed steps and says what each would take:

- **activation checkpointing**: which modules to recompute in backward instead of
  keeping their activations (``torch.utils.checkpoint``, non-reentrant). The
  candidates are the blocks of the model: the children of the model and of its
  ``ModuleList``/``ModuleDict``/``Sequential`` containers that hold parameters.
  Blocks alike (same container, class and parameter shapes) save alike, so one
  estimate per kind of block gives its saving; the blocks of the one kind whose
  savings cover the excess recomputing the fewest parameters are chosen (a proxy
  for the recomputation's FLOPs; or, where no kind alone covers it,
  blocks of every kind, no block inside another), and the choice is then
  estimated as a whole, blocks added until it fits or none is left. This is the
  knapsack of PyTorch's ``torch/distributed/_tools/sac_ilp.py`` at module
  granularity, solved greedily: exact for one kind of block (a transformer's),
  where the savings add up;
- **releasing the output** before ``backward()`` (``keep_output=False``), where it
  was kept;
- **another optimizer implementation**: without ``foreach`` (no multi-tensor
  temporaries in the step), and ``fused`` where the optimizer has a fused kernel;
- **bfloat16 autocast** around the forward;
- **smaller micro-batches with gradient accumulation**: the inputs' batch (the first
  dimension of the tensors that share it) split in 2, 4, 8, ... parts, each part's
  forward and backward in turn, one optimizer step.

Each suggestion is an estimate of the changed step, run on the same device and
profile as the step itself; the user's model is not changed (the changed models are
shallow copies that share its parameters).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pytest_torchmem.engine.user.containers import map_tensors, tensors_in
from pytest_torchmem.engine.fit.search import Figure, resolved_target
from pytest_torchmem.engine.user.loss import default_loss
from pytest_torchmem.engine.figures.stopped import TraceStopped
from pytest_torchmem.engine.figures.units import format_bytes

if TYPE_CHECKING:
    from pytest_torchmem.engine.figures.report import MemoryReport

__all__ = ["Advice", "Suggestion", "advise"]

#: The kinds of block given an estimate each: the largest (by parameters, all alike
#: together) first.
MAX_BLOCK_KINDS: Final = 8
#: Estimates of a whole choice of blocks, each adding blocks to the last.
MAX_CHOICE_ROUNDS: Final = 4


@dataclass(frozen=True)
class Suggestion:
    """One change to the step, and what the changed step takes."""

    #: What to change, in words: "checkpoint blocks.0 to blocks.5 (6 of 12 Block)".
    change: str
    #: The deciding figure of the changed step (as :attr:`Advice.figure`).
    nbytes: int
    fits: bool
    #: The changed step's estimate.
    report: MemoryReport
    #: The modules to checkpoint (qualified names), for a checkpointing suggestion.
    modules: tuple[str, ...] = ()

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "still over"
        return f"{self.change}: {format_bytes(self.nbytes)} ({verdict})"


@dataclass(frozen=True)
class Advice:
    """A step against its budget, and the changes that were estimated."""

    target: str
    limit: int
    figure: Figure
    #: The deciding figure of the step as it is.
    nbytes: int
    report: MemoryReport
    #: The estimated changes: those that fit first, the mildest first (the most memory
    #: in use: the least taken away), then the others, the closest to fitting first.
    suggestions: tuple[Suggestion, ...]
    #: Changes that could not be estimated, with the reason (e.g. a fused optimizer
    #: the device has no kernel for).
    skipped: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.nbytes <= self.limit

    def __str__(self) -> str:
        figure = "reserved" if self.figure == "reserved" else "peak"
        head = (
            f"the step takes {format_bytes(self.nbytes)} ({figure}) of {self.target} "
            f"({format_bytes(self.limit)}): "
        )
        if self.fits:
            return head + f"it fits, {format_bytes(self.limit - self.nbytes)} to spare"
        lines = [head + f"{format_bytes(self.nbytes - self.limit)} over"]
        lines += [f"  {suggestion}" for suggestion in self.suggestions]
        if not self.suggestions:
            lines.append("  no change that was tried brings it down")
        return "\n".join(lines)


def advise(
    model: Any,
    inputs: Any,
    *,
    budget: int | str | None = None,
    gpu: Any = None,
    device: str | None = None,
    figure: Figure | None = None,
    **options: Any,
) -> Advice:
    """Estimate the step of ``model`` on ``inputs`` against ``budget`` or ``gpu`` (as
    :func:`~pytest_torchmem.fit` takes them), and, when it does not fit, the changes
    that would bring it down (see the module), each an estimate of the changed step.

    ``options`` are :func:`~pytest_torchmem.estimate`'s (``optimizer``, ``loss_fn``,
    ``keep_output``, ``cpu``, ...). ``model`` must be a module: a step function is
    the user's own code, which the advice cannot change.

    A trace of the step itself that stops raises
    :class:`~pytest_torchmem.TraceStopped`; a changed step whose trace stops is
    skipped (``skipped`` says where it stopped): neither has a figure.
    """
    from pytest_torchmem.engine.api import estimate
    if not isinstance(model, nn.Module):
        raise TypeError(
            "advise() changes a model's built-in step (checkpointed blocks, its optimizer, "
            f"its batch): give it an nn.Module, got {type(model).__name__}"
        )
    device, limit, target, figure = resolved_target("advise", device, gpu, budget, figure, options)
    chosen_figure: Figure = figure
    devices = {key: options[key] for key in ("gpu", "cpu") if key in options}

    def figure_of(report: MemoryReport) -> int:
        if chosen_figure == "reserved":
            assert report.reserved_peak is not None
            return report.reserved_peak
        return report.peak

    def run(step_model: Any, **changed: Any) -> MemoryReport:
        return estimate(step_model, inputs, device=device, **{**options, **changed})

    report = run(model)
    nbytes = figure_of(report)
    advice = Advice(target, limit, figure, nbytes, report, ())
    if advice.fits:
        return advice
    suggestions: list[Suggestion] = []
    skipped: list[str] = []

    def suggest(change: str, made: Callable[[], MemoryReport], modules: tuple[str, ...] = ()) -> None:
        try:
            changed = made()
        except Exception as exc:  # a change this step or device cannot take: say why
            skipped.append(f"{change}: {type(exc).__name__}: {exc}".splitlines()[0])
            return
        if figure_of(changed) < nbytes:
            suggestions.append(Suggestion(change, figure_of(changed), figure_of(changed) <= limit, changed, modules))

    try:
        found = _checkpointing(model, nbytes, limit, lambda m: run(m), figure_of)
    except TraceStopped as exc:  # a checkpointed step the trace could not follow: no figure
        skipped.append(f"checkpoint blocks: {type(exc).__name__}: {exc}")
        found = None
    if found is not None:
        change, modules, changed = found
        suggest(change, lambda: changed, modules)
    if options.get("keep_output"):
        suggest("release the output before backward() (keep_output=False)", lambda: run(model, keep_output=False))
    factory = options.get("optimizer")
    if factory is not None:
        for change, variant in _optimizer_variants(factory):
            suggest(change, lambda variant=variant: run(model, optimizer=variant))
    if options.get("train", True):
        suggest(
            f"run the forward under torch.autocast({device!r}, dtype=torch.bfloat16)",
            lambda: run(_autocast(model, device)),
        )
        for parts, micro in _micro_batches(inputs):  # the fewest parts that fit
            accumulate, arguments = _accumulating(model, inputs, parts, options)
            suggest(
                f"{parts} micro-batches of {micro} with gradient accumulation",
                lambda accumulate=accumulate, arguments=arguments: estimate(
                    accumulate, arguments, device=device, **devices
                ),
            )
            if suggestions and suggestions[-1].change.startswith(f"{parts} micro-batches") and suggestions[-1].fits:
                break
    # the mildest change that fits first (the most memory it leaves in use), then the
    # others, the closest to fitting first
    ordered = sorted(suggestions, key=lambda s: (not s.fits, -s.nbytes if s.fits else s.nbytes))
    return Advice(target, limit, figure, nbytes, report, tuple(ordered), tuple(skipped))


# -- activation checkpointing -------------------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    """Blocks alike: their names in order, and the saving of checkpointing one."""

    names: tuple[str, ...]
    label: str
    #: Parameters of one block: what recomputing it costs, as a proxy for its FLOPs.
    parameters: int
    saving: int = 0


def _blocks(model: nn.Module) -> list[_Kind]:
    """The model's blocks (see the module), grouped by kind, the largest kinds first."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    kinds: dict[tuple[Any, ...], list[str]] = {}
    labels: dict[tuple[Any, ...], str] = {}
    sizes: dict[tuple[Any, ...], int] = {}
    for name, module in model.named_modules():
        if not name or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        if parent is not model and not isinstance(parent, containers):
            continue
        parameters = [(n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()]
        if not parameters:
            continue
        key = (parent_name, type(module), tuple(parameters))
        kinds.setdefault(key, []).append(name)
        labels[key] = type(module).__name__
        sizes[key] = sum(p.numel() for p in module.parameters())
    ordered = sorted(kinds, key=lambda key: -sizes[key] * len(kinds[key]))
    return [_Kind(tuple(kinds[key]), labels[key], sizes[key]) for key in ordered]


def _checkpointed(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """A shallow copy of ``model`` whose modules ``names`` run under a non-reentrant
    ``torch.utils.checkpoint``; it shares every parameter and buffer with ``model``,
    which is left as it was (each module on the way to a changed one is copied, with
    a dict of children of its own)."""
    root = copy.copy(model)
    root._modules = dict(model._modules)
    copies = {id(root)}
    for name in names:
        *path, leaf_name = name.split(".")
        parent = root
        for part in path:
            child = parent._modules[part]
            assert child is not None
            if id(child) not in copies:
                child = copy.copy(child)
                child._modules = dict(child._modules)
                copies.add(id(child))
                parent._modules[part] = child
            parent = child
        leaf = copy.copy(parent._modules[leaf_name])
        assert leaf is not None
        forward = type(leaf).forward.__get__(leaf)

        def recomputed(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        leaf.forward = recomputed  # type: ignore[method-assign]
        parent._modules[leaf_name] = leaf
    return root


def _checkpointing(
    model: nn.Module,
    nbytes: int,
    limit: int,
    run: Callable[[nn.Module], MemoryReport],
    figure_of: Callable[[MemoryReport], int],
) -> tuple[str, tuple[str, ...], MemoryReport] | None:
    """The fewest blocks to checkpoint for the step to fit (or every block that helps,
    where that is not enough), estimated: (the change in words, the blocks, the changed
    step's report); None where checkpointing no block lowers the figure."""
    kinds = []
    for kind in _blocks(model)[:MAX_BLOCK_KINDS]:
        saving = nbytes - figure_of(run(_checkpointed(model, kind.names[:1])))
        if saving > 0:
            kinds.append(_Kind(kind.names, kind.label, kind.parameters, saving))
    if not kinds:
        return None
    every = [name for kind in kinds for name in kind.names]
    chosen: list[str] = []
    excess = nbytes - limit
    report = None
    for _ in range(MAX_CHOICE_ROUNDS):
        added = _choose(kinds, chosen, excess)
        if not added:
            break
        chosen += added
        report = run(_checkpointed(model, chosen))
        now = figure_of(report)
        if now <= limit:
            break
        excess = now - limit
    if report is None:
        return None
    chosen.sort(key=every.index)
    return _describe(chosen, kinds), tuple(chosen), report


def _choose(kinds: Sequence[_Kind], chosen: Sequence[str], excess: int) -> list[str]:
    """Blocks to add to ``chosen`` whose savings (as estimated, one of a kind at a time)
    cover ``excess``: from the one kind that covers it recomputing the fewest parameters
    (a proxy for the forward's FLOPs), or else from every kind, the largest in all
    first; no block inside or around a chosen one."""

    def free(kind: _Kind, taken: Sequence[str]) -> list[str]:
        return [n for n in kind.names if n not in taken and not any(_nested(n, o) for o in taken)]

    alone = [
        (-(-excess // kind.saving) * kind.parameters, -kind.saving, index)
        for index, kind in enumerate(kinds)
        if kind.saving * len(free(kind, chosen)) >= excess
    ]
    if alone:
        _, _, index = min(alone)
        count = -(-excess // kinds[index].saving)
        return free(kinds[index], chosen)[:count]
    added: list[str] = []
    covered = 0
    for kind in sorted(kinds, key=lambda kind: -kind.saving * len(kind.names)):
        for name in free(kind, [*chosen, *added]):
            if covered >= excess:
                return added
            added.append(name)
            covered += kind.saving
    return added


def _nested(one: str, other: str) -> bool:
    return one.startswith(other + ".") or other.startswith(one + ".")


def _describe(chosen: Sequence[str], kinds: Sequence[_Kind]) -> str:
    parts = []
    for kind in kinds:
        mine = [name for name in kind.names if name in chosen]
        if not mine:
            continue
        what = f"{len(mine)} of {len(kind.names)} {kind.label}"
        if len(mine) == 1:
            parts.append(f"{mine[0]} ({what})")
        else:
            parts.append(f"{mine[0]} to {mine[-1]} ({what})")
    return "checkpoint " + ", ".join(parts)


# -- the other changes ---------------------------------------------------------------------------


def _optimizer_variants(factory: Callable[[Any], torch.optim.Optimizer]) -> list[tuple[str, Callable[[Any], Any]]]:
    """The optimizer ``factory`` makes, without foreach and fused, where it has those."""
    probe = factory([nn.Parameter(torch.zeros(1, device="meta"))])
    cls = type(probe)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {key: value for key, value in probe.defaults.items() if key in accepted}
    name = cls.__name__
    variants = []
    if "foreach" in defaults and defaults.get("foreach") is not False and not defaults.get("fused"):
        settings = {**defaults, "foreach": False}
        variants.append((f"{name}(..., foreach=False)", lambda params, s=settings: cls(params, **s)))
    if "fused" in defaults and not defaults.get("fused") and not defaults.get("differentiable"):
        settings = {**defaults, "fused": True, "foreach": False}
        variants.append((f"{name}(..., fused=True)", lambda params, s=settings: cls(params, **s)))
    return variants


def _autocast(model: nn.Module, device_type: str) -> nn.Module:
    """A shallow copy of ``model`` whose forward runs under bfloat16 autocast."""
    root = copy.copy(model)
    forward = type(model).forward.__get__(root)

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    root.forward = autocast_forward  # type: ignore[method-assign]
    return root


def _micro_batches(inputs: Any) -> list[tuple[int, int]]:
    """(parts, micro-batch) for splitting ``inputs``' batch in 2, 4, 8, ... parts."""
    found = tensors_in(inputs)
    if not found or found[0].dim() == 0:
        return []
    batch = found[0].shape[0]
    splits = []
    parts = 2
    while parts <= batch and batch % parts == 0:
        splits.append((parts, batch // parts))
        parts *= 2
    return splits[:4]


def _accumulating(
    model: nn.Module, inputs: Any, parts: int, options: dict[str, Any]
) -> tuple[Callable[..., None], tuple[Any, ...]]:
    """The step as ``parts`` micro-batches with gradient accumulation: a step function
    (and its arguments) that runs the built-in step's loop (two iterations with an
    optimizer, one without), each iteration's forward and backward once per
    micro-batch (the loss divided by ``parts``), then one optimizer step."""
    batch = tensors_in(inputs)[0].shape[0]
    micro = batch // parts

    def part(index: int) -> Any:
        return map_tensors(
            lambda t: t[index * micro : (index + 1) * micro] if t.dim() and t.shape[0] == batch else t,
            inputs,
        )

    loss_fn = options.get("loss_fn") or default_loss
    factory = options.get("optimizer")

    def accumulate(model: nn.Module, pieces: list[Any]) -> None:
        opt = factory([p for p in model.parameters() if p.requires_grad]) if factory is not None else None
        for _ in range(2 if opt is not None else 1):
            for piece in pieces:
                if isinstance(piece, torch.Tensor):
                    output = model(piece)
                elif isinstance(piece, tuple):
                    output = model(*piece)
                else:
                    output = model(**piece)
                loss = loss_fn(output) / parts
                del output
                loss.backward()
                del loss
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return accumulate, (model, [part(i) for i in range(parts)])
