"""Optimizer and learning-rate schedule builders."""

from __future__ import annotations

import torch
from torch import nn

from engine.schedule import warmup_constant, warmup_cosine
from trainer.config import OptimCfg, SchedulerCfg

_NO_DECAY_MODULES = (nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: never on biases, norms or embeddings (tied ones too)."""
    no_decay: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, _NO_DECAY_MODULES) or name == "bias" or p.ndim < 2:
                no_decay.add(id(p))
    decay, plain, seen = [], [], set()
    for p in model.parameters():  # deduplicates tied parameters
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (plain if id(p) in no_decay else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


def build_optimizer(cfg: OptimCfg, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    fused = cfg.fused and device.type in ("cpu", "cuda")
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None
        )
    # Not fused: fused SGD allocates its momentum buffers with empty_like before it honours
    # `found_inf`, so a skipped first step would leave uninitialized memory as momentum.
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def build_scheduler(
    cfg: SchedulerCfg, optimizer: torch.optim.Optimizer, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    if cfg.name == "cosine":
        factor = warmup_cosine(cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    else:
        factor = warmup_constant(cfg.warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
