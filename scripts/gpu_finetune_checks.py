"""GPU checks of the fine-tuning paths (data=chat, adapter=lora, step=cached) and of the
planner's memory figures, which CPU CI cannot make. Needs one CUDA GPU and the `hf` and
`adapter` extras.

    python scripts/gpu_finetune_checks.py --out DIR

What it runs, each with the real trainer (`python -m trainer.train`) on tiny models built in
a temporary folder (no download):
- chat + LoRA (packed conversations, a tiny pretrained Llama): CUDA fp32 against CPU fp32
  (the same losses up to float rounding), micro 8 x accum 1 against micro 2 x accum 4 on
  CUDA (the split does not change the trajectory), bf16 and fp16 (GradScaler) finite with
  step 1's unscaled gradient norm beside fp32's;
- step=cached with task=contrastive: micro 4 x accum 6 against the whole batch of 24 at once
  on CUDA, and against the CPU, bf16 finite;
- non-logging steps make no host-device sync (`torch.cuda.set_sync_debug_mode("error")`)
  for chat + LoRA in bf16 and for step=cached in bf16;
- `train.memory_report=true` on CUDA at 2048 and 8192 tokens (gpt_tiny, gpt_tiny with
  dropout 0.1, hf_llama), with the CUDA allocator's peak beside it, for `trainer.plan`
  (`plan.gpu=h100|h200`) to be compared against (`--compare` on a machine without a GPU);
- what CUDA reports as the GPU's memory (`total_memory`), against trainer/planning/gpus.py.

Results go to DIR/finetune_checks.json and DIR/finetune_checks.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STEPS = ["eval.every_steps=0", "checkpoint.every_steps=0", "logger=none", "train.log_every=1"]
# The memory runs: (name, overrides). Two measured steps each, micro-batch 1.
LONG = {
    "gpt_2048": ["model=gpt_tiny", "model.block_size=2048"],
    "gpt_8192": ["model=gpt_tiny", "model.block_size=8192"],
    "gpt_dropout_2048": ["model=gpt_tiny", "model.block_size=2048", "model.dropout=0.1"],
    "llama_2048": [
        "model=hf_llama",
        "model.config.max_position_embeddings=2048",
        "data.block_size=2048",
    ],
    "llama_8192": [
        "model=hf_llama",
        "model.config.max_position_embeddings=8192",
        "data.block_size=8192",
    ],
    "llama_bf16_2048": [
        "model=hf_llama",
        "model.config.max_position_embeddings=2048",
        "data.block_size=2048",
        "train.precision=bf16",
    ],
}
PLANNED = ["train.max_steps=2", "train.micro_batch_size=1", "train.grad_accum_steps=2", *STEPS]
MEMORY = [*PLANNED, "train.memory_report=true"]


def records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r]


def train(name: str, args: list[str], root: Path) -> dict[str, Any]:
    run_dir = root / name
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer.train", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"name": name, "error": (proc.stdout + proc.stderr)[-3000:]}
    out: dict[str, Any] = {"name": name, "records": records(run_dir)}
    report = run_dir / "memory_report.json"
    if report.exists():
        out["memory_report"] = json.loads(report.read_text())["ranks"][0]
    return out


def max_diff(a: list[dict], b: list[dict], key: str = "train/loss") -> float:
    return max(abs(x[key] - y[key]) for x, y in zip(a, b, strict=True))


def sync_free(overrides: list[str], root: Path) -> str:
    """Non-logging steps of the fit loop under sync-debug "error" (scripts/bench.py)."""
    from engine.distributed import init_distributed
    from scripts.bench import make_run, sync_check
    from trainer.config.schema import register_configs
    from trainer.run.identity import register_resolvers

    register_configs()
    register_resolvers()
    run = make_run([*overrides, "train.max_steps=40"], root, init_distributed())
    return sync_check(run, 10)


def fixtures(root: Path) -> dict[str, list[str]]:
    from tests.cached_support import tiny_bert, write_pairs, write_tokenizer
    from tests.chat_support import conversations, pretrained, write_jsonl

    base, _ = pretrained(root / "llama")
    chat = write_jsonl(root / "chat.jsonl", conversations(256, seed=0))
    tok = write_tokenizer(root / "bert_tokenizer")
    train_pairs = write_pairs(root / "pairs.jsonl", 24, seed=0)
    val_pairs = write_pairs(root / "pairs_val.jsonl", 8, seed=1)
    return {
        "chat": [
            "model=hf_llama",
            f"model.pretrained={base}",
            "data=chat",
            f"data.path={chat}",
            "data.max_length=128",
            "adapter=lora",
            "adapter.r=8",
            "train.max_steps=10",
            "train.micro_batch_size=8",
            "train.grad_accum_steps=1",
            *STEPS,
        ],
        # data=chat on the in-tree GPT: document boundaries from position_ids, no transformers
        "chat_gpt": [
            "model=gpt_tiny",
            "model.vocab_size=512",
            "model.block_size=128",
            "data=chat",
            f"data.path={chat}",
            f"data.tokenizer={base}",
            "data.max_length=128",
            "train.max_steps=10",
            "train.micro_batch_size=8",
            "train.grad_accum_steps=1",
            *STEPS,
        ],
        "cached": [
            *tiny_bert(),
            "task=contrastive",
            "task.learn_temperature=true",
            "task.symmetric=true",
            "data=pairs",
            f"data.path={train_pairs}",
            f"data.val_path={val_pairs}",
            f"data.tokenizer={tok}",
            "scheduler=constant",
            "train.max_steps=10",
            *STEPS,
        ],
    }


def sync_checks(f: dict[str, list[str]], root: Path) -> dict[str, str]:
    """Each check's verdict: "ok: ..." or "SYNC: ... at <where>"."""
    chat, cached = f["chat"], f["cached"]
    out: dict[str, str] = {}
    for name, args in {
        "chat_gpt_bf16": [*f["chat_gpt"], "train.precision=bf16", "train.device=cuda"],
        "chat_lora_bf16": [*chat, "train.precision=bf16", "train.device=cuda"],
        "cached_bf16_adamw": [
            *cached,  # AdamW, fused on CUDA: its skip needs no host read (SGD's does)
            "step=cached",
            "train.micro_batch_size=4",
            "train.grad_accum_steps=6",
            "train.precision=bf16",
            "train.device=cuda",
        ],
    }.items():
        try:
            out[name] = sync_free(args, root / f"sync_{name}")
        except Exception as exc:  # a check's own failure is a result too
            out[name] = f"failed: {type(exc).__name__}: {exc}"[:2000]
    return out


