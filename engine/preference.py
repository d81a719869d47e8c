"""`task=dpo`: preference tuning on pairs (a prompt, a chosen and a rejected answer).

A batch holds whole pairs (trainer/data/preference.py): `input_ids` and `shift_labels` of
shape (pairs, 2, T), side 0 the chosen sequence and side 1 the rejected one, `shift_labels[...,
t]` the token position t predicts, -100 outside the answer; or packed, one row per pair,
(pairs, T), with `position_ids` restarting at 0 where the rejected side starts (two documents)
and `pair_side` (0 chosen, 1 rejected, -1 padding). A loss item is a pair: each pair's
loss needs the summed log-probabilities of both answers under the policy and (but for
`simpo`) under a frozen reference, so `loss_sum` is the sum of per-pair losses and
`count_items` the number of pairs. The accumulation step divides by the pairs of the whole
global batch, which makes the step exact under accumulation and data parallelism.

Losses (`loss_type`, engine/preference_losses.py: one small class each): `sigmoid` (DPO),
`ipo` (on length-normalized log-probabilities, as TRL's DPOTrainer), `simpo` (reference-free,
length-normalized, TRL's CPOTrainer), `hinge` (SLiC) and `robust` (robust DPO), each of the
pair's margin h = (pi_c - ref_c) - (pi_r - ref_r) (simpo: d = pi_c - pi_r).

Rewards (records `train/reward_*`, `val/reward_*`): beta (pi - ref) per side, on the
log-probabilities the loss reads (length-normalized for ipo and simpo; simpo has no ref),
their margin, and whether chosen beats rejected.

Memory: the log-probabilities are log p(label) = logit(label) - logsumexp(logits) per token,
`chunk_size` tokens at a time in fp32 (engine/numerics/chunked_ce.py). A model that declares
`OutputHead` with at least `chunked_vocab_threshold` classes (the in-tree GPT, transformers'
GPT-2/Llama families) hands its hidden states to `ChunkedLogProbs` in its forward, so the
(rows, T, V) logits are never held, in the policy's forward, its backward (each chunk's logits
recomputed) or the reference's; any other model's logits are read a chunk at a time
(`log_probs_in_chunks`), without an fp32 copy or log-softmax of the whole tensor.
`chunk_size=None` takes the whole fp32 log-softmax of the logits.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from engine.moe.routing import routing_not_counted
from engine.numerics.chunked_ce import IGNORE_INDEX
from engine.preference_losses import PreferenceLoss, preference_loss
from engine.tasks import ChunkSize, TaskOutputError, TokenLogProbs

REFERENCES = ("adapter", "copy", "precomputed", "none")
# `task.reference=precomputed`: the batch field holding each pair's reference log-probabilities,
# (pairs, 2), written before training (trainer/run/extensions/preference.py) and read by the data.
PRECOMPUTED = "reference_log_probs"
REWARDS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


@runtime_checkable
class Reference(Protocol):
    """A reference model to score with: called with the policy as the step calls it, it
    yields the module that scores a batch as the reference; `mode` is its `task.reference`."""

    mode: str

    def __call__(self, policy: nn.Module) -> contextlib.AbstractContextManager[nn.Module]: ...


class FrozenCopy:
    """`task.reference=copy`: the policy's module now, copied once, frozen and in eval mode.
    `module` may be replaced by the same copy laid out over the ranks (`lay_out`)."""

    mode = "copy"

    def __init__(self, model: nn.Module) -> None:
        self.module = copy.deepcopy(model).eval().requires_grad_(False)

    def lay_out(self, apply: Callable[[nn.Module], nn.Module]) -> None:
        """The copy sharded as the policy is (FSDP2: every rank holds its shard)."""
        self.module = apply(self.module).eval()

    @contextlib.contextmanager
    def __call__(self, policy: nn.Module) -> Iterator[nn.Module]:
        del policy
        yield self.module


def frozen_copy(model: nn.Module) -> FrozenCopy:
    return FrozenCopy(model)


class DisabledAdapters:
    """`task.reference=adapter`: the policy's base with its adapters off (peft's
    `disable_adapter()`): no second copy of the weights. `inner` is the module that runs: the
    user's model with peft's layers in it, outside any data-parallel wrapper (the reference
    takes no gradient, so no wrapper's hooks are needed)."""

    mode = "adapter"

    def __init__(self, peft_model: Any, inner: nn.Module) -> None:
        self.peft_model, self.inner = peft_model, inner

    @contextlib.contextmanager
    def __call__(self, policy: nn.Module) -> Iterator[nn.Module]:
        del policy
        with self.peft_model.disable_adapter():
            yield self.inner


def adapters_disabled(peft_model: Any, inner: nn.Module) -> DisabledAdapters:
    return DisabledAdapters(peft_model, inner)


class DPOTask:
    """Direct Preference Optimization and its variants; see the module docstring.

    Args:
        beta: the inverse temperature of the rewards (TRL's default 0.1).
        loss_type: a name of engine/preference_losses.py's `LOSSES`: `sigmoid`, `ipo`,
            `simpo`, `hinge` or `robust`.
        gamma: simpo's target margin (applied as -gamma inside the sigmoid).
        label_smoothing: eps, the assumed share of flipped preferences (sigmoid, simpo,
            robust).
        reference: `copy`, `adapter`, `precomputed` (each pair's reference log-probabilities
            come with the batch, field `reference_log_probs`, written by one pass of the
            initial model before training) or `none` (simpo); null: chosen by the trainer
            (none for simpo, adapter under adapter=lora, else copy), which builds the
            reference model and gives it to the task (`attach_reference`) before the first
            step; `reference_mode` says which the task scores with.
        chunk_size: tokens whose log-probabilities are computed at a time (`auto`: from the
            vocabulary and the device, as task=causal_lm's chunked loss); None: the whole
            fp32 log-softmax of the logits.
        chunked_vocab_threshold: a model declaring `OutputHead` with at least this many
            classes computes them from its hidden states, never holding the logits.
    """

    name = "task=dpo"
    unit = "pairs"
    item_sum_names = REWARDS

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        gamma: float = 0.5,
        label_smoothing: float = 0.0,
        reference: str | None = None,
        chunk_size: ChunkSize = "auto",
        chunked_vocab_threshold: int = 32768,
    ) -> None:
        self._token_log_probs = TokenLogProbs(chunk_size, chunked_vocab_threshold, self.name)
        loss = preference_loss(loss_type, float(beta), float(gamma), float(label_smoothing))
        if not (isinstance(beta, int | float) and beta > 0):
            raise ValueError(f"beta must be a positive number, got {beta!r}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
        if reference is not None and reference not in REFERENCES:
            raise ValueError(
                f"reference must be one of {', '.join(REFERENCES)} or null, got {reference!r}"
            )
        if not loss.needs_reference and reference not in (None, "none"):
            raise ValueError(f"reference: {loss_type} is reference-free; got reference={reference}")
        if loss.needs_reference and reference == "none":
            raise ValueError(
                f"reference: loss_type={loss_type} needs a reference (copy, adapter, precomputed)"
            )
        self.beta, self.loss_type = float(beta), loss_type
        self.gamma, self.label_smoothing = float(gamma), float(label_smoothing)
        self.loss: PreferenceLoss = loss
        self.reference = "none" if not loss.needs_reference else reference
        self._reference: Reference | None = None
        self.chunk_size, self.chunked_vocab_threshold = chunk_size, chunked_vocab_threshold

    @property
    def frozen_copy(self) -> FrozenCopy | None:
        """The reference when it is a frozen copy (to lay out like the policy)."""
        return self._reference if isinstance(self._reference, FrozenCopy) else None

    def attach_reference(self, reference: Reference) -> None:
        """The reference model the task scores with (`copy`, `adapter`; `precomputed` and
        `none` have none)."""
        self._reference = reference

    @property
    def reference_mode(self) -> str | None:
        """The `task.reference` the task scores with: its own when given, else the attached
        model's (None: nothing attached yet)."""
        if self.reference in ("none", "precomputed") or self._reference is None:
            return self.reference
        return self._reference.mode

    # ---- the loss contract ----
    def count_items(self, batch: Any) -> torch.Tensor:
        return torch.tensor(self._fields(batch)[0].shape[0], dtype=torch.int64)  # pairs

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self._pair_losses(model, batch)[0].sum()

    def loss_and_sums(
        self, model: nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss sum and the rewards' sums over the batch's pairs, with `items`: its
        pairs (engine/item_sums.py's `ItemSums`: the step adds them up)."""
        losses, rewards = self._pair_losses(model, batch)
        sums = {k: v.sum().double() for k, v in rewards.items()}
        sums["items"] = torch.tensor(float(len(losses)), dtype=torch.float64, device=losses.device)
        return losses.sum(), sums

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        losses, rewards = self._pair_losses(model, batch)
        return {"loss": losses.sum(), **{k: v.sum() for k, v in rewards.items()}}

    # ---- the arithmetic ----
    def _fields(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if not (isinstance(batch, Mapping) and "input_ids" in batch and "shift_labels" in batch):
            kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise TaskOutputError(
                f"{self.name}: a batch is a dict of `input_ids` and `shift_labels` of shape "
                f"(pairs, 2, positions) (data=preference); got {kind}"
            )
        ids, labels = batch["input_ids"], batch["shift_labels"]
        if "pair_side" in batch:  # packed: (pairs, T), one row per pair
            if ids.dim() != 2 or labels.shape != ids.shape or batch["pair_side"].shape != ids.shape:
                raise TaskOutputError(
                    f"{self.name}: packed pairs are `input_ids`, `shift_labels` and `pair_side` "
                    f"of one shape (pairs, positions); got {tuple(ids.shape)}, "
                    f"{tuple(labels.shape)} and {tuple(batch['pair_side'].shape)}"
                )
            rest = {k: v for k, v in batch.items() if k not in ("input_ids", "shift_labels")}
            return ids, labels, rest
        if ids.dim() != 3 or ids.shape[1] != 2 or labels.shape != ids.shape:
            raise TaskOutputError(
                f"{self.name}: `input_ids` and `shift_labels` must both be (pairs, 2, positions),"
                f" chosen then rejected; got {tuple(ids.shape)} and {tuple(labels.shape)}"
            )
        rest = {k: v for k, v in batch.items() if k not in ("input_ids", "shift_labels")}
        return ids, labels, rest

    def log_probs(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-probabilities of each side's answer tokens, (pairs, 2), and the answer
        tokens per side, (pairs, 2)."""
        ids, labels, rest = self._fields(batch)
        side = rest.pop("pair_side", None)
        rest.pop(PRECOMPUTED, None)  # the reference's, not the model's
        if side is None:  # (P, 2, T) -> (2P, T): each side its own row
            ids, labels = ids.flatten(0, 1), labels.flatten(0, 1)
            rest = {k: v.flatten(0, 1) for k, v in rest.items()}
        mask = labels != IGNORE_INDEX  # (rows, T)
        per_token = self._token_log_probs(model, ids, labels, rest).log_probs * mask  # (rows, T)
        if side is None:
            return per_token.sum(-1).view(-1, 2), mask.sum(-1).view(-1, 2)
        # Packed: each row's positions of side 0 and of side 1 summed apart, (P, 2).
        of_side = torch.stack([side == 0, side == 1], 1)  # (P, 2, T)
        return (per_token.unsqueeze(1) * of_side).sum(-1), (mask.unsqueeze(1) & of_side).sum(-1)

    def routed_positions(self, batch: Any) -> torch.Tensor:
        """(rows * T,) bool, in the order the model's forward routes them: the positions a
        mixture's balancing counts (engine/moe/sums.py's `MarksRoutedPositions`), each side's
        up to its last answer token's. Those are the positions the pair's loss depends on;
        the padding after them, added per micro-batch, is left out, so the balancing does not
        depend on how the pairs are split into micro-batches."""
        _, labels, rest = self._fields(batch)
        side = rest.get("pair_side")
        if side is None:  # (P, 2, T) -> (2P, T), as `log_probs` runs them
            return _up_to_last(labels.flatten(0, 1) != IGNORE_INDEX).reshape(-1)
        scored = labels != IGNORE_INDEX  # packed (P, T): each side a document of the row
        keep = [(side == s) & _up_to_last(scored & (side == s)) for s in (0, 1)]
        return (keep[0] | keep[1]).reshape(-1)

    def _pair_losses(
        self, model: nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair losses (P,) and per-pair rewards (detached)."""
        # The reference's no-grad forward first: what it holds (a model's logits) is freed
        # before the policy's forward keeps its own for backward.
        loss = self.loss
        ref = self._reference_log_probs(model, batch) if loss.needs_reference else None
        policy, lengths = self.log_probs(model, batch)  # (P, 2)
        if loss.length_normalized:
            policy = policy / lengths.clamp(min=1)
        scores = policy
        if ref is not None:
            ref = ref.to(policy)
            if loss.length_normalized:
                ref = ref / lengths.clamp(min=1)
            scores = policy - ref
        losses = loss(scores[:, 0] - scores[:, 1])  # of the pairs' margins
        rewards = self.beta * scores.detach()  # (P, 2)
        return losses, {
            "reward_chosen": rewards[:, 0],
            "reward_rejected": rewards[:, 1],
            "reward_margin": rewards[:, 0] - rewards[:, 1],
            "reward_accuracy": (rewards[:, 0] > rewards[:, 1]).to(rewards.dtype),
        }

    def _reference_log_probs(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.reference == "precomputed":
            ref = batch.get(PRECOMPUTED)
            pairs = self._fields(batch)[0].shape[0]
            if not isinstance(ref, torch.Tensor) or tuple(ref.shape) != (pairs, 2):
                got = tuple(ref.shape) if isinstance(ref, torch.Tensor) else "none"
                raise TaskOutputError(
                    f"{self.name}: reference=precomputed reads each pair's reference "
                    f"log-probabilities from the batch's `{PRECOMPUTED}` of shape (pairs, 2) = "
                    f"({pairs}, 2), got {got} (the trainer writes them before training for "
                    "data=preference)"
                )
            return ref.detach()
        if self._reference is None:
            raise TaskOutputError(
                f"{self.name}: loss_type={self.loss_type} scores against a reference model, and "
                "none is attached (the trainer attaches task.reference before training; "
                "elsewhere call attach_reference(frozen_copy(model)))"
            )
        # A mixture's balancing counts the policy's routing alone (engine/moe/routing.py).
        with torch.no_grad(), routing_not_counted(), self._reference(model) as ref:
            return self.log_probs(ref, batch)[0].detach()


def _up_to_last(marked: torch.Tensor) -> torch.Tensor:
    """(rows, T) bool: the positions at or before each row's last marked one."""
    return marked.flip(-1).cumsum(-1).flip(-1) > 0
