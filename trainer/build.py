"""Assemble a run from the config: each builder receives its own sub-config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import OmegaConf

from engine.callbacks import Callback, CallbackList
from engine.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    list_checkpoints,
    load_checkpoint,
    remove_stale_tmp,
    verify_together,
)
from engine.distributed import DistInfo, broadcast_object, wrap_model
from engine.grad_stats import GradNormsPerLayer
from engine.precision import Precision
from engine.rng import seed_everything
from engine.step import StepContext
from trainer.config import Config, TrainCfg
from trainer.data import (
    GlobalBatchSampler,
    Splits,
    TrainBatches,
    eval_batches,
    eval_set_size,
    load_splits,
)
from trainer.errors import ConfigError, UserError
from trainer.fit import Run, restore
from trainer.gpt import GPT, LanguageModelTask
from trainer.identity import new_run_id
from trainer.metrics import JsonlWriter, Progress, RecordSink, TrainMeter
from trainer.optim import build_optimizer, build_scheduler
from trainer.preemption import StopRequest


def resolve_grad_accum(train: TrainCfg, world_size: int) -> int:
    """`train.global_batch_size`, when set, decides the accumulation count."""
    if train.global_batch_size is None:
        return train.grad_accum_steps
    per_step = train.micro_batch_size * world_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            "train.global_batch_size",
            f"{train.global_batch_size} is not a multiple of train.micro_batch_size "
            f"({train.micro_batch_size}) x world size ({world_size}) = {per_step}; valid values "
            f"are {per_step}, {2 * per_step}, {3 * per_step}, ...",
        )
    return train.global_batch_size // per_step


def build_model(cfg: Config, splits: Splits, info: DistInfo) -> torch.nn.Module:
    if splits.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"the data ({splits.description}) holds token ids up to {splits.vocab_size - 1}; "
            f"model.vocab_size must be at least {splits.vocab_size}, got {cfg.model.vocab_size}",
        )
    return GPT(cfg.model).to(info.device)


def build_val_batches(cfg: Config, splits: Splits, info: DistInfo) -> list[Any]:
    """This rank's share of the validation set (the same set for any world size)."""
    return eval_batches(
        splits.val,
        rank=info.rank,
        world_size=info.world_size,
        batch_size=cfg.eval.batch_size,
        max_batches=cfg.eval.max_batches,
        device=info.device,
    )


def instantiate(spec: dict[str, Any], key: str) -> Any:
    """`hydra.utils.instantiate` with a one-paragraph error naming the config key."""
    if not isinstance(spec, dict) or "_target_" not in spec:
        raise ConfigError(key, f"needs a `_target_` (a class path), got {spec!r}")
    try:
        return hydra.utils.instantiate(spec)
    except Exception as exc:
        root = exc
        while root.__cause__ is not None:  # Hydra wraps the constructor's own error
            root = root.__cause__
        text = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
        if isinstance(root, ImportError | AttributeError):  # the class itself is not found
            target = spec["_target_"]
            raise ConfigError(f"{key}._target_", f"cannot import {target}: {text}") from None
        args = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k != "_target_")
        raise ConfigError(key, f"cannot build {spec['_target_']}({args}): {text}") from None


def build_callbacks(specs: dict[str, Any]) -> CallbackList:
    callbacks = {}
    for name, spec in specs.items():
        cb = instantiate(spec, f"callbacks.{name}")
        if not isinstance(cb, Callback):
            raise ConfigError(f"callbacks.{name}", f"{spec['_target_']} is not a Callback")
        callbacks[name] = cb
    return CallbackList(callbacks)


def build_step(spec: dict[str, Any]) -> Any:
    step_fn = instantiate(spec, "step")
    if not callable(step_fn):
        raise ConfigError("step._target_", f"{spec['_target_']!r} is not a step strategy")
    return step_fn


