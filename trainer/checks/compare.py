"""Do two runs' records agree? The comparison behind `python -m trainer.compare RUN_A RUN_B`.

cumulus promises that a run's trajectory depends on the global batch, not on how it is split
over ranks and micro-batches; this is that check as a tool. It reads both runs'
`metrics.jsonl`, pairs the values of each metric by step (training and validation records
apart: they have their own keys), and prints the largest difference per metric over the
steps both runs recorded. Exit 0 when every metric agrees within the tolerance, 1 when one
does not, 2 when a run has no records or the runs share no step.

Metrics that measure the machine (timing, throughput, memory, utilization) never match
between two runs and are left out by one naming rule that every metric follows
(`measures_machine`); so are text samples. A value recorded as `null` (non-finite) matches
only `null`.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass
from pathlib import Path

# The naming rule (README, "Records"): a metric that measures the machine, not the trajectory,
# ends a segment of its name (between slashes) with a unit of time, rate or memory, is a
# utilization, or names the rank that measured it (`_rank`: the slowest rank of a phase).
# `train/pp_peak_mem_mb/stage0`, `train/tokens_per_s`, `train/pp_bubble`, `time/data_rank`
# are; `train/loss_scale` is not. A new metric named by the rule is left out without a change
# here.
MACHINE_SUFFIXES = ("_s", "_ms", "_per_s", "_mb", "_gb", "_bytes", "mfu", "bubble", "_rank")
NOT_METRICS = {"step", "non_finite"}
EXIT_DIFFERENT, EXIT_BAD_INPUT = 1, 2

Series = dict[int, float | None]  # step -> value (None: recorded as non-finite)


class CompareError(Exception):
    """A run that cannot be compared: printed as one paragraph, exit 2."""


def metrics_file(run: str | Path) -> Path:
    """`run`'s `metrics.jsonl`: `run` is a run directory or the file itself."""
    path = Path(run)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        where = (
            f"the directory {path} has no metrics.jsonl"
            if path.is_dir()
            else f"{path} does not exist"
        )
        raise CompareError(
            f"{where}. Give a run directory (the trainer's hydra.run.dir, where rank 0 writes "
            "metrics.jsonl) or the metrics.jsonl file itself"
        )
    return file


