"""Benchmark cumulus' fit loop against the best plain PyTorch loop, interleaved in one process.

    python scripts/bench.py [--accum 1,4,16] [--rounds 3] [--steps 20] [hydra overrides...]
    torchrun --standalone --nproc_per_node=2 scripts/bench.py ...

Both loops train the same model from the same weights on the same batches with the same
optimizer. The plain loop is written here: token-count normalization, `no_sync` on all but
the last micro-batch, fused AdamW, clipping, no per-step `.item()`. Rounds alternate which
loop goes first; the report gives median ratios with min-max. Rank 0 appends a section to
the report file (default docs/benchmarks.md). On CUDA it also checks that non-logging steps
make no host-device sync (`torch.cuda.set_sync_debug_mode("error")`) and reports MFU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402

from engine.distributed import init_distributed, shutdown_distributed, unwrap  # noqa: E402
from engine.tasks import IGNORE_INDEX  # noqa: E402
from trainer.config.cli import to_config  # noqa: E402
from trainer.config.schema import register_configs  # noqa: E402
from trainer.run.build import build_run  # noqa: E402
from trainer.run.fit import Run, fit  # noqa: E402
from trainer.run.identity import register_resolvers  # noqa: E402
from trainer.run.optim import param_groups  # noqa: E402
from trainer.tracking.records import device_peak_flops, peak_memory_mb  # noqa: E402


def peak_memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:  # Linux: writing 5 resets the process's peak RSS (VmHWM)
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def make_run(overrides: list[str], run_dir: Path, info) -> Run:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg, plain = to_config(compose("train", overrides=overrides))
    run = build_run(cfg, plain, run_dir, info)
    run.sinks = []
    return run


class PlainLoop:
    """The hand-written reference loop."""

    def __init__(self, run: Run) -> None:
        self.info = run.dist
        model = copy.deepcopy(unwrap(run.ctx.model))
        self.raw = model
        self.model = (
            torch.nn.parallel.DistributedDataParallel(
                model,
                device_ids=[run.dist.device.index] if run.dist.device.type == "cuda" else None,
            )
            if run.dist.distributed
            else model
        )
        o = run.state.config["optim"]
        self.opt = torch.optim.AdamW(
            param_groups(model, o["weight_decay"]), lr=o["lr"], betas=tuple(o["betas"]), fused=True
        )
        self.clip = run.settings.train.clip_grad_norm
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[
            run.settings.train.precision
        ]
        self.scaler = (
            torch.amp.GradScaler(run.dist.device.type) if self.dtype == torch.float16 else None
        )

    def step(self, window) -> None:
        self.opt.zero_grad(set_to_none=True)
        n = torch.stack([(y != IGNORE_INDEX).sum() for _, y in window]).sum()
        if self.info.distributed:
            dist.all_reduce(n)
        scale = self.info.world_size / n
        for i, (x, y) in enumerate(window):
            sync = i == len(window) - 1 or not self.info.distributed
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with torch.autocast(
                    x.device.type, dtype=self.dtype, enabled=self.dtype is not None
                ):
                    logits = self.model(x)
                    loss = F.cross_entropy(
                        logits.flatten(0, 1).float(),
                        y.flatten(),
                        ignore_index=IGNORE_INDEX,
                        reduction="sum",
                    )
                if self.scaler is not None:
                    self.scaler.scale(loss * scale).backward()
                else:
                    (loss * scale).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()


def timed(fn, steps: int, device: torch.device) -> tuple[float, float, float]:
    """(wall seconds, process CPU seconds, peak memory MB) of `fn(steps)`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak_memory_reset(device)
    w0, c0 = time.perf_counter(), time.process_time()
    fn(steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - w0, time.process_time() - c0, peak_memory_mb(device)


def sync_site(exc: BaseException) -> str:
    """Where a sync was asked for: the innermost frame, and the innermost of this project's
    own frames when that is another (the sync is in a library it called)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f.filename.startswith(str(REPO))]
    sites = [frames[-1], *([ours[-1]] if ours and ours[-1] is not frames[-1] else [])]
    return " <- ".join(f"{f.filename}:{f.lineno} ({f.name}: {f.line})" for f in sites)


def sync_check(run: Run, steps: int) -> str:
    """Non-logging steps of the fit loop under sync-debug 'error': any sync raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    windows = run.batches.windows(run.step)
    window = next(windows)  # the loader's start-up is not part of a step
    try:
        for _ in range(steps):  # the body of fit() on a step that writes no record
            result = run.step_fn(run.ctx, window)
            run.meter.update(result)
            window = next(windows)
        return f"ok: {steps} steps, no host-device sync"
    except RuntimeError as exc:
        return f"SYNC: {str(exc).splitlines()[0]} at {sync_site(exc)}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        windows.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accum", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--report", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--label", default="")
    args, overrides = ap.parse_known_args()
    register_configs()
    register_resolvers()
    info = init_distributed()
    rows = []
    for accum in [int(a) for a in args.accum.split(",")]:
        rows.append(bench_one(accum, args, overrides, info, check_syncs=not rows))
        if info.is_main:
            print(rows[-1], flush=True)
    sync_result = rows[0].get("sync")
    if info.is_main:
        write_report(args, overrides, rows, info, sync_result)
    shutdown_distributed()


