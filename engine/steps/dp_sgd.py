"""DP-SGD (Abadi et al. 2016) as a step strategy, exact under accumulation and ranks.

Per optimizer step, over the global batch of every micro-batch of every rank:

    per-sample gradients g_i (torch.func: vmap of grad of the model as a function of its
    parameters) -> clip each: g_i · min(1, C/‖g_i‖) -> sum over the micro-batches into `.grad`
    -> one all-reduce (sum) over ranks -> + N(0, (σC)²), the same draw on every rank (from
    (seed, step)), so it is added exactly once -> / the global batch size in samples

C is `max_grad_norm`, σ `noise_multiplier`. Each step is the Gaussian mechanism on a sum of
sensitivity C; nothing above depends on how the global batch is cut into micro-batches and
ranks, so neither does the result (the accumulation "virtual steps" of Opacus need no special
case here). The divisor is the configured global batch size; with `data.sampling=poisson` that
is the *expected* size q·N, as in Opacus: dividing by the realized size would make the
normalization itself depend on the data.

The all-reduce is explicit: DDP's reducer hooks autograd's backward, and per-sample gradients
from torch.func never pass through it (DDP's averaging is thereby out of the picture too).
`train/epsilon` comes from `engine.steps.privacy` at sampling rate global batch / dataset size.

Models torch.func cannot differentiate per sample are refused: BatchNorm mixes the samples of
a batch (a per-sample gradient does not exist) and updates running statistics in place during
forward, which `vmap` forbids; use GroupNorm or LayerNorm. FSDP shards the parameters that
`functional_call` needs whole, and is refused too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_flatten, tree_map

from engine.callbacks import Callback
from engine.distributed import unwrap
from engine.parallel.base import Parallelism
from engine.step import Batch, StepContext, StepResult
from engine.steps.accumulate import count_window, finish_step
from engine.steps.privacy import RDPAccountant, noise_for_epsilon

# The precisions whose forward torch.func's vmap runs per sample: fp16's loss scaler and fp8's
# float8 layers (torchao's autograd functions, which vmap cannot transform) do not.
DP_SGD_PRECISIONS = ("fp32", "bf16")


def check_per_sample_model(model: nn.Module, parallel: Parallelism) -> None:
    """Raise ValueError (one paragraph) for a model whose per-sample gradients do not exist."""
    if parallel.shards_parameters:
        raise ValueError(
            "step=dp_sgd needs every parameter whole on each rank to take per-sample gradients "
            "with torch.func; FSDP shards them. Use dist.strategy=ddp: per-sample gradients "
            "dominate DP-SGD's memory anyway, and train.micro_batch_size bounds them."
        )
    norms = [
        type(m).__name__
        for m in unwrap(model).modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    if norms:
        raise ValueError(
            f"step=dp_sgd cannot train a model with {norms[0]}: batch normalization mixes the "
            "samples of a batch, so a sample's gradient depends on the others and per-sample "
            "clipping bounds nothing, and it updates its running statistics in place during "
            "forward, which torch.func's vmap forbids. Replace it with GroupNorm or LayerNorm "
            "(Opacus refuses it for the same reason)."
        )


def _rows(batch: Batch) -> int:
    """Samples in `batch`: the leading dimension of its tensors."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    if not leaves:
        raise TypeError("step=dp_sgd: a batch holds no tensor to take samples from")
    return leaves[0].shape[0]


def noise_seed(seed: int, step: int) -> int:
    """The noise generator's seed of optimizer step `step`: the same on every rank."""
    return int(np.random.SeedSequence([seed, step, 0xD9]).generate_state(1)[0])


