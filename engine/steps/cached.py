"""The cached two-pass step: exact gradients for losses of the whole window.

For a task whose loss compares every sample of the global batch with every other
(engine/window_task.py: in-batch negatives), one optimizer step runs, in order:

    zero grads -> count the window's loss items (one all-reduce) ->
    pass 1: every micro-batch forward without gradients, its random state recorded ->
    gather the representations over data-parallel ranks (autograd-aware) ->
    the window's loss, a chunk of rows at a time, backward to the representations and the
    task's own parameters only (summed over ranks once) ->
    pass 2: every micro-batch forward again with gradients, its random state replayed (same
    dropout masks), backward of its rows of the cached gradient (no_sync but the last) ->
    unscale -> clip -> finite check -> optimizer step -> scheduler step

Pass 1 keeps no activations, only the representations (samples x dim); the loss holds one
chunk of rows x samples logits at a time; pass 2 holds one micro-batch's activations. So the
memory is a micro-batch's while the gradient is the whole batch's: the price is the second
forward. It is GradCache's method (Gao et al., 2021), with what its users found missing: the
random state replayed (dropout), the gather's gradient summed over ranks, the task's own
parameters (a temperature) given their gradient once per window, and one gradient sync per
window.

Scaling: each rank computes the loss terms of its own samples against the whole window, so
the window's loss is the sum over ranks divided by the global item count (as the accumulation
step's). The representations' gradient is multiplied by `ctx.grad_sync_divisor` before pass 2
(DDP averages what it reduces); the task's parameters, which data parallelism leaves alone,
are summed over ranks by hand. Under fp16 everything is scaled by the GradScaler's scale, and
unscaled together before clipping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import unwrap
from engine.numerics.gather import gather_rows
from engine.parallel.base import NO_GUARD, WindowGuard, all_reduce_flat
from engine.step import Batch, StepContext, StepResult
from engine.steps.accumulate import StepGuard, Unguarded, apply_update, count_step, count_window
from engine.tasks import TaskOutputError
from engine.window_task import WindowTask, loss_parameters, needs_window_task

_HALF = (torch.float16, torch.bfloat16)


class CachedStep:
    """The step strategy of tasks whose loss is of the whole window (`WindowTask`).

    Args:
        chunk_size: rows of the window's loss computed (and back-propagated) at a time: a
            contrastive loss then holds `chunk_size` x window-size logits at most.
        guard: wraps the step's moments (engine/steps/oom.py's out-of-memory guard under
            `train.micro_batch_size=auto`); the arithmetic is the same with any guard.
    """

    def __init__(self, chunk_size: int = 1024, guard: StepGuard | None = None) -> None:
        if type(chunk_size) is not int or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive number, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.guard = guard or Unguarded()

    def guarded(self, guard: StepGuard) -> CachedStep:
        """The same step under `guard`."""
        return CachedStep(self.chunk_size, guard)

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        task = window_task(ctx)
        guard = self.guard
        ctx.optimizer.zero_grad(set_to_none=True)
        guard.start(ctx)
        window = [ctx.parallel.local_batch(b) for b in window]
        global_count = count_window(ctx, window)
        window_guard = guard.window(ctx) or NO_GUARD
        reps, replays = represent_window(ctx, task, window, window_guard)  # pass 1
        buffers = ModuleBuffers(ctx.model)  # BatchNorm statistics: pass 1 updated them
        loss = window_guard.micro_batch(
            len(window) - 1,
            len(window),
            lambda: window_gradient(ctx, task, reps, global_count, self.chunk_size),
        )
        backward_window(ctx, task, window, replays, loss.grads, global_count, window_guard)
        buffers.restore()  # once per micro-batch, as with step=accumulate
        grad_norm, found_inf, lr = guard.update(ctx, lambda: apply_update(ctx))
        loss_sum = loss.loss_sum if ctx.parallel.reports else torch.zeros_like(loss.loss_sum)
        result = StepResult(loss_sum, global_count, grad_norm, found_inf, lr)
        return guard.finish(ctx, lambda: count_step(ctx, result))


def window_task(ctx: StepContext) -> WindowTask:
    if not isinstance(ctx.task, WindowTask):
        raise TypeError(needs_window_task(type(ctx.task).__name__))
    return ctx.task


@dataclass
class RandomState:
    """The CPU generator's state and each CUDA generator's the forward may draw from; `rows`:
    how many representations the forward from it gave (pass 1)."""

    cpu: torch.Tensor
    cuda: list[tuple[torch.device, torch.Tensor]]
    rows: int = 0

    @classmethod
    def capture(cls, devices: Sequence[torch.device]) -> RandomState:
        return cls(torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices])

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)


class ModuleBuffers:
    """The model's buffers (BatchNorm's running statistics) as they are now, put back after
    pass 2, whose forwards would update them a second time for the same micro-batches."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = list(unwrap(model).buffers())
        self.values = [b.detach().clone() for b in self.buffers]

    def restore(self) -> None:
        with torch.no_grad():
            for b, v in zip(self.buffers, self.values):
                b.copy_(v)


