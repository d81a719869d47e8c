"""Assemble a run from the config: each builder receives its own sub-config and the runtime
objects it needs, and `build_run` reads as the list of what a run is made of."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from engine.callbacks import Callback, CallbackList
from engine.callbacks.grad_stats import GradNormsPerLayer
from engine.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    list_checkpoints,
    load_checkpoint,
    remove_stale_tmp,
    verify_together,
)
from engine.distributed import DistInfo, broadcast_object
from engine.model import (
    NoBlocks,
    apply_activation_checkpointing,
    find_blocks,
    flops_per_token,
    require_blocks,
)
from engine.numerics.precision import Precision
from engine.parallel import Parallelism, build_mesh, build_parallelism
from engine.parallel.pipeline import NotSplittable, PipelineParallel
from engine.parallel.tensor import (
    NotParallelizable,
    NotSequenceParallelizable,
    TensorParallel,
    is_strided,
)
from engine.rng import seed_everything
from engine.step import StepContext, StepStrategy, Task
from engine.steps.accumulate import AccumulateStep
from engine.steps.dp_sgd import DPSGDStep, PrivacySpent, check_per_sample_model
from trainer.auto_batch import setup_auto, wandb_extra
from trainer.batch_plan import BatchPlan
from trainer.components import check, instantiate
from trainer.config import EXTRAS, CheckpointCfg, Config, DataExtras, DistCfg, ModelExtras, TrainCfg
from trainer.data import DataSplits, as_splits
from trainer.data.checks import check_samples
from trainer.data.loader import EvalBatches, GlobalBatchSampler, TrainBatches, eval_set_size
from trainer.errors import ConfigError, UserError
from trainer.fit import Run, RunSettings, TrainingProgress, restore
from trainer.identity import new_run_id
from trainer.metrics import JsonlWriter, Progress, RecordSink, TrainMeter, supersede
from trainer.optim import build_optimizer, build_scheduler
from trainer.preemption import StopRequest


def split_extras(node: dict[str, Any], group: str) -> tuple[dict[str, Any], Any]:
    """A `model`/`data` node as (the `_target_`'s spec, the keys the trainer reads itself)."""
    cls = EXTRAS[group]
    names = {f.name for f in dataclasses.fields(cls)}
    spec = {k: v for k, v in node.items() if k not in names}
    extras = {k: v for k, v in node.items() if k in names}
    target = {"_target_": f"{cls.__module__}.{cls.__qualname__}", **extras}
    return spec, instantiate(target, group)


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def options(group: str) -> list[str]:
    """The in-tree config names of a group (`model=gpt_tiny`), for error messages."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def check_config(cfg: Config) -> None:
    """Every component's target imports and its arguments fit its signature (names, types,
    required ones): a one-paragraph error naming the key, before any work starts."""
    for group in ("model", "data"):
        spec, _ = split_extras(getattr(cfg, group), group)
        check(spec, group, options=options(group))
    task = split_extras(cfg.task, "task")[0] if isinstance(cfg.task, dict) else cfg.task
    check(task, "task", options=options("task"))
    check(cfg.optim, "optim", provided=["params"], options=options("optim"))
    check(cfg.scheduler, "scheduler", ["optimizer", "max_steps"], options("scheduler"))
    check(cfg.step, "step", options=options("step"))
    for name, spec in cfg.callbacks.items():
        check(spec, f"callbacks.{name}")


def build_data(node: dict[str, Any]) -> tuple[DataSplits, DataExtras]:
    spec, extras = split_extras(node, "data")
    splits = as_splits(instantiate(spec, "data"), spec["_target_"])
    return splits, extras


def build_model(node: dict[str, Any], info: DistInfo) -> tuple[nn.Module, ModelExtras]:
    """The user's module (or the in-tree GPT) on this rank's device."""
    spec, extras = split_extras(node, "model")
    model = instantiate(spec, "model")
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model._target_",
            f"{spec['_target_']} returned a {type(model).__name__}; it must return an nn.Module",
        )
    return model.to(info.device), extras


def check_fits(model: nn.Module, data: DataSplits, spec: dict[str, Any]) -> None:
    """Token ids and sequence lengths the data declares must fit what the model declares."""
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int) and data.vocab_size is not None and data.vocab_size > vocab:
        key = "model.vocab_size" if "vocab_size" in spec else "model"
        if isinstance(spec.get("config"), dict) and "vocab_size" in spec["config"]:
            key = "model.config.vocab_size"  # a transformers model's config field
        raise ConfigError(
            key,
            f"the data ({data.description or 'data'}) holds token ids up to "
            f"{data.vocab_size - 1}; the model's vocabulary must be at least {data.vocab_size}, "
            f"got {vocab}",
        )
    longest = getattr(model, "max_seq_len", None)
    if isinstance(longest, int) and data.seq_len is not None and data.seq_len > longest:
        raise ConfigError(
            "data.block_size",
            f"must be <= the model's longest sequence ({longest}: model.block_size, or a "
            f"transformers model's n_positions / max_position_embeddings), got {data.seq_len}",
        )


def build_task(node: dict[str, Any]) -> Task:
    spec, _ = split_extras(node, "task")  # task.check_sum is the trainer's (trainer/sum_check.py)
    task = instantiate(spec, "task")
    if not isinstance(task, Task):
        raise ConfigError(
            "task._target_",
            f"{spec['_target_']} built a {type(task).__name__}, which is not a task: it needs "
            "count_items(batch) (loss items, without the model) and loss_sum(model, batch) (the "
            "summed loss), see engine/step.py; or select "
            f"task={'|'.join(options('task'))}",
        )
    return task


def parallelize(
    model: nn.Module,
    extras: ModelExtras,
    train: TrainCfg,
    dist_cfg: DistCfg,
    info: DistInfo,
    parallel: Parallelism | None = None,
) -> nn.Module:
    """Activation checkpointing, compilation and data parallelism (`parallel`, by default the
    one `dist.strategy` names: DDP, or FSDP2 sharding each block and the root), in that order.
    The model's own parameter names are kept."""
    if parallel is None:
        parallel = build_parallelism(dist_cfg.strategy, info)
    try:
        blocks = find_blocks(model, extras.block_classes, key="model.block_classes")
        if extras.activation_checkpointing:
            require_blocks(
                model, blocks, "model.activation_checkpointing=true", "model.block_classes"
            )
            apply_activation_checkpointing(blocks)
        if parallel.per_block:
            require_blocks(model, blocks, f"dist.strategy={parallel.name}", "model.block_classes")
    except NoBlocks as exc:
        message = str(exc).removeprefix("model.block_classes: ")
        raise ConfigError("model.block_classes", message) from None
    if train.compile:  # in place: parameter names (and checkpoints) stay the same
        for module in blocks if parallel.per_block else [model]:
            module.compile()
    try:
        return parallel.apply(
            model, blocks, param_dtype=torch.bfloat16 if train.precision == "bf16" else None
        )
    except NotSplittable as exc:
        raise ConfigError("dist.pp", str(exc)) from None
    except NotSequenceParallelizable as exc:
        raise ConfigError("dist.tp_sequence_parallel", str(exc)) from None
    except NotParallelizable as exc:
        raise ConfigError("dist.tp", str(exc)) from None


