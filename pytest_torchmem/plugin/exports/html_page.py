"""The HTML report's page: views of checks (:func:`~pytest_torchmem.plugin.exports.html_report.check_view`)
become one self-contained HTML document.

Everything is inline: the CSS, the charts (SVG drawn here, readable without
script) and a small script that adds the hover read-out to each chart. No
font, style sheet or script comes from the network. Every text that comes
from the user's code (test ids, module names, file names, messages) is
escaped; the data each chart's script reads is JSON with ``<``, ``>`` and
``&`` written as ``\\u`` escapes, so that it cannot close its element.
"""

from __future__ import annotations

import datetime as _datetime
import html
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pytest_torchmem.engine.figures.report import Category
from pytest_torchmem.engine.figures.modelled_device import is_cuda
from pytest_torchmem.engine.figures.units import format_bytes, format_delta

__all__ = ["COLORS", "escape", "json_for_script", "nice_ticks", "render"]

#: One colour per category (Tableau 10), fixed so that charts compare at a glance.
COLORS: Final = {
    Category.PARAMETERS.value: "#4e79a7",
    Category.BUFFERS.value: "#76b7b2",
    Category.INPUTS.value: "#59a14f",
    Category.GRADIENTS.value: "#f28e2b",
    Category.OPTIMIZER_STATE.value: "#b07aa1",
    Category.ACTIVATIONS.value: "#e15759",
    Category.TEMPORARIES.value: "#edc948",
    Category.WORKSPACE.value: "#9c755f",
}
_PHASE_LABELS: Final = {
    "forward": ("forward", "fwd"),
    "backward": ("backward", "bwd"),
    "step": ("optimizer step", "step"),
    "after": ("end of step", "end"),
}
_FIGURE_LABELS: Final = {
    "forward": "forward peak",
    "backward": "backward peak",
    "step": "step peak",
    "first_step": "first-step peak",
    "peak": "peak",
    "reserved": "reserved peak",
}
# The chart's box, in SVG units: the plot spans [_LEFT, _RIGHT] x [_TOP, _BOTTOM].
_WIDTH: Final = 1000
_HEIGHT: Final = 330
_LEFT: Final = 72
_RIGHT: Final = 988
_TOP: Final = 30
_BOTTOM: Final = 298
#: Budgets further above the data than this factor are not drawn (they would flatten it).
_BUDGET_REACH: Final = 2.0
_DOT: Final = " \u00b7 "
_STATUS_ORDER: Final = (
    "stopped",
    "regressed",
    "over budget",
    "mismatch",
    "missing",
    "improved",
    "stale",
    "new",
    "updated",
    "passed",
)


def escape(value: Any) -> str:
    """``value`` as HTML text or attribute value (quotes escaped too)."""
    return html.escape(str(value), quote=True)


