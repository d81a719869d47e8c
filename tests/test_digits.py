"""`experiment=digits`: a CNN classifier on scikit-learn's bundled handwritten digits, a task
that is not language modelling, through the same trainer.

One full run of the shipped experiment on 1 process and one on 2 ranks (each rank one
micro-batch of 32 where the single process accumulates two: the same global batch of 64),
launched together; `trainer.evaluate` then reads the final checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import read_metrics, train_records
from tests.ranks import explain, launch_all, torchrun_cmd

TIMEOUT = 240.0
ARGS = ["experiment=digits", "logger=none", "train.log_every=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("digits")
    cmds = {
        "one": [sys.executable, "-m", "trainer.train", *ARGS, f"hydra.run.dir={root / 'one'}"],
        "two": [
            *torchrun_cmd(2), "-m", "trainer.train", *ARGS, "train.micro_batch_size=32",
            "train.grad_accum_steps=1", f"hydra.run.dir={root / 'two'}",
        ],
    }  # fmt: skip
    for name, proc in launch_all(cmds, TIMEOUT).items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
    return {name: root / name for name in cmds}


def evals(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in read_metrics(run_dir) if "val/accuracy" in r}


@pytest.mark.multiproc
def test_digits_reaches_95_percent_and_ranks_agree(runs: dict[str, Path]) -> None:
    """The shipped experiment reaches >= 95% validation accuracy, and 2 ranks follow the
    single process's trajectory (every step's loss) to the same accuracy."""
    one, two = evals(runs["one"]), evals(runs["two"])
    assert sorted(one) == sorted(two) == [100, 200, 300]
    assert one[300]["val/items"] == 360  # every 5th of the 1,797 images
    assert one[300]["val/accuracy"] >= 0.95, one
    for step in one:
        assert two[step]["val/accuracy"] == one[step]["val/accuracy"], step
        assert two[step]["val/loss"] == pytest.approx(one[step]["val/loss"], abs=1e-6)
    a, b = train_records(read_metrics(runs["one"])), train_records(read_metrics(runs["two"]))
    assert len(a) == len(b) == 300
    diff = max(abs(x["train/loss"] - y["train/loss"]) for x, y in zip(a, b))
    assert diff <= 1e-6, f"2 ranks off the single process's trajectory by {diff:.2e}"
    assert a[-1]["train/loss"] < 0.3 * a[0]["train/loss"]


@pytest.mark.multiproc
def test_evaluate_reports_the_logged_accuracy(runs: dict[str, Path], tmp_path: Path) -> None:
    """`trainer.evaluate` on the final checkpoint prints the accuracy the run logged."""
    ckpt = runs["one"] / "checkpoints" / "step_00000300"
    cmd = [sys.executable, "-m", "trainer.evaluate", f"checkpoint={ckpt}", "logger=none"]
    proc = launch_all({"eval": cmd}, TIMEOUT)["eval"]
    assert proc.returncode == 0, explain(proc)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    logged = evals(runs["one"])[300]
    assert got["step"] == 300
    assert got["val/accuracy"] == logged["val/accuracy"]
    assert got["val/items"] == logged["val/items"]
    assert got["val/loss"] == pytest.approx(logged["val/loss"], rel=1e-12)
    assert "val/ppl" not in got  # a classifier has no perplexity
