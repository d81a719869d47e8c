"""`train.micro_batch_size=auto`: the largest micro-batch that fits, agreed by every rank.

Candidates are the divisors of the per-rank batch (global / world), so the global batch and
the loss normalization stay exactly what the user set: cumulus's split invariance makes the
trajectory independent of the micro-batch. Before training, `probe` tries the whole per-rank
batch, then bisects the divisors downward; each try runs forward, backward and an optimizer
step on the worst case the data produces (its longest sample, repeated), with all ranks in
lockstep (engine/steps/oom.py), and is undone (parameters, buffers, optimizer state, RNG), so the
run that follows equals one started with that size by hand.

During training `step_window` catches an out-of-memory error agreed by every rank (in a
micro-batch's forward or backward, clipping or the optimizer step), rolls the window back to
its start (gradients, module buffers, RNG, a half-applied update with the optimizer state and
loss scale, the sums a task records beside its loss (task=dpo's rewards); the data position
by rebuilding the loader at the same step), halves the
micro-batch to the next divisor and redoes the window.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import default_collate

from engine.callbacks import Callback
from engine.distributed import unwrap
from engine.parallel.base import local_values
from engine.rng import rng_state, set_rng_state
from engine.step import StepContext
from engine.steps.accumulate import AccumulateStep
from engine.steps.cached import CachedStep, represent
from engine.steps.oom import Agreement, OomGuard, OutOfMemoryAgreed, reset_window
from engine.window_task import WindowTask
from trainer.config.errors import ConfigError, UserError
from trainer.data.checks import next_window
from trainer.run.batch_plan import AUTO, BatchPlan

# The worst case is looked for among this many samples from the start of the training set.
WORST_CASE_SAMPLES = 256

NO_FIT_HINTS = (
    "Try dist.strategy=fsdp (shards parameters, gradients and optimizer state over ranks), "
    "model.activation_checkpointing=true (recomputes activations in backward), "
    "train.precision=bf16 (half the activation memory), a shorter sequence or a smaller model."
)


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def refusal(ctx: StepContext, step_fn: Any) -> str | None:
    """Why `auto` cannot run with this config (one sentence), or None."""
    if ctx.dist.distributed and ctx.parallel.shards_parameters:
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "reset_iter_state"):  # a torch version
            return (
                f"dist.strategy=fsdp on several ranks needs FSDPModule.reset_iter_state (torch "
                f"2.13 or later; this is {torch.__version__}) to recover from an out-of-memory "
                "error; set train.micro_batch_size to a number, or use dist.strategy=ddp"
            )
    if type(step_fn) not in (AccumulateStep, CachedStep):  # whose windows auto redoes
        return (
            f"step {type(step_fn).__name__} is not supported (auto redoes windows of the "
            "default step and step=cached only); use step=accumulate or set "
            "train.micro_batch_size to a number"
        )
    per_micro = [name for name, cb in ctx.callbacks.named.items() if cb.per_micro_batch]
    if per_micro:
        return (
            f"callbacks {per_micro} observe every micro-batch, so their statistics would "
            "depend on the chosen size and a redone window would count twice; remove them or "
            "set train.micro_batch_size to a number"
        )
    return None


class AutoMicroBatch(Callback):
    """The chosen size: recorded as `train/micro_batch_size`, saved in checkpoints; on resume
    the size probed on this machine stays and a different saved one is reported."""

    state_optional = True  # switching a run to auto on resume is fine

    def __init__(self, size: int, is_main: bool) -> None:
        self.size, self.is_main = size, is_main

    def metrics(self) -> dict[str, Any]:
        return {"train/micro_batch_size": self.size}

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = int(state["micro_batch_size"])
        if saved != self.size and self.is_main:
            print(
                f"micro_batch_size=auto: the checkpoint was trained with micro-batch {saved}, "
                f"the probe on this machine chose {self.size} (the trajectory does not "
                "depend on it)",
                flush=True,
            )


def setup_auto(
    cfg: Any, ctx: StepContext, data: Any, step_fn: Any, plan: BatchPlan
) -> tuple[Any, BatchPlan, Any]:
    """With `train.micro_batch_size=auto`: probe the size and return the step under the
    out-of-memory guard, the plan with that micro-batch and the window function that redoes
    a window smaller; otherwise `(step_fn, plan, None)`."""
    if cfg.train.micro_batch_size != AUTO:
        return step_fn, plan, None
    reason = refusal(ctx, step_fn)
    if reason is not None:
        raise ConfigError("train.micro_batch_size", f"auto: {reason}")
    per_rank = plan.per_rank
    agreement = Agreement(ctx.dist, timedelta(seconds=cfg.dist.timeout_s))
    ctx.parallel.guard_collectives(ctx.model, agreement)
    size, tried = probe(ctx, data, per_rank, agreement)
    plan = plan.with_micro(size)
    ctx.callbacks.named["auto_micro_batch"] = AutoMicroBatch(size, ctx.dist.is_main)
    if ctx.dist.is_main:
        print(
            f"micro_batch_size=auto: chose {size} of the divisors of the per-rank batch "
            f"{per_rank} (tried {', '.join(tried)}); accumulation {plan.accum}",
            flush=True,
        )
    guard = OomGuard(agreement)
    # step=cached: the size is pass 2's micro-batch (pass 1 runs the same ones, without
    # activations kept).
    guarded = step_fn.guarded(guard) if isinstance(step_fn, CachedStep) else None
    return guarded or AccumulateStep(guard=guard), plan, step_window


def _size(sample: Any) -> int:
    """How much a sample holds: its tensors' elements (lists: their length), all fields."""
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if isinstance(sample, dict):
        return sum(_size(v) for v in sample.values())
    if isinstance(sample, list | tuple):
        inner = [_size(v) for v in sample]
        return sum(inner) if any(inner) else len(sample)
    return 0


