"""The published corpus (tests/published_figures.py): each real-GPU figure reproduced.

An ``exact`` entry's estimate, rounded as the source rounded it, is the published
figure; an ``explained`` one differs by what its explanation says, and no more. Each
entry's own figure (``ours``, in bytes, on torch 2.13) is pinned too, so that the
table in docs/explanation/accuracy.md stays what the estimate gives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from published_figures import CORPUS, UNITS, Published, cudnn_workspace

ROOT = Path(__file__).resolve().parents[1]

#: The release the entries' ``ours`` were recorded on (the README's).
RECORDED_ON = (2, 13)


def _params() -> list[object]:
    return [
        pytest.param(entry, id=entry.key, marks=[pytest.mark.exhaustive] if entry.heavy else [])
        for entry in CORPUS
    ]


def _release() -> tuple[int, int]:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return major, minor


@pytest.mark.parametrize("entry", _params())
def test_published_figure_is_reproduced(entry: Published) -> None:
    with cudnn_workspace(None):
        report = entry.build()
    ours = getattr(report, entry.figure)
    if _release() == RECORDED_ON:
        assert ours == entry.ours, f"{entry.key}: the estimate moved from {entry.ours} to {ours} B"
    theirs = entry.theirs_bytes()
    if entry.verdict == "exact":
        assert entry.rounded(ours) == entry.theirs, (entry.key, entry.rounded(ours), entry.theirs)
        return
    # explained: the difference is what the explanation says it is
    assert entry.why
    if entry.gap is not None:
        assert theirs is not None and theirs - ours == entry.gap, (entry.key, theirs, ours)
    if entry.cudnn_workspace is not None:
        with cudnn_workspace(entry.cudnn_workspace):
            charged = getattr(entry.build(), entry.figure)
        assert charged == theirs, (entry.key, charged, theirs)
    if entry.gap is None:
        # a figure the source rounded, over more than the estimate follows: ours is below it
        assert ours < float(entry.theirs) * UNITS[entry.unit], (entry.key, ours, entry.theirs)


def test_every_entry_names_its_source_gpu_release_and_protocol() -> None:
    keys = [entry.key for entry in CORPUS]
    assert len(keys) == len(set(keys))
    for entry in CORPUS:
        assert entry.source.startswith("https://"), entry.key
        assert entry.gpu and entry.release and entry.protocol, entry.key
        assert entry.unit in UNITS and re.fullmatch(r"[0-9]+(\.[0-9]+)?", entry.theirs), entry.key
        assert (entry.verdict == "exact") == (entry.gap is None and entry.cudnn_workspace is None
                                              and entry.rounded(entry.ours) == entry.theirs), entry.key


def test_the_accuracy_page_lists_the_corpus() -> None:
    """docs/explanation/accuracy.md's table names every entry with both figures."""
    page = (ROOT / "docs" / "explanation" / "accuracy.md").read_text()
    for entry in CORPUS:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{entry.key}` |")), None)
        assert row is not None, f"{entry.key} is not in the accuracy page's corpus table"
        assert entry.theirs in row.replace(",", ""), entry.key
        assert entry.verdict in row, entry.key
