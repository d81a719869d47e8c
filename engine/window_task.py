"""The contract of a task whose loss is of the whole window, not a sum over micro-batches.

In-batch negatives (contrastive, CLIP, retrieval) compare every sample with every other of
the global batch: a micro-batch's loss is not a term of the batch's loss, so accumulating
micro-batch losses trains on fewer negatives than the batch holds. Such a task says instead
how a micro-batch becomes per-sample representations (`represent`) and which loss the
representations of the whole window give (`window_loss`, over every micro-batch of every
data-parallel rank). `step=cached` (engine/steps/cached.py) then makes the gradient exactly
the whole batch's: representations without gradients first, the loss and its gradient with
respect to them once, then each micro-batch again with gradients, fed that gradient.

A task may own parameters (a learned temperature): `loss_module()` returns them as a module,
which the trainer attaches to the model under `LOSS_MODULE` before laying it out, so that the
optimizer, clipping, EMA and checkpoints see them as the model's own. Data parallelism leaves
them alone (`loss_parameters`): the window's loss gives them their gradient once, summed over
ranks by the step. Only torch is imported here: the parallelisms read this module.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

Batch = Any

# The attribute of the model that holds a task's own parameters; their names in checkpoints
# start with it (`loss_parameters.log_scale`).
LOSS_MODULE = "loss_parameters"


@runtime_checkable
class WindowTask(Protocol):
    """A loss of the whole window's representations (every micro-batch, every data-parallel
    rank). The window's loss is the sum of `window_loss` over a partition of its rows, divided
    by the global count of loss items: each rank computes the rows of its own samples.

    Example (in-batch negatives: each anchor against every positive of the window; train
    with `task._target_=` its import path, and step=cached is chosen by itself)::

        >>> import torch.nn.functional as F
        >>> class InBatchNegatives:
        ...     def count_items(self, batch):  # one loss item per pair
        ...         return torch.tensor(len(batch["anchor"]))
        ...
        ...     def represent(self, model, batch):  # (pairs, 2, dim)
        ...         pairs = torch.stack([batch["anchor"], batch["positive"]], dim=1)
        ...         return F.normalize(model(pairs), dim=-1)
        ...
        ...     def window_loss(self, reps, rows):  # anchors `rows` x every positive
        ...         logits = reps[rows, 0] @ reps[:, 1].T / 0.05  # (rows, pairs)
        ...         targets = torch.arange(rows.start, rows.stop)
        ...         return F.cross_entropy(logits, targets, reduction="sum")
        >>> task, model = InBatchNegatives(), nn.Linear(8, 4)
        >>> batch = {"anchor": torch.randn(6, 8), "positive": torch.randn(6, 8)}
        >>> reps = task.represent(model, batch)
        >>> whole = task.window_loss(reps, slice(0, 6))
        >>> parts = task.window_loss(reps, slice(0, 4)) + task.window_loss(reps, slice(4, 6))
        >>> isinstance(task, WindowTask), torch.allclose(parts, whole)
        (True, True)
    """

    def count_items(self, batch: Batch) -> torch.Tensor:
        """Loss items in `batch` (usually its samples), without running the model."""
        ...

    def represent(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Per-sample representations of `batch`: a float tensor (samples, ...), one row per
        sample; whatever a sample needs (an anchor's and a positive's embedding) stacked in
        its row. Run twice per step (without, then with gradients) with the same random
        state: it must be a function of the model, the batch and the random state only."""
        ...

    def window_loss(self, reps: torch.Tensor, rows: slice) -> torch.Tensor:
        """The summed loss terms of samples `rows` of the window, given the representations
        of the whole window `reps` (samples, ...): a differentiable scalar. The step asks for
        a rank's own rows a chunk at a time, so a (rows x samples) block is the most any call
        should hold. A loss that is not a sum over samples returns its whole value for the
        chunk starting at row 0 and zero for the others."""
        ...


def needs_window_task(task_name: str) -> str:
    """The refusal of `step=cached` for a task that is not a `WindowTask` (one paragraph)."""
    return (
        "step=cached needs a task whose loss is of the whole window (represent(model, batch) "
        "and window_loss(reps, rows), engine/window_task.py), such as task=contrastive; "
        f"{task_name} has a loss per micro-batch: use step=accumulate"
    )


@runtime_checkable
class HasMetrics(Protocol):
    """A task with values of its own for each training record (a learned temperature)."""

    def metrics(self) -> dict[str, Any]:
        """Record key -> value after the step's update (`train/temperature`)."""
        ...


@runtime_checkable
class WindowMetrics(Protocol):
    """A `WindowTask` that reports more than its loss when evaluated (engine/evaluate.py)."""

    def window_metrics(self, reps: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        """Sums over samples `rows` of an evaluation batch, given the representations of the
        whole batch `reps` (gathered over the ranks): `loss` (as `window_loss`) and any other
        metric, each a sum whose mean over the samples is reported as `val/NAME`."""
        ...


@runtime_checkable
class OwnsParameters(Protocol):
    """A task with parameters of its own (a learned temperature), trained with the model."""

    def loss_module(self) -> nn.Module | None:
        """The module holding them (None: none after all)."""
        ...


def attach_loss_parameters(model: nn.Module, task: Any, device: torch.device) -> None:
    """Put the task's own parameters (if any) on `device` and under the model as
    `LOSS_MODULE`, before the model is laid out over ranks: they are then the model's for the
    optimizer, clipping and checkpoints."""
    module = task.loss_module() if isinstance(task, OwnsParameters) else None
    if module is None or not any(True for _ in module.parameters()):
        return
    if hasattr(model, LOSS_MODULE):
        raise ValueError(
            f"the model already has an attribute {LOSS_MODULE!r}, where the task's own "
            "parameters go; rename it"
        )
    model.add_module(LOSS_MODULE, module.to(device))


def loss_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name in the model, parameter) of the task's own parameters attached to `model`:
    data parallelism neither wraps, shards nor reduces them (the step does)."""
    module = dict(model.named_children()).get(LOSS_MODULE)
    if module is None:
        return []
    return [(f"{LOSS_MODULE}.{n}", p) for n, p in module.named_parameters()]
