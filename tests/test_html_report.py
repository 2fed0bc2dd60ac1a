"""``--torchmem-html``: the report's data (downsampling, tensors at the peak, escaping), real
pytest runs that write it (with and without pytest-xdist), and the page in a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import pytest_torchmem as tm
from pytest_torchmem.engine.tracing.devices import device_model
from pytest_torchmem.engine.tracing.devices.cuda.profiles import gpu_profile
from pytest_torchmem.engine.tracing.trace import trace
from pytest_torchmem.engine.figures.units import format_bytes
from pytest_torchmem.plugin.exports.html_page import json_for_script, nice_ticks, render
from pytest_torchmem.plugin.exports.html_report import Downsampler, check_view, display_path, write_report
from pytest_torchmem.plugin.snapshots import Entry, Key
from pytest_torchmem.plugin.judging import Tolerance, judge, stopped

pytest_plugins = ("pytester",)

MiB = 2**20


# -- a small HTML reader (no new dependency) --------------------------------------------


class Node:
    def __init__(self, tag: str, attrs: dict[str, str | None]) -> None:
        self.tag, self.attrs, self.children, self.parts = tag, attrs, [], []

    @property
    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def text(self) -> str:
        return "".join(
            part if isinstance(part, str) else part.text() for part in self.parts
        ).strip()

    def find(self, tag: str | None = None, cls: str | None = None) -> list[Node]:
        found = []
        for child in self.children:
            if (tag is None or child.tag == tag) and (cls is None or cls in child.classes):
                found.append(child)
            found.extend(child.find(tag, cls))
        return found


class Page(HTMLParser):
    VOID: ClassVar = frozenset({"meta", "br", "img", "input", "link", "hr", "col", "wbr"})

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("root", {})
        self.stack = [self.root]
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        self.stack[-1].parts.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        self.stack[-1].parts.append(node)

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].parts.append(data)

    def find(self, tag: str | None = None, cls: str | None = None) -> list[Node]:
        return self.root.find(tag, cls)


def rows(table: Node) -> list[list[str]]:
    return [[cell.text() for cell in row.find("td")] for row in table.find("tr") if row.find("td")]


# -- views made here, from real traces ----------------------------------------------------


class Net(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, width)
        self.fc2 = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)  # FC1-LINE
        return self.fc2(torch.relu(hidden))


def _line(marker: str) -> int:
    source = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(source, 1) if line.rstrip().endswith(f"# {marker}"))


def traced(model: nn.Module, x: torch.Tensor, device: str = "cpu", **options: Any) -> Any:
    return trace(
        model,
        (x,),
        {},
        device=device_model(device),
        loss_fn=options.get("loss_fn"),
        optimizer=options.get("optimizer"),
        train=options.get("train", True),
        gpu=gpu_profile("H100") if device == "cuda" else None,
        record_frames=True,
    )


def view_of(
    step: Any, *, snapshot: Entry | None = None, budgets: dict[str, int] | None = None, **kw: Any
) -> dict[str, Any]:
    entry = Entry.from_report(step.report, {})
    result = judge(
        nodeid=kw.pop("nodeid", "tests/test_x.py::test_x"),
        key=Key("test_x", kw.pop("name", "default"), step.report.device),
        file="tests/__torchmem__/test_x.json",
        accept='pytest --torchmem-update "tests/test_x.py::test_x"',
        estimate=entry,
        snapshot=snapshot,
        tolerance=Tolerance(),
        budgets=budgets or {},
        update=False,
        fail_on_improvement=False,
    )
    return check_view(result, step, root=Path(__file__).parent.parent, **kw)


def totals_of(view: dict[str, Any]) -> list[int]:
    """The chart's total at each point, rebuilt from the per-category changes."""
    series = view["series"]
    count = len(series["x"])
    totals = [0] * count
    for changes in series["values"].values():
        for k, (start, value) in enumerate(changes):
            end = changes[k + 1][0] if k + 1 < len(changes) else count
            for i in range(start, end):
                totals[i] += value
    return totals


# -- downsampling -------------------------------------------------------------------------


