"""Evaluation: exact global mean loss under `inference_mode`, leaving training untouched."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed import DistInfo, all_reduce_sum
from engine.precision import Precision
from engine.step import Batch, Task


def evaluate_loss(
    model: nn.Module,
    task: Task,
    batches: Iterable[Batch],
    precision: Precision,
    dist: DistInfo,
) -> tuple[float, int]:
    """Mean loss per item over all ranks' `batches`, and the global item count.

    Sums and counts are all-reduced, so ranks may hold different numbers of samples (no padding
    with duplicates). The model is put in eval mode and restored to its previous mode after.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=dist.device)  # (loss sum, item count)
    try:
        with torch.inference_mode(), precision.autocast():
            for batch in batches:
                total[0] += task.loss_sum(model, batch).double()
                total[1] += task.count_items(batch).double()
    finally:
        model.train(was_training)
    loss_sum, count = all_reduce_sum(total, dist).tolist()
    return (loss_sum / count if count else float("nan")), int(count)