def bench_one(accum: int, args, overrides: list[str], info, check_syncs: bool) -> dict:
    """Interleaved rounds of both loops at one accumulation count."""
    total = args.warmup + args.steps * args.rounds + 20
    ov = [
        "logger=none",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "checkpoint.resume=never",
        f"train.grad_accum_steps={accum}",
        f"train.max_steps={total}",
        f"train.log_every={args.steps}",
        *overrides,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(ov, Path(tmp), info)
        plain = PlainLoop(run)
        plain_windows = run.batches.windows(0)  # the same batches, through the same loader

        def run_cumulus(steps: int) -> None:
            run.settings.train.max_steps = run.step + steps
            fit(run)

        def run_plain(steps: int) -> None:
            for _ in range(steps):
                plain.step(next(plain_windows))

        run_cumulus(args.warmup)
        run_plain(args.warmup)
        res: dict[str, list] = {"cumulus": [], "plain": []}
        for r in range(args.rounds):
            order = [("cumulus", run_cumulus), ("plain", run_plain)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                res[name].append(timed(fn, args.steps, info.device))
        tokens = run.batches.sampler.global_batch_size * run.state.config["data"]["block_size"]
        row: dict = {
            "accum": accum,
            "world": info.world_size,
            "global_batch": run.batches.sampler.global_batch_size,
        }
        for name in res:
            walls = [w for w, _, _ in res[name]]
            row[name] = {
                "tok_s": statistics.median(tokens * args.steps / w for w in walls),
                "step_ms": statistics.median(1000 * w / args.steps for w in walls),
                "cpu_ms": statistics.median(1000 * c / args.steps for _, c, _ in res[name]),
                "peak_mb": max(m for _, _, m in res[name]),
            }
        ratios = [p[0] / c[0] for c, p in zip(res["cumulus"], res["plain"])]
        row["ratio"] = (statistics.median(ratios), min(ratios), max(ratios))
        peak = device_peak_flops(info.device)
        if peak:
            row["mfu"] = (
                run.meter.flops_per_token * row["cumulus"]["tok_s"] / info.world_size / peak
            )
        if info.device.type == "cuda" and check_syncs:
            row["sync"] = sync_check(run, 10)
    return row


def write_report(args, overrides, rows, info, sync_result) -> None:
    dev = (
        torch.cuda.get_device_name(info.device)
        if info.device.type == "cuda"
        else (f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})")
    )
    launcher = "torchrun --standalone --nproc_per_node=2 " if info.world_size > 1 else "python "
    cmd = (
        f"{launcher}scripts/bench.py --accum {args.accum} --rounds {args.rounds} "
        f"--steps {args.steps} {' '.join(overrides)}".strip()
    )
    lines = [
        f"\n### {args.label or 'bench'}: {info.world_size} process(es) on {dev}",
        f"\n{datetime.date.today()}, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}. Command:\n",
        f"    {cmd}\n",
        "| accum | global batch | cumulus tok/s | plain tok/s | ratio (median, min-max) | "
        "cumulus step ms | plain step ms | cumulus CPU ms/step | plain CPU ms/step | "
        "cumulus peak MB | plain peak MB |" + (" MFU |" if "mfu" in rows[0] else ""),
        "|" + "---|" * (11 + ("mfu" in rows[0])),
    ]
    for r in rows:
        c, p, (med, lo, hi) = r["cumulus"], r["plain"], r["ratio"]
        lines.append(
            f"| {r['accum']} | {r['global_batch']} | {c['tok_s']:,.0f} | {p['tok_s']:,.0f} | "
            f"{med:.3f} ({lo:.3f}-{hi:.3f}) | {c['step_ms']:.1f} | {p['step_ms']:.1f} | "
            f"{c['cpu_ms']:.1f} | {p['cpu_ms']:.1f} | {c['peak_mb']:.0f} | {p['peak_mb']:.0f} |"
            + (f" {r['mfu']:.1%} |" if "mfu" in r else "")
        )
    if sync_result:
        lines.append(f"\nHost-device syncs on non-logging steps: {sync_result}")
    report(lines, args.report)


def report(lines: list[str], path: str) -> None:
    """Print a benchmark's section and append it to the report file (docs/benchmarks.md)."""
    text = "\n".join(lines)
    print(text)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()
