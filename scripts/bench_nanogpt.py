"""cumulus vs nanoGPT's own `train.py` on CPU: the shakespeare-char run from nanoGPT's README
(4 layers x 128, context 64, batch 12, 2,000 iterations, fp32), trained by both with the same
hyperparameters on the same characters, reporting the validation loss at equal steps and the
wall time.

    python scripts/bench_nanogpt.py [--iters 2000] [--anchor ../shared/anchors/nanogpt]

nanoGPT (MIT) is run from a temporary copy of the anchor directory (its `prepare.py` and
`train.py` write next to themselves), never from or into this project. Each framework reports
its own validation estimate, as its users see it: nanoGPT the mean over `eval_iters` random
batches, cumulus the exact mean over a fixed validation subset of the same size. The GPU half
of the comparison (GPT-2 small shapes, tokens/s and MFU on one GPU) needs a GPU session.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench import report  # noqa: E402

# nanoGPT README's CPU run: config/train_shakespeare_char.py with these overrides.
SHAPES = {"block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128}
EVAL_EVERY, EVAL_ITERS = 250, 20


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
    args = ap.parse_args()
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