def build_model_parallel(cfg: Config, info: DistInfo) -> PipelineParallel | TensorParallel | None:
    """`dist.pp` > 1: the pipeline over a (pp, dp) mesh; `dist.tp` > 1: tensor parallelism
    over a (dp, tp) mesh; both: the pipeline over a (pp, dp, tp) mesh, its stages split over
    `tp`. First each refuses what it cannot run yet, with one paragraph naming the key."""
    d = cfg.dist
    if d.pp == 1 and d.tp == 1:
        return None
    key, n, what = ("dist.pp", d.pp, "pipeline stages") if d.pp > 1 else ("dist.tp", d.tp, "")
    what = what or "tensor-parallel ranks"
    if d.pp > 1 and d.tp > 1:
        if d.tp_sequence_parallel:
            raise ConfigError(
                "dist.tp_sequence_parallel",
                "not available with dist.pp > 1 yet (the sequence is split on the first "
                "stage and gathered on the last); use dist.tp without it",
            )
        n, what = d.pp * d.tp, "pipeline x tensor-parallel ranks"
    if info.world_size % n or info.world_size < n:
        raise ConfigError(
            key,
            f"{n} {what} need a world that is a multiple of {n} ranks (world = {key[5:]} x "
            f"data-parallel size); this run has {info.world_size}: launch with torchrun "
            f"--nproc_per_node={n} (or a multiple), or set {key}=1",
        )
    refused = {
        "train.micro_batch_size": (
            cfg.train.micro_batch_size == "auto",
            "the automatic micro-batch is not probed with it yet",
        ),
        "train.compile": (cfg.train.compile, "compiling it is not built yet"),
        "train.grad_norms": (
            cfg.train.grad_norms == "per_layer",
            "per-layer norms would be recorded for this rank's share of the model only",
        ),
    }
    for k, (bad, why) in refused.items():
        if bad:
            raise ConfigError(k, f"not available with {key}={n}: {why}")
    mesh = build_mesh(info, d.pp, d.tp)
    fsdp = d.strategy == "fsdp"
    if d.pp > 1:  # with dist.tp, its stages split over the tensor-parallel ranks
        return PipelineParallel(info, mesh, d.pp_schedule, d.pp_virtual, d.pp_split, fsdp=fsdp)
    return TensorParallel(info, mesh, fsdp=fsdp, sequence_parallel=d.tp_sequence_parallel)


