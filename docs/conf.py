"""Sphinx configuration of the pytest-torchmem documentation (``pip install -e ".[docs]"``).

Build it as CI does: ``sphinx-build -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

from importlib import metadata

project = "pytest-torchmem"
author = "the pytest-torchmem authors"
copyright = "2026, the pytest-torchmem authors"  # noqa: A001 - Sphinx's name

# MyST: the pages are Markdown, as the README was, so that a page reads the same on
# GitHub and in the built site.
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
myst_heading_anchors = 3
exclude_patterns = ["_build"]

# The PyData theme, as NumPy, SciPy, pandas and scikit-learn use: a responsive layout
# whose text column grows with the window (alabaster's was a fixed 660 px: a code block
# held 65 characters a line, and every command and terminal table of the tutorial
# scrolled sideways). The header holds the four parts (index.md's toctree), the left
# sidebar the part's pages and the page's headings (the right "on this page" column is
# dropped), the article the rest of the width (_static/torchmem.css): a code block
# holds 127 characters at 1366 px, 118 at 1280 (tests/test_docs_site.py).
html_theme = "pydata_sphinx_theme"
html_title = "pytest-torchmem"
html_static_path = ["_static"]
html_css_files = ["torchmem.css"]
# the left sidebar: the part's pages, then the page's headings; a page that is a part of
# its own (the first page, the tutorial, development, the changelog) has its headings only
html_sidebars = {
    "**": ["sidebar-nav-bs", "page-toc"],
    **{page: ["page-toc"] for page in ("index", "tutorial", "development", "changelog")},
}
html_theme_options = {
    "navbar_align": "left",
    "header_links_before_dropdown": 6,
    "secondary_sidebar_items": [],
}


def _repository() -> str | None:
    """The repository's address, from the package's metadata (``[project.urls]``)."""
    try:
        urls = metadata.metadata(project).get_all("Project-URL") or []
    except metadata.PackageNotFoundError:  # built without ``pip install -e .``
        return None
    found = dict(url.split(", ", 1) for url in urls)
    return found.get("Repository") or found.get("Source")


# The header links the repository when the package names it (``[project.urls]``'s
# "Repository" in pyproject.toml, what PyPI shows too).
if repository := _repository():
    icon = "fa-brands fa-github" if "github.com" in repository else "fa-brands fa-git-alt"
    html_theme_options["icon_links"] = [
        {"name": "Repository", "url": repository, "icon": icon, "type": "fontawesome"}
    ]
