"""Sphinx configuration of the pytest-torchmem documentation (``pip install -e ".[docs]"``).

Build it as CI does: ``sphinx-build -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

project = "pytest-torchmem"
author = "the pytest-torchmem authors"
copyright = "2026, the pytest-torchmem authors"  # noqa: A001 - Sphinx's name

# MyST: the pages are Markdown, as the README was, so that a page reads the same on
# GitHub and in the built site.
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "pytest-torchmem"
