"""Optimizer and learning-rate schedule from their config nodes (`_target_` + `_partial_`).

The weight-decay rule, for any model: decay only parameters with two or more dimensions that
do not belong to an embedding or a normalization layer. So biases, norm scales (LayerNorm,
RMSNorm, and any module whose class name ends in `Norm`, e.g. Hugging Face's
`LlamaRMSNorm`) and embeddings (tied output heads included) are never decayed. Each
parameter appears once, tied ones too.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from trainer.config.components import call, check, instantiate, locate
from trainer.config.errors import ConfigError
from trainer.tracking.plurals import counted

_NO_DECAY = (nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def _no_decay_module(module: nn.Module) -> bool:
    return isinstance(module, _NO_DECAY) or type(module).__name__.endswith("Norm")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: never on biases, norms or embeddings (tied ones too)."""
    no_decay: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if _no_decay_module(module) or name == "bias" or p.ndim < 2:
                no_decay.add(id(p))
    decay, plain = [], []
    for p in model.parameters():  # deduplicates tied parameters
        if p.requires_grad:
            (plain if id(p) in no_decay else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


SCHEDULERS = ("cosine", "constant", "linear", "wsd")


def build_optimizer(spec: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """`optim` (a partial optimizer class) over `model`'s trainable parameters, grouped by the
    weight-decay rule when the optimizer takes `weight_decay`. Build it after the model is
    wrapped: FSDP replaces the parameters with sharded ones."""
    target = check(spec, "optim", provided=["params"])
    factory = instantiate(spec, "optim", provided=["params"])
    try:
        takes_decay = "weight_decay" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        takes_decay = False
    if takes_decay:
        groups = param_groups(model, float(spec.get("weight_decay") or 0.0))
        groups = [g for g in groups if g["params"]]
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    return call(factory, spec, "optim", groups)


def build_scheduler(
    spec: dict[str, Any], optimizer: torch.optim.Optimizer, max_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """`scheduler` (a partial): the in-tree schedules also receive `max_steps`, any
    `torch.optim.lr_scheduler` class only the optimizer (set its own lengths in config, e.g.
    `total_iters: ${train.max_steps}`). Stepped once per optimizer step."""
    target = check(spec, "scheduler", provided=["optimizer", "max_steps"])
    try:
        takes_horizon = "max_steps" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        takes_horizon = False
    provided = ["optimizer", "max_steps"] if takes_horizon else ["optimizer"]
    factory = instantiate(spec, "scheduler", provided=provided)
    if takes_horizon:
        factory = functools.partial(factory, max_steps=max_steps)
    scheduler = call(factory, spec, "scheduler", optimizer)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(
            "scheduler._target_",
            "ReduceLROnPlateau steps on a metric, not once per optimizer step; use a schedule "
            f"of optimizer steps ({', '.join(SCHEDULERS)}, or a torch.optim.lr_scheduler class)",
        )
    return scheduler


def warmup_note(spec: dict[str, Any], max_steps: int, lr: float) -> str:
    """A note when the warmup covers more than half of the run ('' otherwise): the learning
    rate then never reaches its peak, or holds it only briefly, and never decays much."""
    warmup = spec.get("warmup_steps")
    if not isinstance(warmup, int) or warmup <= max_steps / 2:
        return ""
    if warmup >= max_steps:
        # engine.schedule's warmup: update k (from 0) uses (k + 1) / (warmup + 1) of the peak.
        last = max_steps / (warmup + 1)
        what = (
            f"the learning rate climbs to {last * lr:.3g} ({last:.0%} of optim.lr={lr:g}) by "
            "the last step: it never reaches its peak and never decays"
        )
    else:
        what = (
            f"the learning rate reaches optim.lr={lr:g} at step {warmup} and has only the last "
            f"{counted(max_steps - warmup, 'step')} to decay"
        )
    return (
        f"NOTE: scheduler.warmup_steps={warmup} covers more than half of this run's "
        f"{counted(max_steps, 'step')} (train.max_steps): {what}. Set scheduler.warmup_steps (e.g. "
        f"{max(1, max_steps // 10)}) or train.max_steps."
    )


def horizon_dependent(spec: dict[str, Any]) -> bool:
    """Whether the schedule's shape depends on train.max_steps (its length)."""
    try:
        return "max_steps" in inspect.signature(locate(spec["_target_"], "scheduler")).parameters
    except Exception:
        return False
