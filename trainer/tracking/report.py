"""`python -m trainer.report RUN [RUN ...] -o FILE.html`: one self-contained page of runs.

What a person looks at after (or during) a run: train and validation loss, learning rate,
gradient norm with skipped steps, throughput, MFU and peak memory, then every other metric,
for one run or several overlaid (one colour per run), with the config keys on which the runs
differ, `trainer.compare`'s table of each run against the first, and each run's end summary.
Everything is inline (SVG charts, CSS): the file opens in a browser with no Python and makes
no request. Every run writes its own `report.html` at the end (`write_run_report`); this
command reads any run directory, also one still being written.
"""

from __future__ import annotations

import datetime
import html
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.checkpoint.manifest import MANIFEST
from trainer.checks.compare import CompareError, compare, metrics_file, report, series_of
from trainer.tracking.phases import TABLE_FILE
from trainer.tracking.plots import COLORS, DASHES, Chart, Line, phase_legend, svg, timeline_svg
from trainer.tracking.plurals import counted
from trainer.tracking.records import is_throughput, throughput_key
from trainer.tracking.timeline import phase_lanes

TIMELINE_FILE = Path("profile") / "timeline.json.gz"

EXIT_BAD_INPUT = 2
SUMMARY_FILE = "summary.txt"
# The charts a person looks at first: (title, metrics drawn together). Every other numeric
# metric gets a chart of its own after these.
THROUGHPUT = tuple(throughput_key(u) for u in ("tokens", "pairs", "samples", "items"))
MAIN_CHARTS = (
    ("Loss", ("train/loss", "val/loss")),
    ("Learning rate", ("train/lr",)),
    ("Gradient norm (before clipping)", ("train/grad_norm",)),
    # `train/<unit>_per_s` in the task's unit (trainer/tracking/records.py: throughput_key).
    ("Throughput: loss items per second", THROUGHPUT),
    ("MFU", ("train/mfu",)),
    ("Peak memory (MB)", ("train/peak_mem_mb",)),
    # A mixture of experts (README's MoE section): charted even when constant, since a router
    # that collapsed from the start (E / k, every step) is the thing to see.
    (
        "Expert load: the most-loaded expert's share over the mean, worst layer (1: balanced)",
        ("train/moe_load_max",),
    ),
    ("Load-balancing losses of the whole step", ("train/moe_aux_loss", "train/moe_z_loss")),
    (
        "Where a step's time goes: seconds per step, slowest rank",
        ("time/data_s", "time/compute_s", "time/sync_s", "time/optimizer_s"),
    ),
    (
        "Seconds per step, median rank",
        (
            "time/data_median_s",
            "time/compute_median_s",
            "time/sync_median_s",
            "time/optimizer_median_s",
        ),
    ),
    (
        "Seconds per step, fastest rank",
        ("time/data_min_s", "time/compute_min_s", "time/sync_min_s", "time/optimizer_min_s"),
    ),
)
# (Checkpoint and evaluation times, `time/checkpoint_s` and `time/eval_s`, are only in the
# records that follow them: charts of their own when they vary.)
MAIN_METRICS = {m for _, metrics in MAIN_CHARTS for m in metrics}
# Shown as marks instead (steps where the count grew), or not a curve at all: which rank was
# slowest in each phase is the per-rank table's; a mixture's routing digest is a fingerprint
# for comparing runs (engine/moe/sums.py).
FT_COUNTS = ("ft/failures", "ft/redone_steps")  # ft=torchft: the failed steps are marks
NOT_CHARTED = {"train/skipped_steps", "train/moe_routing_digest", *FT_COUNTS} | {
    f"time/{p}_rank" for p in ("data", "compute", "sync", "optimizer", "checkpoint", "eval")
}
MAX_OTHER_CHARTS = 24
WORLD_ROW = "world (of the run, not in the config)"


class ReportError(Exception):
    """A run that cannot be read: one paragraph, exit 2."""


@dataclass
class RunData:
    """What the page shows of one run directory."""

    path: Path
    label: str
    series: dict[str, dict[int, float | None]]
    config: dict[str, Any]  # .hydra/config.yaml, flattened ({} when absent)
    config_text: str
    summary: str | None  # summary.txt: the run's own closing lines
    unreadable: int  # lines of metrics.jsonl that are not records (one being written)
    ranks: dict[str, Any] | None = None  # time_by_rank.json: each rank's phase times
    timeline: dict[int, dict[str, Any]] | None = None  # profile/timeline.json.gz's phases
    world: int | None = None  # processes of its last launch (not in the config)
    hosts: int | None = None


