"""The code in docs/extending.md runs as documented: in plain Python and from the CLI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, TINY, env, explain, read_metrics, train_records

DOC = REPO / "docs" / "extending.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_documented_python_runs(tmp_path: Path) -> None:
    """All Python blocks, in order, as one script: the plain-Python driver asserts it learns."""
    script = tmp_path / "doc_example.py"
    script.write_text("\n".join(python_blocks()))
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
        cwd=REPO,
    )
    assert proc.returncode == 0, explain(proc)
    assert "final loss" in proc.stdout


def test_documented_cli_runs(tmp_path: Path) -> None:
    """The step and callback blocks as a user module, selected on the command line; with a
    sharded checkpoint at step 2, a resumed run repeats steps 3-4 exactly, callback included
    (its state changes shape, None then a tensor: it travels as plain data)."""
    blocks = python_blocks()
    (tmp_path / "my_ext.py").write_text("\n".join(blocks[:2]))
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "train.max_steps=4",
        "step._target_=my_ext.GradNoiseStep",
        "+step.eta=0.001",
        "+callbacks.pnorm._target_=my_ext.ParamNorm",
        "checkpoint.every_steps=2",
        "checkpoint.format=sharded",
    ]

    def train(run: Path) -> list[dict]:
        proc = subprocess.run(
            [sys.executable, "-m", "trainer.train", *args, f"hydra.run.dir={run}"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env(PYTHONPATH=str(tmp_path)),
            cwd=REPO,
        )
        assert proc.returncode == 0, explain(proc)
        return train_records(read_metrics(run))

    records = train(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["param_norm"] > 0 for r in records)
    assert records[-1]["param_norm_grew"] >= 0
    resumed_dir = tmp_path / "resumed"
    name = "checkpoints/step_00000002"
    shutil.copytree(run_dir / name, resumed_dir / name)
    resumed = train(resumed_dir)
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("train/loss", "param_norm", "param_norm_grew"):
        assert [r[key] for r in resumed] == [r[key] for r in records[2:]], key
