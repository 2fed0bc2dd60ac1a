"""Inductor's output modules written for an estimate: the user's lines theirs come from, and where they are written.

A followed compiled region runs the Python module inductor wrote for it (its
wrapper): the innermost frame of each allocation and of each op listed in
``unsupported`` is a line of that module. Inductor's line map ties the
module's lines to the graph nodes they came from, and each node keeps the
stack of the user's code that made it (backward nodes: the forward's); the
trace reads the user's frames from there (:func:`user_frames_at`).

With caches off, inductor writes each module into a fresh temporary directory
that it never deletes (``fresh_cache(delete=False)``: the module must outlive
the compile); an estimate's go under one directory of ours instead, deleted
when the estimate ends (:func:`output_directory`).
"""

from __future__ import annotations

import bisect
import functools
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_replacing import replacing

__all__ = ["is_generated", "output_directory", "remember", "user_frames_at"]

#: Each output module's line map: the first line of each node's code, and the
#: node's stack trace (None: none), by file.
_LINE_MAPS: Final[dict[str, tuple[list[int], list[str | None]]]] = {}
_FRAME: Final = re.compile(r'File "(.+)", line (\d+), in (.+)\n')


def remember(path: str, linemap: Any) -> None:
    """Keep the line map inductor gave with the output module at ``path``."""
    pairs = sorted((line, trace) for line, trace in linemap or () if isinstance(line, int))
    _LINE_MAPS[path] = ([line for line, _ in pairs], [trace for _, trace in pairs])


def is_generated(path: str) -> bool:
    """Whether ``path`` is an output module of an estimate running now."""
    return path in _LINE_MAPS


def user_frames_at(path: str, line: int) -> tuple[tuple[str, int, str], ...]:
    """The frames (innermost first) of the user's code that made the graph node whose
    code is at ``line`` of the output module ``path``; empty where unknown."""
    found = _LINE_MAPS.get(path)
    if found is None:
        return ()
    lines, traces = found
    index = bisect.bisect_right(lines, line) - 1
    trace = traces[index] if index >= 0 else None
    return _frames_of(trace) if trace else ()


@functools.lru_cache(maxsize=1024)
def _frames_of(trace: str) -> tuple[tuple[str, int, str], ...]:
    """The frames of a graph node's stack trace, innermost first (read once per trace:
    each buffer a program line makes asks again)."""
    return tuple((name, int(number), function) for name, number, function in reversed(_FRAME.findall(trace)))


@contextmanager
def output_directory() -> Iterator[None]:
    """While inductor compiles for an estimate, its output modules are written under a
    temporary directory of ours, deleted (with their line maps) on exit."""
    config = private("torch._inductor.config")
    fresh_cache = private("torch._inductor.utils.fresh_cache")
    root = tempfile.mkdtemp(prefix="pytest-torchmem-inductor-")

    @contextmanager
    def fresh_if_config() -> Iterator[None]:
        if not config.force_disable_caches:
            yield
            return
        with fresh_cache(dir=root, delete=False):
            yield

    try:
        with replacing("torch._inductor.compile_fx.with_fresh_cache_if_config", fresh_if_config):
            yield
    finally:
        prefix = root + os.sep
        for path in [path for path in _LINE_MAPS if path.startswith(prefix)]:
            del _LINE_MAPS[path]
        shutil.rmtree(root, ignore_errors=True)
