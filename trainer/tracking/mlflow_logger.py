"""MLflow on rank 0 (extra `mlflow`: `mlflow-skinny`, the client without the server).

By default the store is local, in the run directory: `mlflow.db` (SQLite, artifacts in
`mlartifacts/`), the store MLflow 3 recommends and browses without opt-in, where SQLAlchemy
and Alembic are installed (the `mlflow` extra installs them); else `mlruns/` (MLflow's file
store, which MLflow 3 keeps in maintenance mode: browsing it needs
`MLFLOW_ALLOW_FILE_STORE=true`). A run that began with one keeps it. `logger.mlflow.tracking_uri`
names any other store (a server, `databricks`, `sqlite:///...`). The MLflow run is found again
by its tag `cumulus.run_id` (the run id kept in checkpoints), so a resumed run continues it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainer.config.schema import MlflowCfg
from trainer.tracking.records import RecordSink

RUN_ID_TAG = "cumulus.run_id"
# MLflow's limits: values per batch, and the length of a parameter's value.
MAX_METRICS, MAX_PARAMS, MAX_PARAM_CHARS = 1000, 100, 6000
# Files of the run directory logged as artifacts at the end: everything small it writes.
ARTIFACT_MAX_BYTES = 64 * 2**20


DB_FILE, ARTIFACT_DIR, FILE_STORE = "mlflow.db", "mlartifacts", "mlruns"


def sql_store_available() -> bool:
    """MLflow's SQL stores need SQLAlchemy and Alembic (full `mlflow` brings them)."""
    return all(importlib.util.find_spec(m) is not None for m in ("sqlalchemy", "alembic"))


def tracking_uri(cfg: MlflowCfg, run_dir: Path) -> str:
    """The store: `logger.mlflow.tracking_uri`; else the run directory's own: the file store
    `mlruns/` when the run began with one (or SQLAlchemy is missing), else `mlflow.db`."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    files = (run_dir / FILE_STORE).resolve()
    if files.is_dir() or not sql_store_available():
        return files.as_uri()
    return f"sqlite:///{(run_dir / DB_FILE).resolve()}"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"train": {"max_steps": 6}}` -> `{"train.max_steps": "6"}`: the resolved config as
    MLflow parameters (strings as they are, other values as JSON)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flatten(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[name] = (
                text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 1] + "…"
            )
    return params


class MlflowSink(RecordSink):
    """Parameters (the resolved config) once, metrics per step, text samples as text
    artifacts, and the run directory's small files as artifacts at the end.

    Args:
        cfg: `logger.mlflow`.
        run_dir: the run directory (the default store is in it).
        run_id: cumulus's run id: the MLflow run tagged with it is continued.
        config: the resolved config.
        sent_through: steps up to this one were logged by the launch this one resumes; they
            are not logged again when that launch's MLflow run is continued.
    """

    def __init__(
        self,
        cfg: MlflowCfg,
        run_dir: Path,
        run_id: str,
        config: dict[str, Any],
        sent_through: int | None = None,
    ) -> None:
        uri = tracking_uri(cfg, run_dir)
        # The run directory's own SQLite store keeps its artifacts beside it (MLflow's
        # default for a SQL store is ./mlruns of the working directory).
        self.artifact_root = (
            (run_dir / ARTIFACT_DIR).resolve().as_uri() if uri.endswith(DB_FILE) else None
        )
        if uri.startswith("sqlite:"):  # creating its tables logs each migration at INFO
            for name in ("mlflow.store.db.utils", "alembic"):
                logging.getLogger(name).setLevel(logging.WARNING)
        if urlparse(uri).scheme in ("", "file"):  # a directory: MLflow's file store
            # MLflow 3 keeps the file store but asks to opt in; it is the local store that
            # needs neither a database nor a server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        else:
            # A server that is down must not stall training for minutes of retries.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        from mlflow.tracking import MlflowClient

        self.uri, self.run_dir = uri, run_dir
        self.log_artifacts = cfg.log_artifacts
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self._experiment(cfg.experiment)
        found = self.client.search_runs(
            [experiment], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.sent_through = sent_through
            have = found[0].data.params  # parameters cannot change: add only new keys
        else:
            run = self.client.create_run(
                experiment,
                run_name=cfg.run_name or run_dir.name,
                tags={RUN_ID_TAG: run_id, "cumulus.run_dir": str(run_dir.resolve())},
            )
            self.run_id, self.sent_through, have = run.info.run_id, None, {}
        self._log_params({k: v for k, v in flatten(config).items() if k not in have})

    def _experiment(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=self.artifact_root)
        except Exception:  # another run created it meanwhile
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS])

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(record["step"])
        if self.sent_through is not None and step <= self.sent_through:
            return
        now = int(time.time() * 1000)
        metrics = []
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, str):
                self.client.log_text(self.run_id, value, f"samples/{key}/step_{step:08d}.txt")
            elif isinstance(value, int | float):
                metrics.append(Metric(key, float(value), now, step))
        for i in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS])

    def closing_note(self) -> str | None:
        return f"  MLflow run {self.run_id} in {self.uri}"

    def close(self) -> None:
        # Called from the trainer's `finally`: an exception on its way out means a failed run.
        error = sys.exc_info()[0]
        if self.log_artifacts:
            for path in artifacts(self.run_dir):
                where = (
                    str(path.parent.relative_to(self.run_dir))
                    if path.parent != self.run_dir
                    else None
                )
                self.client.log_artifact(self.run_id, str(path), where)
        status = (
            "FINISHED" if error is None else "KILLED" if error is KeyboardInterrupt else "FAILED"
        )
        self.client.set_terminated(self.run_id, status=status)


def artifacts(run_dir: Path) -> list[Path]:
    """The run directory's own small files: its top-level files (not the lock) and the
    resolved config; never checkpoints or other trackers' directories."""
    files = [
        p
        for p in sorted(run_dir.iterdir())
        if p.is_file() and not p.name.startswith(".") and p.name != DB_FILE
    ]
    files.append(run_dir / ".hydra" / "config.yaml")
    return [p for p in files if p.is_file() and p.stat().st_size <= ARTIFACT_MAX_BYTES]
