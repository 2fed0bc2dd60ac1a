"""Trace once, replay the rest, within a forward: a model's repeated blocks (the 24 decoder
layers of a transformer) traced a few times and replayed the others.

A block is an element of an ``nn.ModuleList`` or ``nn.Sequential`` among at least
:data:`MIN_BLOCKS` of the same class. Its calls are grouped by what decides the ops
they dispatch: the block's structure (its modules' classes and attributes, its
parameters' and buffers' layouts), its arguments (layouts, which share a storage,
plain values), and torch's switches. A plain attribute the blocks hold different values
of (transformers' ``layer_idx``) is left out of the structure, and the traced calls are
watched for reading it (:class:`replay_watch.Watch`, which also sees a global assigned,
and the plain globals read: a replay stands in only while they hold the values read):
where one reads it, its group is traced. In a group:

* the first calls are traced, and each one's storage events recorded as a template
  (storages renumbered from the window's first, modules as positions in the block),
  until two consecutive calls give the same template (the first call of a step may
  make a library's cached workspace, which the next does not);
* the calls after them are replayed, but for the last three elements of the list: each
  is one node of a custom autograd function whose forward appends the template's events
  again, on new storages, and returns fresh fake tensors of the outputs' layouts;
* the last three elements are traced, their forward compared with the template, and
  their backward recorded: the events between the node pre-hook of the block's output
  (every hook on the output has run) and the first event of a node it did not make
  (autograd runs a block's nodes one after the other: each is ready before any node made
  before the block, and after every node made after it), the storages it freed by what
  they were (its own saved activations, the gradient it got, the inputs it saved), and
  the gradients it left (its input's, its parameters'). Two in a row must be equal (the
  last block's gradient comes from the head, and may differ); the replayed blocks'
  backwards append them again.

The module hooks' events of the blocks' inner modules are replayed with them, and the
hooks the program would have registered on a replayed block's input and output are
registered (their events fall outside the block's window). What a replayed block kept
is kept as the program keeps it: the inputs it saves stay referenced until its backward
drops them where the recording freed them, so that they are freed only if nothing else
holds them; the gradient it got is freed where the recording freed it.

Whatever the replay cannot prove as it goes raises :class:`BlockReplayMiss`, and the trace
runs again without it (the report says why); what it can tell before replaying (a block
that reads tensor values, keeps a tensor, has hooks, changes its attributes, differs
from the template) leaves its group traced. ``TORCHMEM_REPLAY=0`` turns it off with the
loop's replay.

On a rank of ``parallel=``, the blocks are found once ``apply`` ran, and only FSDP2's
units replay: a block ``fully_shard`` made a unit of its own, whose own hooks are all its
FSDP2 state's. Those hooks (the all-gather before the unit's forward and backward, the
reduce-scatter after its backward, the casts of mixed precision) run around the block's
forward, not in it, and are traced for every block; the unit's parameters, gathered,
are what its forward and backward see, and its replayed backward leaves their gradients
for FSDP2's reduce-scatter as a traced one does. Inside a unit, tensor parallel's
modules replay with it: their hooks (the redistribution of their inputs and outputs)
keep no state, DTensor's autograd functions redistribute gradients, and a DTensor
parameter's replayed gradient is a DTensor of its recorded layout. DDP (its reducer hooks
each parameter's gradient in C++), other hooks, and blocks that are no unit are traced.

A pipeline rank's stages replay their blocks in each micro-batch's forward and backward:
each forward is a graph of its own (:meth:`Tracker.new_forward`), and the calls are
grouped by the step's phase too (under 1F1B the steady state's forwards run in the
backward phase) and by whether the stages are being set up (their metadata inferred by a
forward and a backward in the forward phase). A group's template serves every later
micro-batch, where FSDP2 takes each backward's gradients off the gathered parameters
(:meth:`BlockReplay._grads_leave`): a replayed backward must find none there.

Where the trace follows compiled code, blocks compiled alone (``module.compile()``, or
``torch.compile(module)`` put in the list) replay where the warm-up built each of their
regions' programs during one block's call (compiled_blocks.py): dynamo's guards passed
for the others, which ran those programs. Their compiled callable is set
(``_compiled_call_impl``, not the ``forward`` that dynamo's guards look at; a
``torch.compile`` wrapper's ``forward``, which calls its module's), their program's
autograd node is read as autograd's own nodes are (:func:`~.block_backward.block_graph`),
and a replayed call counts its programs' runs as the traced one ran them
(:meth:`~.compiled_program.Following.not_followed` compares them with the warm-up's).
Eager blocks replay beside compiled code, but those that run inside it (their forwards
set, dynamo's guards would fail) or call it. No module hook is registered while a block
runs (dynamo's guards see the global ones), and a block's backward ends where the node
its input came from begins (no module hook marks it).

This module is the driver; what decides a call's program, as values, is
:mod:`.block_keys`; the templates a traced block leaves, :mod:`.block_templates`; a
traced block's backward recorded and its graph, :mod:`.block_backward`; FSDP2's units,
tensor parallel's hooks and DTensor's functions, :mod:`.block_parallel`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
from torch import nn

from pytest_torchmem.engine.figures.report import ROOT_NAME
from pytest_torchmem.engine.figures.timeline import ALLOC, ENTER, EXIT, FREE, NAMED, RESIZE, Phase, StorageInfo
from pytest_torchmem.engine.step.built_in import hook_once
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing import replay_caches
from pytest_torchmem.engine.tracing.block_backward import Recorder, block_graph, holds
from pytest_torchmem.engine.tracing.block_keys import (
    DIFFERS, MIN_BLOCKS, PLAIN, arguments_key, block_lists, block_number, block_structure, cache_writes,
    compiled_call_name, difference, free_names, free_places, masked, saving_hooks,
)
from pytest_torchmem.engine.tracing.block_parallel import (
    dtensor_of, foreign_hooks, fsdp_state, hooked, moved_after_backward,
)
from pytest_torchmem.engine.tracing.block_templates import BackwardTemplate, ForwardTemplate, Group
from pytest_torchmem.engine.tracing.replay_events import layout_of, standin
from pytest_torchmem.engine.tracing.replay_state import global_hooks, parameter_hooks, switches
from pytest_torchmem.engine.tracing.replay_watch import Watch, unchanged

__all__ = ["MIN_BLOCKS", "BlockReplay", "BlockReplayMiss"]

FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
tree_flatten: Final = private("torch.utils._pytree.tree_flatten")
tree_unflatten: Final = private("torch.utils._pytree.tree_unflatten")
_DisableTorchFunction: Final = private("torch._C.DisableTorchFunction")
_sequence_nr: Final = private("torch._C._autograd._get_sequence_nr")

#: The elements at the end of a list that are traced: their backwards run first, and are
#: recorded for the replayed ones (the last one's may differ: its gradient comes from
#: the head).
_TAIL: Final = 3
_STRIDED: Final = torch.strided
_FORWARD: Final = Phase.FORWARD
_BACKWARD: Final = Phase.BACKWARD


class BlockReplayMiss(Exception):
    """A replay found, as it went, that it could not stand for the trace: the trace runs
    again without block replay."""


class BlockReplay:
    """Replays the repeated blocks of ``model``'s forward and backward (see the module).

    ``tracker`` is the trace's tracker; ``lines`` gets what was replayed, or why not.
    Entered around the step: it sets each block's ``forward`` (an instance attribute,
    removed on exit).
    """

    def __init__(
        self,
        tracker: Any,
        model: nn.Module,
        lines: list[str],
        *,
        parallel: bool = False,
        compiled: dict[int, Any] | None = None,
        program_runs: Callable[[], int] = lambda: 0,
        inside_compiled: frozenset[type] = frozenset(),
        under_compiled: frozenset[int] = frozenset(),
    ) -> None:
        self.tracker = tracker
        self.model = model
        self.lines = lines
        #: Under ``parallel=``: the blocks are found once ``apply`` ran (:meth:`attach`), and
        #: only FSDP2's units replay.
        self.parallel = parallel
        self._index = {id(m): i for i, m in enumerate(model.modules())}
        self._names = {id(m): name or ROOT_NAME for name, m in model.named_modules()}
        self._where: dict[int, tuple[str, int, int]] = {}  # id(block) -> (list, position, size)
        self._patched: list[nn.Module] = []
        self._groups: list[Group] = []
        self._busy = False  # a block is running (blocks in blocks are traced)
        self._recorders: list[Recorder] = []
        self._unbound: list[weakref.ref[Any]] = []
        self._called: dict[int, int] = {}
        #: Why the blocks of a list are all traced, found as they were looked at (by the list's name).
        self._unlike: dict[str, str] = {}
        #: The attributes a block's neighbours hold other plain values of (their places in its
        #: structure): replayed only where the traced calls never read them.
        self._free: dict[int, frozenset[int]] = {}
        #: Under ``parallel=``: the blocks that are FSDP2 units (:func:`fsdp_state`), found once.
        self._units: set[int] = set()
        #: In a pipeline: whether FSDP2 moves each unit's gradients off it (:meth:`_grads_leave`).
        self._leaving: dict[int, bool] = {}
        #: Under ``parallel=``: the model is a pipeline rank's stages (its micro-batches' forwards
        #: each a graph of their own; under 1F1B, the later ones in the step's backward phase).
        self.pipeline = False
        #: In a trace that follows compiled code: the blocks compiled alone that replay, by
        #: ``id``, with their regions (compiled_blocks.py), whose compiled callables are set
        #: instead of their forwards (which dynamo's guards see); eager blocks replay beside
        #: them but those run inside compiled code (of the classes ``inside_compiled``,
        #: which a compiled region's graph called; or modules of a compiled module, by
        #: ``id`` in ``under_compiled``), whose forwards set dynamo would see, and those
        #: whose traced calls ran compiled programs (``program_runs``: how many have run).
        self.compiled = compiled
        self._compiled_calls: dict[int, tuple[str, Callable[..., Any]]] = {}
        self.program_runs = program_runs
        self.inside_compiled = inside_compiled
        self.under_compiled = under_compiled

    # -- entering: the blocks' forwards -------------------------------------------------

    def __enter__(self) -> BlockReplay:
        if not self.parallel:
            self._find()
        return self

    def attach(self, model: nn.Module) -> None:
        """Under ``parallel=``: find the blocks of ``model``, what ``apply`` returned.

        A rank's blocks replay where ``apply`` sharded them in place with FSDP2's
        ``fully_shard``, each block a unit: its hooks (the all-gather before its forward
        and backward, the reduce-scatter after its backward) run outside the block's own
        forward, and are traced for every block; what runs inside is the same on every
        block. Anything else (DDP's reducer, whose hooks on the parameters' gradients a
        replayed backward would skip; tensor parallel's DTensors) is traced."""
        from pytest_torchmem.engine.parallel.pipeline import Pipelined

        self.pipeline = isinstance(model, Pipelined)
        # (a copy apply replaced is not held; a pipeline's stages are the copy's, sharded in place)
        same, self.model = model is self.model or self.pipeline, model
        if not same or any(foreign_hooks(m) for m in model.modules()):
            if block_lists(model):
                self.lines.append("blocks traced (under parallel=, only FSDP2's fully_shard units replay)")
            return
        if self.pipeline:
            self._names = {id(m): name for name, m in model.named_modules() if name}
        self._find()
        if not self._patched and not self._unlike and block_lists(model):
            self.lines.append("blocks traced (under parallel=, only FSDP2's fully_shard units replay)")

    def _find(self) -> None:
        owners = Counter(id(p) for m in self.model.modules() for p in m._parameters.values() if p is not None)
        for container, same_class in block_lists(self.model):
            name = self._names.get(id(container), "")
            # the blocks alike in structure, in order (a backbone's stages widen: each
            # stage's blocks are a list of their own, whose last ones are traced)
            by_structure: dict[Any, list[nn.Module]] = {}
            if self.parallel:
                self._units.update(id(block) for block in same_class if fsdp_state(block) is not None)
            with _DisableTorchFunction():
                structures = [block_structure(block, id(block) in self._units, self._is_compiled(block))
                              for block in same_class]
                free = free_places(structures)
                for block, structure in zip(same_class, structures):
                    by_structure.setdefault(masked(structure, free), []).append(block)
            for blocks in by_structure.values():
                if len(blocks) >= MIN_BLOCKS:
                    self._patch(name, blocks, owners, free)
            if all(len(blocks) < MIN_BLOCKS for blocks in by_structure.values()):
                a, b = list(by_structure)[:2]
                self._unlike[name] = f"its blocks differ: {difference((None, a), (None, b))}"

    def _patch(self, name: str, blocks: list[nn.Module], owners: Counter[int], free: frozenset[int]) -> None:
        """Set the forwards of ``blocks``, alike in class and structure but for the plain
        attributes ``free`` (by their place in the structure)."""
        for position, block in enumerate(blocks):
            if id(block) in self._where:
                continue
            if self.compiled is not None and id(block) not in self.compiled and (
                compiled_call_name(block) is not None
                or type(block) in self.inside_compiled
                or id(block) in self.under_compiled
            ):
                continue  # (compiled, but not alone or not alike; or run inside compiled code)
            if id(block) not in (self.compiled or ()) and "forward" in block.__dict__:
                continue
            if isinstance(block, torch.jit.ScriptModule):
                continue
            if self.parallel and id(block) not in self._units:
                continue  # (not a unit of its own: its parameters are gathered around another's forward)
            if any(owners[id(p)] > 1 for p in block.parameters()):
                continue  # (a parameter two blocks share sums its gradient over both)
            if any(id(m) not in self._index for m in block.modules()):
                continue  # (a module apply made: the step's module hooks do not number it)
            self._where[id(block)] = (name, position, len(blocks))
            self._free[id(block)] = free
            if self._is_compiled(block):
                attribute = compiled_call_name(block)
                assert attribute is not None
                call = block.__dict__[attribute]
                self._compiled_calls[id(block)] = (attribute, call)
                block.__dict__[attribute] = _CompiledBlockCall(self, block, call)
            else:
                block.__dict__["forward"] = _BlockForward(self, block)
            self._patched.append(block)

    def _is_compiled(self, block: nn.Module) -> bool:
        return self.compiled is not None and id(block) in self.compiled

    def __exit__(self, *exc: object) -> None:
        for block in self._patched:
            if id(block) in self._compiled_calls:
                attribute, call = self._compiled_calls.pop(id(block))
                block.__dict__[attribute] = call
            else:
                block.__dict__.pop("forward", None)
        self._patched.clear()
        self.tracker.watch = None
        self._recorders.clear()  # (a block's backward that never ran: its recorder holds its parameters)
        names = dict.fromkeys(group.name for group in self._groups)
        for name in names:
            groups = [group for group in self._groups if group.name == name]
            replayed = sum(group.replayed for group in groups)
            if replayed:
                calls = sum(group.calls for group in groups)
                free = sorted({attribute for group in groups for attribute in group.free})
                picking = sorted({n for group in groups if group.forward for _, n, _ in group.forward.writes})
                unread = [attribute for attribute in free if attribute not in picking]
                said = "".join(
                    f"; their {', '.join(attributes)}, {words}, differ"
                    for attributes, words in ((picking, "read only to pick the layer of the KV cache they fill"),
                                         (unread, "never read"))
                    if attributes
                )
                self.lines.append(f"{name}: {replayed} of {calls} block calls replayed (forward and backward{said})")
                continue
            # (a call alone in its group, the first of a list given the model's input, says nothing)
            whys = dict.fromkeys(group.why for group in groups if group.why is not None and group.calls > 1)
            if not whys and sum(group.calls for group in groups) >= MIN_BLOCKS > max(g.calls for g in groups):
                whys = {f"its blocks differ: {difference(groups[-2].signature, groups[-1].signature)}": None}
            if whys:
                self.lines.append(f"{name}: blocks traced ({'; '.join(whys)})")
        for name, why in self._unlike.items():
            if name not in names:
                self.lines.append(f"{name}: blocks traced ({why})")

    # -- a block's call ------------------------------------------------------------------

    def call(self, block: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tracker = self.tracker
        phase = tracker.phase
        if (
            self._busy
            or (phase is not _FORWARD and (phase is not _BACKWARD or not self.pipeline))
            or tracker.stop is not None
            or not tracker.quiet()
        ):
            return forward(*args, **kwargs)
        name, position, size = self._where[id(block)]
        leaves, spec = tree_flatten((args, kwargs))
        free = self._free[id(block)]
        with _DisableTorchFunction():
            structure = block_structure(block, id(block) in self._units, self._is_compiled(block))
            # (the KV caches it is given: the layers its numbers pick, as they are before the call)
            caches = [leaf for leaf in leaves if replay_caches.known(leaf)] if free else []
            slots = tuple(replay_caches.slot_state(cache, structure[place][2]) for cache in caches for place in sorted(free))
            signature = (
                type(block), masked(structure, free), arguments_key(leaves), str(spec),
                (*switches(), saving_hooks()), phase, tracker.setting_up, slots,
                id(self.compiled[id(block)]) if self._is_compiled(block) else None,
            )
        group = self._group(name, size, signature)
        serial = tracker.forwards
        if self._called.get(id(block)) == serial:
            # (its parameters' gradients would sum over its calls)
            if group.replayed:
                raise BlockReplayMiss(f"{name}: a block ran twice in one forward")
            group.why = group.why or "a block ran twice in one forward"
        self._called[id(block)] = serial
        group.calls += 1
        changed = unchanged(tuple(group.globals.values()))
        if changed is not None:
            if group.replayed:
                raise BlockReplayMiss(f"{name}: the global {changed}, which its blocks read, changed")
            group.why = group.why or f"the global {changed}, which its blocks read, changed"
        grad = torch.is_grad_enabled()
        if (
            group.forward is not None
            and self._replayable(group, position, size)
            and (not grad or (group.why is None and all(p.grad is None for p in block.parameters())))
            and self._backward_finds_no_gradients(group, block, grad)
        ):
            group.replayed += 1
            return self._replay(group, block, leaves, grad, structure)
        return self._record(group, block, position, forward, args, kwargs, leaves, grad, structure, caches)

    def _backward_finds_no_gradients(self, group: Group, block: nn.Module, grad: bool) -> bool:
        """Whether the backward of a call replayed now would find its block's parameters
        without gradients, as a replayed backward must: in a pipeline, where the
        micro-batches' backwards add theirs up on the parameters, only the set-up's."""
        if not grad or not self.pipeline or self.tracker.setting_up or self._grads_leave(block):
            return True
        if not group.replayed:
            group.why = group.why or "a pipeline's micro-batches add up their gradients on the blocks' parameters"
        return False

    def _grads_leave(self, block: nn.Module) -> bool:
        """In a pipeline: whether FSDP2 takes ``block``'s gradients off its gathered
        parameters after each micro-batch's backward, so that a later micro-batch's
        backward finds none (where it finds some, a replayed one cannot stand for it).
        2.10 to 2.14 move them into a gradient of the unit's reduce dtype, where that differs
        from theirs; 2.15, and a unit without a reduce dtype of its own, keep them."""
        found = self._leaving.get(id(block))
        if found is None:
            found = self._leaving[id(block)] = moved_after_backward(block)
        return found

    def _replayable(self, group: Group, position: int, size: int) -> bool:
        """Whether the call at ``position`` of ``size`` may be replayed, ``group``'s template
        made. In the forward that made it, the calls before it are traced; in a later one
        (a loop's next iteration, a pipeline's next micro-batch), only the first, whose
        input's gradient goes out of the list (the library workspaces a first call makes
        are made by then). The last three are traced for their backwards, recorded and
        compared, until a backward recorded twice alike is the template; from then on only
        the last, whose gradient comes from the head, is."""
        lower = group.start if group.made_in == self.tracker.forwards else 1
        upper = size - 1 if group.backward is not None else size - _TAIL
        return lower <= position < upper

    def _group(self, name: str, size: int, signature: Any) -> Group:
        for group in self._groups:
            if group.name == name and group.signature == signature:
                return group
        free = tuple(dict.fromkeys(e[1] for e in signature[1] if e[0] == "attribute" and e[2] is DIFFERS))
        group = Group(name, size, signature, free=free)
        self._groups.append(group)
        return group

    @property
    def replayed(self) -> int:
        """How many block calls were replayed."""
        return sum(group.replayed for group in self._groups)

    def vouch(self) -> None:
        """The step ran: raise :class:`BlockReplayMiss` where a replayed block may have made
        it run otherwise (the replayed outputs' values are not known: an op that needed
        them stopped the trace, or followed a fallback rule)."""
        tracker = self.tracker
        if self.replayed and (tracker.stop is not None or tracker.values_missed):
            raise BlockReplayMiss("an op needed values that replayed blocks' outputs do not carry")
        if any(ref() is not None for ref in self._unbound):
            raise BlockReplayMiss("a gradient a replayed block freed was still held")

    # -- tracing a block: the template --------------------------------------------------

    def _record(
        self,
        group: Group,
        block: nn.Module,
        position: int,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        grad: bool,
        structure: tuple[Any, ...],
        caches: list[Any],
    ) -> Any:
        tracker = self.tracker
        timeline = tracker.timeline
        start, first, reads = len(timeline.events), len(timeline.storages), tracker.value_reads
        s0 = _sequence_nr()
        inputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        # (following compiled code: no module hooks, which dynamo's guards see, and the
        # traced step has no module tracker whose hooks the observer would see)
        region = self.compiled[id(block)] if self._is_compiled(block) else None
        observer = _Observer(self, block, inputs) if grad and self.compiled is None else None
        runs = region.backend.calls if region is not None else self.program_runs()
        # (a group traced for a reason already is not watched: the trace function slows
        # every frame the call runs)
        snapshots = [replay_caches.Snapshot(cache) for cache in caches]
        watched = Watch(free_names(structure, self._free[id(block)]), replay_caches.update_code if caches else None)
        self._busy = True
        try:
            with watched if group.why is None else contextlib.nullcontext():
                output = forward(*args, **kwargs)
        finally:
            self._busy = False
            if observer is not None:
                observer.remove()
        s1 = _sequence_nr()
        if region is not None:
            # (how often its compiled programs ran: a replayed call counts them as run)
            runs = region.backend.calls - runs
            if group.runs is None:
                group.runs = runs
            elif group.runs != runs:
                group.why = group.why or "its compiled blocks ran their programs a different number of times"
        elif self.program_runs() != runs:
            group.why = group.why or "a block runs compiled code"
        with _DisableTorchFunction():
            group.globals.update(watched.globals)
            if watched.read:
                made, why = None, f"its blocks differ in attribute {watched.read}, which their forward reads"
            elif watched.wrote:
                made, why = None, f"a block assigns or changes {watched.wrote}"
            else:
                writes = cache_writes(watched.indexed, snapshots, leaves, structure, self._free[id(block)])
                if isinstance(writes, str):
                    made, why = None, writes
                else:
                    made, why = self._template(
                        block, start, first, reads, output, inputs, grad, observer, (s0, s1), writes
                    )
            unit = id(block) in self._units
            after = block_structure(block, unit, region is not None)
            if made is not None and masked(after, self._free[id(block)]) != group.signature[1]:
                made, why = None, "a block changed its own attributes"
            if made is None:
                group.why = group.why or why
            if made is None or group.why is not None:
                if group.replayed:
                    raise BlockReplayMiss(
                        f"{group.name}: a block traced after replayed ones differs ({why or group.why})"
                    )
                return output
            template, ranks = made
            if group.forward is not None:
                if template.key() != group.forward.key():
                    if group.replayed:
                        raise BlockReplayMiss(f"{group.name}: a block traced after replayed ones differs from them")
                    group.forward, group.why = None, "its blocks' storage events differ"
                    return output
            elif group.last is not None and group.last.key() == template.key():
                group.forward, group.start, group.made_in = template, position + 1, tracker.forwards
            group.last = template
            if grad and position >= group.size - _TAIL:
                self._watch_backward(group, block, template, ranks, inputs, output, (s0, s1), first)
        return output

    def _template(
        self,
        block: nn.Module,
        start: int,
        first: int,
        reads: int,
        output: Any,
        inputs: list[Any],
        grad: bool,
        observer: _Observer | None,
        sequence: tuple[int, int],
        writes: tuple[tuple[int, str, tuple[tuple[str, Any], ...]], ...],
    ) -> tuple[tuple[ForwardTemplate, dict[int, int]] | None, str]:
        tracker = self.tracker
        timeline = tracker.timeline
        if tracker.stop is not None:
            return None, "the trace stopped"
        if tracker.value_reads != reads:
            return None, "a block read tensor values"
        if not tracker.quiet():
            return None, "autograd's bookkeeping was pending after a block"
        if hooked(block, id(block) in self._units):
            return None, "its blocks have hooks"
        if global_hooks():
            return None, "a module hook is registered for every module"
        if parameter_hooks(block):
            return None, "its blocks' parameters have hooks"
        positions = self._positions(block)
        ranks: dict[int, int] = {}
        events: list[tuple[int, int, int]] = []
        for kind, a, b in timeline.events[start:]:
            if kind == ALLOC or kind == FREE or kind == RESIZE:
                if a < first:
                    return None, "a block freed or resized a storage made before it"
                events.append((kind, ranks.setdefault(a, len(ranks)), b))
            elif kind == ENTER or kind == EXIT:
                where = positions.get(a)
                if where is None:
                    return None, "a block ran a module outside it"
                events.append((kind, where, 0))
            elif kind == NAMED:
                events.append((kind, a, b))
            else:
                return None, "a block changed the step's phase"
        by_rank = sorted(ranks, key=ranks.__getitem__)
        infos = tuple(timeline.storages[sid] for sid in by_rank)
        ledger = tracker.ledger
        out_leaves, spec = tree_flatten(output)
        outputs: list[Any] = []
        held: set[int] = set()
        differentiable = 0
        for leaf in out_leaves:
            if isinstance(leaf, torch.Tensor):
                if type(leaf) is not FakeTensor or leaf.layout is not _STRIDED:
                    return None, f"a block returned a {type(leaf).__name__}"
                sid = ledger.storage_id(leaf)
                if sid is None or sid not in ranks or sid in held:
                    return None, "a block returned a tensor it did not make, or two on one storage"
                held.add(sid)
                differentiable += leaf.requires_grad
                outputs.append((layout_of(leaf, ranks[sid]), leaf.requires_grad))
            elif type(leaf) in PLAIN:
                outputs.append(leaf)
            else:
                return None, f"a block returned a {type(leaf).__name__}"
        if differentiable > 1:
            return None, "a block returned more than one tensor that requires grad"
        if grad and differentiable and sum(t.requires_grad for t in inputs) != 1:
            return None, "a block's backward takes more than one input's gradient, or none"
        # (what it left in a KV cache: the cache holds it, as it holds a replayed block's)
        left: list[tuple[int, str, tuple[tuple[str, Any], ...]]] = []
        cached: set[int] = set()
        for position, name, attributes in writes:
            values = []
            for attribute, value in attributes:
                if type(value) in PLAIN:
                    values.append((attribute, value))
                    continue
                if type(value) is not FakeTensor or value.layout is not _STRIDED:
                    return None, f"a block left a {type(value).__name__} in its KV cache"
                sid = ledger.storage_id(value)
                if sid is None or sid not in ranks or sid in held or sid in cached:
                    return None, "a block left a tensor in its KV cache that it did not make, or two on one storage"
                cached.add(sid)
                values.append((attribute, (layout_of(value, ranks[sid]), value.requires_grad)))
            left.append((position, name, tuple(values)))
        alive = {sid for sid in ranks if ledger.holds(sid)}
        saved = alive - held - cached
        if any(ledger.nbytes_now(sid) != timeline.storages[sid].nbytes for sid in alive):
            return None, "a block resized a storage it left alive"
        kept: tuple[int, ...] = ()
        graph_cached: frozenset[int] = frozenset()
        trailing: tuple[Any, ...] = ()
        leading: tuple[Any, ...] = ()
        if saved and not (grad and differentiable):
            # (only a backward frees what a block saved: without one, it keeps them)
            return None, "a block keeps tensors it made beside its output"
        if grad and differentiable:
            found = block_graph(block, out_leaves, inputs, sequence, ledger, self._is_compiled(block))
            if isinstance(found, str):
                return None, found
            if any(not holds(ledger.holder(sid), found) for sid in saved - found):
                return None, "a block keeps a tensor it made beyond its output and its graph"
            kept = tuple(i for i, t in enumerate(inputs) if ledger.storage_id(t) in found)
            graph_cached = frozenset(ranks[sid] for sid in cached & found)
        if observer is not None:
            if observer.why is not None:
                return None, observer.why
            trailing = tuple(observer.trailing)
            at = {id(t): i for i, t in enumerate(out_leaves)}
            leading = tuple((where, tuple(at[id(t)] for t in ts)) for where, ts in observer.leading_of(out_leaves))
        template = ForwardTemplate(
            tuple(events),
            infos,
            tuple(positions.get(info.module) for info in infos),
            spec,
            tuple(outputs),
            frozenset(ranks[sid] for sid in saved),
            kept,
            trailing,
            leading,
            tuple(left),
            graph_cached,
        )
        return (template, ranks), ""

    def _positions(self, block: nn.Module) -> dict[int, int]:
        """The module indices of ``block``'s modules, by their position in the block."""
        return {self._index[id(m)]: position for position, m in enumerate(block.modules())}

    def _absolute(self, block: nn.Module) -> list[int]:
        return [self._index[id(m)] for m in block.modules()]

    # -- replaying a block ---------------------------------------------------------------

    def _replay(self, group: Group, block: nn.Module, leaves: list[Any], grad: bool, structure: tuple[Any, ...]) -> Any:
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        template = group.forward
        assert template is not None
        if self._is_compiled(block):
            assert group.runs is not None
            self.compiled[id(block)].backend.calls += group.runs  # type: ignore[index]
        # (the KV cache layers its numbers pick: where it leaves what the template left)
        free = self._free[id(block)]
        slots = [
            (replay_caches.layer(leaves[position], block_number(structure, free, name)), attributes)
            for position, name, attributes in template.writes
        ]
        with _DisableTorchFunction():
            if grad:
                outputs = _Replayed.apply(self, group, block, slots, *tensors)
            else:
                outputs = self._forward(None, group, block, slots, tensors)
            out_leaves: list[Any] = []
            made = iter(outputs)
            for spec in template.outputs:
                out_leaves.append(next(made) if type(spec) is tuple else spec)
            if grad:
                # the hooks the inner modules' would have left on the block's input and output
                absolute = self._absolute(block)
                positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
                for where, inputs in template.trailing:
                    hook_once(tuple(leaves[positions[i]] for i in inputs), self.tracker.exit_module, absolute[where])
                for where, outs in template.leading:
                    hook_once(tuple(out_leaves[i] for i in outs), self.tracker.enter_module, absolute[where])
        return tree_unflatten(out_leaves, template.spec)

    def _forward(
        self, ctx: Any, group: Group, block: nn.Module, slots: list[tuple[Any, Any]], tensors: Sequence[torch.Tensor]
    ) -> tuple[Any, ...]:
        template = group.forward
        assert template is not None
        tracker = self.tracker
        absolute = self._absolute(block)
        sids = _append(tracker, template.events, template.infos, template.modules, absolute, {})
        outputs = []
        for spec in template.outputs:
            if type(spec) is tuple:
                layout, _ = spec
                t = standin(tracker.fake_mode, layout)
                tracker.ledger.bind(t, sids[layout.key])
                outputs.append(t)
        # what it leaves in its KV cache's layer, held by the cache and (until its backward
        # drops it where the program's graph did) by the node, as the program's are
        cached: dict[int, torch.Tensor] = {}
        for layer, attributes in slots:
            for attribute, value in attributes:
                if type(value) is tuple:
                    layout, requires_grad = value
                    t = standin(tracker.fake_mode, layout)
                    tracker.ledger.bind(t, sids[layout.key])
                    if requires_grad:
                        t.requires_grad_(True)
                    if layout.key in template.cached_saved:
                        cached[layout.key] = t
                    value = t
                setattr(layer, attribute, value)
        if ctx is not None:
            ctx.cached = cached
            ctx.set_materialize_grads(False)
            ctx.sids = sids
            ctx.block = block
            ctx.group = group
            ctx.kept = {i: tensors[i] for i in template.kept_inputs}
            ctx.tether = _Tether(tracker.timeline, [sids[r] for r in sorted(template.saved)])
            for spec, t in zip((s for s in template.outputs if type(s) is tuple), outputs):
                if not spec[1]:
                    ctx.mark_non_differentiable(t)
        return tuple(outputs)

    def _backward(self, ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        group: Group = ctx.group
        block: nn.Module = ctx.block
        tracker = self.tracker
        template = group.backward
        if template is None:
            raise BlockReplayMiss(
                f"{group.name}: a replayed block's backward ran before a traced one's was recorded"
                + (f" ({group.why})" if group.why else "")
            )
        if any(ref() is not None for ref in self._unbound):
            raise BlockReplayMiss(f"{group.name}: a gradient a replayed block freed was still held")
        self._unbound.clear()
        params = list(block.parameters())
        if any(p.grad is not None for p in params):
            raise BlockReplayMiss(f"{group.name}: a block's parameters had gradients before its backward")
        got = [g for g in grads if g is not None]
        if len(got) != 1:
            raise BlockReplayMiss(f"{group.name}: a replayed block got {len(got)} gradients, not one")
        ledger = tracker.ledger
        gsid = ledger.storage_id(got[0])
        if gsid is None or type(got[0]) is not FakeTensor or layout_of(got[0], -1) != template.grad_out:
            raise BlockReplayMiss(f"{group.name}: a replayed block got a gradient unlike the recorded one's")
        with _DisableTorchFunction():
            absolute = self._absolute(block)
            kept: dict[int, Any] = ctx.kept

            cached: dict[int, torch.Tensor] = ctx.cached

            def external(kind: str, rank: int, event: int) -> int | None:
                if kind == "f":
                    if rank in cached:
                        # (the graph's reference dropped: freed if the cache no longer holds it)
                        del cached[rank]
                        return None
                    return ctx.sids[rank]  # type: ignore[no-any-return]
                if kind == "g":
                    storage = ledger.unbind(gsid)
                    if storage is not None:
                        self._unbound.append(weakref.ref(storage))
                    return gsid
                kept.pop(rank, None)  # ("i": the input's reference dropped; freed if it was the last)
                return None

            sids = _append(tracker, template.events, template.infos, template.modules, absolute, {}, external)
            kept.clear()
            ctx.tether.done()
            # (what the recorded backward did not free, its KV cache held: it must still)
            left = [ctx.sids[rank] for rank in cached]
            cached.clear()
            if not all(ledger.holds(sid) for sid in left):
                raise BlockReplayMiss(f"{group.name}: a replayed block's KV cache was dropped before its backward")
            out: list[Any] = [None] * (len(ctx.needs_input_grad) - 4)
            for position, layout in template.grads_in:
                if layout.key < 0:  # the gradient it got, handed on (its layout checked above)
                    out[position] = got[0]
                    continue
                t = standin(tracker.fake_mode, layout)
                ledger.bind(t, sids[layout.key])
                out[position] = t
            for p, made in zip(params, template.param_grads):
                if made is not None:
                    layout, spec = made
                    t = standin(tracker.fake_mode, layout)
                    ledger.bind(t, sids[layout.key])
                    p.grad = t if spec is None else dtensor_of(t, spec)
        return tuple(out)

    # -- recording a traced block's backward --------------------------------------------

    def _watch_backward(
        self,
        group: Group,
        block: nn.Module,
        template: ForwardTemplate,
        ranks: dict[int, int],
        inputs: list[Any],
        output: Any,
        sequence: tuple[int, int],
        first: int,
    ) -> None:
        out_leaves, _ = tree_flatten(output)
        differentiable = [t for t in out_leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        wanting = [(i, t) for i, t in enumerate(inputs) if t.requires_grad]
        if len(differentiable) != 1 or len(wanting) != 1:
            group.why = group.why or "a block's backward takes more than one input's or output's gradient"
            return
        recorder = Recorder(self, group, block, template, ranks, inputs, sequence, first)
        recorder.last = self._where[id(block)][1] == group.size - 1
        differentiable[0].register_hook(recorder.got)
        differentiable[0].grad_fn.register_prehook(recorder.begins)
        position, t = wanting[0]
        t.register_hook(lambda grad: recorder.gave(position, grad))
        self._recorders.append(recorder)
        self.tracker.watch = self._watch

    def _watch(self, kind: int, index: int) -> None:
        for recorder in self._recorders:
            recorder.watch(kind, index)

    def _recorded(self, recorder: Recorder, template: BackwardTemplate | None, why: str) -> None:
        self._recorders.remove(recorder)
        if not self._recorders:
            self.tracker.watch = None
        group = recorder.group
        if template is None:
            group.why = group.why or why
        elif group.backward is not None:
            # (the last block's gradient comes from the head: its backward may differ, as it
            # did when the template was made; another step's, or micro-batch's, is not compared)
            if group.backward.key() != template.key() and not recorder.last:
                group.backward, group.why = None, group.why or "its blocks' backwards differ"
        elif group.recorded is not None and group.recorded.key() == template.key():
            group.backward = template
        else:
            group.recorded = template


class _BlockForward:
    """A block's ``forward`` while the replay is entered (an instance attribute): its class's,
    called through the replay. To the program it is the bound method it stands for: its
    signature (``inspect.signature``, through ``__wrapped__``), ``__self__``, ``__func__``,
    name, code and documentation (a library that passes an argument only to the layers
    whose forward takes it asks)."""

    __slots__ = ("replay", "forward", "block")

    def __init__(self, replay: BlockReplay, block: nn.Module) -> None:
        self.replay = replay
        self.block = weakref.ref(block)
        self.forward = type(block).forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block()
        bound = self.forward.__get__(block)
        return self.replay.call(block, bound, args, kwargs)

    @property
    def __wrapped__(self) -> Any:
        return self.forward.__get__(self.block())

    @property  # type: ignore[override]
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.forward.__doc__

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return repr(self.__wrapped__)


class _CompiledBlockCall:
    """A compiled block's compiled callable while the replay is entered (an instance
    attribute: ``module.compile()``'s ``_compiled_call_impl``, whose block's ``forward`` is
    left as it is, for dynamo's guards look at it; or the ``forward`` of ``torch.compile(module)``'s
    wrapper, which calls its module's): called through the replay."""

    __slots__ = ("replay", "block", "call")

    def __init__(self, replay: BlockReplay, block: nn.Module, call: Callable[..., Any]) -> None:
        self.replay = replay
        self.block = weakref.ref(block)
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.replay.call(self.block(), self.call, args, kwargs)  # type: ignore[arg-type]


class _Replayed(torch.autograd.Function):
    """A replayed block: one autograd node, its backward the recorded one's events."""

    @staticmethod
    def forward(
        ctx: Any, replay: BlockReplay, group: Group, block: nn.Module, slots: list[Any], *tensors: torch.Tensor
    ) -> Any:
        ctx.replay = replay
        return replay._forward(ctx, group, block, slots, tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (None, None, None, None, *ctx.replay._backward(ctx, grads))


class _Tether:
    """Frees a replayed block's saved activations if its graph dies without a backward (the
    program's nodes would free them then); its backward frees them itself (:meth:`done`)."""

    __slots__ = ("sids", "timeline")

    def __init__(self, timeline: Any, sids: list[int]) -> None:
        self.timeline = timeline
        self.sids = sids

    def done(self) -> None:
        self.sids = []

    def __del__(self) -> None:
        for sid in self.sids:
            self.timeline.free(sid)


class _Observer:
    """Which of a traced block's inner modules the module hooks watch on the block's own
    input or output (their backward events fall outside the block's window)."""

    def __init__(self, replay: BlockReplay, block: nn.Module, inputs: list[Any]) -> None:
        self.positions = replay._positions(block)
        self.index = replay._index
        self.block = block
        self.inputs = {id(t): i for i, t in enumerate(inputs) if t.requires_grad}
        self.trailing: list[tuple[int, tuple[int, ...]]] = []
        self.outputs: list[tuple[int, list[weakref.ref[Any]]]] = []
        self.why: str | None = None
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._before),
            nn.modules.module.register_module_forward_hook(self._after, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _where(self, module: nn.Module) -> int | None:
        if module is self.block:
            return None
        index = self.index.get(id(module))
        return None if index is None else self.positions.get(index)

    def _before(self, module: nn.Module, args: Any) -> None:
        where = self._where(module)
        if where is None:
            return
        wanting = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        given = [self.inputs[id(t)] for t in wanting if id(t) in self.inputs]
        if given and len(given) != len(wanting):
            self.why = "an inner module of a block took its input beside its own tensors"
        elif given:
            self.trailing.append((where, tuple(given)))

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        where = self._where(module)
        if where is None:
            return
        wanting = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if wanting:
            self.outputs.append((where, [weakref.ref(t) for t in wanting]))

    def leading_of(self, out_leaves: list[Any]) -> list[tuple[int, list[Any]]]:
        """The inner modules that returned the block's own output tensors (those alone)."""
        found = []
        ids = {id(t) for t in out_leaves if isinstance(t, torch.Tensor)}
        for where, refs in self.outputs:
            ts = [r() for r in refs]
            mine = [t for t in ts if t is not None and id(t) in ids]
            if mine and len(mine) != len(ts):
                self.why = "an inner module of a block returned its output beside other tensors"
            elif mine:
                found.append((where, mine))
        return found


# -- helpers ---------------------------------------------------------------------------------


def _append(
    tracker: Any,
    events: Sequence[tuple[int, Any, int]],
    infos: Sequence[StorageInfo],
    modules: Sequence[int | None],
    absolute: list[int],
    sids: dict[int, int],
    external: Callable[[str, int, int], int | None] | None = None,
) -> dict[int, int]:
    """``events`` again on the timeline: the storages they make new (by rank, in ``sids``),
    inner modules as ``absolute`` numbers them; the others through ``external``."""
    timeline = tracker.timeline
    storages, out = timeline.storages, timeline.events
    for kind, ref, b in events:
        if kind == ENTER:
            tracker.enter_module(absolute[ref])
        elif kind == EXIT:
            tracker.exit_module(absolute[ref])
        elif kind == NAMED:
            out.append((kind, ref, b))
        else:
            if type(ref) is tuple:
                tag, rank = ref
                if tag != "b":
                    assert external is not None
                    sid = external(tag, rank, kind)
                    if sid is not None:
                        out.append((kind, sid, b))
                    continue
            else:
                rank = ref
            sid = sids.get(rank)
            if sid is None:
                where = modules[rank]
                info = infos[rank]
                sid = sids[rank] = len(storages)
                storages.append(info if where is None else _moved(info, absolute[where]))
            out.append((kind, sid, b))
    return sids


def _moved(info: StorageInfo, module: int) -> StorageInfo:
    """``info`` made in ``module`` (a replayed block's own): a copy, field by field (the
    fields are all plain values)."""
    return StorageInfo(info.nbytes, info.category, info.phase, module, info.op, info.frames, info.node, info.pool)


