#!/usr/bin/env bash
# GPU figures for docs/benchmarks.md: the experiment=gpt2_small preset on byte tokens of the
# stdlib sources, activation-checkpointing memory, checkpoint stall, fp16 host-device syncs.
#   scripts/gpu_preset.sh [report.md]
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-docs/benchmarks.md}
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
export PYTHONUNBUFFERED=1
$PY scripts/prepare_bin.py "$TMP/bin"
echo "== experiment=gpt2_small, 300 steps, global batch 128 x 1024 tokens"
$PY -m trainer.train experiment=gpt2_small data.path="$TMP/bin" train.max_steps=300 \
  train.global_batch_size=128 scheduler.warmup_steps=50 eval.every_steps=100 \
  checkpoint.every_steps=0 logger=none hydra.run.dir="$TMP/run" 2>&1 | tee "$TMP/run.log" | grep -vE "^\[" || true
$PY - "$TMP" "$REPORT" <<'PYEOF'
import json, sys
tmp, report = sys.argv[1], sys.argv[2]
recs = [json.loads(l) for l in open(f"{tmp}/run/metrics.jsonl")]
train = [r for r in recs if "train/loss" in r]
val = [r for r in recs if "val/loss" in r]
compile_line = next((l.strip() for l in open(f"{tmp}/run.log") if "torch.compile" in l), "")
steady = train[len(train) // 2:]
tok = sorted(r["train/tokens_per_s"] for r in steady)[len(steady) // 2]
mfu = sorted(r.get("train/mfu", 0) for r in steady)[len(steady) // 2]
lines = [
    "\n### experiment=gpt2_small on one GPU (scripts/gpu_preset.sh)\n",
    "GPT-2 small shapes (124M parameters, vocab 50304), bf16 autocast, torch.compile, byte tokens",
    "of the stdlib sources as a uint16 .bin (no download on the GPU machine), global batch",
    "128 x 1024 tokens (micro 16 x accum 8), 300 steps. " + compile_line + ".\n",
    f"- steady-state throughput (median of the second half): {tok:,.0f} tokens/s, MFU {mfu:.1%}",
    f"- step time {steady[-1]['train/step_time_ms']:.0f} ms, peak memory {steady[-1]['train/peak_mem_mb']:,.0f} MB",
    f"- train loss {train[0]['train/loss']:.3f} (step {train[0]['step']}) -> {train[-1]['train/loss']:.3f} (step {train[-1]['step']});"
    f" validation loss " + ", ".join(f"{r['val/loss']:.3f} (step {r['step']})" for r in val),
]
text = "\n".join(lines)
print(text)
open(report, "a").write(text + "\n")
PYEOF
echo "== activation checkpointing, 12 x 768, block 1024, micro 16, bf16"
$PY scripts/bench_memory.py --activation-checkpointing --report "$REPORT" model.n_layer=12 \
  model.n_head=12 model.n_embd=768 model.block_size=1024 train.micro_batch_size=16 \
  train.grad_accum_steps=1 train.precision=bf16
echo "== checkpoint stall, 12 x 768"
$PY scripts/bench_checkpoint.py --saves 3 --report "$REPORT" model.n_layer=12 model.n_head=12 \
  model.n_embd=768 model.block_size=256 train.micro_batch_size=16 train.grad_accum_steps=1
echo "== fp16 (GradScaler) host-device syncs and ratio"
$PY scripts/bench.py --label "GPU gpt_small fp16 (GradScaler)" --accum 1,4 --rounds 3 --steps 20 \
  --report "$REPORT" train.precision=fp16
