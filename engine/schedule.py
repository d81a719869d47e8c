"""Learning-rate schedules: multipliers of the peak LR, and `LambdaLR` builders over them.

Every multiplier takes `step`, the number of optimizer steps taken so far (LambdaLR's
convention), so with warmup the first update uses `1 / (warmup_steps + 1)` of the peak rather
than zero. The builders (`cosine`, `constant`, `linear`, `wsd`) take the optimizer and the
run's length `max_steps`; `scheduler=NAME` selects them (`configs/scheduler/`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Factor = Callable[[int], float]
DECAY_SHAPES = ("linear", "cosine", "sqrt")


def _warmup(step: int, warmup_steps: int) -> float | None:
    return (step + 1) / (warmup_steps + 1) if step < warmup_steps else None


def _decay(progress: float, min_ratio: float, shape: str) -> float:
    """From 1 at progress 0 to `min_ratio` at progress 1."""
    if shape == "cosine":
        left = 0.5 * (1 + math.cos(math.pi * progress))
    elif shape == "sqrt":  # "1 - sqrt": steep at the end, common for WSD cool-downs
        left = 1 - math.sqrt(progress)
    else:
        left = 1 - progress
    return min_ratio + (1 - min_ratio) * left


def _warmup_then_decay(warmup_steps: int, decay_steps: int, min_ratio: float, shape: str) -> Factor:
    def factor(step: int) -> float:
        warm = _warmup(step, warmup_steps)
        if warm is not None:
            return warm
        if step >= decay_steps:
            return min_ratio
        progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
        return _decay(progress, min_ratio, shape)

    return factor


def warmup_cosine(warmup_steps: int, decay_steps: int, min_ratio: float = 0.1) -> Factor:
    """Linear warmup to 1 over `warmup_steps`, then cosine decay to `min_ratio` at
    `decay_steps` (and `min_ratio` after)."""
    return _warmup_then_decay(warmup_steps, decay_steps, min_ratio, "cosine")


def warmup_constant(warmup_steps: int) -> Factor:
    """Linear warmup to 1, then constant."""

    def factor(step: int) -> float:
        warm = _warmup(step, warmup_steps)
        return 1.0 if warm is None else warm

    return factor


def warmup_linear(warmup_steps: int, decay_steps: int, min_ratio: float = 0.0) -> Factor:
    """Linear warmup to 1, then linear decay to `min_ratio` at `decay_steps`."""
    return _warmup_then_decay(warmup_steps, decay_steps, min_ratio, "linear")


def warmup_stable_decay(
    warmup_steps: int, decay_steps: int, total_steps: int, min_ratio: float = 0.0,
    shape: str = "linear",
) -> Factor:  # fmt: skip
    """Warmup-stable-decay: linear warmup to 1, hold 1, then decay to `min_ratio` over the
    last `decay_steps` of `total_steps` (`shape`: linear, cosine or sqrt, i.e. 1 - sqrt)."""
    start = total_steps - decay_steps

    def factor(step: int) -> float:
        warm = _warmup(step, warmup_steps)
        if warm is not None:
            return warm
        if step < start:
            return 1.0
        if step >= total_steps:
            return min_ratio
        return _decay((step - start) / max(1, decay_steps), min_ratio, shape)

    return factor


def _lambda(optimizer: torch.optim.Optimizer, factor: Factor) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _check(warmup_steps: int, min_lr_ratio: float) -> None:
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


def cosine(
    optimizer: torch.optim.Optimizer, *, max_steps: int, warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
) -> torch.optim.lr_scheduler.LambdaLR:  # fmt: skip
    """Linear warmup, then cosine decay to `min_lr_ratio` x the peak at `max_steps`."""
    _check(warmup_steps, min_lr_ratio)
    return _lambda(optimizer, warmup_cosine(warmup_steps, max_steps, min_lr_ratio))


def constant(
    optimizer: torch.optim.Optimizer, *, max_steps: int | None = None, warmup_steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then the peak until the end (`max_steps` is not used)."""
    del max_steps
    _check(warmup_steps, 0.0)
    return _lambda(optimizer, warmup_constant(warmup_steps))


def linear(
    optimizer: torch.optim.Optimizer, *, max_steps: int, warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:  # fmt: skip
    """Linear warmup, then linear decay to `min_lr_ratio` x the peak at `max_steps`."""
    _check(warmup_steps, min_lr_ratio)
    return _lambda(optimizer, warmup_linear(warmup_steps, max_steps, min_lr_ratio))


def wsd(
    optimizer: torch.optim.Optimizer, *, max_steps: int, warmup_steps: int = 0,
    decay_steps: int | None = None, min_lr_ratio: float = 0.0, decay_shape: str = "linear",
) -> torch.optim.lr_scheduler.LambdaLR:  # fmt: skip
    """Warmup-stable-decay: warmup, the peak, then a decay over the last `decay_steps` of
    `max_steps` (default: the last 20%) to `min_lr_ratio` x the peak.

    A run can be extended (a larger `train.max_steps`) from a checkpoint taken in the stable
    phase without any change to the steps already taken.
    """
    _check(warmup_steps, min_lr_ratio)
    if decay_steps is None:
        decay_steps = max(1, round(0.2 * max_steps))
    if decay_steps < 1 or warmup_steps + decay_steps > max_steps:
        raise ValueError(
            f"decay_steps must be >= 1 and warmup_steps + decay_steps <= train.max_steps "
            f"({max_steps}); got warmup_steps={warmup_steps}, decay_steps={decay_steps}"
        )
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(
            f"decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {decay_shape!r}"
        )
    factor = warmup_stable_decay(warmup_steps, decay_steps, max_steps, min_lr_ratio, decay_shape)
    return _lambda(optimizer, factor)
