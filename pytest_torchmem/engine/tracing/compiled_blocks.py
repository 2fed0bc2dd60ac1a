"""Which compiled blocks may be replayed: those whose calls all run one program.

A model's repeated blocks compiled one by one (``layer.compile()``, as fine-tuning
recipes compile their decoder layers) share one of our cache regions
(:func:`~pytest_torchmem.engine.tracing.compiled_program.following_compiled`): dynamo
keeps the program built for the first block on the code object, and runs it for every
other block whose guards pass. Where a guard fails (dynamo specializes on an integer
attribute the forward reads, transformers' ``layer_idx`` where a layer picks its
attention by it), that block gets a program of its own, and its calls must be traced.

The warm-up step tells: it runs every block, and counts the graphs each region built
during each block's call (:class:`WarmUpCompiles`). A region whose graphs were all
built during one block's call has one program per frame of the block's forward, which
every block of the region ran; its blocks may be replayed (:func:`replayable_blocks`)
as eager blocks are, their programs' runs counted as the traced ones' were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from pytest_torchmem.engine.figures.report import ROOT_NAME
from pytest_torchmem.engine.tracing.block_keys import block_lists, compiled_call_name

__all__ = ["WarmUpCompiles", "compiled_lists", "replayable_blocks"]


def compiled_lists(model: nn.Module, regions: dict[int, Any]) -> list[tuple[str, list[nn.Module]]]:
    """``model``'s block lists (by name) with the blocks of each compiled alone
    (``module.compile()``, or ``torch.compile(module)`` put in the list) whose program the
    trace follows (``regions``: the followed modules' regions, by ``id``)."""
    names = {id(m): name or ROOT_NAME for name, m in model.named_modules()}
    found = []
    for container, blocks in block_lists(model):
        compiled = [b for b in blocks if id(b) in regions and compiled_call_name(b) is not None]
        if compiled:
            found.append((names.get(id(container), ROOT_NAME), compiled))
    return found


class WarmUpCompiles:
    """The graphs each followed region built during each compiled block's call in the
    warm-up (entered around it): by region, the number of calls that built any."""

    def __init__(self, model: nn.Module, regions: dict[int, Any]) -> None:
        self.regions = regions
        self.lists = compiled_lists(model, regions)
        self.blocks = [block for _, blocks in self.lists for block in blocks]
        #: by id of a region: how many block calls built graphs, and how many graphs they built
        self.built: dict[int, tuple[int, int]] = {}

    @contextmanager
    def counting(self) -> Iterator[WarmUpCompiles]:
        saved = [(block, name, block.__dict__[name]) for block in self.blocks for name in [compiled_call_name(block)]]
        try:
            for block, name, call in saved:
                block.__dict__[name] = self._counted(self.regions[id(block)], call)
            yield self
        finally:
            for block, name, call in saved:
                block.__dict__[name] = call

    def _counted(self, region: Any, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = region.backend.compiled
            try:
                return call(*args, **kwargs)
            finally:
                built = region.backend.compiled - before
                if built:
                    calls, graphs = self.built.get(id(region), (0, 0))
                    self.built[id(region)] = (calls + 1, graphs + built)

        return run


def replayable_blocks(compiles: WarmUpCompiles, lines: list[str]) -> dict[int, Any]:
    """The compiled blocks that may be replayed, by ``id``, with their regions: those of a
    region whose graphs the warm-up built all during one block's call (and none beside).
    ``lines`` gets why a list's compiled blocks are traced."""
    out = {}
    for name, blocks in compiles.lists:
        why = None
        for block in blocks:
            region = compiles.regions[id(block)]
            calls, graphs = compiles.built.get(id(region), (0, 0))
            if calls == 1 and graphs == region.backend.compiled:
                out[id(block)] = region
            elif calls > 1:
                why = why or f"dynamo built programs in {calls} of their calls: its guards tell them apart"
            else:
                why = why or "their compiled programs were built outside their calls"
        if why is not None:
            lines.append(f"{name}: compiled blocks traced ({why})")
    return out
