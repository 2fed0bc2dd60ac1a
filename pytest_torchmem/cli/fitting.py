"""``python -m pytest_torchmem fit``, ``rank`` and ``ranks``: what fits, from the command line.

Each names a factory, ``module:function`` or ``path/to/file.py:function``, that
takes no argument and returns ``(model, inputs_for)`` or ``(model, inputs_for,
options)``: the model (or a step function), a function from a size to its inputs,
and :func:`~pytest_torchmem.estimate`'s keyword options (``optimizer``,
``loss_fn``, ``keep_output``, ...). ``fit`` searches the largest size that fits
each GPU or the budget (:func:`~pytest_torchmem.fit`), printing a progress line
per estimate to stderr; ``rank`` estimates one size on each GPU and ranks them by
headroom (:func:`~pytest_torchmem.rank_gpus`); ``ranks`` estimates one size on
every distinct rank of the options' ``parallel=`` and lists them, the worst first
(:func:`~pytest_torchmem.every_rank`). torch is imported only here, when one of
them runs.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, TextIO

from tabulate import tabulate

from pytest_torchmem.engine.figures.modelled_device import is_cpu, is_cuda
from pytest_torchmem.engine.figures.units import format_bytes, parse_bytes

__all__ = ["FactoryError", "add_commands", "fit_command", "rank_command", "ranks_command"]


class FactoryError(Exception):
    """The factory cannot be loaded, or returned something else than it should."""


_FACTORY_HELP: Final = (
    "module:function or path/to/file.py:function; the function takes no argument and "
    "returns (model, inputs_for) or (model, inputs_for, options): inputs_for(size) builds "
    "the inputs of one size, options are estimate()'s keyword arguments"
)


def add_commands(commands: Any, formatter: type[argparse.HelpFormatter], exit_codes: str, prog: str) -> None:
    """The ``fit`` and ``rank`` subcommands, on ``commands`` (the main parser's subparsers)."""
    fit = commands.add_parser(
        "fit",
        help="the largest size (batch, sequence length, ...) whose step fits a GPU or a budget",
        description=_fit_help(prog, exit_codes),
        formatter_class=formatter,
    )
    fit.add_argument("factory", metavar="FACTORY", help=_FACTORY_HELP)
    _targets(fit)
    fit.add_argument(
        "--budget",
        metavar="BYTES",
        help="a byte budget (40GiB, 1.5GB) for the step's peak, instead of or on the --gpu",
    )
    fit.add_argument(
        "--sizes",
        default="1:4096",
        metavar="FIRST:LAST[:STEP]",
        help="the sizes to search, both ends included (default 1:4096; 8:4096:8 for multiples of 8)",
    )
    fit.add_argument("--name", default="size", help="what the size is, for the output (batch, length, ...)")
    fit.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="the fake device (default cuda); cpu needs --budget",
    )
    fit.add_argument(
        "--figure",
        choices=("peak", "reserved"),
        help="what must fit: the reserved peak (default against a GPU) or the peak (default against a budget)",
    )
    fit.add_argument(
        "--at-least",
        type=int,
        metavar="SIZE",
        help="exit 1 when the largest size that fits a target is below SIZE (a CI gate)",
    )
    fit.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    _output(fit)
    rank = commands.add_parser(
        "rank",
        help="estimate one size on several GPUs and rank them by the room the step leaves",
        description=_rank_help(prog, exit_codes),
        formatter_class=formatter,
    )
    rank.add_argument("factory", metavar="FACTORY", help=_FACTORY_HELP)
    rank.add_argument("--size", type=int, required=True, help="the size to estimate")
    _targets(rank)
    _output(rank)
    ranks = commands.add_parser(
        "ranks",
        help="every distinct rank of a parallel run, the worst first: which runs out of memory first",
        description=_ranks_help(prog, exit_codes),
        formatter_class=formatter,
    )
    ranks.add_argument("factory", metavar="FACTORY", help=_FACTORY_HELP + "; options hold parallel=tm.Parallel(...)")
    ranks.add_argument("--size", type=int, required=True, help="the size to estimate")
    ranks.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="the fake device (default cuda)"
    )
    ranks.add_argument("--gpu", default=None, metavar="NAME", help="the GPU profile on cuda (default H100)")
    _output(ranks)


