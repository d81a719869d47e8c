#!/usr/bin/env bash
# GPU checks of "where the time goes" that CPU CI cannot do: phase times read from CUDA events,
# a profiled window with CUDA kernels in each rank's trace and the merged timeline, and
# profile.memory=true's allocator snapshot. Usage: scripts/gpu_profile_checks.sh (one or more
# CUDA GPUs; with two or more, the 2-rank NCCL run is checked too).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
COMMON="model=gpt_small logger=none eval.every_steps=0 checkpoint.every_steps=0 train.log_every=1"
COMMON="$COMMON train.max_steps=6 profile=torch profile.steps=[3,4] profile.memory=true"
export PYTHONUNBUFFERED=1
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")

echo "== 1 GPU: profiled steps 3-4, memory history"
$PY -m trainer.train $COMMON hydra.run.dir=$TMP/one > $TMP/one.log 2>&1 || { cat $TMP/one.log; exit 1; }
RUNS="one"
if [ "$GPUS" -ge 2 ]; then
  echo "== 2 GPUs (NCCL): the same"
  $PY -m torch.distributed.run --standalone --nproc_per_node=2 -m trainer.train $COMMON \
    hydra.run.dir=$TMP/two > $TMP/two.log 2>&1 || { cat $TMP/two.log; exit 1; }
  RUNS="one two"
fi
$PY - "$TMP" $RUNS <<'PYEOF'
import gzip, json, sys
from pathlib import Path
tmp, runs = Path(sys.argv[1]), sys.argv[2:]
for run in runs:
    d = tmp / run
    records = [json.loads(l) for l in open(d / "metrics.jsonl") if "train/loss" in l]
    for r in records:
        for p in ("data", "compute", "sync", "optimizer"):
            assert r[f"time/{p}_s"] >= 0, (run, r)
        assert r["time/compute_s"] > 0, (run, r)
    assert [r["step"] for r in records if r.get("time/profiled")] == [2, 3, 4], run
    merged = json.load(gzip.open(d / "profile" / "timeline.json.gz", "rt"))
    kernels = [e for e in merged["traceEvents"] if e.get("cat") == "kernel"]
    assert kernels, f"{run}: no CUDA kernel in the merged timeline"
    ranks = {e["pid"] for e in merged["traceEvents"]}
    snapshots = sorted(p.name for p in (d / "profile").glob("memory_rank*.pickle"))
    assert len(snapshots) == len(ranks), (run, snapshots)
    summary = (d / "summary.txt").read_text()
    assert "self device" in summary, summary
    print(f"{run}: ranks {sorted(ranks)}, {len(kernels)} kernels, snapshots {snapshots}")
    print("  " + " | ".join(f"{k} {records[-1][k]:.4f}" for k in records[-1] if k.endswith("_s")))
PYEOF
echo "OK: phase times from CUDA events, kernels in the merged timeline, memory snapshots"
