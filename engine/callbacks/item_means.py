"""The exact means a task reports beside its loss (engine/item_sums.py's `ItemSums`),
recorded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.callbacks.base import Callback
from engine.distributed import all_reduce_sum

if TYPE_CHECKING:
    from engine.item_sums import ItemSums
    from engine.step import StepContext


class ItemMeans(Callback):
    """After every optimizer step, the task's sums of that step (this rank's micro-batches,
    as the step added them up: `ctx.item_sums`); at a record, each summed over the
    data-parallel ranks (one all-reduce, collective: every rank records) and divided by the
    step's items: `train/NAME`. Stateless: a record."""

    state_optional = True

    def __init__(self, task: ItemSums, prefix: str = "train/") -> None:
        self.task, self.prefix = task, prefix
        self.sums: dict[str, torch.Tensor] = {}
        self.ctx: StepContext | None = None

    def setup(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        del step
        self.sums = ctx.item_sums.take()

    def metrics(self) -> dict[str, Any]:
        ctx = self.ctx
        if ctx is None:
            return {}
        names = list(self.task.item_sum_names)
        zero = torch.zeros((), dtype=torch.float64, device=ctx.dist.device)
        local = torch.stack(
            [self.sums.get(k, zero).double().to(zero.device) for k in [*names, "items"]]
        )
        total = all_reduce_sum(local, ctx.dist, ctx.parallel.dp_group)
        count = total[-1].clamp(min=1)
        return {f"{self.prefix}{k}": total[i] / count for i, k in enumerate(names)}
