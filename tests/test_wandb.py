"""W&B logging with no credentials and no network: offline by itself, the same values as
metrics.jsonl, and the same run continued after a resume.

The logged values are read back from the offline `.wandb` file with `tests/wandb_reader.py`
(a parser written from the file format, not W&B's own code), and compared with ==.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY, one_thread, read_metrics, train_in_process, train_records
from tests.ranks import env, explain, run_cli
from tests.wandb_reader import history, run_id

# TINY without its `logger=none`: these runs use the default logger (wandb).
BASE = [a for a in TINY if not a.startswith("logger=")]
RUN_ARGS = [
    *BASE,
    "train.max_steps=6",
    "checkpoint.every_steps=3",
    "eval.every_steps=3",
    "eval.max_batches=2",
    "eval.sample_tokens=16",
]
TIMEOUT = 120.0
RUN_ID = re.compile(r"run id ([0-9a-z]+)")


@dataclass
class WandbRun:
    proc: subprocess.CompletedProcess
    run_dir: Path
    offline_dirs: list[Path]  # wandb/offline-run-* right after this command, oldest first


def offline_dirs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime_ns)


def wandb_file(offline_dir: Path) -> Path:
    files = list(offline_dir.glob("run-*.wandb"))
    assert len(files) == 1, sorted(offline_dir.iterdir())
    return files[0]


def no_credentials_env(home: Path) -> dict[str, str]:
    """No API key, no ~/.netrc (HOME is empty), no mode forced: the trainer must decide."""
    e = env(HOME=str(home))
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR", "NETRC"):
        e.pop(key, None)
    return e


def train_cli(args: list[str], home: Path) -> subprocess.CompletedProcess:
    """`python -m trainer.train args` with no W&B credentials; past TIMEOUT the test fails."""
    return run_cli(args, timeout=TIMEOUT, environ=no_credentials_env(home))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory, home: Path) -> WandbRun:
    """6 steps with the default logger, evaluations and checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("wandb_run")
    proc = train_cli([*RUN_ARGS, f"hydra.run.dir={run_dir}"], home)
    return WandbRun(proc, run_dir, offline_dirs(run_dir))


@pytest.fixture(scope="module")
def resumed(first: WandbRun, home: Path) -> WandbRun:
    """The same command with train.max_steps=9: resumes from step 6's checkpoint."""
    assert first.proc.returncode == 0, explain(first.proc)
    args = [*RUN_ARGS, f"hydra.run.dir={first.run_dir}", "train.max_steps=9"]
    proc = train_cli(args, home)
    return WandbRun(proc, first.run_dir, offline_dirs(first.run_dir))


def rows_by_step(path: Path) -> dict[int, dict[str, Any]]:
    rows = history(path)
    steps = [row["_step"] for row in rows]
    assert len(steps) == len(set(steps)), f"one history row per step expected, got {steps}"
    return {row["_step"]: row for row in rows}


def assert_same_values(records: list[dict[str, Any]], rows: dict[int, dict[str, Any]]) -> None:
    """Every value of every record is in the W&B row of its step, bit for bit."""
    for record in records:
        row = rows[record["step"]]
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, str):  # text sample: logged as an HTML file
                assert row[f"{key}/_type"] == "html-file", (key, row)
                continue
            assert row[key] == value, (record["step"], key, row[key], value)


@pytest.mark.launches
def test_offline_without_credentials(first: WandbRun) -> None:
    """No key, no netrc, no network: exit 0 within the timeout (no waiting on a network that is
    not there), say so once on stderr, and write the offline files."""
    assert first.proc.returncode == 0, explain(first.proc)
    assert "Traceback" not in first.proc.stderr, explain(first.proc)
    notices = [line for line in first.proc.stderr.splitlines() if "offline" in line.lower()]
    assert len(notices) == 1, explain(first.proc)
    assert "wandb" in notices[0] and str(first.run_dir / "wandb") in notices[0], notices

    assert len(first.offline_dirs) == 1, first.offline_dirs
    trainer_id = RUN_ID.search(first.proc.stdout)
    assert trainer_id, explain(first.proc)
    path = wandb_file(first.offline_dirs[0])
    assert path.name == f"run-{trainer_id.group(1)}.wandb"
    assert first.offline_dirs[0].name.endswith(f"-{trainer_id.group(1)}")
    assert run_id(path) == trainer_id.group(1)
    # The end-of-run summary says how to upload it.
    assert f"wandb sync {first.offline_dirs[0]}" in first.proc.stdout, explain(first.proc)


