"""Continuing runs the way a user does on their second day (issue 40): a checkpoint continued
in a new run directory with the default logger, and a finished run rerun.

Both run the real trainer in this process and compare with an uninterrupted reference run
(records are equal bit for bit on CPU: the resumed run restores every random stream).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, one_thread, read_metrics, train_in_process, train_records
from tests.ranks import explain, run_cli
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


@pytest.mark.launches
def test_a_run_and_an_evaluation_never_sit_in_silence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run says when its first step is done (when records are sparser), that the final
    evaluation and sample are running, and where its data came from; a second run on the
    same JSONL corpus says its token cache was reused. `trainer.evaluate` over a whole
    split prints progress lines (batches, items/s, ETA) on stderr, its JSON last on stdout."""
    import json
    import sysconfig

    docs = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in docs))
    args = [*TINY, "data=hf", f"data.path={corpus}", "train.max_steps=4", "train.log_every=2"]
    args += ["eval.every_steps=4", "eval.max_batches=2", "checkpoint.every_steps=4"]
    with one_thread():
        train_in_process(args, tmp_path / "first")
        first = capsys.readouterr().out
        train_in_process(args, tmp_path / "second")
        second = capsys.readouterr().out
    assert "step 1 done in" in first and "the first record comes at step 2" in first
    assert "final evaluation at step 4: 2 validation batches and a text sample" in first
    assert "  data " in first and "tokenized into" in first and "reused" not in first
    assert "token cache reused" in second
    proc = run_cli(
        [f"checkpoint={tmp_path / 'first'}", f"data.path={corpus}", "eval.max_batches=20"],
        module="trainer.evaluate",
    )
    assert proc.returncode == 0, explain(proc)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("evaluating")]
    assert len(lines) >= 2 and "items (" in lines[-1] and "ETA" in lines[-1], proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["step"] == 4


def test_optimizer_without_state_resumes_exactly(tmp_path: Path) -> None:
    """SGD without momentum keeps no tensor per parameter: a run stopped at step 2 resumes
    and equals the uninterrupted run bit for bit (torch's full-state loader needed a tensor
    to learn the device from, and raised)."""
    args = [*TINY, "optim=sgd", "optim.momentum=0", "checkpoint.every_steps=2"]
    args += ["scheduler=constant", "train.max_steps=4"]
    with one_thread():
        want = train_records(train_in_process(args, tmp_path / "reference"))
        train_in_process([*args, "train.max_steps=2"], tmp_path / "run")
        got = train_records(train_in_process(args, tmp_path / "run"))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        assert (g["train/loss"], g["train/grad_norm"]) == (w["train/loss"], w["train/grad_norm"])
