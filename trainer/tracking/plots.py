"""Line charts as inline SVG: no library, no script, no request, readable in any browser.

Each series is one `<path class="series">` whose `d` holds one `M`/`L` command per point
(`M` again after a gap: a non-finite value), with `data-run` and `data-metric` naming it, so
a reader (or a test) can count and recover the points.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass, field

# Runs are told apart by colour (colour-blind-safe palette, Okabe-Ito), metrics by dash.
COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
DASHES = ("", "6 4", "2 3", "10 3 2 3")
# Above this many points a series is reduced to the minimum and maximum of each of
# MAX_POINTS / 2 equal step ranges: spikes survive, the page stays small.
MAX_POINTS = 2000
WIDTH, HEIGHT = 560, 250
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 10, 34


@dataclass
class Line:
    """One series: `points` are (step, value); value None is a gap (non-finite)."""

    run: int  # index of the run: its colour
    metric: str
    points: list[tuple[int, float | None]]
    dash: int = 0  # index into DASHES


@dataclass
class Chart:
    title: str
    lines: list[Line]
    marks: list[tuple[int, int, str]] = field(default_factory=list)  # (run, step, what)
    hline: tuple[float, str] | None = None  # (value, label): a threshold drawn across
    log_y: bool | None = None  # None: log when all values are positive and span > 100x


def reduce(points: list[tuple[int, float | None]]) -> list[tuple[int, float | None]]:
    """At most about MAX_POINTS points: the min and max of each of MAX_POINTS / 2 equal step
    ranges, in step order (and a gap where a range held a non-finite value)."""
    if len(points) <= MAX_POINTS:
        return points
    buckets = MAX_POINTS // 2
    lo, hi = points[0][0], points[-1][0]
    groups: dict[int, list[tuple[int, float | None]]] = {}
    for point in points:
        index = min(buckets - 1, (point[0] - lo) * buckets // (hi - lo + 1))
        groups.setdefault(index, []).append(point)
    out: list[tuple[int, float | None]] = []
    for group in groups.values():  # insertion order: step order
        finite = [(s, v) for s, v in group if v is not None]
        if len(finite) < len(group):
            out.append((group[0][0], None))
        if finite:
            low = min(finite, key=lambda p: p[1])
            high = max(finite, key=lambda p: p[1])
            out.extend(sorted({low, high}))
    return out


def _nice(span: float) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving about five ticks over `span`."""
    raw = span / 5 if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _ticks(lo: float, hi: float) -> list[float]:
    step = _nice(hi - lo)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{v:.4g}"


def _text(x: float, y: float, text: str, anchor: str) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" class="tick" text-anchor="{anchor}">'
        f"{html.escape(text)}</text>"
    )


def svg(chart: Chart) -> str:
    """The chart as an `<svg>` element (inline in HTML5: no namespace, no external reference)."""
    lines = [Line(ln.run, ln.metric, reduce(ln.points), ln.dash) for ln in chart.lines]
    steps = [s for ln in lines for s, _ in ln.points] + [s for _, s, _ in chart.marks]
    values = [v for ln in lines for _, v in ln.points if v is not None]
    if chart.hline is not None:
        values.append(chart.hline[0])
    if not steps or not values:
        return ""
    log = chart.log_y
    if log is None:
        log = min(values) > 0 and max(values) / min(values) > 100
    f = math.log10 if log else (lambda v: v)
    x0, x1 = min(steps), max(steps)
    y0, y1 = f(min(values)), f(max(values))
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.05 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    else:
        pad = (y1 - y0) * 0.05
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(step: float) -> float:
        return LEFT + (step - x0) / (x1 - x0) * pw

    def py(value: float) -> float:
        return TOP + (1 - (f(value) - y0) / (y1 - y0)) * ph

    out = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{html.escape(chart.title)}">',
        f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" class="frame"/>',
    ]
    for t in _ticks(x0, x1):
        if t != int(t):
            continue
        x = px(t)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + ph}" class="grid"/>')
        out.append(_text(x, TOP + ph + 14, str(int(t)), "middle"))
    if log:
        yticks = [float(10**k) for k in range(math.floor(y0), math.ceil(y1) + 1) if y0 <= k <= y1]
    else:
        yticks = _ticks(y0, y1)
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" class="grid"/>')
        out.append(_text(LEFT - 4, y + 4, _fmt(t), "end"))
    out.append(
        f'<text x="{LEFT + pw / 2:.0f}" y="{HEIGHT - 4}" class="axis" text-anchor="middle">'
        f"optimizer step{' (log y)' if log else ''}</text>"
    )
    if chart.hline is not None:
        y = py(chart.hline[0])
        out.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" class="threshold"/>'
        )
        out.append(_text(LEFT + pw - 4, y - 4, chart.hline[1], "end"))
    for ln in lines:
        out += _series(ln, px, py)
    for run, step, what in chart.marks:
        x = px(step)
        color = COLORS[run % len(COLORS)]
        a, b, top, bottom = x - 4, x + 4, TOP + 2, TOP + 10
        cross = f"M{a:.1f} {top} L{b:.1f} {bottom} M{b:.1f} {top} L{a:.1f} {bottom}"
        out.append(
            f'<path class="mark" d="{cross}" stroke="{color}">'
            f"<title>{html.escape(what)} at step {step}</title></path>"
        )
    out.append("</svg>")
    return "\n".join(out)


