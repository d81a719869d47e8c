#!/usr/bin/env bash
# One node: one process per GPU (or NPROC processes on CPU), overrides passed through.
#   scripts/launch.sh [hydra overrides...]          e.g. scripts/launch.sh train.max_steps=1000
#   NPROC=4 scripts/launch.sh ...                   force the process count
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$($PY -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
if [[ "$NPROC" -gt 1 ]]; then
  # CPU workers share the cores; GPUs get a thread each for the host side.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec $PY -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m trainer.train "$@"
fi
exec $PY -m trainer.train "$@"