def run_all(root: Path) -> dict[str, Any]:
    import torch

    f = fixtures(root)
    chat, cached = f["chat"], f["cached"]
    sgd = ["optim=sgd", "optim.momentum=0.0", "optim.weight_decay=0.0"]
    runs = {
        "chat_cpu_fp32": [*chat, "train.device=cpu"],
        "chat_cuda_fp32": [*chat, "train.device=cuda"],
        "chat_cuda_split": [
            *chat,
            "train.device=cuda",
            "train.micro_batch_size=2",
            "train.grad_accum_steps=4",
        ],
        "chat_cuda_bf16": [*chat, "train.device=cuda", "train.precision=bf16"],
        "chat_cuda_fp16": [*chat, "train.device=cuda", "train.precision=fp16"],
        "cached_cuda_4x6": [
            *cached,
            *sgd,
            "train.device=cuda",
            "step=cached",
            "step.chunk_size=5",
            "train.micro_batch_size=4",
            "train.grad_accum_steps=6",
        ],
        "whole_cuda_24x1": [
            *cached,
            *sgd,
            "train.device=cuda",
            "train.micro_batch_size=24",
            "train.grad_accum_steps=1",
        ],
        "cached_cpu_4x6": [
            *cached,
            *sgd,
            "train.device=cpu",
            "step=cached",
            "step.chunk_size=5",
            "train.micro_batch_size=4",
            "train.grad_accum_steps=6",
        ],
        "cached_cuda_bf16": [
            *cached,
            *sgd,
            "train.device=cuda",
            "step=cached",
            "train.micro_batch_size=4",
            "train.grad_accum_steps=6",
            "train.precision=bf16",
        ],
    }
    runs.update({f"memory_{k}": [*v, *MEMORY, "train.device=cuda"] for k, v in LONG.items()})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = dict(zip(runs, pool.map(lambda kv: train(*kv, root), runs.items())))
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "total_memory": props.total_memory,
        "torch": torch.__version__,
        "errors": {k: v["error"] for k, v in done.items() if "error" in v},
    }
    ok = {k: v["records"] for k, v in done.items() if "records" in v}

    def finite(name: str) -> bool | None:  # None: the run failed (see "errors")
        return all(math.isfinite(r["train/loss"]) for r in ok[name]) if name in ok else None

    def compare(a: str, b: str) -> float | None:
        return max_diff(ok[a], ok[b]) if a in ok and b in ok else None

    result["chat"] = {
        "cuda_vs_cpu_fp32_max_loss_diff": compare("chat_cuda_fp32", "chat_cpu_fp32"),
        "split_8x1_vs_2x4_max_loss_diff": compare("chat_cuda_fp32", "chat_cuda_split"),
        "step1_grad_norm": {k: ok[k][0]["train/grad_norm"] for k in ok if k.startswith("chat")},
        "final_loss": {k: ok[k][-1]["train/loss"] for k in ok if k.startswith("chat")},
        "finite": {k: finite(k) for k in ok if k.startswith("chat")},
        "loss_scale_last": ok.get("chat_cuda_fp16", [{}])[-1].get("train/loss_scale"),
    }
    result["cached"] = {
        "cached_4x6_vs_whole_24x1_max_loss_diff": compare("cached_cuda_4x6", "whole_cuda_24x1"),
        "cuda_vs_cpu_max_loss_diff": compare("cached_cuda_4x6", "cached_cpu_4x6"),
        "final_loss": {k: ok[k][-1]["train/loss"] for k in ok if "24x1" in k or "cached" in k},
        "bf16_finite": finite("cached_cuda_bf16"),
    }
    result["memory"] = {
        k.removeprefix("memory_"): {
            "overrides": LONG[k.removeprefix("memory_")],
            "tracked": v["memory_report"],
            "allocator_peak_mb": [r["train/peak_mem_mb"] for r in v["records"]],
        }
        for k, v in done.items()
        if k.startswith("memory_") and "records" in v
    }
    result["sync"] = sync_checks(f, root)
    return result