@pytest.mark.launches
def test_history_equals_metrics_jsonl(first: WandbRun) -> None:
    """W&B holds exactly the values of metrics.jsonl (full precision), keyed by step."""
    assert first.proc.returncode == 0, explain(first.proc)
    path = wandb_file(first.offline_dirs[0])
    rows = rows_by_step(path)
    records = read_metrics(first.run_dir)
    assert [r["step"] for r in train_records(records)] == [1, 2, 3, 4, 5, 6]
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for key in ("train/loss", "train/lr", "train/grad_norm", "val/loss", "val/items"):
        assert any(key in r for r in records), key
    assert_same_values(records, rows)

    # The sample text is kept (escaped) in the HTML media file the row points to.
    samples = [r for r in records if isinstance(r.get("val/sample"), str)]
    assert samples
    for record in samples:
        media = path.parent / "files" / rows[record["step"]]["val/sample/path"]
        assert html.escape(record["val/sample"]) in media.read_text(encoding="utf-8")


@pytest.mark.launches
def test_resume_continues_the_same_run(first: WandbRun, resumed: WandbRun) -> None:
    """Offline resume makes a new directory, but with the same id, and steps 7..9 follow."""
    assert resumed.proc.returncode == 0, explain(resumed.proc)
    new = [d for d in resumed.offline_dirs if d not in first.offline_dirs]
    assert len(new) == 1, resumed.offline_dirs
    old_id = run_id(wandb_file(first.offline_dirs[0]))
    assert new[0].name.endswith(f"-{old_id}"), (new[0].name, old_id)
    path = wandb_file(new[0])
    assert path.name == f"run-{old_id}.wandb"
    assert run_id(path) == old_id

    rows = rows_by_step(path)
    assert sorted(rows) == [7, 8, 9]
    appended = [r for r in read_metrics(resumed.run_dir) if r["step"] > 6]
    assert [r["step"] for r in train_records(appended)] == [7, 8, 9]
    assert_same_values(appended, rows)


def test_logger_none_writes_no_wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`logger=none` must not start W&B at all: no wandb/ directory anywhere in the run."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    with one_thread():
        records = train_in_process([*TINY, "train.max_steps=2"], run_dir)  # TINY has logger=none
    assert [r["step"] for r in train_records(records)] == [1, 2]
    assert not [p for p in tmp_path.rglob("wandb*")], sorted(tmp_path.rglob("*"))


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process without W&B credentials (an empty HOME: no ~/.netrc), quiet."""
    for key, value in no_credentials_env(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR", "NETRC"):
        monkeypatch.delenv(key, raising=False)


def sink_run(run_dir: Path, run_id: str, steps: int = 5) -> Path:
    """A `WandbSink` (offline, by itself) logging `steps` records, closed; its `.wandb` file."""
    from trainer.config.schema import LoggerCfg
    from trainer.tracking.wandb_logger import WandbSink

    sink = WandbSink(LoggerCfg(), run_dir, run_id, {"micro_batch_size_auto": 8})
    for step in range(1, steps + 1):
        sink.write({"step": step, "train/loss": 1.0 / step})
    sink.close()
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return path


@pytest.mark.usefixtures("no_credentials")
def test_closed_sink_has_written_the_whole_run(tmp_path: Path) -> None:
    """`close()` returns only once the run's offline file holds every record, up to W&B's
    `exit`: callers of `trainer.api.train` may read or `wandb sync` it at once. (wandb's
    `finish()` alone returned with the file still holding only its header about 1 time in
    8 on a loaded machine: `test_wandb_config_records_the_choice` failed that way.) Several
    runs in a row, as a notebook or this test session makes them."""
    from tests.wandb_reader import read_records

    for i in range(4):
        path = sink_run(tmp_path / f"run{i}", f"closed{i}")
        records = read_records(path)
        kinds = [r.WhichOneof("record_type") for r in records]
        assert kinds and kinds[-1] == "exit", (i, kinds)
        assert [row["_step"] for row in history(path)] == [1, 2, 3, 4, 5]
        config = {
            item.key: json.loads(item.value_json)
            for r in records
            if r.WhichOneof("record_type") == "run"
            for item in r.run.config.update
        }
        assert config.get("micro_batch_size_auto") == 8, (i, config)
