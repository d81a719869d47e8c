"""Evaluation: exact global means under `inference_mode`, leaving training untouched."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sized

import torch
from torch import nn

from engine.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_max,
    all_reduce_sum,
)
from engine.numerics.precision import Precision
from engine.parallel.base import Parallelism
from engine.parallel.dims import parallelism_of
from engine.step import Batch, EvalTask, Task, item_count


def task_sums(task: Task, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """A batch's sums for evaluation: the task's `eval_sums` (optional), else its loss sum."""
    if isinstance(task, EvalTask):
        return task.eval_sums(model, batch)
    return {"loss": task.loss_sum(model, batch)}


def evaluate(
    model: nn.Module,
    task: Task,
    batches: Iterable[Batch],
    precision: Precision,
    dist: DistInfo,
    parallel: Parallelism | None = None,
    progress: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[dict[str, float], int]:
    """Per-item means over all ranks' `batches` (`loss`, and whatever else the task sums,
    e.g. `accuracy`), and the global item count.

    `batches` is streamed: one batch on the device at a time. Sums and counts are
    all-reduced, so ranks may hold different numbers of samples (no padding with
    duplicates). A sharded (FSDP) model gathers its parameters in every forward, so there
    every rank runs as many forwards as the rank with the most batches (`batches` must have
    a length); the extra ones reuse a batch and are not counted. The model (and whatever the
    parallelism runs it with: pipeline stages) is in eval mode within, restored after.
    `progress(batches, items)` is told after each batch (`items`: a device tensor, read only
    by whoever prints it).
    """
    if parallel is None:  # read off the model's wrapper
        parallel = parallelism_of(model, dist)
    n_forwards = None
    if dist.distributed and parallel.shards_parameters:
        if not isinstance(batches, Sized):
            raise TypeError("evaluating a sharded model needs batches with a length")
        n_forwards = int(all_reduce_max(torch.tensor(len(batches), device=dist.device), dist))
        if n_forwards and not len(batches):
            raise ValueError(f"rank {dist.rank} has no validation batch to keep FSDP in step")
    sums: dict[str, torch.Tensor] = {}
    count = torch.zeros((), dtype=torch.float64, device=dist.device)
    seen = 0
    with parallel.eval_mode(model), torch.inference_mode(), precision.autocast():
        for batch, batch_sums in parallel.eval_sums(model, task, batches, task_sums, n_forwards):
            for name, value in batch_sums.items():
                sums[name] = sums.get(name, 0) + value.double()
            count += item_count(task, batch).double()
            seen += 1
            if progress is not None:
                progress(seen, count)
    if not parallel.reports:  # another rank of its tensor-parallel group reports
        sums, count = {n: torch.zeros_like(v) for n, v in sums.items()}, torch.zeros_like(count)
    names = sorted(sums)
    if dist.distributed:  # a rank without batches does not know the task's metric names
        names = sorted(set().union(*all_gather_object(names, dist)))
    zero = torch.zeros((), dtype=torch.float64, device=dist.device)
    totals = all_reduce_sum(torch.stack([sums.get(n, zero) for n in names] + [count]), dist)
    *values, total = totals.tolist()
    means = {n: (v / total if total else float("nan")) for n, v in zip(names, values)}
    return means, int(total)
