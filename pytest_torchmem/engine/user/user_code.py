"""Where in the user's code the trace is: the frames outside torch and this package.

An op listed in ``unsupported`` is located at the innermost such frame; each
storage can keep the user's frames that made it (``record_frames``). A line
of a compiled region's program (inductor's output module) stands for the
user's lines its graph node came from (:mod:`generated_code`).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Final

import torch

from pytest_torchmem.engine.figures.timeline import Frame
from pytest_torchmem.engine.user.generated_code import is_generated, user_frames_at

__all__ = ["OWN_DIRS", "location_in", "runner_dirs", "user_frames", "user_location"]

#: Where torch's and this package's code lives: not the user's.
OWN_DIRS: Final = (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),  # pytest_torchmem/
    os.path.dirname(os.path.abspath(torch.__file__)),
    # (a thread's start, under the trace of a pipeline's rank: not the user's code)
    threading.__file__,
)


def user_location() -> str:
    """``file:line`` of the innermost frame outside torch and this package."""
    frames = user_frames(limit=1)
    return f"{frames[0].filename}:{frames[0].line}" if frames else ""


def user_frames(limit: int = 16, stop: tuple[str, ...] = ()) -> tuple[Frame, ...]:
    """The frames outside torch and this package, innermost first (at most ``limit``),
    below the first frame of a file under one of the ``stop`` directories."""
    frames: list[Frame] = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        filename = code.co_filename
        if filename.startswith(stop):
            break
        if not filename.startswith(OWN_DIRS):
            frames.extend(_users(filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(frames[:limit])


def _users(filename: str, line: int, function: str) -> list[Frame]:
    """The user's frames of one frame, innermost first: itself, none (torch's or this
    package's), or, for a line of a compiled region's program, the user's lines its
    graph node came from."""
    if is_generated(filename):
        return [Frame(*frame) for frame in user_frames_at(filename, line) if not frame[0].startswith(OWN_DIRS)]
    if filename.startswith(OWN_DIRS) or filename.startswith("<"):
        return []
    return [Frame(filename, line, function)]


def runner_dirs() -> tuple[str, ...]:
    """The directories of the test runner's code (pytest's, pluggy's), where loaded.

    The frames of a test start below them: :func:`user_frames` stops there,
    which also spares it the walk through pytest's dozens of frames.
    """
    dirs = []
    for name in ("_pytest", "pluggy"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def location_in(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback outside torch and
    this package."""
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames = _users(code.co_filename, tb.tb_lineno, code.co_name)
        if frames:
            found = f"{frames[0].filename}:{frames[0].line}"
        tb = tb.tb_next
    return found
