"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018), from the window.

An accumulation window already computes gradients at two batch sizes: each micro-batch's
(the small batch, b_i loss items) and the window's global one (the big batch, B items). With
E|G_b|² = |G|² + tr(Σ)/b for a batch of b items, their appendix A.1 gives unbiased estimators

    |G|²  ≈ (B |G_B|² − b |G_b|²) / (B − b)
    tr(Σ) ≈ (|G_b|² − |G_B|²) / (1/b − 1/B)

Here |G_b|² is the mean over every micro-batch of every rank and 1/b the mean of their 1/b_i
(so micro-batches of different sizes stay unbiased). Nothing is recomputed: after each
micro-batch's backward the difference between the accumulated gradient and a copy of it from
before is that micro-batch's gradient, times global_count / (divisor × b_i) because each
micro-batch backpropagates `loss_sum × divisor / global_count`. Under DDP the last
micro-batch is reduced inside its backward, so a communication hook reads this rank's
gradient from the bucket just before the all-reduce (a free small batch), and the window's
global gradient is `.grad` after it. Cost per micro-batch: one copy and one norm of the
gradients, and per window one all-reduce of three numbers; memory: one copy of the gradients.

B_simple is in loss items (tokens for a language model). It is the global batch at which
noise and signal in a step are about equal: well below it, a larger batch speeds training
nearly linearly; well above it, more items per step are mostly wasted compute.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.callbacks import Callback
from engine.distributed import all_reduce_sum
from engine.step import StepContext, item_count


def _sq_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all `tensors`, summed in float64 (each tensor's norm in its own dtype:
    no float64 copy of the gradients)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(tensors, 2.0)).double().square().sum()


