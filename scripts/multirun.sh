#!/usr/bin/env bash
# A learning-rate sweep with Hydra's multirun: one run directory per value under multirun/.
#   scripts/multirun.sh [extra overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
exec ${PYTHON:-python3} -m trainer.train -m optim.lr=1e-3,3e-3,1e-2 "$@"
