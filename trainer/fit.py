"""The fit loop: drives the engine's step, logs, evaluates, checkpoints. Reads top to bottom."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import (
    SHARDS,
    CheckpointError,
    CheckpointWriter,
    LoadedCheckpoint,
    load_model_optimizer_state,
    load_sharded,
    model_optimizer_state,
    sharded_model_optimizer_state,
)
from engine.distributed import DistInfo, unwrap
from engine.evaluate import evaluate_loss
from engine.grad_stats import missing_gradients
from engine.rng import rng_state, seed_everything, set_rng_state
from engine.sharded_checkpoint import get_path, saved_keys, split_dtensors, with_path
from engine.step import StepContext, StepStrategy
from trainer.config import Config
from trainer.data import Batch, TrainBatches
from trainer.errors import UserError
from trainer.metrics import RecordSink, TrainMeter
from trainer.preemption import StopRequest


class TrainingDiverged(UserError):
    """Too many consecutive optimizer steps had non-finite gradients (on every rank alike)."""

    all_ranks = True


@dataclass
class Run:
    """Everything one training run is made of, assembled by `trainer.build`."""

    cfg: Config
    dist: DistInfo
    run_dir: Path
    run_id: str
    ctx: StepContext
    step_fn: StepStrategy
    batches: TrainBatches
    val_batches: list[Batch]
    sinks: list[RecordSink]
    meter: TrainMeter
    config_dict: dict[str, Any]
    step: int = 0  # optimizer steps completed
    last_saved_step: int = -1
    sample_prompt: torch.Tensor | None = None  # (1, T) opening of a validation sample
    stop: StopRequest | None = field(default=None, repr=False)
    checkpointer: CheckpointWriter | None = field(default=None, repr=False)

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def fit(run: Run) -> None:
    """Train until `train.max_steps`, a stop request, or divergence."""
    train, eval_cfg, ckpt = run.cfg.train, run.cfg.eval, run.cfg.checkpoint
    run.meter.restart_clock()
    first_step, started = run.step, time.perf_counter()
    while run.step < train.max_steps:
        window = run.batches.window(run.step)
        result = run.step_fn(run.ctx, window)
        run.step += 1
        run.meter.update(result)
        run.ctx.callbacks.after_optimizer_step(run.ctx, run.step)
        if run.step == first_step + 1:
            report_first_step(run, started)

        if run.step % train.log_every == 0 or run.step == train.max_steps:
            write(run, run.meter.record(run.step, result, extra_train_metrics(run)))
            check_divergence(run)
        if _due(run.step, eval_cfg.every_steps) and run.step < train.max_steps:
            evaluate(run)
        if _due(run.step, ckpt.every_steps):
            save(run)
        if run.stop is not None and run.stop.agreed():
            print(f"stop requested: saving step {run.step} and exiting", file=sys.stderr)
            save(run)
            break
    else:
        if eval_cfg.every_steps:
            evaluate(run)
        if ckpt.every_steps:
            save(run)
    run.checkpointer.wait()


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def extra_train_metrics(run: Run) -> dict[str, Any]:
    extra: dict[str, Any] = {"train/epoch": run.batches.sampler.epoch(run.step)}
    scale = run.ctx.precision.loss_scale()
    if scale is not None:
        extra["train/loss_scale"] = scale.item()
    for key, value in run.ctx.callbacks.metrics().items():
        extra[key] = value.item() if isinstance(value, torch.Tensor) else value
    return extra


def report_first_step(run: Run, started: float) -> None:
    """Once, after the first window: compile time, and parameters that should have learned
    but got no gradient."""
    if run.cfg.train.compile and run.dist.is_main:
        if run.dist.device.type == "cuda":
            torch.cuda.synchronize(run.dist.device)
        print(
            f"torch.compile: first step took {time.perf_counter() - started:.1f} s "
            "(compilation included)",
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
    if consecutive >= run.cfg.train.max_consecutive_skips:
        run.checkpointer.wait()  # a save in flight commits first (every rank is here)
        last = run.checkpointer.committed
        raise TrainingDiverged(
            f"{consecutive} consecutive optimizer steps up to step {run.step} had non-finite "
            f"gradients and were skipped (train.max_consecutive_skips="
            f"{run.cfg.train.max_consecutive_skips}); stopping. Parameters were never updated "
            "with them; "
            + (f"the last checkpoint (step {last}) is intact. " if last else "no checkpoint yet. ")
            + divergence_hints(run.cfg)
        )


def divergence_hints(cfg: Config) -> str:
    hints = [f"lower optim.lr (now {cfg.optim.lr:g})"]
    if cfg.train.clip_grad_norm is None:
        hints.append("set train.clip_grad_norm (e.g. 1.0)")
    if cfg.train.precision != "fp32":
        hints.append("try train.precision=fp32")
    hints.append("find the first non-finite value with train.detect_anomaly=true")
    return "Try: " + "; ".join(hints) + "."


def write(run: Run, record: dict[str, Any]) -> None:
    for sink in run.sinks:
        sink.write(record)


def evaluate(run: Run) -> dict[str, Any]:
    """Validation loss over the fixed validation set; consumes no training RNG or data."""
    model, ctx = unwrap(run.ctx.model), run.ctx
    loss, count = evaluate_loss(model, ctx.task, run.val_batches, ctx.precision, run.dist)
    if not math.isfinite(loss):
        print(f"WARNING: validation loss is {loss} at step {run.step}", file=sys.stderr)
    metrics = val_metrics(loss, count)
    # Callbacks that keep other weights (EMA) get their own validation loss.
    for name, cb in ctx.callbacks.named.items():
        if getattr(cb, "evaluate", False) and hasattr(cb, "weights_swapped"):
            with cb.weights_swapped(model):
                other, _ = evaluate_loss(model, ctx.task, run.val_batches, ctx.precision, run.dist)
            metrics[f"val/loss_{name}"] = other
    if run.cfg.eval.sample_tokens and run.sample_prompt is not None:
        # Every rank generates (a sharded model's forward is collective); rank 0 records.
        metrics["val/sample"] = sample_text(run, run.sample_prompt, run.cfg.eval.sample_tokens)
    write(run, {"step": run.step, **metrics})
    ctx.callbacks.evaluate(run.step, metrics)
    run.meter.restart_clock()
    return metrics


def val_metrics(loss: float, count: int) -> dict[str, Any]:
    return {"val/loss": loss, "val/ppl": math.exp(min(loss, 700.0)), "val/items": count}


def sample_text(run: Run, prompt: torch.Tensor, max_new_tokens: int) -> str:
    """A continuation of `prompt` (1, T) byte ids, decoded as UTF-8.

    Uses its own seeded generator and eval mode, so training randomness is untouched.
    """
    model = unwrap(run.ctx.model)
    if not hasattr(model, "generate") or model.cfg.vocab_size != 256:
        return ""
    gen = torch.Generator(run.dist.device).manual_seed(run.cfg.seed + run.step)
    was_training = model.training
    model.eval()
    try:
        with run.ctx.precision.autocast():
            out = model.generate(prompt, max_new_tokens, generator=gen)
    finally:
        model.train(was_training)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def save(run: Run) -> None:
    """Checkpoint the current step (collective: every rank calls it at the same step)."""
    if run.last_saved_step == run.step:
        return
    ctx = run.ctx
    shards = None
    callbacks = ctx.callbacks.state_dict()
    if run.checkpointer.sharded:  # each rank writes its own part
        shards = sharded_model_optimizer_state(ctx.model, ctx.optimizer)
        # Callback tensors sharded like the parameters (FSDP's EMA) too; the rest is plain.
        callbacks, shards["callbacks"] = split_dtensors(callbacks)
    else:  # gathered to rank 0 (collective)
        model_state, optimizer_state = model_optimizer_state(ctx.model, ctx.optimizer)
    shared = None
    if run.dist.is_main:
        shared = {
            "step": run.step,
            "run_id": run.run_id,
            "global_batch_size": run.batches.sampler.global_batch_size,
            "max_steps": run.cfg.train.max_steps,  # the LR schedule's horizon
            "scheduler": ctx.scheduler.state_dict() if ctx.scheduler is not None else None,
            "precision": ctx.precision.state_dict(),
            "meter": {
                "skipped": run.meter.skipped.cpu(),
                "consecutive_skips": run.meter.consecutive_skips.cpu(),
            },
            "callbacks": callbacks,
            "config": run.config_dict,
        }
        if shards is None:
            shared |= {"model": model_state, "optimizer": optimizer_state}
    run.checkpointer.save(run.step, shared, {"rng": rng_state()}, shards)
    run.last_saved_step = run.step
    run.meter.restart_clock()


def summarize(exc: BaseException) -> str:
    """The first line of a long load_state_dict error, with how many more it had."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    detail = [ln for ln in lines[1:] if not ln.endswith(":")]
    more = f" (and {len(detail) - 1} more)" if len(detail) > 1 else ""
    return f"{lines[0].rstrip(':.')}{': ' + detail[0] if detail else ''}{more}"


