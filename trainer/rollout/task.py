"""`task=grpo` as the run builds it: engine/rl/grpo.py's loss over the step's completion
micro-batches, with the settings the rollouts read (group size, mu, reward scaling, truncation
masking, the reference mode), the records a step's forwards add up, and evaluation on the
validation prompts.

The step's forwards (engine/steps/accumulate.py) see completion micro-batches only: the run's
rollout step (trainer/rollout/step.py) turns each window of prompts into them first. A forward
returns its loss sum with the token records' sums (`ItemSums`: `clip_ratio`, `kl`, `entropy`
over the loss tokens, engine/callbacks/item_means.py records their exact means) and keeps its
detached log-probabilities while `keep_log_probs` is on (the old policy's, for the later
iterations of a rollout batch).

Evaluation (`eval_sums`) gets validation prompt batches: each prompt one greedy completion
(temperature 0: the policy's most likely answer, no noise), scored by the run's rewards;
`val/reward` (and `val/reward/NAME`) are the means over the validation prompts, and
`val/loss` is -val/reward (what the run maximizes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.rl.advantages import reward_scale
from engine.rl.grpo import GRPOTask
from engine.rl.rollouts import weighted_rewards
from engine.tasks import ChunkSize
from trainer.rollout.engines import GenerationEngine
from trainer.rollout.generate import RolloutPlan, generate_rollouts
from trainer.rollout.rewards import Rewards

REFERENCES = ("copy", "adapter")
EVAL_STEP = 2**32 - 1  # the validation completions' "step": no run reaches it, fixed for good


@dataclass
class Rollouts:
    """What generates and scores a run's completions (attached after the layout): the
    engine, the rewards, the plan, and the prompts' rows and decoder of each split."""

    engine: GenerationEngine
    rewards: Rewards
    plan: RolloutPlan
    seed: int
    train_row: Callable[[int], Mapping[str, Any]]
    val_row: Callable[[int], Mapping[str, Any]]
    decode: Callable[[list[int]], str]


class GRPORunTask:
    """The `_target_` of task=grpo (configs/task/grpo.yaml says what each argument does)."""

    name = "task=grpo"

    def __init__(
        self,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        num_generations: int = 8,
        loss_type: str = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        num_iterations: int = 1,
        beta: float = 0.0,
        reference: str | None = None,
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        record_entropy: bool = True,
        chunk_size: ChunkSize = "auto",
        chunked_vocab_threshold: int = 32768,
    ) -> None:
        # Messages start with the argument's name: the trainer names the config key from it.
        if not (isinstance(num_iterations, int) and num_iterations >= 1):
            raise ValueError(f"num_iterations must be at least 1, got {num_iterations!r}")
        if reference is not None and reference not in REFERENCES:
            raise ValueError(f"reference must be copy, adapter or null, got {reference!r}")
        reward_scale(scale_rewards)  # its own one-line refusal
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.loss = GRPOTask(
            max_new_tokens,
            num_generations=num_generations,
            loss_type=loss_type,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            beta=beta,
            record_entropy=record_entropy,
            chunk_size=chunk_size,
            chunked_vocab_threshold=chunked_vocab_threshold,
        )
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.num_iterations = num_iterations
        self.reference = reference
        self.scale_rewards = scale_rewards
        self.mask_truncated = bool(mask_truncated_completions)
        self.rollouts: Rollouts | None = None
        self.keep_log_probs = False
        self.kept: list[torch.Tensor] = []

    # ---- what the run reads
    @property
    def num_generations(self) -> int:
        return self.loss.num_generations

    @property
    def max_new_tokens(self) -> int:
        return self.loss.max_new_tokens

    @property
    def beta(self) -> float:
        return self.loss.beta

    @property
    def unit(self) -> str:
        return self.loss.unit

    @property
    def item_sum_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.loss.sum_names if n != "tokens")

    # ---- the loss contract (completion micro-batches)
    def count_items(self, batch: Any) -> torch.Tensor:
        if _is_prompts(batch):  # evaluation: one completion per prompt
            return torch.tensor(int(batch["input_ids"].shape[0]), dtype=torch.int64)
        return self.loss.count_items(batch)

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.loss_and_sums(model, batch)[0]

    def loss_and_sums(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        out = self.loss.loss_and_sums(model, batch)
        if self.keep_log_probs:
            self.kept.append(out.log_probs)
        sums = dict(out.sums)
        sums["items"] = sums.pop("tokens")  # the token records' denominator
        return out.loss_sum, sums

    # ---- evaluation (validation prompt batches)
    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        if not _is_prompts(batch):
            return {"loss": self.loss_sum(model, batch)}
        assert self.rollouts is not None, "the rollouts are attached after the layout"
        r = self.rollouts
        greedy = dataclasses.replace(r.plan.sampling, temperature=0.0)
        plan = dataclasses.replace(r.plan, num_generations=1, sampling=greedy)
        out = generate_rollouts(
            model, r.engine, [batch], r.val_row, r.decode, r.rewards, plan, r.seed, EVAL_STEP
        )
        total = weighted_rewards(out.groups, r.rewards.weights).nan_to_num(0.0).sum()
        sums = {"loss": -total, "reward": total}
        for f, name in enumerate(r.rewards.names):
            scores = torch.stack([g.rewards[:, f] for g in out.groups])
            sums[f"reward/{name}"] = scores.nansum()
        device = batch["input_ids"].device
        return {k: v.to(device, torch.float64) for k, v in sums.items()}


def _is_prompts(batch: Any) -> bool:
    return isinstance(batch, Mapping) and "prompt_lengths" in batch