def test_a_short_series_comes_out_whole() -> None:
    series = [(0, 10), (1, 30), (2, 20), (3, 50), (4, 40)]
    sampler = Downsampler(span=5, buckets=10)
    for x, total in series:
        sampler.add(x, total, total)
    assert [(x, total) for x, total, _ in sampler.points()] == series


def test_each_bucket_keeps_its_max_min_and_last_and_the_peak_survives() -> None:
    # 1000 states over x 0..999, 10 buckets of 100: a ramp 0..99 in each bucket, with a
    # spike of 500 at x 437 and 499 at x 730 (that bucket's max, not the overall one).
    totals = [x % 100 for x in range(1000)]
    totals[437], totals[730] = 500, 499
    sampler = Downsampler(span=1000, buckets=10)
    for x, total in enumerate(totals):
        sampler.add(x, total, ("state", x))
    points = sampler.points()
    kept = [x for x, _, _ in points]
    assert kept == sorted(kept) and len(points) <= 30
    for bucket in range(10):
        xs = range(bucket * 100, bucket * 100 + 100)
        top = max(xs, key=lambda x: (totals[x], -x))
        low = min(xs, key=lambda x: (totals[x], x))
        assert {top, low, xs[-1]} <= set(kept), bucket
    assert 437 in kept and 730 in kept
    assert max(total for _, total, _ in points) == 500
    assert all(state == ("state", x) for x, _, state in points)


def test_the_first_of_equal_maxima_is_kept_and_forced_states_too() -> None:
    sampler = Downsampler(span=100, buckets=1)
    for x in range(100):
        total = 7 if x in (20, 60) else 1
        sampler.add(x, total, x, keep=(x == 45))
    kept = [x for x, _, _ in sampler.points()]
    assert kept == [0, 20, 45, 99]


def test_several_states_at_one_x_and_bad_buckets() -> None:
    sampler = Downsampler(span=3, buckets=3)
    for x, total in [(0, 1), (1, 5), (1, 2), (2, 3)]:  # a resize: +new then -old at x 1
        sampler.add(x, total, None)
    assert [(x, t) for x, t, _ in sampler.points()] == [(0, 1), (1, 5), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="buckets must be at least 1"):
        Downsampler(span=3, buckets=0)


def test_a_long_trace_is_cut_down_and_its_peak_is_exact() -> None:
    step = traced(Net(), torch.randn(32, 64), optimizer=lambda p: torch.optim.Adam(p))
    full = view_of(step)
    small = view_of(step, buckets=5)
    assert len(small["series"]["x"]) <= 3 * 5 + 2 < len(full["series"]["x"])
    peak = step.report.peak
    for view in (full, small):
        totals = totals_of(view)
        assert max(totals) == peak == view["peak"]["bytes"]
        assert view["series"]["x"][totals.index(peak)] == view["peak"]["x"]


# -- what a view holds ----------------------------------------------------------------------


def test_cpu_view_agrees_with_a_real_run_and_names_the_tensors_at_the_peak() -> None:
    x = torch.randn(32, 64)
    for train in (True, False):
        view = view_of(traced(Net(), x, train=train))
        measured = tm.measure(Net(), x, train=train)
        # The chart's peak is what the CPU allocator really reached, and what was alive then.
        assert view["peak"]["bytes"] == measured.peak
        assert max(totals_of(view)) == measured.peak
        assert view["alive"]["bytes"] == measured.peak
        sizes = [row["bytes"] for row in view["tensors"]]
        assert sizes == sorted(sizes, reverse=True)
        # fc1's weight: 64 * 256 float32 = 64 KiB, live before the step.
        weight = {"bytes": 64 * 256 * 4, "category": "parameters", "phase": "", "where": ""}
        assert any(weight.items() <= row.items() for row in view["tensors"])
    # Forward only, the peak is at fc2's input: fc1's output (32 * 256 * 4 B, still held by
    # ``hidden``) and relu's, both made on the lines of Net.forward.
    assert view["peak"]["phase"] == "forward"
    assert [p["phase"] for p in view["phases"]] == ["forward", "after"]
    fc1_out = [row for row in view["tensors"] if row["module"] == "fc1"]
    assert len(fc1_out) == 1 and fc1_out[0]["bytes"] == 32 * 256 * 4
    assert fc1_out[0]["op"] == "aten.addmm.default" and fc1_out[0]["category"] == "activations"
    assert fc1_out[0]["where"] == f"tests/test_html_report.py:{_line('FC1-LINE')} in forward"
    assert fc1_out[0]["stack"][0] == fc1_out[0]["where"]
    # no snapshot: the figures have no reference, and nothing "moved"
    assert view["status"] == "missing" and view["failed"]
    assert all(row["snapshot"] is None and row["moved"] is None for row in view["figures"])
    assert "no snapshot entry" in view["message"]
    json.dumps(view)  # what an xdist worker sends


