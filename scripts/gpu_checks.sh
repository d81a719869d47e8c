#!/usr/bin/env bash
# GPU checks that CPU CI cannot do: CUDA autocast + GradScaler, torch.compile, throughput, MFU
# and host-device syncs. Usage: scripts/gpu_checks.sh [report.md]  (needs one CUDA GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-docs/benchmarks.md}
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
COMMON="logger=none eval.every_steps=0 checkpoint.every_steps=0 train.log_every=1"
export PYTHONUNBUFFERED=1

echo "== precision: 30 steps of gpt_small in fp32 / bf16 / fp16"
for p in fp32 bf16 fp16; do
  $PY -m trainer.train $COMMON train.max_steps=30 train.precision=$p hydra.run.dir=$TMP/$p \
    > $TMP/$p.log 2>&1 || { cat $TMP/$p.log; exit 1; }
done
echo "== compile: 30 steps eager vs train.compile=true"
$PY -m trainer.train $COMMON train.max_steps=30 train.compile=true hydra.run.dir=$TMP/compiled \
  > $TMP/compiled.log 2>&1 || { cat $TMP/compiled.log; exit 1; }
$PY - "$TMP" "$REPORT" <<'PYEOF'
import json, sys, math
tmp, report = sys.argv[1], sys.argv[2]
def recs(d): return [json.loads(l) for l in open(f"{tmp}/{d}/metrics.jsonl") if "train/loss" in l]
r = {d: recs(d) for d in ("fp32", "bf16", "fp16", "compiled")}
lines = ["\n### GPU precision and compile checks (scripts/gpu_checks.sh)\n",
         "| run | step-1 grad norm | vs fp32 | final loss | finite | loss scale (last) |", "|---|---|---|---|---|---|"]
g0 = r["fp32"][0]["train/grad_norm"]
for d, rs in r.items():
    fin = all(math.isfinite(x["train/loss"]) for x in rs)
    lines.append(f"| {d} | {rs[0]['train/grad_norm']:.4f} | {rs[0]['train/grad_norm']/g0-1:+.2%} | "
                 f"{rs[-1]['train/loss']:.4f} | {fin} | {rs[-1].get('train/loss_scale', '-')} |")
diff = max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(r["fp32"], r["compiled"]))
lines.append(f"\nCompiled vs eager (fp32, 30 steps): max |train/loss difference| = {diff:.2e}")
text = "\n".join(lines)
print(text)
open(report, "a").write(text + "\n")
PYEOF
grep -h "compile" $TMP/compiled.log | head -3 || true

echo "== bench: gpt_small, fp32 and bf16, accum 1/4/16"
$PY scripts/bench.py --label "GPU gpt_small fp32" --accum 1,4,16 --rounds 3 --steps 20 --report "$REPORT"
$PY scripts/bench.py --label "GPU gpt_small bf16" --accum 1,4,16 --rounds 3 --steps 20 --report "$REPORT" train.precision=bf16
echo "== bench: GPT-2-small shapes (12 x 768, block 1024, byte vocab), bf16, for MFU"
$PY scripts/bench.py --label "GPU 12x768 bf16" --accum 1,4 --rounds 2 --steps 10 --report "$REPORT" \
  train.precision=bf16 model.n_layer=12 model.n_head=12 model.n_embd=768 model.block_size=1024 \
  train.micro_batch_size=16
