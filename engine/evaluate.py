"""Evaluation: exact global means under `inference_mode`, leaving training untouched."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_max,
    all_reduce_sum,
)
from engine.numerics.gather import gather_rows
from engine.numerics.precision import Precision
from engine.parallel.base import Parallelism
from engine.parallel.dims import parallelism_of
from engine.step import Batch, EvalTask, Task, item_count
from engine.window_task import WindowMetrics, WindowTask

Sums = dict[str, torch.Tensor]
Progress = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class EvalShare:
    """This rank's share of one evaluation batch of a task whose loss is of the whole batch
    (`WindowTask`): the batch's samples are split over the data-parallel ranks and their
    representations gathered, so that every sample of the batch is a negative of every other
    on any world size. `rows`: how many of `batch`'s samples are this rank's. A rank that owns
    none (a last batch smaller than the world) forwards the batch's first sample anyway, so
    that collective forwards (FSDP) and the gather stay in step, and contributes no row."""

    batch: Batch
    rows: int


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
    A task whose loss is of the whole batch (`WindowTask`: in-batch negatives) is evaluated
    on whole evaluation batches split over the data-parallel ranks (`EvalShare`s), their
    representations gathered, so its means do not depend on the world size.
    `progress(batches, items)` is told after each batch (`items`: a device tensor, read only
    by whoever prints it).
    """
    if parallel is None:  # read off the model's wrapper
        parallel = parallelism_of(model, dist)
    with parallel.eval_mode(model), torch.inference_mode(), precision.autocast():
        if isinstance(task, WindowTask):
            sums, count = _window_sums(model, task, batches, parallel, dist, progress)
        else:
            sums, count = _batch_sums(model, task, batches, parallel, dist, progress)
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


def _batch_sums(
    model: nn.Module,
    task: Task,
    batches: Iterable[Batch],
    parallel: Parallelism,
    dist: DistInfo,
    progress: Progress | None,
) -> tuple[Sums, torch.Tensor]:
    """This rank's sums and item count over its own batches, each batch a term of its own."""
    n_forwards = None
    if dist.distributed and parallel.shards_parameters:
        if not isinstance(batches, Sized):
            raise TypeError("evaluating a sharded model needs batches with a length")
        n_forwards = int(all_reduce_max(torch.tensor(len(batches), device=dist.device), dist))
        if n_forwards and not len(batches):
            raise ValueError(f"rank {dist.rank} has no validation batch to keep FSDP in step")
    sums: Sums = {}
    count = torch.zeros((), dtype=torch.float64, device=dist.device)
    pairs = parallel.eval_sums(model, task, batches, task_sums, n_forwards)
    for seen, (batch, batch_sums) in enumerate(pairs, 1):
        _add(sums, batch_sums)
        count += item_count(task, batch).double()
        if progress is not None:
            progress(seen, count)
    return sums, count


def _window_sums(
    model: nn.Module,
    task: WindowTask,
    shares: Iterable[EvalShare | Batch],
    parallel: Parallelism,
    dist: DistInfo,
    progress: Progress | None,
) -> tuple[Sums, torch.Tensor]:
    """This rank's sums over its rows of each evaluation batch, whose representations are
    gathered over the data-parallel ranks first: every rank runs one forward per evaluation
    batch (`EvalShare`s from the loader; a plain batch counts as all this rank's), so the
    ranks must be given the same number of them."""
    sums: Sums = {}
    count = torch.zeros((), dtype=torch.float64, device=dist.device)
    for seen, share in enumerate(shares, 1):
        if not isinstance(share, EvalShare):
            share = EvalShare(share, int(task.count_items(share)))
        reps = task.represent(model, parallel.local_batch(share.batch))[: share.rows]
        whole, offset = gather_rows(reps, parallel.dp_group)  # (batch, ...)
        rows = slice(offset, offset + share.rows)
        if isinstance(task, WindowMetrics):
            _add(sums, task.window_metrics(whole, rows))
        else:
            _add(sums, {"loss": task.window_loss(whole, rows)})
        count += share.rows
        if progress is not None:
            progress(seen, count)
    return sums, count


def _add(sums: Sums, batch_sums: Sums) -> None:
    for name, value in batch_sums.items():
        sums[name] = sums.get(name, 0) + value.double()
