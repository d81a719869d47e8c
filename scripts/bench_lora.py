"""Memory of LoRA adapters against full fine-tuning (issue #47): the same Llama under FSDP2 on
2 ranks, trained 2 steps with `train.memory_report=true` and checkpointed once, with
`adapter=none` and with `adapter=lora adapter.r=16`. Reports each rank's parameter, gradient
and optimizer-state bytes from `memory_report.json` and the checkpoint's size on disk, and
the LoRA/full ratios (the issue's targets: optimizer state and checkpoint <= 2%).

    python scripts/bench_lora.py [--out bench_lora.json] [overrides ...]

The model is `model=hf_llama` at a shape where the adapters are as small a share of the
weights as on a real model: hidden 1024, 4 layers, GQA 16/4 heads, a 32000-token vocabulary
(~110M parameters); extra overrides are appended to both runs. gloo on CPU; each run is its
own `torchrun` job in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPE = {
    "vocab_size": 32000,
    "max_position_embeddings": 256,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
COMMON = [
    "model=hf_llama",
    *[f"model.config.{k}={v}" for k, v in SHAPE.items()],
    "dist.strategy=fsdp",
    "logger=none",
    "data.block_size=128",
    "train.micro_batch_size=2",
    "train.grad_accum_steps=1",
    "train.max_steps=2",
    "train.log_every=1",
    "train.memory_report=true",
    "eval.every_steps=0",
    "checkpoint.every_steps=2",
    "checkpoint.resume=never",
]
KINDS = {"full": ["adapter=none"], "lora": ["adapter=lora", "adapter.r=16", "adapter.alpha=32"]}
TRAINABLE = re.compile(r"\(([\d,]+) of ([\d,]+) trainable")
KEYS = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "peak_bytes")


def run(kind: str, extra: list[str], root: Path) -> dict:
    """One 2-rank job: its memory report, checkpoint size and parameter counts."""
    run_dir = root / kind
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "trainer.train", *COMMON, *KINDS[kind], *extra, f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ranks = json.loads((run_dir / "memory_report.json").read_text())["ranks"]
    ckpt = run_dir / "checkpoints" / "step_00000002"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    found = TRAINABLE.search(proc.stdout)
    trainable, total = (int(g.replace(",", "")) for g in found.groups()) if found else (0, 0)
    return {"ranks": ranks, "checkpoint_bytes": size, "trainable": trainable, "total": total}


def table(results: dict) -> str:
    full, lora = results["full"], results["lora"]
    mib = 2**20
    lines = [
        "| per rank (rank 0) | full fine-tuning | LoRA r=16 | LoRA / full |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key in KEYS:
        a, b = full["ranks"][0][key], lora["ranks"][0][key]
        lines.append(f"| {key} | {a / mib:.2f} MiB | {b / mib:.3f} MiB | {b / a:.2%} |")
    a, b = full["checkpoint_bytes"], lora["checkpoint_bytes"]
    lines.append(
        f"| checkpoint (both ranks) | {a / mib:.1f} MiB | {b / mib:.2f} MiB | {b / a:.2%} |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {kind: run(kind, extra, Path(tmp)) for kind in KINDS}
    lora = results["lora"]
    print(f"LoRA trains {lora['trainable']:,} of {lora['total']:,} parameters "
          f"({lora['trainable'] / max(lora['total'], 1):.2%})")  # fmt: skip
    print(table(results))
    optimizer = max(
        b["optimizer_bytes"] / a["optimizer_bytes"]
        for a, b in zip(results["full"]["ranks"], lora["ranks"])
    )
    checkpoint = lora["checkpoint_bytes"] / results["full"]["checkpoint_bytes"]
    ok = optimizer <= 0.02 and checkpoint <= 0.02
    print(f"targets (<= 2%): optimizer state {optimizer:.2%}, checkpoint {checkpoint:.2%}: "
          f"{'met' if ok else 'NOT met'}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