def cuda_devices(ctx: StepContext, window: Sequence[Batch]) -> list[torch.device]:
    """The CUDA devices a micro-batch's forward draws random numbers on: this rank's and any
    its batches sit on."""
    devices = {ctx.dist.device} if ctx.dist.device.type == "cuda" else set()

    def visit(x: object) -> None:
        if isinstance(x, torch.Tensor) and x.is_cuda:
            devices.add(x.device)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, list | tuple):
            for v in x:
                visit(v)

    for batch in window:
        visit(batch)
    return sorted(devices, key=str)


def represent(ctx: StepContext, task: WindowTask, batch: Batch) -> torch.Tensor:
    """The task's representations of `batch` under the run's autocast, at least fp32."""
    with ctx.precision.autocast():
        reps = task.represent(ctx.model, batch)
    if not isinstance(reps, torch.Tensor) or not reps.is_floating_point() or reps.dim() < 1:
        kind = type(reps).__name__
        if isinstance(reps, torch.Tensor):
            kind = f"{reps.dtype} tensor of shape {tuple(reps.shape)}"
        raise TaskOutputError(
            f"{type(task).__name__}.represent(model, batch) must return a float tensor with one "
            f"row per sample, (samples, ...); it returned a {kind}"
        )
    return reps.float() if reps.dtype in _HALF else reps


def represent_window(
    ctx: StepContext, task: WindowTask, window: Sequence[Batch], guard: WindowGuard
) -> tuple[torch.Tensor, list[RandomState]]:
    """Pass 1: every micro-batch's representations without gradients, concatenated (rows of
    this rank's window, in order), and the random state each forward started from."""
    devices = cuda_devices(ctx, window)
    replays, reps = [], []
    for i, batch in enumerate(window):
        state = RandomState.capture(devices)

        def forward(batch: Batch = batch) -> torch.Tensor:
            with torch.no_grad():
                return represent(ctx, task, batch)

        reps.append(guard.micro_batch(i, len(window), forward))
        state.rows = reps[-1].shape[0]
        replays.append(state)
    return torch.cat(reps), replays


@dataclass(frozen=True)
class WindowGradient:
    """The window's loss and its gradient with respect to this rank's representations."""

    loss_sum: torch.Tensor  # this rank's rows' summed loss, detached
    # (rows of this rank's window, ...), in order, scaled for the data-parallel wrapper's
    # averaging and the loss scale
    grads: torch.Tensor


