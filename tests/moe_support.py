"""A callback for tests/test_moe.py: the weights and the gradients of optimizer step 1, whole
(gathered under FSDP), written by rank 0. Loaded by the trainer's ranks by `_target_`."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.callbacks import Callback
from engine.distributed import unwrap
from engine.parallel.base import whole_tensor
from engine.step import StepContext


class DumpFirstStep(Callback):
    """Before the first update: {"weights": {name: tensor}, "grads": {name: tensor}} to `path`
    (every rank gathers sharded values; rank 0 writes)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        if ctx.step != 0:
            return
        named = list(unwrap(ctx.model).named_parameters())
        weights = {n: whole_tensor(p.detach()).clone() for n, p in named}
        grads = {n: whole_tensor(p.grad).clone() for n, p in named if p.grad is not None}
        if ctx.dist.rank == 0:
            torch.save({"weights": weights, "grads": grads}, self.path)

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        """After step 1: the model's buffers (routing biases) to `path` + `.buffers`."""
        if step != 1 or ctx.dist.rank != 0:
            return
        buffers = {n: b.detach().clone() for n, b in unwrap(ctx.model).named_buffers()}
        torch.save(buffers, f"{self.path}.buffers")


class DumpFirstStepPerRank(DumpFirstStep):
    """DumpFirstStep's weights and gradients of step 1 from every rank, to `path.rank<R>`
    (expert parallelism: each rank holds its own experts)."""

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        if ctx.step != 0:
            return
        named = list(unwrap(ctx.model).named_parameters())
        weights = {n: p.detach().clone() for n, p in named}
        grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
        torch.save({"weights": weights, "grads": grads}, f"{self.path}.rank{ctx.dist.rank}")

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        del ctx, step
