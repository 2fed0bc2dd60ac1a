"""Which torch releases the engine supports, and the clear word outside them.

The engine reads torch's private names and follows its kernels' memory
release by release (:mod:`pytest_torchmem.engine.torch_compat.torch_private` lists every
private name). Each minor release of :data:`SUPPORTED` is tested, CPU and
CUDA builds; outside it, an estimate or a measurement refuses at once with
one line that names the installed torch, the window and what to do, rather
than failing deep inside a rule. Nothing here imports more than ``torch``'s
version string, so the check runs before any module that a release could
break is imported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import cache
from typing import Final, TypeVar

T = TypeVar("T")

__all__ = [
    "PIPELINING",
    "SUPPORTED",
    "TorchReleaseError",
    "installed_release",
    "of_release",
    "release_problem",
    "require_supported_torch",
    "supported_range",
    "torch_minor",
]

#: The first and the last supported minor release of torch (both included).
SUPPORTED: Final = ((2, 10), (2, 15))

#: The releases whose ``torch.distributed.pipelining`` a pipeline estimate follows, first
#: and last (tracing/trace.py refuses the others in one line).
PIPELINING: Final = ((2, 12), (2, 15))

#: Set to ``1`` to run on a torch outside :data:`SUPPORTED` anyway (a nightly,
#: say): the figures are then unverified, and may be wrong or fail.
ANY_RELEASE_VARIABLE: Final = "TORCHMEM_ANY_TORCH"


class TorchReleaseError(RuntimeError):
    """The installed torch is outside the supported window (a one-line message)."""


def supported_range() -> str:
    """The window in words: ``"2.10 to 2.15"``."""
    (first_major, first_minor), (last_major, last_minor) = SUPPORTED
    return f"{first_major}.{first_minor} to {last_major}.{last_minor}"


def _parse(version: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_release() -> tuple[int, int, int]:
    """``(major, minor, patch)`` of the torch this process imports (2.13.0+cpu: ``(2, 13, 0)``)."""
    import torch

    return _parse(torch.__version__)


@cache
def torch_minor() -> tuple[int, int]:
    """``(major, minor)`` of the installed torch, parsed once: the release the rules
    follow (asked on every op that differs between releases)."""
    major, minor, _ = installed_release()
    return major, minor


def of_release(table: Mapping[tuple[int, int], T], release: tuple[int, int]) -> T:
    """The entry of ``table`` (by ``(major, minor)``) for torch ``release``; outside the
    table's releases, that of the nearest one in it."""
    known = sorted(table)
    return table[min(max(release, known[0]), known[-1])]


def release_problem(version: str) -> str | None:
    """Why torch ``version`` cannot be used (one line), or None where it is supported."""
    major, minor, _ = _parse(version)
    (first_major, first_minor), (last_major, last_minor) = SUPPORTED
    if (first_major, first_minor) <= (major, minor) <= (last_major, last_minor):
        return None
    install = f'pip install "torch>={first_major}.{first_minor},<{last_major}.{last_minor + 1}"'
    if (major, minor) > (last_major, last_minor):
        what = f"torch {version}, newer than this pytest-torchmem knows: upgrade pytest-torchmem, or {install}"
    else:
        what = f"torch {version}: {install}"
    return (
        f"pytest-torchmem supports torch {supported_range()}, and this is {what} "
        f"(or set {ANY_RELEASE_VARIABLE}=1 to try it anyway, with unverified figures)"
    )


@cache
def _problem() -> str | None:
    """Why the installed torch cannot be used, worked out once (its version does not change)."""
    import torch

    return release_problem(torch.__version__)


def require_supported_torch() -> None:
    """Raise :class:`TorchReleaseError` where the installed torch is outside the window,
    unless :data:`ANY_RELEASE_VARIABLE` is ``1`` (read on each call: set after a first
    refusal, it lets the next estimate run)."""
    if os.environ.get(ANY_RELEASE_VARIABLE) == "1":
        return
    problem = _problem()
    if problem is not None:
        raise TorchReleaseError(problem)
