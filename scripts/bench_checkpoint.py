"""How long a checkpoint stalls training, how much one rank writes, and how long a resume
takes: `checkpoint.format=full|sharded`, each inline and with `checkpoint.async_save=true`.

    torchrun --nproc_per_node=N scripts/bench_checkpoint.py [--saves 3] [--steps-between 3]
        [--formats full,sharded] [hydra overrides...]

The stall is the time the fit loop spends inside `save()`: the whole write and commit when
inline; the snapshot to CPU memory (plus any wait for the previous write) in the background
mode. "Largest write" is the most bytes any one rank wrote into a checkpoint: all of it on
rank 0 for `full`, about 1/N for `sharded`. The resume time loads the last checkpoint of each
layout into the running model (the checksums were verified once before, as a resume does).
Modes alternate; rank 0 appends medians to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.checkpoint import checkpoint_name, load_checkpoint  # noqa: E402
from engine.distributed import (  # noqa: E402
    broadcast_object,
    init_distributed,
    shutdown_distributed,
)
from scripts.bench import make_run, report  # noqa: E402
from trainer.config.schema import register_configs  # noqa: E402
from trainer.run.fit import fit, save  # noqa: E402
from trainer.run.identity import register_resolvers  # noqa: E402


def ms(values: list[float]) -> str:
    return ", ".join(f"{1000 * v:.0f}" for v in values)


def largest_write_mb(path: Path) -> float:
    """Bytes written by the rank that wrote most: rank r writes `shards/__r_*`, rank 0 the rest."""
    files = json.loads((path / "manifest.json").read_text())["files"]
    per_rank: dict[int, int] = {}
    for name, meta in files.items():
        leaf = name.rsplit("/", 1)[-1]
        rank = int(leaf[2:].split("_")[0]) if leaf.startswith("__") else 0
        per_rank[rank] = per_rank.get(rank, 0) + int(meta["size"])
    return max(per_rank.values()) / 2**20


def synced(info) -> None:
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    if info.distributed:
        dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--steps-between", type=int, default=3)
    ap.add_argument("--formats", default="full,sharded")
    ap.add_argument("--report", default=str(REPO / "docs" / "benchmarks.md"))
    args, overrides = ap.parse_known_args()
    register_configs()
    register_resolvers()
    info = init_distributed()
    formats = args.formats.split(",")
    modes = list(itertools.product(formats, ("inline", "async")))
    stalls: dict[tuple[str, str], list[float]] = {m: [] for m in modes}
    written: dict[str, float] = {}
    resume: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as own:
        tmp = broadcast_object(own, info)  # one run directory, shared by every rank
        total = len(modes) * args.saves * args.steps_between + 10
        run = make_run(
            [
                "logger=none",
                "eval.every_steps=0",
                "checkpoint.every_steps=0",
                "checkpoint.resume=never",
                f"train.max_steps={total}",
                f"train.log_every={total}",
                f"checkpoint.keep_last={len(modes) * args.saves}",
                *overrides,
            ],
            Path(tmp),
            info,
        )
        state_mb = sum(p.numel() * p.element_size() for p in run.ctx.model.parameters()) / 2**20
        last: dict[str, int] = {}
        for i in range(len(modes) * args.saves):
            fmt, mode = modes[i % len(modes)]
            run.checkpointer.settle()
            run.checkpointer.sharded = run.state.sharded = fmt == "sharded"
            run.checkpointer.background = mode == "async"
            run.settings.train.max_steps = run.step + args.steps_between
            fit(run)  # training between saves gives the background writer time to finish
            synced(info)
            t0 = time.perf_counter()
            save(run)
            stalls[(fmt, mode)].append(time.perf_counter() - t0)
            last[fmt] = run.step
        run.checkpointer.settle()
        synced(info)
        for fmt, step in last.items():
            path = run.checkpoint_dir / checkpoint_name(step)
            written[fmt] = largest_write_mb(path)
            synced(info)
            t0 = time.perf_counter()
            run.state.load(load_checkpoint(path, info, checksums=False))
            synced(info)
            resume[fmt] = time.perf_counter() - t0
        synced(info)  # rank 0 deletes the directory on leaving
    if info.is_main:
        dev = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "CPU"
        launcher = f"torchrun --nproc_per_node={info.world_size}" if info.distributed else "python"
        lines = [
            f"\n### Checkpoints: full vs sharded, inline vs background ({dev}, "
            f"{info.world_size} rank(s), {run.state.config['dist']['strategy']})",
            f"\n{datetime.date.today()}, torch {torch.__version__}, parameters {state_mb:.0f} MB "
            "(a checkpoint holds ~3x: weights and AdamW moments). Command:\n\n"
            f"    {launcher} scripts/bench_checkpoint.py {' '.join(sys.argv[1:])}\n",
            "| format | mode | stall per checkpoint (median ms) | all (ms) | largest write by one "
            "rank (MB) | resume (ms) |",
            "|---|---|---|---|---|---|",
        ]
        for fmt, mode in modes:
            values = stalls[(fmt, mode)]
            lines.append(
                f"| {fmt} | {mode} | {1000 * statistics.median(values):.0f} | {ms(values)} | "
                f"{written[fmt]:.0f} | {1000 * resume[fmt]:.0f} |"
            )
        report(lines, args.report)
    shutdown_distributed()


if __name__ == "__main__":
    main()
