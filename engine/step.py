"""What a step strategy receives and returns.

The loss contract is what makes exact accumulation possible: a task reports the *sum* of its
per-item losses and, separately and before any forward, how many loss items a batch holds.
A step strategy then divides by the global count of the whole window, never by a micro-batch
mean.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from engine.distributed import DistInfo
from engine.item_sums import ItemTotals
from engine.numerics.precision import Precision
from engine.parallel.base import Parallelism, WindowGuard
from engine.parallel.dims import parallelism_of
from engine.tasks import TaskOutputError
from engine.timing import PhaseClock

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
class WrapsTask(Protocol):
    """A task that wraps the run's own task to add to its gradient, its loss's value the
    wrapped task's (engine/moe/balance.py's `BalancedTask`: the routers' load balancing). What
    the loss is (a language model's per-token cross-entropy, whose exp is a perplexity)
    remains the wrapped task's: `innermost_task`."""

    task: Task


def innermost_task(task: Task) -> Task:
    """The run's own task under any `WrapsTask` wrapping."""
    while isinstance(task, WrapsTask):
        task = task.task
    return task


@runtime_checkable
class PreparesWindow(Protocol):
    """A task that looks at the whole window once before any backward (engine/moe/balance.py:
    the load-balancing loss's routing pass). The accumulation step calls it after counting,
    with the window's guard: each forward of the look runs under `guard.micro_batch` (an
    out-of-memory error there is agreed by every rank, as one in a backward)."""

    def prepare_window(
        self,
        ctx: StepContext,
        window: Sequence[Batch],
        global_count: torch.Tensor,
        guard: WindowGuard,
    ) -> None: ...


@runtime_checkable
class EvalTask(Task, Protocol):
    """A task that reports more than the loss at evaluation (optional).

    `eval_sums` runs one forward and returns sums over the batch's loss items, `"loss"`
    among them (e.g. `{"loss": ..., "accuracy": correct}`); evaluation reduces each over all
    ranks and divides by the global item count, exactly like the loss.
    """

    def eval_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class AveragesWeights(Protocol):
    """A callback that keeps its own copy of the weights (an EMA): engine/callbacks'
    `AveragedWeights`. Evaluation swaps them in; `evaluate` says whether each evaluation also
    reports their loss."""

    evaluate: bool

    def attach(self, model: nn.Module) -> None: ...

    def weights_swapped(self, model: nn.Module) -> contextlib.AbstractContextManager[None]: ...


class CallbackList:
    """Calls every callback (engine/callbacks' `Callback`s) in order; keyed by name so
    checkpoints can restore each one."""

    def __init__(self, callbacks: dict[str, Any] | None = None) -> None:
        self.named: dict[str, Any] = dict(callbacks or {})

    def __iter__(self) -> Iterator[Any]:
        return iter(self.named.values())

    def setup(self, ctx: StepContext) -> None:
        for cb in self.named.values():
            cb.setup(ctx)

    def after_micro_batch(
        self, ctx: StepContext, batch: Any, global_count: torch.Tensor, last: bool
    ) -> None:
        for cb in self.named.values():
            cb.on_after_micro_batch(ctx, batch, global_count, last)

    def after_backward(self, ctx: StepContext) -> None:
        for cb in self.named.values():
            cb.on_after_backward(ctx)

    def before_optimizer_step(self, ctx: StepContext) -> None:
        for cb in self.named.values():
            cb.on_before_optimizer_step(ctx)

    def after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        for cb in self.named.values():
            cb.on_after_optimizer_step(ctx, step)

    def evaluate(self, step: int, metrics: dict[str, float]) -> None:
        for cb in self.named.values():
            cb.on_evaluate(step, metrics)

    def averaged_weights(self) -> dict[str, AveragesWeights]:
        return {n: cb for n, cb in self.named.items() if isinstance(cb, AveragesWeights)}

    def summaries(self, global_batch_size: int) -> list[str]:
        lines = [cb.summary(global_batch_size) for cb in self.named.values()]
        return [line for line in lines if line]

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for cb in self.named.values():
            out.update(cb.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {name: cb.state_dict() for name, cb in self.named.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A stateless callback may be added on resume; a stateful one must find its state.
        missing = sorted(
            n
            for n, cb in self.named.items()
            if n not in state and cb.state_dict() and not cb.state_optional
        )
        if missing:
            raise KeyError(f"checkpoint holds no state for callbacks {missing}")
        for name, cb in self.named.items():
            if name in state:
                cb.load_state_dict(state[name])


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
    # Where this rank's time goes (engine/timing.py): the step switches its phases.
    clock: PhaseClock = None  # type: ignore[assignment]
    # The item sums a task returns beside its loss (ItemSums: DPO's rewards), of the step's
    # forwards since the last step's records took them.
    item_sums: ItemTotals = field(default_factory=ItemTotals)
    # What the data-parallel wrapper divides synchronized gradients by (DDP averages).
    grad_sync_divisor: int = field(init=False)

    def __post_init__(self) -> None:
        if self.parallel is None:
            self.parallel = parallelism_of(self.model, self.dist)
        if self.clock is None:
            self.clock = PhaseClock(self.dist.device)
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