def test_backward_tensors_name_their_autograd_node() -> None:
    view = view_of(traced(Net(), torch.randn(32, 64)))
    assert view["peak"]["phase"] == "backward"
    grad = [row for row in view["tensors"] if row["category"] == "gradients"]
    assert grad[0]["bytes"] == 64 * 256 * 4  # fc1.weight.grad, made by addmm's backward
    assert (grad[0]["op"], grad[0]["node"]) == ("aten.mm.default", "AddmmBackward0")


def test_cuda_view_charges_allocator_blocks() -> None:
    step = traced(Net(), torch.randn(32, 64), device="cuda")
    view = view_of(step)
    assert view["peak"]["bytes"] == step.report.peak == max(totals_of(view))
    # The caching allocator hands out multiples of 512 bytes: a 1-float bias costs 512.
    assert all(row["bytes"] % 512 == 0 for row in view["tensors"])
    bias = [row for row in view["tensors"] if row["requested"] == 8 * 4]
    assert bias and bias[0]["bytes"] == 512


def test_regression_view_says_what_moved() -> None:
    before = traced(Net(width=128), torch.randn(32, 64))
    after = traced(Net(width=256), torch.randn(32, 64))
    snapshot = Entry.from_report(before.report, {})
    view = view_of(after, snapshot=snapshot, budgets={"backward": 1})
    assert view["status"] == "over budget" and view["failed"]
    figures = {row["figure"]: row for row in view["figures"]}
    assert figures["forward"]["moved"] == "grew"
    assert figures["forward"]["snapshot"] == before.report.forward_peak
    assert figures["backward"]["over"] and figures["backward"]["budget"] == 1
    # fc1's weight doubled: 64 * 128 * 4 more bytes of parameters.
    breakdown = {row["category"]: row for row in view["breakdown"]}
    grown = breakdown["parameters"]["estimate"] - breakdown["parameters"]["snapshot"]
    assert grown == (64 * 128 + 128 + 128 * 8) * 4
    assert {row["name"] for row in view["modules"]["forward"]} >= {"fc1", "fc2"}
    assert view["change"].startswith("backward over budget by ")


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h[h > 0]  # DATA-DEPENDENT


