"""What a new user found (issue 45, section 5), each as the command that showed it: a
console that promised a text sample none was written for, `checkpoint.resume=RUN_DIR`
refused, a memory report written without a word, a warmup longer than the run without a
word. (The other items have their tests beside the code they concern: the tensor-parallel
plan in test_tensor_parallel.py, certify's crash reason in test_certify.py, the cp refusal met
at the first step in test_context_parallel.py, the MLflow store in test_trackers.py.)"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY, one_thread, read_metrics, train_in_process, train_records

FIRST = [a for a in TINY if not a.startswith("train.max_steps")]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """2 steps of gpt_tiny with the memory report on and the default warmup (50 steps):
    checkpoints at 1 and 2. Its console output."""
    run_dir = tmp_path_factory.mktemp("new_user") / "first"
    args = [a for a in FIRST if not a.startswith("scheduler.")]
    args += ["train.max_steps=2", "checkpoint.every_steps=1", "train.memory_report=true"]
    out = io.StringIO()
    with one_thread(), contextlib.redirect_stdout(out):
        train_in_process(args, run_dir)
    return run_dir, out.getvalue()


def test_memory_report_is_announced(first: tuple[Path, str]) -> None:
    """`train.memory_report=true`: the console says the report was written, and where, with
    its peak; the summary (and summary.txt) lists it among what the run left."""
    run_dir, out = first
    report = run_dir / "memory_report.json"
    assert report.is_file()
    said = re.search(r"memory report of steps 1-\d+: peak [\d.]+ MiB on rank 0 \((.*)\)", out)
    assert said and f"written to {report}" in out, out
    assert f"  memory report {report}" in out
    assert f"  memory report {report}" in (run_dir / "summary.txt").read_text()


def test_memory_report_of_a_one_step_run(tmp_path: Path) -> None:
    """`train.max_steps=1` with `train.memory_report=true` (a report measures 2 steps): the
    report is written after the one step there is, and the console says it measured one. Its
    parameter bytes are the model's own, counted apart from the tracker."""
    out = io.StringIO()
    with one_thread(), contextlib.redirect_stdout(out):
        train_in_process([*FIRST, "train.max_steps=1", "train.memory_report=true"], tmp_path)
    report = json.loads((tmp_path / "memory_report.json").read_text())
    assert report["steps"] == 1
    (rank,) = report["ranks"]
    assert rank["parameters_bytes"] > 0 and rank["peak_bytes"] >= rank["parameters_bytes"]
    text = out.getvalue()
    assert "memory report of step 1 (the run has 1 step to measure of the 2" in text, text
    assert f"  memory report {tmp_path / 'memory_report.json'}" in text


def test_a_warmup_longer_than_half_the_run_gets_a_note(
    first: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default warmup (50 steps) in a 2-step run: a NOTE saying how far the learning rate
    gets (2/51 of optim.lr) and what to set; a warmup of 1 step in the same run: none."""
    _, out = first
    notes = [line for line in out.splitlines() if line.startswith("NOTE: scheduler.warmup_steps")]
    assert len(notes) == 1, out
    assert "scheduler.warmup_steps=50 covers more than half of this run's 2 steps" in notes[0]
    assert "climbs to 0.000118 (4% of optim.lr=0.003)" in notes[0], notes[0]
    with one_thread():
        args = [a for a in FIRST if not a.startswith("scheduler.")]
        train_in_process([*args, "train.max_steps=2", "scheduler.warmup_steps=1"], tmp_path / "w")
    assert "NOTE: scheduler.warmup_steps" not in capsys.readouterr().out


def test_resume_from_a_run_directory(
    first: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`checkpoint.resume=RUN_DIR` (as trainer.evaluate and the export accept it): the newest
    valid checkpoint of that run, a damaged newest one skipped with a warning; a directory
    with none is one paragraph."""
    run_dir, _ = first
    other = tmp_path / "other"
    shutil.copytree(run_dir / "checkpoints", other / "checkpoints")
    state = other / "checkpoints" / "step_00000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])  # damaged: step 1 is the newest valid
    args = [*FIRST, "scheduler.warmup_steps=50", "train.max_steps=3"]
    with one_thread():
        newest = train_in_process([*args, f"checkpoint.resume={run_dir}"], tmp_path / "a")
        said = capsys.readouterr()
        older = train_in_process([*args, f"checkpoint.resume={other}"], tmp_path / "b")
        said_older = capsys.readouterr()
    assert [r["step"] for r in train_records(newest)] == [3]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in said.out
    assert [r["step"] for r in train_records(older)] == [2, 3]
    assert "at step 1" in said_older.out and "skipping checkpoint" in said_older.err
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    from trainer.config.errors import UserError

    with (
        one_thread(),
        pytest.raises(UserError, match=r"checkpoint.resume: .* neither a checkpoint"),
    ):
        train_in_process([*args, f"checkpoint.resume={empty}"], tmp_path / "c")
    assert read_metrics(tmp_path / "c") == []


def test_no_text_sample_is_promised_where_none_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model that cannot generate (experiment=digits' CNN; the same rule covers a model split
    by dist.cp, dist.pp or dist.tp):
    the final evaluation's line promises no text sample, and none is recorded; gpt_tiny's
    line promises one and it is there."""
    pytest.importorskip("sklearn")
    common = ["logger=none", "train.max_steps=1", "eval.every_steps=1", "eval.max_batches=1"]
    with one_thread():
        digits = train_in_process(["experiment=digits", *common], tmp_path / "digits")
        said_digits = capsys.readouterr().out
        gpt = train_in_process([*FIRST, *common], tmp_path / "gpt")
        said_gpt = capsys.readouterr().out
    assert "final evaluation at step 1: 1 validation batch\n" in said_digits, said_digits
    assert not any("val/sample" in r for r in digits)
    assert "final evaluation at step 1: 1 validation batch and a text sample" in said_gpt
    assert any("val/sample" in r for r in gpt)
