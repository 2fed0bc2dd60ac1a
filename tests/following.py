"""Which releases follow compiled programs: a mark for the tests that need it.

Kept apart from ``compiled_zoo`` (run as a script in capped processes, which import
the installed package)."""

from __future__ import annotations

import pytest
import torch

from pytest_torchmem.engine.tracing.compiled import following_blocked

#: The tests of a compiled program followed (estimate) or run compiled (measure): torch
#: 2.13 on. Before it dynamo has no cache region of our own (``isolate_recompiles``:
#: torch/_dynamo/eval_frame.py's ``_next_isolate_recompiles_id``, new in 2.13), so the
#: engine compiles nothing there and lists each compiled region (tests/test_compiled.py's
#: test_compiled_regions_are_listed_where_dynamo_cannot_isolate_them).
follows_compiled = pytest.mark.skipif(
    following_blocked() is not None,
    reason=f"torch {torch.__version__} has no {following_blocked()}, which following a "
    "compiled program needs (isolate_recompiles cache regions: torch 2.13); compiled "
    "regions are listed in unsupported instead",
)
