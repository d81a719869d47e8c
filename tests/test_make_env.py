"""Which Python `make` installs into (scripts/python_env.sh): the system's externally managed
python3 (PEP 668) gets the project's `.venv`; an active venv or conda env is used as it is;
`make PYTHON=...` wins; a python3 without `venv` is one line naming the package. The whole
path (a fresh clone, `make train` and `make test-fast` through `.venv`) is
scripts/check_system_python.sh, which CI runs after `make test`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "python_env.sh"
SYSTEM = Path("/usr/bin/python3")


def managed(python: Path) -> bool:
    check = (
        "import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join("
        "sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))"
    )
    return python.exists() and subprocess.run([str(python), "-c", check]).returncode == 0


def fake_python(bin_dir: Path, without_venv: bool = False) -> Path:
    """A `python3` that is another interpreter (the system's, externally managed; or this
    test's, not managed), optionally lacking `venv`/`ensurepip` as Ubuntu without
    python3-venv does."""
    target = SYSTEM if managed(SYSTEM) else Path(sys.executable)
    lines = ["#!/bin/sh"]
    if without_venv:
        lines.append(
            'case "$*" in *"import ensurepip"*|*"-m venv"*) '
            "echo \"ModuleNotFoundError: No module named 'ensurepip'\" >&2; exit 1;; esac"
        )
    lines.append(f'exec {target} "$@"')
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python3").write_text("\n".join(lines) + "\n")
    (bin_dir / "python3").chmod(0o755)
    return target


def run(where: Path, bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    base["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    return subprocess.run(
        ["sh", str(SCRIPT), *args], cwd=where, env={**base, **env}, capture_output=True, text=True
    )


@pytest.mark.launches
def test_the_interpreter_make_chooses(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    target = fake_python(bin_dir)
    want = ".venv/bin/python" if managed(target) else "python3"
    assert run(tmp_path, bin_dir).stdout.strip() == want
    # An active environment is used as it is: nothing chosen, nothing created.
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        assert run(tmp_path, bin_dir, **{var: str(tmp_path / "env")}).stdout.strip() == "python3"
    assert run(tmp_path, bin_dir, "create", "python3").returncode == 0
    assert not (tmp_path / ".venv").exists()
    # A .venv made here earlier is used again.
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    assert run(tmp_path, bin_dir).stdout.strip() == ".venv/bin/python"


@pytest.mark.launches
def test_make_python_wins() -> None:
    proc = subprocess.run(
        ["make", "-n", "setup", "PYTHON=/opt/my/python"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "/opt/my/python -m pip install" in proc.stdout
    assert "python_env.sh create /opt/my/python" in proc.stdout


@pytest.mark.launches
@pytest.mark.skipif(not managed(SYSTEM), reason="/usr/bin/python3 is not externally managed")
def test_a_python_without_venv_is_one_line(tmp_path: Path) -> None:
    """Ubuntu's python3 without python3-venv: one line naming the package, exit 1, and no
    half-made .venv left behind."""
    bin_dir = tmp_path / "bin"
    fake_python(bin_dir, without_venv=True)
    proc = run(tmp_path, bin_dir, "create")
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.search(r"sudo apt install python3\.\d+-venv", lines[0]), lines[0]
    assert "PYTHON=" in lines[0] and "externally managed" in lines[0]
    assert not (tmp_path / ".venv").exists()