def _fit_help(prog: str, exit_codes: str) -> str:
    return f"""\
Search the largest size whose step fits each --gpu (its reserved peak within the
GPU's usable memory: its memory less the 512 MiB of the CUDA context) or a
--budget (its peak), by estimates on the fake device: four or five estimates for
sizes 1 to 4096 where the step's memory grows in a straight line (a batch), never
more than 19. The size found and the next one were both
estimated. The step's memory must not shrink as the size grows.

FACTORY is a function of no argument returning (model, inputs_for) or (model,
inputs_for, options), e.g. in train.py:

    def factory():
        model = build_model()                 # on the meta device: no memory
        inputs = lambda batch: torch.randint(0, 50257, (batch, 1024))
        return model, inputs, {{"optimizer": lambda p: torch.optim.AdamW(p)}}

examples:
  {prog} fit train.py:factory --gpu A100-40GB --name batch
  {prog} fit mypkg.memory:gpt2 --gpu T4 --gpu L4 --gpu A100-40GB --sizes 8:4096:8
  {prog} fit train.py:factory --budget 20GiB --device cpu --at-least 16

{exit_codes}
  (fit: 1 also when a target's size is below --at-least)"""


def _rank_help(prog: str, exit_codes: str) -> str:
    return f"""\
Estimate the step at one --size on each --gpu (default: every named GPU profile)
and rank them: those it fits first, the most room first, then those it does not
fit, the closest first. Headroom is the GPU's usable memory (its memory less the
512 MiB of the CUDA context) less the step's reserved peak.

examples:
  {prog} rank train.py:factory --size 16
  {prog} rank train.py:factory --size 16 --gpu T4,L4,A100-40GB --format markdown

{exit_codes}"""


def _ranks_help(prog: str, exit_codes: str) -> str:
    return f"""\
Estimate the step at one --size on every distinct rank of the factory's
parallel=tm.Parallel(...) and list them, the worst first (on cuda the highest
reserved peak, with the room it leaves on --gpu; on cpu the highest peak). A row
stands for the ranks whose figures equal its own: the ranks of a data-parallel
dimension are one row where they hold the same, a pipeline's stages one row each.
The parallel's rank= is not read.

examples:
  {prog} ranks train.py:factory --size 8
  {prog} ranks train.py:factory --size 8 --gpu A100-80GB --format markdown

{exit_codes}
  (ranks: 1 also when a rank does not fit --gpu)"""


def _targets(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu",
        dest="gpus",
        action="append",
        default=[],
        metavar="NAME",
        help="a GPU profile (A100-40GB, H100, ...); repeat or separate with commas",
    )


def _output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=("table", "json", "markdown"),
        default="table",
        help="table (default), json (machine-readable), or markdown",
    )
    parser.add_argument("--bytes", action="store_true", help="exact byte counts instead of sizes such as 1.50 GiB")


# -- fit --------------------------------------------------------------------------------------


def fit_command(args: argparse.Namespace, err: TextIO) -> tuple[str, int]:
    """Run ``fit``; return its output and exit code."""
    from pytest_torchmem.engine.fit.search import fit

    sizes = _sizes(args.sizes)
    gpus = _names(args.gpus)
    budget = None if args.budget is None else _budget(args.budget)
    if budget is None and not gpus:
        raise FactoryError("fit needs a target: --gpu NAME (repeatable) or --budget BYTES")
    if is_cpu(args.device) and gpus:
        raise FactoryError("--gpu is for --device cuda; on cpu give --budget")
    _check_gpus(gpus)
    model, inputs_for, options = _load(args.factory, args.device, {"device": "give --device", "gpu": "give --gpu"})
    progress = _Progress(err, quiet=args.quiet)
    progress.name = args.name
    found = []
    for gpu in gpus or [None]:
        progress.target = gpu or f"budget {format_bytes(budget or 0)}"
        with _libraries_quiet():
            one = fit(
                model,
                inputs_for,
                sizes=sizes,
                budget=budget,
                gpu=gpu,
                device=args.device,
                figure=args.figure,
                size_name=args.name,
                progress=progress,
                **options,
            )
        found.append(one)
        progress.done()
    short = [one for one in found if args.at_least is not None and (one.size or 0) < args.at_least]
    code = 1 if short else 0
    if args.format == "json":
        return json.dumps([_fit_json(one) for one in found], indent=2, sort_keys=True), code
    text = _fit_table(found, args)
    for one in short:
        text += f"\n{one.target}: the largest {one.size_name} that fits is {one.size}, below --at-least {args.at_least}"
    return text, code


