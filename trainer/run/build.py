"""Assemble a training run from the config: each builder receives its own sub-config and the
runtime objects it needs, and `build_run` reads as the list of what a run is made of. The
model, task and data come from `trainer.run.assemble`, shared with evaluation, export and the
planner; the layout's refusals from the parallelism's own `check`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.callbacks import Callback, CallbackList
from engine.callbacks.grad_stats import GradNormsPerLayer
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext, StepStrategy
from engine.window_task import WindowTask
from trainer.config.components import instantiate
from trainer.config.errors import ConfigError
from trainer.config.schema import Config, TrainCfg
from trainer.data.batches import build_train_batches, build_val_batches
from trainer.models.export import export_line
from trainer.models.hf import origin_note
from trainer.models.lora import export_line as adapter_line
from trainer.run.assemble import assemble
from trainer.run.auto_batch import setup_auto
from trainer.run.batch_plan import BatchPlan
from trainer.run.fit import Run, RunSettings, plain_step_window
from trainer.run.ft import FaultTolerance, job_plan
from trainer.run.layout import check_layout, run_shape
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.parts import Assembly
from trainer.run.preemption import StopRequest
from trainer.run.state import (
    Resumed,
    ResumeSettings,
    TrainingProgress,
    build_checkpointer,
    build_state,
    resume,
)
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


def build_context(
    cfg: Config, parts: Assembly, info: DistInfo, ft: FaultTolerance | None = None
) -> StepContext:
    """The step's runtime objects: the optimizer (after wrapping: FSDP shards the
    parameters), its schedule, the precision and the user's callbacks; the task as the
    extensions wrap it (a mixture of experts' balances its routers). Under `ft` the step's
    deal and sums span the live replica groups (its parallelism over the group's), and its
    records join the callbacks."""
    optimizer = build_optimizer(cfg.optim, parts.model)
    callbacks = build_callbacks(cfg.callbacks, cfg.train)
    if ft is not None:
        callbacks.named["ft"] = ft.records
    return StepContext(
        model=parts.wrapped,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg.scheduler, optimizer, cfg.train.max_steps),
        task=parts.extensions.wrap_task(parts.task, parts.built),
        precision=Precision(cfg.train.precision, info.device.type),
        dist=info,
        parallel=parts.parallel if ft is None else ft.parallel(parts.parallel),
        clip_grad_norm=cfg.train.clip_grad_norm,
        callbacks=callbacks,
        sync_every_micro_batch=cfg.dist.fsdp_sync_every_micro_batch,
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
    ctx = build_context(cfg, parts, info, ft)
    step_fn = run_step(cfg, parts, ctx, plan)
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
    banner = build_banner(cfg, parts, plan, ctx, run_dir, resumed) if info.is_main else None
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


def run_step(cfg: Config, parts: Assembly, ctx: StepContext, plan: BatchPlan) -> StepStrategy:
    """The step the run takes: the one the extensions prepare from `step`, their callbacks
    joined to the run's (first: the routing biases move before any other sees the step),
    refused by the compatibility table or the layout's own check."""
    step_fn = parts.extensions.prepare_step(build_step(cfg.step), ctx, plan, parts.built)
    extensions = parts.extensions.callbacks(ctx, step_fn, parts.built)
    ctx.callbacks.named = {**extensions, **ctx.callbacks.named}
    parts.choices.knowing(step=step_fn, callbacks=ctx.callbacks).checked()
    check_layout(parts.parallel, run_shape(cfg, step_fn, ctx, plan))
    return step_fn


def build_banner(
    cfg: Config,
    parts: Assembly,
    plan: BatchPlan,
    ctx: StepContext,
    run_dir: Path,
    resumed: Resumed,
) -> Banner:
    """What the first lines of the run say (rank 0): the layout is the step's (under ft, the
    replica groups around this group's)."""
    return Banner(
        run_dir=run_dir,
        run_id=resumed.run_id,
        model=type(parts.model).__name__ + origin_note(parts.model, cfg.model),
        n_params=parts.n_params,
        n_trainable=parts.n_trainable,
        mixture=parts.mixture,
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
