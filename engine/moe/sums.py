"""What the load balancing counts: the routed positions that count (`routed_mask`), one
micro-batch's per-layer sums (`LayerSums`), the whole step's (`StepSums`) and what is known
of the window being stepped (`Window`). engine/moe/balance.py explains the
step; the modes (engine/moe/strategies.py) read these."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from engine.moe.objective import BalanceObjective
from engine.moe.routing import HALF, Routing
from engine.numerics.chunked_ce import IGNORE_INDEX
from engine.steps.cached import RandomState


@runtime_checkable
class MarksRoutedPositions(Protocol):
    """A task whose batches say which positions count their own way (task=dpo's pairs, padded
    per micro-batch without an attention mask): `routed_positions(batch)`, (n,) bool over the
    n positions its model's forward routes, in order."""

    def routed_positions(self, batch: Any) -> torch.Tensor: ...


def routed_mask(batch: Any, n: int, task: Any = None) -> torch.Tensor:
    """(n,) bool: which of the n routed positions count (engine/moe/balance.py's docstring);
    `task`'s own marks when it declares them (`MarksRoutedPositions`)."""
    mask: torch.Tensor | None = None
    if isinstance(task, MarksRoutedPositions):
        mask = task.routed_positions(batch)
    elif isinstance(batch, Mapping):
        if isinstance(batch.get("attention_mask"), torch.Tensor):
            mask = batch["attention_mask"] != 0
    elif isinstance(batch, tuple | list) and len(batch) == 2:
        inputs, targets = batch
        aligned = isinstance(targets, torch.Tensor) and isinstance(inputs, torch.Tensor)
        if aligned and targets.shape == inputs.shape:
            mask = targets != IGNORE_INDEX
    if mask is None:
        return torch.ones(n, dtype=torch.bool)
    if mask.numel() != n:
        raise ValueError(
            f"the routers routed {n} positions but the batch marks {mask.numel()} "
            "(attention_mask or targets): a router must route every input position once"
        )
    return mask.reshape(-1)


@dataclass
class LayerSums:
    """One micro-batch's routing, per layer: assignments (L, E), summed probabilities (L, E)
    with their graph, summed squared logsumexps (L,) with theirs, and counted tokens."""

    counts: torch.Tensor
    probs: torch.Tensor
    lse2: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def of(cls, routings: Sequence[Routing], mask: torch.Tensor) -> LayerSums:
        counts, probs, lse2 = [], [], []
        for r in routings:
            logits = r.logits.float() if r.logits.dtype in HALF else r.logits
            # Masked, not indexed: no shape that depends on the values (no host sync on a
            # GPU; a planned step's fake tensors have no values).
            m = mask.to(logits.device)  # (N,)
            E, k = logits.shape[-1], r.experts.shape[-1]
            slots = m.to(torch.int64).repeat_interleave(k)  # (N*k,) 1 where the token counts
            zeros = torch.zeros(E, dtype=torch.int64, device=logits.device)
            counts.append(zeros.scatter_add(0, r.experts.reshape(-1), slots))
            p = torch.where(m.unsqueeze(-1), F.softmax(logits, dim=-1), 0.0)  # (N, E)
            probs.append(p.sum(0))
            lse2.append(torch.where(m, torch.logsumexp(logits, dim=-1).pow(2), 0.0).sum())
        tokens = mask.sum().to(probs[0].device)
        return cls(torch.stack(counts), torch.stack(probs), torch.stack(lse2), tokens)

    def flat(self) -> torch.Tensor:
        """Everything detached, in float64, as one vector (one all-reduce)."""
        parts = [self.counts, self.probs.detach(), self.lse2.detach(), self.tokens]
        return torch.cat([p.to(torch.float64).reshape(-1) for p in parts])


@dataclass(frozen=True)
class MicroRouting:
    """One micro-batch's routing as the modes see it: its per-layer sums, the routings they
    came from (per layer, in forward order), and the batch itself."""

    sums: LayerSums
    routings: Sequence[Routing]
    batch: Any
    top_k: int


@dataclass
class StepSums:
    """The whole step's sums (float64, over every micro-batch and rank): assignments (L, E),
    probabilities (L, E), squared logsumexps (L,), tokens; `own`, what a mode adds to them
    (its own loss's value, summed over the micro-batches: `Balance.own`); and the records
    they give."""

    counts: torch.Tensor
    probs: torch.Tensor
    lse2: torch.Tensor
    tokens: torch.Tensor
    top_k: int
    own: torch.Tensor | None = None

    @classmethod
    def unflat(cls, flat: torch.Tensor, layers: int, experts: int, top_k: int) -> StepSums:
        le = layers * experts
        end = 2 * le + layers + 1  # the tokens' place; a mode's own values follow
        return cls(
            flat[:le].view(layers, experts),
            flat[le : 2 * le].view(layers, experts),
            flat[2 * le : 2 * le + layers],
            flat[end - 1],
            top_k,
            flat[end:] if flat.numel() > end else None,
        )

    @property
    def f(self) -> torch.Tensor:
        """(L, E): each expert's share of the assignments."""
        return self.counts / (self.tokens.clamp(min=1) * self.top_k)

    def records(self, objective: BalanceObjective) -> dict[str, torch.Tensor]:
        T = self.tokens.clamp(min=1)
        load = self.counts.max(-1).values / self.counts.mean(-1).clamp(min=1e-30)
        return {
            "train/moe_aux_loss": objective.aux(self.counts, self.probs, self.tokens, self.top_k),
            "train/moe_z_loss": (self.lse2 / T).mean(),
            "train/moe_load_max": load.max(),
            ROUTING_DIGEST: routing_digest(self.counts),
        }


ROUTING_DIGEST = "train/moe_routing_digest"
# The largest prime below 2**24: every digest, and every term of its sum, is an integer that
# float64 holds exactly (and the digest float32 too), so equal counts give equal digests.
_DIGEST_PRIME = 16_777_213


def routing_digest(counts: torch.Tensor) -> torch.Tensor:
    """A fingerprint of a step's assignments per layer and expert (L, E), integers: the sum of
    each count times a weight of its own (pseudo-random, fixed) modulo a prime. Two runs whose
    routers chose alike have the same digest whatever the split; a token sent to another
    expert changes it (unless other changes of the same step cancel it: about 1 in 1.7e7).
    trainer.certify compares a mixture's layouts up to the step where it first differs."""
    p = float(_DIGEST_PRIME)
    weights = torch.randint(
        1, _DIGEST_PRIME, counts.shape, generator=torch.Generator().manual_seed(0)
    ).to(counts.device, torch.float64)
    terms = torch.remainder(torch.remainder(counts.to(torch.float64), p) * weights, p)
    return torch.remainder(terms.sum(), p)


@dataclass
class Window:
    """What the balancing knows of the window being stepped: each micro-batch's random state
    and routing-pass counts (by the batch's identity), the step's sums (`global`'s routing
    pass), what a mode's `prepare` counted besides (`prepared`), the global count."""

    global_count: torch.Tensor
    micro_batches: int  # over every rank
    batches: list[Any]  # kept: their identities name them until the next window
    replays: dict[int, tuple[RandomState, torch.Tensor]] = field(default_factory=dict)
    step: StepSums | None = None
    prepared: Any = None  # the mode's own, from its `prepare`
    local: list[torch.Tensor] = field(default_factory=list)  # pass-2 sums (records)