def find_resume(cfg: Config, ckpt_dir: Path, info: DistInfo) -> Path | None:
    """The checkpoint to resume from, the same on every rank: the newest that verifies
    (`auto`) or the given path. All ranks verify each candidate together."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return None
    error = None
    if resume == "auto":
        candidates = list(reversed(list_checkpoints(ckpt_dir))) if info.is_main else []
    else:
        candidates = [Path(resume).expanduser()]
        if info.is_main and not candidates[0].exists():
            error = (
                f"checkpoint.resume: {candidates[0]} does not exist; valid: auto, never, or "
                "the path of a checkpoint directory (run_dir/checkpoints/step_NNNNNNNN)"
            )
    candidates, error = broadcast_object((candidates, error), info)
    if error:
        raise UserError(error, all_ranks=True)
    for path in candidates:
        problem = verify_together(path, info)
        if problem is None:
            return path
        if resume != "auto":
            raise UserError(f"checkpoint.resume: {problem}", all_ranks=True)
        if info.is_main:
            print(f"WARNING: skipping checkpoint: {problem}", file=sys.stderr)
    return None


def checkpoint_format(cfg: Config, info: DistInfo) -> str:
    """`checkpoint.format=auto`: sharded where the state is sharded (FSDP on several ranks)."""
    if cfg.checkpoint.format != "auto":
        return cfg.checkpoint.format
    return "sharded" if cfg.dist.strategy == "fsdp" and info.distributed else "full"


def build_run(cfg: Config, config_dict: dict[str, Any], run_dir: Path, info: DistInfo) -> Run:
    accum = resolve_grad_accum(cfg.train, info.world_size)
    global_batch = cfg.train.micro_batch_size * accum * info.world_size
    splits = load_splits(cfg.data)

    seed_everything(cfg.seed)  # same initial weights on every rank
    model = build_model(cfg, splits, info)
    fsdp = cfg.dist.strategy == "fsdp" and info.distributed
    if cfg.train.compile:  # in place: parameter names (and checkpoints) stay the same
        for module in model.blocks if fsdp else [model]:
            module.compile()
    wrapped = wrap_model(
        model,
        info,
        cfg.dist.strategy,
        shard_modules=list(model.blocks),
        param_dtype=torch.bfloat16 if cfg.train.precision == "bf16" else None,
    )
    # After wrapping: FSDP replaces the parameters with sharded ones.
    optimizer = build_optimizer(cfg.optim, model, info.device)
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.train.max_steps)
    precision = Precision(cfg.train.precision, info.device.type)
    ctx = StepContext(
        model=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        task=LanguageModelTask(),
        precision=precision,
        dist=info,
        clip_grad_norm=cfg.train.clip_grad_norm,
        callbacks=build_callbacks(cfg.callbacks),
        sync_every_micro_batch=cfg.dist.fsdp_sync_every_micro_batch,
    )
    n_val = eval_set_size(len(splits.val), cfg.eval.batch_size, cfg.eval.max_batches)
    if fsdp and cfg.eval.every_steps and n_val < info.world_size:
        raise ConfigError(
            "eval.max_batches",
            f"FSDP evaluates in lockstep and needs a validation sample on each of the "
            f"{info.world_size} ranks; the set has {n_val}: raise eval.max_batches or "
            "eval.batch_size",
        )
    fmt = checkpoint_format(cfg, info)
    if fsdp and fmt == "full" and any(hasattr(cb, "weights_swapped") for cb in ctx.callbacks):
        raise ConfigError(
            "checkpoint.format",
            "under dist.strategy=fsdp the EMA callback keeps its average sharded like the "
            "parameters, and only sharded checkpoints save it; use checkpoint.format=sharded "
            "(or auto, the default)",
        )
    if cfg.train.grad_norms == "per_layer" and not any(
        isinstance(cb, GradNormsPerLayer) for cb in ctx.callbacks
    ):  # callbacks=grad_stats already computes the same norms
        ctx.callbacks.named["grad_norms_per_layer"] = GradNormsPerLayer()
    ctx.callbacks.setup(ctx)  # before a checkpoint is restored into their state
    sampler = GlobalBatchSampler(len(splits.train), global_batch, cfg.seed)
    batches = TrainBatches(
        splits.train,
        sampler,
        rank=info.rank,
        world_size=info.world_size,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum_steps=accum,
        device=info.device,
    )
    val = build_val_batches(cfg, splits, info)
    run = Run(
        cfg=cfg,
        dist=info,
        run_dir=run_dir,
        run_id="",
        ctx=ctx,
        step_fn=build_step(cfg.step),
        batches=batches,
        val_batches=val,
        sinks=[],
        meter=TrainMeter(info, model.flops_per_token(cfg.data.block_size)),
        config_dict=config_dict,
    )
    if info.is_main:
        remove_stale_tmp(run.checkpoint_dir)
    run.checkpointer = CheckpointWriter(
        run.checkpoint_dir,
        info,
        session=broadcast_object(new_run_id(), info),
        keep_last=cfg.checkpoint.keep_last,
        background=cfg.checkpoint.async_save,
        sharded=fmt == "sharded",
        timeout_s=cfg.dist.timeout_s,
    )
    if len(splits.val):
        run.sample_prompt = splits.val[0][:32].unsqueeze(0).to(info.device)  # same on all ranks
    resume = find_resume(cfg, run.checkpoint_dir, info)
    if resume is not None:
        try:
            ckpt = load_checkpoint(resume, info, checksums=False)  # rank 0 verified them
        except CheckpointError as exc:
            raise UserError(f"checkpoint.resume: {exc}", all_ranks=True) from None
        restore(run, ckpt)
    else:
        run.run_id = broadcast_object(new_run_id(), info)
        # Each rank its own dropout stream, independent of the initialization stream.
        seed_everything(cfg.seed + 1 + info.rank)

    if info.is_main:
        run.sinks = build_sinks(cfg, run, model, splits, resume, accum)
    if cfg.train.detect_anomaly:
        torch.autograd.set_detect_anomaly(True)  # slow: for debugging NaNs only
    run.stop = StopRequest(info)
    return run


def build_sinks(
    cfg: Config, run: Run, model: torch.nn.Module, splits: Splits, resume: Path | None, accum: int
) -> list[RecordSink]:
    """Rank 0's outputs: the resolved config, metrics.jsonl, the console, W&B."""
    (run.run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run.run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(run.config_dict))
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"cumulus | run dir {run.run_dir} | run id {run.run_id}\n"
        f"  model {n_params / 1e6:.2f}M params | data {splits.description}: "
        f"{len(splits.train)} train / {len(splits.val)} val samples\n"
        f"  world {run.dist.world_size} x micro {cfg.train.micro_batch_size} x accum {accum} = "
        f"global batch {run.batches.sampler.global_batch_size} | precision "
        f"{cfg.train.precision} | device {run.dist.device}"
        + (f"\n  resumed from {resume} at step {run.step}" if resume else ""),
        flush=True,
    )
    sinks: list[RecordSink] = [
        JsonlWriter(run.run_dir / "metrics.jsonl"),
        Progress(cfg.train.max_steps),
    ]
    if cfg.logger.name == "wandb":
        from trainer.wandb_logger import WandbSink

        sinks.append(WandbSink(cfg.logger, run.run_dir, run.run_id, run.config_dict))
    return sinks
