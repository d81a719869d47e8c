"""cumulus engine: the autograd-aware core, usable from plain Python (no Hydra, no W&B).

- `step`: what a step strategy receives and returns (`StepContext`, `Task`, `StepResult`)
- `steps/`: step strategies (exact accumulation, SAM, DP-SGD) and the out-of-memory guard
- `parallel/`: how the model is spread over ranks (DDP, FSDP2, tensor, pipeline)
- `checkpoint/`: atomic, verifiable, safe-to-load checkpoints (full and sharded layouts)
- `callbacks/`: hooks at the moments that matter to autograd (EMA, gradient statistics)
- `numerics/`: mixed precision, exact chunked cross-entropy, hand-written autograd functions
- `tasks`, `model`, `evaluate`, `distributed`, `rng`, `schedule`: tasks, what a model may
  declare, evaluation, the process group, random streams, learning-rate schedules
"""

from importlib import import_module
from typing import Any

# Imported on first use, so that `import engine.parallel.dims` (config checks) stays cheap.
_EXPORTS = {
    "AccumulateStep": "engine.steps.accumulate",
    "DistInfo": "engine.distributed",
    "init_distributed": "engine.distributed",
    "shutdown_distributed": "engine.distributed",
    "Precision": "engine.numerics.precision",
    "StepContext": "engine.step",
    "StepResult": "engine.step",
    "StepStrategy": "engine.step",
    "Task": "engine.step",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
