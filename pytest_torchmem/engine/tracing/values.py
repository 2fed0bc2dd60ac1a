"""The values of small tensors, known beside the fake trace (issue 10).

Fake tensors have no values, so an op whose output size or whose path depends
on them (``nonzero``, ``.item()``, ``unique``, a boolean mask) cannot be
followed. But the step's inputs are real tensors, and so may be the model's
parameters and buffers; a tensor computed only from tensors whose values are
known, and small enough, can have its value known too. :class:`KnownValues`
keeps a real copy (a *shadow*) of such tensors: each op whose tensor
arguments all have shadows runs for real on them, beside its fake run, and its
outputs get the real results as shadows. A value-dependent op that meets
shadows is then answered with the real value, and the trace follows the path
eager takes.

The step modelled is a healthy one: its values are finite (``isnan`` and
``isinf`` are all ``False``, ``isfinite`` all ``True``, whatever the values; a
grad scaler's check finds no inf), as a check of a trainer's loss finds them.

Values drawn at random on the host (ops tagged ``nondeterministic_seeded`` whose
output is a CPU tensor: a data loader's seed, a sampler's permutation) are
drawn for real, from a copy of the generator the op names (the default one's
state as the trace began, or the user's ``torch.Generator``'s), so that they
are the values a real run draws, and the user's generators are not advanced.
Once a draw from a generator cannot be made for real (too large, its arguments
unknown), its copy no longer follows it: what it draws later is unknown.

What stays unknown: tensors made from unknown ones (too large, on the meta
device, drawn at random on the device), uninitialised memory (``empty``), ops
outside ATen's own namespaces, and anything written in place with unknown
values (every shadow of that storage is dropped).

Real memory is bounded, never proportional to activations or parameters: a
tensor is shadowed only if its storage holds at most :data:`MAX_NUMEL`
elements, and the shadows alive together hold at most :data:`MAX_BYTES`; past
that, values are unknown. The user's tensors are copied, never written.

Shadows are keyed by the fake tensor (its ``id``, held weakly) for the lookups
made on every op, and grouped by fake storage, so that views and in-place
writes see one real storage, as the fake ones share one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.exchanged_values import EXCHANGES, exchanged

__all__ = [
    "ABSORBING",
    "KnownValues",
    "LIFTS",
    "MAX_BYTES",
    "MAX_NUMEL",
    "ValueKind",
    "count_nonzero",
    "on_values",
    "value_kind",
]

# torch's private names (engine/torch_compat/torch_private.py), bound once: read per op.
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")
_DisableTorchDispatch: Final = private("torch._C._DisableTorchDispatch")
_OpOverload: Final = private("torch._ops.OpOverload")

aten = torch.ops.aten

#: The most elements a shadowed storage holds (per tensor): ATen's ``GRAIN_SIZE``,
#: below which its CPU kernels run on the calling thread (a kernel split over the
#: intra-op threads costs their wake-up, more than the work on so few elements).
MAX_NUMEL: Final = 1 << 15
#: The most bytes all shadows alive at once hold (16 MiB).
MAX_BYTES: Final = 1 << 24
#: The most elements a real op reads from one argument (an expanded view can be large).
_MAX_READ: Final = MAX_NUMEL

_CPU: Final = torch.device("cpu")
#: What an op run on the shadows returned that wrote them in place and returned nothing.
_WROTE_IN_PLACE: Final = object()


class ValueKind(IntEnum):
    """How an op's outputs get their values."""

    #: Opaque: outputs unknown (random, uninitialised, outside ATen).
    OPAQUE = 0
    #: Computed from the tensor arguments' values: known when they all are.
    COMPUTED = 1
    #: Made from the arguments that are not tensors alone (``arange``, ``zeros``):
    #: known whatever the tensor arguments (``zeros_like``).
    MADE = 2
    #: Drawn at random (``nondeterministic_seeded``): known on the host, drawn from a
    #: copy of the generator.
    SEEDED = 3
    #: A functional collective's output: known for an integer tensor of known values,
    #: each peer taken to hold this rank's (:mod:`exchanged_values`).
    EXCHANGED = 4


#: Ops whose outputs are uninitialised memory, or depend on more than their arguments.
_OPAQUE: Final = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.empty_permuted.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.resize_.default,
        aten.resize_as_.default,
        aten._resize_output_.default,
        aten.set_.source_Storage,
        aten.set_.source_Storage_storage_offset,
        aten.set_.default,
    }
)

