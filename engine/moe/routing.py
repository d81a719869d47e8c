"""Token-choice top-k routing: what a router declares, and the dispatch of tokens to experts.

A router (`Routed`) scores every token against `num_experts` experts; each token goes to its
`top_k` best (softmax over all experts, then top-k, the k weights renormalized to sum to 1).
Routing is dropless: no capacity, no token dropped, so a token's output does not depend on
which other tokens share its micro-batch. The router keeps what its last forward routed
(`routing`) for the load-balancing loss (engine/moe/balance.py), which a model exposes by
declaring its routers (`HasRouters`); not what a block recomputed in backward routes again
(`recomputing`).

A forward whose routing is not the balanced model's (DPO's reference: a frozen copy, or the
policy's own routers with its adapters off) runs under `routing_not_counted()`: routers keep
nothing of it (`keeps_routing`) and the balancing's routing pass does not stop in it.

The dispatch sorts the (token, slot) assignments by expert so that each expert runs one
matmul on a contiguous slice (`dispatch` -> expert compute, engine/moe/grouped.py's
`grouped_mm` -> `combine`), the counts per expert staying on the device: the shapes do not
depend on the routing, so torch.compile traces it once. Expert parallelism slots in between:
an all-to-all sends each expert's slice to the rank holding it, and back before `combine`;
only it reads the counts on the host (its split sizes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Routing:
    """What one router's forward routed: `logits` (N, E), in the graph of the forward (the
    balancing loss back-propagates through them), and `experts` (N, k) int64, the chosen
    experts of each of the N routed positions (every position of the input, in order)."""

    logits: torch.Tensor
    experts: torch.Tensor


@runtime_checkable
class Routed(Protocol):
    """A router: after each forward, `routing` holds what it routed (None before any).

    Example::

        class Router(nn.Module):
            def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
                super().__init__()
                self.num_experts, self.top_k = num_experts, top_k
                self.gate = nn.Linear(dim, num_experts, bias=False)
                self.routing: Routing | None = None

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                logits = self.gate(x)  # (N, E)
                weights, experts = top_k_route(logits, self.top_k)  # (N, k), (N, k)
                if not recomputing():  # activation checkpointing's second forward
                    self.routing = Routing(logits, experts)
                return weights, experts
    """

    num_experts: int
    top_k: int
    routing: Routing | None


@runtime_checkable
class BiasedRouter(Routed, Protocol):
    """A router that chooses experts by probability + `bias` (E,), a buffer the balancing
    updates after each optimizer step (`moe.balance=bias`) and checkpoints save with the
    model. `Router` in trainer/models/moe.py is one."""

    bias: torch.Tensor


@runtime_checkable
class HasRouters(Protocol):
    """A model with routers: `routers()` lists them in the order its forward runs them (the
    balancing's routing pass stops after the last one).

    Example::

        class MyMoE(nn.Module):
            def routers(self) -> list[Router]:
                return [block.moe.router for block in self.blocks if block.moe is not None]
    """

    def routers(self) -> Sequence[Routed]: ...


class HookedRouter:
    """A router module of a model that does not declare one (transformers' `*TopKRouter`,
    whose forward returns `(logits, weights, experts)`), observed by a forward hook: a
    `Routed` whose `routing` is what the module's last forward routed. `module` is where the
    balancing's routing pass may stop."""

    def __init__(self, module: nn.Module, num_experts: int, top_k: int) -> None:
        self.module, self.num_experts, self.top_k = module, num_experts, top_k
        self.routing: Routing | None = None
        module.register_forward_hook(self._record)

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "routing": None}  # copies never hold a forward's graph

    def _record(self, module: nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
        del args
        logits, experts = output[0], output[-1]  # (N, E), (N, k)
        if experts.is_floating_point() or experts.shape[-1] != self.top_k:
            raise TypeError(
                f"{type(module).__name__} returned {tuple(experts.shape)} {experts.dtype} as its "
                f"last output; a router's forward must return (logits, ..., experts (N, "
                f"{self.top_k}) indices)"
            )
        if keeps_routing():
            self.routing = Routing(logits, experts)


_NOT_COUNTED = [0]  # how deep in `routing_not_counted` this process is


@contextlib.contextmanager
def routing_not_counted() -> Iterator[None]:
    """Forwards whose routing is not the balanced model's (DPO's reference): a router keeps
    nothing of them, and the routing pass (engine/moe/balance.py) does not stop in them.
    (A router that keeps its routing anyway, the in-tree GPT's, has it replaced by the
    policy's forward that follows: the balancing reads the routers after it.)"""
    _NOT_COUNTED[0] += 1
    try:
        yield
    finally:
        _NOT_COUNTED[0] -= 1


def counted() -> bool:
    """Whether this forward's routing is the balanced model's (not `routing_not_counted`)."""
    return _NOT_COUNTED[0] == 0


def keeps_routing() -> bool:
    """Whether a router keeps what this forward routes: not when a block is recomputed in
    backward (`recomputing`), nor in a forward whose routing is not counted."""
    return counted() and not recomputing()


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing recomputing
    the block. A router then keeps nothing: what it routes is the forward's routing again
    (already counted), and its logits' graph would hold the recomputed block's activations
    alive until the router's next forward: every recomputed block's, by the end of backward.
    Compiled code is traced once, outside backward, and recomputes without running this."""
    if torch.compiler.is_compiling():
        return False
    # torch.utils.checkpoint asks the same of the autograd engine: -1 outside a backward pass.
    return torch._C._current_graph_task_id() != -1


def top_k_route(
    logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, E) logits -> the chosen experts' weights (N, k), renormalized over the k, in the
    logits' dtype (softmax in at least fp32), and the experts (N, k) int64. With `bias` (E,)
    (`moe.balance=bias`), experts are chosen by probability + bias; their weights are their
    probabilities all the same (DeepSeek-V3's auxiliary-loss-free balancing)."""
    probs = F.softmax(logits.float() if logits.dtype in HALF else logits, dim=-1)
    if bias is None:
        weights, experts = torch.topk(probs, top_k, dim=-1)
    else:
        experts = torch.topk(probs + bias.to(probs.dtype), top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


HALF = (torch.float16, torch.bfloat16)  # routed in fp32 from these


@dataclass(frozen=True)
class Dispatch:
    """The (token, slot) assignments sorted by expert: `order` (N*k,) the flat assignment
    indices in expert order, `tokens` (N*k,) the token of each, `counts` (E,) int64 the
    assignments per expert (the slices' lengths), on the device."""

    order: torch.Tensor
    tokens: torch.Tensor
    counts: torch.Tensor


def dispatch(
    x: torch.Tensor, experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, Dispatch]:
    """Tokens `x` (N, C) copied once per assignment, grouped by expert: (N*k, C) with expert
    0's rows first; the stable sort keeps each expert's tokens in their original order. The
    counts are summed on the device, never read: a bincount's length would depend on the
    values, and a host read would cut torch.compile's graph."""
    flat = experts.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)
    tokens = order // experts.shape[-1]
    counts = flat.new_zeros(num_experts).scatter_add(0, flat, torch.ones_like(flat))
    return x[tokens], Dispatch(order, tokens, counts)


def combine(ys: torch.Tensor, weights: torch.Tensor, d: Dispatch, n_tokens: int) -> torch.Tensor:
    """Expert outputs `ys` (N*k, C) in dispatch order -> (N, C): each token's weighted sum
    over its k experts."""
    w = weights.reshape(-1)[d.order].unsqueeze(-1).to(ys.dtype)  # (N*k, 1)
    out = ys.new_zeros(n_tokens, ys.shape[-1])
    return out.index_add(0, d.tokens, ys * w)
