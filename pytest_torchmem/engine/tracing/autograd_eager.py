"""Where autograd treats fake tensors otherwise than plain ones, the trace does as eager autograd does.

Fake tensors are tensor subclasses, and autograd takes other paths for
subclasses than for the plain tensors of the real step. :class:`AutogradAsEager`
follows the eager paths, one section each:

- **the input buffer's sum**: the engine adds a second gradient into the first
  in place when it holds the only reference to it, on plain tensors only
  (:meth:`~AutogradAsEager.accumulates_in_place`);
- **backward formulas**: some pick another algorithm for subclasses; the
  device gives such an op an eager replica, run in place of the node's own;
- **wrapped numbers autograd saves**: ``x / 3.0`` saves the 0-dim tensor ATen
  wrapped 3.0 in, until the node is released;
- **views written in place**: autograd replays a view's ops where a plain
  tensor's node would allocate the base's gradient (``as_strided_backward``).

What it follows of autograd's C++ (reference counts, node names, the names of
saved attributes) is named below with the source it follows, and pinned on
the running torch by ``tests/test_torch_constants.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Final

import torch

from pytest_torchmem.engine.parallel import threads
from pytest_torchmem.engine.figures.timeline import Phase
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.ledger import StorageLedger
from pytest_torchmem.engine.tracing.op_plans import number_nbytes
from pytest_torchmem.engine.tracing.rules import REPLICA, Formula, FormulaCall, TraceContext

__all__ = [
    "AutogradAsEager",
    "COPY_SLICES",
    "INPUT_BUFFER_ONLY_STORAGE_USE_COUNT",
    "INPUT_BUFFER_ONLY_USE_COUNT",
    "RAW_SAVED_PREFIX",
    "SAVED_PREFIX",
]

# torch's private names (engine/torch_compat/torch_private.py), bound once: read per op in backward.
_current_autograd_node: Final = private("torch._C._current_autograd_node")
_storage_use_count: Final = private("torch._C._storage_Use_Count")
_SavedTensor: Final = private("torch._C._autograd.SavedTensor")
_DisableTorchDispatch: Final = private("torch._C._DisableTorchDispatch")
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")

_STRIDED: Final = torch.strided

# -- what autograd's C++ is, as the trace reads it -----------------------------------------

# ``InputBuffer::accumulate`` (torch/csrc/autograd/input_buffer.cpp) sums a second
# gradient into the first in place (``old_var.add_(var)``) when grad mode is off and
# ``can_accumulate_inplace(old_var)``: a dense, non-subclass tensor whose
# ``use_count()`` and ``storage().use_count()`` are 1 (the buffer holds the only
# reference), else out of place (``old_var + var``). Fake tensors are subclasses: the
# engine always takes the second branch, and the tracker sees its ``add`` in
# ``__torch_dispatch__``, where the counts include the references on the way there:
#: ``old._use_count()`` inside ``__torch_dispatch__`` of the engine's ``add`` when the input
#: buffer holds the only reference to ``old``: its 1, and 3 the dispatch into Python adds
#: (the boxed call's argument stack and the Python object among them).
INPUT_BUFFER_ONLY_USE_COUNT: Final = 4
#: ``torch._C._storage_Use_Count`` of that ``old``'s storage, read through
#: ``old.untyped_storage()``: the tensor's 1, and the Python storage object's.
INPUT_BUFFER_ONLY_STORAGE_USE_COUNT: Final = 2
#: The name's end of ``torch::autograd::CopySlices`` (torch/csrc/autograd/functions/tensor.h),
#: the node autograd gives the base of a view written in place (``rebase_history`` in
#: torch/csrc/autograd/variable.cpp); ``Node.name()`` spells it ``torch::autograd::CopySlices``.
COPY_SLICES: Final = "CopySlices"
#: How a generated backward node names a saved argument ``name`` (``_saved_other``) and its
#: raw :class:`SavedTensor` (``_raw_saved_other``): tools/autograd/gen_autograd_functions.py.
SAVED_PREFIX: Final = "_saved_"
RAW_SAVED_PREFIX: Final = "_raw_saved_"
_RAW: Final = RAW_SAVED_PREFIX.removesuffix(SAVED_PREFIX)  # "_raw" + "_saved_other"

# -- our marks in a node's metadata ---------------------------------------------------------

#: Marks (in ``Node.metadata``) a replayed view node given the as_strided_backward hook.
_AS_STRIDED_MARK: Final = "torchmem_as_strided_backward"
#: The wrapped numbers (in ``Node.metadata``) the node inside a CopySlices saved.
_SAVED_NUMBERS: Final = "torchmem_saved_numbers"
#: Tokens (in ``Node.metadata``) that die with the node.
_TOKENS: Final = "torchmem_tokens"
#: Whether a backward node's ``apply`` is running (in ``Node.metadata``): set by
#: the node's prehook, cleared by its post hook (see ``note_running_node``).
_RUNNING: Final = "torchmem_running"
#: Whether a node's own formula runs unrecorded (in ``Node.metadata``): its eager
#: replica (a :class:`Formula`) runs in the post hook instead.
_SILENT: Final = "torchmem_silent"
#: The most view ops between a view written in place and its base that are modelled.
_MAX_VIEW_CHAIN: Final = 16
#: What a storage held for a saved wrapped number is made by.
_SAVED_NUMBER_OP: Final = "<saved wrapped scalar>"


class AutogradAsEager:
    """The trace's autograd, as eager autograd runs on plain tensors (see the module).

    Storages autograd holds itself (saved wrapped numbers) are charged to
    ``ledger``; replaced formulas run with ``context``. What an op leaves pending
    (a node autograd attaches after the op returns) is settled before the next op
    or step event (:meth:`settle`).
    """

    def __init__(self, ledger: StorageLedger, context: TraceContext) -> None:
        self.ledger: Final = ledger
        self.context: Final = context
        # Ops that took Python numbers in Tensor slots while autograd was recording:
        # (weak refs to their outputs, the outputs' nodes before the op, the slots'
        # names, a probe for a node out of reach), settled once autograd has
        # attached the op's node.
        self.pending_numbers: list[tuple[list[weakref.ref[Any]], list[Any], list[str], _NumbersProbe]] = []
        self._saved_numbers: set[int] = set()  # _cdata of wrapped numbers autograd saved
        # Views an in-place op wrote into while autograd was recording (weak refs),
        # whose regenerated nodes are settled once autograd has rebased them.
        self.pending_views: list[weakref.ref[Any]] = []
        # Outputs of ops whose node gets an eager formula (weak refs), settled once
        # autograd has attached the node; how many such nodes run unrecorded now.
        self.pending_formulas: list[tuple[weakref.ref[Any], Formula]] = []
        self.silent = 0

    def settle(self, phase: Phase | None, module: int, final: bool = False) -> None:
        """Settle what the last ops left pending (``final``: the phase ends)."""
        self.settle_numbers(phase, module, final)
        self._settle_views()
        self._settle_formulas()

    def settle_pending(self, phase: Phase | None, module: int) -> None:
        """:meth:`settle`, where something is pending (mostly nothing is)."""
        if self.pending_numbers:
            self.settle_numbers(phase, module)
        if self.pending_views:
            self._settle_views()
        if self.pending_formulas:
            self._settle_formulas()

    # -- the input buffer's sum -------------------------------------------------------------

    def note_running_node(self) -> None:
        """Mark the backward node running this op as inside its ``apply``.

        ``Engine::evaluate_function`` (``torch/csrc/autograd/engine.cpp``) adds a
        node's outputs into the next nodes' input buffers under the same current
        node as its ``apply``, after the post hooks. An ``add`` of the backward
        formula itself (``var_mean_backward``'s ``gself + aux``, ``i1e``'s
        ``self.sgn() + result.reciprocal()``) is always out of place, and must not
        be taken for the buffer's in-place accumulation: the node's first other op
        registers a prehook and a post hook that say whether ``apply`` runs. A node
        whose ``apply`` dispatched no other op before an ``add`` is not known, and
        the use counts decide as before.
        """
        node = _current_autograd_node()
        if node is None:
            return
        meta = node.metadata
        if _RUNNING in meta:
            return
        meta[_RUNNING] = True

        def started(*_: Any) -> None:
            meta[_RUNNING] = True

        def finished(*_: Any) -> None:
            meta[_RUNNING] = False

        node.register_prehook(started)
        node.register_hook(finished)

    def accumulates_in_place(self, args: tuple[Any, ...], kwargs: dict[str, Any], phase: Phase | None) -> bool:
        """Whether this ``add`` is autograd's input buffer summing two gradients in place.

        The engine (``InputBuffer::accumulate``) does ``old.add_(new)`` when grad
        mode is off and it holds the last reference to ``old`` and its storage,
        which is dense; otherwise ``old + new``. Fake tensors count as tensor
        subclasses, for which the engine always takes the second branch. Not while
        the node's ``apply`` runs (:meth:`note_running_node`): that ``add`` is the
        formula's.
        """
        if kwargs or len(args) != 2 or torch.is_grad_enabled() or phase != Phase.BACKWARD:
            return False
        old, new = args
        node = _current_autograd_node()
        if (
            type(old) is not FakeTensor
            or type(new) is not FakeTensor
            or node is None
            or node.metadata.get(_RUNNING, False)
            or old.shape != new.shape
            or old.dtype != new.dtype
            or old.layout is not _STRIDED
            or new.layout is not _STRIDED
            or not _dense(old)
        ):
            return False
        return (
            old._use_count() == INPUT_BUFFER_ONLY_USE_COUNT
            and _storage_use_count(old.untyped_storage()._cdata) == INPUT_BUFFER_ONLY_STORAGE_USE_COUNT
        )

    # -- backward formulas run as eagerly ------------------------------------------
    #
    # Some backward formulas pick another algorithm for tensor subclasses, which
    # fake tensors are, than eagerly (``cumprod_backward``: by ``(input == 0).any()``
    # on plain tensors, always the masked one on subclasses). The device gives
    # such an op a :class:`Formula`, a Python replica of the eager formula: its
    # node gets hooks where autograd made it, the node's own formula then runs
    # unrecorded, and the replica runs in the post hook, through the trace, its
    # gradients replacing the node's.

    def in_silent_node(self) -> bool:
        """Whether the running node's own formula runs unrecorded (its replica runs after)."""
        node = _current_autograd_node()
        return node is not None and node.metadata.get(_SILENT, False)

    def remember_formula(self, out: Any, formula: Formula) -> None:
        """The op that made ``out`` gets ``formula`` for its node, once autograd attaches it."""
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor):
            self.pending_formulas.append((weakref.ref(first), formula))

    def _settle_formulas(self) -> None:
        pending, self.pending_formulas = self.pending_formulas, []
        for ref, formula in pending:
            t = ref()
            node = None if t is None else t.grad_fn
            if node is None or node.name() != formula.node or _SILENT in node.metadata:
                continue
            self._replace_formula(node, formula)

    def _replace_formula(self, node: Any, formula: Formula) -> None:
        meta = node.metadata
        meta[_SILENT] = False
        # the hooks say when apply runs (see note_running_node), registered here
        # rather than from inside the node, where the post hooks are being run
        meta[_RUNNING] = False

        # (the hooks find the node as the engine's current one: holding it in their
        # closures would make a cycle that keeps its saved tensors until a collection)
        def started(grads: Any) -> None:
            meta[_RUNNING] = True
            node = _current_autograd_node()
            call = FormulaCall(node, tuple(grads), (), self.context)
            if all(_saved_without_hooks(node, f"{SAVED_PREFIX}{name}") is not None for name in formula.saved):
                if formula.applies(call):
                    meta[_SILENT] = True
                    self.silent += 1

        def finished(grad_inputs: Any, grads: Any) -> Any:
            if not meta.get(_SILENT, False):
                meta[_RUNNING] = False
                return None
            meta[_SILENT] = False
            self.silent -= 1
            needed = tuple(g is not None for g in grad_inputs)
            meta[REPLICA] = True
            node = _current_autograd_node()
            try:
                replaced = formula.backward(FormulaCall(node, tuple(grads), needed, self.context))
            finally:
                meta[_RUNNING] = meta[REPLICA] = False
            return tuple(replaced)

        node.register_prehook(started)
        node.register_hook(finished)

    # -- wrapped numbers that autograd saves --------------------------------------
    #
    # The wrapped-number tensor of ``x / 3.0`` is saved by ``DivBackward0`` (its
    # ``other``): it lives on until the backward node releases it, and the
    # backward's ``grad / other`` reuses it instead of wrapping a new one. The
    # fake trace sees plain Python numbers, but autograd saves the same real
    # wrapped tensors during the trace, so their lifetimes can be followed.

    def fresh_numbers(self, numbers: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``numbers`` less those the running backward node unpacked from its saved ones."""
        node = _current_autograd_node()
        if node is None:
            return numbers
        # (CopySlices runs the node of an in-place op on a view, which saved these)
        saved = list(node.metadata.get(_SAVED_NUMBERS, ())) if _is_copy_slices(node) else []
        for attr in dir(node) if self._saved_numbers else ():
            if attr.startswith(SAVED_PREFIX):
                value = _saved_without_hooks(node, attr)
                if isinstance(value, torch.Tensor) and value._cdata in self._saved_numbers:
                    with _DisableTorchDispatch():  # a real tensor: read it directly
                        saved.append(value.item())
        fresh = []
        for name, value in numbers:
            if value in saved:
                saved.remove(value)
            else:
                fresh.append((name, value))
        return fresh

    def remember_numbers(
        self, func: Any, args: Any, kwargs: Any, out: Any, numbers: list[tuple[str, Any]]
    ) -> None:
        """The op ``func`` took the Python ``numbers`` in Tensor slots: the ones its node
        saves are charged once autograd attaches it."""
        inputs = [*args, *kwargs.values()]
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return
        results = out if isinstance(out, (tuple, list)) else (out,)
        outs = [t for t in results if isinstance(t, torch.Tensor)]
        if outs:
            # An in-place op's output keeps its old node until autograd rebases it.
            before = [t.grad_fn for t in outs]
            probe = _NumbersProbe(func, args, kwargs, numbers)
            names = [name for name, _ in numbers]
            self.pending_numbers.append(([weakref.ref(t) for t in outs], before, names, probe))

    def settle_numbers(self, phase: Phase | None, module: int, final: bool = False) -> None:
        """Charge the wrapped numbers that the last ops' backward nodes saved, until released.

        Called before the next op (or step event), once autograd has attached the
        node to the op's outputs; nothing is allocated in between.
        """
        pending, self.pending_numbers = self.pending_numbers, []
        for refs, before, names, probe in pending:
            outs = [(t, old) for t, old in zip((r() for r in refs), before) if t is not None]
            node = next((t.grad_fn for t, old in outs if t.grad_fn not in (None, old)), None)
            if node is None:
                if outs and not final:  # autograd has not attached the op's node yet
                    self.pending_numbers.append((refs, before, names, probe))
                continue
            copy_slices = _copy_slices_of_write(probe, [t for t, _ in outs])
            if copy_slices is not None:
                # An in-place op on a view: its node is inside CopySlices, out of reach.
                for value in probe.saved():
                    self._charge_number_until(value, copy_slices, phase, module)
                continue
            for name in names:
                saved = _saved_without_hooks(node, f"{SAVED_PREFIX}{name}")
                if (
                    not isinstance(saved, torch.Tensor)
                    or isinstance(saved, FakeTensor)
                    or saved.dim() != 0
                    or saved._cdata in self._saved_numbers
                ):
                    continue
                self._charge_saved_number(saved, phase, module)

    def _charge_number_until(self, value: Any, node: Any, phase: Phase | None, module: int) -> None:
        """Charge the wrapped number ``value`` that the CopySlices ``node`` holds (in its
        in-place op's node), which its backward reuses, until the node has run or is
        destroyed (a graph dropped unrun: a checkpoint's recomputation)."""
        ledger = self.ledger
        sid = ledger.held(number_nbytes(value), _SAVED_NUMBER_OP, phase, module)
        node.metadata.setdefault(_SAVED_NUMBERS, []).append(value)
        held = [True]

        def release(*_: Any) -> None:
            if held.pop() if held else False:
                ledger.release(sid)

        node.register_hook(release)
        # The node's metadata dies with it: a token there tells when.
        token = _Token()
        node.metadata.setdefault(_TOKENS, []).append(token)
        ledger.release_with(sid, weakref.ref(token, release))

    def _charge_saved_number(self, saved: torch.Tensor, phase: Phase | None, module: int) -> None:
        key = saved._cdata
        ledger = self.ledger
        sid = ledger.held(saved.element_size(), _SAVED_NUMBER_OP, phase, module)
        self._saved_numbers.add(key)

        def released(_ref: Any) -> None:
            self._saved_numbers.discard(key)
            ledger.release(sid)

        ledger.release_with(sid, weakref.ref(saved, released))

    # -- views written in place --------------------------------------------------
    #
    # An in-place op on a view makes autograd rebase the view's history: the base
    # gets a CopySlices node and the view a regenerated node. For a plain strided
    # tensor that node is an AsStridedBackward0, whose as_strided_backward puts the
    # gradient into a new zeroed tensor the size of the base's storage; for a
    # tensor subclass (fake tensors) autograd replays the view ops from the base
    # instead (ViewBackward0, TransposeBackward0...), which allocate nothing. The
    # replayed nodes are given hooks that return what as_strided_backward returns.

    def remember_views(self, written_slots: tuple[tuple[int, str], ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The views among the arguments an op wrote into (``written_slots``) get their
        regenerated nodes settled once autograd has rebased them."""
        for index, name in written_slots:
            t = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(t, FakeTensor) and t._is_view():
                self.pending_views.append(weakref.ref(t))

    def _settle_views(self) -> None:
        pending, self.pending_views = self.pending_views, []
        for ref in pending:
            view = ref()
            base = None if view is None else view._base
            node = None if view is None else view.grad_fn
            if base is None or node is None or _AS_STRIDED_MARK in node.metadata:
                continue
            chain = _replay_chain(node, base)
            if not chain:
                continue
            # The first replayed node gets the view's gradient, the last one (next
            # to CopySlices) returns the base's: one hook takes it, the other
            # answers as as_strided_backward would.
            node.metadata[_AS_STRIDED_MARK] = True
            taken: list[torch.Tensor] = []
            node.register_prehook(_taken_by(taken))
            chain[-1].register_hook(_as_strided_backward(base, view, taken))


class _NumbersProbe:
    """Which Python numbers an op's backward node saves, found by running the op on
    0-dim real tensors: autograd decides from the op and from which inputs require
    grad, not from values. Used where the node is out of reach (inside CopySlices)."""

    def __init__(self, func: Any, args: Any, kwargs: Any, numbers: list[tuple[str, Any]]) -> None:
        self.func = func
        self.args = tuple(_probe_spec(a) for a in args)
        self.kwargs = tuple((k, _probe_spec(v)) for k, v in kwargs.items())
        self.numbers = tuple(numbers)

    def saved(self) -> list[Any]:
        """The numbers the op's node saves (saved-tensor hooks never get a wrapped
        number: SavedVariable in torch/csrc/autograd/saved_variable.cpp)."""
        key = (self.func, self.args, self.kwargs, self.numbers)
        found = _PROBED.get(key)
        if found is None:
            # In a thread of its own: none of the trace's modes, dispatch-key
            # exclusions or grad mode, which are thread-local.
            box: list[list[Any]] = []
            threads.start(lambda: box.append(self._run())).join()
            found = box[0] if box else []
            if len(_PROBED) >= _PROBED_MAX:
                _PROBED.clear()
            _PROBED[key] = found
        return found

    def _run(self) -> list[Any]:
        try:
            args = tuple(_probe_value(a) for a in self.args)
            kwargs = {k: _probe_value(v) for k, v in self.kwargs}
            out = self.func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - what 0-dim tensors cannot run is not probed
            return []
        results = out if isinstance(out, (tuple, list)) else (out,)
        node = next((t.grad_fn for t in results if isinstance(t, torch.Tensor) and t.grad_fn), None)
        if node is None:
            return []
        return [
            value
            for name, value in self.numbers
            if isinstance(getattr(node, f"{SAVED_PREFIX}{name}", None), torch.Tensor)
        ]


#: _NumbersProbe's answers by (op, argument specs, numbers).
_PROBED: dict[Any, list[Any]] = {}
_PROBED_MAX: Final = 4096
_PROBE_TENSOR: Final = object()


class _Token:
    """An object to hold a weak reference to."""


def number_holders(node: Any) -> list[Any]:
    """The tokens of the wrapped numbers a CopySlices ``node`` holds that the trace charged
    (:meth:`AutogradAsEager._charge_number_until`): each keeps its number's storage."""
    return list(node.metadata.get(_TOKENS, ())) if _is_copy_slices(node) else []


def _probe_spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (_PROBE_TENSOR, value.dtype, value.requires_grad)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return (_PROBE_TENSOR, None, False)  # not probed
    return value


def _probe_value(spec: Any) -> Any:
    if isinstance(spec, tuple) and len(spec) == 3 and spec[0] is _PROBE_TENSOR:
        _, dtype, requires_grad = spec
        if dtype is None:
            raise TypeError("a list of tensors")
        t = torch.zeros((), dtype=dtype, requires_grad=requires_grad)
        return t.clone() if requires_grad else t  # not a leaf, which in-place ops refuse
    return spec


def _is_copy_slices(node: Any) -> bool:
    return node.name().endswith(COPY_SLICES)


def _copy_slices_of_write(probe: _NumbersProbe, outs: list[torch.Tensor]) -> Any:
    """The CopySlices node that an in-place op on a view gave its base, if it was one."""
    if not probe.func._schema.is_mutable:
        return None
    for t in outs:
        base = t._base
        if base is not None and base.grad_fn is not None and _is_copy_slices(base.grad_fn):
            return base.grad_fn
    return None


def _taken_by(taken: list[torch.Tensor]) -> Callable[[Any], None]:
    """A pre hook that puts the node's first gradient into ``taken``."""

    def hook(grad_outputs: Any) -> None:
        taken.append(grad_outputs[0])

    return hook


def _replay_chain(node: Any, base: torch.Tensor) -> list[Any]:
    """The nodes from ``node`` down to the CopySlices of ``base`` (excluded), if ``node``
    is a view's regenerated node (a replay: one node per view op from the base)."""
    copy_slices = base.grad_fn
    if copy_slices is None or not _is_copy_slices(copy_slices):
        return []
    chain = [node]
    while len(chain) <= _MAX_VIEW_CHAIN:
        nexts = chain[-1].next_functions
        if len(nexts) != 1 or nexts[0][0] is None:
            return []
        if nexts[0][0] is copy_slices:
            return chain
        chain.append(nexts[0][0])
    return []


def _as_strided_backward(
    base: torch.Tensor, view: torch.Tensor, taken: list[torch.Tensor]
) -> Callable[..., Any]:
    """A post hook for the last replayed node of ``view``: the gradient of ``base`` as
    the AsStridedBackward0 of a plain tensor makes it from the view's gradient
    (``taken``) (``as_strided_backward`` in torch/csrc/autograd/FunctionsManual.cpp,
    for views without overlapping memory)."""
    base_geometry = (tuple(base.shape), base.stride(), base.storage_offset())
    view_geometry = (tuple(view.shape), view.stride(), view.storage_offset())

    def hook(grad_inputs: Any, grad_outputs: Any) -> Any:
        grad, replayed = (taken.pop() if taken else None), grad_inputs[0]
        if not isinstance(grad, torch.Tensor) or not isinstance(replayed, torch.Tensor):
            return None
        if replayed.untyped_storage()._cdata != grad.untyped_storage()._cdata:
            return None  # the replay allocated its result, as as_strided_backward does
        if 0 in base_geometry[0] or 0 in view_geometry[0]:
            return None
        shared = min(base_geometry[2], view_geometry[2])
        base_offset, view_offset = base_geometry[2] - shared, view_geometry[2] - shared
        size = max(
            _min_storage_size(base_geometry[0], base_geometry[1], base_offset),
            _min_storage_size(view_geometry[0], view_geometry[1], view_offset),
        )
        storage = grad.new_zeros(size)
        storage.as_strided(view_geometry[0], view_geometry[1], view_offset).copy_(grad)
        return (storage.as_strided(base_geometry[0], base_geometry[1], base_offset),)

    return hook


def _min_storage_size(sizes: tuple[int, ...], strides: tuple[int, ...], offset: int) -> int:
    return offset + 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))


def _saved_without_hooks(node: Any, attr: str) -> Any:
    """The tensor a backward node saved as ``attr``, if it has no unpack hook (else None).

    Reading a saved tensor runs its unpack hook: a non-reentrant checkpoint
    recomputes its forward there. Wrapped numbers are saved without hooks.
    """
    raw = getattr(node, _RAW + attr, None)
    if not isinstance(raw, _SavedTensor):
        return None
    try:
        if raw.unpack_hook is not None:
            return None
        return getattr(node, attr)
    except RuntimeError:  # released
        return None


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of its storage with no gaps or overlaps."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True
