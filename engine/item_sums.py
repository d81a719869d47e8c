"""What a task reports beside its loss (`ItemSums`: DPO's rewards), returned with the loss of
each micro-batch, and the step's totals of them (`ItemTotals`), which the step adds up and
its records take (engine/callbacks/item_means.py)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ItemSums(Protocol):
    """A task that reports, beside its loss, sums of other per-item values (optional): DPO's
    rewards. `loss_and_sums(model, batch)` returns what `loss_sum` returns and the batch's
    sums of each value over its loss items, with `items`, their number. The step adds up
    the sums of its own forwards (the training forwards: a check of the loss or a routing
    pass calls `loss_sum`) and the trainer records each as `train/NAME` = its sum over every
    micro-batch and rank divided by the items' (engine/callbacks/item_means.py): an exact
    mean over the step's items. `item_sum_names`: the names it reports (a rank with no
    items reports zeros).

    Example (a classifier that also records the mean confidence of its predictions)::

        class ConfidentTask(ClassificationTask):
            item_sum_names = ("confidence",)

            def loss_and_sums(self, model, batch):
                logits, labels = self._logits(model, batch)
                top = logits.detach().softmax(-1).amax(-1).sum().double()
                items = torch.tensor(float(len(labels)), dtype=torch.float64)
                loss = F.cross_entropy(logits, labels, reduction="sum")
                return loss, {"confidence": top, "items": items}
    """

    item_sum_names: tuple[str, ...]

    def loss_and_sums(
        self, model: Any, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class ItemTotals:
    """The item sums of one step's training forwards on this rank: added micro-batch by
    micro-batch by the step, taken once the step is done (or dropped with a window that is
    redone)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        for name, value in sums.items():
            self._sums[name] = self._sums[name] + value if name in self._sums else value

    def take(self) -> dict[str, torch.Tensor]:
        out, self._sums = self._sums, {}
        return out


def task_loss(task: Any, model: Any, batch: Any, totals: ItemTotals) -> torch.Tensor:
    """`task`'s loss sum of `batch`, its item sums added to `totals` (a step's forward)."""
    if isinstance(task, ItemSums):
        loss, sums = task.loss_and_sums(model, batch)
        totals.add(sums)
        return loss
    return task.loss_sum(model, batch)