class NoiseScale(Callback):
    """Records `train/noise_scale` (B_simple of the last window, in loss items) and
    `train/noise_scale_ema`: the ratio of bias-corrected exponential moving averages (decay
    `decay` per optimizer step) of the tr(Σ) and |G|² estimates. Averaging numerator and
    denominator separately, as McCandlish et al. do, keeps the smoothed ratio from the bias
    a mean of noisy ratios has. Also `train/noise_grad_sq` and `train/noise_trace` (the two
    estimates of the last window, per loss item).

    Needs at least two small batches' worth of difference: with one micro-batch on one rank
    the small and big batches coincide and nothing is recorded.
    """

    def __init__(self, decay: float = 0.95) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        # .grad after the previous micro-batch (zeros where it was None), in buffers allocated
        # once: subtracting in place costs no allocation. `_started`: they hold this window's.
        self._prev: dict[int, torch.Tensor] = {}
        self._started = False
        self._hooked: torch.Tensor | None = None  # |delta|² the comm hook saw (DDP, synced)
        self._params: list[nn.Parameter] = []
        self._small = torch.zeros(3, dtype=torch.float64)  # Σ|g_i|², Σ 1/b_i, count
        self._last: dict[str, torch.Tensor] = {}
        self._ema = torch.zeros(2, dtype=torch.float64)  # grad_sq, trace
        self._ema_steps = torch.zeros((), dtype=torch.float64)  # windows averaged in
        self._count = torch.ones((), dtype=torch.float64)  # loss items of the last window

    def setup(self, ctx: StepContext) -> None:
        if ctx.parallel.shards_parameters:
            raise ValueError(
                "callbacks.noise_scale reads each micro-batch's full gradient, which FSDP "
                "shards away; use dist.strategy=ddp (or one process) to measure the noise scale"
            )
        device = ctx.dist.device
        self._small = self._small.to(device)
        self._ema = self._ema.to(device)
        self._ema_steps = self._ema_steps.to(device)
        model = ctx.model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model.register_comm_hook(state=None, hook=self._comm_hook)

    def _comm_hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """This rank's gradient in the bucket, before the all-reduce: the last (synchronized)
        micro-batch's own part is it minus the previous accumulation. Then DDP's own
        all-reduce. Unannotated: DDP rejects annotations that are not GradBucket / Future
        objects, and here they would be strings (`from __future__ import annotations`)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        deltas = list(bucket.gradients())
        if self._started:  # prev - g: the negated local delta, in place (prev is not read again
            # before the next micro-batch overwrites it)
            prev = self._prev
            deltas = [
                prev[id(p)].sub_(g) if id(p) in prev else g
                for p, g in zip(bucket.parameters(), deltas)
            ]
        sq = _sq_norm(deltas)
        self._hooked = sq if self._hooked is None else self._hooked + sq
        return allreduce_hook(state, bucket)

    def on_after_micro_batch(
        self, ctx: StepContext, batch: Any, global_count: torch.Tensor, last: bool
    ) -> None:
        if not self._started:  # first micro-batch of a window
            self._params = [p for p in ctx.model.parameters() if p.requires_grad]
            self._small.zero_()
        pairs = [(p.grad, self._buffer(p)) for p in self._params if p.grad is not None]
        grads = [g for g, _ in pairs]
        with torch.no_grad():
            if self._hooked is not None:  # synchronized: the comm hook saw the local part
                delta_sq, self._hooked = self._hooked, None
            elif not self._started:
                delta_sq = _sq_norm(grads)
            else:  # prev - g in place: its norm is the micro-batch's delta's
                prev = [b for _, b in pairs]
                torch._foreach_sub_(prev, grads)
                delta_sq = _sq_norm(prev)
            count = global_count.to(delta_sq.device, torch.float64).clamp(min=1)
            items = item_count(ctx.task, batch).to(delta_sq.device, torch.float64)
            has_items = (items > 0).to(torch.float64)  # an all-padding micro-batch adds nothing
            items = items.clamp(min=1)
            scale = self._loss_scale(ctx)
            # delta = (gradient of the micro-batch's loss sum) x divisor / global_count, so its
            # mean gradient is delta x global_count / (divisor x items), loss scale removed.
            factor = count / (ctx.grad_sync_divisor * items * scale)
            self._small += has_items * torch.stack(
                [delta_sq * factor.square(), 1.0 / items, torch.ones_like(items)]
            )
            if not last:
                if not self._started:  # a parameter without a gradient yet has accumulated 0
                    torch._foreach_zero_(list(self._prev.values()))
                torch._foreach_copy_([b for _, b in pairs], grads)
                self._started = True
                return
            self._started = False
            big_sq = _sq_norm(grads) / scale.square()
            self._finish_window(ctx, big_sq, count)

    def _buffer(self, p: nn.Parameter) -> torch.Tensor:
        if id(p) not in self._prev:
            self._prev[id(p)] = torch.zeros_like(p.grad)
        return self._prev[id(p)]

    @staticmethod
    def _loss_scale(ctx: StepContext) -> torch.Tensor:
        scale = ctx.precision.loss_scale()
        one = torch.ones((), dtype=torch.float64, device=ctx.dist.device)
        return one if scale is None else scale.to(one.device, torch.float64)

    def _finish_window(self, ctx: StepContext, big_sq: torch.Tensor, count: torch.Tensor) -> None:
        """The window's estimates from all ranks' small batches (one all-reduce), and the EMA."""
        sum_sq, sum_inv, m = all_reduce_sum(self._small, ctx.dist).unbind()
        self._count = count
        inv_small = sum_inv / m.clamp(min=1)  # 1/b: the mean inverse small-batch size
        inv_big = 1.0 / count
        # One micro-batch on one rank: small and big batches coincide, nothing to estimate.
        valid = (m > 0) & (inv_small > inv_big * (1 + 1e-9))
        small_sq = sum_sq / m.clamp(min=1)
        denom = torch.where(valid, inv_small - inv_big, torch.ones_like(inv_small))
        trace = (small_sq - big_sq) / denom  # tr(Σ) ≈ (|G_b|² − |G_B|²) / (1/b − 1/B)
        grad_sq = big_sq - trace * inv_big  # = (B|G_B|² − b|G_b|²) / (B − b)
        valid = valid & torch.isfinite(trace) & torch.isfinite(grad_sq)
        self._last = {"grad_sq": grad_sq, "trace": trace, "valid": valid}
        blended = self.decay * self._ema + (1 - self.decay) * torch.stack([grad_sq, trace])
        self._ema = torch.where(valid, blended, self._ema)
        self._ema_steps = self._ema_steps + valid.to(torch.float64)

    def noise_scale(self) -> torch.Tensor | None:
        """B_simple of the last window (a device tensor; nan when it could not be estimated)."""
        if not self._last:
            return None
        return self._last["trace"] / self._last["grad_sq"]

    def noise_scale_ema(self) -> torch.Tensor | None:
        """The smoothed B_simple: bias-corrected EMA of tr(Σ) over that of |G|²."""
        if not self._last:
            return None
        # Bias correction divides both by the same 1 − decay^t, so it cancels in the ratio.
        return self._ema[1] / self._ema[0]

    def metrics(self) -> dict[str, Any]:
        if not self._last or not bool(self._last["valid"]):
            return {}
        return {
            "train/noise_scale": self.noise_scale(),
            "train/noise_scale_ema": self.noise_scale_ema(),
            "train/noise_grad_sq": self._last["grad_sq"],
            "train/noise_trace": self._last["trace"],
        }

    def summary(self, global_batch_size: int) -> str | None:
        """One line for the end-of-run summary: the smoothed noise scale beside the batch."""
        ema = self.noise_scale_ema()
        if ema is None or not self._ema_steps.item():
            return None
        items = int(self._count.item())
        value = ema.item()
        advice = (
            "a larger global batch would still speed up training nearly linearly"
            if value > 2 * items
            else "a larger global batch would mostly waste compute"
            if value < items / 2
            else "the global batch is near the efficient size"
        )
        return (
            f"  gradient noise scale (EMA) {value:,.0f} loss items | global batch "
            f"{global_batch_size} samples = {items:,} loss items: {advice}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self._ema, "ema_steps": self._ema_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ema = state["ema"].to(self._ema.device, torch.float64)
        self._ema_steps = state["ema_steps"].to(self._ema.device, torch.float64)
