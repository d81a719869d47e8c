"""Support for tests/test_profile.py: one rank made slow in one place, loaded by the trainer
through `_target_` (so it must stay cheap to import and free of side effects).

- `slow_data`: the default text data whose training samples take `delay_s` each to read on
  rank `rank` (a slow disk on one host);
- `SlowCompute`: rank `rank` spends `seconds` more in each step's first micro-batch, before
  the gradient all-reduce (a throttled device);
- `Hang`: rank `rank` stops in step `step`'s first micro-batch for `seconds` (a deadlock).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from engine.callbacks import Callback

if TYPE_CHECKING:
    import torch

    from engine.step import StepContext


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class SlowReads:
    """A map-style dataset whose reads take `delay_s` longer."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.delay_s)
        return self.inner[index]


def slow_data(rank: int = 1, delay_s: float = 0.03, **text_args: Any) -> Any:
    """`trainer.data.text.text_data(**text_args)`, its training reads slowed on `rank`."""
    from trainer.data.text import text_data

    splits = text_data(**text_args)
    if _rank() == rank:
        splits.train = SlowReads(splits.train, delay_s)
    return splits


class SlowCompute(Callback):
    """Rank `rank` sleeps `seconds` after each step's first micro-batch (of two or more):
    inside the step's compute, before the synchronized micro-batch."""

    def __init__(self, rank: int = 1, seconds: float = 0.3) -> None:
        self.rank, self.seconds = int(rank), float(seconds)

    def on_after_micro_batch(
        self, ctx: StepContext, batch: Any, global_count: torch.Tensor, last: bool
    ) -> None:
        if not last and _rank() == self.rank:
            time.sleep(self.seconds)


class Hang(Callback):
    """Rank `rank` stops for `seconds` in step `step`, after its first micro-batch: its peers
    wait for it in the gradient all-reduce of the last one."""

    def __init__(self, step: int, rank: int = 1, seconds: float = 3600.0) -> None:
        self.step, self.rank, self.seconds = int(step), int(rank), float(seconds)

    def on_after_micro_batch(
        self, ctx: StepContext, batch: Any, global_count: torch.Tensor, last: bool
    ) -> None:
        if not last and ctx.step + 1 == self.step and _rank() == self.rank:
            time.sleep(self.seconds)