def _fit_json(found: Any) -> dict[str, Any]:
    return {
        "target": found.target,
        "limit": found.limit,
        "figure": found.figure,
        "size_name": found.size_name,
        "size": found.size,
        "nbytes": found.nbytes,
        "headroom": found.headroom,
        "next_size": found.next_size,
        "next_nbytes": found.next_nbytes,
        "estimates": [{"size": p.size, "nbytes": p.nbytes, "fits": p.fits} for p in found.probes],
    }


def _fit_table(found: Sequence[Any], args: argparse.Namespace) -> str:
    size = _bytes_formatter(args.bytes)
    name = found[0].size_name
    rows = [
        [
            one.target,
            size(one.limit),
            "none" if one.size is None else one.size,
            "-" if one.nbytes is None else size(one.nbytes),
            "-" if one.headroom is None else size(one.headroom),
            "-" if one.next_size is None else one.next_size,
            "-" if one.next_nbytes is None else size(one.next_nbytes),
            len(one.probes),
        ]
        for one in sorted(found, key=lambda one: -(one.size or 0))
    ]
    figure = found[0].figure
    headers = ["target", "usable" if args.gpus and args.budget is None else "limit", name, figure, "to spare", f"next {name}", "needs", "estimates"]
    return tabulate(rows, headers=headers, tablefmt="github" if args.format == "markdown" else "simple", disable_numparse=True)


# -- rank ---------------------------------------------------------------------------------------


def rank_command(args: argparse.Namespace) -> tuple[str, int]:
    """Run ``rank``; return its output and exit code."""
    from pytest_torchmem.engine.fit.search import rank_gpus

    if args.size < 1:
        raise FactoryError(f"--size must be a positive integer, got {args.size}")
    _check_gpus(_names(args.gpus))
    model, inputs_for, options = _load(args.factory, "cuda", {"device": "rank estimates on the fake cuda device", "gpu": "give --gpu"})
    inputs = inputs_for(args.size)
    with _libraries_quiet():
        rooms = rank_gpus(model, inputs, _names(args.gpus) or None, **options)
    if args.format == "json":
        rows = [
            {
                "gpu": room.gpu,
                "fits": room.fits,
                "usable": room.usable,
                "reserved_peak": room.reserved_peak,
                "peak": room.peak,
                "headroom": room.headroom,
            }
            for room in rooms
        ]
        return json.dumps(rows, indent=2, sort_keys=True), 0
    size = _bytes_formatter(args.bytes)
    table = [
        [room.gpu, "yes" if room.fits else "no", size(room.usable), size(room.reserved_peak), size(room.peak), size(room.headroom)]
        for room in rooms
    ]
    headers = ["gpu", "fits", "usable", "reserved", "peak", "headroom"]
    return tabulate(table, headers=headers, tablefmt="github" if args.format == "markdown" else "simple", disable_numparse=True), 0


# -- ranks --------------------------------------------------------------------------------------


