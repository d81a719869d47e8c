"""A step's rollouts: each prompt's G completions as generated and scored, and how they become
the micro-batches of completions that the accumulation step trains on.

A `Group` is one prompt and its completions; `completion_batches` lays a rank's groups out
row by row, group after group in the order given, `micro_batch_size` completions per
micro-batch. A row is the prompt's tokens, then the completion's, then padding (right padding:
every row's positions start at 0, and no real token attends to a pad after it, so a model needs
no attention mask). Its `shift_labels[t]` is the token position t predicts where that token is
a completion token (through the first end-of-sequence token), -100 elsewhere: those are the
loss tokens. With `mask_truncated` a completion that reached `max_new_tokens` without its end
token has no loss token (DAPO's overlong filtering); it still counts in its group's advantage.

`rollout_sums` gives the records of the rollouts themselves (rewards, lengths, zero-std
groups) as sums over this rank's completions, for the exact means over the step's
completions on any layout (engine/rl/grpo.py `grpo_records`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.numerics.chunked_ce import IGNORE_INDEX
from engine.rl.advantages import Advantages


@dataclass(frozen=True)
class Group:
    """One prompt and its G completions.

    Args:
        prompt: (P,) the prompt's token ids.
        completions: (G, L) the generated ids, each row padded after its `lengths` tokens.
        lengths: (G,) tokens generated, through the first end-of-sequence token.
        truncated: (G,) bool, no end-of-sequence token within `max_new_tokens`.
        rewards: (G, F) float64, each reward function's score (NaN: the function declined).
    """

    prompt: torch.Tensor
    completions: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor
    rewards: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.completions.shape[0])


def weighted_rewards(groups: Sequence[Group], weights: torch.Tensor) -> torch.Tensor:
    """(P, G) float64: each completion's sum over the reward functions of weight x score; NaN
    where every function declined (TRL's `nansum` and unscorable rows)."""
    scores = torch.stack([g.rewards.double() for g in groups])  # (P, G, F)
    total = (scores * weights.double().to(scores.device)).nansum(-1)
    return torch.where(scores.isnan().all(-1), torch.nan, total)


def completion_rows(
    groups: Sequence[Group], advantages: torch.Tensor, mask_truncated: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Every completion of `groups` as one sample (group after group): `input_ids` (P + n,),
    `shift_labels` (P + n,), `advantages` () (float64), for `n` generated tokens."""
    rows = []
    for g, group in enumerate(groups):
        p = len(group.prompt)
        for i in range(group.size):
            n = int(group.lengths[i])
            ids = torch.cat([group.prompt, group.completions[i, :n].to(group.prompt)])
            labels = torch.full_like(ids, IGNORE_INDEX)
            if n and not (mask_truncated and bool(group.truncated[i])):
                labels[p - 1 : p + n - 1] = ids[p:]  # position t predicts token t + 1
            rows.append({"input_ids": ids, "shift_labels": labels, "advantages": advantages[g, i]})
    return rows


def collate_completions(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows padded on the right to the longest: ids 0, labels -100 (and any per-position
    field given, such as `old_log_probs`, 0)."""
    width = max(len(r["input_ids"]) for r in rows)
    out: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if values[0].dim() == 0:
            out[key] = torch.stack(values)
            continue
        fill = IGNORE_INDEX if key == "shift_labels" else 0
        padded = values[0].new_full((len(values), width), fill)
        for k, v in enumerate(values):
            padded[k, : len(v)] = v
        out[key] = padded
    return out


def completion_batches(
    groups: Sequence[Group],
    advantages: torch.Tensor,
    micro_batch_size: int,
    mask_truncated: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """This rank's window: its completions, `micro_batch_size` per micro-batch (the last may
    hold fewer), each a dict of `input_ids` (B, T), `shift_labels` (B, T), `advantages` (B,)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    rows = completion_rows(groups, advantages, mask_truncated)
    return [
        collate_completions(rows[a : a + micro_batch_size])
        for a in range(0, len(rows), micro_batch_size)
    ]


def rollout_sums(
    groups: Sequence[Group], advantages: Advantages, weights: torch.Tensor, names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The rollouts' records on this rank: sums over its completions (float64, to be summed
    over the ranks; `completions` their number) and maxima (to be maxed over the ranks).

    `reward` (weighted), `reward/NAME` (each function, its scored completions: `scored/NAME`),
    `reward_std` (each completion its group's std: the mean over completions is the mean
    group std), `completion_len`, `truncated`, and `zero_std_groups` (counted once per group);
    maxima: `completion_len_max`."""
    total = weighted_rewards(groups, weights)  # (P, G)
    scores = torch.stack([g.rewards.double() for g in groups])  # (P, G, F)
    lengths = torch.stack([g.lengths for g in groups]).double()  # (P, G)
    truncated = torch.stack([g.truncated for g in groups]).double()
    size = total.shape[1]
    sums = {
        "completions": total.new_tensor(float(total.numel())),
        "reward": total.nansum(),
        "scored": (~total.isnan()).sum().double(),
        "reward_std": advantages.group_std.double().sum() * size,
        "completion_len": lengths.sum(),
        "truncated": truncated.sum(),
        "zero_std_groups": advantages.zero_std.double().sum(),
    }
    for f, name in enumerate(names):
        sums[f"reward/{name}"] = scores[..., f].nansum()
        sums[f"scored/{name}"] = (~scores[..., f].isnan()).sum().double()
    maxima = {"completion_len_max": lengths.max()}
    return sums, maxima
