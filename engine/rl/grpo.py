"""`task=grpo`: the clipped policy-gradient loss over a step's rollouts, exact on any layout.

A batch is a micro-batch of completions (engine/rl/rollouts.py `completion_batches`):
`input_ids` (B, T) (each row a prompt, its completion, padding), `shift_labels` (B, T) (the
completion token position t predicts, -100 elsewhere: the loss tokens, mask m_{i,t}), and
`advantages` (B,) (engine/rl/advantages.py); optionally `old_log_probs` and `ref_log_probs`
(B, T), aligned with `shift_labels`.

Per loss token, with pi = log p_theta(o_{i,t} | q, o_{i,<t}) (engine/tasks.py `TokenLogProbs`,
the log-probability path task=dpo takes, a chunk of tokens at a time):

    r_{i,t} = exp(pi - pi_old)              (pi_old: `old_log_probs`; absent, pi detached: r = 1)
    pg_{i,t} = -min(r A_i, clip(r, 1 - epsilon, 1 + epsilon_high) A_i)
    kl_{i,t} = exp(pi_ref - pi) - (pi_ref - pi) - 1          (k3, Schulman; with beta > 0)
    l_{i,t} = pg_{i,t} + beta kl_{i,t}

The objective of the step (N completions of the whole global batch, |o_i| = sum_t m_{i,t}
the loss tokens of completion i, L_max = `max_new_tokens`), per `loss_type`:

- `dapo` (DAPO, arXiv 2503.14476, token-level; the default, as TRL's):
      L = sum_i sum_t m_{i,t} l_{i,t} / sum_i |o_i|
  global denominator: the loss tokens of the whole batch (every micro-batch, every rank);
- `grpo` (DeepSeekMath, per-sequence mean, then the mean over the sequences):
      L = (1 / N') sum_i (1 / |o_i|) sum_t m_{i,t} l_{i,t},   N' = #{i : |o_i| > 0}
  global denominator: the completions that have a loss token;
- `dr_grpo` (Dr. GRPO, arXiv 2503.20783, a constant normalizer):
      L = sum_i sum_t m_{i,t} l_{i,t} / (N L_max)
  global denominator: N L_max, every completion counted (masked ones too: the constant
  does not depend on the data).

The cumulus rule makes each exact under accumulation and data parallelism: `count_items`
gives a micro-batch's share of the denominator (loss tokens; completions with a loss token;
B L_max), the step sums it over the window and the ranks once before any backward, and every
micro-batch back-propagates `loss_sum / global_count`, with `loss_sum` its share of the
numerator (sum m l; sum_i (sum_t m l) / |o_i|; sum m l). TRL's grpo and dr_grpo divide each
micro-batch by its own size and then by the accumulation steps (exact only when every
micro-batch holds as many completions), and TRL's grpo counts a masked (truncated) completion
in N with a zero loss: here it is not part of the objective. TRL's `bnpo` (the tokens of each
local micro-batch) is not offered: it varies with the micro-batch, and `dapo` is its exact form.

`num_iterations` (mu) > 1 reuses a rollout batch for mu optimizer steps: iteration 1 needs no
old log-probabilities (pi_old = pi detached, r = 1: the policy that generated is the one
training); later iterations take `old_log_probs` from the batch, the log-probabilities the
first iteration's forward returned (`GRPOOutput.log_probs`), which the caller keeps with the
rollouts. The reference's log-probabilities (beta > 0) come from `reference` (a frozen copy,
or the base with its adapters disabled: engine/preference.py) per micro-batch, or from the
batch's `ref_log_probs` when the caller kept them too.

Records (`GRPOOutput.sums`, float64 sums over the micro-batch's loss tokens, summed over the
window and the ranks; `grpo_records` divides): `clip_ratio` (tokens whose clipped branch is
the one taken: r < 1 - epsilon with A < 0, or r > 1 + epsilon_high with A > 0, as TRL's
`clip_ratio/region_mean`), `kl` (beta > 0), `entropy` (of each loss token's whole
distribution), over `tokens`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from engine.numerics.chunked_ce import IGNORE_INDEX
from engine.preference import FrozenCopy, Reference
from engine.tasks import ChunkSize, TaskOutputError, TokenLogProbs

# Batch fields that are the loss's, not the model's inputs.
LOSS_FIELDS = ("input_ids", "shift_labels", "advantages", "old_log_probs", "ref_log_probs")


class LossNormalization(Protocol):
    """A `task.loss_type`: how the step's sum of per-token losses is normalized, as each
    micro-batch's share of the global denominator (`items`) and the weight of each of its
    loss tokens in its `loss_sum` (`weights`)."""

    name: ClassVar[str]
    unit: ClassVar[str]  # what a loss item is (the throughput's unit)

    def items(self, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """The micro-batch's share of the denominator, int64, from its loss mask (B, T)."""
        ...

    def weights(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) float: each loss token's weight in the micro-batch's `loss_sum`."""
        ...


class TokenMean:
    """`dapo`: every loss token of the step weighs the same."""

    name, unit = "dapo", "tokens"

    def items(self, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        del max_new_tokens
        return mask.sum()

    def weights(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.float()


class SequenceMean:
    """`grpo`: each completion's tokens averaged, then the completions."""

    name, unit = "grpo", "completions"

    def items(self, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        del max_new_tokens
        return mask.any(-1).sum()

    def weights(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.float() / mask.sum(-1, keepdim=True).clamp(min=1)


class ConstantLength:
    """`dr_grpo`: every completion normalized by the same length, `max_new_tokens`."""

    name, unit = "dr_grpo", "items"

    def items(self, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        return torch.tensor(mask.shape[0] * max_new_tokens, dtype=torch.int64)

    def weights(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.float()


LOSS_TYPES: dict[str, LossNormalization] = {
    n.name: n for n in (TokenMean(), SequenceMean(), ConstantLength())
}
TOKEN_RECORDS = ("clip_ratio", "kl", "entropy")


@dataclass
class GRPOOutput:
    """What one micro-batch's forward gives: the loss sum (differentiable), the records'
    sums (detached float64), and the policy's and reference's log-probabilities (detached,
    (B, T)) for the caller to keep for later iterations (`old_log_probs`, `ref_log_probs`)."""

    loss_sum: torch.Tensor
    sums: dict[str, torch.Tensor]
    log_probs: torch.Tensor
    ref_log_probs: torch.Tensor | None = None


class GRPOTask:
    """The GRPO loss family over micro-batches of completions; see the module docstring.

    Args:
        max_new_tokens: L_max, the completions' longest length (dr_grpo's constant).
        num_generations: G, the completions of each prompt (the rollouts' group size: the
            loss reads the advantages, which already compare each completion with its group).
        loss_type: `dapo` (default), `grpo` or `dr_grpo`.
        epsilon, epsilon_high: the clip range [1 - epsilon, 1 + epsilon_high] of the ratio
            (epsilon_high null: epsilon; DAPO's clip-higher: 0.28).
        beta: the weight of the k3 KL to the reference (0: no reference, as TRL and DAPO).
        reference: what scores the batch as the reference (engine/preference.py's
            `FrozenCopy` or `adapters_disabled`); needed with beta > 0 unless batches carry
            `ref_log_probs`.
        record_entropy: record each loss token's entropy (one more exp over each chunk's
            logits in the forward).
        chunk_size, chunked_vocab_threshold: as task=dpo's (engine/tasks.py `TokenLogProbs`).
    """

    name = "task=grpo"

    def __init__(
        self,
        max_new_tokens: int,
        num_generations: int = 8,
        loss_type: str = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        reference: Reference | FrozenCopy | None = None,
        record_entropy: bool = True,
        chunk_size: ChunkSize = "auto",
        chunked_vocab_threshold: int = 32768,
    ) -> None:
        # Messages start with the argument's name: the trainer names the config key from it.
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        if not (isinstance(max_new_tokens, int) and max_new_tokens > 0):
            raise ValueError(f"max_new_tokens must be a positive number, got {max_new_tokens!r}")
        high = epsilon if epsilon_high is None else epsilon_high
        if not (0 < epsilon < 1 and high > 0):
            raise ValueError(
                f"epsilon must be in (0, 1) and epsilon_high positive, got {epsilon}, {high}"
            )
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        if not (isinstance(num_generations, int) and num_generations >= 2):
            raise ValueError(
                f"num_generations must be at least 2, got {num_generations!r}: a completion's "
                "advantage is its reward against the others of its group, and a group of one "
                "has no others (its advantage would always be 0)"
            )
        self.num_generations = num_generations
        self.normalization = LOSS_TYPES[loss_type]
        self.max_new_tokens = max_new_tokens
        self.epsilon, self.epsilon_high, self.beta = float(epsilon), float(high), float(beta)
        self.reference = reference
        self.record_entropy = record_entropy
        self.token_log_probs = TokenLogProbs(chunk_size, chunked_vocab_threshold, self.name)

    @property
    def loss_type(self) -> str:
        return self.normalization.name

    @property
    def unit(self) -> str:
        return self.normalization.unit

    @property
    def sum_names(self) -> tuple[str, ...]:
        """The records `loss_and_sums` sums (over `tokens`)."""
        names = ["clip_ratio", *(["kl"] if self.beta > 0 else [])]
        return (*names, *(["entropy"] if self.record_entropy else []), "tokens")

    # ---- the loss contract ----
    def count_items(self, batch: Any) -> torch.Tensor:
        _, labels, _ = self._fields(batch)
        return self.normalization.items(labels != IGNORE_INDEX, self.max_new_tokens)

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.loss_and_sums(model, batch).loss_sum

    def loss_and_sums(self, model: nn.Module, batch: Any) -> GRPOOutput:
        """One micro-batch's forward: its share of the step's loss and of its records."""
        ids, labels, rest = self._fields(batch)
        mask = labels != IGNORE_INDEX  # (B, T)
        ref = self._reference_log_probs(model, batch, ids, labels, rest)
        scores = self.token_log_probs(model, ids, labels, rest, with_entropy=self.record_entropy)
        log_probs = scores.log_probs  # (B, T)
        old = batch.get("old_log_probs")
        old = log_probs.detach() if old is None else old.to(log_probs)
        ratio = torch.exp(log_probs - old)  # (B, T)
        adv = batch["advantages"].to(log_probs)[:, None]  # (B, 1)
        clipped = ratio.clamp(1.0 - self.epsilon, 1.0 + self.epsilon_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        kl = None
        if ref is not None:
            delta = ref.to(log_probs) - log_probs
            kl = torch.exp(delta) - delta - 1.0
            per_token = per_token + self.beta * kl
        weights = self.normalization.weights(mask).to(per_token)
        loss_sum = torch.where(mask, per_token * weights, 0.0).sum()
        with torch.no_grad():
            took_clip = ((ratio < 1 - self.epsilon) & (adv < 0)) | (
                (ratio > 1 + self.epsilon_high) & (adv > 0)
            )
            sums = {"clip_ratio": (took_clip & mask).sum().double()}
            if kl is not None:
                sums["kl"] = torch.where(mask, kl, 0.0).sum().double()
            if scores.entropy is not None:
                sums["entropy"] = torch.where(mask, scores.entropy, 0.0).sum().double()
            sums["tokens"] = mask.sum().double()
        return GRPOOutput(loss_sum, sums, log_probs.detach(), ref)

    def log_probs(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Each loss token's log-probability under `model`, (B, T), 0 elsewhere (the old
        policy's before training on a rollout batch, a reference's: call under no_grad)."""
        ids, labels, rest = self._fields(batch)
        return self.token_log_probs(model, ids, labels, rest).log_probs

    # ---- the parts ----
    def _fields(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        needed = ("input_ids", "shift_labels", "advantages")
        if not (isinstance(batch, Mapping) and all(k in batch for k in needed)):
            kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise TaskOutputError(
                f"{self.name}: a batch is a dict of `input_ids`, `shift_labels` (completions, "
                f"positions) and `advantages` (completions,) (engine/rl/rollouts.py); got {kind}"
            )
        ids, labels, adv = batch["input_ids"], batch["shift_labels"], batch["advantages"]
        if ids.dim() != 2 or labels.shape != ids.shape or adv.shape != ids.shape[:1]:
            raise TaskOutputError(
                f"{self.name}: `input_ids` and `shift_labels` must be (completions, positions) "
                f"and `advantages` (completions,); got {tuple(ids.shape)}, "
                f"{tuple(labels.shape)} and {tuple(adv.shape)}"
            )
        for key in ("old_log_probs", "ref_log_probs"):
            if key in batch and batch[key].shape != labels.shape:
                raise TaskOutputError(
                    f"{self.name}: `{key}` must be aligned with `shift_labels` "
                    f"{tuple(labels.shape)}; got {tuple(batch[key].shape)}"
                )
        rest = {k: v for k, v in batch.items() if k not in LOSS_FIELDS}
        return ids, labels, rest

    def _reference_log_probs(
        self,
        model: nn.Module,
        batch: Mapping[str, Any],
        ids: torch.Tensor,
        labels: torch.Tensor,
        rest: dict[str, Any],
    ) -> torch.Tensor | None:
        if self.beta == 0:
            return None
        kept = batch.get("ref_log_probs")
        if kept is not None:
            return kept.detach()
        if self.reference is None:
            raise TaskOutputError(
                f"{self.name}: beta={self.beta} scores against a reference, and none is "
                "attached: pass reference=frozen_copy(model) (engine/preference.py), or give "
                "batches `ref_log_probs`"
            )
        # The reference's no-grad forward first: what it holds is freed before the policy's.
        with torch.no_grad(), self.reference(model) as scorer:
            return self.token_log_probs(scorer, ids, labels, rest).log_probs.detach()


def grpo_records(
    sums: Mapping[str, float], maxima: Mapping[str, float] | None = None
) -> dict[str, float]:
    """The step's records from its sums over every rank (`GRPOOutput.sums` of its forwards,
    `rollout_sums` of its rollouts) and maxima: exact means over the step's completions
    (rewards, lengths) or loss tokens (clip ratio, KL, entropy); `zero_std_groups` a count."""
    out: dict[str, float] = {}
    completions = max(float(sums.get("completions", 0.0)), 1.0)
    tokens = max(float(sums.get("tokens", 0.0)), 1.0)
    if "reward" in sums:
        out["reward"] = float(sums["reward"]) / max(float(sums["scored"]), 1.0)
        out["reward_std"] = float(sums["reward_std"]) / completions
        out["completion_len"] = float(sums["completion_len"]) / completions
        out["truncated_ratio"] = float(sums["truncated"]) / completions
        out["zero_std_groups"] = float(sums["zero_std_groups"])
    for key, value in sums.items():
        if key.startswith("reward/"):
            name = key.removeprefix("reward/")
            out[key] = float(value) / max(float(sums[f"scored/{name}"]), 1.0)
    for name in TOKEN_RECORDS:
        if name in sums:
            out[name] = float(sums[name]) / tokens
    out.update({k: float(v) for k, v in (maxima or {}).items()})
    return out