def read_records(file: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a metrics.jsonl that may be being written: a line that does not parse
    (cut short) is counted and skipped instead of stopping the report."""
    records, bad = [], 0
    for line in file.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            int(record["step"])
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        records.append(record)
    return records, bad


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; an empty mapping holds no key."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def load_run(path: Path, label: str) -> RunData:
    try:
        file = metrics_file(path)
    except CompareError as exc:
        raise ReportError(str(exc)) from None
    run_dir = file.parent
    records, bad = read_records(file)
    config_file = run_dir / ".hydra" / "config.yaml"
    config_text, config = "", {}
    if config_file.is_file():
        config_text = config_file.read_text(encoding="utf-8")
        # Written by OmegaConf.to_yaml, which quotes every string YAML would read as another
        # type: PyYAML's C loader reads what OmegaConf.load would, 10x faster (every run's end).
        loaded = yaml.load(config_text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        config = flatten(loaded) if isinstance(loaded, dict) else {}
    summary_file = run_dir / SUMMARY_FILE
    summary = summary_file.read_text(encoding="utf-8") if summary_file.is_file() else None
    run = RunData(run_dir, label, series_of(records), config, config_text, summary, bad)
    run.ranks, run.timeline = read_ranks(run_dir), read_timeline(run_dir)
    run.world, run.hosts = read_world(run_dir, run.ranks)
    return run


def read_world(run_dir: Path, ranks: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(world size, hosts) of the run's last launch: the config does not hold them. Its
    time_by_rank.json lists every rank with its host; else its newest checkpoint's manifest
    names the world size; (None, None) when neither is there yet."""
    if ranks is not None:
        rows = ranks["ranks"]
        return len(rows), len({str(r.get("host")) for r in rows if isinstance(r, dict)})
    for manifest in sorted((run_dir / "checkpoints").glob(f"step_*/{MANIFEST}"), reverse=True):
        try:
            world = json.loads(manifest.read_text(encoding="utf-8")).get("world_size")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(world, int) and not isinstance(world, bool) and world > 0:
            return world, None
    return None, None


def layout(run: RunData) -> str:
    """The run's world and how it was split, in words: `1 process`, `2 ranks on 1 host: dp 2
    (ddp), global batch 32`; the degrees are the config's `dist.*`, the world the run's."""
    if run.world is None:
        return "world size unknown (no time_by_rank.json or checkpoint yet)"
    config = run.config
    degrees = {k: config.get(f"dist.{k}", 1) for k in ("pp", "tp", "cp")}
    degrees = {k: v if isinstance(v, int) and v > 0 else 1 for k, v in degrees.items()}
    split = math.prod(degrees.values())
    dp = run.world // split if run.world % split == 0 else None
    micro, accum = config.get("train.micro_batch_size"), config.get("train.grad_accum_steps")
    batch = config.get("train.global_batch_size")
    if not isinstance(batch, int) and isinstance(micro, int) and isinstance(accum, int) and dp:
        batch = micro * accum * dp
    tail = f", global batch {batch}" if isinstance(batch, int) else ""
    if run.world == 1:
        return f"1 process{tail}"
    hosts = f" on {run.hosts} host{'s' if run.hosts != 1 else ''}" if run.hosts else ""
    parts = [f"dp {dp if dp else '?'}"] + [f"{k} {v}" for k, v in degrees.items() if v > 1]
    strategy = config.get("dist.strategy", "ddp")
    return f"{run.world} ranks{hosts}: {' x '.join(parts)} ({strategy}){tail}"


def read_ranks(run_dir: Path) -> dict[str, Any] | None:
    """The run's per-rank phase table (None when absent or being replaced)."""
    try:
        table = json.loads((run_dir / TABLE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return table if isinstance(table, dict) and table.get("ranks") else None


def read_timeline(run_dir: Path) -> dict[int, dict[str, Any]] | None:
    """Each rank's phase spans in the run's merged profile (None without a profile)."""
    path = run_dir / TIMELINE_FILE
    if not path.is_file():
        return None
    try:
        return phase_lanes(path) or None
    except (OSError, ValueError, EOFError) as exc:
        print(f"WARNING: {path} not shown ({exc})", file=sys.stderr)
        return None


def labels(paths: list[Path]) -> list[str]:
    """The shortest trailing parts of the paths that tell the runs apart."""
    parts = [p.resolve().parts for p in paths]
    for n in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-n:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


def skipped_steps(series: dict[int, float | None]) -> list[int]:
    """The record steps at which a cumulative count (`train/skipped_steps`, `ft/failures`)
    grew."""
    marks, before = [], 0.0
    for step in sorted(series):
        count = series[step]
        if count is not None and count > before:
            marks.append(step)
            before = count
    return marks


def main_charts(runs: list[RunData]) -> list[tuple[str, tuple[str, ...]]]:
    """MAIN_CHARTS for these runs: with several runs, a chart of the phases is one panel per
    phase (one line per run, in its colour), not runs x phases lines in one."""
    if len(runs) == 1:
        return list(MAIN_CHARTS)
    out = []
    for title, metrics in MAIN_CHARTS:
        if not all(m.startswith("time/") for m in metrics):
            out.append((title, metrics))
            continue
        for metric in metrics:
            phase = metric.removeprefix("time/").split("_")[0]
            out.append(
                (f"{phase.capitalize()}: seconds per step, {title.split(', ')[-1]}", (metric,))
            )
    return out


def charts(runs: list[RunData]) -> list[Chart]:
    """The main charts (those with data), then one per other metric."""
    out = []
    for title, metrics in main_charts(runs):
        lines = [
            Line(i, metric, sorted(run.series[metric].items()), dash)
            for i, run in enumerate(runs)
            for dash, metric in enumerate(metrics)
            if run.series.get(metric)
        ]
        if not lines:
            continue
        chart = Chart(title, lines)
        if "train/loss" in metrics:  # ft=torchft: a lost replica group's step, redone
            chart.marks = [
                (i, step, "failed step, redone by the live replica groups")
                for i, run in enumerate(runs)
                for step in skipped_steps(run.series.get("ft/failures", {}))
            ]
        if metrics == ("train/moe_load_max",):
            chart.hline = (1.0, "balanced")
        if metrics == ("train/grad_norm",):
            chart.marks = [
                (i, step, "skipped step")
                for i, run in enumerate(runs)
                for step in skipped_steps(run.series.get("train/skipped_steps", {}))
            ]
            clips = {run.config.get("train.clip_grad_norm") for run in runs} - {None}
            if len(clips) == 1:
                clip = float(clips.pop())
                chart.hline = (clip, f"train.clip_grad_norm={clip:g}")
        out.append(chart)
    shown = MAIN_METRICS | NOT_CHARTED
    others = sorted({m for run in runs for m in run.series} - shown)
    for metric in [m for m in others if constant(runs, m) is None][:MAX_OTHER_CHARTS]:
        lines = [
            Line(i, metric, sorted(run.series[metric].items()))
            for i, run in enumerate(runs)
            if run.series.get(metric)
        ]
        out.append(Chart(metric, lines))
    return out


def constant(runs: list[RunData], metric: str) -> float | None:
    """The one value `metric` takes in every record of every run (None if it varies): such a
    metric (a validation set's item count) is a line of text, not a chart."""
    values = {v for run in runs for v in run.series.get(metric, {}).values()}
    return values.pop() if len(values) == 1 and None not in values else None


def config_differences(runs: list[RunData]) -> list[tuple[str, list[str]]]:
    """The config keys whose values are not the same in every run (absent shows as '-'),
    after the runs' worlds when those differ (the config does not hold them)."""
    keys = sorted({k for run in runs for k in run.config})
    rows = []
    worlds = [layout(run) for run in runs]
    if len(set(worlds)) > 1:
        rows.append((WORLD_ROW, worlds))
    for key in keys:
        values = [json.dumps(run.config[key]) if key in run.config else "-" for run in runs]
        if len(set(values)) > 1:
            rows.append((key, values))
    return rows


def compare_tables(runs: list[RunData]) -> list[tuple[str, str]]:
    """`trainer.compare`'s table of each run against the first (or why it cannot be made)."""
    tables = []
    for run in runs[1:]:
        title = f"{run.label} against {runs[0].label}"
        try:
            diffs, only = compare(runs[0].path, run.path)
            tables.append((title, report(diffs, only, 1e-5, 1e-5)))
        except CompareError as exc:
            tables.append((title, f"not compared: {exc}"))
    return tables


def last(series: dict[int, float | None]) -> tuple[int, float | None] | None:
    return max(series.items()) if series else None


def run_line(run: RunData) -> str:
    """One line about a run: its last step and values."""
    parts = []
    for metric in ("train/loss", "val/loss", "val/accuracy"):
        point = last(run.series.get(metric, {}))
        if point is not None and point[1] is not None:
            parts.append(f"{metric} {point[1]:.4f} (step {point[0]})")
    rates = [m for m in run.series if is_throughput(m)]  # the task's unit's (one per run)
    tps = [v for m in rates[:1] for v in run.series[m].values() if v is not None]
    if tps:
        parts.append(f"median items/s {sorted(tps)[len(tps) // 2]:,.0f}")
    mem = [v for v in run.series.get("train/peak_mem_mb", {}).values() if v is not None]
    if mem:
        parts.append(f"peak memory {max(mem):,.0f} MB")
    failed = skipped_steps(run.series.get("ft/failures", {}))
    if failed:  # ft=torchft
        lost = last(run.series.get("ft/lost_s", {}))
        parts.append(
            f"{len(failed)} failed step(s) redone (steps {', '.join(map(str, failed[:8]))}"
            f"{', ...' if len(failed) > 8 else ''}; {lost[1] if lost else 0:.1f} s lost)"
        )
    return " | ".join(parts) or "no records yet"


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.swatch { display: inline-block; width: 14px; height: 4px; margin-right: 6px; }
table { border-collapse: collapse; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: left; vertical-align: top; }
pre { background: #f6f6f6; padding: 8px; white-space: pre-wrap; font-size: 12px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
figure { margin: 0; width: 560px; } figcaption { font-weight: 600; margin: 4px 0; }
svg.chart { background: #fff; font-size: 11px; }
svg .frame { fill: none; stroke: #999; } svg .grid { stroke: #eee; }
svg .series { fill: none; stroke-width: 1.5; } svg .mark { stroke-width: 2; }
svg .threshold { stroke: #999; stroke-dasharray: 3 3; } svg .tick, svg .axis { fill: #555; }
svg.timeline { background: #fff; font-size: 11px; }
.legend span { margin-right: 14px; white-space: nowrap; }
"""


def legend(runs: list[RunData], chart: Chart) -> str:
    items = []
    for line in chart.lines:
        color = COLORS[line.run % len(COLORS)]
        dash = DASHES[line.dash % len(DASHES)]
        sample = (
            f'<svg width="28" height="8"><path d="M0 4 L28 4" stroke="{color}" stroke-width="2"'
            + (f' stroke-dasharray="{dash}"' if dash else "")
            + "/></svg>"
        )
        name = line.metric if len(runs) == 1 else f"{runs[line.run].label}: {line.metric}"
        items.append(f"<span>{sample} {html.escape(name)}</span>")
    for what in dict.fromkeys(what for _, _, what in chart.marks):
        words = "skipped step (non-finite gradients)" if what == "skipped step" else what
        items.append(f"<span>× {html.escape(words)}</span>")
    return '<div class="legend">' + "".join(items) + "</div>"


def render(runs: list[RunData], preface: tuple[str, str] | None = None) -> str:
    """The whole page."""
    esc = html.escape
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>cumulus report: {esc(', '.join(r.label for r in runs))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>cumulus report ({len(runs)} run{'s' if len(runs) > 1 else ''})</h1>",
        f"<p>Written {when} from each run's metrics.jsonl and .hydra/config.yaml.</p>",
        *([f"<h2>{esc(preface[0])}</h2><pre>{esc(preface[1])}</pre>"] if preface else []),
        "<h2>Runs</h2><table><tr><th>run</th><th>directory</th><th>world</th>"
        "<th>last values</th></tr>",
    ]
    for i, run in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        note = f" ({run.unreadable} unreadable lines skipped)" if run.unreadable else ""
        out.append(
            f'<tr><td><span class="swatch" style="background:{color}"></span>{esc(run.label)}</td>'
            f"<td>{esc(str(run.path))}</td><td>{esc(layout(run))}</td>"
            f"<td>{esc(run_line(run))}{esc(note)}</td></tr>"
        )
    out.append("</table>")
    if len(runs) > 1:
        rows = config_differences(runs)
        out.append("<h2>Config differences</h2>")
        if rows and rows[0][0] == WORLD_ROW and len(rows) == 1:
            out.append("<p>The runs' configs are the same; they ran on different worlds.</p>")
        if rows:
            head = "".join(f"<th>{esc(r.label)}</th>" for r in runs)
            out.append(f"<table><tr><th>key</th>{head}</tr>")
            for key, values in rows:
                cells = "".join(f"<td>{esc(v)}</td>" for v in values)
                out.append(f"<tr><td>{esc(key)}</td>{cells}</tr>")
            out.append("</table>")
        else:
            out.append("<p>The runs' configs are the same.</p>")
        out.append("<h2>Records compared (python -m trainer.compare)</h2>")
        for title, text in compare_tables(runs):
            out.append(f"<h3>{esc(title)}</h3><pre>{esc(text)}</pre>")
    out.append('<h2>Curves</h2><div class="charts">')
    for chart in charts(runs):
        drawing = svg(chart)
        if drawing:
            out.append(
                f"<figure><figcaption>{esc(chart.title)}</figcaption>{drawing}"
                f"{legend(runs, chart)}</figure>"
            )
    out.append("</div>")
    flat = sorted(
        m
        for m in {m for run in runs for m in run.series}
        if m not in MAIN_METRICS and constant(runs, m) is not None
    )
    if flat:
        values = ", ".join(f"{m} = {constant(runs, m):g}" for m in flat)
        out.append(f"<p>Constant in every record: {esc(values)}.</p>")
    out += where_time_goes(runs)
    out.append("<h2>End of run</h2>")
    for run in runs:
        text = run.summary or "no summary yet: the run is still going, or it stopped early"
        out.append(f"<h3>{esc(run.label)}</h3><pre>{esc(text)}</pre>")
        if run.config_text:
            out.append(
                f"<details><summary>config of {esc(run.label)}</summary>"
                f"<pre>{esc(run.config_text)}</pre></details>"
            )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def rank_table(run: RunData) -> str:
    """Each rank's mean seconds per step in each phase (the slowest in bold), its
    checkpoint and evaluation totals, and in how many records it was the slowest."""
    table = run.ranks or {}
    phases = ("data", "compute", "sync", "optimizer")
    rows = table.get("ranks", [])
    worst = {p: max((r["mean_s"].get(p, 0.0) for r in rows), default=0.0) for p in phases}
    head = "".join(f"<th>{p} (s/step)</th>" for p in phases)
    out = [
        f"<table><tr><th>rank</th><th>host</th>{head}<th>checkpoints (s)</th>"
        "<th>evaluations (s)</th><th>clearly the slowest in (records)</th></tr>"
    ]
    for row in rows:
        cells = []
        for p in phases:
            value = row["mean_s"].get(p, 0.0)
            text = f"{value:.4f}"
            cells.append(
                f"<td><b>{text}</b></td>" if value == worst[p] and value else f"<td>{text}</td>"
            )
        slowest = ", ".join(f"{p} {n}" for p, n in row.get("slowest_records", {}).items() if n)
        totals = row.get("total_s", {})
        out.append(
            f"<tr><td>{row['rank']}</td><td>{html.escape(str(row.get('host')))}</td>"
            + "".join(cells)
            + f"<td>{totals.get('checkpoint', 0.0):.2f}</td><td>{totals.get('eval', 0.0):.2f}</td>"
            + f"<td>{html.escape(slowest or '-')}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def where_time_goes(runs: list[RunData]) -> list[str]:
    """Each run's per-rank table and, when it was profiled, the timeline of its profiled
    steps (one lane per rank)."""
    esc = html.escape
    out = []
    for run in runs:
        if run.ranks is None and run.timeline is None:
            continue
        out.append(f"<h2>Where the time goes: {esc(run.label)}</h2>")
        if run.ranks is not None:
            records, steps = run.ranks.get("records", 0), run.ranks.get("steps", 0)
            out.append(
                "<p>Mean seconds per optimizer step of each rank over "
                f"{counted(records, 'record')} ({counted(steps, 'step')}) of the last launch "
                f"({TABLE_FILE}). <i>sync</i> is time spent waiting inside collectives: the "
                "ranks that wait longest are the fast ones.</p>"
            )
            out.append(rank_table(run))
        if run.timeline is not None:
            out.append(
                f"<p>The profiled steps ({TIMELINE_FILE}: open it in Perfetto, ui.perfetto.dev, "
                "for every operator):</p>"
            )
            out.append(timeline_svg(run.timeline) + phase_legend())
    return out


def build_report(
    paths: list[Path],
    out: Path,
    names: list[str] | None = None,
    preface: tuple[str, str] | None = None,
) -> Path:
    """Write the page of `paths` (run directories or metrics.jsonl files) to `out`,
    atomically (a reader never sees half a page). `names` label the runs (default: the
    shortest distinct ends of their paths); `preface` is a (title, text) shown first."""
    runs = [load_run(p, "") for p in paths]
    for run, label in zip(runs, names or labels([r.path for r in runs])):
        run.label = label
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(render(runs, preface), encoding="utf-8")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def write_run_report(run_dir: Path, summary: str | None) -> None:
    """At the end of a run (rank 0): `summary.txt` and `report.html` in its directory. A
    report that cannot be written is a warning: it never fails the run."""
    try:
        if summary is not None:
            (run_dir / SUMMARY_FILE).write_text(summary + "\n", encoding="utf-8")
        if (run_dir / "metrics.jsonl").is_file():
            build_report([run_dir], run_dir / "report.html")
    except Exception as exc:
        print(f"WARNING: report.html not written ({type(exc).__name__}: {exc})", file=sys.stderr)
