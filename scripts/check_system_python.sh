#!/usr/bin/env bash
# The README's commands on a machine whose python3 is the system's (PEP 668), as a new user
# meets them on a fresh Debian or Ubuntu VM: run by .ci/run after `make test`.
#
# 1. A fresh clone, a PATH whose first python3 is /usr/bin's, no environment active:
#    `make train ARGS="train.max_steps=5"` and `make test-fast` succeed, through a project
#    .venv that make creates.
# 2. With that venv active, a second fresh clone's `make train` uses it: no new .venv.
#
# Skipped (exit 0, one line) where /usr/bin/python3 is missing or not externally managed.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
system=/usr/bin/python3
if ! [ -x "$system" ] || ! "$system" -c 'import os, sys, sysconfig
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
    echo "check_system_python: skipped: $system is missing or not externally managed"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The user's shell on a fresh VM: the system's directories first, nothing activated.
clean_env=(env -u VIRTUAL_ENV -u CONDA_PREFIX -u PYTHON -u PYTHONPATH -u PYENV_VERSION
    "PATH=/usr/local/bin:/usr/bin:/bin" "TMPDIR=$work")
# On failure the clone is kept for a look (its logs, its .venv).
fail() { trap - EXIT; echo "check_system_python: FAILED: $* (kept: $work)" >&2; exit 1; }

git clone --quiet "$repo" "$work/first"
cd "$work/first"
"${clean_env[@]}" make train ARGS="train.max_steps=5" >"$work/train.log" 2>&1 ||
    { tail -40 "$work/train.log"; fail "make train with the system python3"; }
grep -q "externally managed (PEP 668): installing into the project's .venv" "$work/train.log" ||
    fail "make train did not say that it made .venv"
[ -x .venv/bin/python ] || fail "no .venv/bin/python after make train"
"${clean_env[@]}" make test-fast >"$work/test-fast.log" 2>&1 ||
    { grep -E "^(FAILED|ERROR)|passed|failed" "$work/test-fast.log" | tail -40; fail "make test-fast with the system python3"; }
echo "check_system_python: make train and make test-fast passed through $work/first/.venv"

# A user who activated a venv keeps it: the second clone's make creates nothing.
git clone --quiet "$repo" "$work/second"
cd "$work/second"
"${clean_env[@]}" bash -c '. ../first/.venv/bin/activate && make train ARGS="train.max_steps=2 logger=none"' \
    >"$work/active.log" 2>&1 || { tail -40 "$work/active.log"; fail "make train in an active venv"; }
[ ! -e .venv ] || fail "make made a .venv although a venv was active"
echo "check_system_python: with a venv active, make used it and created nothing"