class Bincount(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bincount(x)  # BINCOUNT


def test_ops_not_traced_faithfully_are_listed_where_they_were_called() -> None:
    # an input over the trace's value limit (32,768 elements): the mask's values are unknown
    view = view_of(traced(DataDependent(), torch.randn(4100, 8)))
    where = f"tests/test_html_report.py:{_line('DATA-DEPENDENT')}"
    assert {row["op"]: row["location"] for row in view["unsupported"]} == {
        "aten.index.Tensor": where
    }
    assert (view["approximate"], view["stopped"]) == (True, False)
    page = Page(render([view], {}))
    warning = page.find("div", "warning")[0].text()
    assert warning.startswith("Approximate: the trace went on past these ops")
    assert "aten.index.Tensor at " + where in warning
    assert [badge.text() for badge in page.find("section")[0].find("span", "badge")] == ["missing", "approximate"]
    # An op run on its known values (its kernel's buffers not modelled, on cuda): listed,
    # approximate.
    listed = view_of(traced(Bincount(), torch.tensor([1, 2, 3]), "cuda", train=False))
    assert [row["op"] for row in listed["unsupported"]] == ["aten.bincount.default"]
    assert listed["approximate"]
    # A complete trace is not marked.
    complete = view_of(traced(Net(), torch.randn(4, 64)))
    assert (complete["approximate"], complete["stopped"]) == (False, False)
    assert not Page(render([complete], {})).find("span", "s-approximate")


def test_a_stopped_check_shows_where_it_stopped_and_the_part_that_ran() -> None:
    """The view of a check whose trace stopped: its status, pytest's message, the ops with
    the one that stopped it last, and the chart of the part of the step that ran, read
    from the trace the error carries (an input above the value limit: bincount's output
    size is unknown)."""
    with pytest.raises(tm.TraceStopped) as info:
        traced(Bincount(), torch.randint(0, 4, (40_000,)), train=False)
    stop = info.value
    result = stopped(
        nodeid="tests/test_x.py::test_x",
        key=Key("test_x", "default", "cpu"),
        file="tests/__torchmem__/test_x.json",
        accept='pytest --torchmem-update "tests/test_x.py::test_x"',
        partial=Entry.from_report(stop.report, {}),
        snapshot=None,
        tolerance=Tolerance(),
        budgets={},
        update=False,
        why=str(stop),
    )
    view = check_view(result, stop.trace, root=Path(__file__).parent.parent)
    assert (view["status"], view["failed"], view["stopped"], view["approximate"]) == ("stopped", True, True, False)
    assert view["message"].splitlines()[1] == f"cpu: {stop}"
    assert [row["op"] for row in view["unsupported"]] == ["aten.bincount.default"]
    assert view["unsupported"][0]["location"] == f"tests/test_html_report.py:{_line('BINCOUNT')}"
    page = Page(render([view], {}))
    assert page.find("div", "warning")[0].text().startswith("The trace stopped: at the last of these ops")
    assert [badge.text() for badge in page.find("section")[0].find("span", "badge")] == ["stopped"]
    assert page.find("path", "area")  # the chart of the part that ran


def test_display_path() -> None:
    root = Path(__file__).parent.parent
    assert display_path(__file__, root) == "tests/test_html_report.py"
    # a library's file: from its site-packages folder, even in a virtualenv inside the root
    assert display_path(torch.__file__, root) == "torch/__init__.py"
    assert display_path("/nowhere/x.py", root) == "/nowhere/x.py"


# -- the page ---------------------------------------------------------------------------------


EVIL = "test_x.py::test_a[</script><script>alert(1)</script>&\"'<b>]"


def test_user_text_is_escaped_in_html_and_in_the_chart_data() -> None:
    step = traced(Net(), torch.randn(4, 64))
    view = view_of(step, nodeid=EVIL, name="<i>check</i>")
    view["tensors"][0]["module"] = "blocks.<img src=x onerror=alert(1)>"
    view["series"]["labels"][0] = "</script><!-- & \u2028"
    text = render([view], {"torch": "<2.13>"})
    assert "<script>alert(1)" not in text and "<img src=x" not in text
    assert "<i>check</i>" not in text and "<2.13>" not in text
    page = Page(text)
    assert page.find("h2")[0].text() == f"{EVIL} [<i>check</i>]"
    assert page.find("table", "index")[0].find("a")[0].text().startswith(EVIL)
    modules = [row[4] for row in rows(page.find("table", "tensors")[0])]
    assert "blocks.<img src=x onerror=alert(1)>" in modules
    # The chart's data is still the same JSON once the browser has read it.
    scripts = page.find("script", "chart-data")
    assert len(scripts) == 1
    data = json.loads(scripts[0].text())
    assert data["labels"][0] == "</script><!-- & \u2028"
    assert json.loads(json_for_script({"a": "</script>&"})) == {"a": "</script>&"}
    assert "<" not in json_for_script({"a": "</script>"})


def test_nice_ticks() -> None:
    ticks, top = nice_ticks(70 * MiB)  # 70 MiB / 4 = 17.5 MiB a step: 20 MiB
    assert ticks == [0, 20 * MiB, 40 * MiB, 60 * MiB, 80 * MiB] and top == 80 * MiB
    ticks, top = nice_ticks(900)
    assert ticks == [0, 250, 500, 750, 1000] and top == 1000
    assert nice_ticks(0) == ([0.0, 1.0], 1.0)


def test_no_checks_is_a_page_that_says_so_and_the_write_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "out" / "report.html"
    write_report(path, [], environment={"torch": torch.__version__})
    page = Page(path.read_text())
    assert "No memory checks ran" in page.find("p", "empty")[0].text()
    assert not page.find("section")
    path.write_text("old")
    write_report(path, [], environment={})
    assert path.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.html"]  # no temporary left


# -- real pytest runs ------------------------------------------------------------------------


BODY = """
import os
import pytest
import torch
from torch import nn

WIDTH = int(os.environ.get("TM_WIDTH", "16"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, WIDTH)
        self.fc2 = nn.Linear(WIDTH, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))  # FORWARD


def test_steady(torchmem):
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))


def test_grows(torchmem):
    torchmem.check(Net(), torch.randn(4, 32), train=False)


def test_new(torchmem):
    if os.environ.get("TM_NEW") != "1":
        pytest.skip("written later")
    torchmem.check(nn.Linear(8, 4), torch.randn(2, 8))
"""


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    # pytester's in-process runs forget the modules imported inside them: import once here.
    tm.estimate(nn.Linear(2, 2), torch.randn(1, 2))


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")
    monkeypatch.delenv("TM_WIDTH", raising=False)
    monkeypatch.delenv("TM_NEW", raising=False)
    pytester.makepyfile(test_m=BODY)
    assert pytester.runpytest("--torchmem-update", "--torchmem-devices=cpu").ret == 0
    monkeypatch.setenv("TM_WIDTH", "64")
    monkeypatch.setenv("TM_NEW", "1")
    return pytester


@pytest.mark.parametrize("xdist", [False, True], ids=["no-xdist", "xdist"])
def test_report_of_a_run_with_passing_regressing_and_missing_checks(
    project: pytest.Pytester, xdist: bool
) -> None:
    args = ["--torchmem-devices=cpu", "--torchmem-html", "out/report.html"]
    if xdist:
        result = project.runpytest_subprocess("-n", "2", "-p", "no:randomly", *args)
    else:
        result = project.runpytest(*args)
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["wrote out/report.html"])
    text = (project.path / "out" / "report.html").read_text(encoding="utf-8")
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in text
    page = Page(text)

    # The index: failing checks first, with their figures.
    index = rows(page.find("table", "index")[0])
    assert [(r[0], r[1], r[2]) for r in index] == [
        ("regressed", "test_m.py::test_grows", "cpu"),
        ("missing", "test_m.py::test_new", "cpu"),
        ("passed", "test_m.py::test_steady", "cpu"),
    ]
    # Linear(8, 4) on a (2, 8) input, as the CPU allocator really sees it.
    steady = tm.measure(nn.Linear(8, 4), torch.randn(2, 8))
    assert index[2][3:7] == [
        format_bytes(steady.forward_peak),
        format_bytes(steady.backward_peak),
        format_bytes(0),
        format_bytes(steady.peak),
    ]
    assert index[2][7] == "0 B" and index[1][7] == "-"
    links = [a.attrs["href"] for a in page.find("table", "index")[0].find("a")]
    sections = page.find("section")
    assert links == [f"#{section.attrs['id']}" for section in sections]
    assert [s.attrs["data-status"] for s in sections] == ["regressed", "missing", "passed"]
    assert [("failed" in s.classes) for s in sections] == [True, True, False]

    # Every section: a chart with an area per category, the peak marked, the tensors.
    for section, row in zip(sections, index):
        assert section.find("svg", "chart")
        assert section.find("path", "area")
        label = section.find("text", "peak-label")[0].text()
        assert re.fullmatch(r"peak .+ \u00b7 (forward|backward)", label)
        assert label.split(" \u00b7 ")[0] == f"peak {row[6]}"
        assert section.find("table", "tensors")
        bands = [t.text() for t in section.find("text", "band-label")]
        assert bands[0] in ("forward", "fwd")

    grows, new, steady_section = sections
    message = grows.find("pre", "message")[0].text()
    assert "cpu forward peak grew" in message
    assert 'accept the change with: pytest --torchmem-update "test_m.py::test_grows"' in message
    # forward only, the peak is in forward, where relu's output is alive
    assert "forward" in grows.find("text", "peak-label")[0].text()
    figures = {r[0]: r for r in rows(grows.find("table", "figures")[0])}
    assert figures["forward peak"][-1] == "\u25b2 grew"
    assert figures["forward peak"][3].startswith("+")
    # fc1 grew from 32x16 to 32x64 weights: the parameters moved by (32*48 + 48 + 48*8) * 4 B.
    breakdown = {r[0]: r for r in rows(grows.find("table", "breakdown")[0])}
    assert breakdown["parameters"][3].startswith(f"+{format_bytes((32 * 48 + 48 + 48 * 8) * 4)}")
    assert grows.find("line", "ref-snapshot")
    wheres = [r[6] for r in rows(grows.find("table", "tensors")[0])]
    source = (project.path / "test_m.py").read_text().splitlines()
    line = next(n for n, text in enumerate(source, 1) if text.endswith("# FORWARD"))
    assert f"test_m.py:{line} in forward" in wheres

    assert "cpu: no snapshot entry" in new.find("pre", "message")[0].text()
    assert not steady_section.find("pre", "message")
    assert torch.__version__ in page.find("p", "env")[0].text()


