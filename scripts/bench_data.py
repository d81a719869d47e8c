"""Loader workers hiding an expensive `__getitem__`: tokens/s with `data.num_workers` 0 vs N.

    python scripts/bench_data.py [--workers 2] [--rounds 3] [--steps 40] [--cost sleep|cpu]

The default text data is wrapped so that every sample costs extra time when it is read:
`sleep` (latency: a network filesystem, a remote object store) or `cpu` (a busy loop:
decoding, augmentation). The extra cost per optimizer step is set equal to the step's own
compute, measured first. Each round trains the same run with 0 workers and with `--workers`,
in alternating order, through the real trainer; the report (appended to docs/benchmarks.md)
gives the median tokens/s and the share of the data cost the workers hid.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench import report  # noqa: E402


class Costly:
    """A dataset whose every read costs `seconds` more (slept, or spent in a busy loop)."""

    def __init__(self, dataset: Any, seconds: float, kind: str) -> None:
        self.dataset, self.seconds, self.kind = dataset, seconds, kind

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        if self.kind == "sleep":
            time.sleep(self.seconds)
        else:
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                pass
        return self.dataset[i]


def costly_text(seconds_per_sample: float = 0.0, kind: str = "sleep", **text: Any) -> Any:
    """`data._target_` for this benchmark: the in-tree text data, made costly to read."""
    from trainer.data.text import text_data

    splits = text_data(**text)
    splits.train = Costly(splits.train, seconds_per_sample, kind)
    return splits


BASE = [
    "model=gpt_tiny",
    "logger=none",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "checkpoint.resume=never",
    "train.micro_batch_size=8",
    "train.grad_accum_steps=2",
    "data._target_=scripts.bench_data.costly_text",
]


def tokens_per_s(overrides: list[str], steps: int) -> tuple[float, float]:
    """Median (tokens/s, ms per step) of a run's steps after the first (which includes the
    loader's start-up), as the trainer's own meter records them."""
    from trainer.api import train

    with tempfile.TemporaryDirectory() as tmp:
        records = train([*overrides, f"train.max_steps={steps}", "train.log_every=1"], run_dir=tmp)
    rates = [r["train/tokens_per_s"] for r in records if "train/tokens_per_s" in r][1:]
    times = [r["train/step_time_ms"] for r in records if "train/step_time_ms" in r][1:]
    return statistics.median(rates), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cost", choices=("sleep", "cpu"), default="sleep")
    ap.add_argument("--report", default=str(REPO / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    samples_per_step = 16
    _, step_ms = tokens_per_s([*BASE, "data.num_workers=0"], args.steps)
    per_sample = step_ms / 1000 / samples_per_step  # the data then costs as much as the step
    costly = [*BASE, f"+data.seconds_per_sample={per_sample}", f"+data.kind={args.cost}"]
    res: dict[int, list[tuple[float, float]]] = {0: [], args.workers: []}
    for r in range(args.rounds):
        order = [0, args.workers] if r % 2 == 0 else [args.workers, 0]
        for workers in order:
            res[workers].append(tokens_per_s([*costly, f"data.num_workers={workers}"], args.steps))
            print(workers, res[workers][-1], flush=True)
    plain_ms = step_ms
    rows = []
    for workers, got in res.items():
        ms = statistics.median(t for _, t in got)
        hidden = (plain_ms + plain_ms - ms) / plain_ms  # share of the data cost not paid
        rows.append(
            f"| {workers} | {statistics.median(r for r, _ in got):,.0f} | {ms:.1f} | "
            f"{min(1.0, max(0.0, hidden)):.0%} |"
        )
    lines = [
        f"\n### Loader workers vs an expensive `__getitem__` ({args.cost}), gpt_tiny, CPU "
        f"({os.cpu_count()} cores)",
        f"\n{datetime.date.today()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
        f". Command:\n\n    python scripts/bench_data.py --workers {args.workers} --rounds "
        f"{args.rounds} --steps {args.steps} --cost {args.cost}\n",
        f"Step without the extra cost: {plain_ms:.1f} ms; reading the {samples_per_step} samples "
        f"of a step costs {per_sample * samples_per_step * 1000:.1f} ms more "
        f"({per_sample * 1000:.2f} ms each). Medians over {args.rounds} rounds.\n",
        "| data.num_workers | tokens/s | ms per step | data cost hidden |",
        "|---|---|---|---|",
        *rows,
    ]
    report(lines, args.report)


if __name__ == "__main__":
    main()
