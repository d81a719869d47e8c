"""cumulus engine: the autograd-aware core, usable from plain Python (no Hydra, no W&B)."""

from engine.accumulate import AccumulateStep
from engine.distributed import DistInfo, init_distributed, shutdown_distributed
from engine.precision import Precision
from engine.step import StepContext, StepResult, StepStrategy, Task

__all__ = [
    "AccumulateStep",
    "DistInfo",
    "Precision",
    "StepContext",
    "StepResult",
    "StepStrategy",
    "Task",
    "init_distributed",
    "shutdown_distributed",
]
