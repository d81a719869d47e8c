"""Exponential moving average of the weights, as a stateful callback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from engine.callbacks import AveragedWeights
from engine.distributed import unwrap


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shard of each FSDP parameter (a view), plain tensors as they are: an average
    is elementwise, so shards are averaged where they live, with no communication."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A copy of `t` laid out like `ref`: a full tensor (from an unsharded checkpoint) is cut
    into this rank's shard when `ref` is a DTensor (every rank holds `t`: no communication)."""
    if isinstance(ref, DTensor) and not isinstance(t, DTensor):
        t = t.to(ref.device)
        return distribute_tensor(t, ref.device_mesh, ref.placements, src_data_rank=None)
    return t.clone()


class EMA(AveragedWeights):
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

    def attach(self, model: nn.Module) -> None:
        """Allocate the average like the parameters (DTensor shards under FSDP); it holds
        nothing meaningful until the first update (`updates == 0`)."""
        if self.shadow is None:
            self.shadow = [p.detach().clone() for p in self._params(model)]

    def on_after_optimizer_step(self, ctx: Any, step: int) -> None:
        params = [p.detach() for p in self._params(ctx.model)]
        if self.shadow is None or self.updates == 0:  # the first average is the weights
            self.shadow = [p.clone() for p in params]
        elif self.shadow[0].device != params[0].device:  # restored from a CPU checkpoint
            self.shadow = [s.to(p.device) for s, p in zip(self.shadow, params)]
        decay = self.decay
        if self.warmup:
            decay = min(decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(_local(self.shadow), _local(params), 1.0 - decay)
        self.updates += 1

    @contextlib.contextmanager
    def weights_swapped(self, model: nn.Module) -> Iterator[None]:
        """Temporarily load the EMA weights into `model` (for evaluation)."""
        if self.shadow is None or self.updates == 0:
            yield
            return
        weights = _local([p.detach() for p in self._params(model)])  # share storage with them
        backup = [w.clone() for w in weights]
        with torch.no_grad():
            torch._foreach_copy_(weights, _local(self.shadow))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(weights, backup)

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        shadow = state["shadow"]
        if shadow is None:
            self.shadow = None
        elif self.shadow is not None and len(self.shadow) == len(shadow):  # laid out by setup
            self.shadow = [_like(t, ref) for t, ref in zip(shadow, self.shadow)]
        else:
            self.shadow = [t.clone() for t in shadow]
