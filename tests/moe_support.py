"""For tests/test_moe.py, loaded by the trainer's ranks by `_target_`: a callback writing the
weights and the gradients of optimizer step 1, whole (gathered under FSDP), from rank 0 (and
its micro-batches: `DumpFirstStepBatches`); a
mixture whose routing does not repeat (`RestlessGPT`; `RestlessOnRank1`, on rank 1 alone); a
stop request after a given step (`StopAfter`); an overflow in one rank's experts
(`OverflowInExperts`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.callbacks import Callback
from engine.distributed import unwrap
from engine.moe.routing import HasRouters
from engine.parallel.base import local_values, whole_tensor
from engine.step import StepContext
from trainer.models.gpt import GPT
from trainer.models.moe import Router


class DumpFirstStep(Callback):
    """Before the first update: {"weights": {name: tensor}, "grads": {name: tensor}, "held":
    [the index of each router still holding a routing]} to `path` (every rank gathers sharded
    values; rank 0 writes). Every micro-batch's routing was read and dropped after its forward:
    one still held after the backward passes was routed again by a block recomputed in
    backward (activation checkpointing), and its logits' graph keeps the recomputed block's
    activations alive."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        if ctx.step != 0:
            return
        named = list(unwrap(ctx.model).named_parameters())
        weights = {n: whole_tensor(p.detach()).clone() for n, p in named}
        grads = {n: whole_tensor(p.grad).clone() for n, p in named if p.grad is not None}
        model = unwrap(ctx.model)
        routers = model.routers() if isinstance(model, HasRouters) else []
        held = [i for i, r in enumerate(routers) if r.routing is not None]
        if ctx.dist.rank == 0:
            torch.save({"weights": weights, "grads": grads, "held": held}, self.path)

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        """After step 1: the model's buffers (routing biases) to `path` + `.buffers`."""
        if step != 1 or ctx.dist.rank != 0:
            return
        buffers = {n: b.detach().clone() for n, b in unwrap(ctx.model).named_buffers()}
        torch.save(buffers, f"{self.path}.buffers")


class DumpFirstStepBatches(DumpFirstStep):
    """DumpFirstStep's dump with rank 0's micro-batches of step 1 too, in order: `"batches"`,
    a list of (inputs, targets) (a per-micro-batch reference needs the split)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.batches: list[tuple[torch.Tensor, ...]] = []

    def on_after_micro_batch(
        self, ctx: StepContext, batch: Any, global_count: torch.Tensor, last: bool
    ) -> None:
        del global_count
        if ctx.step != 0:
            return
        self.batches.append(tuple(t.detach().clone() for t in batch))
        if last and ctx.dist.rank == 0:
            torch.save(self.batches, f"{self.path}.batches")


class RestlessGPT(GPT):
    """A mixture whose routing depends on how many forwards it has run, not only on its
    weights, its batch and its random state: before each forward of its first router, the
    router's bias sends every token to the next expert. A micro-batch's backward pass then
    routes unlike its routing pass (moe.balance=global must say so)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.forwards = 0
        router = self.routers()[0]
        router.register_forward_pre_hook(self._turn)

    def _turn(self, router: nn.Module, args: Any) -> None:
        del args
        assert isinstance(router, Router)
        self.forwards += 1
        with torch.no_grad():
            router.bias.zero_()
            router.bias[self.forwards % router.num_experts] = 10.0


class RestlessOnRank1(RestlessGPT):
    """RestlessGPT on rank 1 alone: rank 0 routes every micro-batch as it counted, and must
    still stop with rank 1 (the ranks agree on the routing check)."""

    def _turn(self, router: nn.Module, args: Any) -> None:
        if dist.is_initialized() and dist.get_rank() == 1:
            super()._turn(router, args)


class StopAfter(Callback):
    """A scheduler's stop request (SIGTERM to this process) after optimizer step `step`: the
    run saves and stops at the next step boundary (trainer/run/preemption.py)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        del ctx
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class DumpFirstStepPerRank(DumpFirstStep):
    """DumpFirstStep's weights and gradients of step 1 from every rank, to `path.rank<R>`
    (expert parallelism: each rank holds its own experts; FSDP2's shards of the other
    parameters are gathered)."""

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        if ctx.step != 0:
            return
        named = list(unwrap(ctx.model).named_parameters())
        weights = {n: whole_tensor(p.detach()).clone() for n, p in named}
        grads = {n: whole_tensor(p.grad).clone() for n, p in named if p.grad is not None}
        torch.save({"weights": weights, "grads": grads}, f"{self.path}.rank{ctx.dist.rank}")

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        del ctx, step


class OverflowInExperts(Callback):
    """An fp16 overflow in one rank's experts at optimizer step 1: after the window's last
    backward, rank `rank` puts inf in the (still scaled) gradient of its last expert of the
    first mixture, before GradScaler unscales (it breaks `on_after_micro_batch`'s read-only
    contract on purpose: a gradient that overflowed in backward). Each rank writes to
    `path.rank<R>` its loss scale and its own values (FSDP2's shards, its experts) of every
    parameter before and after step 1, and how many parameters its optimizer holds state for
    after it (none: the step was skipped)."""

    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = Path(path), rank
        self.before: dict[str, Any] = {}

    def _values(self, ctx: StepContext) -> dict[str, torch.Tensor]:
        named = unwrap(ctx.model).named_parameters()
        return {n: local_values(p.detach()).clone() for n, p in named}

    def on_after_micro_batch(
        self, ctx: StepContext, batch: Any, global_count: torch.Tensor, last: bool
    ) -> None:
        del batch, global_count
        if ctx.step != 0 or not last:
            return
        scale = ctx.precision.loss_scale()
        assert scale is not None, "OverflowInExperts needs train.precision=fp16"
        self.before = {"scale": scale.item(), "weights": self._values(ctx)}
        if ctx.dist.rank != self.rank:
            return
        named = unwrap(ctx.model).named_parameters()
        expert = next(p for n, p in named if ".mlp.experts." in n and p.grad is not None)
        with torch.no_grad():
            local_values(expert.grad)[-1].view(-1)[0] = float("inf")

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        if step != 1:
            return
        scale = ctx.precision.loss_scale()
        assert scale is not None
        after = {"scale": scale.item(), "weights": self._values(ctx)}
        state = {"before": self.before, "after": after, "stepped": len(ctx.optimizer.state)}
        torch.save(state, f"{self.path}.rank{ctx.dist.rank}")
