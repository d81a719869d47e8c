"""report.html: every run writes one, `python -m trainer.report` overlays any runs, and the page
is self-contained (no request can leave it).

Two real runs share the module: B differs from A in its learning rate and has one step
skipped (an injected non-finite gradient). The charts are parsed back from the SVG: every
series holds one point per finite record of its metric in metrics.jsonl (read here as plain
JSON), at coordinates that are one affine map of (step, value) per chart. With Chromium
installed, the pages are also rendered headless: the browser's DOM holds the same series, and
a screenshot is kept (CUMULUS_TEST_ARTIFACTS, or the test's temporary directory).
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY, read_metrics, train_in_process
from tests.ranks import explain, launch_all, run_cli, run_torchrun
from trainer.tracking.plots import MAX_POINTS, reduce

INJECT = "tests.precision_support.InjectNonFinite"
COMMON = [*TINY, "train.max_steps=8", "eval.every_steps=4", "eval.max_batches=2"]
ARGS = {
    "a": COMMON,
    "b": [*COMMON, "optim.lr=0.001", f"+callbacks.nan._target_={INJECT}", "+callbacks.nan.step=5"],
}
MAIN = ("train/loss", "val/loss", "train/lr", "train/grad_norm", "train/tokens_per_s")


class Runs:
    def __init__(self, root: Path) -> None:
        self.dirs = {name: root / name for name in ARGS}
        cmds = {
            name: [sys.executable, "-m", "trainer.train", *args, f"hydra.run.dir={self.dirs[name]}"]
            for name, args in ARGS.items()
        }
        self.procs = launch_all(cmds, timeout=180)
        self.both = root / "both.html"
        self.report = run_cli(
            [*map(str, self.dirs.values()), "-o", str(self.both)],
            module="trainer.report",
            timeout=60,
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    runs = Runs(tmp_path_factory.mktemp("report"))
    for proc in runs.procs.values():
        assert proc.returncode == 0, explain(proc)
    assert runs.report.returncode == 0, explain(runs.report)
    return runs


def charts(page: str) -> list[ET.Element]:
    """Every chart of the page, parsed as XML (so each is well formed)."""
    return [ET.fromstring(m) for m in re.findall(r'<svg class="chart".*?</svg>', page, flags=re.S)]


def points(d: str) -> list[list[tuple[float, float]]]:
    """The segments of a path's `d` (`M x y L x y ... M ...`), as lists of points."""
    segments: list[list[tuple[float, float]]] = []
    for command, x, y in re.findall(r"([ML])\s*(-?[\d.]+)[ ,](-?[\d.]+)", d):
        if command == "M":
            segments.append([])
        segments[-1].append((float(x), float(y)))
    assert re.sub(r"[ML]\s*-?[\d.]+[ ,]-?[\d.]+", "", d).strip() == "", d
    return segments


def complete_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl's complete lines (a run may be writing the last one)."""
    text = (run_dir / "metrics.jsonl").read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines]


def finite_points(run_dir: Path, metric: str) -> list[tuple[int, float]]:
    return [
        (r["step"], r[metric])
        for r in complete_records(run_dir)
        if isinstance(r.get(metric), int | float) and math.isfinite(r[metric])
    ]


