"""Assemble a training run from the config: each builder receives its own sub-config and the
runtime objects it needs, and `build_run` reads as the list of what a run is made of. The
model, task and data come from `trainer.run.assemble`, shared with evaluation, export and the
planner; the layout's refusals from the parallelism's own `check`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from engine.callbacks import Callback, CallbackList
from engine.callbacks.grad_stats import GradNormsPerLayer
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.parallel.base import RunShape
from engine.parallel.dims import ParallelDims
from engine.step import StepContext, StepStrategy
from engine.steps.accumulate import AccumulateStep
from engine.steps.dp_sgd import (
    DP_SGD_PRECISIONS,
    DPSGDStep,
    PrivacySpent,
    check_per_sample_model,
)
from engine.window_task import WindowTask
from trainer.config.components import instantiate
from trainer.config.errors import ConfigError
from trainer.config.schema import Config, DataExtras, TrainCfg
from trainer.config.signing import sign
from trainer.data.batches import build_train_batches, build_val_batches
from trainer.data.loader import TrainBatches
from trainer.models.export import export_line
from trainer.models.hf import origin_note
from trainer.models.lora import export_line as adapter_line
from trainer.run.assemble import Assembly, assemble, check_layout
from trainer.run.auto_batch import setup_auto
from trainer.run.batch_plan import AUTO, BatchPlan
from trainer.run.fit import Run, RunSettings, plain_step_window
from trainer.run.ft import FaultTolerance, job_plan
from trainer.run.moe import balanced_task, check_moe_step
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.preemption import StopRequest
from trainer.run.state import (
    ResumeSettings,
    RunState,
    TrainingProgress,
    build_checkpointer,
    resume,
    signed_config,
)
from trainer.run.window import step_for_task
from trainer.tracking.profiler import build_profiler
from trainer.tracking.records import TrainMeter, item_unit
from trainer.tracking.sinks import Banner, build_sinks

# A step builds the optimizer's state (Adam's moments): the second one is a steady step.
MEMORY_REPORT_STEPS = 2


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
        check_per_sample_model(ctx.model, ctx.parallel)
    except ValueError as exc:
        raise ConfigError("step", str(exc)) from None
    if ctx.precision.mode not in DP_SGD_PRECISIONS:  # fp16's scaler; fp8's float8 matmuls
        raise ConfigError(
            "train.precision",
            f"step=dp_sgd supports fp32 or bf16, not {ctx.precision.mode}: its per-sample "
            "gradients (torch.func's vmap) run neither under fp16's loss scaler nor through "
            "fp8's float8 layers",
        )
    try:
        step_fn.set_sampling(batches.plan.global_batch, len(batches.dataset))
    except ValueError as exc:  # step.target_epsilon out of reach
        raise ConfigError("step.target_epsilon", str(exc)) from None
    ctx.callbacks.named["privacy"] = PrivacySpent(step_fn)


def build_context(
    cfg: Config,
    parts: Assembly,
    info: DistInfo,
    dims: ParallelDims,
    ft: FaultTolerance | None = None,
) -> StepContext:
    """The step's runtime objects: the optimizer (after wrapping: FSDP shards the
    parameters), its schedule, the precision and the callbacks; a mixture of experts' task
    balances its routers (trainer/run/moe.py). Under `ft` the step's deal and sums span the
    live replica groups (its parallelism over the group's), and its records join the
    callbacks."""
    optimizer = build_optimizer(cfg.optim, parts.model)
    callbacks = build_callbacks(cfg.callbacks, cfg.train)
    if ft is not None:
        callbacks.named["ft"] = ft.records
    return StepContext(
        model=parts.wrapped,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg.scheduler, optimizer, cfg.train.max_steps),
        task=balanced_task(cfg, parts, info, dims),
        precision=Precision(cfg.train.precision, info.device.type),
        dist=info,
        parallel=parts.parallel if ft is None else ft.parallel(parts.parallel),
        clip_grad_norm=cfg.train.clip_grad_norm,
        callbacks=callbacks,
        sync_every_micro_batch=cfg.dist.fsdp_sync_every_micro_batch,
    )


def build_state(
    cfg: Config,
    config: dict[str, Any],
    ctx: StepContext,
    parts: Assembly,
    derived: dict[str, str] | None = None,
    **named: Any,
) -> RunState:
    """What a checkpoint holds: the model and optimizer through the parallelism, the config
    (with the keys it derives, `derived`, signed on rank 0 with this user's secret), and the
    named stateful components (user components join when they have state)."""
    fmt = cfg.checkpoint.format
    sharded = (fmt if fmt != "auto" else parts.parallel.checkpoint_format) == "sharded"
    derived = derived or {}
    signature = sign(signed_config(config, derived)) if ctx.dist.is_main else None
    state = RunState(
        parts.model,
        ctx.optimizer,
        parts.parallel,
        config=config,
        derived=derived,
        signature=signature,
        sharded=sharded,
        adapter=parts.adapter,
    )
    for name, component in {
        **named,
        "scheduler": ctx.scheduler,
        "precision": ctx.precision,
        "callbacks": ctx.callbacks,
        "task": parts.task,
        "train_data": parts.data.train,
        "val_data": parts.data.val,
    }.items():
        state.add(name, component)
    return state


def choices_shape(cfg: Config, step_fn: Any, callbacks: Any) -> RunShape:
    """The run's choices a parallelism may refuse that the config (its step and callbacks
    built) decides: what trainer/run/lifecycle.py checks before any process group."""
    return RunShape(
        auto_micro_batch=cfg.train.micro_batch_size == AUTO,
        compile=cfg.train.compile,
        per_layer_norms=cfg.train.grad_norms == "per_layer",
        step=step_fn,
        plain_accumulation=type(step_fn) is AccumulateStep,
        callbacks=callbacks,
    )


def run_shape(cfg: Config, step_fn: Any, ctx: StepContext, plan: BatchPlan) -> RunShape:
    """The run's choices a parallelism may refuse (its `check`), the built run's included."""
    fmt = cfg.checkpoint.format
    return dataclasses.replace(
        choices_shape(cfg, step_fn, ctx.callbacks),
        accum=plan.accum,
        checkpoint_format=fmt if fmt != "auto" else ctx.parallel.checkpoint_format,
    )


def build_run(
    cfg: Config,
    config: dict[str, Any],
    run_dir: Path,
    info: DistInfo,
    derived: dict[str, str] | None = None,
) -> Run:
    """The run `cfg` describes in `run_dir`, resumed from its checkpoints. `config`: the
    resolved config a checkpoint saves; `derived`: its keys that other keys give
    (trainer/config/trust.py:derived_keys), saved beside it."""
    dims = cfg.dist.dims(info.world_size)  # the layout and the batch arithmetic first
    ft = FaultTolerance(cfg.ft, info, cfg.seed) if cfg.ft.enabled else None
    plan = job_plan(cfg.train, cfg.ft, dims.dp) if ft else BatchPlan.from_config(cfg.train, dims.dp)
    parts = assemble(cfg, info, dims, static_shapes=True)  # (CUDA graphs' refusals first)
    parallel = parts.parallel  # (under ft: this group's; evaluation stays within it)
    ctx = build_context(cfg, parts, info, dims, ft)
    step_fn = step_for_task(build_step(cfg.step), ctx, cfg, plan)
    check_moe_step(ctx.task, step_fn, ctx.callbacks)
    check_layout(parallel, run_shape(cfg, step_fn, ctx, plan))
    step_fn, plan, auto_window = setup_auto(cfg, ctx, parts.data, step_fn, plan)
    batches = build_train_batches(parts.data, parts.data_extras, cfg.seed, info, plan, ctx.parallel)
    val_batches = build_val_batches(
        parts.data,
        parts.data_extras,
        cfg.eval,
        cfg.seed,
        info,
        parallel,
        whole_batches=isinstance(parts.task, WindowTask),
    )
    attach_privacy(step_fn, ctx, batches, parts.data_extras)
    ctx.callbacks.setup(ctx)  # before a checkpoint is restored into their state
    unit = item_unit(parts.task)  # a task names its loss items (`unit = "tokens"`)
    meter = TrainMeter(info, parts.flops_per_token, run_dir, unit)
    progress = TrainingProgress(ctx, plan.global_batch, cfg.train.max_steps)
    state = build_state(
        cfg, config, ctx, parts, derived, progress=progress, meter=meter, step=step_fn
    )
    checkpointer = build_checkpointer(
        cfg.checkpoint,
        run_dir / "checkpoints",
        info,
        state.sharded,
        cfg.dist.timeout_s,
        shared_dir=ft is not None,
    )
    settings = RunSettings.from_config(cfg)
    resuming = resume_settings(cfg, plan, settings)
    resumed = (
        ft.fresh(state, progress, run_dir)  # the first quorum decides: a peer or the disk
        if ft is not None
        else resume(state, progress, run_dir, resuming, info)
    )
    checkpointer.committed = resumed.path
    banner = build_banner(cfg, parts, run_dir, plan, ctx, resumed) if info.is_main else None
    sinks: list[Any] = []
    if banner is not None and ft is None:  # (ft: the writer's sinks open at its first record)
        sinks = build_sinks(cfg, config, banner, unit=unit)
    if cfg.train.detect_anomaly:
        torch.autograd.set_detect_anomaly(True)  # slow: for debugging NaNs only
    run = Run(
        settings=settings,
        dist=info,
        run_dir=run_dir,
        ctx=ctx,
        step_fn=step_fn,
        batches=batches,
        val_batches=val_batches,
        meter=meter,
        checkpointer=checkpointer,
        state=state,
        progress=progress,
        resumed=resumed,
        sinks=sinks,
        stop=StopRequest(info),
        step_window=measured(auto_window or plain_step_window, cfg, run_dir),
        decode=parts.data.decode,
        data_description=parts.data.description or str(cfg.data.get("_target_")),
        profiler=build_profiler(cfg.profile, run_dir, info, ctx.clock, cfg.train.max_steps),
    )
    if ft is not None:
        ft.attach(run, resuming, cfg, config, banner, unit)
    return run


def build_banner(
    cfg: Config, parts: Assembly, run_dir: Path, plan: BatchPlan, ctx: StepContext, resumed: Any
) -> Banner:
    """What the first lines of the run say (rank 0)."""
    return Banner(
        run_dir=run_dir,
        run_id=resumed.run_id,
        model=type(parts.model).__name__ + origin_note(parts.model, cfg.model),
        n_params=parts.n_params,
        n_trainable=parts.n_trainable,
        data=parts.data.description or str(cfg.data.get("_target_")),
        n_train=len(parts.data.train),
        n_val=len(parts.data.val),
        plan=plan,
        layout=ctx.parallel.describe(),
        precision=parts.precision(cfg.train.precision),
        device=str(ctx.dist.device),
        resumed=resumed,
        export=export_line(parts.model) if parts.adapter is None else adapter_line(parts.adapter),
    )


def measured(step_window: Any, cfg: Config, run_dir: Path) -> Any:
    """`train.memory_report=true`: the first steps measured (trainer/run/memory.py)."""
    if not cfg.train.memory_report:
        return step_window
    from trainer.run.memory import MemoryWindow

    return MemoryWindow(step_window, MEMORY_REPORT_STEPS, run_dir / "memory_report.json")


def resume_settings(cfg: Config, plan: BatchPlan, settings: RunSettings) -> ResumeSettings:
    return ResumeSettings(
        resume=cfg.checkpoint.resume,
        seed=cfg.seed,
        max_steps=cfg.train.max_steps,
        global_batch_size=plan.global_batch,
        schedule_uses_max_steps=settings.schedule_uses_max_steps,
    )
