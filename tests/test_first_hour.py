"""A user's first hour with their own model, as issue 21 found it: each mistake they made
stops the run with one paragraph (exit 2) saying what to fix, and a resumed run leaves one
record per step.

The project is docs/your-model.md's tagger (`tests.user_project`), plus `mistakes.py`: the
variants a user wrote by accident (a mean loss, a dataset of lists without `collate_fn`, ...).
Every command is the real trainer, launched as the user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, env, explain, launch, launch_all, read_metrics
from tests.user_project import select, write_project

TIMEOUT = 120.0
QUICK = [
    "data.n_train=64",
    "data.n_val=16",
    "train.micro_batch_size=8",
    "train.grad_accum_steps=2",
    "train.max_steps=3",
    "train.log_every=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "logger=none",
]

MISTAKES = '''
"""What a user wrote by accident (tests/test_first_hour.py)."""

import torch
from tagger import IGNORE, TaggingTask, tagging_data


class MeanTask(TaggingTask):
    def loss_sum(self, model, batch):  # the mean over the batch's tags, not their sum
        return super().loss_sum(model, batch) / self.count_items(batch).clamp(min=1)


class IntCountTask(TaggingTask):
    def count_items(self, batch):  # a Python int
        return int((batch["labels"] != IGNORE).sum())


def no_collate(**kw):  # sequences of different lengths, nothing pads them
    splits = tagging_data(**kw)
    del splits["collate_fn"]
    return splits


class Lists(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"features": [[0.1 * i] * 5] * 3, "labels": [i % 4] * 3}


def lists(**kw):  # Python lists, no collate_fn
    return {"train": Lists(kw["n_train"]), "val": Lists(kw["n_val"])}


def failing_collate(**kw):
    splits = tagging_data(**kw)

    def collate(samples):
        raise KeyError("my_field")

    splits["collate_fn"] = collate
    return splits
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_project(tmp_path_factory.mktemp("first_hour"))
    (root / "mistakes.py").write_text(MISTAKES)
    return root


def command(project: Path, run_dir: Path, *extra: str) -> list[str]:
    args = [*select(project), *QUICK, *extra, f"hydra.run.dir={run_dir}"]
    return [sys.executable, "-m", "trainer.train", *args]


@pytest.fixture(scope="module")
def runs(project: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each mistake launched once (two at a time), with the correct task as the control."""
    root = tmp_path_factory.mktemp("runs")
    cases = {
        "sum": [],
        "mean": ["task._target_=mistakes.MeanTask"],
        "mean_unchecked": ["task._target_=mistakes.MeanTask", "task.check_sum=false"],
        "int_count": ["task._target_=mistakes.IntCountTask"],
        "no_collate": ["data._target_=mistakes.no_collate"],
        "lists": ["data._target_=mistakes.lists"],
        "failing_collate": ["data._target_=mistakes.failing_collate"],
    }
    names = list(cases)
    results = {}
    for i in range(0, len(names), 2):
        cmds = {n: command(project, root / n, *cases[n]) for n in names[i : i + 2]}
        results |= launch_all(cmds, TIMEOUT, PYTHONPATH=str(project))
    return {"root": root, "results": results}


def paragraph(proc: subprocess.CompletedProcess) -> str:
    """The single error paragraph of a refused run (exit 2, no traceback)."""
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, explain(proc)
    return errors[0]


def test_sum_task_trains(runs: dict[str, Any]) -> None:
    proc = runs["results"]["sum"]
    assert proc.returncode == 0, explain(proc)
    assert [r["step"] for r in read_metrics(runs["root"] / "sum")] == [1, 2, 3]


def test_mean_loss_is_refused_with_what_to_return(runs: dict[str, Any]) -> None:
    text = paragraph(runs["results"]["mean"])
    assert "task `mistakes.MeanTask`" in text
    assert "not a sum" in text and "reduction='sum'" in text and "task.check_sum=false" in text
    assert not read_metrics(runs["root"] / "mean")  # stopped before the first step


def test_check_sum_false_skips_the_check(runs: dict[str, Any]) -> None:
    proc = runs["results"]["mean_unchecked"]
    assert proc.returncode == 0, explain(proc)


def test_count_items_may_return_an_int(runs: dict[str, Any]) -> None:
    proc = runs["results"]["int_count"]
    assert proc.returncode == 0, explain(proc)
    same = [r["train/loss"] for r in read_metrics(runs["root"] / "int_count")]
    assert same == [r["train/loss"] for r in read_metrics(runs["root"] / "sum")]


def test_sum_check_leaves_the_trajectory_alone(tmp_path: Path) -> None:
    """With dropout, the check (eval mode, RNG restored) changes nothing: bitwise the same."""
    from tests.conftest import TINY, train_in_process

    common = [*TINY, "train.max_steps=3", "model.dropout=0.1", "data.block_size=32"]
    checked = train_in_process(common, tmp_path / "checked")
    unchecked = train_in_process([*common, "task.check_sum=false"], tmp_path / "unchecked")
    assert [r["train/loss"] for r in checked] == [r["train/loss"] for r in unchecked]


def test_halves_of_common_batches() -> None:
    import torch

    from trainer.sum_check import halves

    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    a, b = halves((x, y))
    assert a[0].shape == (2, 2) and b[1].tolist() == [2, 3, 4]
    d = halves({"input_ids": x, "meta": "s"})
    assert d is not None and d[0]["meta"] == "s" and d[1]["input_ids"].shape[0] == 3
    assert halves((x[:1], y[:1])) is None  # one sample: nothing to split
    assert halves((x, y[:3])) is None  # no common batch dimension


def test_resume_after_kill_leaves_one_record_per_step(project: Path, tmp_path: Path) -> None:
    """kill -9 mid-run, rerun the same command: metrics.jsonl holds each step once, the
    records written after the resumed checkpoint are in metrics.superseded.jsonl."""
    run_dir = tmp_path / "run"
    cmd = command(
        project, run_dir, "train.max_steps=24", "checkpoint.every_steps=5", "data.n_train=256"
    )
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(PYTHONPATH=str(project)), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 7:
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = read_metrics(run_dir)
    assert before, "the run wrote no record before it was killed"
    ckpts = sorted(run_dir.glob("checkpoints/step_*"))
    resumed = int(ckpts[-1].name.split("_")[1]) if ckpts else 0
    later = [r["step"] for r in before if r["step"] > resumed]

    again = launch(cmd, TIMEOUT, PYTHONPATH=str(project))
    assert again.returncode == 0, explain(again)
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, 25))
    superseded = run_dir / "metrics.superseded.jsonl"
    moved = [json.loads(ln)["step"] for ln in superseded.read_text().splitlines()] if later else []
    assert moved == later


def test_wandb_is_not_sent_a_step_twice() -> None:
    from trainer.wandb_logger import WandbSink

    sent: list[int] = []

    class FakeRun:
        def log(self, data: dict[str, Any], step: int) -> None:
            sent.append(step)

    sink = WandbSink.__new__(WandbSink)
    sink.run, sink.sent_through = FakeRun(), 7
    for step in (6, 7, 8, 9):
        sink.write({"step": step, "train/loss": 1.0})
    assert sent == [8, 9]
