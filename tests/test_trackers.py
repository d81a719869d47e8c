"""TensorBoard and MLflow beside metrics.jsonl: the same steps and values, read back with each
tracker's own reader (tensorboard's `EventAccumulator`, MLflow's `MlflowClient`), also after
kill -9 and a resume; a tracker that breaks mid-run costs its own records, never the run; a
missing package is one line naming the extra.

The reference is metrics.jsonl, the record of truth, read here as plain JSON. A resumed run
does not send a tracker the steps the killed launch already sent (they moved to
metrics.superseded.jsonl): those steps keep the killed launch's values there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO, TINY, read_metrics, train_records
from tests.ranks import env, explain, launch
from tests.test_checkpoint import kill_at, killed, superseded

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
pytest.importorskip("mlflow", reason="the mlflow extra is not installed")

BANNER = re.compile(r"resumed from (\S+) at step (\d+)")
RUN_ID = re.compile(r"run id ([0-9a-z]+)")
ARGS = [
    *[a for a in TINY if not a.startswith("logger=")],
    "logger=[tensorboard,mlflow]",
    "train.max_steps=10",
    "checkpoint.every_steps=5",
    "eval.every_steps=5",
    "eval.max_batches=2",
    "eval.sample_tokens=16",
]


def trainer(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainer.train", *args]


class Resumed:
    """A run killed after step 8 (checkpoint 5), then rerun to its end."""

    def __init__(self, root: Path) -> None:
        self.run_dir = root / "run"
        args = [*ARGS, f"hydra.run.dir={self.run_dir}", *kill_at(8, root / "killed")]
        self.first = launch(trainer(args))
        self.records_before = read_metrics(self.run_dir)
        self.rerun = launch(trainer(args))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Resumed:
    return Resumed(tmp_path_factory.mktemp("trackers"))


def expected(run: Resumed) -> dict[int, dict[str, Any]]:
    """What each tracker must hold per step: the killed launch's records for the steps it
    sent (moved to metrics.superseded.jsonl), metrics.jsonl's for the others."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_metrics(run.run_dir):
        by_step.setdefault(record["step"], {}).update(record)
    for record in superseded(run.run_dir):
        by_step[record["step"]] = {**by_step[record["step"]], **record}
    return by_step


def numeric(record: dict[str, Any]) -> dict[str, float | None]:
    return {
        k: v
        for k, v in record.items()
        if k not in ("step", "non_finite") and (v is None or isinstance(v, int | float))
    }


@pytest.mark.launches
def test_resumed_run_keeps_one_record_per_step(resumed: Resumed) -> None:
    """The setting the tracker checks rely on: killed after step 8, resumed from step 5,
    steps 6-7 redone (the killed launch's records superseded), one record per step."""
    assert killed(resumed.first), explain(resumed.first)
    assert [r["step"] for r in train_records(resumed.records_before)] == list(range(1, 8))
    assert resumed.rerun.returncode == 0, explain(resumed.rerun)
    assert [int(m.group(2)) for m in BANNER.finditer(resumed.rerun.stdout)] == [5]
    assert [r["step"] for r in train_records(read_metrics(resumed.run_dir))] == list(range(1, 11))
    assert [r["step"] for r in train_records(superseded(resumed.run_dir))] == [6, 7]
    assert "Traceback" not in resumed.rerun.stderr, explain(resumed.rerun)


@pytest.mark.launches
def test_tensorboard_holds_metrics_jsonl(resumed: Resumed) -> None:
    """EventAccumulator over the run's event directory (two files: two launches) gives, for
    every metric, exactly the steps of the records and their values as float32 (TensorBoard's
    scalar type), one per step; the text samples as text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    assert resumed.rerun.returncode == 0, explain(resumed.rerun)
    logdir = resumed.run_dir / "tensorboard"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    want = expected(resumed)
    keys = {k for record in want.values() for k in numeric(record)}
    assert {"train/loss", "train/grad_norm", "train/lr", "val/loss"} <= keys
    assert set(acc.Tags()["tensors"]) == keys | {"val/sample"}
    for key in keys:
        events = acc.Tensors(key)
        steps = [e.step for e in events]
        assert steps == sorted(s for s, r in want.items() if key in r), key
        for event in events:
            got = tensor_util.make_ndarray(event.tensor_proto)
            value = want[event.step][key]
            ref = np.float32(np.nan if value is None else value)
            assert got.dtype == np.float32 and got.shape == ()
            assert got.tobytes() == ref.tobytes(), (key, event.step, got, value)
    samples = {e.step: e for e in acc.Tensors("val/sample")}
    assert sorted(samples) == [5, 10]
    for step, event in samples.items():
        text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
        assert text == want[step]["val/sample"]


def mlflow_client(run_dir: Path) -> Any:
    """A client of the run directory's default store: SQLite (`mlflow.db`), opened as
    `mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db` opens it, no opt-in."""
    from mlflow.tracking import MlflowClient

    assert (run_dir / "mlflow.db").is_file() and not (run_dir / "mlruns").exists()
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


@pytest.mark.launches
def test_mlflow_holds_metrics_jsonl(resumed: Resumed) -> None:
    """One MLflow run, continued by the resume (tagged with the trainer's run id): every
    metric's history is exactly the records' steps and values (float64, bit for bit), the
    parameters are the resolved config, and the run's files are its artifacts."""
    assert resumed.rerun.returncode == 0, explain(resumed.rerun)
    client = mlflow_client(resumed.run_dir)
    experiment = client.get_experiment_by_name("cumulus")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    trainer_id = RUN_ID.search(resumed.first.stdout)
    assert trainer_id and trainer_id.group(1) in resumed.rerun.stdout
    assert run.data.tags["cumulus.run_id"] == trainer_id.group(1)
    assert run.info.status == "FINISHED"

    want = expected(resumed)
    keys = {k for record in want.values() for k in numeric(record)}
    assert set(run.data.metrics) == keys
    for key in keys:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == sorted(s for s, r in want.items() if key in r), key
        for metric in history:
            value = want[metric.step][key]
            if value is None:
                assert np.isnan(metric.value), (key, metric.step)
            else:
                assert metric.value == value, (key, metric.step, metric.value, value)

    config = (resumed.run_dir / ".hydra" / "config.yaml").read_text()
    import yaml

    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict) and node:
            return {
                k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()
            }
        return {prefix[:-1]: node}

    params = flat(yaml.safe_load(config))
    assert set(run.data.params) == set(params)
    for key, value in params.items():
        assert run.data.params[key] == (value if isinstance(value, str) else json.dumps(value))

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert (resumed.run_dir / "mlartifacts").is_dir()  # beside its store, not in the cwd
    assert {"metrics.jsonl", "metrics.superseded.jsonl", "report.html", "summary.txt"} <= artifacts
    local = Path(
        client.download_artifacts(run.info.run_id, "metrics.jsonl", str(resumed.run_dir / "dl"))
    )
    assert local.read_text() == (resumed.run_dir / "metrics.jsonl").read_text()
    sample = client.download_artifacts(
        run.info.run_id, "samples/val/sample/step_00000010.txt", str(resumed.run_dir / "dl")
    )
    assert Path(sample).read_text() == want[10]["val/sample"]


