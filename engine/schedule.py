"""Learning-rate schedules as multipliers of the peak LR (for `LambdaLR`)."""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_cosine(
    warmup_steps: int, decay_steps: int, min_ratio: float = 0.1
) -> Callable[[int], float]:
    """Linear warmup to 1 over `warmup_steps`, then cosine decay to `min_ratio` at `decay_steps`.

    `step` is the number of optimizer steps taken so far (LambdaLR's convention), so the first
    update uses `1 / (warmup_steps + 1)` of the peak rather than zero.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if step >= decay_steps:
            return min_ratio
        progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def warmup_constant(warmup_steps: int) -> Callable[[int], float]:
    """Linear warmup to 1, then constant."""

    def factor(step: int) -> float:
        return (step + 1) / (warmup_steps + 1) if step < warmup_steps else 1.0

    return factor
