"""Who asks: the traced program, or torch and this package.

The views a trace puts on (the GPU the fake cuda device is, a real run's answers
to the question whether the program is traced) answer the program's own code:
the model's, its libraries', the user's step. Not torch's code, which runs the
step on the trace's fake tensors and must see them as they are; not this
package's; not a module being imported (``imports.py``: an import runs as the
process imports it). This module says which a caller is.
"""

from __future__ import annotations

import dis
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from threading import get_ident
from types import FrameType
from typing import Final

import torch

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.imports import importing

__all__ = [
    "NOT_THE_PROGRAM",
    "TORCH_DIR",
    "dispatch_depth",
    "from_the_program",
    "is_the_program",
    "looks_it_up",
    "out_of_the_programs_sight",
]

# torch's private names (engine/torch_compat/torch_private.py)
_len_dispatch_stack: Final = private("torch._C._len_torch_dispatch_stack")
_pop_mode: Final = private("torch.utils._python_dispatch._pop_mode")
_push_mode: Final = private("torch.utils._python_dispatch._push_mode")

#: torch's own code.
TORCH_DIR: Final = os.path.dirname(os.path.abspath(torch.__file__))

#: Where the code that keeps seeing the trace as it is lives: torch, this package, and
#: Python's frozen modules (the import system).
NOT_THE_PROGRAM: Final = (TORCH_DIR, str(Path(__file__).resolve().parents[2]), "<frozen")


def is_the_program(frame: FrameType | None, thread: int) -> bool:
    """Whether ``frame`` runs the program's code, on the tracing thread ``thread``, while
    no module is being imported.

    Code compiled from a string (``<string>``, FX's ``<eval_with_key>.N``) is its maker's:
    dynamo's guards and FX's graph modules are torch's, a notebook cell the program's."""
    if get_ident() != thread or importing():
        return False
    while frame is not None and frame.f_code.co_filename.startswith("<") and not frame.f_code.co_filename.startswith("<frozen"):
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(NOT_THE_PROGRAM)


def from_the_program(thread: int) -> bool:
    """Whether the caller of the caller (a query's caller) is the program's code, on the
    tracing thread ``thread``, while no module is being imported."""
    return is_the_program(sys._getframe(2), thread)


#: The instructions that look a name up in a module: ``module.name`` (and ``module.name(...)``
#: where Python loads it as a method), ``from module import name``.
_LOOKUPS: Final = frozenset(dis.opmap[name] for name in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM") if name in dis.opmap)


def looks_it_up(frame: FrameType) -> bool:
    """Whether ``frame`` reads a module's attribute by its own instruction (``module.name``,
    ``from module import name``), not through C code it called: dynamo's guards read the
    module attributes a compiled region looked up as the region is called, with the
    caller's frame on top (``getattr(module, "name")`` is such a call too)."""
    return frame.f_code.co_code[frame.f_lasti] in _LOOKUPS


def dispatch_depth() -> int:
    """How many dispatch modes are on the stack now (before the step: the trace's own)."""
    return int(_len_dispatch_stack())


@contextmanager
def out_of_the_programs_sight(depth: int) -> Iterator[None]:
    """The block dispatches below the dispatch modes the program entered itself (those
    above the ``depth`` the trace's own took, :func:`dispatch_depth`): what the trace makes
    for its own accounting (a copy made outside the dispatcher in a real run), the
    program's modes (a profiler, a recorder) do not see."""
    popped = []
    while _len_dispatch_stack() > depth:
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)
