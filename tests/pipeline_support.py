"""Support for tests/test_pipeline.py: a GPT that overflows in fp16 on one pipeline stage only.

The trainer's subprocesses build `OverflowGPT` by `model._target_`, so this module imports
only torch and the GPT it extends (cheap, no side effects).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.models.gpt import GPT


class _InfGradFor(torch.autograd.Function):
    """Identity on a block's output `x`; in backward, `x`'s gradient passes through unchanged
    while the parameter `w` gets an all-inf gradient. So only `w`'s stage sees the overflow:
    no inf reaches the activations another stage receives, nor the tied embedding."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.w_meta = (w.shape, w.dtype, w.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.w_meta
        return grad, torch.full(shape, float("inf"), dtype=dtype, device=device)


class OverflowGPT(GPT):
    """`GPT` whose first block, on its `overflow_at_call`-th training forward (1-based; eval
    and no-grad calls are not counted), routes its output through `_InfGradFor`, giving that
    block's `ln1.weight` an inf gradient: a GradScaler overflow on the stage holding block 0
    alone. Parameters and their initialization are GPT's own (same seed, same weights).

    The injection is a forward hook on the block module itself, which a pipeline stage (a
    shallow copy of the model, `GPT.pipeline_stage`) shares with the model.
    """

    def __init__(self, overflow_at_call: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.overflow_at_call = int(overflow_at_call)
        self.training_calls = 0
        self.poisoned_calls: list[int] = []
        self.blocks[0].register_forward_hook(self._maybe_poison)

    def _maybe_poison(self, block: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not (block.training and torch.is_grad_enabled()):
            return None
        self.training_calls += 1
        if self.training_calls != self.overflow_at_call:
            return None
        self.poisoned_calls.append(self.training_calls)
        return _InfGradFor.apply(out, block.ln1.weight)
