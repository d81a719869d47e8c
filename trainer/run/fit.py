"""The fit loop: drives the engine's step, logs, evaluates, checkpoints. Reads top to bottom."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from engine.callbacks.grad_stats import missing_gradients
from engine.checkpoint import CheckpointWriteError, CheckpointWriter
from engine.distributed import DistInfo, unwrap
from engine.evaluate import evaluate as evaluate_model
from engine.model import Generates
from engine.step import StepContext, StepResult, StepStrategy, innermost_task
from engine.tasks import CausalLMTask, TaskOutputError
from engine.window_task import WindowTask
from trainer.config.contract import annotate_step
from trainer.config.errors import UserError
from trainer.config.schema import CheckpointCfg, Config, EvalCfg, TrainCfg
from trainer.data.checks import next_window
from trainer.data.loader import EvalBatches, TrainBatches
from trainer.run.optim import horizon_dependent
from trainer.run.preemption import StopRequest
from trainer.run.state import Resumed, RunState, TrainingProgress
from trainer.run.sum_check import check_loss_is_sum
from trainer.tracking.phases import TABLE_FILE
from trainer.tracking.plurals import counted
from trainer.tracking.profiler import NoProfiler
from trainer.tracking.records import (
    MOE_LOAD,
    EvalProgress,
    RecordSink,
    TrainMeter,
    peak_memory_mb,
)


class RunEnded(UserError):
    """The run stopped early for a reason every rank shares; `outcome` names it in the
    end-of-run summary."""

    all_ranks = True
    outcome = "stopped"


class TrainingDiverged(RunEnded):
    """Too many consecutive optimizer steps had non-finite gradients (on every rank alike)."""

    outcome = "diverged"


class CheckpointWriteFailed(RunEnded):
    """A checkpoint could not be written and `checkpoint.on_write_error=stop`."""

    outcome = "stopped: checkpoint write failed"


@runtime_checkable
class ChecksBeforeSave(Protocol):
    """A callback holding a verdict that a checkpoint must not outlive (moe.balance=global's
    routing check, read at records): `before_save` runs on every rank before each save, the
    stop request's included, and raises a `RunEnded` to stop the run there."""

    def before_save(self) -> None: ...


@dataclass
class RunSettings:
    """What the loop reads of the config, picked once by `trainer.run.build`: the root config does
    not travel into the loop."""

    train: TrainCfg
    eval: EvalCfg
    checkpoint: CheckpointCfg
    seed: int
    # The user-swappable nodes a failing step's header names (`model`, `task`).
    components: dict[str, Any]
    data_target: str | None  # `data._target_`, named when loading a window fails
    check_sum: bool  # `task.check_sum` (trainer/run/sum_check.py)
    lr: Any  # `optim.lr`, quoted in the divergence hint
    schedule_uses_max_steps: bool  # the LR schedule decays over train.max_steps

    @classmethod
    def from_config(cls, cfg: Config) -> RunSettings:
        return cls(
            train=cfg.train,
            eval=cfg.eval,
            checkpoint=cfg.checkpoint,
            seed=cfg.seed,
            components={"model": cfg.model, "task": cfg.task},
            data_target=cfg.data.get("_target_"),
            check_sum=bool(cfg.task.get("check_sum", True)),
            lr=cfg.optim.get("lr"),
            schedule_uses_max_steps=horizon_dependent(cfg.scheduler),
        )


# One optimizer step on a window taken from `windows`: the result and the (possibly rebuilt)
# window iterator (trainer/run/auto_batch.py redoes a window with smaller micro-batches).
StepWindow = Callable[["Run", Any, Iterator[Any]], tuple[StepResult, Iterator[Any]]]


def plain_step_window(run: Run, window: Any, windows: Iterator[Any]) -> tuple[Any, Iterator[Any]]:
    return run.step_fn(run.ctx, window), windows