def markdown(r: dict[str, Any]) -> str:
    gib = r["total_memory"] / 2**30
    lines = [
        f"### Fine-tuning paths on CUDA ({r['device']}, torch {r['torch']})",
        "",
        f"`total_memory` {r['total_memory']:,} bytes ({gib:.1f} GiB). "
        f"Errors: {sorted(r['errors']) or 'none'}.",
        "",
        "| check | figure |",
        "| --- | --- |",
    ]
    c, k = r["chat"], r["cached"]
    rows = [
        (
            "chat+LoRA, CUDA fp32 vs CPU fp32, max loss difference over 10 steps",
            c["cuda_vs_cpu_fp32_max_loss_diff"],
        ),
        (
            "chat+LoRA, micro 8 x accum 1 vs micro 2 x accum 4 (CUDA fp32)",
            c["split_8x1_vs_2x4_max_loss_diff"],
        ),
        (
            "chat+LoRA step-1 gradient norm (fp32 / bf16 / fp16)",
            " / ".join(
                f"{c['step1_grad_norm'].get(f'chat_cuda_{p}', float('nan')):.5f}"
                for p in ("fp32", "bf16", "fp16")
            ),
        ),
        ("chat+LoRA finite", c["finite"]),
        ("chat+LoRA fp16 loss scale (last)", c["loss_scale_last"]),
        (
            "step=cached 4x6 vs the whole batch 24x1 (CUDA fp32), max loss difference",
            k["cached_4x6_vs_whole_24x1_max_loss_diff"],
        ),
        ("step=cached CUDA vs CPU (fp32), max loss difference", k["cuda_vs_cpu_max_loss_diff"]),
        ("step=cached bf16 finite", k["bf16_finite"]),
    ]
    rows += [(f"no host-device sync, {n}", v) for n, v in r["sync"].items()]
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def compare_plans(result: dict[str, Any], gpu: str) -> str:
    """Each memory run's plan (`trainer.plan`, run here on the CPU for `plan.gpu=gpu`) against
    the CUDA run's tracked peak and the allocator's peak."""
    from trainer.plan import main as plan_main

    lines = [
        "",
        f"| run | planned peak MiB (plan.gpu={gpu}) | tracked peak MiB (CUDA run) | "
        "allocator peak MiB (CUDA run) | planned / tracked | planned / allocator |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in result["memory"].items():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "plan.json"
            args = [*m["overrides"], *PLANNED, "plan.world=1", f"plan.gpu={gpu}"]
            plan_main([*args, f"plan.out={out}"])
            planned = json.loads(out.read_text())["roles"][0]["peak_bytes"] / 2**20
        tracked = m["tracked"]["peak_bytes"] / 2**20
        alloc = max(m["allocator_peak_mb"])
        lines.append(
            f"| {name} | {planned:.1f} | {tracked:.1f} | {alloc:.1f} | {planned / tracked:.3f} | "
            f"{planned / alloc:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--compare", help="a finetune_checks.json: plan its memory runs here")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--sync-only", action="store_true", help="only the host-device sync checks")
    args = ap.parse_args()
    if args.compare:
        print(compare_plans(json.loads(Path(args.compare).read_text()), args.gpu))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sync_only:
        with tempfile.TemporaryDirectory() as tmp:
            f = fixtures(Path(tmp))
            print(json.dumps(sync_checks(f, Path(tmp)), indent=1))
        return
    with tempfile.TemporaryDirectory() as tmp:
        result = run_all(Path(tmp))
    (out / "finetune_checks.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "finetune_checks.md").write_text(text)
    print(text)
    for name, err in result["errors"].items():
        print(f"== {name} failed:\n{err}")


if __name__ == "__main__":
    main()
