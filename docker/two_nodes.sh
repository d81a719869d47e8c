#!/usr/bin/env bash
# Without Docker: two single-process "nodes" on this host through a c10d rendezvous.
#   docker/two_nodes.sh [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-29511}
RUN=${RUN:-outputs/two_nodes}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
launch() {
  python3 -m torch.distributed.run --nnodes=2 --nproc_per_node=1 --node_rank="$1" \
    --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:$PORT --rdzv_id=two_nodes_$$ \
    -m trainer.train hydra.run.dir="$RUN" "${@:2}"
}
launch 0 "$@" & A=$!
launch 1 "$@" & B=$!
wait $A && wait $B
