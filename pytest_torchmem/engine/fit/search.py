"""The largest size whose step fits a budget or a GPU, found by a search over estimates.

``tm.fit(model, inputs_for, gpu="A100-40GB")`` estimates the step of ``model`` on
``inputs_for(size)`` for a few sizes and returns the largest size that fits. The
search assumes what a step's memory does as a batch or a sequence grows: it never
shrinks. It estimates both ends of the sizes and the size where the line between
them crosses the limit, and the size after it: a step's memory is close to affine
in its batch, so that is usually the answer (four or five estimates). Where it is not (a
sequence length under eager attention, quadratic), it goes on with guesses from
the line between the closest size that fits and the closest that does not, kept
near enough to the middle never to take more guesses than a bisection and one (the
ITP method, :func:`_search`): a search over sizes 1 to 4096 takes at most 19
estimates. The answer is shown by estimates: the size that fits and the next one,
which does not, were both estimated.

What decides: against a GPU, the caching allocator's reserved peak (the segments
it holds, fragmentation included: what runs out) must stay within the GPU's
usable memory (:func:`usable_memory`); against a byte budget, the peak (the
figure budgets and snapshots use) unless ``figure="reserved"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from pytest_torchmem.engine.figures.units import format_bytes, parse_bytes

from pytest_torchmem.engine.figures.gpu_profiles import usable_memory
from pytest_torchmem.engine.figures.modelled_device import device_kind, is_cpu, is_cuda

if TYPE_CHECKING:
    from pytest_torchmem.engine.figures.report import MemoryReport
    from pytest_torchmem.engine.figures.gpu_profiles import GpuProfile

__all__ = ["Fit", "GpuRoom", "Probe", "fit", "rank_gpus"]

Figure = Literal["peak", "reserved"]


@dataclass(frozen=True, slots=True)
class Probe:
    """One estimate of the search: the size, the deciding figure, and whether it fits."""

    size: int
    nbytes: int
    fits: bool


@dataclass(frozen=True)
class Fit:
    """The largest size whose step fits ``limit``, with the estimates that show it.

    ``size`` is None when even the smallest size does not fit; ``next_size`` is None
    when the largest size fits (the search's upper end: there may be room for more).
    """

    #: What the step had to fit: a GPU's name, or "budget 10.00 GiB".
    target: str
    #: The bytes the deciding figure must stay within.
    limit: int
    #: The deciding figure: "reserved" (the allocator's reserved peak) or "peak".
    figure: Figure
    #: What the size is called (``size_name``): "batch", "sequence length", ...
    size_name: str
    size: int | None
    #: The deciding figure at ``size``.
    nbytes: int | None
    next_size: int | None
    #: The deciding figure at ``next_size`` (above ``limit``).
    next_nbytes: int | None
    #: The estimate at ``size`` (None when nothing fits).
    report: MemoryReport | None
    #: Every estimate the search made, in order.
    probes: tuple[Probe, ...]

    @property
    def headroom(self) -> int | None:
        """``limit`` less the figure at ``size``."""
        return None if self.nbytes is None else self.limit - self.nbytes

    def __str__(self) -> str:
        figure = "reserved" if self.figure == "reserved" else "peak"
        if self.size is None:
            assert self.next_nbytes is not None and self.next_size is not None
            return (
                f"no {self.size_name} fits {self.target}: {self.size_name} {self.next_size} needs "
                f"{format_bytes(self.next_nbytes)} ({figure}) of {format_bytes(self.limit)}"
            )
        assert self.nbytes is not None
        line = (
            f"{self.size_name} {self.size} fits {self.target}: {format_bytes(self.nbytes)} ({figure}) "
            f"of {format_bytes(self.limit)}, {format_bytes(self.limit - self.nbytes)} to spare"
        )
        if self.next_size is None:
            return f"{line}; the largest {self.size_name} searched"
        assert self.next_nbytes is not None
        return f"{line}; {self.size_name} {self.next_size} needs {format_bytes(self.next_nbytes)}"


@dataclass(frozen=True)
class GpuRoom:
    """How one step sits on one GPU: its figures against the GPU's usable memory."""

    gpu: str
    usable: int
    peak: int
    reserved_peak: int
    report: MemoryReport

    @property
    def headroom(self) -> int:
        """Usable memory less the reserved peak (negative: it does not fit)."""
        return self.usable - self.reserved_peak

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does not fit"
        room = "to spare" if self.fits else "over"
        return (
            f"{self.gpu}: {verdict}, {format_bytes(self.reserved_peak)} reserved of "
            f"{format_bytes(self.usable)} usable, {format_bytes(abs(self.headroom))} {room}"
        )


def fit(
    model: Any,
    inputs_for: Callable[[int], Any],
    *,
    sizes: Sequence[int] = range(1, 4097),
    budget: int | str | None = None,
    gpu: str | GpuProfile | None = None,
    device: str | None = None,
    figure: Figure | None = None,
    size_name: str = "size",
    progress: Callable[[Probe], None] | None = None,
    **options: Any,
) -> Fit:
    """The largest of ``sizes`` whose step of ``model`` on ``inputs_for(size)`` fits.

    ``model``: a module (its built-in step, with ``options`` as in
    :func:`~pytest_torchmem.estimate`: ``optimizer``, ``loss_fn``, ``keep_output``,
    ``cpu``, ``compile``, ...) or a step function; ``inputs_for(size)`` builds its
    inputs for one size (a batch, a sequence length, any integer). ``sizes``: the
    sizes to search, ascending (a ``range``: ``range(8, 4097, 8)`` for multiples
    of 8); the step's memory must not shrink as the size grows.

    The target is ``gpu`` (a name or a profile: the reserved peak against its
    usable memory, :func:`usable_memory`), or ``budget`` (bytes or "40 GiB":
    the peak against it, on ``device``, default ``"cuda"``), or both (the budget
    on that GPU). ``figure`` overrides what is compared: ``"peak"`` or
    ``"reserved"``. ``progress`` is called with each :class:`Probe` as the search
    makes it. A probe whose trace stops raises :class:`~pytest_torchmem.TraceStopped`:
    that size's figure is unknown, and so is the answer.
    """
    from pytest_torchmem.engine.api import estimate

    if not callable(inputs_for):
        raise TypeError(
            "fit() needs a function that builds the inputs for one size, e.g. "
            f"lambda batch: torch.randn(batch, 3, 224, 224), got {type(inputs_for).__name__}"
        )
    sizes = _checked_sizes(sizes)
    device, limit, target, figure = resolved_target("fit", device, gpu, budget, figure, options)

    reports: dict[int, MemoryReport] = {}

    def figure_at(size: int) -> int:
        report = estimate(model, inputs_for(size), device=device, **options)
        reports[size] = report
        if figure == "reserved":
            assert report.reserved_peak is not None
            return report.reserved_peak
        return report.peak

    probes = _search(sizes, figure_at, limit, progress)
    fitting = [p for p in probes if p.fits]
    over = [p for p in probes if not p.fits]
    best = max(fitting, key=lambda p: p.size, default=None)
    above = min(over, key=lambda p: p.size, default=None)
    return Fit(
        target=target,
        limit=limit,
        figure=figure,
        size_name=size_name,
        size=None if best is None else best.size,
        nbytes=None if best is None else best.nbytes,
        next_size=None if above is None else above.size,
        next_nbytes=None if above is None else above.nbytes,
        report=None if best is None else reports[best.size],
        probes=tuple(probes),
    )


def rank_gpus(
    model: Any,
    inputs: Any,
    gpus: Sequence[str | GpuProfile] | None = None,
    **options: Any,
) -> tuple[GpuRoom, ...]:
    """The step of ``model`` on ``inputs`` estimated on each GPU of ``gpus`` (default:
    every named profile), ranked by headroom: the GPUs it fits first, the most room
    first, then those it does not fit, the closest first. A trace that stops on any
    of them raises :class:`~pytest_torchmem.TraceStopped`."""
    from pytest_torchmem.engine.api import estimate
    from pytest_torchmem.engine.figures.gpu_profiles import PROFILES, gpu_profile

    if "device" in options and not is_cuda(options.pop("device")):
        raise ValueError("rank_gpus() estimates on the fake cuda device: leave device out")
    profiles = [gpu_profile(gpu) for gpu in (gpus if gpus is not None else list(PROFILES))]
    if not profiles:
        raise ValueError("rank_gpus() needs at least one GPU")
    rooms = []
    for profile in profiles:
        report = estimate(model, inputs, device="cuda", gpu=profile, **options)
        assert report.reserved_peak is not None
        rooms.append(GpuRoom(str(profile), usable_memory(profile), report.peak, report.reserved_peak, report))
    return tuple(sorted(rooms, key=lambda room: -room.headroom))


def _checked_sizes(sizes: Any) -> Sequence[int]:
    if isinstance(sizes, range):
        checked: Sequence[int] = sizes
    else:
        try:
            checked = list(sizes)
        except TypeError:
            raise TypeError(f"sizes must be a range or a sequence of integers, got {sizes!r}") from None
    if len(checked) == 0:
        raise ValueError("sizes is empty: give the sizes to search, e.g. range(1, 4097)")
    for size in checked if not isinstance(checked, range) else (checked[0], checked[-1]):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"sizes must be positive integers, got {size!r}")
    if not isinstance(checked, range) and any(a >= b for a, b in zip(checked, checked[1:])):
        raise ValueError("sizes must be in ascending order, each once")
    if isinstance(checked, range) and checked.step < 0:
        raise ValueError("sizes must be in ascending order: use a range with a positive step")
    return checked


