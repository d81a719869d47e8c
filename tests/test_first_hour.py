"""A user's first hour with their own model, as issue 21 found it: each mistake they made
stops the run with one paragraph (exit 2) saying what to fix, and a resumed run leaves one
record per step.

The project is docs/your-model.md's tagger (`tests.user_project`), plus `mistakes.py`: the
variants a user wrote by accident (a mean loss, a dataset of lists without `collate_fn`, ...).
Every command is the real trainer, launched as the user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import ranks
from tests.conftest import read_metrics
from tests.ranks import explain, launch, launch_all, torchrun_cmd
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
from tagger import IGNORE, Tagger, TaggingTask, tagging_data


class MeanTask(TaggingTask):
    def loss_sum(self, model, batch):  # the mean over the batch's tags, not their sum
        return super().loss_sum(model, batch) / self.count_items(batch).clamp(min=1)


class IntCountTask(TaggingTask):
    def count_items(self, batch):  # a Python int
        return int((batch["labels"] != IGNORE).sum())


class Tensors(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        return {"features": s["features"], "labels": torch.tensor(s["labels"]).long()}


def no_collate(**kw):  # tensors of different lengths, nothing pads them
    splits = tagging_data(**kw)
    return {"train": Tensors(splits["train"]), "val": Tensors(splits["val"])}


class BrokenTagger(Tagger):
    def forward(self, features):
        raise ValueError("a bug in my model")


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
    """Each mistake launched once (four at a time), the correct task as the control."""
    root = tmp_path_factory.mktemp("runs")
    cases = {
        "sum": [],
        "mean": ["task._target_=mistakes.MeanTask"],
        "mean_unchecked": ["task._target_=mistakes.MeanTask", "task.check_sum=false"],
        "int_count": ["task._target_=mistakes.IntCountTask"],
        "no_collate": ["data._target_=mistakes.no_collate"],
        "lists": ["data._target_=mistakes.lists"],
        "failing_collate": ["data._target_=mistakes.failing_collate"],
        "broken_model": ["model._target_=mistakes.BrokenTagger"],
    }
    cmds = {n: command(project, root / n, *cases[n]) for n in cases}
    # Two ranks: the verdict is all-reduced, every rank stops, rank 0 alone speaks.
    cmds["mean_ddp"] = [*torchrun_cmd(2), *cmds["mean"][1:]]
    cmds["mean_ddp"][-1] = f"hydra.run.dir={root / 'mean_ddp'}"
    # The user's config folder forgotten: `data=tagging` is not among cumulus's configs.
    cmds["no_searchpath"] = [a for a in cmds["sum"] if not a.startswith("hydra.searchpath")]
    names = list(cmds)
    results = {}
    for i in range(0, len(names), 4):
        batch = {n: cmds[n] for n in names[i : i + 4]}
        results |= launch_all(batch, TIMEOUT, PYTHONPATH=str(project))
    return {"root": root, "results": results}


def paragraph(proc: subprocess.CompletedProcess) -> str:
    """The single error paragraph of a refused run (exit 2, no traceback)."""
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, explain(proc)
    return errors[0]


@pytest.mark.multiproc
def test_sum_task_trains(runs: dict[str, Any]) -> None:
    proc = runs["results"]["sum"]
    assert proc.returncode == 0, explain(proc)
    assert [r["step"] for r in read_metrics(runs["root"] / "sum")] == [1, 2, 3]


@pytest.mark.multiproc
def test_progress_line_in_the_tasks_unit(runs: dict[str, Any]) -> None:
    out = runs["results"]["sum"].stdout
    assert " tags/s | " in out and "tok/s" not in out, out  # TaggingTask.unit = "tags"


@pytest.mark.multiproc
def test_chosen_accumulation_has_no_note(runs: dict[str, Any], tmp_path: Path) -> None:
    """The NOTE that accumulation is the default (tests/test_small_things.py shows it) is not
    printed when the user chose it: train.grad_accum_steps=2 on the command line (the
    default's value), or train.global_batch_size."""
    note = "NOTE: accumulation is the default"
    assert "train.grad_accum_steps=2" in QUICK
    assert note not in runs["results"]["sum"].stdout
    # Chosen explicitly through the global batch: no note.
    import contextlib
    import io

    from tests.conftest import TINY, train_in_process

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_in_process(
            [*TINY, "train.max_steps=1", "train.global_batch_size=16"], tmp_path / "global"
        )
    assert "world 1 x micro 8 x accum 2" in out.getvalue() and note not in out.getvalue()


@pytest.mark.multiproc
def test_mean_loss_is_refused_with_what_to_return(runs: dict[str, Any]) -> None:
    text = paragraph(runs["results"]["mean"])
    assert "task `mistakes.MeanTask`" in text
    assert "not a sum" in text and "reduction='sum'" in text and "task.check_sum=false" in text
    assert not (runs["root"] / "mean").exists()  # refused before its first step: no run dir


@pytest.mark.multiproc
def test_forgotten_searchpath(runs: dict[str, Any]) -> None:
    text = paragraph(runs["results"]["no_searchpath"])
    assert "invalid config `model`: no config named 'tagger'" in text
    assert "hydra.searchpath=[file://DIR]" in text and "model=cnn|gpt_small|gpt_tiny" in text
    assert not (runs["root"] / "sum").with_name("no_searchpath").exists()


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (  # a scheduler class without _partial_
            [
                "scheduler._target_=torch.optim.lr_scheduler.StepLR",
                "~scheduler._partial_",
                "~scheduler.warmup_steps",
                "+scheduler.step_size=3",
            ],
            "scheduler._partial_",
            "+scheduler._partial_=true",
        ),
        (  # AdamW's keys left when swapping the optimizer class
            ["optim._target_=torch.optim.SGD"],
            "optim.betas",
            "`~optim.betas ~optim.eps`",
        ),
        (  # an interpolation to a missing key
            ["train.max_steps=${train.max_step}"],
            "train.max_steps",
            "Did you mean `${train.max_steps}`?",
        ),
        (["data=synth_tags"], "data", "hydra.searchpath=[file://DIR]"),
    ],
    ids=["partial", "leftover_keys", "interpolation", "searchpath"],
)
def test_hydra_mistakes_name_the_fix(overrides: list[str], key: str, fix: str) -> None:
    """Through trainer.api.compose, as from Python (the command line gives the same)."""
    from trainer.api import compose
    from trainer.config.cli import to_config
    from trainer.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        to_config(compose(["model=gpt_tiny", *overrides]))
    assert err.value.key == key and fix in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.multiproc