def check_page(
    page: str, run_dirs: list[Path]
) -> dict[tuple[int, str], list[list[tuple[float, float]]]]:
    """Every series of the page against the records; returns the segments by (run, metric)."""
    found: dict[tuple[int, str], list[list[tuple[float, float]]]] = {}
    for chart in charts(page):
        log_y = "(log y)" in "".join(chart.itertext())
        pairs = []  # ((step, value), (x, y)) of every point of the chart
        for path in chart.iter("path"):
            if path.get("class") != "series":
                continue
            run, metric = int(path.get("data-run")), path.get("data-metric")
            segments = points(path.get("d"))
            found[(run, metric)] = segments
            want = finite_points(run_dirs[run], metric)
            got = [p for segment in segments for p in segment]
            assert len(got) == len(want), (run, metric, len(got), len(want))
            pairs += [(w, g) for w, g in zip(want, got)]
        # One affine map per chart from (step, value) to pixels, to within the 0.1 px rounding.
        f = math.log10 if log_y else (lambda v: v)
        (s0, _), (x0, _) = min(pairs, key=lambda p: p[0][0])
        (s1, _), (x1, _) = max(pairs, key=lambda p: p[0][0])
        (_, va), (_, ya) = min(pairs, key=lambda p: p[0][1])
        (_, vb), (_, yb) = max(pairs, key=lambda p: p[0][1])
        for (step, value), (x, y) in pairs:
            if s1 != s0:
                assert abs(x - (x0 + (step - s0) * (x1 - x0) / (s1 - s0))) <= 0.11, (step, x)
            if vb != va:
                want_y = ya + (f(value) - f(va)) * (yb - ya) / (f(vb) - f(va))
                assert abs(y - want_y) <= 0.11, (value, y)
    return found


@pytest.mark.launches
def test_each_run_writes_its_report(runs: Runs) -> None:
    """The run's own report.html: one series per metric it recorded (constants named in a
    line instead), each with one point per finite record; the skipped step leaves a gap in
    the gradient norm and a mark, and its summary is the run's closing lines."""
    for name, run_dir in runs.dirs.items():
        page = (run_dir / "report.html").read_text()
        found = check_page(page, [run_dir])
        records = read_metrics(run_dir)
        metrics = {k for r in records for k, v in r.items() if isinstance(v, int | float)} - {
            "step"
        }
        constants = {m for m in metrics if len({r[m] for r in records if m in r}) == 1}
        assert {m for _, m in found} == metrics - constants - {"train/skipped_steps"}, name
        assert set(MAIN) <= {m for _, m in found}
        line = re.search(r"Constant in every record: (.*?)\.</p>", page)
        for metric in constants - {"train/skipped_steps"}:
            assert line and metric in line.group(1), metric
        summary = (run_dir / "summary.txt").read_text().strip()
        assert summary.startswith("run finished: step 8/8")
        assert summary in runs.procs[name].stdout
        assert html.escape(summary) in page
        if name == "b":
            norm = found[(0, "train/grad_norm")]
            assert [len(s) for s in norm] == [4, 3], norm  # steps 1-4, gap at 5, 6-8
            assert len(re.findall(r'<path class="mark"', page)) == 1
            assert "skipped step at step 5" in page
        else:
            assert 'class="mark"' not in page


@pytest.mark.launches
def test_overlay_of_two_runs(runs: Runs) -> None:
    """`trainer.report A B`: both runs' series in every chart, the config keys on which they
    differ, and trainer.compare's own table of B against A."""
    page = runs.both.read_text()
    found = check_page(page, list(runs.dirs.values()))
    for metric in MAIN:
        assert (0, metric) in found and (1, metric) in found, metric
    rows = dict(re.findall(r"<tr><td>([\w.]+)</td>(.*?)</tr>", page))
    assert "optim.lr" in rows and "0.001" in rows["optim.lr"]
    assert "callbacks.nan.step" in rows
    assert "train.max_steps" not in rows  # the same in both
    compared = run_cli([*map(str, runs.dirs.values())], module="trainer.compare", timeout=60)
    assert compared.returncode == 1, explain(compared)  # another learning rate: different
    table = compared.stdout.split("\n", 2)[2].strip()  # after the first:/second: lines
    assert html.escape(table) in page


