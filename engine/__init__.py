"""cumulus engine: the autograd-aware core, usable from plain Python (no Hydra, no W&B)."""

from engine.distributed import DistInfo, init_distributed, shutdown_distributed
from engine.numerics.precision import Precision
from engine.step import StepContext, StepResult, StepStrategy, Task
from engine.steps.accumulate import AccumulateStep

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
