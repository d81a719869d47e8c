"""Exponential moving average of the weights, as a stateful callback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.callbacks import Callback
from engine.distributed import unwrap


class EMA(Callback):
    """Keeps `shadow = decay * shadow + (1 - decay) * w` after every optimizer step.

    Reads the parameters only after the update (never touches them or their gradients), so the
    training trajectory is the same with or without it. Checkpointed and restored exactly.
    With `evaluate=True` each evaluation also reports the loss of the EMA weights.

    Args:
        decay: weight of the old average per step.
        warmup: use `min(decay, (1 + n) / (10 + n))` for the n-th update, so early averages are
            not dominated by the random initialization.
        evaluate: also evaluate the EMA weights (`val/loss_ema`).
    """

    def __init__(self, decay: float = 0.999, warmup: bool = True, evaluate: bool = True) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.warmup = warmup
        self.evaluate = evaluate
        self.updates = 0
        self.shadow: list[torch.Tensor] | None = None

    def _params(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in unwrap(model).parameters() if p.requires_grad]

    def on_after_optimizer_step(self, ctx: Any, step: int) -> None:
        params = [p.detach() for p in self._params(ctx.model)]
        if self.shadow is None:
            self.shadow = [p.clone() for p in params]
        elif self.shadow[0].device != params[0].device:  # restored from a CPU checkpoint
            self.shadow = [s.to(p.device) for s, p in zip(self.shadow, params)]
        decay = self.decay
        if self.warmup:
            decay = min(decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.shadow, params, 1.0 - decay)
        self.updates += 1

    @contextlib.contextmanager
    def weights_swapped(self, model: nn.Module) -> Iterator[None]:
        """Temporarily load the EMA weights into `model` (for evaluation)."""
        if self.shadow is None:
            yield
            return
        params = self._params(model)
        backup = [p.detach().clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in params], self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in params], backup)

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        shadow = state["shadow"]
        self.shadow = None if shadow is None else [t.clone() for t in shadow]
