"""A GPT with a memory limit, for `train.micro_batch_size=auto` tests.

`LimitedGPT` raises a real `torch.OutOfMemoryError` when a training micro-batch holds more
than `fit` samples (or, with `fit_tokens`, more padded tokens): in forward, in backward
(a custom autograd Function on the token embeddings), or in `block`: as the first block
starts (under FSDP2 inside that unit, after its all-gather; in forward, the token embeddings
run in the root unit, between the root's all-gather and the first block's), or in `routing`:
a training forward without a graph (moe.balance=global's routing pass), on the `ranks`
given (None: every rank). `LowerLimit`, a callback, lowers the limit during a
run: after optimizer step `at_step` (0: before the first), the limit becomes `fit` after
`skip` more training forwards, so an OOM can land in the middle of a window. `OomInStep`
runs out of memory at the end of an optimizer step (after the update). Optionally a
BatchNorm over the embedding channels (running statistics: module buffers) and float64
parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.callbacks import Callback
from engine.distributed import unwrap
from trainer.models.gpt import GPT


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _OomInBackward(torch.autograd.Function):
    """Identity in forward; in backward, out of memory when the batch exceeds the limit."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, model: LimitedGPT) -> torch.Tensor:
        ctx.model = model
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.model.check(grad.shape[0], "backward")
        return grad, None


class LimitedGPT(GPT):
    def __init__(
        self,
        fit: int = 1_000_000,
        where: str = "forward",
        ranks: list[int] | None = None,
        batchnorm: bool = False,
        float64: bool = False,
        fit_tokens: int | None = None,
        **gpt: Any,
    ) -> None:
        super().__init__(**gpt)
        self.fit, self.where, self.ranks = fit, where, ranks
        self.fit_tokens = fit_tokens  # also out of memory above this many (padded) tokens
        self.armed: dict[str, Any] | None = None
        self.ooms: list[tuple[str, int]] = []  # (where, batch size) of each raised OOM
        self.last_batch = 0  # the last training micro-batch's size
        self.norm = nn.BatchNorm1d(self.tok_emb.embedding_dim) if batchnorm else None
        self.tok_emb.register_forward_hook(self._limit)
        # FSDP2 prepends its own pre-hook when it wraps the block: this runs after it.
        self.blocks[0].register_forward_pre_hook(self._limit_block)
        if float64:
            self.double()

    def check(self, batch: int, where: str, tokens: int = 0) -> None:
        mine = self.ranks is None or _rank() in self.ranks
        too_many = tokens > self.fit_tokens if self.fit_tokens is not None else False
        if where == self.where and (batch > self.fit or too_many) and mine:
            self.ooms.append((where, batch))
            raise torch.OutOfMemoryError(f"test limit: {batch} samples > {self.fit} ({where})")

    def _limit(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if self.training and not torch.is_grad_enabled():  # moe.balance=global's routing pass
            self.check(out.shape[0], "routing")
        if not (self.training and torch.is_grad_enabled()):
            return out
        self.last_batch = out.shape[0]
        if self.armed is not None:
            if self.armed["skip"] == 0:
                self.fit, self.where = self.armed["fit"], self.armed["where"]
                self.ranks = self.armed["ranks"]
                self.armed = None
            else:
                self.armed["skip"] -= 1
        self.check(out.shape[0], "forward", out.shape[0] * out.shape[1])
        if self.norm is not None:
            out = self.norm(out.transpose(1, 2)).transpose(1, 2)  # (B, C, T) for BatchNorm1d
        return _OomInBackward.apply(out, self)

    def _limit_block(self, module: nn.Module, args: Any) -> None:
        if self.training and torch.is_grad_enabled():
            self.check(args[0].shape[0], "block")


class LowerLimit(Callback):
    """After optimizer step `at_step` (0: at setup), the model's limit becomes `fit` (in
    `where`, on `ranks`) from the `skip`-th next training forward on."""

    def __init__(
        self,
        at_step: int,
        fit: int,
        skip: int = 0,
        where: str = "forward",
        ranks: list[int] | None = None,
    ) -> None:
        self.at_step = at_step
        self.arm = {"fit": fit, "skip": skip, "where": where, "ranks": ranks}

    def setup(self, ctx: Any) -> None:
        if self.at_step == 0:
            self.on_after_optimizer_step(ctx, 0)

    def on_after_optimizer_step(self, ctx: Any, step: int) -> None:
        if step == self.at_step:
            unwrap(ctx.model).armed = dict(self.arm)


class OomInStep(Callback):
    """Out of memory in the optimizer step from step `at_step` on, on `ranks`, while the
    window's micro-batches hold more than `fit` samples (their activations fragment a GPU's
    cache). Raised by an optimizer step post-hook: after the update was applied to every
    parameter and Adam's moments (created on the first step), the worst case to undo."""

    def __init__(self, at_step: int, fit: int = 0, ranks: list[int] | None = None) -> None:
        self.at_step, self.fit, self.ranks = at_step, fit, ranks
        self.pending = False

    def setup(self, ctx: Any) -> None:
        ctx.optimizer.register_step_post_hook(self._raise)

    def on_before_optimizer_step(self, ctx: Any) -> None:
        mine = self.ranks is None or _rank() in self.ranks
        large = unwrap(ctx.model).last_batch > self.fit
        self.pending = ctx.step + 1 >= self.at_step and mine and large

    def _raise(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.pending:
            self.pending = False
            raise torch.OutOfMemoryError("test limit: optimizer step")
