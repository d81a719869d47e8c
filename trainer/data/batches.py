"""This rank's training windows and validation batches, built from the data and the layout."""

from __future__ import annotations

import os

from engine.distributed import DistInfo
from engine.parallel.base import Parallelism
from trainer.config.errors import ConfigError
from trainer.config.schema import DataExtras, EvalCfg
from trainer.data import DataSplits
from trainer.data.loader import EvalBatches, GlobalBatchSampler, TrainBatches, eval_set_size
from trainer.run.batch_plan import BatchPlan


def resolve_num_workers(requested: int | None, info: DistInfo) -> int:
    """`data.num_workers=null`: loader workers only where spare cores make them pay off."""
    if requested is not None:
        return requested
    if info.device.type != "cuda":
        return 0  # on CPU the workers would take cores from the training step itself
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(4, (os.cpu_count() or 1) // local_ranks - 1))


def build_train_batches(
    data: DataSplits,
    extras: DataExtras,
    seed: int,
    info: DistInfo,
    plan: BatchPlan,
    parallel: Parallelism,
) -> TrainBatches:
    """This data-parallel rank's training windows, through a DataLoader."""
    return TrainBatches(
        data.train,
        GlobalBatchSampler(len(data.train), plan.global_batch, seed, extras.sampling),
        rank=parallel.dp_rank,
        plan=plan,
        device=info.device,
        collate_fn=data.collate_fn,
        num_workers=resolve_num_workers(extras.num_workers, info),
    )


def build_val_batches(
    data: DataSplits,
    extras: DataExtras,
    cfg: EvalCfg,
    seed: int,
    info: DistInfo,
    parallel: Parallelism,
    whole_batches: bool = False,
) -> EvalBatches:
    """This data-parallel rank's validation batches, through a DataLoader; `whole_batches`
    for a task whose loss is of the whole batch: its shares of every evaluation batch."""
    val = EvalBatches(
        data.val,
        rank=parallel.dp_rank,
        world_size=parallel.dp_size,
        batch_size=cfg.batch_size,
        max_batches=cfg.max_batches,
        device=info.device,
        seed=seed,
        collate_fn=data.collate_fn,
        num_workers=resolve_num_workers(extras.num_workers, info),
        whole_batches=whole_batches,
    )
    n_val = eval_set_size(len(data.val), cfg.batch_size, cfg.max_batches)
    lockstep = parallel.shards_parameters and not whole_batches  # shares: one batch each
    if lockstep and cfg.every_steps and n_val < parallel.dp_size:
        raise ConfigError(
            "eval.max_batches",
            f"a model whose parameters are split over ranks (dist.strategy=fsdp, dist.ep) "
            f"evaluates in lockstep and needs a validation sample on each of the "
            f"{parallel.dp_size} ranks; the set has {n_val}: raise eval.max_batches or "
            "eval.batch_size",
        )
    return val
