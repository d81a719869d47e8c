"""How the model is spread over the job's ranks: the `Parallelism` interface and its
implementations, one module each."""

from engine.parallel.base import (
    PARALLELISMS,
    STRATEGIES,
    DataParallel,
    FullyShardedDataParallel,
    MeshSplit,
    Parallelism,
    all_reduce_flat,
    build_mesh,
    build_parallelism,
    local_values,
    parallelism_of,
    shard_units,
    whole_tensor,
)

__all__ = [
    "PARALLELISMS",
    "STRATEGIES",
    "DataParallel",
    "FullyShardedDataParallel",
    "MeshSplit",
    "Parallelism",
    "all_reduce_flat",
    "build_mesh",
    "build_parallelism",
    "local_values",
    "parallelism_of",
    "shard_units",
    "whole_tensor",
]