def test_mean_loss_on_two_ranks_stops_every_rank(runs: dict[str, Any]) -> None:
    proc = runs["results"]["mean_ddp"]
    assert proc.returncode != 0, explain(proc)
    said = [ln for ln in proc.stderr.splitlines() if "is not a sum over its loss items" in ln]
    assert len(said) == 1 and said[0].startswith("error: invalid config `task`"), explain(proc)
    # torchrun adds its own ChildFailedError report; no frame of the trainer's.
    assert "fit.py" not in proc.stderr and "sum_check.py" not in proc.stderr, explain(proc)


def test_api_train_returns_one_record_per_step(tmp_path: Path) -> None:
    """A rerun that resumes from an earlier checkpoint than the records reach: trainer.api
    returns each step once; the redone step's first record is in the superseded file."""
    import shutil

    from tests.conftest import TINY
    from trainer.api import train

    args = [*TINY, "train.max_steps=3", "checkpoint.every_steps=2"]
    assert [r["step"] for r in train(args, run_dir=tmp_path)] == [1, 2, 3]
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000003")  # as if killed before it
    again = train(args, run_dir=tmp_path)
    assert [r["step"] for r in again] == [1, 2, 3]
    moved = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved] == [3]


@pytest.mark.multiproc
def test_check_sum_false_skips_the_check(runs: dict[str, Any]) -> None:
    proc = runs["results"]["mean_unchecked"]
    assert proc.returncode == 0, explain(proc)


