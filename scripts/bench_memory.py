"""Memory benchmark: what FSDP and activation checkpointing save.

    torchrun --standalone --nproc_per_node=2 scripts/bench_memory.py [overrides]   # FSDP vs DDP
    python scripts/bench_memory.py --activation-checkpointing [overrides]          # AC on vs off

FSDP: bytes of parameters + optimizer state held by each rank after one step (local shards of
sharded tensors), DDP vs FSDP; expected about 1/N. Activation checkpointing: peak memory of a
training step (CUDA allocator, or process RSS on CPU) with and without it, each in a fresh
process so the peaks do not mix. Rank 0 appends the figures to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.distributed import init_distributed, shutdown_distributed  # noqa: E402
from scripts.bench import make_run, peak_memory_reset, report  # noqa: E402
from trainer.config.schema import register_configs  # noqa: E402
from trainer.run.fit import fit  # noqa: E402
from trainer.run.identity import register_resolvers  # noqa: E402
from trainer.tracking.records import peak_memory_mb  # noqa: E402


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(run) -> tuple[int, int]:
    params = {id(p): p for p in run.ctx.model.parameters()}
    param_bytes = sum(local_bytes(p) for p in params.values())
    optim_bytes = sum(
        local_bytes(v)
        for s in run.ctx.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return param_bytes, optim_bytes


def base_overrides(steps: int, extra: list[str]) -> list[str]:
    return [
        "logger=none",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "checkpoint.resume=never",
        f"train.max_steps={steps}",
        f"train.log_every={steps}",
        *extra,
    ]


def strategy_memory(overrides: list[str], info) -> dict:
    out = {}
    for strategy in ("ddp", "fsdp"):
        with tempfile.TemporaryDirectory() as tmp:
            run = make_run(
                base_overrides(1, [*overrides, f"dist.strategy={strategy}"]), Path(tmp), info
            )
            fit(run)
            out[strategy] = state_bytes(run)
    return out


def peak_one(ac: bool, overrides: list[str]) -> float:
    """Peak memory of 3 steps in this process (called in a fresh subprocess)."""
    register_configs()
    register_resolvers()
    info = init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(
            base_overrides(3, [*overrides, f"model.activation_checkpointing={str(ac).lower()}"]),
            Path(tmp),
            info,
        )
        run.settings.train.max_steps = 1
        fit(run)  # warm-up: allocator pools, lazy optimizer state
        peak_memory_reset(info.device)
        run.settings.train.max_steps = 3
        fit(run)
        return peak_memory_mb(info.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--peak-one", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--report", default=str(REPO / "docs" / "benchmarks.md"))
    args, overrides = ap.parse_known_args()
    if args.peak_one:
        print(json.dumps({"peak_mb": peak_one(args.peak_one == "on", overrides)}))
        return
    cmd_line = " ".join(sys.argv[1:])
    if args.activation_checkpointing:
        peaks = {}
        for mode in ("off", "on", "off", "on"):  # interleaved, two of each
            proc = subprocess.run(
                [sys.executable, __file__, "--peak-one", mode, *overrides],
                capture_output=True,
                text=True,
                check=True,
            )
            peaks.setdefault(mode, []).append(
                json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]
            )
        off, on = min(peaks["off"]), min(peaks["on"])
        lines = [
            "\n### Activation checkpointing: peak memory of a training step",
            f"\n{datetime.date.today()}, torch {torch.__version__}, "
            f"{'CUDA allocator peak' if torch.cuda.is_available() else 'process peak RSS'}. "
            f"Command:\n\n    python scripts/bench_memory.py {cmd_line}\n",
            "| activation checkpointing | peak MB (min of 2) |",
            "|---|---|",
            f"| off | {off:.0f} |",
            f"| on | {on:.0f} |",
            f"\nSaving: {1 - on / off:.0%} of the peak.",
        ]
    else:
        register_configs()
        register_resolvers()
        info = init_distributed()
        res = strategy_memory(overrides, info)
        shutdown_distributed()
        if not info.is_main:
            return
        d, f = res["ddp"], res["fsdp"]
        lines = [
            f"\n### FSDP vs DDP: per-rank parameter + optimizer state, {info.world_size} ranks",
            f"\n{datetime.date.today()}, torch {torch.__version__}. Command:\n\n"
            f"    torchrun --standalone --nproc_per_node={info.world_size} "
            f"scripts/bench_memory.py {cmd_line}\n",
            "| strategy | parameters MB | optimizer state MB | total MB | vs DDP |",
            "|---|---|---|---|---|",
        ]
        for name, (p, o) in (("ddp", d), ("fsdp", f)):
            lines.append(
                f"| {name} | {p / 2**20:.2f} | {o / 2**20:.2f} | {(p + o) / 2**20:.2f} | "
                f"{(p + o) / sum(d):.3f} |"
            )
    report(lines, args.report)


if __name__ == "__main__":
    main()