def window_gradient(
    ctx: StepContext,
    task: WindowTask,
    reps: torch.Tensor,
    global_count: torch.Tensor,
    chunk_size: int,
) -> WindowGradient:
    """The window's loss over this rank's rows of `reps`, `chunk_size` rows at a time, and its
    gradient with respect to them (the task's own parameters get theirs, summed over ranks)."""
    count = global_count.clamp(min=1)  # an all-padding window
    mine = reps.detach().requires_grad_()
    with ctx.clock.collective("representations gathered"):
        whole, offset = gather_rows(mine, ctx.parallel.dp_group)  # (window, ...)
    # The loss's graph ends at a leaf copy of the gathered rows: each chunk's graph is freed
    # by its own backward, and the gather's backward (a collective) runs once.
    cut = whole.detach().requires_grad_()
    loss_sum = torch.zeros((), dtype=cut.dtype, device=cut.device)
    for start in range(offset, offset + mine.shape[0], chunk_size):
        rows = slice(start, min(start + chunk_size, offset + mine.shape[0]))
        part = task.window_loss(cut, rows)
        if not isinstance(part, torch.Tensor) or part.dim() != 0:
            raise TaskOutputError(
                f"{type(task).__name__}.window_loss(reps, rows) must return the summed loss of "
                f"those rows as a scalar tensor; it returned {type(part).__name__}"
                + (f" of shape {tuple(part.shape)}" if isinstance(part, torch.Tensor) else "")
            )
        part = part.float() if part.dtype in _HALF else part
        if part.requires_grad:
            ctx.precision.backward(part / count.to(part.dtype))
        loss_sum = loss_sum + part.detach()
    grad = cut.grad if cut.grad is not None else torch.zeros_like(cut)
    with ctx.clock.collective("representation gradients summed"):
        whole.backward(grad)  # summed over ranks: this rank's rows of the whole gradient
        sync_loss_parameters(ctx)
    assert mine.grad is not None
    return WindowGradient(loss_sum, mine.grad * ctx.grad_sync_divisor)


def sync_loss_parameters(ctx: StepContext) -> None:
    """The task's own parameters got each rank's share of their gradient (its rows' terms):
    sum it over data-parallel ranks, once per window (no wrapper reduces them)."""
    params = [p for _, p in loss_parameters(unwrap(ctx.model)) if p.requires_grad]
    if not params or ctx.parallel.dp_size == 1:
        return
    for p in params:
        if p.grad is None:  # this rank had no rows: its share is zero
            p.grad = torch.zeros_like(p)
    all_reduce_flat([p.grad for p in params], ctx.parallel.dp_group)


def backward_window(
    ctx: StepContext,
    task: WindowTask,
    window: Sequence[Batch],
    replays: list[RandomState],
    grads: torch.Tensor,
    global_count: torch.Tensor,
    guard: WindowGuard,
) -> None:
    """Pass 2: each micro-batch forward again from its recorded random state, backward of its
    rows of the cached gradient; gradients synchronized in the last micro-batch only (or
    every one with `sync_every_micro_batch`). The random state after the step is the one pass
    2 started from, as if it had not run."""
    after = RandomState.capture([d for d, _ in replays[0].cuda]) if replays else None
    parts = torch.split(grads, [r.rows for r in replays])
    last = len(window) - 1
    for i, batch in enumerate(window):
        sync = i == last or ctx.sync_every_micro_batch
        with guard.gradient_sync(ctx, sync), ctx.clock.span(f"micro-batch {i + 1}/{len(window)}"):
            run = replay(ctx, task, batch, replays[i], parts[i], synced=sync)
            guard.micro_batch(i, len(window), run)
        ctx.callbacks.after_micro_batch(ctx, batch, global_count, i == last)
    guard.after_window(ctx)
    ctx.parallel.sync_gradients(ctx.trainable_parameters())
    if after is not None:
        after.restore()


def replay(
    ctx: StepContext,
    task: WindowTask,
    batch: Batch,
    state: RandomState,
    grad: torch.Tensor,
    synced: bool = False,
) -> Callable[[], torch.Tensor]:
    """Pass 2 of one micro-batch; `synced`: its gradients are communicated inside backward
    (the wait is timed as `sync`, engine/timing.py)."""

    def run() -> torch.Tensor:
        state.restore()
        reps = represent(ctx, task, batch)
        if reps.shape != grad.shape:
            raise TaskOutputError(
                f"{type(task).__name__}.represent gave {tuple(reps.shape)} for a micro-batch "
                f"whose first pass gave {tuple(grad.shape)}: it must depend on the model, the "
                "batch and the random state only"
            )
        if synced:
            ctx.clock.wait_after_backward(reps)
        reps.backward(grad.to(reps.dtype))
        if synced:
            ctx.clock.after_backward()
        return reps.detach().sum()

    return run
