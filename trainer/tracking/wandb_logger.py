"""Weights & Biases on rank 0: online with credentials, otherwise offline by itself."""

from __future__ import annotations

import html
import netrc
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainer.config.schema import LoggerCfg
from trainer.tracking.records import RecordSink


def has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host or "api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbSink(RecordSink):
    """Logs the same records as metrics.jsonl, keyed by optimizer step.

    The run id comes from the run identity and is kept in checkpoints, so a resumed run
    continues the same W&B run (offline too).
    """

    def __init__(
        self,
        cfg: LoggerCfg,
        run_dir: Path,
        run_id: str,
        config: dict[str, Any],
        sent_through: int | None = None,
    ) -> None:
        # A resumed run repeats the steps after its checkpoint; W&B already has them (and
        # would refuse or duplicate them), so those steps are not sent again.
        self.sent_through = sent_through
        mode = cfg.mode
        if mode is None:
            mode = "online" if has_credentials() else "offline"
            if mode == "offline":
                print(
                    "wandb: no credentials found, logging offline to "
                    f"{run_dir / 'wandb'} (sync later with `wandb sync`)",
                    file=sys.stderr,
                )
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        kwargs = dict(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.run_name,
            tags=list(cfg.tags),
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
        )
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=60), **kwargs)
        except Exception as exc:  # network down, bad key: never lose the run over logging
            if mode != "online":
                raise
            print(f"wandb: online init failed ({exc}); logging offline instead", file=sys.stderr)
            self.run = wandb.init(mode="offline", **kwargs)

    def write(self, record: dict[str, Any]) -> None:
        # Always pass step=: an offline resume starts W&B's own counter at 0 again.
        if self.sent_through is not None and record["step"] <= self.sent_through:
            return
        import wandb

        data = {
            k: wandb.Html(f"<pre>{html.escape(v)}</pre>") if isinstance(v, str) else v
            for k, v in record.items()
            if k != "step"
        }
        self.run.log(data, step=record["step"])

    def sync_command(self) -> str | None:
        """How to upload an offline run, or None when it is online."""
        if self.run.settings.mode not in ("offline", "dryrun"):
            return None
        return f"wandb sync {self.run.settings.sync_dir}"

    def closing_note(self) -> str | None:
        sync = self.sync_command()
        return f"  W&B logged offline; upload with: {sync}" if sync else None

    def close(self) -> None:
        """Finish the run and return once W&B has written all of it to the run directory.

        `Run.finish()` alone does not wait for that (wandb 0.31): it tells the wandb-core
        service that the run is over without waiting for the service to write the rest of the
        run's `.wandb` file, so right after it the file may hold only its header. A command's
        exit waits for the service (wandb's own atexit teardown); `trainer.api.train` returns
        to its caller, who may `wandb sync` or read the file at once. So the service is torn
        down here (it restarts on the next `wandb.init`), unless another W&B run of this
        process is still active: that one's end (or the process's) waits for it instead.
        """
        import wandb

        self.run.finish()
        if wandb.run is None:
            wandb.teardown()
