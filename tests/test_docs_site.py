"""The built documentation site in a real browser: the tutorial and the how-tos at a
laptop's width and a phone's.

It needs the ``docs`` extra (``pip install -e ".[docs]"``) and Debian's chromium; it
skips without them, unless ``TORCHMEM_REQUIRE_DOCS=1`` (``.ci/run``, after building the
documentation). The site is built here, as CI builds it, into a temporary directory.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_html_report import browse

ROOT = Path(__file__).resolve().parent.parent

#: Characters a line of a code block holds on a laptop (1366 and 1280 px wide; 127 and
#: 118 are measured): the commands and code of the pages, whose longest lines are 113
#: characters. Longer lines are terminal output (the torchmem table, 150 to 194
#: characters; messages of up to 222) and scroll sideways inside their block. Sphinx's
#: default theme (alabaster) held 65 on a laptop.
LAPTOP_LINE: int = 115

#: Each page in an iframe of the given viewport; once all are loaded, what each one's
#: layout gives is written into the wrapper's <html data-probe="...">, which
#: ``--dump-dom`` prints (file:// frames read with --allow-file-access-from-files).
PROBE = """<!doctype html><html><head><meta charset="utf-8"></head><body style="margin:0">
%(frames)s
<script>
window.addEventListener("load", function () {
  var pages = [];
  document.querySelectorAll("iframe").forEach(function (frame) {
    var doc = frame.contentDocument, win = frame.contentWindow, blocks = [], tables = [];
    doc.querySelectorAll("[role=main] pre").forEach(function (pre) {
      var style = win.getComputedStyle(pre), probe = doc.createElement("span");
      probe.textContent = "0".repeat(100);
      pre.appendChild(probe);
      var char = probe.getBoundingClientRect().width / 100;
      pre.removeChild(probe);
      var inner = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      var lines = pre.textContent.replace(/\\n$/, "").split("\\n");
      var longest = Math.max.apply(null, lines.map(function (l) { return l.length; }));
      blocks.push({longest: longest, capacity: Math.floor(inner / char + 0.01),
                   overflows: pre.scrollWidth > pre.clientWidth, scrolls: style.overflowX,
                   first: pre.textContent.split("\\n")[0].slice(0, 60)});
    });
    doc.querySelectorAll("[role=main] table").forEach(function (table) {
      var box = table.parentElement;
      tables.push({overflows: table.offsetWidth > box.clientWidth || box.scrollWidth > box.clientWidth,
                   first: table.innerText.split("\\n")[0].slice(0, 60)});
    });
    var nav = Array.prototype.map.call(doc.querySelectorAll(".bd-header .navbar-nav a.nav-link"),
                                       function (a) { return a.textContent.trim(); });
    var cut = Array.prototype.filter.call(doc.querySelectorAll(".prev-next-area a"),
                                          function (a) { return a.scrollWidth > a.clientWidth; });
    pages.push({page: frame.getAttribute("src"), blocks: blocks, tables: tables, nav: nav,
                width: doc.documentElement.scrollWidth, viewport: win.innerWidth,
                cut: cut.map(function (a) { return a.textContent.replace(/\\s+/g, " ").trim(); })});
  });
  document.documentElement.setAttribute("data-probe", JSON.stringify(pages));
});
</script></body></html>"""


def _require(what: str, missing: bool, fix: str) -> None:
    if not missing:
        return
    if os.environ.get("TORCHMEM_REQUIRE_DOCS") == "1":
        pytest.fail(f"TORCHMEM_REQUIRE_DOCS=1 but {what} is missing: {fix}")
    pytest.skip(f"{what} is not installed ({fix}); the documentation site is not built")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation, built as CI builds it (warnings are errors)."""
    for module in ("sphinx", "myst_parser", "pydata_sphinx_theme"):
        _require(module, importlib.util.find_spec(module) is None, 'pip install -e ".[docs]"')
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(ROOT / "docs"), str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def pages(site: Path) -> list[str]:
    return ["tutorial.html", *sorted(str(p.relative_to(site)) for p in (site / "howto").glob("*.html"))]


def probe(site: Path, tmp_path: Path, width: int, height: int) -> list[dict[str, Any]]:
    """Lay out the tutorial and every how-to in a ``width`` x ``height`` viewport."""
    frames = "\n".join(
        f'<iframe src="{page}" width="{width}" height="{height}" style="border:0;display:block"></iframe>'
        for page in pages(site)
    )
    wrapper = site / f"probe-{width}.html"
    wrapper.write_text(PROBE % {"frames": frames}, encoding="utf-8")
    window = f"--window-size={width + 40},{height}"
    dom, _ = browse(wrapper, tmp_path, "--allow-file-access-from-files", window, "--dump-dom")
    found = re.search(r'data-probe="([^"]*)"', dom)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.parametrize(("width", "height"), [(1366, 768), (1280, 800)])
def test_on_a_laptop_code_blocks_hold_their_lines(
    site: Path, tmp_path: Path, width: int, height: int
) -> None:
    """Sphinx's default theme held 65 characters: every command and table of the tutorial
    and the how-tos scrolled sideways. Now a block holds ``LAPTOP_LINE`` characters, and the
    blocks that scroll are exactly those with a longer line (terminal output)."""
    laid_out = probe(site, tmp_path, width, height)
    assert [p["page"] for p in laid_out] == pages(site)
    blocks = [(p["page"], b) for p in laid_out for b in p["blocks"]]
    assert len(blocks) > 30
    for page, block in blocks:
        where = f"{page}: block {block['first']!r}"
        assert block["capacity"] >= LAPTOP_LINE, f"{where} holds {block['capacity']} characters a line"
        assert block["overflows"] == (block["longest"] > block["capacity"]), (where, block)
    scrolling = sorted({b["longest"] for _, b in blocks if b["overflows"]})
    assert scrolling and scrolling[0] > LAPTOP_LINE, scrolling
    for page in laid_out:
        assert page["width"] <= page["viewport"], f"{page['page']} scrolls sideways"
        assert all(not t["overflows"] for t in page["tables"]), (page["page"], page["tables"])
        assert page["nav"][:4] == ["Tutorial", "How-to guides", "Reference", "Explanation"], page["nav"]


def test_on_a_phone_only_code_blocks_scroll_sideways(site: Path, tmp_path: Path) -> None:
    """At 390 px the page fits the screen; a long line scrolls inside its own block; the
    links to the previous and next pages show their whole titles (the theme cut those
    with code: "Generation: t")."""
    for page in probe(site, tmp_path, 390, 844):
        assert page["width"] <= page["viewport"] == 390, f"{page['page']} scrolls sideways"
        assert {b["scrolls"] for b in page["blocks"]} <= {"auto", "scroll"}, page["page"]
        assert page["cut"] == [], page["page"]


def test_missing_docs_tools_skip_or_fail_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHMEM_REQUIRE_DOCS", raising=False)
    _require("sphinx", False, "")  # present: nothing happens
    with pytest.raises(pytest.skip.Exception, match="sphinx is not installed"):
        _require("sphinx", True, 'pip install -e ".[docs]"')
    monkeypatch.setenv("TORCHMEM_REQUIRE_DOCS", "1")
    with pytest.raises(pytest.fail.Exception, match="TORCHMEM_REQUIRE_DOCS=1 but sphinx is missing: pip"):
        _require("sphinx", True, 'pip install -e ".[docs]"')