def test_a_run_without_checks_writes_a_page_that_says_so(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:hypothesispytest -p no:cacheprovider")
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    pytester.makeini("[pytest]\ntorchmem_html = reports/memory.html\n")  # the ini twin
    assert pytester.runpytest().ret == 0
    page = Page((pytester.path / "reports" / "memory.html").read_text())
    assert "No memory checks ran" in page.find("p", "empty")[0].text()


# -- in a real browser ---------------------------------------------------------------------


def chromium() -> str:
    """Debian's chromium; skips without it, unless ``TORCHMEM_REQUIRE_CHROMIUM=1`` (CI)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("TORCHMEM_REQUIRE_CHROMIUM") == "1":
        pytest.fail(
            "TORCHMEM_REQUIRE_CHROMIUM=1 but no chromium on PATH: install it "
            "(apt-get install chromium) or unset the variable to skip the browser tests"
        )
    pytest.skip("chromium is not installed (apt-get install chromium); the page is not rendered")


def browse(page: Path, tmp_path: Path, *args: str) -> tuple[str, str]:
    """Open ``page`` in headless chromium; return its stdout (e.g. the DOM) and its log."""
    command = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        *args,
        page.as_uri(),
    ]
    # a bound for a hang, not for a loaded machine's slowness
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line and "Uncaught" in line]


@pytest.fixture(scope="module")
def views() -> list[dict[str, Any]]:
    x = torch.randn(32, 64)
    before = traced(Net(width=128), x)
    snapshot = Entry.from_report(before.report, {})
    adam = {"optimizer": lambda p: torch.optim.Adam(p)}
    return [
        view_of(traced(Net(), x, **adam), snapshot=snapshot, name="train"),
        view_of(traced(Net(), x, device="cuda", **adam), name="train"),
        view_of(before, snapshot=snapshot, nodeid=EVIL),
    ]


def test_the_page_runs_in_a_browser(views: list[dict[str, Any]], tmp_path: Path) -> None:
    chromium()
    path = tmp_path / "report.html"
    write_report(path, views, environment={"torch": torch.__version__})
    dom, log = browse(path, tmp_path, "--dump-dom")
    assert console_errors(log) == []
    page = Page(dom)
    html = page.find("html")[0]
    assert html.attrs["data-torchmem"] == "ready"
    error = [n for n in page.find("div", "js-error")]
    assert error and "hidden" in error[0].attrs and error[0].text() == ""
    figures = page.find("figure", "chart")
    assert len(figures) == 3
    for figure, view in zip(figures, views_in_page_order(views)):
        # the script read each chart's data and added its hover cursor
        assert figure.attrs["data-ready"] == str(len(chart_points(figure)))
        assert len(figure.find("line", "cursor")) == 1
        assert len(figure.find("path", "area")) == len(chart_categories(figure))
    assert page.find("h2")[-1].text() == EVIL  # the hostile test id is text, not markup


def views_in_page_order(views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from pytest_torchmem.plugin.exports.html_report import order

    return list(order(views))


def chart_points(figure: Node) -> list[int]:
    return json.loads(figure.find("script", "chart-data")[0].text())["x"]


def chart_categories(figure: Node) -> list[str]:
    return json.loads(figure.find("script", "chart-data")[0].text())["cats"]


HOVER = """<script>
(function () {
  var figure = document.querySelectorAll("figure.chart")[%d];
  var dot = figure.querySelector(".peak-dot").getBoundingClientRect();
  var svg = figure.querySelector("svg");
  // Mouse events land on whole pixels: one pixel right of the dot's centre (the peak's step
  // is several pixels wide in these charts).
  svg.dispatchEvent(new MouseEvent("mousemove", {
    clientX: Math.ceil(dot.left + dot.width / 2) + 1, clientY: dot.top + dot.height / 2,
    bubbles: true}));
})();
</script></body>"""


def test_hovering_the_peak_reads_out_its_bytes_by_category(
    views: list[dict[str, Any]], tmp_path: Path
) -> None:
    chromium()
    ordered = views_in_page_order(views)
    path = tmp_path / "report.html"
    write_report(path, views, environment={})
    text = path.read_text()
    for n in (0, 1):
        path.write_text(text.replace("</body>", HOVER % n))
        dom, log = browse(path, tmp_path, "--dump-dom")
        assert console_errors(log) == []
        figure = Page(dom).find("figure", "chart")[n]
        tip = figure.find("div", "tip")[0]
        assert "display: block" in tip.attrs.get("style", "")
        readout = {r[0]: r[1] for r in rows(tip)}
        view = ordered[n]
        assert readout["total"] == format_bytes(view["peak"]["bytes"])
        at_peak = {
            row["category"].replace("_", " "): format_bytes(row["estimate"])
            for row in view["breakdown"]
            if row["estimate"]
        }
        assert {k: v for k, v in readout.items() if k != "total"} == at_peak
        phase = {"step": "optimizer step"}.get(view["peak"]["phase"], view["peak"]["phase"])
        if view["peak"]["first_step"]:  # the peak of a training loop's first step
            phase = f"first {phase}"
        assert tip.find("div", "head")[0].text() == f"{phase} \u00b7 event {view['peak']['x'] - 1}"


def test_a_script_error_shows_on_the_page(views: list[dict[str, Any]], tmp_path: Path) -> None:
    """The error marker the other browser tests look for does appear when the script fails."""
    chromium()
    path = tmp_path / "report.html"
    write_report(path, views[:1], environment={})
    text = path.read_text()
    broken = re.sub(r'(<script type="application/json" class="chart-data">)\{', r"\1{]", text)
    path.write_text(broken)
    dom, _ = browse(path, tmp_path, "--dump-dom")
    page = Page(dom)
    assert page.find("html")[0].attrs["data-torchmem"] == "error"
    error = page.find("div", "js-error")[0]
    assert "hidden" not in error.attrs and "script failed" in error.text()


def test_screenshot(views: list[dict[str, Any]], tmp_path: Path) -> None:
    chromium()
    path = tmp_path / "report.html"
    write_report(path, views, environment={"torch": torch.__version__})
    shot = tmp_path / "report.png"
    browse(path, tmp_path, f"--screenshot={shot}", "--window-size=1400,2000")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 2000)
    # A blank page of that size compresses to a few KiB; charts and tables do not.
    assert len(data) > 60_000
    keep = os.environ.get("TORCHMEM_SCREENSHOT")
    if keep:  # to look at it: TORCHMEM_SCREENSHOT=/tmp/report.png pytest -k screenshot
        shutil.copyfile(shot, keep)


def test_missing_chromium_skips_or_fails_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("TORCHMEM_REQUIRE_CHROMIUM", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium is not installed"):
        chromium()
    monkeypatch.setenv("TORCHMEM_REQUIRE_CHROMIUM", "1")
    with pytest.raises(pytest.fail.Exception, match="TORCHMEM_REQUIRE_CHROMIUM=1"):
        chromium()
