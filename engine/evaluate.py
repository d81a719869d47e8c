"""Evaluation: exact global mean loss under `inference_mode`, leaving training untouched."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed import DistInfo, all_reduce_max, all_reduce_sum, is_sharded
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
    with duplicates). A sharded (FSDP) model gathers its parameters in every forward, so there
    every rank runs as many forwards as the rank with the most batches; the extra ones reuse a
    batch and are not counted. The model is put in eval mode and restored to its mode after.
    """
    batches = list(batches)
    n_forwards = len(batches)
    if dist.distributed and is_sharded(model):
        n_forwards = int(all_reduce_max(torch.tensor(len(batches), device=dist.device), dist))
        if n_forwards and not batches:
            raise ValueError(f"rank {dist.rank} has no validation batch to keep FSDP in step")
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=dist.device)  # (loss sum, item count)
    try:
        with torch.inference_mode(), precision.autocast():
            for i in range(n_forwards):
                if i < len(batches):
                    total[0] += task.loss_sum(model, batches[i]).double()
                    total[1] += task.count_items(batches[i]).double()
                else:
                    task.loss_sum(model, batches[0])  # lockstep only: not counted
    finally:
        model.train(was_training)
    loss_sum, count = all_reduce_sum(total, dist).tolist()
    return (loss_sum / count if count else float("nan")), int(count)
