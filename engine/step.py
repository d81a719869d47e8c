"""What a step strategy receives and returns.

The loss contract is what makes exact accumulation possible: a task reports the *sum* of its
per-item losses and, separately and before any forward, how many loss items a batch holds.
A step strategy then divides by the global count of the whole window, never by a micro-batch
mean.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from engine.callbacks import CallbackList
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.parallel.base import Parallelism
from engine.parallel.dims import parallelism_of
from engine.tasks import TaskOutputError

Batch = Any


@runtime_checkable
class Task(Protocol):
    """Turns a micro-batch into a loss. Implemented by the application (e.g. a language model)."""

    def count_items(self, batch: Batch) -> torch.Tensor:
        """Number of loss items (valid tokens, samples) in `batch`, without running the model."""
        ...

    def loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Sum (not mean) of the per-item losses of `batch`: a differentiable scalar."""
        ...


def item_count(task: Task, batch: Batch) -> torch.Tensor:
    """`task.count_items(batch)` as a tensor: a plain Python int is accepted as well."""
    count = task.count_items(batch)
    if isinstance(count, torch.Tensor):
        return count
    if isinstance(count, numbers.Integral) and not isinstance(count, bool):
        return torch.tensor(int(count), dtype=torch.int64)
    raise TaskOutputError(
        f"{type(task).__name__}.count_items(batch) must return the number of loss items as an "
        f"int or an integer tensor, got {type(count).__name__} ({count!r:.80})"
    )


@runtime_checkable
class EvalTask(Task, Protocol):
    """A task that reports more than the loss at evaluation (optional).

    `eval_sums` runs one forward and returns sums over the batch's loss items, `"loss"`
    among them (e.g. `{"loss": ..., "accuracy": correct}`); evaluation reduces each over all
    ranks and divides by the global item count, exactly like the loss.
    """

    def eval_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]: ...


@dataclass
class StepContext:
    """The runtime objects a step strategy works with. Built once per run."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    task: Task
    precision: Precision
    dist: DistInfo
    clip_grad_norm: float | None = None
    callbacks: CallbackList = field(default_factory=CallbackList)
    # FSDP: reduce-scatter after every micro-batch instead of keeping unsharded gradients of
    # the whole window (less memory, one collective per micro-batch).
    sync_every_micro_batch: bool = False
    # Optimizer steps completed; `finish_step` advances it (restored from checkpoints).
    step: int = 0
    # How `model` is spread over ranks (engine/parallel/); left out, it is read off the
    # model's wrapper (DDP, FSDP2, or none).
    parallel: Parallelism = None  # type: ignore[assignment]
    # What the data-parallel wrapper divides synchronized gradients by (DDP averages).
    grad_sync_divisor: int = field(init=False)

    def __post_init__(self) -> None:
        if self.parallel is None:
            self.parallel = parallelism_of(self.model, self.dist)
        self.grad_sync_divisor = self.parallel.sync_divisor

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


@dataclass
class StepResult:
    """Detached device tensors describing one optimizer step.

    Nothing here has been copied to the host: the fit loop calls `.item()` only when it writes
    a record, so steps in between never wait for the device.
    """

    loss_sum: torch.Tensor  # this rank's summed loss over the window (fp32, detached)
    global_count: torch.Tensor  # loss items in the window over all ranks (int64)
    grad_norm: torch.Tensor  # total gradient norm before clipping, unscaled
    skipped: torch.Tensor  # 1.0 when the update was skipped for non-finite gradients, else 0.0
    lr: float  # learning rate the update used (first param group)


class StepStrategy(Protocol):
    """How one optimizer step turns a window of micro-batches into a parameter update."""

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult: ...
