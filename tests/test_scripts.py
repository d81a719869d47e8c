"""Every shell script parses; the launcher really launches."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, read_metrics, train_records
from tests.ranks import explain, launch

SCRIPTS = sorted(
    [
        *REPO.glob("scripts/*.sh"),
        *REPO.glob("scripts/*.sbatch"),
        *REPO.glob("docker/*.sh"),
        REPO / ".ci" / "run",
    ]
)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_parses(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.launches
def test_launch_sh_single_process(tmp_path: Path) -> None:
    """`scripts/launch.sh` with overrides trains (one process on a CPU-only machine). The real
    command: the script is what is tested."""
    run_dir = tmp_path / "run"
    script = ["bash", str(REPO / "scripts" / "launch.sh"), *TINY, "train.max_steps=2"]
    proc = launch([*script, f"hydra.run.dir={run_dir}"], 120, cwd=tmp_path, real=True)
    assert proc.returncode == 0, explain(proc)
    assert [r["step"] for r in train_records(read_metrics(run_dir))] == [1, 2]


def test_dockerfile_installs_the_package() -> None:
    """No Docker engine here: check that the image copies what `pip install` needs."""
    text = (REPO / "docker" / "Dockerfile").read_text()
    for needed in ("pyproject.toml", "engine", "trainer", "configs", "launch.sh"):
        assert needed in text
    assert text.count("FROM ") == 1 and "pytorch/pytorch" in text
