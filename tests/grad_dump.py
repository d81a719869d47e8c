"""A callback that saves the gradients the optimizer is about to apply at one step, so a
test can compare them with a gradient it computes itself. Loaded by the trainer's
subprocesses as `tests.grad_dump.DumpGrads`; imports only what the trainer already has."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.callbacks import Callback
from engine.distributed import unwrap
from engine.step import StepContext


class DumpGrads(Callback):
    """Rank 0 writes {parameter name: gradient} of optimizer step `step` (1-based) to `path`.
    Under DDP every rank holds the same, all-reduced gradients."""

    def __init__(self, path: str, step: int = 1) -> None:
        self.path, self.step = Path(path), step

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        if ctx.step + 1 != self.step or ctx.dist.rank != 0:
            return
        model = unwrap(ctx.model)
        grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        torch.save(grads, self.path)