def ranks_command(args: argparse.Namespace) -> tuple[str, int]:
    """Run ``ranks``; return its output and exit code (1: a rank does not fit the GPU)."""
    from pytest_torchmem.engine.api import every_rank
    from pytest_torchmem.engine.parallel.mesh import Parallel

    if args.size < 1:
        raise FactoryError(f"--size must be a positive integer, got {args.size}")
    if args.gpu is not None:
        if not is_cuda(args.device):
            raise FactoryError("--gpu is for --device cuda")
        _check_gpus([args.gpu])
    model, inputs_for, options = _load(
        args.factory, args.device, {"device": "give --device", "gpu": "give --gpu"}
    )
    parallel = options.pop("parallel", None)
    if not isinstance(parallel, Parallel):
        raise FactoryError(
            f"{args.factory}: ranks needs the options to hold parallel=tm.Parallel(mesh=..., apply=...), "
            f"got {'none' if parallel is None else type(parallel).__name__}"
        )
    with _libraries_quiet():
        figures = every_rank(
            model, inputs_for(args.size), parallel=parallel, device=args.device, gpu=args.gpu, **options
        )
    code = 1 if any(entry.fits is False for entry in figures) else 0
    cuda = is_cuda(args.device)
    if args.format == "json":
        rows = [
            {
                "rank": entry.rank,
                "ranks": list(entry.ranks),
                "coordinates": dict(entry.coordinates),
                "forward_peak": entry.report.forward_peak,
                "backward_peak": entry.report.backward_peak,
                "step_peak": entry.report.step_peak,
                "peak": entry.report.peak,
                "reserved_peak": entry.report.reserved_peak,
                "usable": entry.usable,
                "headroom": entry.headroom,
                "fits": entry.fits,
            }
            for entry in figures
        ]
        return json.dumps(rows, indent=2, sort_keys=True), code
    size = _bytes_formatter(args.bytes)
    table = []
    for entry in figures:
        report = entry.report
        row = [
            entry.rank,
            ",".join(f"{name}={index}" for name, index in entry.coordinates.items()),
            _ranks_cell(entry.ranks),
            size(report.forward_peak),
            size(report.backward_peak),
            size(report.step_peak),
            size(report.peak),
        ]
        if cuda:
            assert report.reserved_peak is not None and entry.headroom is not None
            row += [size(report.reserved_peak), size(entry.headroom), "yes" if entry.fits else "no"]
        table.append(row)
    headers = ["rank", "coordinates", "stands for", "forward", "backward", "step", "peak"]
    if cuda:
        headers += ["reserved", "headroom", "fits"]
    return tabulate(table, headers=headers, tablefmt="github" if args.format == "markdown" else "simple", disable_numparse=True), code


def _ranks_cell(ranks: Sequence[int]) -> str:
    """The ranks a row stands for: runs of consecutive ranks as ``first-last``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


# -- shared -------------------------------------------------------------------------------------


@contextmanager
def _libraries_quiet() -> Iterator[None]:
    """transformers' notices while the estimates run its model (``loss_type=None`` was set
    in the config...) are no part of the command's output: its logger is raised to errors
    and its warnings ignored for them, then the user's configuration is put back."""
    if "transformers" not in sys.modules:
        yield
        return
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
            yield
    finally:
        logger.setLevel(level)


class _Progress:
    """One line per estimate on stderr; on a terminal, one line rewritten in place."""

    def __init__(self, err: TextIO, *, quiet: bool) -> None:
        self.err, self.quiet = err, quiet
        self.live = not quiet and err.isatty()
        self.target = ""
        self.name = "size"
        self.count = 0

    def __call__(self, probe: Any) -> None:
        self.count += 1
        if self.quiet:
            return
        verdict = "fits" if probe.fits else "does not fit"
        line = f"fit {self.target}: estimate {self.count}, {self.name} {probe.size}: {format_bytes(probe.nbytes)}, {verdict}"
        if self.live:
            self.err.write("\r\033[K" + line)
        else:
            self.err.write(line + "\n")
        self.err.flush()

    def done(self) -> None:
        if self.live and self.count:
            self.err.write("\n")
            self.err.flush()
        self.count = 0


def _bytes_formatter(exact: bool) -> Callable[[int], str]:
    return (lambda n: f"{n:,}") if exact else format_bytes


