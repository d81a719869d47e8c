"""task=grpo's step: the window of prompts becomes a rollout batch, which the run's step
strategy (step=accumulate) trains on.

One optimizer step, in order:

    [every num_iterations-th step] generate (phase `generate`, eval mode, no grad, on the
    laid-out model) -> score -> advantages over whole groups -> completion micro-batches
    -> the inner step: count the window's loss items over every rank (one all-reduce, before
    any backward) -> forward + backward of each micro-batch -> update

A rollout batch trains `num_iterations` (mu) optimizer steps: the first with the policy that
generated (ratio 1), keeping each micro-batch's detached log-probabilities; the later ones
with those as the old policy's. The prompts of the mu - 1 steps that reuse a batch are not
used (an epoch of prompts lasts mu times the steps). A checkpoint taken within a batch's
iterations holds the batch and its old log-probabilities, gathered from every data-parallel
rank (`state_dict`: collective), so a resumed run trains on the same rollouts.

The records of the rollouts (`train/reward`, its std, each function's mean, completion
lengths, zero-std groups) are sums over this rank's completions, summed over the ranks when a
record is written (`RolloutRecords`): exact means over the step's completions on any layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from engine.callbacks import Callback
from engine.distributed import all_gather_object, all_reduce_max, all_reduce_sum, unwrap
from engine.rl.advantages import Advantages
from engine.rl.grpo import grpo_records
from engine.rl.rollouts import Group
from engine.step import Batch, StepContext, StepResult, StepStrategy
from trainer.config.errors import UserError
from trainer.data.loader import to_device
from trainer.rollout.generate import StepRollouts, generate_rollouts
from trainer.rollout.task import GRPORunTask


class RolloutStep:
    """The step strategy of task=grpo: rollouts from the window of prompts, then `inner`."""

    def __init__(self, inner: StepStrategy, task: GRPORunTask, ctx: StepContext) -> None:
        self.inner, self.task = inner, task
        self.dist, self.parallel = ctx.dist, ctx.parallel
        self.current: StepRollouts | None = None
        self.old: list[torch.Tensor] | None = None  # the first iteration's log-probabilities

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        mu = self.task.num_iterations
        iteration = ctx.step % mu
        if iteration == 0 or self.current is None:
            if iteration:
                raise UserError(
                    f"task.num_iterations={mu}: step {ctx.step + 1} trains on the rollouts of "
                    f"step {ctx.step - iteration + 1}, which the checkpoint resumed from does "
                    "not hold; resume from a checkpoint saved at a multiple of "
                    "task.num_iterations",
                    all_ranks=True,
                )
            ctx.clock.switch("generate")
            self.current, self.old = self._generate(ctx, window), None
            ctx.clock.switch("compute")
        batches = self.current.batches
        if self.old is not None:
            batches = [{**b, "old_log_probs": o} for b, o in zip(batches, self.old)]
        batches = [to_device(b, ctx.dist.device) for b in batches]
        keep = mu > 1 and self.old is None
        self.task.keep_log_probs, self.task.kept = keep, []
        try:
            result = self.inner(ctx, batches)
        finally:
            self.task.keep_log_probs = False
        if keep:
            self.old = [t.detach().cpu() for t in self.task.kept]
        self.task.kept = []
        if ctx.step % mu == 0:  # the batch's last iteration is done: nothing to keep
            self.old = None
        return result

    def _generate(self, ctx: StepContext, window: Sequence[Batch]) -> StepRollouts:
        r = self.task.rollouts
        assert r is not None, "the rollouts are attached after the layout"
        group = ctx.parallel.dp_group

        def over_ranks(t: torch.Tensor) -> torch.Tensor:
            summed = all_reduce_sum(t.to(ctx.dist.device), ctx.dist, group)
            return summed.to(t.device)

        with ctx.precision.autocast():
            return generate_rollouts(
                unwrap(ctx.model),  # DDP's wrapper: no generate; FSDP2 shards in place
                r.engine,
                window,
                r.train_row,
                r.decode,
                r.rewards,
                r.plan,
                r.seed,
                ctx.step,
                over_ranks,
            )

    # ---- a checkpoint within a rollout batch's iterations (collective)
    def state_dict(self) -> dict[str, Any]:
        if self.task.num_iterations == 1:
            return {}
        mine = None
        if self.current is not None and self.old is not None:
            mine = {"rollouts": _plain(self.current), "old": self.old}
        every = all_gather_object(mine, self.dist)  # (tp, pp, cp are refused: dp is the world)
        return {"ranks": every} if any(e is not None for e in every) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state.get("ranks")
        if not ranks:
            return
        if len(ranks) != self.parallel.dp_size:
            raise UserError(
                f"task.num_iterations: the checkpoint was saved within a rollout batch's "
                f"iterations on {len(ranks)} data-parallel ranks, and this run has "
                f"{self.parallel.dp_size}: the rollouts are each rank's own; resume on "
                f"{len(ranks)} ranks, or from a checkpoint saved at a multiple of "
                "task.num_iterations"
            )
        mine = ranks[self.parallel.dp_rank]
        self.current, self.old = _rollouts_of(mine["rollouts"]), list(mine["old"])


def _plain(rollouts: StepRollouts) -> dict[str, Any]:
    """A rollout batch as tensors and plain containers (a checkpoint loads weights only)."""
    adv = rollouts.advantages
    return {
        "groups": [dataclasses.asdict(g) for g in rollouts.groups],
        "texts": rollouts.texts,
        "advantages": {"values": adv.values, "group_std": adv.group_std, "zero_std": adv.zero_std},
        "batches": rollouts.batches,
        "sums": rollouts.sums,
        "maxima": rollouts.maxima,
    }


def _rollouts_of(plain: dict[str, Any]) -> StepRollouts:
    return StepRollouts(
        groups=[Group(**g) for g in plain["groups"]],
        texts=plain["texts"],
        advantages=Advantages(**plain["advantages"]),
        batches=plain["batches"],
        sums=plain["sums"],
        maxima=plain["maxima"],
    )


class RolloutRecords(Callback):
    """The rollouts' records of the step the last record covers: their sums over this rank's
    completions, summed (maxima: maxed) over the data-parallel ranks at a record (collective:
    every rank records). Stateless."""

    state_optional = True

    def __init__(self, step: RolloutStep) -> None:
        self.step = step
        self.ctx: StepContext | None = None

    def setup(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def metrics(self) -> dict[str, Any]:
        ctx, current = self.ctx, self.step.current
        if ctx is None or current is None:
            return {}
        group = ctx.parallel.dp_group
        names = sorted(current.sums)
        local = torch.stack([current.sums[k].double().reshape(()) for k in names])
        total = all_reduce_sum(local.to(ctx.dist.device), ctx.dist, group).cpu()
        top_names = sorted(current.maxima)
        tops = torch.stack([current.maxima[k].double().reshape(()) for k in top_names])
        top = all_reduce_max(tops.to(ctx.dist.device), ctx.dist).cpu()
        sums = {k: float(v) for k, v in zip(names, total)}
        maxima = {k: float(v) for k, v in zip(top_names, top)}
        records = grpo_records(sums, maxima)
        return {f"train/{k}": v for k, v in records.items()}
