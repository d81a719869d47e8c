"""Every shell script parses; the launcher really launches."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, TINY, read_metrics, train_records
from tests.ranks import explain, launch, launch_all, python_cmd

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


@pytest.mark.launches
def test_multirun_from_the_command_line_and_from_a_config(tmp_path: Path) -> None:
    """Hydra's multirun still runs each job: asked with `-m` (scripts/multirun.sh's way; the
    run mode then comes from the command line alone, trainer.config.cli.compose_once), and
    asked by a config of the user's own that sets `hydra.mode: MULTIRUN` (with
    `hydra.searchpath`, Hydra composes to read it, as it always did). Each job trains in its
    own directory with its own learning rate."""
    user = tmp_path / "configs" / "experiment"
    user.mkdir(parents=True)
    (user / "sweep.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n"
        "    params:\n      optim.lr: 0.01,0.02\n"
    )
    cmds = {
        "flag": python_cmd(
            "trainer.train", "-m", *TINY, "train.max_steps=2", "optim.lr=0.01,0.02",
            f"hydra.sweep.dir={tmp_path / 'flag'}",
        ),
        "config": python_cmd(
            "trainer.train", *TINY, "train.max_steps=2", "experiment=sweep",
            f"hydra.searchpath=[file://{tmp_path / 'configs'}]",
            f"hydra.sweep.dir={tmp_path / 'config'}",
        ),
    }  # fmt: skip
    for name, proc in launch_all(cmds, 240).items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
        for job, lr in (("0", 0.01), ("1", 0.02)):
            records = train_records(read_metrics(tmp_path / name / job))
            assert [r["step"] for r in records] == [1, 2], (name, job)
            saved = yaml.safe_load((tmp_path / name / job / ".hydra" / "config.yaml").read_text())
            assert saved["optim"]["lr"] == lr, (name, job, saved["optim"])