def _names(values: Sequence[str]) -> list[str]:
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def _check_gpus(names: Sequence[str]) -> None:
    from pytest_torchmem.engine.figures.gpu_profiles import gpu_profile

    for name in names:
        try:
            gpu_profile(name)
        except ValueError as exc:
            raise FactoryError(f"--gpu: {exc}") from None


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except (TypeError, ValueError) as exc:
        raise FactoryError(f"--budget: {exc}") from None


def _sizes(text: str) -> range:
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(part.strip().isdecimal() for part in parts):
        raise FactoryError(f"--sizes must be FIRST:LAST or FIRST:LAST:STEP in positive integers, got {text!r}")
    first, last, *step = (int(part) for part in parts)
    if first < 1 or last < first or (step and step[0] < 1):
        raise FactoryError(f"--sizes {text!r}: give 1 <= FIRST <= LAST and a positive STEP")
    return range(first, last + 1, step[0] if step else 1)


def _load(
    spec: str, device: str, flags: dict[str, str]
) -> tuple[Any, Callable[[int], Any], dict[str, Any]]:
    """The factory ``spec`` names, called: ``(model, inputs_for, options)``, its options
    checked for a step on ``device`` (``flags``: the options the command sets, and what
    to do instead of each)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise FactoryError(f"FACTORY must be module:function or path/to/file.py:function, got {spec!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise FactoryError(f"no such file: {where}")
        sys.path.insert(0, str(path.parent))  # its sibling modules import as when it runs
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # the user's module: its error, in one line
            raise FactoryError(f"cannot load {where}: {_raised(exc, str(path))}") from None
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise FactoryError(f"cannot import {where!r}: {_raised(exc, None)}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise FactoryError(f"{where} has no function {name!r}")
    try:
        made = factory()
    except Exception as exc:
        raise FactoryError(f"{spec} raised {_raised(exc, getattr(module, '__file__', None))}") from None
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise FactoryError(
            f"{spec} must return (model, inputs_for) or (model, inputs_for, options), "
            f"got {type(made).__name__}"
        )
    model, inputs_for, *rest = made
    options = rest[0] if rest else {}
    if not callable(inputs_for):
        raise FactoryError(f"{spec}: inputs_for must be a function of the size, got {type(inputs_for).__name__}")
    if not isinstance(options, dict):
        raise FactoryError(f"{spec}: options must be a dict of estimate()'s keyword arguments, got {type(options).__name__}")
    _check_options(spec, options, device, flags)
    return model, inputs_for, options


def _check_options(spec: str, options: dict[Any, Any], device: str, flags: dict[str, str]) -> None:
    """The factory's options are :func:`~pytest_torchmem.estimate`'s keyword arguments,
    less those the command sets (``flags``); a name it does not take is refused before any
    estimate."""
    from pytest_torchmem.engine.api import estimate

    known = sorted(
        name
        for name, parameter in inspect.signature(estimate).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in flags
    )
    for key in options:
        if key in flags:
            raise FactoryError(f"{spec}: the options hold {key!r}, which the command sets: leave it out; {flags[key]}")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise FactoryError(
                f"{spec}: the options hold {key!r}, which estimate() does not take; {hint}"
                f"its options are {', '.join(known)}"
            )
    if "cpu" in options and options["cpu"] is not None and not is_cpu(device):
        raise FactoryError(
            f"{spec}: the options hold cpu={options['cpu']!r}, a CPU profile, and this command "
            "estimates on the fake cuda device: leave it out, or run fit with --device cpu"
        )


def _raised(exc: BaseException, own_file: str | None) -> str:
    """``exc`` in one line: its type, its message and where it was raised (the last line of
    ``own_file`` on its way, else the line that raised it)."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if not frame.filename.startswith("<")]
    own = [frame for frame in frames if own_file is not None and frame.filename == own_file]
    if isinstance(exc, SyntaxError) or not frames:
        return text
    frame = (own or frames)[-1]
    return f"{text} (at {_shown(frame.filename)}:{frame.lineno})"


def _shown(path: str) -> str:
    """``path`` relative to the working directory where it lies under it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if relative.startswith("..") else relative
