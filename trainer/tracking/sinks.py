"""Rank 0's outputs: the resolved config, the banner, `metrics.jsonl`, the console, trackers."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from trainer.config.schema import Config, LoggerCfg, TrainCfg
from trainer.run.batch_plan import AUTO, BatchPlan
from trainer.run.optim import warmup_note
from trainer.run.state import Resumed
from trainer.tracking.records import JsonlWriter, Progress, RecordSink, supersede

if TYPE_CHECKING:
    from engine.moe.active import MixtureSizes


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
    n_trainable: int | None = None  # when not every parameter trains (adapter=lora)
    mixture: MixtureSizes | None = None  # a mixture of experts: its routing, active parameters

    def routing(self) -> str:
        """' (N active: E experts, top-k)' for a mixture of experts (the parameters a token
        goes through, which MFU counts); '' for a dense model."""
        if self.mixture is None:
            return ""
        routed = "; ".join(f"{e} experts, top-{k}" for e, k in self.mixture.routing)
        return f" ({self.mixture.active / 1e6:.2f}M active: {routed})"

    def trainable(self) -> str:
        """' (N trainable, x%)' when not every parameter trains."""
        n = self.n_trainable
        if n is None or n == self.n_params:
            return ""
        return f" ({n:,} of {self.n_params:,} trainable, {n / max(self.n_params, 1):.2%})"

    def text(self) -> str:
        plan = self.plan
        return (
            f"cumulus | run dir {self.run_dir} | run id {self.run_id}\n"
            f"  model {self.model} {self.n_params / 1e6:.2f}M params{self.routing()}"
            f"{self.trainable()} | "
            f"data {self.data}: "
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
    """A note when the accumulation count is the default and nobody chose it ('' when
    train.global_batch_size decides it, or the command line names train.grad_accum_steps,
    even with the default's value)."""
    if train.global_batch_size is not None or plan.accum != TrainCfg.grad_accum_steps:
        return ""
    if "train.grad_accum_steps" in command_line_keys():
        return ""
    return (
        f"NOTE: accumulation is the default train.grad_accum_steps={plan.accum}: each "
        f"optimizer step sums {plan.accum} micro-batches per rank. Set "
        "train.grad_accum_steps, or train.global_batch_size to fix the batch whatever the "
        "world size."
    )


def command_line_keys() -> set[str]:
    """The keys this Hydra run's command-line overrides set (`+key=`, `++key=` included);
    empty outside a Hydra run (`trainer.api` composes without one)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


def tracker_config(config: dict[str, Any], plan: BatchPlan) -> dict[str, Any]:
    """The config a tracker records: the resolved one, plus the micro-batch `auto` chose."""
    if config.get("train", {}).get("micro_batch_size") != AUTO:
        return config
    return {**config, "micro_batch_size_auto": plan.micro}


def build_sinks(cfg: Config, config: dict[str, Any], banner: Banner, unit: str) -> list[RecordSink]:
    """Rank 0's outputs, in order: the resolved config, the banner, metrics.jsonl (records of
    steps after the resumed one moved to metrics.superseded.jsonl: one per step), the
    console, the trackers `logger=[...]` selects."""
    announce(cfg, config, banner)
    moved = supersede(banner.run_dir / "metrics.jsonl", banner.resumed.step)
    return open_sinks(cfg, config, banner, unit, moved)


def announce(cfg: Config, config: dict[str, Any], banner: Banner) -> None:
    """The resolved config in the run directory; the banner and its notes on the console."""
    run_dir = banner.run_dir
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
    print(banner.text(), flush=True)
    notes = (
        default_accumulation_note(cfg.train, banner.plan),
        warmup_note(cfg.scheduler, cfg.train.max_steps, float(cfg.optim.get("lr", 0.0))),
    )
    for note in notes:
        if note:
            print(note, flush=True)


def open_sinks(
    cfg: Config, config: dict[str, Any], banner: Banner, unit: str, moved: int | None
) -> list[RecordSink]:
    """metrics.jsonl, the console and the trackers, once the records after the resumed step
    are moved aside (`moved`: the newest step moved, if any)."""
    run_dir, resumed = banner.run_dir, banner.resumed
    sinks: list[RecordSink] = [
        JsonlWriter(run_dir / "metrics.jsonl"),
        Progress(cfg.train.max_steps, unit=unit),
    ]
    tracked = tracker_config(config, banner.plan)
    # This run directory's own checkpoint: the same tracker run, which already has the moved
    # steps (W&B would refuse or duplicate them). Another run's checkpoint starts a new one.
    own = (
        resumed.path is not None
        and resumed.path.resolve().parent == (run_dir / "checkpoints").resolve()
    )
    for name in cfg.logger.names:
        sinks.append(
            Guarded(
                name,
                lambda name=name: open_tracker(
                    name, cfg.logger, run_dir, banner.run_id, tracked, moved, own
                ),
            )
        )
    return sinks


def open_tracker(
    name: str,
    cfg: LoggerCfg,
    run_dir: Path,
    run_id: str,
    config: dict[str, Any],
    moved: int | None,
    own: bool,
) -> RecordSink:
    """The tracker `name` (a package imported only here: `--help` stays fast)."""
    if name == "wandb":
        from trainer.tracking.wandb_logger import WandbSink

        return WandbSink(cfg, run_dir, run_id, config, sent_through=moved if own else None)
    if name == "tensorboard":
        from trainer.tracking.tensorboard_logger import TensorboardSink

        # The event directory belongs to the run directory: it holds every step that
        # metrics.jsonl held, whoever's checkpoint this launch resumed.
        logdir = Path(cfg.tensorboard.dir) if cfg.tensorboard.dir else run_dir / "tensorboard"
        return TensorboardSink(logdir, sent_through=moved)
    if name == "mlflow":
        from trainer.tracking.mlflow_logger import MlflowSink

        # Continuing this run's MLflow run (found by run id) skips the moved steps itself.
        return MlflowSink(cfg.mlflow, run_dir, run_id, config, sent_through=moved if own else None)
    raise ValueError(f"unknown tracker {name!r}")  # LoggerCfg refused it already


class Guarded(RecordSink):
    """A tracker whose failure costs its own records, never the run: the first error (at
    start-up or at any record: a full disk, a server gone) is one warning, and the tracker
    records nothing more in this launch. metrics.jsonl stays the record of every step."""

    def __init__(self, name: str, open_sink: Callable[[], RecordSink]) -> None:
        self.name = name
        self.failure: str | None = None
        self.sink: RecordSink | None = None
        try:
            self.sink = open_sink()
        except Exception as exc:
            self._fail("start-up", exc)

    def _fail(self, when: str, exc: Exception) -> None:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        self.failure = f"{when} ({type(exc).__name__}: {first})"
        self.sink = None  # not closed: closing a broken tracker may fail or wait again
        print(
            f"WARNING: logger {self.name} failed at {self.failure}; it records nothing more "
            "in this launch. Training goes on; metrics.jsonl has every step.",
            file=sys.stderr,
            flush=True,
        )

    def write(self, record: dict[str, Any]) -> None:
        if self.sink is None:
            return
        try:
            self.sink.write(record)
        except Exception as exc:
            self._fail(f"step {record.get('step')}", exc)

    def closing_note(self) -> str | None:
        if self.failure is not None:
            return f"  {self.name}: stopped recording at {self.failure}"
        return self.sink.closing_note() if self.sink is not None else None

    def close(self) -> None:
        if self.sink is None:
            return
        try:
            self.sink.close()
        except Exception as exc:
            self._fail("close", exc)