@pytest.mark.multiproc
def test_count_items_may_return_an_int(runs: dict[str, Any]) -> None:
    proc = runs["results"]["int_count"]
    assert proc.returncode == 0, explain(proc)
    same = [r["train/loss"] for r in read_metrics(runs["root"] / "int_count")]
    assert same == [r["train/loss"] for r in read_metrics(runs["root"] / "sum")]


@pytest.mark.multiproc
def test_variable_length_without_collate_fn(runs: dict[str, Any]) -> None:
    text = paragraph(runs["results"]["no_collate"])
    assert "invalid config `data`" in text and "mistakes.no_collate" in text
    assert "different shapes" in text and "pad_collate" in text


@pytest.mark.multiproc
def test_dataset_of_python_lists(runs: dict[str, Any]) -> None:
    text = paragraph(runs["results"]["lists"])
    assert "mistakes.lists" in text and "field `features` is a Python list" in text
    assert "torch.tensor" in text and "pad_collate" in text


@pytest.mark.multiproc
def test_failing_collate_keeps_its_traceback_under_one_line(runs: dict[str, Any]) -> None:
    proc = runs["results"]["failing_collate"]
    assert proc.returncode == 1, explain(proc)
    lines = proc.stderr.splitlines()
    head = lines.index("Traceback (most recent call last):") - 1
    assert lines[head].startswith("error in data.collate_fn while loading the batches of step 1")
    assert "mistakes.py:" in lines[head] and "in collate" in lines[head]
    assert "KeyError: 'my_field'" in lines[-3:]


@pytest.mark.multiproc
def test_failing_model_names_the_component_and_step(runs: dict[str, Any]) -> None:
    proc = runs["results"]["broken_model"]
    assert proc.returncode == 1, explain(proc)
    lines = proc.stderr.splitlines()
    head = lines[lines.index("Traceback (most recent call last):") - 1]
    assert head.startswith("error in `model` (mistakes.BrokenTagger) during step 1"), head
    assert "in forward" in head and "ValueError: a bug in my model" in lines[-3:]


def test_sum_check_leaves_the_trajectory_alone(tmp_path: Path) -> None:
    """With dropout, the check (eval mode, RNG restored) changes nothing: bitwise the same."""
    from tests.conftest import TINY, train_in_process

    common = [*TINY, "train.max_steps=3", "model.dropout=0.1", "data.block_size=32"]
    checked = train_in_process(common, tmp_path / "checked")
    unchecked = train_in_process([*common, "task.check_sum=false"], tmp_path / "unchecked")
    assert [r["train/loss"] for r in checked] == [r["train/loss"] for r in unchecked]


def test_halves_of_common_batches() -> None:
    import torch

    from trainer.run.sum_check import halves

    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    a, b = halves((x, y))
    assert a[0].shape == (2, 2) and b[1].tolist() == [2, 3, 4]
    d = halves({"input_ids": x, "meta": "s"})
    assert d is not None and d[0]["meta"] == "s" and d[1]["input_ids"].shape[0] == 3
    assert halves((x[:1], y[:1])) is None  # one sample: nothing to split
    assert halves((x, y[:3])) is None  # no common batch dimension


@pytest.mark.launches
def test_resume_after_kill_leaves_one_record_per_step(project: Path, tmp_path: Path) -> None:
    """kill -9 mid-run, rerun the same command: metrics.jsonl holds each step once, the
    records written after the resumed checkpoint are in metrics.superseded.jsonl."""
    run_dir = tmp_path / "run"
    cmd = command(
        project, run_dir, "train.max_steps=24", "checkpoint.every_steps=5", "data.n_train=256"
    )
    run = ranks.start(cmd, TIMEOUT, PYTHONPATH=str(project))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline and run.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 7:
                break
            time.sleep(0.02)
    finally:
        run.collect()  # SIGKILLs its whole tree
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
    from trainer.tracking.wandb_logger import WandbSink

    sent: list[int] = []

    class FakeRun:
        def log(self, data: dict[str, Any], step: int) -> None:
            sent.append(step)

    sink = WandbSink.__new__(WandbSink)
    sink.run, sink.sent_through = FakeRun(), 7
    for step in (6, 7, 8, 9):
        sink.write({"step": step, "train/loss": 1.0})
    assert sent == [8, 9]
