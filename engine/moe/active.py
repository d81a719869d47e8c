"""The parameters one token goes through: of a mixture's routed experts, only its top-k.

A mixture of E experts routes each token to `top_k` of them, so a token's FLOPs (MFU,
`trainer.plan`'s compute time) and its "active parameters" count top_k / E of the experts'
weights, and everything else whole: attention, embeddings, norms, the routers, dense MLPs and
the shared experts every token goes through. A model declares its mixtures twice over, and
both are read here: its experts (engine/parallel/expert.py's `HasExperts`: each mixture's
module and the parameters holding every expert along dim 0) and its routers
(engine/moe/routing.py's `HasRouters`: each mixture's `top_k`), one of each per mixture, in
the same order. The in-tree GPT and transformers' mixtures (Qwen3-MoE, Mixtral, Qwen2-MoE
with its shared expert, ...) declare both; a dense model neither, and its active parameters
are all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from engine.moe.routing import HasRouters, HookedRouter, Routed
from engine.parallel.expert import ExpertLayer, HasExperts


def mixture_layers(model: nn.Module) -> list[tuple[ExpertLayer, int]]:
    """Each mixture's experts with the `top_k` of its router; [] for a dense model, or for
    one whose routers and experts do not pair one to one (each expert then counts)."""
    layers = list(model.expert_layers()) if isinstance(model, HasExperts) else []
    routers = list(model.routers()) if isinstance(model, HasRouters) else []
    if len(layers) != len(routers):
        return []
    return [(layer, int(router.top_k)) for layer, router in zip(layers, routers)]


def active_parameters(
    model: nn.Module, counted: Callable[[nn.Parameter], bool] = lambda p: True
) -> int:
    """The parameters (of those `counted`) one token goes through: of each mixture's expert
    parameters its `top_k` experts' share (one expert's slice along dim 0 times top_k, also
    when dist.ep kept a rank's slice only), of every other parameter all of it. Tied
    parameters count once."""
    share: dict[int, int] = {}  # id(parameter) -> the experts of it a token goes through
    for layer, top_k in mixture_layers(model):
        for name in layer.params:
            share[id(layer.module.get_parameter(name))] = top_k
    total = 0
    for p in model.parameters():
        if counted(p):
            k = share.get(id(p))
            total += p.numel() if k is None else p.numel() // p.shape[0] * k
    return total


@dataclass(frozen=True)
class MixtureSizes:
    """A mixture of experts' sizes, of the whole model (before dist.ep splits it)."""

    routing: tuple[tuple[int, int], ...]  # (experts, top_k) of each distinct mixture
    active: int  # the parameters one token goes through (`active_parameters`)
    routed: int  # the routed experts' parameters, every expert: what dist.ep splits
    dispatched: int  # values one token sends its experts, summed over the mixture layers

    @property
    def experts(self) -> int:
        """The expert count every mixture's divides (what dist.ep must divide)."""
        return math.gcd(*(e for e, _ in self.routing))


def token_width(router: Routed) -> int:
    """The width of the hidden state a router scores, which dist.ep sends the experts: the
    second dimension of its (E, C) weight (a linear gate over the token); 0 when it holds
    none."""
    module = router.module if isinstance(router, HookedRouter) else router
    if not isinstance(module, nn.Module):
        return 0
    for p in module.parameters():
        if p.dim() == 2 and p.shape[0] == router.num_experts:
            return int(p.shape[1])
    return 0


def mixture_sizes(model: nn.Module) -> MixtureSizes | None:
    """The sizes of a model declaring its mixtures (`mixture_layers`); None for a dense one."""
    layers = mixture_layers(model)
    if not layers:
        return None
    routing: list[tuple[int, int]] = []
    for layer, top_k in layers:
        if (layer.num_experts, top_k) not in routing:
            routing.append((layer.num_experts, top_k))
    routed = {
        id(p): p.numel()
        for layer, _ in layers
        for p in (layer.module.get_parameter(name) for name in layer.params)
    }
    routers = model.routers() if isinstance(model, HasRouters) else ()
    dispatched = sum(int(r.top_k) * token_width(r) for r in routers)
    sizes = (active_parameters(model), sum(routed.values()), dispatched)
    return MixtureSizes(tuple(routing), *sizes)
