"""Sharpness-aware minimization (Foret et al., 2021) as a step strategy.

Per optimizer step: gradient g at w over the whole window (exact accumulation, one all-reduce)
-> move to w + rho * g / ||g|| -> gradient at that point over the same window -> back to the
saved w -> update w with the second gradient. Both passes keep the `no_sync` discipline, so
each communicates once. Works with clipping and every precision: the ascent direction
g / ||g|| does not depend on the loss scale, so scaled fp16 gradients need no unscaling there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.parallel.base import total_norm
from engine.step import Batch, StepContext, StepResult
from engine.steps.accumulate import count_window, finish_step


class SAMStep:
    """Args:
    rho: radius of the ascent step (in parameter space).
    adaptive: ASAM: scale each coordinate of the ascent by |w| (scale-invariant sharpness).
    """

    def __init__(self, rho: float = 0.05, adaptive: bool = False) -> None:
        if rho <= 0:
            raise ValueError(f"rho must be positive, got {rho}")
        self.rho = rho
        self.adaptive = adaptive

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        params = ctx.trainable_parameters()
        ctx.optimizer.zero_grad(set_to_none=True)
        global_count = count_window(ctx, window)
        # The loss reported: at w.
        loss_sum = ctx.parallel.backward_window(ctx, window, global_count)

        with torch.no_grad():
            with_grad = [p for p in params if p.grad is not None]
            saved = [p.detach().clone() for p in with_grad]
            if self.adaptive:
                scaled = [p.abs() * p.grad for p in with_grad]  # T_w g
                ascent = [p.abs() * s for p, s in zip(with_grad, scaled)]  # T_w^2 g
            else:
                scaled = ascent = [p.grad for p in with_grad]
            factor = self.rho / (total_norm(scaled) + 1e-12)
            for p, a in zip(with_grad, ascent):
                p.add_(a * factor)
        ctx.optimizer.zero_grad(set_to_none=True)
        ctx.parallel.backward_window(ctx, window, global_count)  # the gradient used: at w + e
        with torch.no_grad():
            for p, w in zip(with_grad, saved):
                p.copy_(w)  # exact restore; (w + e) - e is not w in floating point
        return finish_step(ctx, loss_sum, global_count)
