"""cumulus vs nanoGPT's own `train.py`, on CPU (validation loss) or on one GPU (speed).

    python scripts/bench_nanogpt.py [--iters 2000] [--anchor ../shared/anchors/nanogpt]
    python scripts/bench_nanogpt.py --gpu [--steps 50] [--prepare-only] [--also 'OVERRIDES']

CPU: the shakespeare-char run from nanoGPT's README (4 layers x 128, context 64, batch 12,
2,000 iterations, fp32), trained by both with the same hyperparameters on the same
characters, reporting the validation loss at equal steps and the wall time. nanoGPT (MIT) is
run from a temporary copy of the anchor directory (its `prepare.py` and `train.py` write next
to themselves), never from or into this project. Each framework reports its own validation
estimate, as its users see it: nanoGPT the mean over `eval_iters` random batches, cumulus the
exact mean over a fixed validation subset of the same size.

`--gpu` (issue #61): nanoGPT's own train.py and cumulus at the same shapes on the same GPU:
GPT-2 small (12 x 768, block 1024, vocab 50304, no biases), bf16 autocast, torch.compile,
micro-batch 16 x accumulation 8, the same uint16 token file (seeded random tokens: speed does
not depend on them), `--steps` steps each. Reported per run: tokens/s and step time (median
of the second half of the steps), MFU (nanoGPT's FLOPs per token, 6N + 12 L T C, against
989 TFLOP/s: H100 and H200 bf16 dense), peak memory and cumulus's compute phase; the table,
with the date, the GPU and torch's version, is appended to docs/benchmarks.md. The anchor is
first copied into `.anchors/nanogpt` of this checkout (git-ignored), so a GPU machine that
holds only the checkout has it: `--prepare-only` makes that copy (and the token file) and
stops, for a session that ships the checkout to a GPU machine (carry `.anchors`). Each
`--also 'k=v ...'` adds a cumulus run with those overrides (a row of its own), e.g. float8
and CUDA graphs (issue #61; fp8 needs the extra `fp8`, torchao):

    python scripts/bench_nanogpt.py --gpu --also 'train.precision=fp8' \
        --also 'train.compile_mode=reduce-overhead'
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench import report  # noqa: E402

# nanoGPT README's CPU run: config/train_shakespeare_char.py with these overrides.
SHAPES = {"block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128}
EVAL_EVERY, EVAL_ITERS = 250, 20

# --gpu: GPT-2 small at the experiment=gpt2_small preset's shapes (issue #61).
GPU_SHAPES = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
GPU_VOCAB, GPU_MICRO, GPU_ACCUM = 50304, 16, 8
PEAK_FLOPS = 989e12  # H100 / H200 SXM, bf16 dense
ANCHOR_COPY = REPO / ".anchors" / "nanogpt"  # git-ignored
DATASET = "cumulus_bench"  # nanoGPT's data/<dataset>/{train,val}.bin
PEAK_TAG = "PEAK_MEMORY_BYTES"


@dataclasses.dataclass
class GpuRun:
    """One framework's steady state: medians over the second half of the steps."""

    name: str
    step_ms: float
    tokens_per_s: float
    mfu: float
    peak_gib: float
    compute_ms: float | None = None  # cumulus's compute phase; nanoGPT has none


def copy_anchor(anchor: Path, dest: Path = ANCHOR_COPY) -> Path:
    """nanoGPT in this checkout's git-ignored `.anchors/`: copied from `anchor` when it exists
    (replacing an older copy, keeping the token files), else the copy already there."""
    if (anchor / "train.py").is_file():
        keep = dest / "data" / DATASET
        stash = dest.parent / f".{DATASET}"
        if keep.is_dir():
            shutil.rmtree(stash, ignore_errors=True)
            keep.rename(stash)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(anchor, dest, ignore=shutil.ignore_patterns("__pycache__", "out*"))
        if stash.is_dir():
            keep.parent.mkdir(parents=True, exist_ok=True)
            stash.rename(keep)
    if not (dest / "train.py").is_file():
        raise SystemExit(
            f"error: no nanoGPT: --anchor {anchor} holds no train.py and neither does {dest}; "
            "run `python scripts/bench_nanogpt.py --gpu --prepare-only` where the anchor exists"
        )
    return dest


