"""How long a checkpoint stalls training: inline writes vs `checkpoint.async_save=true`.

    python scripts/bench_checkpoint.py [--saves 4] [--steps-between 3] [hydra overrides...]

The stall is the time the fit loop spends inside `save()`: the whole write and commit when
inline; the snapshot to CPU memory (plus any wait for the previous write) in the background
mode. Modes alternate; rank 0 appends medians to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.distributed import init_distributed, shutdown_distributed  # noqa: E402
from scripts.bench import make_run  # noqa: E402
from trainer.config import register_configs  # noqa: E402
from trainer.fit import fit, save  # noqa: E402
from trainer.identity import register_resolvers  # noqa: E402


def ms(values: list[float]) -> str:
    return ", ".join(f"{1000 * v:.0f}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--steps-between", type=int, default=3)
    ap.add_argument("--report", default=str(REPO / "docs" / "benchmarks.md"))
    args, overrides = ap.parse_known_args()
    register_configs()
    register_resolvers()
    info = init_distributed()
    stalls: dict[str, list[float]] = {"inline": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        total = 2 * args.saves * args.steps_between + 10
        run = make_run(
            [
                "logger=none",
                "eval.every_steps=0",
                "checkpoint.every_steps=0",
                "checkpoint.resume=never",
                f"train.max_steps={total}",
                f"train.log_every={total}",
                "checkpoint.keep_last=2",
                *overrides,
            ],
            Path(tmp),
            info,
        )
        state_mb = sum(p.numel() * p.element_size() for p in run.ctx.model.parameters()) / 2**20
        for i in range(2 * args.saves):
            mode = "async" if i % 2 else "inline"
            run.checkpointer.background = mode == "async"
            run.cfg.train.max_steps = run.step + args.steps_between
            fit(run)  # training between saves gives the background writer time to finish
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            t0 = time.perf_counter()
            save(run)
            stalls[mode].append(time.perf_counter() - t0)
        run.checkpointer.wait()
    if info.is_main:
        inline, bg = statistics.median(stalls["inline"]), statistics.median(stalls["async"])
        dev = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "CPU"
        lines = [
            f"\n### Checkpoint stall: inline vs background writes ({dev})",
            f"\n{datetime.date.today()}, torch {torch.__version__}, parameters {state_mb:.0f} MB "
            "(a checkpoint holds ~3x: weights and AdamW moments). Command:\n\n"
            f"    python scripts/bench_checkpoint.py {' '.join(sys.argv[1:])}\n",
            "| mode | stall per checkpoint (median ms) | all (ms) |",
            "|---|---|---|",
            f"| inline | {1000 * inline:.0f} | {ms(stalls['inline'])} |",
            f"| checkpoint.async_save=true | {1000 * bg:.0f} | {ms(stalls['async'])} |",
            f"\nThe background writer removes {1 - bg / inline:.0%} of the stall.",
        ]
        text = "\n".join(lines)
        print(text)
        with open(args.report, "a") as fh:
            fh.write(text + "\n")
    shutdown_distributed()


if __name__ == "__main__":
    main()
