"""A traced block's backward recorded as a template (block_replay.py): :class:`Recorder`
watches the window between the node pre-hook of the block's output and the first event
of a node the block did not make, and names what it freed by what it was; and the graph
a block's forward made, with the storages its nodes saved (:func:`block_graph`,
:func:`holds`).
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.figures.timeline import ALLOC, ENTER, EXIT, FREE, RESIZE, Phase
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.autograd_eager import number_holders
from pytest_torchmem.engine.tracing.block_parallel import dtensor_function, local_of
from pytest_torchmem.engine.tracing.block_templates import BackwardTemplate, ForwardTemplate, Group
from pytest_torchmem.engine.tracing.replay_events import Layout, layout_of

__all__ = ["Recorder", "block_graph", "holds"]

FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")
_current_autograd_node: Final = private("torch._C._current_autograd_node")
_SavedTensor: Final = private("torch._C._autograd.SavedTensor")
_FORWARD: Final = Phase.FORWARD
_BACKWARD: Final = Phase.BACKWARD

_ACCUMULATE_GRAD: Final = "torch::autograd::AccumulateGrad"
#: The package of AOTAutograd's runtime, whose ``CompiledFunction`` a compiled program's
#: forward applies (torch/_functorch/_aot_autograd/runtime_wrappers.py, 2.10 to 2.15).
_AOT_AUTOGRAD: Final = "torch._functorch._aot_autograd"


class Recorder:
    """Watches a traced block's backward: the window between its entry and the first event
    of a node it did not make."""

    def __init__(
        self,
        replay: Any,
        group: Group,
        block: nn.Module,
        forward: ForwardTemplate,
        ranks: dict[int, int],
        inputs: list[Any],
        sequence: tuple[int, int],
        first: int,
    ) -> None:
        self.replay = replay
        self.group = group
        self.index = replay._index[id(block)]
        self.positions = replay._positions(block)
        self.params = list(block.parameters())
        self.param_ids = {id(p) for p in self.params}
        self.forward = forward
        self.ranks = ranks
        self.output_sids = {
            sid for sid, rank in ranks.items() if rank not in forward.saved and rank not in forward.cached_saved
        }
        ledger = replay.tracker.ledger
        self.input_sids = {ledger.storage_id(t): i for i, t in enumerate(inputs)}
        self.input_sids.pop(None, None)
        self.sequence = sequence
        self.state = "before"
        self.start = self.end = self.bfirst = -1
        self.gsid: int | None = None
        self.grad_out: Layout | None = None
        self.reads = 0
        self.why = ""
        #: The phase its backward runs in: the step's backward, or, for a pipeline stage's
        #: set-up (its metadata inferred), the forward phase it ran in.
        self.phase = _FORWARD if replay.tracker.setting_up else _BACKWARD
        #: Whether the block is its list's last (:meth:`BlockReplay._recorded`).
        self.last = False
        #: Whether the trace follows compiled code: no module hook marks the end of the
        #: block's backward (a compiled block's is its program's one node), which is over
        #: once the node its input came from begins (see :meth:`gave`).
        self.compiled = replay.compiled is not None

    def owns(self, node: Any) -> bool:
        if node is None:
            return False
        s0, s1 = self.sequence
        if s0 <= node._sequence_nr() < s1:
            return True
        return node.name() == _ACCUMULATE_GRAD and id(node.variable) in self.param_ids

    def got(self, grad: torch.Tensor) -> None:
        """The gradient of the block's output (before the module hooks' entry)."""
        tracker = self.replay.tracker
        self.gsid = tracker.ledger.storage_id(grad)
        self.grad_out = layout_of(grad, -1) if type(grad) is FakeTensor else None
        if any(p.grad is not None for p in self.params):
            self.why = "a block's parameters had gradients before its backward"

    def begins(self, grads: Any) -> None:
        """The block's first node is about to run, every hook on its output run (a node
        pre-hook: the module hooks' events on the output are the program's own, before)."""
        tracker = self.replay.tracker
        if self.state != "before" or tracker.phase is not self.phase:
            self.why = self.why or "a block's backward began outside the step's backward"
            return
        self.state = "in"
        self.start = len(tracker.timeline.events)
        self.bfirst = len(tracker.timeline.storages)
        self.reads = tracker.value_reads
        if not tracker.quiet():
            self.why = self.why or "autograd's bookkeeping was pending as a block's backward began"

    def watch(self, kind: int, index: int) -> None:
        if self.state == "in" and not self.owns(_current_autograd_node()):
            self.state = "ended"
            self.end = len(self.replay.tracker.timeline.events)

    def gave(self, position: int, grad: torch.Tensor) -> None:
        """The gradient of the block's input (the block's backward is over)."""
        if self.state == "done":
            return
        if self.compiled and self.state == "in" and not self.owns(_current_autograd_node()):
            # (the hook runs as the node its input came from begins: autograd runs the
            # block's nodes, made after that node, first; they made every event by then)
            self.state = "ended"
            self.end = len(self.replay.tracker.timeline.events)
        self.state, state = "done", self.state
        with _DisableTorchFunction():
            template, why = self._template(position, grad, state)
        self.replay._recorded(self, template, why)

    def _template(self, position: int, grad: torch.Tensor, state: str) -> tuple[BackwardTemplate | None, str]:
        tracker = self.replay.tracker
        timeline, ledger = tracker.timeline, tracker.ledger
        if self.why:
            return None, self.why
        if state != "ended":
            return None, "a block's backward window could not be found"
        if tracker.stop is not None or tracker.value_reads != self.reads:
            return None, "a block's backward read tensor values, or the trace stopped"
        if self.gsid is None or self.grad_out is None:
            return None, "a block's output gradient was not tracked"
        first = self.bfirst
        ranks: dict[int, int] = {}
        events: list[tuple[int, Any, int]] = []
        freed_f: set[int] = set()
        for kind, a, b in timeline.events[self.start : self.end]:
            if kind == ALLOC or kind == FREE or kind == RESIZE:
                if a >= first:
                    events.append((kind, ("b", ranks.setdefault(a, len(ranks))), b))
                    continue
                if kind != FREE:
                    return None, "a block's backward resized a storage made before it"
                if a in self.ranks:
                    rank = self.ranks[a]
                    if a in self.output_sids:
                        return None, "a block's backward freed its own output"
                    freed_f.add(rank)
                    events.append((kind, ("f", rank), b))
                elif a == self.gsid:
                    events.append((kind, ("g", 0), b))
                elif a in self.input_sids:
                    events.append((kind, ("i", self.input_sids[a]), b))
                else:
                    return None, "a block's backward freed a storage it was not given"
            elif kind == ENTER or kind == EXIT:
                where = self.positions.get(a)
                if where is None:
                    return None, "a block's backward ran a module outside it"
                events.append((kind, where, 0))
            else:
                return None, "a block's backward changed the step's phase"
        if freed_f - self.forward.cached_saved != set(self.forward.saved):
            return None, "a block's backward left activations it saved alive"
        if any(ev[1][0] == "i" and ev[1][1] not in self.forward.kept_inputs for ev in events if ev[0] == FREE and type(ev[1]) is tuple):
            return None, "a block's backward freed an input its graph did not save"
        by_rank = sorted(ranks, key=ranks.__getitem__)
        infos = tuple(timeline.storages[sid] for sid in by_rank)
        left: set[int] = set()
        sid = ledger.storage_id(grad)
        if type(grad) is not FakeTensor:
            return None, f"a block's input gradient is a {type(grad).__name__}"
        if sid == self.gsid:
            # the gradient it got, summed into in place and handed on (a residual's)
            if any(ev[1] == ("g", 0) for ev in events) or layout_of(grad, -1) != self.grad_out:
                return None, "a block's backward handed on a view of the gradient it got"
            grads_in: tuple[tuple[int, Layout], ...] = ((position, layout_of(grad, -1)),)
        elif sid in ranks:
            grads_in = ((position, layout_of(grad, ranks[sid])),)
            left.add(sid)
        else:
            return None, "a block's input gradient was not made in its backward"
        param_grads: list[Layout | None] = []
        for p in self.params:
            if p.grad is None:
                param_grads.append(None)
                continue
            local, spec = local_of(p.grad), getattr(p.grad, "_spec", None)
            psid = ledger.storage_id(local)
            if type(local) is not FakeTensor or psid not in ranks or psid in left:
                return None, "a block's parameter gradient was not made in its backward"
            left.add(psid)
            param_grads.append((layout_of(local, ranks[psid]), spec))
        alive = {s for s in ranks if ledger.holds(s)}
        if alive != left:
            return None, "a block's backward left tensors alive beside its gradients"
        if any(ledger.nbytes_now(s) != timeline.storages[s].nbytes for s in alive):
            return None, "a block's backward resized a gradient it left"
        return (
            BackwardTemplate(
                tuple(events),
                infos,
                tuple(self.positions.get(info.module) for info in infos),
                self.grad_out,
                grads_in,
                tuple(param_grads),
            ),
            "",
        )


def holds(holder: Any, found: set[int]) -> bool:
    """Whether ``holder`` (:meth:`StorageLedger.holder`: a wrapped number's tensor, a
    node's token) is among what :func:`block_graph` found its graph holds."""
    if holder is None:
        return False
    return (holder._cdata if isinstance(holder, torch.Tensor) else id(holder)) in found


def _compiled_program(node: Any) -> bool:
    """Whether ``node`` is the autograd node of a compiled program (AOTAutograd's
    ``CompiledFunction``)."""
    forward = getattr(type(node), "_forward_cls", None)
    return (
        isinstance(node, torch.autograd.function.BackwardCFunction)
        and forward is not None
        and forward.__module__.startswith(_AOT_AUTOGRAD)
    )


def _node_key(node: Any) -> tuple[int, str]:
    return node._sequence_nr(), node.name()


def block_graph(
    block: nn.Module,
    out_leaves: list[Any],
    inputs: list[Any],
    sequence: tuple[int, int],
    ledger: Any,
    compiled: bool = False,
) -> set[int] | str:
    """The storages the block's graph saves, and the keys (:func:`holds`) of what holds
    the wrapped numbers it saved; or why the graph cannot be replayed (it reaches tensors
    the block was not given, it has a custom function). ``compiled``: the block is compiled
    alone, and its compiled program's node (AOTAutograd's function, which saves its
    tensors with ``save_for_backward``) is read as autograd's own nodes are."""
    s0, s1 = sequence
    params = {id(p) for p in block.parameters()}
    given = {id(t) for t in inputs}
    # (by sequence number and name: a node's Python object is not the same object each
    # time on every release)
    given_nodes = {_node_key(t.grad_fn) for t in inputs if t.grad_fn is not None}
    saved: set[int] = set()
    seen: set[Any] = set()
    stack = [t.grad_fn for t in out_leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        key = _node_key(node)
        if key in seen:
            continue
        seen.add(key)
        if compiled and _compiled_program(node):
            for t in node.saved_tensors:
                sid = ledger.storage_id(local_of(t)) if isinstance(t, torch.Tensor) else None
                if sid is None and isinstance(t, torch.Tensor):
                    return "a block's compiled program saved a tensor the trace does not know"
                if sid is not None:
                    saved.add(sid)
        elif isinstance(node, torch.autograd.function.BackwardCFunction) and not dtensor_function(node):
            return "a block runs a custom autograd function"
        saved.update(id(token) for token in number_holders(node))
        for attr in dir(node):
            if attr.startswith("_raw_saved_"):
                raw = getattr(node, attr)
                if isinstance(raw, _SavedTensor) and raw.unpack_hook is not None:
                    return "a block saves tensors through hooks (a checkpoint)"
            elif attr.startswith("_saved_"):
                value = getattr(node, attr)
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        sid = ledger.storage_id(local_of(t))
                        if sid is not None:
                            saved.add(sid)
                        elif type(t) is torch.Tensor:  # (a wrapped number, held by the node)
                            saved.add(t._cdata)
        for next_node, _ in node.next_functions:
            if next_node is None:
                continue
            if next_node.name() == _ACCUMULATE_GRAD:
                variable = next_node.variable
                if id(variable) not in params and id(variable) not in given:
                    return "a block's graph reaches a tensor it was not given"
                continue
            if s0 <= next_node._sequence_nr() < s1:
                stack.append(next_node)
            elif _node_key(next_node) not in given_nodes:
                return "a block's graph reaches a tensor it was not given"
    return saved
