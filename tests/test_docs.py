"""The code in docs/extending.md and docs/your-model.md runs as documented: in plain Python,
from Python through the trainer, and from the command line; docs/architecture.md's example
extension runs as a doctest; the README's table of common overrides names every `train.*`
key."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, read_metrics, received, train_records
from tests.ranks import explain, launch, launch_all
from tests.user_project import commands, write_project

DOC = REPO / "docs" / "extending.md"


def overrides_table() -> str:
    """The table of common overrides: the first table of the commands reference's
    `trainer.train` section."""
    commands = (REPO / "docs" / "reference" / "commands.md").read_text()
    training = commands.split("\n## `trainer.train`\n", 1)[1]
    rows = re.search(r"\n\| key \| meaning \|\n(?:\|.*\n)+", training.split("\n## ", 1)[0])
    assert rows, "docs/reference/commands.md: no key table in the trainer.train section"
    return rows.group(0)


def test_readme_overrides_table_names_every_train_key() -> None:
    """Every key of the schema's `train` section is in the table of common overrides
    (where a user looks first: `train.log_every` and `train.device` were missing)."""
    from trainer.config.schema import TrainCfg

    named = set(re.findall(r"`train\.(\w+)", overrides_table()))
    missing = [f"train.{f.name}" for f in dataclasses.fields(TrainCfg) if f.name not in named]
    assert not missing, f"the table of common overrides lacks {missing}"


def test_architecture_example_extension_runs() -> None:
    """docs/architecture.md's example extension, as a doctest: a run assembled with it."""
    import doctest

    doc = REPO / "docs" / "architecture.md"
    result = doctest.testfile(str(doc), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0, result


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.launches
def test_documented_python_runs(tmp_path: Path) -> None:
    """All Python blocks, in order, as one script: the plain-Python driver asserts it learns."""
    script = tmp_path / "doc_example.py"
    script.write_text("\n".join(python_blocks()))
    proc = launch([sys.executable, str(script)], 120)
    assert proc.returncode == 0, explain(proc)
    assert "final loss" in proc.stdout


@pytest.mark.launches
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
        cmd = [sys.executable, "-m", "trainer.train", *args, f"hydra.run.dir={run}"]
        proc = launch(cmd, 120, PYTHONPATH=str(tmp_path))
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


@pytest.mark.launches
def test_your_model_doc_runs(tmp_path: Path) -> None:
    """docs/your-model.md: its package and config folder, written out, train from the
    command line and from Python as documented; both learn the tagging rule,
    `trainer.compare` finds the two splits of one global batch on the same trajectory, and
    `trainer.evaluate` on the command-line run's checkpoint reports its accuracy."""
    project = write_project(tmp_path)
    bash, compare = commands("bash")
    (script,) = commands("python")
    (tmp_path / "from_python.py").write_text(script)
    # The doc's `PYTHONPATH=.` would hide this checkout behind an installed cumulus.
    bash = bash.replace("PYTHONPATH=.", f"PYTHONPATH=.:{REPO}")
    cmds = {
        "cli": ["bash", "-c", bash.replace("python -m", f"{sys.executable} -m")],
        "python": [sys.executable, "from_python.py"],
    }
    results = launch_all(cmds, 180, cwd=project)
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
    assert "val/accuracy" in results["python"].stdout
    evals = [r for r in read_metrics(project / "runs" / "tagger") if "val/accuracy" in r]
    assert [r["step"] for r in evals] == [50, 100, 150]
    assert evals[-1]["val/accuracy"] > 0.8, evals
    assert compare.startswith("python -m trainer.compare "), compare
    proc = launch(
        ["bash", "-c", compare.replace("python -m", f"{sys.executable} -m")], 60, cwd=project
    )
    assert proc.returncode == 0, explain(proc)
    loss = [line.split() for line in proc.stdout.splitlines() if line.startswith("train/loss ")]
    assert loss and loss[0][1] == "15", proc.stdout  # every record (train.log_every=10)
    evaluate = [sys.executable, "-m", "trainer.evaluate"]
    run = f"checkpoint={project}/runs/tagger"
    theirs = received(project / "runs/tagger/checkpoints/step_00000150", tmp_path / "theirs")
    results = launch_all(
        {
            "folder": [*evaluate, run, f"hydra.searchpath=[file://{project}/my_configs]"],
            "bare": [*evaluate, run],  # the run is this user's own: no flag needed
            "received": [*evaluate, f"checkpoint={theirs}"],
        },
        120,
        cwd=project,
    )
    # Received, without the config folder the checkpoint's targets are not trusted.
    assert results["received"].returncode == 2 and "trust=[" in results["received"].stderr
    for name in ("folder", "bare"):
        proc = results[name]
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["step"] == 150
        assert got["val/accuracy"] == evals[-1]["val/accuracy"]
        assert got["val/loss"] == pytest.approx(evals[-1]["val/loss"], rel=1e-12)
