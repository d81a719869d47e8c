"""Pipeline parallelism: the model's blocks split into stages over the mesh's `pp` ranks, and
the accumulation window run as the pipeline's schedule.

The window's micro-batches *are* the pipeline's micro-batches. Every stage of a data-parallel
replica reads the same window; the item count is summed over the data-parallel ranks before
any forward, and the last stage scales each micro-batch's loss sum by 1 / that count before
its backward, exactly as the plain accumulation step does. Nothing inside the schedule scales
again. After the last backward, gradients are summed over the data-parallel ranks (a plain
sum: `sync_divisor` is 1) and a parameter held by several stages (a tied embedding) gets the
sum of their gradients, so every copy takes the same update.

The model declares how it is split (`pipeline_stage`, see docs/your-model.md); each rank keeps
the model object itself as the *holder* of its stages' parameters, pruned to them, so the
optimizer, the parameter names and the checkpoints stay the model's own.

The runtime is small on purpose: a rank walks its schedule's list of actions
(engine/parallel/pipeline/schedule.py); a forward receives its input from the previous stage, a
backward the gradient of its output from the next one (blocking), and sends go out
asynchronously, each tensor preceded by a header with its shape and dtype, so micro-batches
may differ in length.
"""

from importlib import import_module
from typing import Any

# Imported on first use: the runtime pulls in DTensor, slow to import, while the schedules
# are plain lists anyone may read.
_EXPORTS = {
    "PipelineParallel": "engine.parallel.pipeline.parallel",
    "SCHEDULES": "engine.parallel.pipeline.schedule",
    "DeclaresStages": "engine.parallel.pipeline.stages",
    "NotSplittable": "engine.parallel.pipeline.stages",
    "stage_ranges": "engine.parallel.pipeline.stages",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
