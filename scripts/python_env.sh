#!/bin/sh
# The Python interpreter `make` installs into and runs (the Makefile's PYTHON default).
#
#   sh scripts/python_env.sh           prints it
#   sh scripts/python_env.sh create    makes the project's .venv when it is the one chosen
#
# The choice: an active virtual environment or conda environment keeps being used (python3);
# a .venv made here earlier is used again; a python3 that is externally managed (PEP 668:
# Debian's and Ubuntu's own Python, where `pip install` is refused) gets a project .venv;
# any other python3 (pyenv, a Python built from source) is used as it is. `make PYTHON=...`
# overrides all of this.
set -eu

VENV=.venv

choose() {
    if [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
        echo python3
    elif [ -x "$VENV/bin/python" ]; then
        echo "$VENV/bin/python"
    elif python3 -c 'import os, sys, sysconfig
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))' \
        2>/dev/null; then
        echo "$VENV/bin/python"
    else
        echo python3
    fi
}

create() {
    chosen=${1:-$(choose)}
    [ "$chosen" = "$VENV/bin/python" ] || return 0
    [ -x "$VENV/bin/python" ] && return 0
    version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
        echo "make: python3 $version is externally managed (PEP 668) and cannot make the project's .venv: its venv module is missing; install it (Debian/Ubuntu: sudo apt install python$version-venv), or run make PYTHON=/path/to/a/python you can install into" >&2
        exit 1
    fi
    if ! python3 -m venv "$VENV" >"$VENV.log" 2>&1; then
        rm -rf "$VENV"
        echo "make: 'python3 -m venv $VENV' failed (its output: $VENV.log); run make PYTHON=/path/to/a/python you can install into" >&2
        exit 1
    fi
    rm -f "$VENV.log"
    echo "make: python3 $version is externally managed (PEP 668): installing into the project's $VENV (activate it for the python -m trainer.* commands: . $VENV/bin/activate)"
}

case "${1:-}" in
    "") choose ;;
    create) create "${2:-}" ;;
    *) echo "usage: sh scripts/python_env.sh [create [INTERPRETER]]" >&2; exit 2 ;;
esac
