"""Continuing runs the way a user does on their second day (issue 40): a checkpoint continued
in a new run directory with the default logger, and a finished run rerun.

Both run the real trainer in this process and compare with an uninterrupted reference run
(records are equal bit for bit on CPU: the resumed run restores every random stream).
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TINY, one_thread, read_metrics, train_in_process, train_records
from tests.wandb_reader import run_id

# TINY with the default logger (W&B: offline by itself without credentials).
BASE = [a for a in TINY if not a.startswith("logger=")]
ARGS = [*BASE, "train.max_steps=6", "checkpoint.every_steps=3", "eval.every_steps=0"]
ARGS += ["scheduler=constant"]  # the first run stops at 3 steps: a schedule of no horizon


def wandb_ids(run_dir: Path) -> list[str]:
    """The W&B run ids of a run directory's offline runs, read from their `.wandb` files."""
    return [run_id(f) for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))]


def test_checkpoint_continues_in_a_new_run_directory_with_wandb(tmp_path: Path) -> None:
    """`checkpoint.resume=OTHER_RUN/checkpoints/step_N hydra.run.dir=NEW` with the default
    logger: the branch gets its own (non-empty) W&B run id, trains the remaining steps, and
    its records equal an uninterrupted run's (it crashed with "Run ID cannot be empty")."""
    with one_thread():
        reference = train_records(train_in_process(ARGS, tmp_path / "reference"))
        first = tmp_path / "first"
        train_in_process([*ARGS, "train.max_steps=3"], first)
        ckpt = first / "checkpoints" / "step_00000003"
        branch = tmp_path / "branch"
        records = train_records(train_in_process([*ARGS, f"checkpoint.resume={ckpt}"], branch))
    assert [r["step"] for r in records] == [4, 5, 6]
    for got, want in zip(records, reference[3:], strict=True):
        assert got["train/loss"] == want["train/loss"], (got, want)
        assert got["train/grad_norm"] == want["train/grad_norm"], (got, want)
    (branch_id,) = wandb_ids(branch)
    (first_id,) = wandb_ids(first)
    assert branch_id and branch_id != first_id


def test_finished_run_rerun_writes_no_second_record(tmp_path: Path) -> None:
    """Rerunning a finished run (same command, same run directory) has nothing to train: it
    writes no record, so `metrics.jsonl` keeps one record per step and kind (the final
    evaluation used to be appended again)."""
    args = [*TINY, "train.max_steps=4", "checkpoint.every_steps=2", "eval.every_steps=2"]
    args += ["eval.max_batches=2", "eval.sample_tokens=0"]
    run_dir = tmp_path / "run"
    with one_thread():
        train_in_process(args, run_dir)
        before = read_metrics(run_dir)
        train_in_process(args, run_dir)
    after = read_metrics(run_dir)
    assert after == before
    val_steps = [r["step"] for r in after if "val/loss" in r]
    assert val_steps == [2, 4]