@pytest.mark.multiproc
@pytest.mark.launches
def test_runs_on_other_worlds_are_told_apart(runs: Runs, tmp_path: Path) -> None:
    """Run A's config on 2 ranks: the report of both says the configs are the same but the
    worlds are not, and names each run's world (read from its time_by_rank.json: the config
    does not hold it). Of three runs, each phase's time is a panel of its own, one line per
    run in its colour (not runs x phases lines in one)."""
    two = tmp_path / "two"
    proc = run_torchrun(2, [*COMMON, f"hydra.run.dir={two}"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    pages = {}
    for name, dirs in {"pair": [runs.dirs["a"], two], "three": [*runs.dirs.values(), two]}.items():
        out = tmp_path / f"{name}.html"
        made = run_cli([*map(str, dirs), "-o", str(out)], module="trainer.report", timeout=60)
        assert made.returncode == 0, explain(made)
        pages[name] = out.read_text()
    page = pages["pair"]
    said = "The runs' configs are the same; they ran on different worlds."
    assert said in page and "The runs' configs are the same.</p>" not in page
    worlds = ["1 process, global batch 16", "2 ranks on 1 host: dp 2 (ddp), global batch 32"]
    row = "<tr><td>world (of the run, not in the config)</td>"
    assert row + "".join(f"<td>{w}</td>" for w in worlds) + "</tr>" in page, page
    assert all(f"<td>{w}</td>" in pages["three"] for w in worlds)
    found = check_page(pages["three"], [*runs.dirs.values(), two])
    timed = [m for _, m in found if m.startswith("time/")]
    assert {"time/data_s", "time/compute_s", "time/sync_s", "time/optimizer_s"} <= set(timed)
    for chart in charts(pages["three"]):
        series = [p for p in chart.iter("path") if p.get("class") == "series"]
        metrics = {p.get("data-metric") for p in series}
        if any(m.startswith("time/") for m in metrics):
            assert len(metrics) == 1, metrics
            assert len(series) == len({p.get("data-run") for p in series}) <= 3


@pytest.mark.launches
def test_page_is_self_contained(runs: Runs) -> None:
    """Nothing on the page can make a request: no URL, no reference to another file, no
    script, no stylesheet link, no image source, no CSS url()."""
    for page in [runs.both, *(d / "report.html" for d in runs.dirs.values())]:
        text = page.read_text()
        # (`\b`: a config key such as `profile:` is no `file:` URL.)
        assert not re.search(r"\b(?:https?|ftp|file):|//[\w.-]+\.\w", text), page
        assert not re.search(r"\b(src|href|xlink:href|srcset|action)\s*=", text, re.I), page
        assert not re.search(r"<(script|link|img|iframe|object|embed)\b|url\(|@import", text, re.I)


@pytest.mark.launches
def test_report_of_a_run_being_written(runs: Runs, tmp_path: Path) -> None:
    """A metrics.jsonl whose last line is still being written: the page is made from the
    complete lines, and says one line was skipped; no summary yet."""
    run_dir = tmp_path / "live"
    (run_dir / ".hydra").mkdir(parents=True)
    shutil.copy(runs.dirs["a"] / ".hydra" / "config.yaml", run_dir / ".hydra" / "config.yaml")
    lines = (runs.dirs["a"] / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:5]) + lines[5][:20])
    out = tmp_path / "live.html"
    proc = run_cli([str(run_dir), "-o", str(out)], module="trainer.report", timeout=60)
    assert proc.returncode == 0, explain(proc)
    page = out.read_text()
    check_page(page, [run_dir])
    assert "1 unreadable lines skipped" in page and "no summary yet" in page
    bad = run_cli([str(tmp_path / "nothing"), "-o", str(out)], module="trainer.report", timeout=60)
    assert (
        bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    )


