"""The model laid out over the job's ranks: the parallelism built once from its degrees, its
refusals as config errors, and `parallelize` (activation checkpointing, compilation, the
layout), which lays out the policy and anything laid out like it (DPO's frozen copy)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.distributed import DistInfo
from engine.model import NoBlocks, apply_activation_checkpointing, find_blocks, require_blocks
from engine.parallel.base import LayoutError, Parallelism, RunShape
from engine.parallel.dims import ParallelDims
from engine.steps.accumulate import AccumulateStep
from trainer.config.errors import ConfigError
from trainer.config.schema import Config, ModelExtras
from trainer.run.batch_plan import AUTO, BatchPlan


def layout_error(exc: LayoutError) -> ConfigError:
    """An engine refusal of a layout, as the config error naming its key."""
    return ConfigError(exc.key, str(exc))


def build_parallelism(dims: ParallelDims, info: DistInfo) -> Parallelism:
    """The parallelism of `dims` on this job's ranks, the device mesh built once."""
    try:
        return dims.build(info)
    except LayoutError as exc:
        raise layout_error(exc) from None


def check_layout(parallel: Parallelism, shape: RunShape) -> None:
    """The parallelism's refusals of the run's other choices, as config errors."""
    try:
        parallel.check(shape)
    except LayoutError as exc:
        raise layout_error(exc) from None


def parameter_dtype(precision: str, dims: ParallelDims, info: DistInfo) -> torch.dtype | None:
    """The dtype the laid-out model computes with its parameters in, when not their own: bf16
    under `train.precision=bf16|fp8` where FSDP2 shards them (`dist.strategy=fsdp` on several
    ranks, also beside tp, pp, cp or ep: it casts each unit's parameters for its forward);
    None where the parameters compute as they are, under autocast (one process, DDP, tp or pp
    without FSDP2, ep over DDP). The one owner of the choice: `parallelize` lays out with it,
    and a precomputed reference is keyed by it."""
    sharded = dims.strategy == "fsdp" and info.distributed
    return torch.bfloat16 if precision in ("bf16", "fp8") and sharded else None


def parallelize(
    model: nn.Module,
    extras: ModelExtras,
    parallel: Parallelism,
    *,
    compile: bool = False,
    compile_mode: str | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Activation checkpointing, compilation (`torch.compile`'s `compile_mode`, None for its
    default) and the parallelism (DDP; FSDP2 sharding each block and the root, computing with
    `param_dtype` parameters (`parameter_dtype`); tensor or pipeline splits), in that order.
    The model's own parameter names are kept."""
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
    if compile:  # in place: parameter names (and checkpoints) stay the same
        for module in blocks if parallel.per_block else [model]:
            module.compile(mode=compile_mode)
    try:
        return parallel.apply(model, blocks, param_dtype=param_dtype)
    except LayoutError as exc:
        raise layout_error(exc) from None


def run_shape(cfg: Config, step_fn: Any, ctx: Any, plan: BatchPlan) -> RunShape:
    """The run's choices a parallelism may refuse (its `check`: the engine's own refusals,
    which the compatibility table's have come before), the built run's included."""
    fmt = cfg.checkpoint.format
    return RunShape(
        auto_micro_batch=cfg.train.micro_batch_size == AUTO,
        compile=cfg.train.compile,
        per_layer_norms=cfg.train.grad_norms == "per_layer",
        step=step_fn,
        plain_accumulation=type(step_fn) is AccumulateStep,
        callbacks=ctx.callbacks,
        accum=plan.accum,
        checkpoint_format=fmt if fmt != "auto" else ctx.parallel.checkpoint_format,
    )
