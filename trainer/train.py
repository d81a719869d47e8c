"""`python -m trainer.train [overrides]` or `torchrun --nproc_per_node=N -m trainer.train`."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trainer.cli import check_overrides, exit_with, run_command
from trainer.config import Config, register_configs
from trainer.errors import UserError
from trainer.identity import register_resolvers
from trainer.preemption import watch_launcher

if TYPE_CHECKING:
    from engine.distributed import DistInfo

register_configs()
register_resolvers()


def train(cfg: Config, plain: dict[str, Any], info: DistInfo, run_dir: Path) -> None:
    """Build the run in `run_dir` (resuming from its checkpoints) and fit it, holding the run
    directory's lock throughout; a summary closes every run that ends on its own terms."""
    # Imported here: `--help` and a refused config answer without loading torch.
    import torch

    from trainer.build import build_run
    from trainer.fit import RunEnded, fit, summary
    from trainer.report import write_run_report
    from trainer.run_lock import run_dir_lock

    started = time.perf_counter()
    with run_dir_lock(run_dir, info):
        run = build_run(cfg, plain, run_dir, info)
        outcome = None
        try:
            outcome = fit(run)
        except RunEnded as exc:  # diverged, or a checkpoint could not be written
            outcome = exc.outcome
            raise
        except BaseException:
            # A save in flight still commits: a sharded one needs the process group, which is
            # torn down after this. Only this rank's own write is waited for: the other ranks
            # may not be here.
            run.checkpointer.wait()
            raise
        finally:
            torch.autograd.set_detect_anomaly(False)  # process-wide; don't leak into later runs
            closing = None
            if info.is_main:
                if outcome is not None:
                    closing = summary(run, outcome, time.perf_counter() - started)
                # Before the trackers close: MLflow uploads both as artifacts.
                write_run_report(run_dir, closing)
            for sink in run.sinks:
                sink.close()
            run.stop.close()
            if closing is not None:
                print(closing, flush=True)


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    fresh = run_dir.is_dir() and not any(run_dir.iterdir())  # Hydra just made it
    watch_launcher()  # under torchrun: stop if the launcher dies, from start-up on
    try:
        run_command(cfg, lambda config, plain, info: train(config, plain, info, run_dir))
    except SystemExit as exc:
        if exc.code and fresh and os.environ.get("RANK", "0") == "0":
            remove_if_unused(run_dir)
        raise


def remove_if_unused(run_dir: Path) -> None:
    """A run directory that this launch created and that holds no record and no checkpoint
    (the run was refused before its first step) is removed: nothing is left to resume."""
    metrics = run_dir / "metrics.jsonl"
    if any(run_dir.glob("checkpoints/step_*")) or (metrics.exists() and metrics.stat().st_size):
        return
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    try:
        check_overrides(sys.argv[1:], Path(__file__).resolve().parent.parent / "configs")
    except UserError as exc:
        exit_with(exc)
    main()