@pytest.mark.launches
def test_report_without_o_goes_into_the_run_directory(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trainer.report RUN` with no -o writes RUN/report.html (it wrote ./report.html into
    whatever directory the shell was in and printed only its name); several runs without -o
    write ./report.html. Either way the full path is printed."""
    from trainer.report import main

    run_dir = tmp_path / "runs" / "a"
    shutil.copytree(runs.dirs["a"], run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    (run_dir / "report.html").unlink()
    elsewhere = tmp_path / "shell"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run_dir / 'report.html'}"
    check_page((run_dir / "report.html").read_text(), [run_dir])
    assert not list(elsewhere.iterdir())
    assert main(["../runs/a/metrics.jsonl", str(runs.dirs["b"])]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {elsewhere / 'report.html'}"
    check_page((elsewhere / "report.html").read_text(), [run_dir, runs.dirs["b"]])


def test_a_report_error_never_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """report.html cannot be written (a directory is in its place): one warning, and the run
    ends as usual, leaving no temporary file."""
    run_dir = tmp_path / "run"
    (run_dir / "report.html").mkdir(parents=True)
    records = train_in_process([*TINY, "train.max_steps=2"], run_dir)
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "report.html not written" in warnings[0], warnings
    assert (run_dir / "summary.txt").read_text().startswith("run finished: step 2/2")
    assert not list(run_dir.glob(".report*"))


def test_long_series_keep_their_extremes() -> None:
    """Above MAX_POINTS points a series is cut to about MAX_POINTS, keeping each range's
    minimum and maximum (a spike survives) and its gaps."""
    series: list[tuple[int, float | None]] = [(s, math.sin(s / 500)) for s in range(1, 20001)]
    series[7000] = (7001, 50.0)
    series[12000] = (12001, None)
    kept = reduce(series)
    assert len(kept) <= MAX_POINTS * 1.5
    assert (7001, 50.0) in kept
    assert any(v is None for _, v in kept)
    steps = [s for s, _ in kept]
    assert steps == sorted(steps)
    finite = [v for _, v in series if v is not None]
    assert min(v for _, v in kept if v is not None) == min(finite)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.launches
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_pages_render_in_headless_chromium(runs: Runs, tmp_path: Path) -> None:
    """Headless Chromium, network off: its DOM of each page holds the same series as the
    file, and the screenshot (kept) is not blank."""
    out = Path(os.environ.get("CUMULUS_TEST_ARTIFACTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    pages = {"report_one_run": runs.dirs["b"] / "report.html", "report_two_runs": runs.both}
    for name, page in pages.items():
        flags = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}",
        ]
        dom = subprocess.run(
            [*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=60
        )
        assert dom.returncode == 0, dom.stderr[-2000:]
        text = page.read_text()
        assert dom.stdout.count('class="series"') == text.count('class="series"') > 0
        shot = out / f"{name}.png"
        proc = subprocess.run(
            [*flags, "--window-size=1280,1800", f"--screenshot={shot}", page.as_uri()],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0 and shot.stat().st_size > 20_000, proc.stderr[-2000:]
        image = pytest.importorskip("PIL.Image").open(shot).convert("RGB")
        colors = image.getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 50, "the screenshot looks blank"


def test_config_reads_as_omegaconf_reads_it(tmp_path: Path) -> None:
    """The report reads `.hydra/config.yaml` with PyYAML's loader: every value OmegaConf wrote
    (strings YAML would take for numbers, booleans or null, tiny and huge floats, unresolved
    interpolations, lists, empty mappings) comes back as `OmegaConf.load` reads it."""
    from omegaconf import OmegaConf

    from trainer.tracking.report import flatten, load_run

    config = {
        "strings": {"exp": "1e-3", "yes": "on", "none": "null", "num": "12", "dot": ".5"},
        "floats": {"small": 1e-05, "lr": 0.003, "big": 1e20, "inf": math.inf},
        "other": {"ref": "${strings.exp}", "list": [1, "2", None, True], "empty": {}},
        "int": 7,
    }
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    want = OmegaConf.to_container(OmegaConf.load(tmp_path / ".hydra" / "config.yaml"))
    got = load_run(tmp_path, "run").config
    assert got == flatten(want)
    assert [type(v) for v in got.values()] == [type(v) for v in flatten(want).values()]
    assert got["strings.exp"] == "1e-3" and got["floats.small"] == 1e-05
