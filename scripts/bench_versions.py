"""Two checkouts of cumulus interleaved: the default job's throughput and its start-up time.

    git worktree add /tmp/before <commit>
    python scripts/bench_versions.py --before /tmp/before --after . [--rounds 3] [--steps 60]

Each round runs both checkouts, in alternating order, each from its own directory:

- start-up: a 1-step run of the default job: wall time from the command's launch to its
  first record in metrics.jsonl (the first optimizer step done), and to its exit;
- throughput: the default job (`make train`'s model and data) for `--steps` steps, logging
  every 10: the median tokens/s of its records after the first.

Checkpoints, evaluation and W&B are off in both, so the figures are the step loop's. Rank 0
appends the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench import report  # noqa: E402

QUIET = ["logger=none", "eval.every_steps=0", "checkpoint.every_steps=0"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    env.pop("PYTHONPATH", None)  # each checkout imports its own code (it is the cwd)
    return env


def start_up(tree: Path) -> tuple[float, float, float]:
    """(seconds to the first record, seconds to exit, CPU seconds) of a 1-step run from
    `tree`. CPU time (user + sys) is steadier than wall time on a shared machine."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, "-m", "trainer.train", *QUIET, "train.max_steps=1"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [*cmd, f"hydra.run.dir={tmp}"], cwd=tree, env=_env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        first = None
        while proc.poll() is None:
            if first is None and metrics.exists() and metrics.stat().st_size:
                first = time.perf_counter() - t0
            time.sleep(0.005)
        total = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"{tree}: exit {proc.returncode}\n{proc.stderr.read()}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return (first if first is not None else total), total, cpu


def throughput(tree: Path, steps: int) -> float:
    """Median tokens/s of the default job's records after the first, from `tree`."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "trainer.train", *QUIET, f"train.max_steps={steps}",
            "train.log_every=10", f"hydra.run.dir={tmp}",
        ]  # fmt: skip
        subprocess.run(cmd, cwd=tree, env=_env(), check=True, capture_output=True)
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        rates = [json.loads(line).get("train/tokens_per_s") for line in lines]
        return statistics.median([r for r in rates if r is not None][1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--after", default=REPO, type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--label", default="")
    ap.add_argument("--report", default=str(REPO / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    res: dict[str, dict[str, list[float]]] = {
        n: {"first": [], "exit": [], "cpu": [], "tok": []} for n in trees
    }
    for r in range(args.rounds):
        names = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in names:
            first, total, cpu = start_up(trees[name])
            res[name]["first"].append(first)
            res[name]["exit"].append(total)
            res[name]["cpu"].append(cpu)
            res[name]["tok"].append(throughput(trees[name], args.steps))
            print(name, {k: round(v[-1], 2) for k, v in res[name].items()}, flush=True)

    def cell(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    ratios = [a / b for a, b in zip(res["after"]["tok"], res["before"]["tok"])]
    lines = [
        f"\n### {args.label or 'Before vs after'}: the default job, start-up and throughput "
        f"(CPU, {os.cpu_count()} cores)",
        f"\n{datetime.date.today()}, OMP_NUM_THREADS={_env()['OMP_NUM_THREADS']}, "
        f"{args.rounds} interleaved rounds, medians (min-max). Command:\n",
        f"    python scripts/bench_versions.py --before {args.before} --after {args.after} "
        f"--rounds {args.rounds} --steps {args.steps}\n",
        "| checkout | launch to first step, s | launch to exit (1 step), s | CPU s (1 step) | "
        f"tokens/s ({args.steps} steps) |",
        "|---|---|---|---|---|",
        *(
            f"| {name} ({trees[name].name}) | {cell(v['first'], '.2f')} | {cell(v['exit'], '.2f')} "
            f"| {cell(v['cpu'], '.2f')} | {cell(v['tok'], ',.0f')} |"
            for name, v in res.items()
        ),
        f"\nThroughput after / before: {statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}-{max(ratios):.3f}).",
    ]
    report(lines, args.report)


if __name__ == "__main__":
    main()