@dataclass
class Run:
    """Everything one training run is made of, assembled by `trainer.run.build` in one call.
    Nothing in it refers back to the run, so it is freed (DDP's reducer with it) as soon as
    it is dropped, while the process group still exists."""

    settings: RunSettings
    dist: DistInfo
    run_dir: Path
    ctx: StepContext
    step_fn: StepStrategy
    batches: TrainBatches
    val_batches: EvalBatches
    meter: TrainMeter
    checkpointer: CheckpointWriter
    state: RunState  # what a checkpoint holds
    progress: TrainingProgress
    resumed: Resumed
    sinks: list[RecordSink]
    stop: StopRequest = field(repr=False)
    step_window: StepWindow = plain_step_window
    # Token ids -> text, for the samples written at each evaluation (None: no samples).
    decode: Callable[[list[int]], str] | None = None
    data_description: str = ""  # where the data came from (a reused token cache, say)
    latest: dict[str, Any] = field(default_factory=dict)  # the last train and val loss
    # profile=torch (trainer/tracking/profiler.py): traces optimizer steps, flags them.
    profiler: Any = field(default_factory=NoProfiler)
    # The final evaluation's and checkpoint's time, which no record holds (rank 0; `finish`).
    final_times: dict[str, Any] = field(default_factory=dict)
    # Whether this launch writes the run directory's checkpoints and report (under ft: the
    # writer group alone).
    writes_run_files: Callable[[], bool] = field(default=lambda: True, repr=False)
    last_saved_step: int = field(init=False)

    def __post_init__(self) -> None:
        self.last_saved_step = self.resumed.step if self.resumed.path is not None else -1

    @property
    def step(self) -> int:
        """Optimizer steps completed (the engine counts them)."""
        return self.ctx.step

    @property
    def run_id(self) -> str:
        return self.progress.run_id

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def fit(run: Run) -> str:
    """Train until `train.max_steps` ("finished"), a stop request ("stopped by request"), or
    divergence or a failed checkpoint write (`RunEnded`)."""
    train, eval_cfg, ckpt = run.settings.train, run.settings.eval, run.settings.checkpoint
    run.meter.restart_clock()
    first_step, started = run.step, time.perf_counter()
    clock = run.ctx.clock  # where each rank's time goes: data, compute, sync, optimizer
    windows = run.batches.windows(run.step)  # loader workers prefetch the next windows
    try:
        while run.step < train.max_steps:
            stepping = run.step + 1  # the step this window makes (the engine counts it)
            run.meter.exclude(run.profiler.begin(stepping))  # the profiler's own time
            step_started = time.perf_counter()
            clock.begin_step(stepping)
            window = next_window(windows, run.batches, run.settings.data_target, stepping)
            clock.switch("compute")
            try:
                if run.step == first_step:
                    check_task(run, window)
                result, windows = run.step_window(run, window, windows)  # advances step
                del window  # not held through evaluation and saving
            except TaskOutputError as exc:  # the same on every rank: the model does not fit
                raise UserError(f"invalid config `task`: {exc}", all_ranks=True) from None
            except UserError:
                raise
            except Exception as exc:  # in the user's model or task: traceback, headed
                annotate_step(exc, run.settings.components, stepping)
                raise
            clock.end_step()
            profiled = time.perf_counter() - step_started if run.profiler.recording else None
            run.meter.update(result, profiled)
            if run.step == first_step + 1:
                report_first_step(run, started)

            if run.step % train.log_every == 0 or run.step == train.max_steps:
                extra = extra_train_metrics(run)
                write(run, run.meter.record(run.step, result, extra, clock))
                check_divergence(run)
            if _due(run.step, eval_cfg.every_steps) and run.step < train.max_steps:
                with clock.within("eval"):
                    evaluate(run)
            if _due(run.step, ckpt.every_steps):
                with clock.within("checkpoint"):
                    save(run)
            if run.stop.agreed():
                if run.dist.is_main:  # every rank agreed: one says it
                    print(f"stop requested: saving step {run.step} and exiting", file=sys.stderr)
                with clock.within("checkpoint"):
                    save(run, final=True)
                finish(run)
                return "stopped by request"
        else:
            # A finished run rerun has its last evaluation already: one record per step.
            if eval_cfg.every_steps and not (run.step == first_step and run.resumed.evaluated):
                if run.dist.is_main:
                    sample = " and a text sample" if sample_prompt(run) is not None else ""
                    print(
                        f"final evaluation at step {run.step}: "
                        f"{counted(len(run.val_batches), 'validation batch', 'validation batches')}"
                        f"{sample}",
                        flush=True,
                    )
                with clock.within("eval"):
                    evaluate(run)
            if ckpt.every_steps:
                with clock.within("checkpoint"):
                    save(run, final=True)
    finally:
        windows.close()
    finish(run)
    return "finished"


