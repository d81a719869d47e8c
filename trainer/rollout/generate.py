"""A step's rollouts from a window of prompt micro-batches: generated, scored, compared within
their groups, and laid out as the micro-batches of completions the step trains on.

`generate_rollouts` is what the run calls once per rollout batch, before the step: every
prompt of this rank's window (data=prompts' batches: `input_ids`, `prompt_lengths`, `index`,
`stream`) gets G completions from `engine` (one group per call, seeds of (seed, step, the
prompt's `stream` key, completion index): trainer/rollout/sampling.py), decoded (end tokens
and special tokens left out, as TRL decodes) and scored by `rewards`
(trainer/rollout/rewards.py) with the prompt's row; the advantages compare each completion
with its group (engine/rl/advantages.py; `batch` scaling sums over the ranks with
`over_ranks`); the completions become micro-batches of `micro_batch_size`
(engine/rl/rollouts.py). Which micro-batches the prompts came in does not matter: only the
prompts' order on the rank (the window's, flattened) and their rows do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.rl.advantages import Advantages, SumOverRanks, group_advantages
from engine.rl.rollouts import Group, completion_batches, rollout_sums, weighted_rewards
from trainer.rollout.engines import GenerationEngine
from trainer.rollout.rewards import Rewards
from trainer.rollout.sampling import Sampling, completion_seeds


@dataclass(frozen=True)
class RolloutPlan:
    """How a rollout batch is made.

    Args:
        num_generations: G, completions per prompt.
        sampling: max_new_tokens, temperature, top-p and the end tokens.
        micro_batch_size: completions per training micro-batch.
        scale_rewards: `group`, `batch` or `none` (engine/rl/advantages.py).
        mask_truncated: a completion cut at max_new_tokens has no loss token.
    """

    num_generations: int
    sampling: Sampling
    micro_batch_size: int
    scale_rewards: str = "group"
    mask_truncated: bool = False


@dataclass
class StepRollouts:
    """A rollout batch on this rank: its groups (with their completions' texts), their
    advantages, the window of completion micro-batches and the rollouts' record sums."""

    groups: list[Group]
    texts: list[list[str]]
    advantages: Advantages
    batches: list[dict[str, torch.Tensor]]
    sums: dict[str, torch.Tensor]
    maxima: dict[str, torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t


def completion_for_reward(text: str, prompt: Any) -> Any:
    """A completion as TRL hands it to a reward: its text, or for a prompt of messages one
    assistant message."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def generate_rollouts(
    model: nn.Module,
    engine: GenerationEngine,
    window: Sequence[Mapping[str, torch.Tensor]],
    row: Callable[[int], Mapping[str, Any]],
    decode: Callable[[list[int]], str],
    rewards: Rewards,
    plan: RolloutPlan,
    seed: int,
    step: int,
    over_ranks: SumOverRanks = _local,
) -> StepRollouts:
    """The rollouts of this rank's prompts in `window`; `row(index)` gives a prompt's row
    (`prompt` and its other fields), `decode` a completion's text (special tokens left out)."""
    groups, texts = [], []
    ends = set(plan.sampling.eos_ids)
    for batch in window:
        for k in range(batch["input_ids"].shape[0]):
            prompt = batch["input_ids"][k, : int(batch["prompt_lengths"][k])]
            index = int(batch["index"][k])
            # The prompt's stream key (a function of its position in the global batch), or
            # its row where the batch carries none.
            key = int(batch["stream"][k]) if "stream" in batch else index
            seeds = completion_seeds(seed, step, key, plan.num_generations)
            out = engine.generate(model, prompt, seeds, plan.sampling)
            ids = [out.tokens[i, : int(out.lengths[i])].tolist() for i in range(len(seeds))]
            said = [decode([t for t in c if t not in ends]) for c in ids]
            fields = dict(row(index))
            raw = fields.pop("prompt")
            scores = rewards.score(
                [raw] * len(seeds),
                [completion_for_reward(t, raw) for t in said],
                ids,
                [fields] * len(seeds),
            )
            groups.append(
                Group(
                    prompt.cpu(), out.tokens.cpu(), out.lengths.cpu(), out.truncated.cpu(), scores
                )
            )
            texts.append(said)
    advantages = group_advantages(
        weighted_rewards(groups, rewards.weights), plan.scale_rewards, over_ranks
    )
    batches = completion_batches(
        groups, advantages.values, plan.micro_batch_size, plan.mask_truncated
    )
    sums, maxima = rollout_sums(groups, advantages, rewards.weights, rewards.names)
    return StepRollouts(groups, texts, advantages, batches, sums, maxima)
