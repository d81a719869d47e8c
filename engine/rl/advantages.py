"""Group-relative advantages (`task.scale_rewards`): each completion's reward against its group's.

A group is one prompt's G completions. With r_i the weighted reward of completion i of a
group (the sum over the reward functions of weight x score), mean_g and std_g its group's mean
and standard deviation (Bessel-corrected, as TRL's `nanstd`), and std_B that of every
completion of the step (all data-parallel ranks):

- `group` (TRL's default, DeepSeekMath's GRPO): A_i = (r_i - mean_g) / (std_g + 1e-4);
- `batch` (PPO Lite): A_i = (r_i - mean_g) / (std_B + 1e-4);
- `none` (Dr. GRPO, which drops the std for its question-level difficulty bias):
  A_i = r_i - mean_g.

A group whose rewards are all equal carries no signal: its advantages are exactly 0 (not the
round-off of r - mean) and it is counted as a zero-std group (`train/zero_std_groups`); that is
not an error. A completion every reward function declined to score (each returned None, as a
TRL reward function may for a row it does not apply to) is NaN: left out of its group's mean
and std and given advantage 0, as TRL does. The 1e-4 is TRL's, so an advantage here is TRL's.

Groups are whole on a rank (a prompt's completions are generated together), so `group` and
`none` need no communication; `batch` sums (count, sum) and then the squared deviations over
the data-parallel ranks: two all-reduces of two numbers per step, before any backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

STD_EPS = 1e-4  # TRL's: A = (r - mean) / (std + 1e-4)
# Sums a float64 tensor over the data-parallel ranks (the identity on one process).
SumOverRanks = Callable[[torch.Tensor], torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t


def _group_std(rewards: torch.Tensor) -> torch.Tensor:
    """(P, G) -> (P,): each group's Bessel-corrected std over its scored completions (0 with
    fewer than two)."""
    scored = ~rewards.isnan()
    n = scored.sum(1)  # (P,)
    mean = rewards.nansum(1) / n.clamp(min=1)
    dev = torch.where(scored, rewards - mean[:, None], 0.0)
    var = (dev**2).sum(1) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), 0.0)


class RewardScale(Protocol):
    """What divides r - mean_g: a `task.scale_rewards` mode."""

    name: ClassVar[str]

    def divisor(self, rewards: torch.Tensor, over_ranks: SumOverRanks) -> torch.Tensor:
        """(P, 1) or a scalar, for the groups `rewards` (P, G) of this rank."""
        ...


class GroupScale:
    """`group`: each group's own std."""

    name = "group"

    def divisor(self, rewards: torch.Tensor, over_ranks: SumOverRanks) -> torch.Tensor:
        del over_ranks
        return _group_std(rewards)[:, None] + STD_EPS


class BatchScale:
    """`batch`: the std of every scored completion of the step, over all ranks."""

    name = "batch"

    def divisor(self, rewards: torch.Tensor, over_ranks: SumOverRanks) -> torch.Tensor:
        scored = ~rewards.isnan()
        n_sum = over_ranks(torch.stack([scored.sum().to(rewards), rewards.nansum()]))
        n, mean = n_sum[0], n_sum[1] / n_sum[0].clamp(min=1)
        # Two passes (deviations from the global mean), not sum(r^2) - n mean^2: no cancellation.
        squares = over_ranks(torch.where(scored, rewards - mean, 0.0).pow(2).sum().reshape(1))[0]
        std = torch.where(n > 1, (squares / (n - 1).clamp(min=1)).sqrt(), 0.0)
        return std + STD_EPS


class NoScale:
    """`none`: r - mean_g alone (Dr. GRPO)."""

    name = "none"

    def divisor(self, rewards: torch.Tensor, over_ranks: SumOverRanks) -> torch.Tensor:
        del over_ranks
        return torch.ones((), dtype=rewards.dtype, device=rewards.device)


SCALES: dict[str, RewardScale] = {s.name: s for s in (GroupScale(), BatchScale(), NoScale())}


def reward_scale(name: str) -> RewardScale:
    """The mode `task.scale_rewards=name`."""
    if name not in SCALES:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALES)}, got {name!r}")
    return SCALES[name]


@dataclass(frozen=True)
class Advantages:
    """Per completion of this rank's groups (P, G): the advantage (float64), and per group
    its reward std (the records' `reward_std`) and whether its rewards are all equal."""

    values: torch.Tensor  # (P, G)
    group_std: torch.Tensor  # (P,)
    zero_std: torch.Tensor  # (P,) bool


def group_advantages(
    rewards: torch.Tensor,
    scale: RewardScale | str = "group",
    over_ranks: SumOverRanks = _local,
) -> Advantages:
    """The advantages of this rank's groups' weighted rewards `rewards` (P, G) (NaN: not
    scored). `over_ranks` sums over the data-parallel ranks (needed by `batch` only; every
    rank calls it the same number of times)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (groups, completions), got shape {tuple(rewards.shape)}")
    mode = reward_scale(scale) if isinstance(scale, str) else scale
    rewards = rewards.double()
    scored = ~rewards.isnan()
    n = scored.sum(1, keepdim=True)
    mean = rewards.nansum(1, keepdim=True) / n.clamp(min=1)  # (P, 1)
    high = torch.where(scored, rewards, -torch.inf).amax(1)
    low = torch.where(scored, rewards, torch.inf).amin(1)
    zero_std = ~(high > low)  # all scored rewards equal (or fewer than two scored)
    divisor = mode.divisor(rewards, over_ranks)
    values = (rewards - mean) / divisor
    values = torch.where(scored & ~zero_std[:, None], values, 0.0)
    return Advantages(values, _group_std(rewards), zero_std)
