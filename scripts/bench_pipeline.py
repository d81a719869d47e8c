"""Pipeline schedules on gloo: step time and bubble fraction per schedule and accumulation.

    python scripts/bench_pipeline.py [--accum 4 8 16] [--steps 12] [--report FILE]

For each accumulation count, one process without a pipeline (the reference), then
`torchrun --nproc_per_node=2 ... dist.pp=2` with each schedule (`interleaved_1f1b` with
`dist.pp_virtual=2`), all on the same model and global batch, and reads their
`metrics.jsonl`: the median step time over the steps after the first log interval, the
measured bubble (`train/pp_bubble`: the fraction of the schedule's time the ranks spent
blocked in receives) and the ideal bubble of the schedule (engine/parallel/pipeline/schedule.py's
`simulate`, forward and backward costing the same), and the largest difference of
`train/loss` against the reference (the exactness check, per run).

Prints a Markdown table (and writes it to `--report`). On this 2-core machine two ranks share
the cores with nothing else to do, so step times say how the schedules compare, not what a
pipeline gains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.parallel.pipeline.schedule import actions, simulate  # noqa: E402

MODEL = [
    "model=gpt_tiny",
    "model.n_layer=8",
    "model.n_embd=64",
    "model.n_head=4",
    "data.block_size=64",
    "logger=none",
    "train.micro_batch_size=4",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "scheduler.warmup_steps=2",
    "train.log_every=2",
]
SCHEDULES = {"gpipe": [], "1f1b": [], "interleaved_1f1b": ["dist.pp_virtual=2"]}


def ideal_bubble(schedule: str, pp: int, n_micro: int, virtual: int) -> float:
    """1 - useful work / schedule length, each action one time unit."""
    lists = [actions(schedule, pp, r, n_micro, virtual) for r in range(pp)]
    rounds = simulate(lists, pp * virtual)
    return 1 - len(lists[0]) / rounds


def run(args: list[str], nproc: int, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    launcher = [sys.executable, *(torchrun if nproc > 1 else []), "-m", "trainer.train"]
    cmd = [*launcher, *args, f"hydra.run.dir={out}"]
    subprocess.run(cmd, check=True, cwd=REPO, env=env, capture_output=True)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "train/loss" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accum", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--report", type=Path)
    a = parser.parse_args()
    rows = [
        "| accumulation | run | step time (ms, median) | bubble measured | bubble ideal | "
        "max abs loss diff vs 1 process |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for accum in a.accum:
            base = [*MODEL, f"train.max_steps={a.steps}", f"train.grad_accum_steps={accum}"]
            ref = run(base, 1, Path(tmp) / f"ref{accum}")
            time_ms = statistics.median(r["train/step_time_ms"] for r in ref[1:])
            rows.append(f"| {accum} | 1 process | {time_ms:.0f} | | | |")
            for name, extra in SCHEDULES.items():
                recs = run(
                    [*base, "dist.pp=2", f"dist.pp_schedule={name}", *extra],
                    2,
                    Path(tmp) / f"{name}{accum}",
                )
                diff = max(abs(x["train/loss"] - y["train/loss"]) for x, y in zip(ref, recs))
                virtual = 2 if extra else 1
                rows.append(
                    f"| {accum} | pp=2 {name}{' (virtual 2)' if extra else ''} | "
                    f"{statistics.median(r['train/step_time_ms'] for r in recs[1:]):.0f} | "
                    f"{statistics.mean(r['train/pp_bubble'] for r in recs[1:]):.2f} | "
                    f"{ideal_bubble(name, 2, accum, virtual):.2f} | {diff:.1e} |"
                )
                print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if a.report:
        a.report.write_text(table + "\n")


if __name__ == "__main__":
    main()