def resolved_target(
    caller: str, device: Any, gpu: Any, budget: int | str | None, figure: Figure | None, options: dict[str, Any]
) -> tuple[str, int, str, Figure]:
    """``(device, limit, target in words, figure)`` of a search or an advice for ``gpu``
    and/or ``budget`` on ``device`` (default ``"cuda"``), the figure defaulting to the
    reserved peak against a GPU and the peak against a budget; ``options["gpu"]`` is set
    to the GPU's profile on cuda. ``caller`` names the function in the errors."""
    from pytest_torchmem.engine.figures.gpu_profiles import gpu_profile

    if budget is None and gpu is None:
        raise ValueError(f"{caller}() needs a target: gpu='A100-40GB' (a GPU) or budget='40 GiB' (bytes)")
    device = _fit_device(device, gpu)
    if figure not in (None, "peak", "reserved"):
        raise ValueError(f"figure must be 'peak' or 'reserved', got {figure!r}")
    if figure == "reserved" and not is_cuda(device):
        raise ValueError("figure='reserved' is the caching allocator's: it needs device='cuda'")
    profile = gpu_profile(gpu) if is_cuda(device) else None
    if budget is not None:
        limit = parse_bytes(budget)
        target = f"budget {format_bytes(limit)}" + (f" on {profile}" if gpu is not None else "")
        chosen: Figure = figure or "peak"
    else:
        assert profile is not None
        limit, target = usable_memory(profile), str(profile)
        chosen = figure or "reserved"
    if is_cuda(device):
        options["gpu"] = profile
    return device, limit, target, chosen