def worst_case_sample(dataset: Any) -> Any:
    """The largest of the first `WORST_CASE_SAMPLES` samples: padded micro-batches of it
    are the most memory any micro-batch of that size needs."""
    n = min(len(dataset), WORST_CASE_SAMPLES)
    return max((dataset[i] for i in range(n)), key=_size)


class ProbeUndo:
    """Parameters, buffers and optimizer state (copied to the host) and every RNG, taken
    before the probe and put back after each try."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        module = unwrap(ctx.model)
        # This rank's values (FSDP2 shards its parameters: DTensors), restored in place.
        with torch.no_grad():
            self.tensors = [local_values(t) for t in [*module.parameters(), *module.buffers()]]
            self.values = [t.detach().to("cpu", copy=True) for t in self.tensors]
        self.optimizer = copy.deepcopy(ctx.optimizer.state_dict())
        self.rng = rng_state()

    def restore(self) -> None:
        with torch.no_grad():
            for t, v in zip(self.tensors, self.values, strict=True):
                t.copy_(v)
        self.ctx.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        self.ctx.optimizer.zero_grad(set_to_none=True)
        set_rng_state(self.rng)


def fits(ctx: StepContext, batch: Any, agreement: Agreement) -> bool:
    """Collective: forward, backward and an optimizer step of `batch` ran on every rank.

    fp16 runs back-propagate without the GradScaler (scale 1: same memory, and no skipped
    step hides the optimizer's allocation)."""

    def step() -> None:
        with ctx.parallel.guarded_sync(ctx.model, True):
            if isinstance(ctx.task, WindowTask):  # step=cached's pass 2 of one micro-batch
                loss = represent(ctx, ctx.task, batch).sum()
            else:
                with ctx.precision.autocast():
                    loss = ctx.task.loss_sum(ctx.model, batch)
            loss.float().backward()
        del loss
        ctx.optimizer.step()

    _, failed = agreement.attempt(step)
    reset_window(ctx)
    return failed == 0


def probe(
    ctx: StepContext, data: Any, per_rank: int, agreement: Agreement
) -> tuple[int, list[str]]:
    """The largest divisor of `per_rank` that fits: the whole batch first, then bisection."""
    from trainer.data.loader import to_device

    candidates = divisors(per_rank)
    sample = worst_case_sample(data.train)
    collate = data.collate_fn or default_collate
    undo = ProbeUndo(ctx)
    tried: list[str] = []

    def attempt(size: int) -> bool:
        try:
            ok = fits(ctx, to_device(collate([sample] * size), ctx.dist.device), agreement)
        finally:
            undo.restore()
        tried.append(f"{size} {'fits' if ok else 'out of memory'}")
        return ok

    if attempt(candidates[-1]):
        return candidates[-1], tried
    fit, fail = -1, len(candidates) - 1  # indices: largest known to fit, smallest known not to
    while fail - fit > 1:
        mid = (fit + fail) // 2
        if attempt(candidates[mid]):
            fit = mid
        else:
            fail = mid
    if fit < 0:
        raise UserError(
            f"train.micro_batch_size=auto: not even a micro-batch of 1 sample fits in memory "
            f"(forward, backward and optimizer step of the longest sample). {NO_FIT_HINTS}",
            all_ranks=True,
        )
    return candidates[fit], tried


class WindowStart:
    """What a window changes before its optimizer step, taken at its start: persistent module
    buffers (BatchNorm statistics) and every RNG. Gradients are freed, not restored: the step
    zeroes them first; the data position is the step count. Non-persistent buffers (causal
    masks, rotary caches) are derived state, as for an exact resume, and are not copied."""

    def __init__(self, ctx: StepContext) -> None:
        model = unwrap(ctx.model)
        persistent = model.state_dict(keep_vars=True)
        self.buffers = [b for name, b in model.named_buffers() if name in persistent]
        self.values = [b.detach().clone() for b in self.buffers]
        self.rng = rng_state()

    def restore(self) -> None:
        with torch.no_grad():
            for b, v in zip(self.buffers, self.values, strict=True):
                b.copy_(v)
        set_rng_state(self.rng)


def step_window(run: Any, window: Any, windows: Iterator[Any]) -> tuple[Any, Iterator[Any]]:
    """One optimizer step on `window`, taken from `windows`: an out-of-memory error agreed by
    every rank rolls the window back, halves the micro-batch (to the next divisor) and redoes
    the same window; returns the result and the (possibly rebuilt) window iterator."""
    while True:
        start = WindowStart(run.ctx)
        try:
            return run.step_fn(run.ctx, window), windows
        except OutOfMemoryAgreed as oom:
            start.restore()
            run.ctx.item_sums.take()  # the failed window's forwards: no step's
            size = shrink(run, oom)
        del window
        windows.close()
        windows = run.batches.windows(run.step)
        window = next_window(windows, run.batches, run.settings.data_target, run.step + 1)
        if run.dist.is_main:
            print(
                f"micro_batch_size=auto: redoing step {run.step + 1} with micro-batch {size} "
                f"x accumulation {run.batches.plan.accum}",
                file=sys.stderr,
                flush=True,
            )


def shrink(run: Any, oom: OutOfMemoryAgreed) -> int:
    """The next smaller size (the largest divisor at most half the current one), set in the
    batches, the config and the recorded value; a clear error when nothing is left."""
    batches, info = run.batches, run.dist
    plan = batches.plan
    smaller = [d for d in divisors(plan.per_rank) if d <= plan.micro // 2]
    if not oom.retry or not smaller:
        what = (
            f"the {oom.where} (after the step was counted: not redone)"
            if not oom.retry
            else f"the {oom.where} with micro-batches of 1 sample"
        )
        raise UserError(
            f"train.micro_batch_size=auto: out of memory at step {run.step + 1} in {what}, "
            f"on {oom.ranks} rank(s). {NO_FIT_HINTS}",
            all_ranks=True,
        )
    size = smaller[-1]
    batches.plan = plan.with_micro(size)
    recorded = run.ctx.callbacks.named.get("auto_micro_batch")
    if isinstance(recorded, AutoMicroBatch):
        recorded.size = size
    if info.is_main:
        print(
            f"micro_batch_size=auto: {oom} at step {run.step + 1}; shrinking the micro-batch "
            f"to {size}",
            file=sys.stderr,
            flush=True,
        )
    return size