def finish(run: Run) -> None:
    """Collective, at the end of a run: a save in flight commits (checkpoint time), and the
    time of what came after the last record (the final evaluation and checkpoint) goes to
    time_by_rank.json's `final` and the summary: no record holds it."""
    if run.checkpointer.in_flight:
        with run.ctx.clock.within("checkpoint"):
            settle(run)
    run.final_times = run.meter.close_phases(run.ctx.clock)


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def check_task(run: Run, window: list[Any]) -> None:
    """Once per launch, on the first window: the task's loss is a sum over its items (a loss
    of the whole window is not one, and step=cached makes it exact by construction)."""
    if isinstance(run.ctx.task, WindowTask):
        return
    if run.settings.check_sum and run.ctx.parallel.whole_model:
        # (Pipeline stages do not hold the whole model to run the check with.)
        name = f"task `{run.settings.components['task'].get('_target_')}`"
        batch = next((b for b in window if b is not None), None)  # Poisson: maybe empty
        ctx = run.ctx
        check_loss_is_sum(ctx.task, ctx.model, batch, ctx.precision, run.dist, name)


def extra_train_metrics(run: Run) -> dict[str, Any]:
    extra: dict[str, Any] = {"train/epoch": run.batches.sampler.epoch(run.step)}
    scale = run.ctx.precision.loss_scale()
    if scale is not None:
        extra["train/loss_scale"] = scale.item()
    for key, value in run.ctx.callbacks.metrics().items():
        extra[key] = value.item() if isinstance(value, torch.Tensor) else value
    # The parallelism's own metrics (pipeline bubbles); collective: every rank records.
    extra.update(run.ctx.parallel.metrics(peak_memory_mb(run.dist.device)))
    return extra