def check_model_parallel_components(
    parallel: Parallelism, step_fn: StepStrategy, callbacks: CallbackList
) -> None:
    """What runs with a model split over ranks: the exact accumulation step, callbacks that do
    not look at single micro-batches or keep a copy of every weight."""
    if not isinstance(parallel, PipelineParallel | TensorParallel):
        return
    key = "dist.pp" if isinstance(parallel, PipelineParallel) else "dist.tp"
    if type(step_fn) is not AccumulateStep:
        raise ConfigError(
            "step",
            f"with {key} the window runs as step=accumulate's; {type(step_fn).__name__} needs "
            "the whole model on one rank",
        )
    for name, cb in callbacks.named.items():
        per_micro = type(cb).on_after_micro_batch is not Callback.on_after_micro_batch
        if per_micro or name in callbacks.averaged_weights():
            raise ConfigError(
                f"callbacks.{name}",
                f"not available with {key}: it looks at every micro-batch's gradients or keeps "
                "a copy of every weight, which no rank holds whole",
            )


def instantiate_callback(name: str, spec: Any) -> Callback:
    cb = instantiate(spec, f"callbacks.{name}")
    if not isinstance(cb, Callback):
        raise ConfigError(f"callbacks.{name}", f"{spec['_target_']} is not a Callback")
    return cb


def build_callbacks(specs: dict[str, Any], train: TrainCfg) -> CallbackList:
    callbacks = CallbackList({name: instantiate_callback(name, s) for name, s in specs.items()})
    if train.grad_norms == "per_layer" and not any(
        isinstance(cb, GradNormsPerLayer) for cb in callbacks
    ):  # callbacks=grad_stats already computes the same norms
        callbacks.named["grad_norms_per_layer"] = GradNormsPerLayer()
    return callbacks


def build_step(spec: dict[str, Any]) -> StepStrategy:
    step_fn = instantiate(spec, "step")
    if not callable(step_fn):
        raise ConfigError("step._target_", f"{spec['_target_']!r} is not a step strategy")
    return step_fn


