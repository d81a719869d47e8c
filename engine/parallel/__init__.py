"""How the model is spread over the job's ranks, one module per kind of parallelism.

- `base`: the `Parallelism` interface every caller uses, and `ParallelBase`, its defaults
- `dims`: `ParallelDims`, the degrees decided once; it builds the mesh and the parallelism
- `ddp`: DistributedDataParallel (the bare model on one process)
- `fsdp`: FSDP2, and what it needs to recover from an out-of-memory error
- `tensor`: tensor parallelism (and Megatron's sequence parallelism)
- `pipeline/`: pipeline stages (schedules, stages, links between them, their state)
- `context`: context parallelism (each sequence split over ranks), over any of the above
- `expert`: expert parallelism (`dist.ep`: experts split over ranks, tokens sent all-to-all)

Nothing is imported here: `engine.parallel.dims` must stay cheap to import (config checks).
"""


class LayoutError(ValueError):
    """A layout that cannot run, named by the config `key` that asks for it: one paragraph."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
