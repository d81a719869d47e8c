"""The exact accumulation step.

One optimizer step from a window of micro-batches, in textbook order:

    zero grads -> count loss items of the window (one all-reduce) -> [a task's look at the
    whole window, under the window's guard: the MoE balancing's routing pass] -> per micro-batch:
    forward + backward of loss_sum * divisor / global_count (no_sync but the last) ->
    unscale -> clip -> finite check -> optimizer step -> scheduler step

Dividing each micro-batch by `grad_accum_steps` is wrong when micro-batches hold different
numbers of valid tokens; dividing every micro-batch of every rank by the *global* count makes
the accumulated gradient equal to the gradient of the whole global batch's mean loss. DDP then
averages over ranks, hence the factor `ctx.grad_sync_divisor` (the world size under DDP; 1
under FSDP as wrapped here, which sums).

The loop over the window's micro-batches is the parallelism's (`backward_window`: the plain
loop of engine/parallel/base.py, or a pipeline's schedule). `AccumulateStep(guard=...)` runs
the same step under a guard (engine/steps/oom.py: out-of-memory errors agreed by every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from engine.parallel.base import NO_GUARD, SettlesCount, WindowGuard
from engine.step import Batch, PreparesWindow, StepContext, StepResult, item_count

T = TypeVar("T")


class StepGuard(Protocol):
    """What wraps a step's moments: its start, the window (a `WindowGuard` for the
    parallelism's loop, or None), the update and the step's end."""

    def start(self, ctx: StepContext) -> None: ...
    def window(self, ctx: StepContext) -> WindowGuard | None: ...
    def update(self, ctx: StepContext, fn: Callable[[], T]) -> T: ...
    def finish(self, ctx: StepContext, fn: Callable[[], T]) -> T: ...


class Unguarded:
    """Every moment runs as it is."""

    def start(self, ctx: StepContext) -> None:
        del ctx

    def window(self, ctx: StepContext) -> WindowGuard | None:
        del ctx
        return None

    def update(self, ctx: StepContext, fn: Callable[[], T]) -> T:
        del ctx
        return fn()

    def finish(self, ctx: StepContext, fn: Callable[[], T]) -> T:
        del ctx
        return fn()


def count_window(ctx: StepContext, window: Sequence[Batch], defer: bool = False) -> torch.Tensor:
    """Loss items of the whole window over all data-parallel ranks: one all-reduce, before
    any forward. (Pipeline stages of one replica read the same window: counted once.)
    `defer`: nothing reads the count before the first backward, so a parallelism that can
    (`SettlesCount`: across replica groups) takes its last sum after the first forward."""
    local = torch.stack([item_count(ctx.task, b) for b in window]).sum()
    if local.device.type == "cpu" and ctx.dist.device.type == "cuda":
        # Counts known on the host (a task counting rows): a pageable copy would wait for
        # the device at every step's start; a pinned one is queued like the rest.
        local = local.pin_memory()
    local = local.to(ctx.dist.device, torch.int64, non_blocking=True)
    with ctx.clock.collective("window item count"):
        if defer and isinstance(ctx.parallel, SettlesCount):
            return ctx.parallel.pending_item_count(local)
        return ctx.parallel.global_item_count(local)


def clip_gradients(ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Total grad norm before clipping, and a 0/1 flag for non-finite gradients.

    A non-finite gradient anywhere makes the total norm inf or nan, so one reduction serves
    both clipping and the skip decision, on the device. The parallelism computes the norm
    over every rank's gradients and clips each rank's own values.
    """
    params = ctx.trainable_parameters()
    norm = ctx.parallel.grad_norm(params)
    if ctx.clip_grad_norm is not None:
        ctx.parallel.clip_(params, ctx.clip_grad_norm, norm)
    norm = norm.detach()
    return norm, (~torch.isfinite(norm)).to(torch.float32)


class AccumulateStep:
    """The default step strategy: exact micro-batch gradient accumulation.

    `guard` wraps the window's moments (the null guard: each runs as it is); the arithmetic
    is the same with any guard."""

    def __init__(self, guard: StepGuard | None = None) -> None:
        self.guard = guard or Unguarded()

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        guard = self.guard
        ctx.optimizer.zero_grad(set_to_none=True)
        guard.start(ctx)
        window = [ctx.parallel.local_batch(b) for b in window]
        prepares = isinstance(ctx.task, PreparesWindow)  # e.g. MoE balancing's routing pass
        global_count = count_window(ctx, window, defer=not prepares)
        window_guard = guard.window(ctx) or NO_GUARD
        if prepares:
            ctx.task.prepare_window(ctx, window, global_count, window_guard)
        loss_sum = ctx.parallel.backward_window(ctx, window, global_count, window_guard)
        grad_norm, found_inf, lr = guard.update(ctx, lambda: apply_update(ctx))
        result = StepResult(loss_sum, global_count, grad_norm, found_inf, lr)
        return guard.finish(ctx, lambda: count_step(ctx, result))


def finish_step(ctx: StepContext, loss_sum: torch.Tensor, global_count: torch.Tensor) -> StepResult:
    """Unscale, clip, skip-or-update, advance the schedule and the step count: the tail every
    strategy shares. It fires the callbacks' hooks of these moments, so no loop has to."""
    grad_norm, found_inf, lr = apply_update(ctx)
    return count_step(ctx, StepResult(loss_sum, global_count, grad_norm, found_inf, lr))


def apply_update(ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The first half of `finish_step`: unscale, clip and update (or skip); the gradient
    norm, the non-finite flag and the learning rate used."""
    ctx.clock.switch("optimizer")
    # Tensor parallel: DTensor shards and whole parameters side by side in one optimizer.
    with ctx.parallel.optimizer_context():
        ctx.precision.unscale_(ctx.optimizer)
    # Ranks holding different parameters: one overflow skips them all.
    ctx.parallel.agree_found_inf(ctx.precision, ctx.optimizer)
    ctx.callbacks.after_backward(ctx)
    grad_norm, found_inf = clip_gradients(ctx)
    ctx.callbacks.before_optimizer_step(ctx)
    lr = float(ctx.optimizer.param_groups[0]["lr"])
    with ctx.parallel.optimizer_context():
        ctx.precision.optimizer_step(ctx.optimizer, found_inf)
    return grad_norm, found_inf, lr


def count_step(ctx: StepContext, result: StepResult) -> StepResult:
    """The second half of `finish_step`: advance the schedule and the step count, then the
    callbacks of a finished step."""
    if ctx.scheduler is not None:
        ctx.scheduler.step()
    ctx.step += 1
    ctx.callbacks.after_optimizer_step(ctx, ctx.step)
    return result