def attach_privacy(
    step_fn: StepStrategy, ctx: StepContext, batches: TrainBatches, extras: DataExtras
) -> None:
    """step=dp_sgd: check the model, tell the step its batch and dataset sizes, and record
    `train/epsilon`. Poisson sampling only means something for it."""
    if not isinstance(step_fn, DPSGDStep):
        if extras.sampling == "poisson":
            raise ConfigError(
                "data.sampling",
                "poisson draws variable-size batches for DP-SGD's privacy accounting; it needs "
                "step=dp_sgd (valid otherwise: shuffle)",
            )
        return
    try:
        check_per_sample_model(ctx.model)
    except ValueError as exc:
        raise ConfigError("step", str(exc)) from None
    if ctx.precision.scaler is not None:
        raise ConfigError("train.precision", "step=dp_sgd supports fp32 or bf16, not fp16")
    step_fn.set_sampling(batches.plan.global_batch, len(batches.dataset))
    ctx.callbacks.named["privacy"] = PrivacySpent(step_fn)


def resolve_num_workers(requested: int | None, info: DistInfo) -> int:
    """`data.num_workers=null`: loader workers only where spare cores make them pay off."""
    if requested is not None:
        return requested
    if info.device.type != "cuda":
        return 0  # on CPU the workers would take cores from the training step itself
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(4, (os.cpu_count() or 1) // local_ranks - 1))


def build_train_batches(
    data: DataSplits,
    extras: DataExtras,
    cfg: Config,
    info: DistInfo,
    plan: BatchPlan,
    parallel: Parallelism,
) -> TrainBatches:
    """This data-parallel rank's training windows, through a DataLoader."""
    return TrainBatches(
        data.train,
        GlobalBatchSampler(len(data.train), plan.global_batch, cfg.seed, extras.sampling),
        rank=parallel.dp_rank,
        plan=plan,
        device=info.device,
        collate_fn=data.collate_fn,
        num_workers=resolve_num_workers(extras.num_workers, info),
    )


def build_val_batches(
    data: DataSplits, extras: DataExtras, cfg: Config, info: DistInfo, parallel: Parallelism
) -> EvalBatches:
    """This data-parallel rank's validation batches, through a DataLoader."""
    val = EvalBatches(
        data.val,
        rank=parallel.dp_rank,
        world_size=parallel.dp_size,
        batch_size=cfg.eval.batch_size,
        max_batches=cfg.eval.max_batches,
        device=info.device,
        seed=cfg.seed,
        collate_fn=data.collate_fn,
        num_workers=resolve_num_workers(extras.num_workers, info),
    )
    n_val = eval_set_size(len(data.val), cfg.eval.batch_size, cfg.eval.max_batches)
    if parallel.shards_parameters and cfg.eval.every_steps and n_val < parallel.dp_size:
        raise ConfigError(
            "eval.max_batches",
            f"FSDP evaluates in lockstep and needs a validation sample on each of the "
            f"{parallel.dp_size} ranks; the set has {n_val}: raise eval.max_batches or "
            "eval.batch_size",
        )
    return val


def build_checkpointer(
    cfg: CheckpointCfg, checkpoint_dir: Path, info: DistInfo, fmt: str, timeout_s: float
) -> CheckpointWriter:
    if info.is_main:
        remove_stale_tmp(checkpoint_dir)
    write_shards = None
    if fmt == "sharded":
        from engine.checkpoint.sharded import write_sharded_checkpoint as write_shards
    return CheckpointWriter(
        checkpoint_dir,
        info,
        session=broadcast_object(new_run_id(), info),
        keep_last=cfg.keep_last,
        background=cfg.async_save,
        write_shards=write_shards,
        timeout_s=timeout_s,
    )


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


def checkpoint_format(cfg: CheckpointCfg, parallel: Parallelism) -> str:
    """`checkpoint.format=auto`: sharded where the state is sharded (FSDP on several ranks)."""
    if cfg.format != "auto":
        return cfg.format
    return parallel.checkpoint_format


def check_checkpoint_format(
    fmt: str, parallel: Parallelism, callbacks: CallbackList, model: nn.Module
) -> None:
    strided = [n for n, p in model.named_parameters() if is_strided(p)]
    if fmt == "sharded" and strided:
        raise ConfigError(
            "checkpoint.format",
            f"sharded checkpoints cannot hold {strided[0]}: a fused q/k/v weight split third "
            "by third over dist.tp (colwise_qkv) is a strided DTensor, which "
            "torch.distributed.checkpoint cannot save; use checkpoint.format=full (or auto): "
            "gathered, it resumes on any layout",
        )
    if parallel.shards_parameters and fmt == "full" and callbacks.averaged_weights():
        raise ConfigError(
            "checkpoint.format",
            "under dist.strategy=fsdp the EMA callback keeps its average sharded like the "
            "parameters, and only sharded checkpoints save it; use checkpoint.format=sharded "
            "(or auto, the default)",
        )


def build_run(cfg: Config, config_dict: dict[str, Any], run_dir: Path, info: DistInfo) -> Run:
    # Checked before anything is built: the data-parallel size is the world's, divided by the
    # pipeline stages and the tensor-parallel ranks.
    split = build_model_parallel(cfg, info)  # a pipeline or tensor parallelism, if asked for
    plan = BatchPlan.from_config(cfg.train, info.world_size // (cfg.dist.pp * cfg.dist.tp))
    interleaved = cfg.dist.pp_schedule == "interleaved_1f1b"
    if isinstance(split, PipelineParallel) and interleaved and plan.accum % cfg.dist.pp:
        raise ConfigError(
            "train.grad_accum_steps",
            f"dist.pp_schedule=interleaved_1f1b sends micro-batches through the stages in groups "
            f"of dist.pp={cfg.dist.pp}: the micro-batches per step must be a multiple of it, got "
            f"{plan.accum}",
        )
    seed_everything(cfg.seed)  # same initial weights on every rank
    model, model_extras = build_model(cfg.model, info)
    data, data_extras = build_data(cfg.data)
    check_samples(data, cfg.data["_target_"])
    check_fits(model, data, cfg.model)
    task = build_task(cfg.task)
    # Of the whole model, before pipeline stages prune it to their own parameters.
    flops = flops_per_token(model, data.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    parallel = split or build_parallelism(cfg.dist.strategy, info, build_mesh(info))
    wrapped = parallelize(model, model_extras, cfg.train, cfg.dist, info, parallel)
    optimizer = build_optimizer(cfg.optim, model)  # after wrapping: FSDP shards the parameters
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.train.max_steps)
    precision = Precision(cfg.train.precision, info.device.type)
    callbacks = build_callbacks(cfg.callbacks, cfg.train)
    step_fn = build_step(cfg.step)
    check_model_parallel_components(parallel, step_fn, callbacks)
    ctx = StepContext(
        model=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        task=task,
        precision=precision,
        dist=info,
        parallel=parallel,
        clip_grad_norm=cfg.train.clip_grad_norm,
        callbacks=callbacks,
        sync_every_micro_batch=cfg.dist.fsdp_sync_every_micro_batch,
    )
    step_fn, plan = setup_auto(cfg, ctx, data, step_fn, plan)  # train.micro_batch_size=auto
    batches = build_train_batches(data, data_extras, cfg, info, plan, parallel)
    val_batches = build_val_batches(data, data_extras, cfg, info, parallel)
    attach_privacy(step_fn, ctx, batches, data_extras)
    fmt = checkpoint_format(cfg.checkpoint, parallel)
    check_checkpoint_format(fmt, parallel, callbacks, wrapped)
    callbacks.setup(ctx)  # before a checkpoint is restored into their state
    run = Run(
        settings=RunSettings.from_config(cfg),
        dist=info,
        run_dir=run_dir,
        ctx=ctx,
        step_fn=step_fn,
        batches=batches,
        val_batches=val_batches,
        meter=TrainMeter(info, flops),
        checkpointer=build_checkpointer(
            cfg.checkpoint, run_dir / "checkpoints", info, fmt, cfg.dist.timeout_s
        ),
        config_dict=config_dict,
        progress=TrainingProgress(ctx, plan.global_batch, cfg.train.max_steps),
        decode=data.decode,
    )
    register_state(run, task=task, data=data, step_fn=step_fn)
    resume = find_resume(cfg, run.checkpoint_dir, info)
    if resume is not None:
        try:
            ckpt = load_checkpoint(resume, info, checksums=False)  # verified by find_resume
        except CheckpointError as exc:
            raise UserError(f"checkpoint.resume: {exc}", all_ranks=True) from None
        restore(run, ckpt)
    else:
        run.run_id = broadcast_object(new_run_id(), info)
        # Each data-parallel rank its own dropout stream, independent of the initialization
        # stream (the ranks of a tensor-parallel group compute the same activations: one,
        # unless each holds its own part of them: engine/parallel/tensor.py).
        seed_everything(cfg.seed + 1 + getattr(parallel, "dropout_stream", parallel.dp_rank))

    if info.is_main:
        run.sinks = build_sinks(cfg, run, model, data, resume, n_params)
    if cfg.train.detect_anomaly:
        torch.autograd.set_detect_anomaly(True)  # slow: for debugging NaNs only
    run.stop = StopRequest(info)
    return run


def register_state(run: Run, *, task: Any, data: DataSplits, step_fn: Any) -> None:
    """Name everything a checkpoint saves besides the model and optimizer; user components
    (task, datasets, step strategy) join when they have `state_dict`/`load_state_dict`."""
    ctx = run.ctx
    run.state.add("progress", run.progress)
    run.state.add("scheduler", ctx.scheduler)
    run.state.add("precision", ctx.precision)
    run.state.add("callbacks", ctx.callbacks)
    run.state.add("meter", run.meter)
    run.state.add("task", task)
    run.state.add("step", step_fn)
    run.state.add("train_data", data.train)
    run.state.add("val_data", data.val)


def build_sinks(
    cfg: Config,
    run: Run,
    model: nn.Module,
    data: DataSplits,
    resume: Path | None,
    n_params: int | None = None,
) -> list[RecordSink]:
    """Rank 0's outputs: the resolved config, metrics.jsonl, the console, W&B."""
    plan = run.batches.plan
    (run.run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run.run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(run.config_dict))
    if n_params is None:
        n_params = sum(p.numel() for p in model.parameters())
    print(
        f"cumulus | run dir {run.run_dir} | run id {run.run_id}\n"
        f"  model {type(model).__name__} {n_params / 1e6:.2f}M params | data "
        f"{data.description or cfg.data.get('_target_')}: "
        f"{len(data.train)} train / {len(data.val)} val samples\n"
        f"  world {plan.dp_size} x micro {plan.micro} x accum {plan.accum} = "
        f"global batch {plan.global_batch}"
        + (f" | pipeline {cfg.dist.pp} stages, {cfg.dist.pp_schedule}" if cfg.dist.pp > 1 else "")
        + (f" | tensor parallel {cfg.dist.tp}" if cfg.dist.tp > 1 else "")
        + (" + sequence" if cfg.dist.tp_sequence_parallel else "")
        + " | precision "
        f"{cfg.train.precision} | device {run.dist.device}"
        + (f"\n  resumed from {resume} at step {run.step}" if resume else ""),
        flush=True,
    )
    if cfg.train.global_batch_size is None and plan.accum == TrainCfg.grad_accum_steps:
        print(
            f"NOTE: accumulation is the default train.grad_accum_steps={plan.accum}: each "
            f"optimizer step sums {plan.accum} micro-batches per rank. Set "
            "train.grad_accum_steps, or train.global_batch_size to fix the batch whatever the "
            "world size.",
            flush=True,
        )
    # Records of steps after the resumed one go to metrics.superseded.jsonl: one per step.
    moved = supersede(run.run_dir / "metrics.jsonl", run.step)
    # The same W&B run (this run directory's own checkpoint) already has those steps.
    own = resume is not None and resume.resolve().parent == run.checkpoint_dir.resolve()
    sent = moved if own else None
    sinks: list[RecordSink] = [
        JsonlWriter(run.run_dir / "metrics.jsonl"),
        Progress(cfg.train.max_steps, unit=getattr(run.ctx.task, "unit", "items")),
    ]
    if cfg.logger.name == "wandb":
        from trainer.wandb_logger import WandbSink

        sinks.append(
            WandbSink(
                cfg.logger,
                run.run_dir,
                run.run_id,
                {**run.config_dict, **wandb_extra(run)},
                sent_through=sent,
            )
        )
    return sinks
