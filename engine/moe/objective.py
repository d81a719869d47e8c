"""What a mixture's load-balancing loss is: the objective, which the model chooses. The modes of
`moe.balance` (engine/moe/strategies.py) choose over which tokens it is taken.

Every objective is built on Switch Transformer's formula, the one Megatron-core's
`switch_load_balancing_loss_func` computes:

    switch(P, C, T, k) = E * sum_i (C_i / (k T)) * (P_i / T)

where C_i is the number of (token, slot) assignments to expert i (a constant: no gradient),
P_i the summed router probability of expert i, and T the tokens they were summed over. The
two objectives are:

- `PerLayer` (Switch, Megatron; the in-tree GPT's, and that of any model that declares
  none): switch per MoE layer, averaged over the layers. f = C / (k T) sums to 1, and the
  default coefficient is 0.01.
- `Pooled` (transformers' `load_balancing_loss_func`, the objective of its mixtures): every
  layer's tokens pooled, E * sum_i (sum_l C_li / (L T)) * (sum_l P_li / (L T)). Here f sums
  to top_k, and the default coefficient is the model config's `router_aux_loss_coef`.

Both are linear in P when C and T are fixed. So a whole batch's value is the sum over its
micro-batches of `aux(C of the whole batch, P of the micro-batch, T of the whole batch)`;
`moe.balance=global` relies on this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

SWITCH_COEF = 0.01  # Switch Transformer's and Megatron's usual weight


def switch_loss(
    probs: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Switch's load-balancing loss over the last dim: `probs` (..., E) summed router
    probabilities (in the graph), `counts` (..., E) assignments and `tokens` (...) counted
    tokens (constants) -> (...), E * sum_i counts_i / (top_k tokens) * probs_i / tokens.
    The weights of `probs` are formed in float64, then cast to `probs`' dtype."""
    experts = probs.shape[-1]
    t = tokens.to(torch.float64).clamp(min=1).unsqueeze(-1)  # (..., 1)
    weight = counts.to(torch.float64) / (top_k * t * t)  # (..., E)
    return experts * (probs * weight.to(probs.device, probs.dtype)).sum(-1)


@runtime_checkable
class BalanceObjective(Protocol):
    """A load-balancing loss of a whole set of tokens, from its per-layer sums: `aux(counts
    (..., L, E), probs (..., L, E), tokens (...), top_k) -> (...)`, linear in `probs`; `coef`
    is its weight when `moe.aux_coef` is null (the model's own); `name` says which it is."""

    name: str
    coef: float

    def aux(
        self, counts: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, top_k: int
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class PerLayer:
    """Switch / Megatron: switch per layer (f sums to 1), averaged over the layers."""

    coef: float = SWITCH_COEF
    name: str = "per layer (Switch, Megatron)"

    def aux(
        self, counts: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        return switch_loss(probs, counts, tokens.unsqueeze(-1), top_k).mean(-1)


@dataclass(frozen=True)
class Pooled:
    """transformers' `load_balancing_loss_func`: the layers' assignments and probabilities
    pooled over L * T rows, f summing to top_k."""

    coef: float
    name: str = "pooled over the layers (transformers)"

    def aux(
        self, counts: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        del top_k  # transformers' f is counts / rows: it sums to top_k
        layers = probs.shape[-2]
        return switch_loss(probs.sum(-2), counts.sum(-2), tokens * layers, 1)


@runtime_checkable
class DeclaresBalanceObjective(Protocol):
    """A mixture that says which load-balancing loss it is trained with (transformers'
    mixtures: `Pooled`); a model with routers that does not is balanced by `PerLayer`."""

    def balance_objective(self) -> BalanceObjective: ...


def objective_of(model: object) -> BalanceObjective:
    """The objective `model` declares, else Switch / Megatron's per-layer one."""
    if isinstance(model, DeclaresBalanceObjective):
        return model.balance_objective()
    return PerLayer()
