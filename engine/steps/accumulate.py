"""The exact accumulation step.

One optimizer step from a window of micro-batches, in textbook order:

    zero grads -> count loss items of the window (one all-reduce) -> per micro-batch:
    forward + backward of loss_sum * divisor / global_count (no_sync but the last) ->
    unscale -> clip -> finite check -> optimizer step -> scheduler step

Dividing each micro-batch by `grad_accum_steps` is wrong when micro-batches hold different
numbers of valid tokens; dividing every micro-batch of every rank by the *global* count makes
the accumulated gradient equal to the gradient of the whole global batch's mean loss. DDP then
averages over ranks, hence the factor `ctx.grad_sync_divisor` (the world size under DDP; 1
under FSDP as wrapped here, which sums).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.distributed import all_reduce_sum
from engine.parallel import local_values, whole_tensor
from engine.step import Batch, StepContext, StepResult, item_count

_HALF = (torch.float16, torch.bfloat16)


def count_window(ctx: StepContext, window: Sequence[Batch]) -> torch.Tensor:
    """Loss items of the whole window over all data-parallel ranks: one all-reduce, before
    any forward. (Pipeline stages of one replica read the same window: counted once.)"""
    local = torch.stack([item_count(ctx.task, b) for b in window]).sum()
    return all_reduce_sum(local.to(ctx.dist.device, torch.int64), ctx.dist, ctx.parallel.dp_group)


def backward_window(
    ctx: StepContext, window: Sequence[Batch], global_count: torch.Tensor
) -> torch.Tensor:
    """Forward + backward every micro-batch; gradients accumulate in `.grad`.

    Returns this rank's loss sum over the window (detached; fp32, or the loss's own precision
    when higher). Each graph is freed by its own backward; only the detached sum survives.
    """
    pipelined = getattr(ctx.parallel, "backward_window", None)
    if pipelined is not None:  # the window is the pipeline's schedule (engine/parallel/pipeline/)
        return pipelined(ctx, window, global_count)  # no per-micro-batch hooks (refused)
    # DDP divides the reduced gradient by world_size; multiplying by that divisor here undoes
    # it, so the result is the global mean. Guard against an all-padding window (count 0).
    count = global_count.clamp(min=1)
    loss_sum: torch.Tensor | None = None
    last = len(window) - 1
    for i, batch in enumerate(window):
        with ctx.parallel.gradient_sync(ctx.model, enabled=i == last or ctx.sync_every_micro_batch):
            micro_sum = micro_backward(ctx, batch, count)
        ctx.callbacks.after_micro_batch(ctx, batch, global_count, i == last)
        loss_sum = micro_sum if loss_sum is None else loss_sum + micro_sum
    sync = getattr(ctx.parallel, "sync_gradients", None)
    if sync is not None:  # a parallelism that sums gradients itself, after the window
        sync(ctx.trainable_parameters())
    if not getattr(ctx.parallel, "reports", True):  # tensor parallel: one rank of a group
        loss_sum = torch.zeros_like(loss_sum)
    return loss_sum


def micro_backward(ctx: StepContext, batch: Batch, count: torch.Tensor) -> torch.Tensor:
    """Forward + backward of one micro-batch, scaled by the window's global `count` (clamped
    to at least 1); returns its loss sum, detached (the graph goes with this frame)."""
    with ctx.precision.autocast():
        micro_sum = ctx.task.loss_sum(ctx.model, batch)
    # Scale in the loss's own precision (at least fp32): float64 runs stay float64.
    micro_sum = micro_sum.float() if micro_sum.dtype in _HALF else micro_sum
    ctx.precision.backward(micro_sum * (ctx.grad_sync_divisor / count.to(micro_sum.dtype)))
    return micro_sum.detach()


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all `tensors` together, on the device (also for sharded DTensors)."""
    return whole_tensor(_norm(tensors))


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    # Squares summed in float64: finite gradients up to ~1e150 never overflow to an inf norm
    # (fp32 overflows from ~1e19), so "inf norm" means a gradient really is non-finite.
    per_tensor = torch._foreach_norm(tensors, 2.0, dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack(per_tensor)).float()


def clip_gradients(
    params: list[nn.Parameter],
    max_norm: float | None,
    norm_of: Callable[[list[nn.Parameter]], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Total grad norm before clipping, and a 0/1 flag for non-finite gradients.

    A non-finite gradient anywhere makes the total norm inf or nan, so one reduction serves
    both clipping and the skip decision, on the device. `norm_of` computes the total norm
    where ranks hold different parameters (pipeline stages).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and norm_of is None:
        raise RuntimeError("no parameter received a gradient: is the loss connected to the model?")
    norm = _norm(grads) if norm_of is None else norm_of(params)
    if max_norm is not None and norm_of is not None:
        # The norm is the total over ranks holding different parameters; the gradients may
        # mix DTensor shards and whole tensors: scale each rank's own values in place.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_([local_values(g) for g in grads], coef)
    elif max_norm is not None:  # clip with the (possibly sharded) norm the gradients live with
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    norm = whole_tensor(norm).detach()
    return norm, (~torch.isfinite(norm)).to(torch.float32)


class AccumulateStep:
    """The default step strategy: exact micro-batch gradient accumulation."""

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        ctx.optimizer.zero_grad(set_to_none=True)
        global_count = count_window(ctx, window)
        loss_sum = backward_window(ctx, window, global_count)
        return finish_step(ctx, loss_sum, global_count)


def finish_step(ctx: StepContext, loss_sum: torch.Tensor, global_count: torch.Tensor) -> StepResult:
    """Unscale, clip, skip-or-update, advance the schedule and the step count: the tail every
    strategy shares. It fires the callbacks' hooks of these moments, so no loop has to."""
    grad_norm, found_inf, lr = apply_update(ctx)
    return count_step(ctx, StepResult(loss_sum, global_count, grad_norm, found_inf, lr))


def apply_update(ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The first half of `finish_step`: unscale, clip and update (or skip); the gradient
    norm, the non-finite flag and the learning rate used."""
    # Tensor parallel: DTensor shards and whole parameters side by side in one optimizer.
    mixed = getattr(ctx.parallel, "mixed_tensors", contextlib.nullcontext)
    with mixed():
        ctx.precision.unscale_(ctx.optimizer)
    agree = getattr(ctx.parallel, "agree_found_inf", None)
    if agree is not None:  # stages hold different parameters: one overflow skips them all
        agree(ctx.precision, ctx.optimizer)
    ctx.callbacks.after_backward(ctx)
    norm_of = getattr(ctx.parallel, "grad_norm", None)
    grad_norm, found_inf = clip_gradients(ctx.trainable_parameters(), ctx.clip_grad_norm, norm_of)
    ctx.callbacks.before_optimizer_step(ctx)
    lr = float(ctx.optimizer.param_groups[0]["lr"])
    with mixed():
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