def _series(ln: Line, px: Callable[[float], float], py: Callable[[float], float]) -> list[str]:
    """One line of a chart as a `<path>` (gaps where values are missing), and a dot for each
    point that stands alone."""
    color, dash = COLORS[ln.run % len(COLORS)], DASHES[ln.dash % len(DASHES)]
    commands, singles, pen = [], [], "M"
    for i, (step, value) in enumerate(ln.points):
        if value is None:
            pen = "M"
            continue
        commands.append(f"{pen}{px(step):.1f} {py(value):.1f}")
        after = ln.points[i + 1][1] if i + 1 < len(ln.points) else None
        if pen == "M" and after is None:
            singles.append((px(step), py(value)))  # a lone point draws no line: a dot
        pen = "L"
    attrs = f'data-run="{ln.run}" data-metric="{html.escape(ln.metric)}"'
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    return [
        f'<path class="series" {attrs} stroke="{color}"{dash_attr} d="{" ".join(commands)}">'
        f"<title>{html.escape(ln.metric)}</title></path>",
        *(
            f'<circle class="dot" cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>'
            for x, y in singles
        ),
    ]


# ---- the profiled steps as a timeline: one lane per rank, one colour per phase ----

PHASE_COLORS = {
    "data": "#E69F00",
    "compute": "#0072B2",
    "sync": "#999999",
    "optimizer": "#009E73",
    "checkpoint": "#CC79A7",
    "eval": "#56B4E9",
}
MAX_LANES = 16
LANE, LABEL, AXIS = 22, 84, 34
Span = tuple[str, float, float]  # (name, start µs, end µs)


def timeline_svg(lanes: dict[int, dict[str, list[Span]]], width: int = 1120) -> str:
    """Each rank's phase spans over the profiled steps (from the merged timeline), on one
    time axis: where each rank's time went, and who waited for whom."""
    ranks = sorted(lanes)[:MAX_LANES]
    spans = [s for r in ranks for key in ("phases", "steps") for s in lanes[r][key]]
    if not spans:
        return ""
    t0, t1 = min(s[1] for s in spans), max(s[2] for s in spans)
    t1 = t1 if t1 > t0 else t0 + 1.0
    plot = width - LABEL - RIGHT
    height = TOP + AXIS + LANE * len(ranks) + 10

    def px(t: float) -> float:
        return LABEL + (t - t0) / (t1 - t0) * plot

    out = [
        f'<svg class="timeline" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="timeline of the profiled steps">'
    ]
    for ms in _ticks(0.0, (t1 - t0) / 1000.0):
        x = px(t0 + ms * 1000.0)
        out.append(
            f'<line x1="{x:.1f}" y1="{TOP + AXIS - 6}" x2="{x:.1f}" y2="{height - 10}" '
            'class="grid"/>'
        )
        out.append(_text(x, TOP + AXIS - 10, f"{_fmt(ms)} ms", "middle"))
    for name, start, _ in lanes[ranks[0]]["steps"]:
        x = px(start)
        out.append(
            f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{height - 10}" class="threshold"/>'
        )
        out.append(_text(x + 3, TOP + 10, name, "start"))
    for row, rank in enumerate(ranks):
        y = TOP + AXIS + row * LANE
        out.append(_text(LABEL - 6, y + LANE / 2 + 4, f"rank {rank}", "end"))
        for name, start, end in lanes[rank]["phases"]:
            phase = name.split(" ", 1)[0]
            x0, x1 = px(start), px(end)
            out.append(
                f'<rect class="phase" data-rank="{rank}" data-phase="{phase}" x="{x0:.2f}" '
                f'y="{y + 2}" width="{max(x1 - x0, 0.3):.2f}" height="{LANE - 4}" '
                f'fill="{PHASE_COLORS.get(phase, "#000")}"><title>rank {rank}: '
                f"{html.escape(name)} {(end - start) / 1000:.2f} ms</title></rect>"
            )
    out.append("</svg>")
    return "\n".join(out)


def phase_legend() -> str:
    items = "".join(
        f'<span><svg width="14" height="10"><rect width="14" height="10" fill="{color}"/></svg>'
        f" {name}</span>"
        for name, color in PHASE_COLORS.items()
    )
    return f'<div class="legend">{items}</div>'