def json_for_script(data: Any) -> str:
    """``data`` as JSON that is safe inside ``<script type="application/json">``."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _num(value: float) -> str:
    """An SVG coordinate: one decimal, no trailing zero."""
    text = f"{value:.1f}"
    return text.removesuffix(".0")


def _tenths(value: int) -> str:
    """A length in tenths of a unit, as SVG path data writes it shortest (``.7``, ``-12.3``)."""
    sign = "-" if value < 0 else ""
    whole, tenth = divmod(abs(value), 10)
    if not tenth:
        return f"{sign}{whole}"
    return f"{sign}{whole or ''}.{tenth}"


def _step_path(xs: Sequence[float], ys: Sequence[float], right: float, base: float) -> str:
    """The area under a step function that holds ``ys[i]`` from ``xs[i]`` to the next point
    and the last value to ``right``, down to ``base``.

    Coordinates are rounded to tenths, then written as relative moves between the
    rounded points (so no rounding error adds up): about half the size of absolute ones.
    """
    if not xs:
        return ""
    px, py = round(xs[0] * 10), round(base * 10)
    commands = [f"M{_tenths(px)} {_tenths(py)}"]
    for x, y in zip(xs, ys):
        nx, ny = round(x * 10), round(y * 10)
        if nx != px:
            commands.append(f"h{_tenths(nx - px)}")
        if ny != py:
            commands.append(f"v{_tenths(ny - py)}")
        px, py = nx, ny
    commands.append(f"H{_tenths(round(right * 10))}V{_tenths(round(base * 10))}Z")
    return "".join(commands)


def _compact(nbytes: float) -> str:
    """An axis label: ``0``, ``512 B``, ``1.5 MiB``, ``20 MiB``."""
    if nbytes == 0:
        return "0"
    for unit, factor in (
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if nbytes >= factor:
            return f"{nbytes / factor:.3g} {unit}"
    return f"{nbytes:.3g} B"


def nice_ticks(top: float, count: int = 4) -> tuple[list[float], float]:
    """Ticks from 0 that cover ``top`` in about ``count`` steps of 1, 2, 2.5 or 5 times a
    power of ten of a binary unit; returns the ticks and the axis maximum (the last tick)."""
    if top <= 0:
        return [0.0, 1.0], 1.0
    unit = 1
    for factor in (2**40, 2**30, 2**20, 2**10):
        if top >= factor:
            unit = factor
            break
    raw = top / unit / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    if unit == 1:
        step = max(step, 1)
    steps = math.ceil(top / unit / step - 1e-9)
    ticks = [i * step * unit for i in range(steps + 1)]
    return ticks, ticks[-1]


def _badge(status: str, failed: bool) -> str:
    text = status + (" (failed)" if failed and status in ("improved", "stale") else "")
    return f'<span class="badge s-{status.replace(" ", "-")}">{escape(text)}</span>'


def _check_label(view: Mapping[str, Any]) -> str:
    name = (
        "" if view["name"] == "default" else f' <span class="muted">[{escape(view["name"])}]</span>'
    )
    return f"{escape(view['nodeid'])}{name}"


def _device_label(view: Mapping[str, Any]) -> str:
    env = view.get("environment", {})
    if is_cuda(view["device"]) and env.get("gpu"):
        return f"{view['device']} ({env['gpu']})"
    if env.get("cpu"):
        return f"{view['device']} ({env['cpu']})"
    if env.get("cpu_threads"):  # recorded before CPU profiles
        return f"{view['device']} ({env['cpu_threads']} threads, {env.get('cpu_isa', '?')})"
    return str(view["device"])


def _delta(new: int | None, old: int | None) -> str:
    if new is None or old is None:
        return ""
    if new == old:
        return '<span class="muted">0 B</span>'
    kind = "up" if new > old else "down"
    return f'<span class="{kind}">{escape(format_delta(new, old))}</span>'


def _bytes(value: int | None) -> str:
    return '<span class="muted">-</span>' if value is None else escape(format_bytes(value))


def _swatch(category: str) -> str:
    return f'<span class="sw" style="background:{COLORS.get(category, "#999")}"></span>'


# -- the chart ------------------------------------------------------------------------


def _stack(view: Mapping[str, Any], count: int) -> tuple[list[str], list[list[int]]]:
    """The categories drawn (stack order, bottom first) and their values at the first
    ``count`` points."""
    values = view["series"]["values"]
    names = [c.value for c in Category if c.value in values]
    columns = []
    for name in names:
        column = [0] * count
        changes = [change for change in values[name] if change[0] < count]
        for k, (start, value) in enumerate(changes):
            end = changes[k + 1][0] if k + 1 < len(changes) else count
            column[start:end] = [value] * (end - start)
        columns.append(column)
    return names, columns


class _Axis:
    """The chart's x axis: each phase gets a width that grows with the square root of its
    events, so that a long optimizer step does not squeeze forward and backward; within a
    phase, events are evenly spaced."""

    def __init__(self, view: Mapping[str, Any], left: float, right: float) -> None:
        peak_x = view["peak"]["x"]
        # The chart stops where the step ends: the frees after it count in no figure.
        phases = [
            phase
            for phase in view["phases"]
            if phase["end"] > phase["start"]
            and (phase["phase"] != "after" or phase["start"] < peak_x)
        ]
        bounds = [(phase["start"], phase["end"]) for phase in phases]
        if not bounds:
            bounds = [(0, max(view["series"]["span"] - 1, 1))]
        else:  # the state before the step shares the first phase's part
            bounds[0] = (0, bounds[0][1])
        weights = [math.sqrt(end - start) for start, end in bounds]
        scale = (right - left) / sum(weights)
        self.phases = phases
        self.segments: list[tuple[int, int, float, float]] = []
        position = left
        for (start, end), weight in zip(bounds, weights):
            self.segments.append((start, end, position, position + weight * scale))
            position += weight * scale
        self.end = bounds[-1][1]
        self.uneven = len(bounds) > 1

    def __call__(self, x: float) -> float:
        for start, end, p0, p1 in self.segments:
            if x < end:
                return p0 + (p1 - p0) * max(x - start, 0) / (end - start)
        return self.segments[-1][3]


def _phase_label(phase: Mapping[str, Any]) -> tuple[str, str]:
    """A phase's label and its short form: ``"first forward"`` in a training loop's
    first step."""
    label, short = _PHASE_LABELS.get(phase["phase"], (phase["phase"], ""))
    if phase.get("first_step"):
        return f"first {label}", f"1st {short}" if short else ""
    return label, short


def _chart(view: Mapping[str, Any], index: int) -> str:
    series = view["series"]
    sx = _Axis(view, _LEFT, _RIGHT)
    xs: list[int] = [x for x in series["x"] if x <= sx.end]
    names, columns = _stack(view, len(xs))
    totals = [sum(values) for values in zip(*columns)] if columns else [0] * len(xs)
    data_max = max([view["peak"]["bytes"], *totals, 1])

    references: list[tuple[str, int, int, int, str]] = []  # kind, value, x0, x1, title
    # the loop's figures are its later steps' phases, the first step's its own phases
    spans = {
        phase["phase"]: (phase["start"], phase["end"])
        for phase in sx.phases
        if not phase.get("first_step")
    }
    first = [phase for phase in sx.phases if phase.get("first_step")]
    if first:
        spans["first_step"] = (first[0]["start"], first[-1]["end"])
    budgets_off: list[str] = []
    for row in view["figures"]:
        figure = row["figure"]
        where = (0, sx.end) if figure == "peak" else spans.get(figure)
        if where is None:
            continue
        if row["snapshot"] is not None and figure != "peak":
            title = f"snapshot {_FIGURE_LABELS[figure]}: {format_bytes(row['snapshot'])}"
            references.append(("snapshot", row["snapshot"], *where, title))
        if row["budget"] is not None:
            title = f"budget {_FIGURE_LABELS[figure]}: {format_bytes(row['budget'])}"
            if row["budget"] <= _BUDGET_REACH * data_max:
                references.append(("budget", row["budget"], *where, title))
            else:
                budgets_off.append(title)
    top = max([data_max, *(value for _, value, *_ in references)])
    ticks, y_max = nice_ticks(top * 1.1)

    def sy(value: float) -> float:
        return _BOTTOM - (_BOTTOM - _TOP) * value / y_max

    parts = [
        f'<svg class="chart" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" aria-label="live '
        + 'memory by category across the step">'
    ]
    # phase bands, labelled above the plot
    parts.append('<g class="bands">')
    for phase in sx.phases:
        x0, x1 = sx(phase["start"]), sx(phase["end"])
        label, short = _phase_label(phase)
        parts.append(
            f'<rect class="band band-{escape(phase["phase"])}" x="{_num(x0)}" y="{_TOP}" '
            f'width="{_num(x1 - x0)}" height="{_BOTTOM - _TOP}"/>'
        )
        if x0 > _LEFT:
            parts.append(
                f'<line class="boundary" x1="{_num(x0)}" x2="{_num(x0)}" y1="{_TOP - 16}" '
                f'y2="{_BOTTOM}"/>'
            )
        text = label if x1 - x0 >= 7 * len(label) + 8 else short if x1 - x0 >= 34 else ""
        if text:
            parts.append(
                f'<text class="band-label" x="{_num((x0 + x1) / 2)}" y="{_TOP - 7}">'
                f"{escape(text)}</text>"
            )
    parts.append("</g>")
    # the grid and the y axis
    parts.append('<g class="grid">')
    for tick in ticks:
        y = _num(sy(tick))
        parts.append(f'<line x1="{_LEFT}" x2="{_RIGHT}" y1="{y}" y2="{y}"/>')
        parts.append(f'<text class="tick" x="{_LEFT - 8}" y="{y}" dy="4">{_compact(tick)}</text>')
    parts.append("</g>")
    # the stacked areas, top category first so that each lower one paints over it
    parts.append('<g class="areas">')
    cumulative = [0] * len(xs)
    tops: list[list[int]] = []
    for values in columns:
        cumulative = [a + b for a, b in zip(cumulative, values)]
        tops.append(cumulative)
    px = [sx(x) for x in xs]
    for name, layer in reversed(list(zip(names, tops))):
        path = _step_path(px, [sy(value) for value in layer], sx(sx.end), sy(0))
        parts.append(
            f'<path class="area" data-category="{name}" fill="{COLORS[name]}" d="{path}"/>'
        )
    parts.append("</g>")
    # snapshot and budget lines
    if references:
        parts.append('<g class="references">')
        for kind, value, x0, x1, title in references:
            y = _num(sy(value))
            parts.append(
                f'<line class="ref-{kind}" x1="{_num(sx(x0))}" x2="{_num(sx(x1))}" '
                f'y1="{y}" y2="{y}"><title>{escape(title)}</title></line>'
            )
            if kind == "budget":
                parts.append(
                    f'<text class="budget-label" x="{_num(sx(x1) - 6)}" y="{_num(sy(value) - 5)}"'
                    f' text-anchor="end">{escape(title)}</text>'
                )
        parts.append("</g>")
    # the peak
    peak = view["peak"]
    peak_px, peak_py = sx(peak["x"]), sy(peak["bytes"])
    phase = _phase_label(peak)[0] if peak["phase"] else ""
    label = f"peak {format_bytes(peak['bytes'])}" + (f" \u00b7 {phase}" if phase else "")
    right = peak_px > (_LEFT + _RIGHT) / 2
    parts.append(
        '<g class="peak">'
        f'<line class="peak-line" x1="{_num(peak_px)}" x2="{_num(peak_px)}" y1="{_TOP}" '
        f'y2="{_BOTTOM}"/>'
        f'<circle class="peak-dot" cx="{_num(peak_px)}" cy="{_num(peak_py)}" r="4.5"/>'
        f'<text class="peak-label" x="{_num(peak_px + (-9 if right else 9))}" '
        f'y="{_num(max(peak_py - 9, _TOP + 13))}" text-anchor="{"end" if right else "start"}">'
        f"{escape(label)}</text></g>"
    )
    parts.append(
        f'<text class="axis" x="{_LEFT}" y="{_BOTTOM + 18}">start of the step</text>'
        f'<text class="axis" x="{(_LEFT + _RIGHT) / 2}" y="{_BOTTOM + 18}" '
        'text-anchor="middle">trace events in order (ops, frees, module calls) \u2192</text>'
        f'<text class="axis" x="{_RIGHT}" y="{_BOTTOM + 18}" text-anchor="end">'
        f"{max(sx.end - 1, 0)} events</text>"
    )
    parts.append(
        f'<rect class="hit" x="{_LEFT}" y="{_TOP}" width="{_RIGHT - _LEFT}" '
        f'height="{_BOTTOM - _TOP}"/></svg>'
    )
    data = {
        "x": xs,
        "segments": [[a, b, round(p0, 2), round(p1, 2)] for a, b, p0, p1 in sx.segments],
        "box": [_LEFT, _TOP, _RIGHT, _BOTTOM],
        "cats": names,
        "colors": [COLORS[name] for name in names],
        "values": {
            name: [change for change in series["values"][name] if change[0] < len(xs)]
            for name in names
        },
        "labels": series["labels"],
        "label": series["label"][: len(xs)],
        "phases": sx.phases,
    }
    legend = [f"<li>{_swatch(name)}{escape(name.replace('_', ' '))}</li>" for name in names]
    kinds = {kind for kind, *_ in references}
    if "snapshot" in kinds:
        legend.append('<li><span class="key key-snapshot"></span>snapshot phase peak</li>')
    if "budget" in kinds:
        legend.append('<li><span class="key key-budget"></span>budget</li>')
    legend.append('<li><span class="key key-peak"></span>peak</li>')
    notes = []
    if sx.uneven:
        notes.append("each phase is drawn wider the more events it has (by their square root)")
    if series["kept"] < series["changes"] + 1:
        notes.append(
            f"{series['kept']} of {series['changes']} changes of the live bytes drawn: each of "
            f"{series['buckets']} slices of the step keeps its highest and lowest total and its "
            "last, and the peak is exact"
        )
    notes.extend(f"{title} is above the chart" for title in budgets_off)
    if view.get("adjusted"):
        notes.append(
            "a pytest_torchmem_adjust_report hook changed this check's figures: the chart "
            "shows the trace before the change"
        )
    note = ""
    if notes:
        text = "; ".join(notes)
        note = f'<figcaption class="muted">{escape(text[0].upper() + text[1:])}.</figcaption>'
    return (
        f'<figure class="chart" id="chart-{index}">{"".join(parts)}'
        f'<script type="application/json" class="chart-data">{json_for_script(data)}</script>'
        f'<ul class="legend">{"".join(legend)}</ul>{note}</figure>'
    )


# -- the tables -----------------------------------------------------------------------


def _figures_table(view: Mapping[str, Any]) -> str:
    rows = view["figures"]
    measured = any(row["measured"] is not None for row in rows)
    budgets = any(row["budget"] is not None for row in rows)
    head = ["figure", "estimate", "snapshot", "change", "allowed"]
    head += ["budget"] if budgets else []
    head += ["GPU measured"] if measured else []
    head.append("")
    out = ['<table class="figures"><thead><tr>']
    out += [f'<th class="{"" if i == 0 or not h else "num"}">{h}</th>' for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for row in rows:
        verdict, cls = "", ""
        if row["over"] or row["measured_over"]:
            verdict, cls = "over budget", "bad"
        elif row["moved"] == "grew":
            verdict, cls = "\u25b2 grew", "bad"
        elif row["moved"] == "shrank":
            verdict, cls = "\u25bc shrank", "good"
        allowed = "" if row["allowed"] is None else f"\u00b1{format_bytes(row['allowed'])}"
        cells = [
            f"<td>{_FIGURE_LABELS.get(row['figure'], escape(row['figure']))}</td>",
            f'<td class="num strong">{_bytes(row["estimate"])}</td>',
            f'<td class="num">{_bytes(row["snapshot"])}</td>',
            f'<td class="num">{_delta(row["estimate"], row["snapshot"])}</td>',
            f'<td class="num muted">{escape(allowed)}</td>',
        ]
        if budgets:
            cells.append(
                f'<td class="num">{"" if row["budget"] is None else _bytes(row["budget"])}</td>'
            )
        if measured:
            cells.append(
                f'<td class="num">{"" if row["measured"] is None else _bytes(row["measured"])}</td>'
            )
        cells.append(f'<td class="verdict {cls}">{escape(verdict)}</td>')
        out.append(f'<tr class="{cls}">{"".join(cells)}</tr>')
    out.append("</tbody></table>")
    return "".join(out)


def _breakdown_table(view: Mapping[str, Any]) -> str:
    rows = view["breakdown"]
    snapshot = any(row["snapshot"] is not None for row in rows)
    moved = sorted(
        (row for row in rows if snapshot and row["snapshot"] is not None),
        key=lambda row: -abs(row["estimate"] - row["snapshot"]),
    )
    most = {row["category"] for row in moved[:3] if row["estimate"] != row["snapshot"]}
    out = [
        '<table class="breakdown"><thead><tr><th>category</th><th class="num">estimate</th>'
        + ('<th class="num">snapshot</th><th class="num">change</th>' if snapshot else "")
        + "</tr></thead><tbody>"
    ]
    for row in rows:
        if not row["estimate"] and not row["snapshot"]:
            continue
        cls = ' class="moved"' if row["category"] in most else ""
        cells = [
            f"<td>{_swatch(row['category'])}{escape(row['category'].replace('_', ' '))}</td>",
            f'<td class="num">{_bytes(row["estimate"])}</td>',
        ]
        if snapshot:
            cells.append(f'<td class="num">{_bytes(row["snapshot"])}</td>')
            cells.append(f'<td class="num">{_delta(row["estimate"], row["snapshot"])}</td>')
        out.append(f"<tr{cls}>{''.join(cells)}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _modules_tables(view: Mapping[str, Any]) -> str:
    modules = view.get("modules") or {}
    if not any(modules.values()):
        return ""
    head = (
        '<h3>Modules that moved most</h3><p class="muted small">Peak live bytes on the device '
        "while each module ran (the whole device, not only what the module made).</p>"
        '<div class="columns">'
    )
    out = [head]
    for phase, rows in modules.items():
        if not rows:
            continue
        out.append(
            f'<div><table class="modules"><thead><tr><th>module ({escape(phase)})</th>'
            '<th class="num">estimate</th><th class="num">snapshot</th><th class="num">change</th>'
            "</tr></thead><tbody>"
        )
        for row in rows:
            out.append(
                f'<tr><td class="wrap"><code>{escape(row["name"])}</code></td>'
                f'<td class="num">{_bytes(row["estimate"])}</td>'
                f'<td class="num">{_bytes(row["snapshot"])}</td>'
                f'<td class="num">{_delta(row["estimate"], row["snapshot"])}</td></tr>'
            )
        out.append("</tbody></table></div>")
    out.append("</div>")
    return "".join(out)


def _tensors_table(view: Mapping[str, Any]) -> str:
    rows = view["tensors"]
    if not rows:
        return ""
    alive = view["alive"]
    shown = sum(row["bytes"] for row in rows)
    # one decimal, never rounded up to a "100%" that would claim every storage is listed
    share = f"{math.floor(1000 * shown / alive['bytes']) / 10:g}%" if alive["bytes"] else "-"
    head = (
        "<h3>Largest tensors alive at the peak</h3>"
        f'<p class="muted small">{alive["count"]} storages hold {escape(format_bytes(alive["bytes"]))}'
        f" at the peak; the {len(rows)} largest below hold {share} of it. Sizes are what the "
        "allocator charges; hover a location for the calling frames.</p>"
        '<table class="tensors"><thead><tr><th class="num">#</th><th class="num">size</th>'
        "<th>category</th><th>made by</th><th>module</th><th>phase</th><th>where</th>"
        "</tr></thead><tbody>"
    )
    out = [head]
    for n, row in enumerate(rows, 1):
        size = escape(format_bytes(row["bytes"]))
        if row["requested"] != row["bytes"]:
            size = f'<span title="{escape(format_bytes(row["requested"]))} requested">{size}</span>'
        where = row["where"] or "(before the step)"
        stack = "\n".join(row["stack"])
        node = f'<div class="node">{escape(row["node"])}</div>' if row.get("node") else ""
        out.append(
            f'<tr><td class="num muted">{n}</td><td class="num strong">{size}</td>'
            f"<td>{_swatch(row['category'])}{escape(row['category'].replace('_', ' '))}</td>"
            f'<td class="wrap"><code>{escape(row["op"] or "-")}</code>{node}</td>'
            f'<td class="wrap"><code>{escape(row["module"] or "-")}</code></td>'
            f"<td>{escape(row['phase'] or '-')}</td>"
            f'<td class="wrap"><code title="{escape(stack)}">{escape(where)}</code></td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def _unsupported(view: Mapping[str, Any]) -> str:
    rows = view.get("unsupported") or []
    if not rows:
        return ""
    items = "".join(
        f"<li><code>{escape(row['op'])}</code>"
        + (f" at <code>{escape(row['location'])}</code>" if row.get("location") else "")
        + (f": {escape(row['reason'])}" if row.get("reason") else "")
        + "</li>"
        for row in rows
    )
    title, words = (
        ("The trace stopped", "at the last of these ops: the figures are of the part of the step that ran")
        if view.get("stopped")
        else ("Approximate", "the trace went on past these ops, which it could not follow exactly")
    )
    return f'<div class="warning"><strong>{title}:</strong> {words}.<ul>{items}</ul></div>'


def _section(view: Mapping[str, Any], index: int) -> str:
    status = view["status"]
    classes = "card check" + (" failed" if view["failed"] else "")
    meta = [
        f"snapshot <code>{escape(view['file'])}</code>",
        f"tolerance {escape(view['tolerance'])}",
    ]
    if view["stale"]:
        meta.append(f"recorded in another environment: {escape(', '.join(view['stale']))}")
    rooms = [_room(room) for room in view.get("rooms", ())]
    parts = [
        f'<section class="{classes}" id="check-{index}" data-status="{escape(status)}">',
        f'<div class="check-head">{_badge(status, view["failed"])}'
        + ('<span class="badge s-approximate">approximate</span>' if view.get("approximate") else "")
        + f'<h2><a href="#check-{index}">{_check_label(view)}</a></h2>'
        + f'<span class="device">{escape(_device_label(view))}</span>'
        + '<a class="top-link" href="#top">\u2191 index</a></div>',
        f'<p class="meta">{_DOT.join(meta)}</p>',
    ]
    if rooms:
        parts.append(f'<p class="meta headroom">{_DOT.join(rooms)}</p>')
    if view.get("leak"):
        parts.append(_leak(view["leak"]))
    if view["message"]:
        parts.append(f'<pre class="message">{escape(view["message"])}</pre>')
    elif view["acceptable"]:
        parts.append(f'<p class="meta">accept with <code>{escape(view["accept"])}</code></p>')
    parts.append(_unsupported(view))
    parts.append(
        '<div class="columns"><div><h3>Peaks</h3>'
        f"{_figures_table(view)}</div><div><h3>At the peak, by category</h3>"
        f"{_breakdown_table(view)}</div></div>"
    )
    parts.append("<h3>Live memory across the step</h3>")
    parts.append(_chart(view, index))
    parts.append(_tensors_table(view))
    parts.append(_modules_tables(view))
    parts.append("</section>")
    return "".join(parts)


_LEAK_WIDTH: Final = 600
_LEAK_HEIGHT: Final = 170


def _leak(leak: Mapping[str, Any]) -> str:
    """A leak check's figures, and what is held after each iteration beyond what was held
    before the first, as bars (``--torchmem-leaks``, ``memory_budget(leak=...)``)."""
    per, allowed = leak["per_iteration"], leak["allowed"]
    grows = f"{format_bytes(per)} more held after every iteration" if per > 0 else "no growth per iteration"
    verdict = "bad" if leak.get("leaks") else "good"
    text = f'<span class="{verdict}">leak check: <strong>{grows}</strong> (allowed {format_bytes(allowed)})</span>'
    if leak.get("fragmentation"):
        text += f'{_DOT}<span class="bad">reserved grows {format_bytes(leak["reserved_per_iteration"])} per iteration: fragmentation</span>'
    beyond = [held - leak["baseline"] for held in leak["held"]]
    ticks, y_max = nice_ticks(max([*beyond, 1]) * 1.1)
    left, right, top, bottom = 70, _LEAK_WIDTH - 10, 10, _LEAK_HEIGHT - 24
    width = (right - left) / max(len(beyond), 1)

    def sy(value: float) -> float:
        return bottom - (bottom - top) * value / y_max

    parts = [
        f'<svg class="leak-chart" viewBox="0 0 {_LEAK_WIDTH} {_LEAK_HEIGHT}" role="img" '
        'aria-label="memory held after each iteration, beyond what was held before the first">'
    ]
    for tick in ticks:
        parts.append(
            f'<line class="grid" x1="{left}" x2="{right}" y1="{_num(sy(tick))}" y2="{_num(sy(tick))}"/>'
            f'<text class="tick" x="{left - 6}" y="{_num(sy(tick) + 4)}">{escape(_compact(tick))}</text>'
        )
    for i, value in enumerate(beyond):
        x = left + i * width + width * 0.15
        parts.append(
            f'<rect class="leak-bar" x="{_num(x)}" y="{_num(sy(max(value, 0)))}" width="{_num(width * 0.7)}" '
            f'height="{_num(bottom - sy(max(value, 0)))}"><title>after iteration {i + 1}: '
            f"{escape(format_bytes(leak['held'][i]))} held</title></rect>"
            f'<text class="axis" x="{_num(x + width * 0.35)}" y="{bottom + 16}">{i + 1}</text>'
        )
    parts.append("</svg>")
    return f'<p class="meta leak">{text}</p>' + "".join(parts)


def _room(room: Mapping[str, Any]) -> str:
    """``headroom on H100: 62.66 GiB to spare (reserved 16.03 GiB of 78.69 GiB usable)``."""
    usable, reserved, headroom = room["usable"], room["reserved"], room["headroom"]
    room_text = f"{format_bytes(headroom)} to spare" if headroom >= 0 else f"{format_bytes(-headroom)} over"
    text = (
        f"headroom on {escape(room['gpu'])}: <strong>{room_text}</strong> (reserved "
        f"{format_bytes(reserved)} of {format_bytes(usable)} usable)"
    )
    if room.get("required"):
        text += " · fits= asks it to fit"
    return f'<span class="{"good" if headroom >= 0 else "bad"}">{text}</span>'


def _index(views: Sequence[Mapping[str, Any]]) -> str:
    head = (
        '<table class="index"><thead><tr><th>status</th><th>test</th><th>device</th>'
        '<th class="num">forward</th><th class="num">backward</th><th class="num">step</th>'
        '<th class="num">peak</th><th>change</th></tr></thead><tbody>'
    )
    out = [head]
    for n, view in enumerate(views, 1):
        figures = {row["figure"]: row["estimate"] for row in view["figures"]}
        cls = ' class="failed"' if view["failed"] else ""
        out.append(
            f"<tr{cls}><td>{_badge(view['status'], view['failed'])}</td>"
            f'<td class="wrap"><a href="#check-{n}">{_check_label(view)}</a></td>'
            f"<td>{escape(view['device'])}</td>"
            + "".join(
                f'<td class="num">{_bytes(figures.get(name))}</td>'
                for name in ("forward", "backward", "step")
            )
            + f'<td class="num strong">{_bytes(figures.get("peak"))}</td>'
            f'<td class="wrap">{escape(view["change"])}</td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def _totals(views: Sequence[Mapping[str, Any]]) -> str:
    counts = Counter(view["status"] for view in views)
    failed = sum(view["failed"] for view in views)
    badges = " ".join(
        f'<span class="badge s-{status.replace(" ", "-")}">{counts[status]} {escape(status)}</span>'
        for status in _STATUS_ORDER
        if counts.get(status)
    )
    checks = f"{len(views)} check{'' if len(views) == 1 else 's'}"
    verdict = f"{failed} failed" if failed else "none failed"
    return f'<p class="totals"><strong>{checks}</strong>, {verdict} {badges}</p>'


def _environment(environment: Mapping[str, Any]) -> str:
    items = "".join(
        f"<span><b>{escape(key.replace('_', ' '))}</b> {escape(value)}</span>"
        for key, value in environment.items()
        if value not in (None, "")
    )
    return f'<p class="env">{items}</p>'


def render(views: Sequence[Mapping[str, Any]], environment: Mapping[str, Any]) -> str:
    """The whole page for ``views`` (in the order given)."""
    failed = sum(view["failed"] for view in views)
    title = f"torchmem: {len(views)} check{'' if len(views) == 1 else 's'}, {failed} failed"
    when = _datetime.datetime.now(_datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if views:
        body = (
            f"{_totals(views)}{_index(views)}</header><main>"
            + "".join(_section(view, n) for n, view in enumerate(views, 1))
            + "</main>"
        )
    else:
        body = (
            '</header><main><p class="card empty">No memory checks ran in this session: '
            "no selected test called <code>torchmem.check</code>.</p></main>"
        )
    return (
        '<!DOCTYPE html>\n<html lang="en" data-torchmem="static"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        '<div class="page"><header class="top card" id="top">'
        '<div id="torchmem-error" class="js-error" hidden></div>'
        f'<h1>Memory report <span class="muted">pytest-torchmem</span></h1>'
        f'<p class="muted small">generated {when}</p>{_environment(environment)}{body}'
        f"</div><script>{_JS}</script></body></html>\n"
    )


_CSS: Final = """
:root{--fg:#1f2328;--muted:#59636e;--line:#d8dee4;--soft:#f6f8fa;--red:#cf222e;
--green:#1a7f37;--blue:#0969da;--amber:#9a6700}
*{box-sizing:border-box}
body{margin:0;background:#eef1f4;color:var(--fg);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
.page{max-width:1320px;margin:0 auto;padding:20px 24px 48px}
.card{background:#fff;border:1px solid var(--line);border-radius:10px;padding:18px 22px;
margin:0 0 18px}
h1{font-size:22px;margin:0}h1 .muted{font-weight:400;font-size:15px;margin-left:6px}
h2{font-size:16px;margin:0;font-weight:600;word-break:break-all}
h2 a{color:inherit;text-decoration:none}h2 a:hover{text-decoration:underline}
h3{font-size:13px;margin:20px 0 6px;text-transform:uppercase;letter-spacing:.04em;color:var(--muted)}
.muted{color:var(--muted)}.small{font-size:12.5px;margin:2px 0 8px}
.env{display:flex;flex-wrap:wrap;gap:4px 18px;margin:6px 0 12px;font-size:12.5px;color:var(--muted)}
.env b{color:var(--fg);font-weight:600;margin-right:4px}
.totals{margin:10px 0 10px;font-size:14px}.totals .badge{margin-left:4px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:5px 10px;text-align:left;border-bottom:1px solid #eaeef2;vertical-align:top}
th{font-weight:600;color:var(--muted);font-size:11.5px;text-transform:uppercase;
letter-spacing:.03em;border-bottom:1px solid var(--line);white-space:nowrap}
.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.strong{font-weight:600}.wrap{word-break:break-word;overflow-wrap:anywhere}
table.index td{vertical-align:middle}table.index tr.failed td{background:#fff6f6}
table.index tr.failed td:first-child{box-shadow:inset 3px 0 0 var(--red)}
a{color:var(--blue)}
code{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;
background:var(--soft);padding:1px 4px;border-radius:4px}
.badge{display:inline-block;padding:1px 9px;border-radius:999px;font-size:12px;font-weight:600;
border:1px solid;white-space:nowrap;line-height:1.5}
.s-passed{color:var(--green);background:#dafbe1;border-color:#aceebb}
.s-regressed,.s-over-budget,.s-mismatch,.s-stopped{color:var(--red);background:#ffebe9;border-color:#ffcecb}
.s-improved{color:var(--blue);background:#ddf4ff;border-color:#b6e3ff}
.s-missing,.s-not-written,.s-approximate{color:var(--amber);background:#fff8c5;border-color:#eed888}
.s-stale{color:#57606a;background:#eaeef2;border-color:#d0d7de}
.s-new,.s-updated{color:#8250df;background:#fbefff;border-color:#e6ccff}
section.check{scroll-margin-top:12px}
section.check.failed{border-left:5px solid var(--red)}
.check-head{display:flex;align-items:center;gap:12px;flex-wrap:wrap}
.device{font-size:12.5px;color:var(--muted);border:1px solid var(--line);border-radius:6px;
padding:1px 8px;white-space:nowrap}
.top-link{margin-left:auto;font-size:12.5px;text-decoration:none}
.meta{margin:8px 0 0;font-size:12.5px;color:var(--muted)}
pre.message{margin:12px 0 0;background:#fff6f6;border:1px solid #ffd7d5;border-radius:8px;
padding:10px 12px;white-space:pre-wrap;word-break:break-word;
font:12px/1.5 ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace}
.warning{margin:12px 0 0;background:#fff8c5;border:1px solid #eed888;border-radius:8px;
padding:8px 12px;font-size:13px}.warning ul{margin:4px 0 0;padding-left:20px}
.columns{display:grid;grid-template-columns:minmax(0,1.25fr) minmax(0,1fr);gap:28px}
@media (max-width:900px){.columns{grid-template-columns:minmax(0,1fr)}}
tr.bad td{background:#fff6f6}tr.good td{background:#f3f9ff}
td.verdict{white-space:nowrap;font-weight:600}td.verdict.bad{color:var(--red)}
td.verdict.good{color:var(--blue)}
.up{color:var(--red)}.down{color:var(--green)}
tr.moved td{background:#fffbea}
.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:7px;
vertical-align:-1px}
figure.chart{margin:4px 0 0;position:relative}
svg.chart{display:block;width:100%;height:auto;font-size:12px}
svg.leak-chart{display:block;width:100%;max-width:600px;height:auto;font-size:11px}
svg.leak-chart .tick{text-anchor:end;fill:var(--muted)}
svg.leak-chart .axis{text-anchor:middle;fill:var(--muted)}
svg.leak-chart .grid{stroke:#e3e6ea}
svg.leak-chart .leak-bar{fill:#cf222e;opacity:.75}
svg.chart text{fill:var(--muted)}
svg.chart .tick{text-anchor:end;font-variant-numeric:tabular-nums}
svg.chart .band-label{text-anchor:middle;font-weight:600;fill:#3d444d;font-size:12px}
svg.chart .axis{font-size:11px}
.band-forward{fill:#edf3fb}.band-backward{fill:#fcf1e7}.band-step{fill:#eef7ee}
.band-after{fill:#f1f1f1}
.boundary{stroke:#8c959f;stroke-width:1;stroke-dasharray:2 2}
.grid line{stroke:#000;stroke-opacity:.08}
.ref-snapshot{stroke:#1f2328;stroke-width:1.6;stroke-dasharray:7 4}
.ref-budget{stroke:var(--red);stroke-width:2.5}
svg.chart .budget-label{fill:var(--red);font-weight:600;font-size:11.5px;paint-order:stroke;
stroke:#fff;stroke-width:3px;stroke-linejoin:round}
.peak-line{stroke:#1f2328;stroke-width:1;stroke-dasharray:3 3}
.peak-dot{fill:#fff;stroke:#1f2328;stroke-width:2}
svg.chart .peak-label{fill:#1f2328;font-weight:700;font-size:13px;paint-order:stroke;
stroke:#fff;stroke-width:4px;stroke-linejoin:round}
.hit{fill:transparent;cursor:crosshair}
.cursor{stroke:#1f2328;stroke-width:1;pointer-events:none}
.legend{list-style:none;display:flex;flex-wrap:wrap;gap:4px 16px;margin:6px 0 0 7%;padding:0;
font-size:12.5px}
.legend li{display:flex;align-items:center}
.key{display:inline-block;width:22px;height:0;margin-right:7px}
.key-snapshot{border-top:2px dashed #1f2328}.key-budget{border-top:2px solid var(--red)}
.key-peak{width:10px;height:10px;border:2px solid #1f2328;border-radius:50%}
figcaption{font-size:12px;margin:6px 0 0 7%}
.tip{position:absolute;display:none;pointer-events:none;z-index:5;min-width:220px;
background:#fff;border:1px solid var(--line);border-radius:8px;
box-shadow:0 6px 20px rgba(31,35,40,.15);padding:8px 10px;font-size:12px}
.tip table{font-size:12px}.tip td{padding:1px 4px;border:0}
.tip .head{font-weight:600;margin-bottom:2px}.tip .op{color:var(--muted);margin-bottom:4px;
word-break:break-all}.tip .total td{border-top:1px solid var(--line);font-weight:600}
.js-error{background:#ffebe9;color:var(--red);border:1px solid #ffcecb;border-radius:8px;
padding:8px 12px;margin:0 0 12px;font-weight:600}
.empty{font-size:15px}
.node{font-size:11.5px;color:var(--muted);margin-top:1px}
"""

_JS: Final = r"""
(function () {
  "use strict";
  var root = document.documentElement;
  function fail(message) {
    var box = document.getElementById("torchmem-error");
    if (box) {
      box.hidden = false;
      box.textContent = "The report's script failed (" + message +
        "): the tables are complete, the charts' hover read-out is not.";
    }
    root.setAttribute("data-torchmem", "error");
  }
  window.addEventListener("error", function (event) {
    fail(event.message || String(event.error));
  });
  var UNITS = ["KiB", "MiB", "GiB", "TiB"];
  function bytes(n) {
    if (Math.abs(n) < 1024) return n + " B";
    var size = Math.abs(n), unit = "B";
    for (var i = 0; i < UNITS.length && size >= 1024; i++) { size /= 1024; unit = UNITS[i]; }
    return (n < 0 ? "-" : "") + size.toFixed(2) + " " + unit;
  }
  var PHASES = {forward: "forward", backward: "backward", step: "optimizer step", after: "end"};
  var SVG = "http://www.w3.org/2000/svg";
  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function setup(figure) {
    var data = JSON.parse(figure.querySelector("script.chart-data").textContent);
    var svg = figure.querySelector("svg.chart");
    var n = data.x.length, box = data.box;
    var columns = data.cats.map(function (name) {
      var changes = data.values[name], column = new Array(n), j = 0, value = 0;
      for (var i = 0; i < n; i++) {
        if (j < changes.length && changes[j][0] === i) { value = changes[j][1]; j++; }
        column[i] = value;
      }
      return column;
    });
    var cursor = document.createElementNS(SVG, "line");
    cursor.setAttribute("class", "cursor");
    cursor.setAttribute("y1", box[1]);
    cursor.setAttribute("y2", box[3]);
    cursor.style.display = "none";
    svg.appendChild(cursor);
    var tip = el("div", "tip");
    figure.appendChild(tip);
    function totalAt(i) {
      var sum = 0;
      for (var c = 0; c < columns.length; c++) sum += columns[c][i];
      return sum;
    }
    function hide() { cursor.style.display = "none"; tip.style.display = "none"; }
    function phaseAt(x) {
      for (var i = data.phases.length - 1; i >= 0; i--) {
        var phase = data.phases[i];
        if (phase.start > x) continue;
        return phase.first_step ? "first " + (PHASES[phase.phase] || phase.phase) : phase.phase;
      }
      return "";
    }
    function show(event) {
      var point = svg.createSVGPoint();
      point.x = event.clientX; point.y = event.clientY;
      var p = point.matrixTransform(svg.getScreenCTM().inverse());
      if (p.x < box[0] || p.x > box[2] || n === 0) { hide(); return; }
      // back from SVG units to events; a tenth of a unit (the drawing's rounding) to spare
      var x = 0;
      for (var s = 0; s < data.segments.length; s++) {
        var seg = data.segments[s], perUnit = (seg[1] - seg[0]) / (seg[3] - seg[2]);
        x = seg[1];
        if (p.x < seg[3]) { x = seg[0] + (p.x - seg[2] + 0.1) * perUnit; break; }
      }
      x = Math.floor(x);
      var lo = 0, hi = n - 1;
      while (lo < hi) {
        var mid = (lo + hi + 1) >> 1;
        if (data.x[mid] <= x) lo = mid; else hi = mid - 1;
      }
      var i = lo;
      // several states at one event (a resize): show the highest
      for (var j = lo - 1; j >= 0 && data.x[j] === data.x[lo]; j--) {
        if (totalAt(j) > totalAt(i)) i = j;
      }
      cursor.setAttribute("x1", p.x); cursor.setAttribute("x2", p.x);
      cursor.style.display = "";
      tip.textContent = "";
      var phase = phaseAt(data.x[i]);
      tip.appendChild(el("div", "head", (PHASES[phase] || phase || "before the step") +
        " \u00b7 event " + Math.max(data.x[i] - 1, 0)));
      tip.appendChild(el("div", "op", data.labels[data.label[i]]));
      var table = el("table"), total = 0;
      for (var c = data.cats.length - 1; c >= 0; c--) {
        var value = columns[c][i];
        total += value;
        if (!value) continue;
        var row = el("tr"), name = el("td"), sw = el("span", "sw");
        sw.style.background = data.colors[c];
        name.appendChild(sw);
        name.appendChild(document.createTextNode(data.cats[c].replace("_", " ")));
        row.appendChild(name);
        row.appendChild(el("td", "num", bytes(value)));
        table.appendChild(row);
      }
      var sum = el("tr", "total");
      sum.appendChild(el("td", "", "total"));
      sum.appendChild(el("td", "num", bytes(total)));
      table.appendChild(sum);
      tip.appendChild(table);
      tip.style.display = "block";
      var rect = figure.getBoundingClientRect();
      var left = event.clientX - rect.left + 14, top = event.clientY - rect.top + 14;
      if (left + tip.offsetWidth > rect.width) left = event.clientX - rect.left - tip.offsetWidth - 14;
      tip.style.left = Math.max(left, 0) + "px";
      tip.style.top = top + "px";
    }
    svg.addEventListener("mousemove", show);
    svg.addEventListener("mouseleave", hide);
    figure.setAttribute("data-ready", String(n));
  }
  try {
    var figures = document.querySelectorAll("figure.chart");
    for (var k = 0; k < figures.length; k++) setup(figures[k]);
    if (root.getAttribute("data-torchmem") !== "error") root.setAttribute("data-torchmem", "ready");
  } catch (error) {
    fail(error && error.message ? error.message : String(error));
  }
})();
"""