def sharded_callback_state(ckpt: LoadedCheckpoint, live: dict[str, Any]) -> dict[str, Any]:
    """Where to load the callback tensors the checkpoint saved shard by shard: this run's own
    tensors at the same places (sharded or not: loading reshards). State of callbacks this run
    does not have is left unread, as in the full layout."""
    out = {}
    for key in saved_keys(ckpt.path / SHARDS, "callbacks"):
        if key.split("/", 1)[0] not in live:
            continue
        try:
            out[key] = get_path(live, key)
        except (KeyError, IndexError, TypeError):
            out[key] = None
        if not isinstance(out[key], torch.Tensor):
            raise KeyError(f"callback state {key} is in the checkpoint but not in this run")
    return out


def restore(run: Run, ckpt: LoadedCheckpoint) -> None:
    """Put the run exactly where checkpoint `ckpt` left it. Anything missing is an error."""
    s, ctx = ckpt.shared, run.ctx
    try:
        callbacks = s["callbacks"]
        if ckpt.layout == "sharded":  # collective; reshards to this run's ranks and strategy
            sharded = sharded_callback_state(ckpt, ctx.callbacks.state_dict())
            load_sharded(ckpt.path, ctx.model, ctx.optimizer, {"callbacks": sharded})
            for key, tensor in sharded.items():
                callbacks = with_path(callbacks, key, tensor)
        else:
            load_model_optimizer_state(ctx.model, ctx.optimizer, s["model"], s["optimizer"])
        if ctx.scheduler is not None:
            ctx.scheduler.load_state_dict(s["scheduler"])
        ctx.precision.load_state_dict(s["precision"])
        ctx.callbacks.load_state_dict(callbacks)
        run.meter.skipped.copy_(s["meter"]["skipped"])
        run.meter.consecutive_skips.copy_(s["meter"]["consecutive_skips"])
        saved_batch, saved_id = int(s["global_batch_size"]), str(s["run_id"])
        saved_horizon = s.get("max_steps")
        rng = None if ckpt.per_rank is None else ckpt.per_rank["rng"]
    except CheckpointError as exc:  # unsafe or unreadable shards: every rank got the same
        raise UserError(f"checkpoint.resume: {exc}", all_ranks=True) from None
    except (KeyError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise UserError(
            f"checkpoint {ckpt.path} does not fit this run: {summarize(exc)}. Resume with the "
            "model, optimizer and callbacks it was saved with, or pass checkpoint.resume=never.",
            all_ranks=True,
        ) from None
    run.step = run.last_saved_step = run.checkpointer.committed = ckpt.step
    # The same W&B run only when continuing this run directory; a branch gets its own id.
    if ckpt.path.resolve().parent == run.checkpoint_dir.resolve():
        run.run_id = saved_id
    warn = run.dist.is_main
    if saved_batch != run.batches.sampler.global_batch_size and warn:
        print(
            f"WARNING: {ckpt.path} was trained with global batch {saved_batch}, this run uses "
            f"{run.batches.sampler.global_batch_size}: the data order from here on differs",
            file=sys.stderr,
        )
    if saved_horizon is not None and saved_horizon != run.cfg.train.max_steps and warn:
        print(
            f"WARNING: the LR schedule decays over train.max_steps; it was {saved_horizon} when "
            f"{ckpt.path} was saved and is {run.cfg.train.max_steps} now, so the learning rate "
            "from here on follows the new schedule",
            file=sys.stderr,
        )
    # RNG last: nothing after this may consume randomness before the first step.
    if rng is not None:
        if "cuda" in rng and not torch.cuda.is_available() and warn:
            print(
                f"WARNING: {ckpt.path} holds CUDA RNG state; this run has no CUDA", file=sys.stderr
            )
        set_rng_state(rng)
    else:
        if warn:
            print(
                f"WARNING: {ckpt.path} was saved by {ckpt.world_size} ranks, this run has "
                f"{run.dist.world_size}: model and optimizer resume exactly, random streams "
                "(dropout) are reseeded",
                file=sys.stderr,
            )
        seed_everything(run.cfg.seed + 1_000_003 * ckpt.step + run.dist.rank)