def report_first_step(run: Run, started: float) -> None:
    """Once, after the first window: compile time, and parameters that should have learned
    but got no gradient."""
    if run.settings.train.compile and run.dist.is_main:
        if run.dist.device.type == "cuda":
            torch.cuda.synchronize(run.dist.device)
        print(
            f"torch.compile: first step took {time.perf_counter() - started:.1f} s "
            "(compilation included)",
            flush=True,
        )
    every, last = run.settings.train.log_every, run.settings.train.max_steps
    if run.dist.is_main and every > 1 and run.step < last:
        # The next multiple of log_every from this step on (a resumed run's too), or the last.
        first_record = min(-(-run.step // every) * every, last)
        print(
            f"step {run.step} done in {time.perf_counter() - started:.1f} s (start-up "
            f"included); the first record comes at step {first_record}",
            flush=True,
        )
    missing = missing_gradients(run.ctx.model)
    if missing and run.dist.is_main:
        print(
            f"WARNING: {len(missing)} parameter(s) require grad but received no gradient in the "
            f"first step: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}. They "
            "are frozen by mistake, disconnected from the loss, or computed under no_grad.",
            file=sys.stderr,
        )


def check_divergence(run: Run) -> None:
    consecutive = int(run.meter.consecutive_skips.item())
    if consecutive >= run.settings.train.max_consecutive_skips:
        settle(run, next_checkpoint_step(run))  # a save in flight commits first (all ranks)
        last = run.checkpointer.committed_step
        raise TrainingDiverged(
            f"{consecutive} consecutive optimizer steps up to step {run.step} had non-finite "
            f"gradients and were skipped (train.max_consecutive_skips="
            f"{run.settings.train.max_consecutive_skips}); stopping. Parameters were never updated "
            "with them; "
            + (f"the last checkpoint (step {last}) is intact. " if last else "no checkpoint yet. ")
            + divergence_hints(run.settings)
        )


def divergence_hints(settings: RunSettings) -> str:
    lr = settings.lr
    hints = [f"lower optim.lr (now {lr:g})" if isinstance(lr, int | float) else "lower optim.lr"]
    if settings.train.clip_grad_norm is None:
        hints.append("set train.clip_grad_norm (e.g. 1.0)")
    if settings.train.precision != "fp32":
        hints.append("try train.precision=fp32")
    hints.append("find the first non-finite value with train.detect_anomaly=true")
    return "Try: " + "; ".join(hints) + "."


def write(run: Run, record: dict[str, Any]) -> None:
    # What the summary's first line repeats: the losses, and a mixture's expert load.
    kept = ("train/loss", "val/loss", MOE_LOAD)
    run.latest.update({k: record[k] for k in kept if k in record})
    for sink in run.sinks:
        sink.write(record)


def summary(run: Run, outcome: str, seconds: float) -> str:
    """The closing lines of a run: how it ended, where it got, and what it left."""
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    losses = " | ".join(
        f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in run.latest.items()
    )
    newest = run.checkpointer.committed
    what = "; the trainable parameters alone" if run.state.trainable_only else ""
    lines = [
        f"run {outcome}: step {run.step}/{run.settings.train.max_steps} in "
        + (f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}")
        + (f" | {losses}" if losses else ""),
        f"  run dir {run.run_dir}",
        f"  newest checkpoint {newest} ({size_text(newest)}{what})"
        if newest is not None
        else "  newest checkpoint (none)",
        f"  data {run.data_description}",
    ]
    report = run.run_dir / "memory_report.json"
    if run.settings.train.memory_report and report.is_file():
        lines.append(f"  memory report {report}")
    final = [
        f"{words} {run.final_times[f'{phase}_s']:.2f} s (rank {run.final_times[f'{phase}_rank']})"
        for phase, words in (("eval", "evaluation"), ("checkpoint", "checkpoint"))
        if f"{phase}_s" in run.final_times
    ]
    if final:
        lines.append(f"  after the last record: {', '.join(final)} ({TABLE_FILE} `final`)")
    lines += run.ctx.callbacks.summaries(run.batches.plan.global_batch)
    lines += run.profiler.summary()
    lines += [note for sink in run.sinks if (note := sink.closing_note())]
    return "\n".join(lines)


def evaluate(run: Run) -> dict[str, Any]:
    """Validation metrics over the fixed validation set; consumes no training RNG or data."""
    model, ctx = unwrap(run.ctx.model), run.ctx
    label = f"evaluating step {run.step}"
    progress = EvalProgress(len(run.val_batches), label) if run.dist.is_main else None
    means, count = evaluate_model(
        model, ctx.task, run.val_batches, ctx.precision, run.dist, ctx.parallel, progress
    )
    if not math.isfinite(means.get("loss", math.nan)):
        print(
            f"WARNING: validation loss is {means.get('loss')} at step {run.step}", file=sys.stderr
        )
    metrics = val_metrics(means, count, ctx.task)
    # Callbacks that keep other weights (EMA) get their own validation loss.
    for name, averaged in ctx.callbacks.averaged_weights().items():
        if averaged.evaluate:
            with averaged.weights_swapped(model):
                other, _ = evaluate_model(
                    model, ctx.task, run.val_batches, ctx.precision, run.dist, ctx.parallel
                )
            metrics[f"val/loss_{name}"] = other["loss"]
    if run.settings.eval.sample_tokens and (run.dist.is_main or forward_is_collective(model)):
        # Rank 0 records the sample. The other ranks generate with it only where every
        # forward needs them (FSDP2's or tensor-parallel shards); a whole model on each rank
        # (DDP) runs on rank 0 alone while they go on to the next step's first collective.
        text = sample_text(run, run.settings.eval.sample_tokens)
        if text is not None:
            metrics["val/sample"] = text
    write(run, {"step": run.step, **metrics})
    ctx.callbacks.evaluate(run.step, metrics)
    run.meter.restart_clock()
    return metrics


def val_metrics(means: dict[str, float], count: int, task: Any) -> dict[str, Any]:
    """`val/loss`, `val/ppl` (language models), `val/items`, and the task's other means."""
    loss = means["loss"]
    out: dict[str, Any] = {"val/loss": loss}
    if isinstance(innermost_task(task), CausalLMTask):  # a mixture's balanced task too
        out["val/ppl"] = math.exp(min(loss, 700.0))
    out["val/items"] = count
    out.update({f"val/{k}": v for k, v in means.items() if k != "loss"})
    return out


def _prompt(batch: Any, length: int = 32) -> torch.Tensor | None:
    """The token ids (1, T) that open a validation sample, from a causal-LM batch: a
    conversation's up to its first supervised token (data=chat's `shift_labels`; of a pair,
    the chosen side's)."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch[0]
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        return None
    labels = batch.get("shift_labels") if isinstance(batch, dict) else None
    if ids.dim() == 3 and isinstance(labels, torch.Tensor):  # pairs (data=preference): chosen
        ids, labels = ids[:, 0], labels[:, 0]
    if isinstance(labels, torch.Tensor) and labels.shape[:1] == ids.shape[:1]:
        supervised = (labels[0] != -100).nonzero()
        if len(supervised):
            length = int(supervised[0, -1]) + 1  # position t predicts token t + 1
    return ids[:1, :length]


def sample_prompt(run: Run) -> torch.Tensor | None:
    """The prompt of the text sample each evaluation writes, or None when it writes none:
    `eval.sample_tokens=0`, a model that cannot generate (or is split over ranks: `dist.cp`,
    `dist.pp`, `dist.tp`), data without a decoder or without token ids."""
    model = unwrap(run.ctx.model)
    if not run.settings.eval.sample_tokens or run.decode is None:
        return None
    # Generating is optional (a model declares `generate`) and needs the whole model.
    if not isinstance(model, Generates) or not run.ctx.parallel.whole_model:
        return None
    first = run.val_batches.first_sample()
    return None if first is None else _prompt(first)


def forward_is_collective(model: torch.nn.Module) -> bool:
    """Whether a forward of `model` needs the other ranks: its parameters are DTensors (FSDP2
    gathers them, a tensor-parallel split reduces over them)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def sample_text(run: Run, max_new_tokens: int) -> str | None:
    """A continuation of the validation set's first sample, decoded; None when no sample can
    be made (`sample_prompt`).

    Uses its own seeded generator and eval mode, so training randomness is untouched.
    """
    model = unwrap(run.ctx.model)
    prompt = sample_prompt(run)
    if prompt is None:
        return None
    gen = torch.Generator(run.dist.device).manual_seed(run.settings.seed + run.step)
    was_training = model.training
    model.eval()
    try:
        with run.ctx.precision.autocast():
            out = model.generate(prompt, max_new_tokens, generator=gen)
    finally:
        model.train(was_training)
    return run.decode(out[0].tolist())


def save(run: Run, final: bool = False) -> None:
    """Checkpoint the current step (collective: every rank calls it at the same step), after
    the callbacks' checks (`ChecksBeforeSave`); `final`: the run ends after it (no later
    checkpoint step to retry at)."""
    if run.last_saved_step == run.step or not run.writes_run_files():
        return
    settle(run, retry_at=run.step)  # the previous background save, if one is in flight
    for callback in run.ctx.callbacks:
        if isinstance(callback, ChecksBeforeSave):
            callback.before_save()
    shared, per_rank, shards = run.state.payload()
    try:
        run.checkpointer.save(run.step, shared if run.dist.is_main else None, per_rank, shards)
        run.last_saved_step = run.step
    except CheckpointWriteError as exc:
        write_failed(run, exc, None if final else next_checkpoint_step(run))
    run.meter.restart_clock()


def next_checkpoint_step(run: Run) -> int | None:
    every, last = run.settings.checkpoint.every_steps, run.settings.train.max_steps
    step = (run.step // every + 1) * every if every else None
    return step if step is not None and step <= last else None


def settle(run: Run, retry_at: int | None = None) -> None:
    """Collective: wait for a background save in flight and act on its outcome."""
    try:
        run.checkpointer.settle()
    except CheckpointWriteError as exc:
        write_failed(run, exc, retry_at)


def write_failed(run: Run, exc: CheckpointWriteError, retry_at: int | None) -> None:
    """Every rank alike: stop with one paragraph (`checkpoint.on_write_error=stop`) or warn
    and go on to the checkpoint step `retry_at` (`warn`)."""
    newest = (
        f"The newest committed checkpoint is {exc.committed}; rerunning the same command "
        "resumes from it."
        if exc.committed is not None
        else "No checkpoint of this run has been committed yet."
    )
    if run.settings.checkpoint.on_write_error == "warn":
        if run.dist.is_main:
            retry = (
                "has no checkpoint step left"
                if retry_at is None
                else f"tries again at step {retry_at}"
            )
            print(
                f"WARNING: {exc}. Training goes on (checkpoint.on_write_error=warn) and {retry}. "
                f"{newest}",
                file=sys.stderr,
                flush=True,
            )
        return
    raise CheckpointWriteFailed(
        f"{exc}. {newest} Free space or raise the quota (`df -h`, `ulimit -f`) and rerun, or "
        "set checkpoint.on_write_error=warn to keep training when a checkpoint cannot be "
        "written and try again at the next checkpoint step."
    )


def size_text(path: Path) -> str:
    """A checkpoint's size on disk, every file of it (shards included), in words."""
    size = float(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
    for unit in ("bytes", "KB", "MB"):
        if size < 1000:
            return f"{size:.0f} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"
