"""Mixture-of-experts blocks of the in-tree GPT (`model.moe.*`): a router, the experts as
stacked weights, and optional shared experts that see every token.

The routing itself (top-k, the dispatch by expert) is engine/moe/routing.py's; the balancing
loss of the whole step is engine/moe/balance.py's, fed by the routers these blocks declare.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe.grouped import group_offsets, grouped_mm, row_groups
from engine.moe.routing import Routing, combine, dispatch, keeps_routing, top_k_route
from engine.parallel.expert import ExpertLayer, sorted_rows


@dataclass
class MoEConfig:
    """`model.moe.*`: `experts` (0: a dense model), `top_k` experts per token, `hidden` units
    per expert (default 4 x n_embd), every `every`-th block is a mixture (the last of each
    `every`), `shared_experts` experts of `hidden` units that every token goes through."""

    experts: int = 0
    top_k: int = 2
    hidden: int | None = None
    every: int = 1
    shared_experts: int = 0

    @classmethod
    def of(cls, node: dict | MoEConfig | None) -> MoEConfig:
        """From `model.moe` (a mapping, or None: dense); keys other than `experts` given with
        zero experts are refused, since they would do nothing."""
        if isinstance(node, MoEConfig) or node is None:
            return node or cls()
        node = dict(node)
        unknown = sorted(set(node) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"moe.{unknown[0]} is not a key of model.moe; valid: "
                + ", ".join(cls.__dataclass_fields__)
            )
        if not node.get("experts", 0):
            extra = sorted(k for k in node if k != "experts")
            if extra:
                raise ValueError(
                    f"moe.experts is 0 (a dense model) but model.moe.{extra[0]} is set: set "
                    "model.moe.experts to the number of experts (e.g. 8) for a mixture of "
                    f"experts, or drop model.moe.{extra[0]}"
                )
        return cls(**node)

    def __post_init__(self) -> None:
        # Messages start with the key under `model`: the trainer names the config key from it.
        if type(self.experts) is not int or self.experts < 0:
            raise ValueError(
                f"moe.experts must be 0 (dense) or a positive number, got {self.experts!r}"
            )
        if not self.experts:
            return
        if type(self.top_k) is not int or not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"moe.top_k must be between 1 and moe.experts ({self.experts}), got {self.top_k!r}"
            )
        if self.hidden is not None and (type(self.hidden) is not int or self.hidden <= 0):
            raise ValueError(f"moe.hidden must be a positive number or null, got {self.hidden!r}")
        if type(self.every) is not int or self.every <= 0:
            raise ValueError(f"moe.every must be a positive number, got {self.every!r}")
        if type(self.shared_experts) is not int or self.shared_experts < 0:
            raise ValueError(
                f"moe.shared_experts must be 0 or a positive number, got {self.shared_experts!r}"
            )

    def is_moe_block(self, index: int) -> bool:
        """Whether block `index` (0-based) is a mixture: the last of every `every` blocks."""
        return self.experts > 0 and index % self.every == self.every - 1


class Router(nn.Module):
    """Scores each token against every expert (a linear gate without bias) and routes it to
    its top-k (engine/moe/routing.py's `BiasedRouter`): chosen by probability + `bias`, which
    stays 0 unless `moe.balance=bias` moves it."""

    bias: torch.Tensor

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("bias", torch.zeros(num_experts))  # in checkpoints
        self.routing: Routing | None = None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "routing": None}  # copies never hold a forward's graph

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # (N, E)
        # A zero bias chooses as plain top-k does, exactly (p + 0.0 == p).
        weights, experts = top_k_route(logits, self.top_k, self.bias)  # (N, k), (N, k)
        if keeps_routing():  # not in a recomputing backward, nor a reference forward
            self.routing = Routing(logits, experts)
        return weights, experts


class Experts(nn.Module):
    """`n` GELU MLPs of `hidden` units as stacked weights (E, C, H) and (E, H, C): FSDP
    shards them like any weight; expert parallelism splits dim 0 (`expert_layer`)."""

    def __init__(self, n: int, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.num_experts = n
        self.fc = nn.Parameter(torch.empty(n, dim, hidden))
        self.proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.fc_bias = nn.Parameter(torch.zeros(n, hidden)) if bias else None
        self.proj_bias = nn.Parameter(torch.zeros(n, dim)) if bias else None

    def forward(self, xs: torch.Tensor, counts: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """`xs` (N*k, C) sorted by expert, `counts` rows per expert (E,) on the device (a
        list under expert parallelism) -> (N*k, C): each expert's MLP on its rows, every
        expert in one grouped product per layer (engine/moe/grouped.py)."""
        offsets = group_offsets(counts, xs.device)  # (E,) each expert's end row
        owner = row_groups(offsets, xs.shape[0]) if self.fc_bias is not None else None
        h = grouped_mm(xs, self.fc, offsets)  # (N*k, H)
        h = h + self.fc_bias[owner] if self.fc_bias is not None else h
        y = grouped_mm(F.gelu(h), self.proj, offsets)  # (N*k, C)
        return y + self.proj_bias[owner] if self.proj_bias is not None else y

    def expert_layer(self) -> ExpertLayer:
        """How expert parallelism splits these experts (engine/parallel/expert.py): every
        parameter along dim 0, called on rows sorted by expert."""
        names = tuple(name for name, _ in self.named_parameters())
        return ExpertLayer(self, self.num_experts, "model.moe.experts", sorted_rows, names)


class MoE(nn.Module):
    """The mixture replacing a block's MLP: (B, T, C) -> (B, T, C), every position routed."""

    def __init__(self, dim: int, moe: MoEConfig, bias: bool, dropout: float) -> None:
        super().__init__()
        hidden = moe.hidden or 4 * dim
        self.router = Router(dim, moe.experts, moe.top_k)
        self.experts = Experts(moe.experts, dim, hidden, bias)
        self.shared: nn.Sequential | None = None
        if moe.shared_experts:
            width = moe.shared_experts * hidden
            self.shared = nn.Sequential(
                nn.Linear(dim, width, bias=bias), nn.GELU(), nn.Linear(width, dim, bias=bias)
            )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        weights, experts = self.router(flat)  # (N, k), (N, k)
        xs, d = dispatch(flat, experts, self.router.num_experts)  # (N*k, C), by expert
        ys = self.experts(xs, d.counts)  # (N*k, C); under dist.ep via the experts' ranks
        y = combine(ys, weights, d, B * T)  # (N, C)
        if self.shared is not None:
            y = y + self.shared(flat)
        return self.drop(y.view(B, T, C))

    def init_weights(self, n_layer: int) -> None:
        """GPT-2's init: N(0, 0.02), the output projections scaled by 1/sqrt(2 n_layer)."""
        nn.init.normal_(self.experts.fc, std=0.02)
        nn.init.normal_(self.experts.proj, std=0.02 / math.sqrt(2 * n_layer))
