#!/usr/bin/env bash
# Fault-tolerant training on one machine (ft=torchft, docs/guides/fault-tolerance.md): torchft's
# lighthouse and GROUPS replica groups of PROCS processes each, every group under
#   torchrun --standalone --nproc_per_node=PROCS --max-restarts=K
# inside a relaunch loop (a killed agent comes back too), so a lost group comes back by
# itself and takes the live state from a peer. Usage:
#   scripts/ft_local.sh GROUPS PROCS -- [training overrides]
#   scripts/ft_local.sh 2 1 -- model=gpt_tiny train.max_steps=200 train.global_batch_size=32
# Every group writes to the same run directory (hydra.run.dir; default outputs/ft-<time>);
# each group's console goes to RUN_DIR/ft/group<G>.log, prefixed lines to this terminal.
# Environment: FT_MAX_RESTARTS (torchrun's --max-restarts per launch, 3), FT_RELAUNCHES
# (launches of one group's torchrun, 10), FT_PORT (the lighthouse's port; 0: a free one),
# FT_MIN_LAUNCH_S (30), PYTHON (the interpreter), and the lighthouse's own settings:
# FT_HEARTBEAT_TIMEOUT_S (2), FT_JOIN_TIMEOUT_S (5).
set -uo pipefail

usage() {
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}
[ $# -ge 2 ] || usage
GROUPS_N=$1 PROCS=$2
shift 2
[ "${1:-}" = "--" ] && shift
case "$GROUPS_N$PROCS" in *[!0-9]*) usage ;; esac
[ "$GROUPS_N" -ge 1 ] && [ "$PROCS" -ge 1 ] || usage

PYTHON=${PYTHON:-python}
RESTARTS=${FT_MAX_RESTARTS:-3}
RELAUNCHES=${FT_RELAUNCHES:-10}
RUN_DIR="" MIN_GROUPS=1
for arg in "$@"; do
  case "$arg" in
    hydra.run.dir=*) RUN_DIR=${arg#hydra.run.dir=} ;;
    ft.min_groups=*) MIN_GROUPS=${arg#ft.min_groups=} ;;
    ft.group=* | ft.groups=* | ft.lighthouse=*)
      echo "error: $arg is set by scripts/ft_local.sh itself" >&2
      exit 2
      ;;
  esac
done
if [ -z "$RUN_DIR" ]; then
  RUN_DIR=outputs/ft-$(date +%Y-%m-%d_%H-%M-%S)
  set -- "$@" "hydra.run.dir=$RUN_DIR"
fi
mkdir -p "$RUN_DIR/ft"

"$PYTHON" -m trainer.lighthouse --port "${FT_PORT:-0}" --min-groups "$MIN_GROUPS" \
  --heartbeat-timeout-s "${FT_HEARTBEAT_TIMEOUT_S:-2}" \
  --join-timeout-s "${FT_JOIN_TIMEOUT_S:-5}" >"$RUN_DIR/ft/lighthouse.addr" \
  2>"$RUN_DIR/ft/lighthouse.log" &
LIGHTHOUSE=$!
PIDS=() TAILS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  kill -TERM "$LIGHTHOUSE" 2>/dev/null
  wait 2>/dev/null
}
trap 'cleanup; exit 130' INT TERM
for _ in $(seq 600); do
  [ -s "$RUN_DIR/ft/lighthouse.addr" ] && break
  kill -0 "$LIGHTHOUSE" 2>/dev/null || { cat "$RUN_DIR/ft/lighthouse.log" >&2; exit 1; }
  sleep 0.1
done
ADDRESS=$(head -n 1 "$RUN_DIR/ft/lighthouse.addr")
echo "lighthouse $ADDRESS; $GROUPS_N groups of $PROCS processes; run dir $RUN_DIR"

# One group: torchrun (which restarts its workers) in a loop that launches it again, until
# it finishes, a launch reports bad input (`error: `: every relaunch would say the same), a
# launch spent its restarts within FT_MIN_LAUNCH_S (30) seconds (a failure that persists), or
# RELAUNCHES launches failed.
group() {
  local g=$1 log="$RUN_DIR/ft/group$1.log" launch began
  shift
  for launch in $(seq "$RELAUNCHES"); do
    began=$SECONDS
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m torch.distributed.run --standalone \
      --nproc_per_node="$PROCS" --max-restarts="$RESTARTS" -m trainer.train \
      ft=torchft "ft.lighthouse=$ADDRESS" "ft.group=$g" "ft.groups=$GROUPS_N" "$@" \
      >>"$log" 2>&1 && return 0
    grep -q "^error: " "$log" && return 2
    if [ $((SECONDS - began)) -lt "${FT_MIN_LAUNCH_S:-30}" ]; then
      echo "group $g: torchrun spent its $RESTARTS restarts in $((SECONDS - began)) s; stopping" >>"$log"
      return 1
    fi
    echo "group $g: launch $launch ended; launching again" >>"$log"
  done
  return 1
}
for g in $(seq 0 $((GROUPS_N - 1))); do
  : >"$RUN_DIR/ft/group$g.log"
  group "$g" "$@" &
  PIDS+=($!)
  tail -q -n +1 -F "$RUN_DIR/ft/group$g.log" 2>/dev/null | sed -u "s/^/[group $g] /" &
  TAILS+=($!)
done
STATUS=0
for pid in "${PIDS[@]}"; do
  wait "$pid" || STATUS=$?
done
sleep 0.5
kill "${TAILS[@]}" "$LIGHTHOUSE" 2>/dev/null
wait 2>/dev/null
exit "$STATUS"