#: Ops through which ``torch.tensor(...)`` hands a real tensor to the trace: its value.
LIFTS: Final = frozenset(
    {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.lift.default}
)

#: Factories whose values their non-tensor arguments decide: run for real on the CPU.
_FACTORIES: Final = frozenset(
    {
        *(getattr(aten.arange, name) for name in aten.arange.overloads()),
        *(getattr(aten.linspace, name) for name in aten.linspace.overloads()),
        *(getattr(aten.logspace, name) for name in aten.logspace.overloads()),
        *(getattr(aten.eye, name) for name in aten.eye.overloads()),
        aten.tril_indices.default,
        aten.triu_indices.default,
    }
)


_Fill = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def _filled(index: int | None, value: Any = None) -> _Fill:
    """The fill value of a factory: the argument at ``index`` (or keyword
    ``fill_value``), else ``value``."""

    def fill(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if index is None:
            return value
        return args[index] if len(args) > index else kwargs.get("fill_value", value)

    return fill


#: Ops whose outputs are filled with one value, whatever the tensor arguments hold.
_FILLS: Final[dict[Any, _Fill]] = {
    aten.zeros.default: _filled(None, 0),
    aten.ones.default: _filled(None, 1),
    aten.full.default: _filled(1),
    aten.scalar_tensor.default: _filled(0),
    aten.zeros_like.default: _filled(None, 0),
    aten.ones_like.default: _filled(None, 1),
    aten.full_like.default: _filled(1),
    aten.new_zeros.default: _filled(None, 0),
    aten.new_ones.default: _filled(None, 1),
    aten.new_full.default: _filled(2),
    # The step modelled is a healthy one, its values finite (as _FINITE_ASSUMED below): a
    # trainer's check of the loss for nan or inf finds none, whatever the loss's value.
    aten.isnan.default: _filled(None, False),
    aten.isinf.default: _filled(None, False),
    aten.isposinf.default: _filled(None, False),
    aten.isneginf.default: _filled(None, False),
    aten.isfinite.default: _filled(None, True),
}


#: Binary ops with an absorbing value: an argument all ``True`` (``or``, of booleans) or
#: all zero (``and``) decides every element of the output, whatever the other argument
#: holds; by op, the output's value then (see :meth:`KnownValues._absorbed`).
ABSORBING: Final[dict[Any, bool]] = {
    aten.bitwise_or.Tensor: True,
    aten.bitwise_or.Scalar: True,
    aten.logical_or.default: True,
    aten.bitwise_and.Tensor: False,
    aten.bitwise_and.Scalar: False,
    aten.logical_and.default: False,
}


#: Ops that write a flag only where the data they check is not finite, by the index of
#: that flag among their arguments: the trace takes the data to be finite (the flag keeps
#: its value), as the step it models is one that is taken (``GradScaler.step`` reads the
#: flag that its ``unscale_`` wrote, and steps the optimizer where it is 0).
_FINITE_ASSUMED: Final[dict[Any, int]] = {aten._amp_foreach_non_finite_check_and_unscale_.default: 1}


def value_kind(func: Any) -> ValueKind:
    """The :class:`ValueKind` of ``func``."""
    if func in _FACTORIES or func in _FILLS or func in LIFTS:
        return ValueKind.MADE
    if func in EXCHANGES:
        return ValueKind.EXCHANGED
    if func in _OPAQUE or not isinstance(func, _OpOverload):
        return ValueKind.OPAQUE
    if func.namespace not in ("aten", "prims"):
        return ValueKind.OPAQUE
    if torch.Tag.nondeterministic_seeded in func.tags:
        return ValueKind.SEEDED
    return ValueKind.COMPUTED


@dataclass(eq=False)
class _Storage:
    """The real copy of one fake storage, and the known tensors that view it."""

    real: torch.UntypedStorage
    nbytes: int
    ids: set[int] = field(default_factory=set)
    #: Whether its values are the same in each iteration of the step (see
    #: :meth:`KnownValues.settled`).
    settled: bool = False
    #: Its place in the order the shadows' storages were made (:meth:`KnownValues.mark`).
    serial: int = 0


@dataclass(eq=False, slots=True)
class _Known:
    ref: weakref.ref[Any]
    shadow: torch.Tensor
    key: int  # the fake storage's _cdata


class _Unknown(Exception):
    """An argument's value is not known (internal control flow)."""


@contextmanager
def on_values() -> Iterator[None]:
    """Run real ops on shadows: no dispatch mode (the fake mode would take real
    tensors for its own), no autograd."""
    with _DisableTorchDispatch(), torch.no_grad():
        yield


def count_nonzero(value: torch.Tensor | None) -> int | None:
    """How many elements of the real ``value`` are not zero (``None`` for ``None``)."""
    if value is None:
        return None
    with on_values():
        return int(torch.count_nonzero(value))


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _view(real: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A real tensor on ``real`` with ``like``'s dtype and geometry."""
    with _DisableTorchDispatch():
        out = torch.empty(0, dtype=like.dtype, device=_CPU)
        out.set_(real, like.storage_offset(), like.shape, like.stride())
    return out


def _copy_of(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A CPU copy of the real ``storage``, through a tensor of its widest whole
    elements (``UntypedStorage.copy_`` goes byte by byte, and a byte tensor has
    eight times the elements, past ``GRAIN_SIZE`` sooner)."""
    nbytes = storage.nbytes()
    dtype = next(d for d in _WORDS if nbytes % d.itemsize == 0)
    with _DisableTorchDispatch(), torch.no_grad():
        source = torch.empty(0, dtype=dtype, device=storage.device).set_(storage)
        return source.to(_CPU, copy=True).untyped_storage()


_WORDS: Final = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _new_storage(nbytes: int) -> torch.UntypedStorage:
    with _DisableTorchDispatch():
        return torch.empty(nbytes, dtype=torch.uint8, device=_CPU).untyped_storage()


class KnownValues:
    """The shadows of one trace (see the module's docstring)."""

    def __init__(self, max_numel: int = MAX_NUMEL, max_bytes: int = MAX_BYTES) -> None:
        self.max_numel: Final = max_numel
        self.max_bytes: Final = max_bytes
        #: id(fake tensor) -> its shadow. Truthy when any value is known (read on every op).
        self.known: dict[int, _Known] = {}
        self._storages: dict[int, _Storage] = {}
        self.nbytes = 0  # held by the shadows' storages
        self._serial = 0  # the serial of the next storage
        #: The serials of the settled storages written in place, in order (a value an
        #: iteration read, that a later one reads changed, if the storage is older).
        self._settled_writes: list[int] = []
        #: id(a generator the step draws from; None: the default) -> (it, its copy, or None
        #: once a draw could not be made for real)
        self._generators: dict[int, tuple[Any, torch.Generator | None]] = {}

    # -- reading ---------------------------------------------------------------

    def of(self, t: Any) -> torch.Tensor | None:
        """The real value of the fake tensor ``t`` (read-only, please), or ``None``."""
        if not isinstance(t, FakeTensor):
            return None
        entry = self.known.get(id(t))
        key = _storage_key(t)
        if entry is not None and entry.key == key and _geometry(entry.shadow) == _geometry(t):
            return entry.shadow
        # another view of a known storage (a saved output unpacked by autograd, say)
        storage = self._storages.get(key) if key is not None else None
        if storage is None or not _fits(t, storage.nbytes):
            return None
        return _view(storage.real, t)

    def alias(self, t: Any) -> None:
        """Know ``t`` by its own identity if it views a known storage (a tensor made
        outside dispatch: an output autograd saved and unpacked, ``x.data``)."""
        if isinstance(t, FakeTensor) and id(t) not in self.known:
            key = _storage_key(t)
            storage = self._storages.get(key) if key is not None else None
            if storage is not None and _fits(t, storage.nbytes):
                self._add(t, _view(storage.real, t), key)

    def _shadow(self, a: FakeTensor) -> torch.Tensor:
        entry = self.known.get(id(a))
        if entry is None:
            raise _Unknown
        shadow = entry.shadow
        # ``x.data = y`` swaps a tensor's storage without dispatching an op
        if a.shape != shadow.shape or _storage_key(a) != entry.key:
            raise _Unknown
        if a.numel() > _MAX_READ:
            raise _Unknown
        return shadow

    def _real(self, value: Any) -> Any:
        kind = type(value)
        if kind is FakeTensor:
            return self._shadow(value)
        if kind is list or kind is tuple:
            return kind(self._real(v) for v in value)
        if isinstance(value, torch.Tensor):
            raise _Unknown  # a real tensor reached the op unfaked, or a subclass
        if isinstance(value, torch.device):
            return _CPU
        return value

    # -- the step's own tensors -------------------------------------------------

    def adopt(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], *, inputs: bool = False) -> None:
        """Know the values of fake stand-ins from their real originals, in order,
        while the limits allow: ``(fake, original)`` pairs. The originals are copied
        (once per storage), never written. ``inputs``: they are the step's inputs (their
        values are each iteration's until the step writes them)."""
        copies: dict[int, tuple[int, torch.UntypedStorage]] = {}
        for fake, original in pairs:
            if not _readable(original):
                continue
            real_storage = original.untyped_storage()
            key = _storage_key(fake)
            if key is None or fake.dtype != original.dtype:
                continue
            copied = copies.get(real_storage._cdata)
            if copied is None or copied[0] != key:
                storage = self._storages.get(key)
                if storage is None:
                    nbytes = real_storage.nbytes()
                    if nbytes != fake.untyped_storage().nbytes() or not self._room(nbytes, fake):
                        continue
                    storage = self._storages[key] = self._new(_copy_of(real_storage), nbytes, inputs)
                    self.nbytes += nbytes
                copied = copies[real_storage._cdata] = (key, storage.real)
            self._add(fake, _view(copied[1], fake), key)

    def _room(self, nbytes: int, like: torch.Tensor) -> bool:
        return nbytes <= self.max_numel * like.element_size() and self.nbytes + nbytes <= self.max_bytes

    def _add(self, fake: torch.Tensor, shadow: torch.Tensor, key: int) -> None:
        ident = id(fake)
        old = self.known.get(ident)
        if old is not None:
            if old.key == key:
                old.shadow = shadow
                return
            self._drop_id(ident)
        storage = self._storages[key]
        storage.ids.add(ident)
        self.known[ident] = _Known(weakref.ref(fake, self._dead(ident, key)), shadow, key)

    def _dead(self, ident: int, key: int) -> Callable[[Any], None]:
        def dead(_ref: Any) -> None:
            entry = self.known.get(ident)
            if entry is not None and entry.key == key:
                self._drop_id(ident)

        return dead

    def _drop_id(self, ident: int) -> None:
        entry = self.known.pop(ident, None)
        if entry is None:
            return
        storage = self._storages.get(entry.key)
        if storage is not None:
            storage.ids.discard(ident)
            if not storage.ids:
                del self._storages[entry.key]
                self.nbytes -= storage.nbytes

    def know(self, t: Any, real: torch.Tensor) -> None:
        """Know the fake tensor ``t`` to hold the real ``real`` (of its shape and dtype): a
        rule that made ``t`` out of dense ops whose values it knows otherwise (a sparse
        tensor's parts, copied). Within the limits; ``real`` is copied."""
        if _readable(real):  # (a real plain tensor, not a fake one made from it)
            self._attach(t, real)

    def assume(self, t: Any, value: Any) -> None:
        """Know every element of the fake tensor ``t`` to be ``value`` (a decision the
        trace cannot compute, taken as the caller's model of the program says)."""
        if self.of(t) is None:
            real = self._fill(t, value)
            if real is not None:
                self._attach(t, real)

    def forget(self, t: Any) -> None:
        """``t``'s storage was written with unknown values: forget every view of it."""
        if isinstance(t, (list, tuple)):
            for v in t:
                self.forget(v)
            return
        if not isinstance(t, FakeTensor):
            return
        entry = self.known.get(id(t))
        if entry is not None:
            self._forget_storage(entry.key)
        key = _storage_key(t)
        if key is not None:
            self._forget_storage(key)

    def _forget_storage(self, key: int) -> None:
        storage = self._storages.pop(key, None)
        if storage is None:
            return
        self.nbytes -= storage.nbytes
        for ident in storage.ids:
            self.known.pop(ident, None)

    # -- ops ------------------------------------------------------------------------

    def run(
        self, func: Any, kind: ValueKind, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, Any]:
        """``(True, real outputs)`` of ``func`` (of :class:`ValueKind` ``kind``) run on the
        arguments' values, when they are all known and the op computes its outputs
        from them alone; else ``(False, None)``. For ops fake tensors cannot run."""
        if kind != ValueKind.COMPUTED or not self.known:
            return False, None
        try:
            real_args, real_kwargs = self._real(args), self._real(_items(kwargs))
        except _Unknown:
            return False, None
        try:
            with _DisableTorchDispatch(), torch.no_grad():
                out = func(*real_args, **dict(real_kwargs))
        except Exception:  # noqa: BLE001 - what the real op refuses is the fake one's to say
            return False, None
        # (fake outputs are made like the real ones: plain strided tensors only)
        return _all_strided(out), out

    def after(
        self,
        func: Any,
        kind: ValueKind,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        written: tuple[Any, ...],
        real_out: Any = None,
    ) -> None:
        """Give ``out`` the values ``func`` computes, where they are known; forget the
        values of what it wrote in place (``written``) where they are not.
        ``real_out``: the real outputs, if :meth:`run` made them already."""
        settled = None
        if written:
            self._wrote(written)
            settled = self._settles(kind, args, kwargs)  # (before the shadows are written)
        if real_out is None:
            real_out = self._compute(func, kind, args, kwargs, out)
            if real_out is _WROTE_IN_PLACE:
                for t in written:
                    self._unsettle(t, bool(settled))
                    self._check_written(t)
                return
            if real_out is None:
                flag = _FINITE_ASSUMED.get(func)
                kept = args[flag] if flag is not None and len(args) > flag else None
                for t in written:
                    if t is not kept:
                        self.forget(t)
                return
        if settled is None:
            settled = self._settles(kind, args, kwargs)
        self._attach(out, real_out, settled)
        for t in written:
            self._check_written(t)

    def _settles(self, kind: ValueKind, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether an op of ``kind`` on these arguments makes settled values."""
        return kind == ValueKind.MADE or (kind == ValueKind.COMPUTED and self.settled(args, kwargs))

    def rewritten(self, func: Any, kind: ValueKind, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """``func``, an out-of-place op, ran in place into its first argument, whose storage
        ``out`` is (a rule did as the eager kernel does: a backward formula's ``scatter_``
        into its zeros, autograd's accumulation of a second gradient): that storage now
        holds the op's result where it is known, else nothing known."""
        real = self._compute(func, kind, args, kwargs, out) if kind == ValueKind.COMPUTED else None
        settled = real is not None and self.settled(args, kwargs)
        self._wrote(out)
        self.forget(out)
        if isinstance(real, torch.Tensor):
            self._attach(out, real, settled)

    def settled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether every fake tensor among an op's arguments holds values that each
        iteration of the step gives it alike: computed only from the step's inputs (not
        written since) and from what factories make of numbers. The step's parameters,
        gradients, optimizer state and buffers change from one iteration to the next, and
        random draws advance their generator: what is made of them is not settled."""
        for value in _leaves((*args, *kwargs.values())):
            if type(value) is FakeTensor:
                storage = self._storage_of(value)
                if storage is None or not storage.settled or not _fits(value, storage.nbytes):
                    return False
            elif isinstance(value, torch.Tensor):
                return False
        return True

    def _storage_of(self, t: Any) -> _Storage | None:
        """The known storage the fake tensor ``t`` views, if any."""
        key = _storage_key(t) if isinstance(t, FakeTensor) else None
        return self._storages.get(key) if key is not None else None

    def mark(self) -> tuple[int, int]:
        """Where the trace is, for :meth:`rewritten_since`."""
        return len(self._settled_writes), self._serial

    def rewritten_since(self, mark: tuple[int, int]) -> bool:
        """Whether an op wrote in place, since :meth:`mark` gave ``mark``, into a settled
        storage made before it (the step's input, what an earlier iteration made and
        kept): what was read of it then is not what is read now."""
        writes, serial = mark
        return any(s < serial for s in self._settled_writes[writes:])

    def _new(self, real: torch.UntypedStorage, nbytes: int, settled: bool) -> _Storage:
        self._serial += 1
        return _Storage(real, nbytes, settled=settled, serial=self._serial - 1)

    def _wrote(self, written: Any) -> None:
        """Keep the serials of the settled storages among ``written``."""
        for t in _leaves(written):
            storage = self._storage_of(t)
            if storage is not None and storage.settled:
                self._settled_writes.append(storage.serial)

    def all_known(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether every fake tensor among an op's arguments has a shadow (by identity)."""
        return self._all_known(args) and (not kwargs or self._all_known(kwargs.values()))

    def _all_known(self, values: Any) -> bool:
        """Whether every fake tensor in ``values`` (arguments, lists of them) has a
        shadow, by identity: the check every op pays while values are known, so it
        is a loop over types and one dict look-up for the common first tensor."""
        known = self.known
        for value in values:
            kind = type(value)
            if kind is FakeTensor:
                if id(value) not in known:
                    return False
            elif kind is list or kind is tuple:
                if not self._all_known(value):
                    return False
        return True

    def _compute(
        self, func: Any, kind: ValueKind, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> Any:
        if kind == ValueKind.OPAQUE:
            return None
        if kind == ValueKind.SEEDED:
            return self._drawn(func, args, kwargs, out)
        if kind == ValueKind.EXCHANGED:
            return self._exchanged(func, args, kwargs, out)
        if kind == ValueKind.COMPUTED and not self.all_known(args, kwargs):
            return self._absorbed(func, args, out)
        fill = _FILLS.get(func)
        if fill is not None:
            return self._fill(out, fill(args, kwargs))
        if func in LIFTS:
            lifted = args[0] if args else None
            if not isinstance(lifted, torch.Tensor) or not _readable(lifted) or not self._small(lifted):
                return None
            with _DisableTorchDispatch(), torch.no_grad():
                return lifted.detach().to(_CPU, copy=True)
        try:
            real_args, real_kwargs = self._real(args), self._real(_items(kwargs))
        except _Unknown:
            return None
        if not self._small(out):
            return None
        try:
            with _DisableTorchDispatch(), torch.no_grad():
                computed = func(*real_args, **dict(real_kwargs))
        except Exception:  # noqa: BLE001 - a kernel the CPU lacks, or a check of its own
            return None
        # (an in-place foreach op returns nothing: it wrote its shadows)
        return _WROTE_IN_PLACE if computed is None else computed

    def _exchanged(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """A collective's output, where its input's value is known and every peer's is
        taken to be it (see :mod:`exchanged_values`), else None."""
        if kwargs or not args or not self._small(out):
            return None
        value = self.of(args[0])
        if value is None:
            return None
        try:
            with _DisableTorchDispatch():
                return exchanged(func, value, args[1:])
        except Exception:  # noqa: BLE001 - arguments the real collective would refuse
            return None

    def _drawn(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """The values a random op draws on the host, from a copy of its generator (see the
        module), or None (and the copy no longer follows the generator)."""
        if type(out) is not FakeTensor or out.fake_device.type != "cpu":
            return None  # (on the device: CUDA's generator, not followed)
        generator = kwargs.get("generator")
        key = id(generator)
        found = self._generators.get(key)
        if found is None:
            source = torch.default_generator if generator is None else generator
            if not isinstance(source, torch.Generator) or source.device.type != "cpu":
                return None
            copy = torch.Generator()
            copy.set_state(source.get_state())
            found = self._generators[key] = (generator, copy)
        copy = found[1]
        if copy is None:
            return None
        in_place = func._schema.is_mutable and bool(args) and args[0] is out
        try:
            if not self._small(out):
                raise _Unknown
            rest = self._real(args[1:] if in_place else args)
            real_kwargs = dict(self._real(_items(kwargs)))
            real_kwargs["generator"] = copy
            with _DisableTorchDispatch(), torch.no_grad():
                if in_place:  # into its shadow, or a fresh one (what it held is drawn over)
                    target = self.of(out)
                    if target is None:
                        target = _view(_new_storage(out.untyped_storage().nbytes()), out)
                    func(target, *rest, **real_kwargs)
                    return target
                return func(*rest, **real_kwargs)
        except Exception:  # noqa: BLE001 - not drawn here: the copy falls behind the generator
            self._generators[key] = (generator, None)
            return None

    def _absorbed(self, func: Any, args: tuple[Any, ...], out: Any) -> Any:
        """The value of a binary op one of whose arguments is known and decides every
        element whatever the other holds (``done | unknown`` where ``done`` is all
        ``True``; ``x & unknown`` where ``x`` is all zero), else ``None``.

        A generation loop stops on ``stop_at_max_length | stop_at_eos``: the first is
        known, the second depends on the generated tokens (values the trace does not
        have), and the loop ends when the first is all ``True``."""
        absorbing = ABSORBING.get(func)
        if absorbing is None or type(out) is not FakeTensor or len(args) < 2 or not self._small(out):
            return None
        for arg in args[:2]:
            with on_values():
                if isinstance(arg, FakeTensor):
                    value = self.of(arg)
                elif isinstance(arg, int):  # a Python bool or int (a Scalar overload's)
                    value = torch.tensor(arg)
                else:
                    value = None
                if value is None or value.dtype.is_floating_point or value.dtype.is_complex:
                    continue
                if absorbing and value.dtype != torch.bool and func is not aten.logical_or.default:
                    continue  # an integer's bitwise or: no single absorbing value
                decides = bool(value.all()) if absorbing else not bool(value.any())
            if decides:
                return self._fill(out, absorbing)
        return None

    def _small(self, out: Any) -> bool:
        if isinstance(out, torch.Tensor):
            return out.numel() <= self.max_numel
        if isinstance(out, (tuple, list)):
            return all(self._small(t) for t in out)
        return True

    def _fill(self, out: Any, value: Any) -> Any:
        if type(out) is not FakeTensor or isinstance(value, torch.Tensor) or not self._small(out):
            return None
        with _DisableTorchDispatch():
            if out.is_contiguous() and out.storage_offset() == 0:
                # (one call: most factories' outputs; _attach checks the storage's size)
                return torch.full(out.shape, value, dtype=out.dtype)
            real = _view(_new_storage(out.untyped_storage().nbytes()), out)
            return real.fill_(value)

    def _attach(self, out: Any, real: Any, settled: bool = False) -> None:
        """Know ``out`` to hold ``real``; ``settled``: made only of settled values (see
        :meth:`settled`)."""
        if isinstance(out, (tuple, list)):
            if isinstance(real, (tuple, list)) and len(real) == len(out):
                for o, r in zip(out, real):
                    self._attach(o, r, settled)
            return
        if not isinstance(out, FakeTensor) or not isinstance(real, torch.Tensor):
            return
        if real.shape != out.shape or real.dtype != out.dtype or real.device.type != "cpu":
            self.forget(out)
            return
        key = _storage_key(out)
        if key is None:
            return
        storage = self._storages.get(key)
        if storage is not None:
            # a view of (or an in-place write into) a known storage: its shadow is there
            storage.settled = storage.settled and settled
            if _fits(out, storage.nbytes):
                self._add(out, _view(storage.real, out), key)
            return
        nbytes = out.untyped_storage().nbytes()
        if not self._room(nbytes, out):
            return
        if real.untyped_storage().nbytes() == nbytes and _geometry(real) == _geometry(out):
            shadow = real
        else:
            shadow = _view(_new_storage(nbytes), out)
            with _DisableTorchDispatch(), torch.no_grad():
                shadow.copy_(real)
        self._storages[key] = self._new(shadow.untyped_storage(), nbytes, settled)
        self.nbytes += nbytes
        self._add(out, shadow, key)

    def _unsettle(self, t: Any, settled: bool) -> None:
        """``t`` was written in place by its shadow's op: its storage stays settled only if
        what was written is."""
        for v in _leaves(t):
            storage = self._storage_of(v)
            if storage is not None:
                storage.settled = storage.settled and settled

    def _check_written(self, t: Any) -> None:
        """After a real in-place op: the written tensor's shadow must still be a view
        of its storage's copy with the fake's geometry (``out=`` may have resized it)."""
        if isinstance(t, (list, tuple)):
            for v in t:
                self._check_written(v)
            return
        if not isinstance(t, FakeTensor):
            return
        entry = self.known.get(id(t))
        storage = self._storages.get(entry.key) if entry is not None else None
        if (
            entry is None
            or storage is None
            or entry.shadow.untyped_storage()._cdata != storage.real._cdata
            or _geometry(entry.shadow) != _geometry(t)
        ):
            self.forget(t)


def _leaves(values: Any) -> Iterator[Any]:
    """``values``, with the items of the lists and tuples among them in their place."""
    if type(values) is list or type(values) is tuple:
        for value in values:
            yield from _leaves(value)
    else:
        yield values


def _all_strided(out: Any) -> bool:
    if isinstance(out, (tuple, list)):
        return all(_all_strided(o) for o in out)
    return not isinstance(out, torch.Tensor) or _readable(out)


def _items(kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(kwargs.items())


def _fits(t: torch.Tensor, nbytes: int) -> bool:
    """Whether ``t``'s elements lie inside a storage of ``nbytes``."""
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return all(s >= 0 for s in t.stride()) and (last + 1) * t.element_size() <= nbytes


def _readable(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor whose values can be copied."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type != "meta"
        and not t.is_quantized
        and not t.is_nested
    )