def write_tokens(data: Path, tokens: int, vocab: int = GPU_VOCAB, seed: int = 0) -> Path:
    """`data`/train.bin and val.bin: seeded uniform uint16 token ids below `vocab`, in the
    layout both frameworks read (nanoGPT's prepare.py's). Kept when already the right size."""
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, n in (("train.bin", tokens), ("val.bin", max(tokens // 16, 4096))):
        path = data / name
        if path.is_file() and path.stat().st_size == 2 * n:
            continue
        rng.integers(0, vocab, n, dtype=np.uint16).tofile(path)
    return data


def gpu_tokens(steps: int) -> int:
    """Token ids enough for `steps` steps without repeating a batch, and some to spare."""
    return (steps + 10) * GPU_MICRO * GPU_ACCUM * (GPU_SHAPES["block_size"] + 1)


def nanogpt_gpu_cmd(steps: int, out_dir: Path) -> list[str]:
    """nanoGPT's train.py (run in its folder) at the GPU shapes, under a wrapper that prints
    the CUDA allocator's peak after the run. One evaluation of one batch, at iteration 0."""
    args = [
        f"--dataset={DATASET}", f"--out_dir={out_dir}", f"--batch_size={GPU_MICRO}",
        f"--gradient_accumulation_steps={GPU_ACCUM}",
        *[f"--{k}={v}" for k, v in GPU_SHAPES.items()],
        "--bias=False", "--dropout=0.0", f"--max_iters={steps - 1}",  # iterations 0..max_iters
        f"--lr_decay_iters={steps}", "--warmup_iters=10", f"--eval_interval={steps + 1000}",
        "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False",
        "--wandb_log=False", "--device=cuda", "--dtype=bfloat16", "--compile=True",
    ]  # fmt: skip
    wrapper = (
        "import runpy, sys, torch; sys.argv = ['train.py', *sys.argv[1:]]; "
        "runpy.run_path('train.py', run_name='__main__'); "
        f"print('{PEAK_TAG}', torch.cuda.max_memory_allocated())"
    )
    return [sys.executable, "-c", wrapper, *args]


def cumulus_gpu_cmd(steps: int, data: Path, run_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """cumulus's experiment=gpt2_small preset at the same shapes, batch and steps (`extra`:
    overrides of a variant, e.g. `task.chunk_size=null`)."""
    return [
        sys.executable, "-m", "trainer.train", "experiment=gpt2_small", f"data.path={data}",
        f"model.vocab_size={GPU_VOCAB}", *[f"model.{k}={v}" for k, v in GPU_SHAPES.items()],
        f"data.block_size={GPU_SHAPES['block_size']}", f"train.micro_batch_size={GPU_MICRO}",
        f"train.global_batch_size={GPU_MICRO * GPU_ACCUM}", f"train.max_steps={steps}",
        "train.log_every=1", "scheduler.warmup_steps=10", "eval.every_steps=0",
        "eval.sample_tokens=0", "checkpoint.every_steps=0", "logger=none",
        f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip


def flops_per_token() -> float:
    """nanoGPT's `estimate_mfu` per token: 6N + 12 L T C, N without the position embeddings
    (both models: tied token embedding and output layer, no biases)."""
    c, layers, t = GPU_SHAPES["n_embd"], GPU_SHAPES["n_layer"], GPU_SHAPES["block_size"]
    per_block = 12 * c * c + 2 * c  # q/k/v, projection, MLP (4x) and two LayerNorm weights
    n = GPU_VOCAB * c + layers * per_block + c  # token embedding, blocks, final LayerNorm
    return 6 * n + 12 * layers * t * c


def second_half(values: list[float]) -> float:
    return statistics.median(values[len(values) // 2 :])


def run_from_times(
    name: str, step_ms: list[float], peak_bytes: float, compute_ms: list[float] | None = None
) -> GpuRun:
    """A steady state from per-step milliseconds: medians over the second half."""
    ms = second_half(step_ms)
    tokens_per_s = GPU_MICRO * GPU_ACCUM * GPU_SHAPES["block_size"] / (ms / 1000)
    return GpuRun(
        name,
        ms,
        tokens_per_s,
        tokens_per_s * flops_per_token() / PEAK_FLOPS,
        peak_bytes / 2**30,
        None if compute_ms is None else second_half(compute_ms),
    )


def parse_nanogpt(stdout: str) -> GpuRun:
    """nanoGPT's per-iteration log lines (`iter N: loss L, time T ms, ...`) and the wrapper's
    peak memory line."""
    times = [float(t) for t in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", stdout, re.M)]
    peak = re.search(rf"^{PEAK_TAG} (\d+)", stdout, re.M)
    if not times or peak is None:
        raise RuntimeError(f"nanoGPT printed no iteration times or peak memory:\n{stdout[-2000:]}")
    return run_from_times("nanoGPT train.py", times, float(peak.group(1)))


def parse_cumulus(run_dir: Path, extra: Sequence[str] = ()) -> GpuRun:
    """cumulus's per-step records (metrics.jsonl, train.log_every=1)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "train/step_time_ms" in r]
    if not records:
        raise RuntimeError(f"cumulus wrote no step records in {run_dir}")
    return run_from_times(
        " ".join(["cumulus experiment=gpt2_small", *extra]),
        [r["train/step_time_ms"] for r in records],
        max(r["train/peak_mem_mb"] for r in records) * 2**20,
        [1000 * r["time/compute_s"] for r in records if "time/compute_s" in r] or None,
    )


def gpu_table(
    runs: list[GpuRun],
    gpu: str,
    torch_version: str,
    steps: int,
    date: str,
    also: Sequence[str] = (),
) -> list[str]:
    """The section docs/benchmarks.md gets: one row per run, nanoGPT (the first) as 1."""
    base = runs[0].tokens_per_s
    return [
        "",
        f"### nanoGPT vs cumulus on one GPU ({gpu}, torch {torch_version}), {date}",
        "",
        f"GPT-2 small ({GPU_SHAPES['n_layer']} x {GPU_SHAPES['n_embd']}, block "
        f"{GPU_SHAPES['block_size']}, vocab {GPU_VOCAB}), bf16 autocast, torch.compile, micro "
        f"{GPU_MICRO} x accumulation {GPU_ACCUM}, the same uint16 token file, {steps} steps; "
        "medians of the second half. MFU: nanoGPT's FLOPs per token against "
        f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s. Command:",
        "",
        f"    python scripts/bench_nanogpt.py --gpu --steps {steps}"
        + "".join(f" --also '{v}'" for v in also),
        "",
        "| run | tokens/s | vs nanoGPT | MFU | step (ms) | compute phase (ms) "
        "| peak memory (GiB) |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r.name} | {r.tokens_per_s:,.0f} | {r.tokens_per_s / base:.3f} | {r.mfu:.1%} | "
            f"{r.step_ms:.1f} | {'-' if r.compute_ms is None else f'{r.compute_ms:.1f}'} | "
            f"{r.peak_gib:.2f} |"
            for r in runs
        ),
    ]


def gpu_main(args: argparse.Namespace) -> None:
    """--gpu: copy nanoGPT, write the token file, run both, append the table."""
    work = copy_anchor(args.anchor)
    data = write_tokens(work / "data" / DATASET, gpu_tokens(args.steps))
    if args.prepare_only:
        print(f"nanoGPT and the token file are in {work}; run --gpu on the GPU machine")
        return
    if not torch.cuda.is_available():
        raise SystemExit("error: --gpu needs a CUDA device; this machine has none")
    with tempfile.TemporaryDirectory() as tmp:
        stdout, _ = timed(nanogpt_gpu_cmd(args.steps, Path(tmp) / "nanogpt"), work, "nanoGPT")
        theirs = parse_nanogpt(stdout)
        ours = []
        for i, extra in enumerate([[], *(v.split() for v in args.also)]):
            run_dir = Path(tmp) / f"cumulus{i}"
            timed(cumulus_gpu_cmd(args.steps, data, run_dir, extra), REPO, "cumulus")
            ours.append(parse_cumulus(run_dir, extra))
    lines = gpu_table(
        [theirs, *ours],
        torch.cuda.get_device_name(),
        torch.__version__,
        args.steps,
        str(datetime.date.today()),
        args.also,
    )
    report(lines, args.report)


def nanogpt(work: Path, iters: int) -> tuple[dict[int, float], float]:
    """Validation loss by step and wall seconds of nanoGPT's own train.py."""
    cmd = [
        sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
        "--compile=False", "--dtype=float32", f"--eval_iters={EVAL_ITERS}", "--log_interval=100",
        f"--eval_interval={EVAL_EVERY}", f"--max_iters={iters}", f"--lr_decay_iters={iters}",
        "--dropout=0.0", *[f"--{k}={v}" for k, v in SHAPES.items()],
    ]  # fmt: skip
    stdout, seconds = timed(cmd, work, "nanoGPT")
    found = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", stdout)
    return {int(s): float(v) for s, v in found}, seconds


def cumulus(data: Path, iters: int, run_dir: Path) -> tuple[dict[int, float], float]:
    """The same run through cumulus: config/train_shakespeare_char.py's values as overrides."""
    vocab = 65  # tiny-shakespeare's characters (meta.pkl)
    cmd = [
        sys.executable, "-m", "trainer.train", "model=gpt_small", f"model.vocab_size={vocab}",
        f"model.block_size={SHAPES['block_size']}", f"model.n_layer={SHAPES['n_layer']}",
        f"model.n_head={SHAPES['n_head']}", f"model.n_embd={SHAPES['n_embd']}",
        "model.dropout=0.0", "model.bias=true", f"data.path={data}",
        f"data.block_size={SHAPES['block_size']}", "data.packed=true",
        f"train.micro_batch_size={SHAPES['batch_size']}", "train.grad_accum_steps=1",
        f"train.max_steps={iters}", "train.clip_grad_norm=1.0", "train.log_every=100",
        "optim=adamw", "optim.lr=1e-3", "optim.weight_decay=0.1", "optim.betas=[0.9,0.99]",
        "scheduler=cosine", "scheduler.warmup_steps=100", "scheduler.min_lr_ratio=0.1",
        f"eval.every_steps={EVAL_EVERY}", f"eval.max_batches={EVAL_ITERS}",
        f"eval.batch_size={SHAPES['batch_size']}", "eval.sample_tokens=0",
        "checkpoint.every_steps=0", "logger=none", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    _, seconds = timed(cmd, REPO, "cumulus")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val/loss"] for r in records if "val/loss" in r}, seconds


def timed(cmd: list[str], cwd: Path, name: str) -> tuple[str, float]:
    """Run `cmd`: its stdout and wall seconds, command to exit."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=_env())
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout, seconds


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    env["WANDB_MODE"] = "disabled"
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--anchor", type=Path, default=REPO.parent / "shared" / "anchors" / "nanogpt")
    ap.add_argument("--report", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--gpu", action="store_true", help="speed on one GPU, GPT-2 small shapes")
    ap.add_argument("--steps", type=int, default=50, help="--gpu: steps of each run")
    ap.add_argument("--prepare-only", action="store_true", help="--gpu: copy and write only")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="OVERRIDES",
        help="--gpu: one more cumulus run with these overrides (quoted, space-separated), "
        "e.g. --also 'task.chunk_size=null'; each adds about a minute",
    )
    args = ap.parse_args()
    if args.gpu:
        gpu_main(args)
        return
    if not (args.anchor / "train.py").is_file():
        raise SystemExit(f"error: --anchor {args.anchor} holds no nanoGPT train.py")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "nanogpt"
        shutil.copytree(args.anchor, work)
        data = work / "data" / "shakespeare_char"
        subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
        theirs, their_s = nanogpt(work, args.iters)
        ours, our_s = cumulus(data, args.iters, Path(tmp) / "cumulus")
    steps = sorted(s for s in ours if s in theirs)
    lines = [
        "",
        "### nanoGPT vs cumulus, shakespeare-char on CPU (nanoGPT README's CPU run)",
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={_env()['OMP_NUM_THREADS']}; {SHAPES['n_layer']} layers x "
        f"{SHAPES['n_embd']}, context {SHAPES['block_size']}, batch {SHAPES['batch_size']}, "
        f"{args.iters} iterations, fp32, AdamW 1e-3 (beta2 0.99, decay 0.1), warmup 100 + "
        "cosine to 1e-4, clip 1.0. Validation: each framework's own estimate over "
        f"{EVAL_ITERS} batches (nanoGPT random, cumulus a fixed subset). Command:",
        "",
        f"    python scripts/bench_nanogpt.py --iters {args.iters}",
        "",
        "| step | nanoGPT val loss | cumulus val loss |",
        "|---|---|---|",
        *(f"| {s} | {theirs[s]:.4f} | {ours[s]:.4f} |" for s in steps),
        "",
        f"Wall time, command to exit: nanoGPT {their_s:.0f} s, cumulus {our_s:.0f} s "
        f"(cumulus / nanoGPT {our_s / their_s:.2f}).",
    ]
    report(lines, args.report)


if __name__ == "__main__":
    main()