def read_series(run: str | Path) -> dict[str, Series]:
    """Every numeric metric of `run`, by step. A step recorded twice (an old run resumed
    before records were deduplicated) keeps its last value, as the resumed run computed it."""
    file = metrics_file(run)
    records = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            int(record["step"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CompareError(
                f"{file}, line {number}, is not a cumulus record (a JSON object with a "
                f"`step`): {exc}; was it written by another program, or cut off?"
            ) from None
        records.append(record)
    return series_of(records)


def series_of(records: list[dict]) -> dict[str, Series]:
    """The numeric metrics of `records` (each with a `step`), by step; the last record of a
    step wins. Strings, lists and flags are not metrics; `null` stays None (non-finite)."""
    series: dict[str, Series] = {}
    for record in records:
        step = int(record["step"])
        for key, value in record.items():
            if key in NOT_METRICS or isinstance(value, bool | str | list | dict):
                continue
            if value is None or (isinstance(value, float) and not math.isfinite(value)):
                series.setdefault(key, {})[step] = None
            elif isinstance(value, int | float):
                series.setdefault(key, {})[step] = float(value)
    return series


@dataclass
class Difference:
    """The largest disagreement of one metric over the common steps."""

    metric: str
    steps: int  # common steps
    max_abs: float  # max |a - b| (inf where one side is null and the other is not)
    at_step: int
    max_rel: float  # max |a - b| / max(|a|, |b|)
    within: bool


def difference(metric: str, a: Series, b: Series, atol: float, rtol: float) -> Difference | None:
    """`metric` compared over the steps both series hold (None when they share none)."""
    steps = sorted(a.keys() & b.keys())
    if not steps:
        return None
    worst = Difference(metric, len(steps), 0.0, steps[0], 0.0, True)
    for step in steps:
        x, y = a[step], b[step]
        if x is None or y is None:
            delta, rel, ok = (0.0, 0.0, True) if x is y else (math.inf, math.inf, False)
        else:
            delta = abs(x - y)
            scale = max(abs(x), abs(y))
            rel = delta / scale if scale else 0.0
            ok = delta <= atol + rtol * scale
        if delta > worst.max_abs:
            worst.max_abs, worst.at_step = delta, step
        worst.max_rel = max(worst.max_rel, rel)
        worst.within &= ok
    return worst


def measures_machine(metric: str) -> bool:
    """True for a timing, throughput, memory or utilization metric, or the rank that measured
    one (`MACHINE_SUFFIXES`)."""
    return any(part.endswith(MACHINE_SUFFIXES) for part in metric.split("/"))


def selected(metric: str, keys: list[str], ignore: list[str]) -> bool:
    if keys:
        return any(fnmatch.fnmatchcase(metric, p) for p in keys)
    if measures_machine(metric):
        return False
    return not any(fnmatch.fnmatchcase(metric, p) for p in ignore)


def compare(
    run_a: str | Path,
    run_b: str | Path,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    keys: list[str] | None = None,
    ignore: list[str] | None = None,
) -> tuple[list[Difference], dict[str, list[str]]]:
    """The per-metric differences of two runs, and the metrics only one of them recorded
    (`{"a": [...], "b": [...]}`). Raises `CompareError` when they share no step."""
    a, b = read_series(run_a), read_series(run_b)
    names_a = {m for m in a if selected(m, keys or [], ignore or [])}
    names_b = {m for m in b if selected(m, keys or [], ignore or [])}
    diffs = [
        d
        for m in sorted(names_a & names_b)
        if (d := difference(m, a[m], b[m], atol, rtol)) is not None
    ]
    if not diffs:
        raise CompareError(
            f"{run_a} and {run_b} share no step of any metric{_steps_hint(a, b)}: compare runs "
            "of the same configuration (their train.log_every and eval.every_steps must meet), "
            "or check --keys"
        )
    only = {"a": sorted(names_a - names_b), "b": sorted(names_b - names_a)}
    return diffs, only


def _steps_hint(a: dict[str, Series], b: dict[str, Series]) -> str:
    def span(series: dict[str, Series]) -> str:
        steps = {s for values in series.values() for s in values}
        return f"steps {min(steps)}-{max(steps)}" if steps else "no metric"

    return f" (the first records {span(a)}, the second {span(b)})"


def report(diffs: list[Difference], only: dict[str, list[str]], atol: float, rtol: float) -> str:
    """The table `python -m trainer.compare` prints: one line per metric, then the verdict."""
    width = max(len("metric"), *(len(d.metric) for d in diffs))
    lines = [f"{'metric':<{width}}  steps  {'max |diff|':>10}  at step  {'max rel':>9}"]
    for d in diffs:
        flag = "" if d.within else "  <- outside tolerance"
        lines.append(
            f"{d.metric:<{width}}  {d.steps:>5}  {d.max_abs:>10.2e}  {d.at_step:>7}  "
            f"{d.max_rel:>9.2e}{flag}"
        )
    for side, name in (("a", "first"), ("b", "second")):
        if only[side]:
            lines.append(f"only in the {name} run (not compared): {', '.join(only[side])}")
    bad = [d for d in diffs if not d.within]
    tol = f"|diff| <= {atol:g} + {rtol:g} x |value|"
    if bad:
        names = ", ".join(f"{d.metric} (step {d.at_step})" for d in bad)
        lines.append(f"DIFFERENT: {len(bad)} of {len(diffs)} metrics outside {tol}: {names}")
    else:
        every = "the 1 metric" if len(diffs) == 1 else f"all {len(diffs)} metrics"
        lines.append(f"SAME: {every} within {tol}")
    return "\n".join(lines)
