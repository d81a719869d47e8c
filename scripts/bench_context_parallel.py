"""Context parallelism (`dist.cp`): per-rank activation memory and step time vs sequence length.

    python scripts/bench_context_parallel.py [--lengths 2048,4096,8192] [--cps 1,2,4]
        [--steps 3] [--out docs/benchmarks.md]

For each sequence length and cp degree it launches the real trainer's assembly under
`torchrun --standalone --nproc_per_node=cp` (gloo on CPU; `cp=1` is one process), builds the
run exactly as `trainer.train` would (`gpt_tiny` widened to the sequence, micro-batch 1) and
measures, on every rank:

- activation memory: the bytes autograd saves for backward in one micro-batch's forward
  (`torch.autograd.graph.saved_tensors_hooks`, each storage counted once): what context
  parallelism divides, a figure that does not depend on the allocator or the machine's load;
- step time: the median wall time of an optimizer step (after one warm-up step), and the part
  of it spent in the all-gathers of keys and values and their gradients' all-reduces.

The report (a markdown table) is appended to `--out` by the driver.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARK = "CP_BENCH "


def worker(length: int, steps: int) -> None:
    """One rank of a configuration: build the run, measure, print one JSON line (rank 0)."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from engine.distributed import init_distributed, shutdown_distributed
    from trainer.config.cli import to_config
    from trainer.config.schema import register_configs
    from trainer.run.build import build_run
    from trainer.run.identity import register_resolvers

    register_configs()
    register_resolvers()
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = [
        "model=gpt_tiny",
        f"model.block_size={length}",
        f"data.block_size={length}",
        "logger=none",
        "train.micro_batch_size=1",
        "train.grad_accum_steps=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        f"dist.cp={cp}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg, plain = to_config(compose("train", overrides=overrides))
    info = init_distributed("gloo", "cpu", 600.0)
    comm = [0.0]
    gather, reduce = dist.all_gather, dist.all_reduce

    def timed(fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                comm[0] += time.perf_counter() - started

        return call

    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(cfg, plain, Path(tmp), info)
        windows = run.batches.windows(0)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        window = next(windows)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run.step_fn(run.ctx, window)  # the warm-up step, measured for memory
        times, comms = [], []
        dist.all_gather, dist.all_reduce = timed(gather), timed(reduce)  # the step's own comms
        for _ in range(steps):
            window = next(windows)
            comm[0] = 0.0
            started = time.perf_counter()
            run.step_fn(run.ctx, window)
            times.append(time.perf_counter() - started)
            comms.append(comm[0])
        dist.all_gather, dist.all_reduce = gather, reduce
        windows.close()
        result = {
            "activation_mb": sum(saved.values()) / 2**20,
            "step_s": statistics.median(times),
            "comm_s": statistics.median(comms),
        }
        everyone = [None] * info.world_size
        if info.distributed:
            dist.all_gather_object(everyone, result)
        else:
            everyone = [result]
        if info.is_main:
            print(MARK + json.dumps({"length": length, "cp": cp, "ranks": everyone}), flush=True)
        del run
    shutdown_distributed(clean=True)


def drive(args: argparse.Namespace) -> None:
    rows = []
    for length in args.lengths:
        for cp in args.cps:
            launcher = (
                [sys.executable]
                if cp == 1
                else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc_per_node={cp}"]
            )  # fmt: skip
            cmd = [*launcher, __file__, "--worker", str(length), "--steps", str(args.steps)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"length {length} cp {cp} failed (exit {proc.returncode})")
            rows.append(json.loads(line[len(MARK) :]))
            print(rows[-1], flush=True)
    import torch

    table = [
        f"\n### Context parallelism: activation memory and step time per rank "
        f"(gpt_tiny widened to the sequence, micro-batch 1, gloo on CPU, {os.cpu_count()} cores)",
        f"\n{datetime.date.today()}, torch {torch.__version__}; "
        f"`python scripts/bench_context_parallel.py --lengths "
        f"{','.join(map(str, args.lengths))} --cps {','.join(map(str, args.cps))} "
        f"--steps {args.steps}`. Activation memory: bytes saved for backward in one forward "
        "(max over ranks); step time: median of the measured steps (max over ranks), and the "
        "part in the key/value all-gathers and gradient all-reduces.\n",
        "| sequence | cp | activation MB / rank | vs cp=1 | step s | in all-gather/reduce s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base: dict[int, float] = {}
    for row in rows:
        mem = max(r["activation_mb"] for r in row["ranks"])
        step = max(r["step_s"] for r in row["ranks"])
        comm = max(r["comm_s"] for r in row["ranks"])
        base.setdefault(row["length"], mem) if row["cp"] == 1 else None
        ratio = mem / base[row["length"]] if row["length"] in base else float("nan")
        table.append(
            f"| {row['length']} | {row['cp']} | {mem:,.1f} | {ratio:.2f} | {step:.3f} | "
            f"{comm:.3f} |"
        )
    text = "\n".join(table) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2048, 4096, 8192])  # fmt: skip
    parser.add_argument("--cps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", type=int, default=None)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps)
    else:
        drive(args)


if __name__ == "__main__":
    main()