def _fit_device(device: Any, gpu: Any) -> str:
    if device is None:
        return "cuda"
    try:
        kind = device_kind(str(device))
    except ValueError:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if is_cpu(kind) and gpu is not None:
        raise ValueError(f"gpu={gpu!r} applies to device='cuda' only")
    return kind


def _search(
    sizes: Sequence[int],
    figure_at: Callable[[int], int],
    limit: int,
    progress: Callable[[Probe], None] | None,
) -> list[Probe]:
    """Probes enough of ``sizes`` to name the largest that fits (see the module).

    After the two ends, the size where their line crosses the limit and the size
    after it, twice at most; then the ITP method (Oliveira and Takahashi, "An enhancement of the bisection method
    average performance preserving minmax optimality", ACM TOMS 47, 2020) over the
    sizes' indices: a guess by the line between the ends of the interval (regula
    falsi), moved toward the middle by a margin that shrinks with the interval
    (truncation), and kept within a distance of the middle that makes it never take
    more than ``ceil(log2(n - 1)) + 1`` guesses (projection): at most
    ``ceil(log2(n - 1)) + 7`` estimates in all.
    """
    probes: list[Probe] = []

    def over(index: int) -> int:
        size = sizes[index]
        nbytes = figure_at(size)
        made = Probe(size, nbytes, nbytes <= limit)
        probes.append(made)
        if progress is not None:
            progress(made)
        return nbytes - limit

    low, high = 0, len(sizes) - 1
    at_low = over(low)
    if at_low > 0 or high == low:
        return probes
    at_high = over(high)
    if at_high <= 0:
        return probes
    # A step's figure is close to affine in a batch: the line between the ends names
    # the boundary, to be confirmed by the size after it; where both fit, the line
    # from the first size through the second names it again (the ends' line is
    # steeper where the figure bends up).
    first = (low, at_low)
    anchor = (high, at_high)
    for _ in range(2):
        index = _crossing(first, anchor, low, high)
        at = over(index)
        if at > 0:
            high, at_high = index, at
            break
        low, at_low = index, at
        if index + 1 >= high:
            break
        at = over(index + 1)
        if at > 0:
            high, at_high = index + 1, at
            break
        low, at_low = index + 1, at
        anchor = (low, at_low)
        if high - low <= 1:
            break
    if high - low <= 1:
        return probes
    most = math.ceil(math.log2(high - low)) + _SLACK
    truncation = _TRUNCATION / (high - low)
    guesses = 0
    while high - low > 1:
        middle = (low + high) / 2
        radius = 2.0 ** (most - guesses - 1) - (high - low) / 2
        line = (high * at_low - low * at_high) / (at_low - at_high)
        toward = 1 if middle > line else -1
        margin = truncation * (high - low) ** 2
        truncated = line + toward * margin if margin <= abs(middle - line) else middle
        guess = truncated if abs(truncated - middle) <= radius else middle - toward * radius
        index = min(max(math.floor(guess), low + 1), high - 1)
        at = over(index)
        if at <= 0:
            low, at_low = index, at
        else:
            high, at_high = index, at
        guesses += 1
    return probes


def _crossing(one: tuple[int, int], two: tuple[int, int], low: int, high: int) -> int:
    """The index where the line through two (index, figure less the limit) points
    crosses zero, rounded down, strictly inside (low, high)."""
    (i, a), (j, b) = one, two
    line = i + (j - i) * -a / (b - a) if b != a else float(high)
    return min(max(math.floor(line), low + 1), high - 1)


#: ITP's constants (see :func:`_search`): ``kappa_1 * (b - a)`` and ``n_0``.
_TRUNCATION: Final = 0.1
_SLACK: Final = 1
