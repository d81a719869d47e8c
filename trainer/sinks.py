"""Rank 0's outputs: the resolved config, the banner, `metrics.jsonl`, the console, trackers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainer.batch_plan import AUTO, BatchPlan
from trainer.config import Config, TrainCfg
from trainer.metrics import JsonlWriter, Progress, RecordSink, supersede
from trainer.state import Resumed


@dataclass(frozen=True)
class Banner:
    """What the first lines of a run say about it."""

    run_dir: Path
    run_id: str
    model: str
    n_params: int
    data: str
    n_train: int
    n_val: int
    plan: BatchPlan
    layout: str  # the parallelism's own words ('' for plain data parallelism)
    precision: str
    device: str
    resumed: Resumed
    export: str  # what scripts/export_hf.py will make of the model

    def text(self) -> str:
        plan = self.plan
        return (
            f"cumulus | run dir {self.run_dir} | run id {self.run_id}\n"
            f"  model {self.model} {self.n_params / 1e6:.2f}M params | data {self.data}: "
            f"{self.n_train} train / {self.n_val} val samples\n"
            f"  world {plan.dp_size} x micro {plan.micro} x accum {plan.accum} = "
            f"global batch {plan.global_batch}"
            + (f" | {self.layout}" if self.layout else "")
            + f" | precision {self.precision} | device {self.device}"
            + (
                f"\n  resumed from {self.resumed.path} at step {self.resumed.step}"
                if self.resumed.path
                else ""
            )
            + f"\n  {self.export}"
        )


def default_accumulation_note(train: TrainCfg, plan: BatchPlan) -> str:
    """A note when the accumulation count is the default ('' otherwise)."""
    if train.global_batch_size is not None or plan.accum != TrainCfg.grad_accum_steps:
        return ""
    return (
        f"NOTE: accumulation is the default train.grad_accum_steps={plan.accum}: each "
        f"optimizer step sums {plan.accum} micro-batches per rank. Set "
        "train.grad_accum_steps, or train.global_batch_size to fix the batch whatever the "
        "world size."
    )


def tracker_config(config: dict[str, Any], plan: BatchPlan) -> dict[str, Any]:
    """The config a tracker records: the resolved one, plus the micro-batch `auto` chose."""
    if config.get("train", {}).get("micro_batch_size") != AUTO:
        return config
    return {**config, "micro_batch_size_auto": plan.micro}


def build_sinks(cfg: Config, config: dict[str, Any], banner: Banner, unit: str) -> list[RecordSink]:
    """Rank 0's outputs, in order: the resolved config, the banner, metrics.jsonl (records of
    steps after the resumed one moved to metrics.superseded.jsonl: one per step), the
    console, W&B."""
    run_dir, resumed = banner.run_dir, banner.resumed
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    print(banner.text(), flush=True)
    note = default_accumulation_note(cfg.train, banner.plan)
    if note:
        print(note, flush=True)
    moved = supersede(run_dir / "metrics.jsonl", resumed.step)
    sinks: list[RecordSink] = [
        JsonlWriter(run_dir / "metrics.jsonl"),
        Progress(cfg.train.max_steps, unit=unit),
    ]
    if cfg.logger.name == "wandb":
        from trainer.wandb_logger import WandbSink

        # The same W&B run (this run directory's own checkpoint) already has those steps.
        own = (
            resumed.path is not None
            and resumed.path.resolve().parent == (run_dir / "checkpoints").resolve()
        )
        sinks.append(
            WandbSink(
                cfg.logger,
                run_dir,
                banner.run_id,
                tracker_config(config, banner.plan),
                sent_through=moved if own else None,
            )
        )
    return sinks
