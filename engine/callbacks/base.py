"""Callbacks at the moments that matter to autograd.

Each hook says what it may touch. A callback that changes anything else (the loss, the batch,
gradients outside `on_after_backward`) breaks the exactness guarantees, so don't.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from engine.step import StepContext


class Callback:
    """No-op base; override the hooks you need. Stateful callbacks also override the state pair."""

    # True when a checkpoint saved without this callback may still be resumed with it (its
    # state is a record, not something the trajectory depends on).
    state_optional = False

    @property
    def per_micro_batch(self) -> bool:
        """Whether it looks at single micro-batches (overrides `on_after_micro_batch`): its
        statistics then depend on how the window is split, and layouts that run the window
        their own way (pipeline stages, the out-of-memory guard's redone windows) refuse it."""
        return type(self).on_after_micro_batch is not Callback.on_after_micro_batch

    def summary(self, global_batch_size: int) -> str | None:
        """One line for the end-of-run summary (None: nothing to say)."""
        del global_batch_size
        return None

    def setup(self, ctx: StepContext) -> None:
        """Once, after the model is wrapped (and sharded) and before a checkpoint is restored.
        A callback whose state follows the parameters allocates it here, shaped and sharded
        like them, so a sharded checkpoint can be loaded into it in place."""

    def on_after_micro_batch(
        self, ctx: StepContext, batch: Any, global_count: torch.Tensor, last: bool
    ) -> None:
        """One micro-batch's backward has run: `.grad` holds the window's running sum so far,
        scaled by the loss scale, this rank's own (not yet synchronized) unless the
        micro-batch was synchronized (`last` under DDP). Read-only."""

    def on_after_backward(self, ctx: StepContext) -> None:
        """Gradients of the whole window are accumulated, synchronized and unscaled; not yet
        clipped. May read `p.grad`; may modify it in place (that changes the update), but must
        not change whether it is finite: under fp16 GradScaler has already decided to skip."""

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        """Gradients are clipped; the update has not happened. Read-only."""

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        """Parameters hold the new values of optimizer step `step` (1-based). May read them and
        keep its own copies (EMA); must not modify them."""

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation finished with `metrics`. Read-only."""

    def metrics(self) -> dict[str, Any]:
        """Values to add to the next training record (device tensors are fine: the record
        converts them). Called only when a record is written."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Tensors (DTensors under FSDP, saved shard by shard in a sharded checkpoint) and plain
        values. The same structure every time: a sharded checkpoint loads into it in place."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class AveragedWeights(Callback):
    """A callback that keeps its own copy of the weights (an EMA, say): the declared interface
    evaluation and `trainer.evaluate weights=NAME` use to find and swap them in.

    Subclasses implement `attach` (allocate the copy laid out like the model's parameters,
    sharded like them under FSDP) and `weights_swapped`; `evaluate` says whether each
    evaluation also reports the loss of these weights (`val/loss_NAME`).
    """

    evaluate: bool = True

    def setup(self, ctx: StepContext) -> None:
        self.attach(ctx.model)

    def attach(self, model: nn.Module) -> None:
        """Allocate the averaged weights like `model`'s trainable parameters (before a
        checkpoint is restored into them)."""
        raise NotImplementedError

    def weights_swapped(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Within the context `model` holds these weights; its own come back after."""
        raise NotImplementedError