class DPSGDStep:
    """Args:
    max_grad_norm: C, the clipping bound of each sample's gradient (L2 over all parameters).
    noise_multiplier: σ; the noise added to the sum has standard deviation σ·C. None: 1.0,
        or the one `target_epsilon` chooses.
    delta: the δ at which `train/epsilon` is reported (and `target_epsilon` is met).
    seed: seeds the noise (with the step number); the run's `seed` by default config.
    target_epsilon: instead of σ, the ε to spend over `steps` steps: σ is chosen in
        `set_sampling`, once the sampling rate is known, as Opacus's
        `make_private_with_epsilon` chooses it (`engine.steps.privacy.noise_for_epsilon`).
        A checkpoint keeps the chosen σ, so a resumed (or extended) run adds the same noise
        and its ε stays the truth.
    steps: the run's optimizer steps (`${train.max_steps}` by default config).
    """

    def __init__(
        self,
        max_grad_norm: float,
        noise_multiplier: float | None = None,
        delta: float = 1e-5,
        seed: int = 0,
        target_epsilon: float | None = None,
        steps: int | None = None,
    ) -> None:
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        if noise_multiplier is not None and target_epsilon is not None:
            raise ValueError(
                f"noise_multiplier and target_epsilon are both set ({noise_multiplier:g} and "
                f"{target_epsilon:g}); give one: step.noise_multiplier fixes the noise and "
                "reports the epsilon it spends, step.target_epsilon chooses the noise multiplier "
                "that spends at most that epsilon at step.delta over train.max_steps (as Opacus's "
                "make_private_with_epsilon). Set the other to null"
            )
        if noise_multiplier is not None and noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if target_epsilon is not None and not target_epsilon > 0:
            raise ValueError(f"target_epsilon must be positive, got {target_epsilon}")
        if target_epsilon is not None and (steps is None or steps < 1):
            raise ValueError(
                f"steps must be the run's optimizer steps (>= 1) to choose the noise for "
                f"target_epsilon, got {steps}; configs/step/dp_sgd.yaml sets ${{train.max_steps}}"
            )
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.max_grad_norm = float(max_grad_norm)
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        # σ; with a target, chosen by set_sampling (or restored from a checkpoint).
        self.noise_multiplier: float | None = (
            float(noise_multiplier)
            if noise_multiplier is not None
            else (1.0 if target_epsilon is None else None)
        )
        self.delta = float(delta)
        self.seed = int(seed)
        self.steps = steps
        # Global batch in samples (expected, if Poisson); None: the realized size of each step.
        self.batch_size: int | None = None
        self.sample_rate: float | None = None
        self.accountant: RDPAccountant | None = None
        self._checked = False

    def set_sampling(self, global_batch_size: int, dataset_size: int) -> None:
        """The global batch in samples and the dataset it is drawn from: the divisor of the
        noisy sum and the sampling rate q = global batch / dataset size of the accountant.
        With `target_epsilon`, σ is chosen here (ValueError, one line, if out of reach)."""
        self.batch_size = int(global_batch_size)
        self.sample_rate = min(1.0, global_batch_size / dataset_size)
        if self.noise_multiplier is None:  # a target, and no σ restored
            self.noise_multiplier = noise_for_epsilon(
                self.target_epsilon, self.delta, self.sample_rate, self.steps
            )
        self._account()

    def _account(self) -> None:
        sigma = self.noise_multiplier
        self.accountant = None
        if self.sample_rate is not None and sigma is not None and sigma > 0:
            self.accountant = RDPAccountant(self.sample_rate, sigma)

    def state_dict(self) -> dict[str, Any]:
        """The σ a target chose (nothing otherwise: σ is the config's)."""
        if self.target_epsilon is None:
            return {}
        return {"noise_multiplier": self.noise_multiplier}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sigma = state.get("noise_multiplier")
        if self.target_epsilon is not None and sigma is not None:
            self.noise_multiplier = float(sigma)  # the noise the trajectory so far was made with
            self._account()

    def epsilon(self, steps: int) -> float:
        """ε spent after `steps` optimizer steps (inf without noise)."""
        if steps == 0:
            return 0.0
        return (
            float("inf") if self.accountant is None else self.accountant.epsilon(steps, self.delta)
        )

    def summary(self, steps: int) -> str:
        """One line for the end-of-run summary (indented as its other lines): ε spent, at
        what δ, the noise multiplier and sampling rate, and the target if one chose σ."""
        sigma, rate = self.noise_multiplier, self.sample_rate
        # ASCII: a console in a Latin-1 locale must not fail on a Greek letter.
        text = f"  privacy: epsilon {self.epsilon(steps):.5g} at delta {self.delta:g}"
        text += f" after {steps} step{'s' if steps != 1 else ''}"
        if sigma is not None:
            text += f" (noise multiplier {sigma:.6g}"
            text += f", sampling rate {rate:.4g})" if rate is not None else ")"
        if self.target_epsilon is not None:
            text += f"; target epsilon {self.target_epsilon:g} over {self.steps} step"
            text += "s" if self.steps != 1 else ""
        return text

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        if not self._checked:
            if self.noise_multiplier is None:
                raise ValueError("target_epsilon: call set_sampling() before the first step")
            check_per_sample_model(ctx.model, ctx.parallel)
            if ctx.precision.mode not in DP_SGD_PRECISIONS:
                raise ValueError(
                    f"step=dp_sgd supports train.precision=fp32|bf16, not {ctx.precision.mode}"
                )
            self._checked = True
        ctx.optimizer.zero_grad(set_to_none=True)
        global_count = count_window(ctx, window)  # loss items: what train/loss is a mean of
        model = unwrap(ctx.model)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        summed = {n: torch.zeros_like(p) for n, p in params.items()}  # Σ clipped g_i
        loss_sum = torch.zeros((), device=ctx.dist.device)
        samples = 0
        for batch in window:
            rows = 0 if batch is None else _rows(batch)
            if rows == 0:  # an empty Poisson micro-batch
                continue
            samples += rows
            loss = self._clipped_sum_into(ctx, model, params, batch, summed)
            # fp32, or the loss's own precision when higher (float64 models)
            loss_sum = loss_sum + (loss if loss.dtype == torch.float64 else loss.float())
        grads = list(summed.values())
        # One collective for the whole gradient and the sample count.
        flat = torch.cat([*(g.flatten() for g in grads), grads[0].new_full((1,), samples)])
        if ctx.dist.distributed:
            with ctx.clock.collective("gradient all-reduce"):
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        pieces = flat.split([g.numel() for g in grads] + [1])
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(pieces, grads)])
        self._add_noise(ctx, grads)
        # The configured (expected) global batch; without `set_sampling`, the realized one.
        divisor = self.batch_size if self.batch_size is not None else pieces[-1].clamp(min=1)
        for p, g in zip(params.values(), grads):
            p.grad = g.div_(divisor)
        return finish_step(ctx, loss_sum, global_count)

    def _clipped_sum_into(
        self,
        ctx: StepContext,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        batch: Batch,
        summed: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Add this micro-batch's clipped per-sample gradients to `summed`; its loss sum."""
        detached = {n: p.detach() for n, p in params.items()}
        frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        buffers = dict(model.named_buffers())
        task = ctx.task

        def sample_loss(weights: dict[str, torch.Tensor], sample: Batch) -> torch.Tensor:
            one = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, sample)
            functional = _Functional(model, {**weights, **frozen}, buffers)
            with ctx.precision.autocast():
                return task.loss_sum(functional, one)

        in_dims = tree_map(lambda t: 0 if isinstance(t, torch.Tensor) else None, batch)
        per_sample = vmap(
            grad_and_value(sample_loss), in_dims=(None, in_dims), randomness="different"
        )
        grads, losses = per_sample(detached, batch)  # {name: (n, *shape)}, (n,)
        with torch.no_grad():
            # Each parameter's per-sample norms in its own dtype (one pass, no float64 copy of
            # the per-sample gradients), combined in float64: (P, n) -> (n,)
            per_param = [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()]
            norms = torch.linalg.vector_norm(torch.stack(per_param).double(), dim=0)
            # min(1, C/‖g_i‖), exactly: no epsilon in the denominator.
            factor = torch.where(
                norms > self.max_grad_norm, self.max_grad_norm / norms, torch.ones_like(norms)
            )
            for name, g in grads.items():
                summed[name] += torch.einsum("n,n...->...", factor.to(g.dtype), g)
        return losses.detach().sum()

    def _add_noise(self, ctx: StepContext, grads: list[torch.Tensor]) -> None:
        """N(0, (σC)²) on every coordinate, drawn on the CPU from (seed, step): the same on
        every rank and device, added after the sum, so once."""
        if self.noise_multiplier == 0:
            return
        gen = torch.Generator().manual_seed(noise_seed(self.seed, ctx.step))
        std = self.noise_multiplier * self.max_grad_norm
        for g in grads:
            noise = torch.randn(g.shape, generator=gen, dtype=g.dtype)
            g.add_(noise.to(g.device), alpha=std)


class _Functional(nn.Module):
    """`model` called with the given parameters and buffers (for `Task.loss_sum`)."""

    def __init__(self, model: nn.Module, params: dict[str, Any], buffers: dict[str, Any]) -> None:
        super().__init__()
        object.__setattr__(self, "inner", model)  # not a submodule: no parameters of its own
        self.tensors = {**buffers, **params}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.inner, self.tensors, args, kwargs, strict=False)


class PrivacySpent(Callback):
    """Records `train/epsilon`: ε at the step's δ after the optimizer steps so far. Stateless:
    the step count (restored from checkpoints) is all the accounting needs."""

    def __init__(self, step: DPSGDStep) -> None:
        self.step_fn = step
        self.steps = 0

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        self.steps = step

    def metrics(self) -> dict[str, Any]:
        return {"train/epsilon": self.step_fn.epsilon(self.steps)}

    def summary(self, global_batch_size: int) -> str:
        """The end-of-run line: ε spent so far, δ, the noise multiplier, the sampling rate
        and the target, if one chose the noise."""
        del global_batch_size
        return self.step_fn.summary(self.steps)