@pytest.mark.launches
def test_tracker_failing_mid_run_warns_once(tmp_path: Path) -> None:
    """MLflow's store breaks after step 3: one warning naming it, training goes on to the
    end, TensorBoard and metrics.jsonl keep every step, the summary says where MLflow
    stopped."""
    run_dir = tmp_path / "run"
    args = [
        *[a for a in ARGS if not a.startswith(("train.max_steps", "eval.", "checkpoint."))],
        "train.max_steps=5",
        f"hydra.run.dir={run_dir}",
        # MLflow's file store (a directory per run), the one whose metrics a test can break.
        f"logger.mlflow.tracking_uri={(run_dir / 'mlruns').as_uri()}",
        "+callbacks.brk._target_=tests.tracker_support.BreakMlflowStore",
        "+callbacks.brk.step=3",
        f"+callbacks.brk.store={run_dir / 'mlruns'}",
    ]
    proc = launch(trainer(args))
    assert proc.returncode == 0, explain(proc)
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, explain(proc)
    assert "logger mlflow failed at step 3" in warnings[0], warnings
    assert "metrics.jsonl has every step" in warnings[0]
    assert "mlflow: stopped recording at step 3" in proc.stdout, explain(proc)
    assert [r["step"] for r in train_records(read_metrics(run_dir))] == [1, 2, 3, 4, 5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Tensors("train/loss")] == [1, 2, 3, 4, 5]


def run_without(package: str, args: list[str]) -> subprocess.CompletedProcess:
    """`python -m trainer.train args` in an interpreter where `package` cannot be imported,
    reporting which heavy tracker packages got imported."""
    code = (
        "import atexit, runpy, sys\n"
        f"sys.modules[{package!r}] = None\n"
        "atexit.register(lambda: print('imported:', sorted(m for m in ('tensorboard', "
        "'mlflow', 'wandb') if sys.modules.get(m) is not None)))\n"
        f"sys.argv = ['trainer.train', *{args!r}]\n"
        "runpy.run_module('trainer.train', run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
        cwd=REPO,
    )


@pytest.mark.parametrize("package", ["tensorboard", "mlflow"])
def test_missing_extra_is_one_line(tmp_path: Path, package: str) -> None:
    """Selecting a tracker whose package is missing: exit 2 before any work, one line naming
    the extra to install, no traceback, no run directory left."""
    run_dir = tmp_path / "run"
    proc = run_without(package, [*TINY, f"logger=[{package}]", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, explain(proc)
    assert errors[0].startswith("error: invalid config `logger`:"), errors
    assert f"pip install -e '.[{package}]'" in errors[0], errors
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_refused_config_imports_no_tracker(tmp_path: Path) -> None:
    """A config refused with trackers selected loads none of their packages (start-up and
    `--help` stay fast)."""
    proc = run_without(
        "nothing_at_all",
        [
            *TINY,
            "logger=[wandb,tensorboard,mlflow]",
            "train.max_steps=0",
            f"hydra.run.dir={tmp_path}",
        ],
    )
    assert proc.returncode == 2, explain(proc)
    assert "train.max_steps" in proc.stderr
    assert "imported: []" in proc.stdout, explain(proc)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("logger=[tensorboard,comet]", "no config named 'comet'"),
        ("+logger.trackers.comet=true", "unknown tracker 'comet'"),
        ("logger.trackers.tensorboard=true", "trackers are chosen by selecting their configs"),
    ],
)
def test_unknown_tracker_is_one_paragraph(tmp_path: Path, override: str, says: str) -> None:
    proc = run_without("nothing_at_all", [*TINY, override, f"hydra.run.dir={tmp_path / 'r'}"])
    assert proc.returncode == 2, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and says in errors[0], explain(proc)
    assert "wandb" in errors[0] and "tensorboard" in errors[0] and "mlflow" in errors[0]
