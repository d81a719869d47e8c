"""`python -m trainer.compare RUN_A RUN_B`: the split-invariance check as a tool.

Real runs: docs/your-model.md's tagger with `task=token_classification`, one process, the
same global batch of 8 split as micro 4 x accum 2 and micro 8 x accum 1 (exit 0), and a run
with another learning rate (exit 1). Written records pin down the rest: which metrics are
compared, nulls, and the one-paragraph refusals (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ranks import explain, launch_all, run_cli
from tests.test_user_model import trainer
from tests.user_project import write_project

RUNS = [
    "task=token_classification",
    "data.n_train=8",
    "data.n_val=4",
    "optim=sgd",
    "optim.lr=0.5",
    "scheduler=constant",
    "train.max_steps=8",
    "train.log_every=1",
    "eval.every_steps=4",
    "checkpoint.every_steps=0",
    "logger=none",
]


def compare(*args: str | Path) -> tuple[int, str, str]:
    proc = run_cli([str(a) for a in args], module="trainer.compare", timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def row(stdout: str, metric: str) -> list[str]:
    (line,) = [ln for ln in stdout.splitlines() if ln.split()[:1] == [metric]]
    return line.split()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    project = write_project(root / "project")
    splits = {
        "micro4_accum2": ["train.micro_batch_size=4", "train.grad_accum_steps=2"],
        "micro8_accum1": ["train.micro_batch_size=8", "train.grad_accum_steps=1"],
        "other_lr": ["train.micro_batch_size=4", "train.grad_accum_steps=2", "optim.lr=0.4"],
    }
    cmds = {name: trainer(project, root / name, *RUNS, *s) for name, s in splits.items()}
    results = launch_all(cmds, 150, PYTHONPATH=str(project))
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
    return {name: root / name for name in splits}


@pytest.mark.launches
def test_two_splits_of_one_global_batch_agree(runs: dict[str, Path]) -> None:
    """Exit 0, every trajectory metric compared over all 8 steps (2 evaluations), throughput
    and timing left out; a run directory or its metrics.jsonl both work."""
    code, out, err = compare(runs["micro4_accum2"], runs["micro8_accum1"] / "metrics.jsonl")
    assert code == 0, out + err
    for metric in ("train/loss", "train/grad_norm", "train/lr"):
        assert row(out, metric)[1] == "8", out
        assert float(row(out, metric)[2]) <= 1e-5, out
    assert row(out, "val/accuracy")[1] == "2" and row(out, "val/loss")[1] == "2", out
    for speed in ("train/tokens_per_s", "train/step_time_ms", "train/peak_mem_mb"):
        assert speed not in out
    assert out.splitlines()[-1].startswith("SAME")


@pytest.mark.launches
def test_another_learning_rate_differs(runs: dict[str, Path]) -> None:
    """Exit 1, naming the metrics outside tolerance; step 1's loss (before any update) is
    the same in both, so the largest loss difference is at a later step."""
    code, out, err = compare(runs["micro4_accum2"], runs["other_lr"])
    assert code == 1, out + err
    last = out.splitlines()[-1]
    assert last.startswith("DIFFERENT") and "train/loss" in last and "train/lr" in last, out
    steps, max_diff, at_step = row(out, "train/loss")[1:4]
    assert steps == "8" and float(max_diff) > 1e-3 and int(at_step) > 1, out
    # A tolerance that covers the difference accepts it; --keys narrows what is compared.
    code, out, _ = compare(runs["micro4_accum2"], runs["other_lr"], "--atol", "1", "--rtol", "0")
    assert code == 0, out
    code, out, _ = compare(
        runs["micro4_accum2"], runs["other_lr"], "--keys", "val/items", "train/epoch"
    )
    assert code == 0 and "train/loss" not in out, out


def write(path: Path, records: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.launches
def test_nulls_duplicates_and_one_sided_metrics(tmp_path: Path) -> None:
    """A null matches only a null; a step recorded twice keeps its last record; a metric in
    one run only is listed, not compared."""
    a = write(
        tmp_path / "a",
        [
            {"step": 1, "train/loss": 2.0, "train/grad_norm": None, "non_finite": ["x"]},
            {"step": 2, "train/loss": 9.0, "train/grad_norm": 1.0},
            {"step": 2, "train/loss": 1.5, "train/grad_norm": 1.0},  # after a resume
            {"step": 2, "val/loss": 1.7, "val/sample": "def f():"},
        ],
    )
    b = write(
        tmp_path / "b",
        [
            {"step": 1, "train/loss": 2.0, "train/grad_norm": None, "train/loss_scale": 8.0},
            {"step": 2, "train/loss": 1.5, "train/grad_norm": 1.0, "train/loss_scale": 8.0},
            {"step": 2, "val/loss": 1.7, "val/sample": "class A:"},
        ],
    )
    code, out, _ = compare(a, b)
    assert code == 0, out
    assert "only in the second run (not compared): train/loss_scale" in out
    assert "val/sample" not in out
    c = write(tmp_path / "c", [{"step": 1, "train/loss": 2.0, "train/grad_norm": 3.0}])
    code, out, _ = compare(a, c)
    assert code == 1 and row(out, "train/grad_norm")[2] == "inf", out


def pipeline_record(step: int, loss: float, seed: int) -> dict:
    """A training record as a `dist.pp=2` run writes it: trajectory metrics, and timing,
    throughput and memory metrics that differ with `seed` (another launch, another machine)."""
    noise = 1.0 + 0.37 * seed
    return {
        "step": step,
        "train/loss": loss,
        "train/grad_norm": 0.5,
        "train/lr": 1e-3,
        "train/epoch": 0,
        "train/skipped_steps": 0,
        "train/tokens_per_s": 9000.0 * noise,
        "train/step_time_ms": 12.0 * noise,
        "train/peak_mem_mb": 300.0 * noise,
        "train/mfu": 0.01 * noise,
        "train/pp_bubble": 0.2 * noise,
        "train/pp_bubble/stage0": 0.1 * noise,
        "train/pp_bubble/stage1": 0.3 * noise,
        "train/pp_peak_mem_mb/stage0": 150.0 * noise,
        "train/pp_peak_mem_mb/stage1": 140.0 * noise,
    }


@pytest.mark.launches
def test_machine_metrics_are_left_out_by_their_names(tmp_path: Path) -> None:
    """Two pipeline runs on one trajectory compare equal although every timing, throughput
    and memory metric differs (the pipeline's bubble and per-stage memory included), and
    none of those is listed; a real loss difference still fails."""
    a = write(tmp_path / "a", [pipeline_record(s, 3.0 - 0.1 * s, 0) for s in (1, 2, 3)])
    b = write(tmp_path / "b", [pipeline_record(s, 3.0 - 0.1 * s, 1) for s in (1, 2, 3)])
    code, out, err = compare(a, b)
    assert code == 0, out + err
    for machine in ("pp_bubble", "pp_peak_mem_mb", "tokens_per_s", "step_time_ms", "mfu"):
        assert machine not in out, out
    assert row(out, "train/loss")[1] == "3", out
    c = write(tmp_path / "c", [pipeline_record(s, 3.0 - 0.1 * s + (s == 3), 0) for s in (1, 2, 3)])
    code, out, err = compare(a, c)
    assert code == 1, out + err
    last = out.splitlines()[-1]
    assert last.startswith("DIFFERENT: 1 of 5 metrics") and last.endswith("train/loss (step 3)")


@pytest.mark.launches
def test_refusals_are_one_paragraph(tmp_path: Path) -> None:
    """No metrics.jsonl, no common step, a line that is not a record: exit 2 and one
    paragraph saying what to give."""
    a = write(tmp_path / "a", [{"step": 1, "train/loss": 2.0}])
    b = write(tmp_path / "b", [{"step": 5, "train/loss": 2.0}])
    (tmp_path / "empty").mkdir()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n{"st')
    cases = {
        tmp_path / "empty": "has no metrics.jsonl",
        tmp_path / "missing": "does not exist",
        b: "share no step of any metric (the first records steps 1-1, the second steps 5-5)",
        tmp_path / "torn": "line 2, is not a cumulus record",
    }
    for other, says in cases.items():
        code, out, err = compare(a, other)
        assert code == 2, out + err
        assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err
        assert "Traceback" not in err and not out
