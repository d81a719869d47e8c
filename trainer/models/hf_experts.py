"""transformers' experts as cumulus runs them: found by what transformers declares of them,
split by expert parallelism (`dist.ep`, engine/parallel/expert.py) from outside.

transformers 5 holds a sparse block's experts as one module of fused 3-D weights
(`Qwen3MoeExperts`, `MixtralExperts`, `OlmoeExperts`, ...: `gate_up_proj` (E, 2I, C),
`down_proj` (E, C, I)), called by the block as `experts(hidden (N, C), top_k_index (N, k),
top_k_weights (N, k))` after its own router chose. Its `use_experts_implementation`
decorator (transformers/integrations/moe.py) declares how: the layout (`has_gate`,
`has_bias`, `is_transposed`, `is_concatenated`), the config whose `_experts_implementation`
picks the forward, `_is_expert_parallel`. `DecoratedExperts` is that declaration; every
module that has it is a mixture's experts (`transformers_experts`).

Under dist.ep the split keeps experts [rank*local, (rank+1)*local) along dim 0 of each of
the weights the declaration names (`stacked_parameters`) and wraps the module's call
(engine/parallel/expert.py's `top_k`): the block's (token, slot) assignments go all-to-all
to the ranks holding their experts, transformers' own forward runs there on this rank's
experts (each row routed to its local expert with weight 1), and the outputs come back to be
weighed and summed. So cumulus reproduces none of transformers' expert math, and any
decorated family splits; a mixture whose experts are not decorated is refused in one
paragraph naming dist.ep.

Which forward transformers' experts run (`EXPERTS`, registered in its `ExpertsInterface`):
compiled, transformers' `grouped_mm` (shapes that do not depend on the routing: one graph);
eager, the class's own forward (its loop over the experts hit), which runs every dtype,
float64 included, and is what expert parallelism calls on the local experts.

Checkpoints name the kept slices as the unsplit model does (`...mlp.experts.gate_up_proj`),
and `ExpertParallel` writes them whole, so a checkpoint resumes under any dist.ep and
scripts/export_hf.py writes transformers' own class with every expert.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from engine.parallel.expert import ExpertLayer, top_k

# The config fields transformers' families count their experts in (Qwen3-MoE, OLMoE:
# num_experts; Mixtral: num_local_experts; DeepSeek-V3: n_routed_experts; ERNIE 4.5 MoE).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# The experts implementation cumulus registers in transformers' ExpertsInterface.
EXPERTS = "cumulus"


@runtime_checkable
class DecoratedExperts(Protocol):
    """transformers' fused experts, as `use_experts_implementation` declares them (the
    attributes it sets on every instance, beside the class's own `num_experts`)."""

    num_experts: int
    config: Any  # its `_experts_implementation` chooses the forward
    has_gate: bool  # gate_up_proj (gate and up fused) rather than up_proj
    has_bias: bool  # <weight>_bias (E, out) beside each weight
    is_transposed: bool  # weights (E, in, out) rather than (E, out, in)
    is_concatenated: bool  # gate and up concatenated along out rather than interleaved
    _is_expert_parallel: bool  # transformers' own expert parallelism applied


def stacked_parameters(experts: DecoratedExperts) -> tuple[str, ...]:
    """The parameters holding every expert along dim 0, by the declaration: gate_up_proj
    (or up_proj) and down_proj, and their biases with `has_bias`."""
    weights = ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")
    return (*weights, *(f"{w}_bias" for w in weights)) if experts.has_bias else weights


def experts_key(config: dict[str, Any], num_experts: int) -> str:
    """The key of `config` (transformers' config fields, those given in model.config
    included) that sets a mixture's `num_experts`, as the user writes it:
    `model.config.<field>`."""
    for field in EXPERT_COUNT_KEYS:
        if config.get(field) == num_experts:
            return f"model.config.{field}"
    return "the number of experts in model.config"


def transformers_experts(model: nn.Module, config: dict[str, Any]) -> list[ExpertLayer]:
    """Every decorated experts module of `model` as dist.ep splits it, in module order;
    `config`: its transformers config as a dict (naming the key of the expert count)."""
    found = [m for m in model.modules() if isinstance(m, DecoratedExperts)]
    return [
        ExpertLayer(
            m, m.num_experts, experts_key(config, m.num_experts), top_k, stacked_parameters(m)
        )
        for m in found
    ]


def experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """`EXPERTS`: under torch.compile transformers' `grouped_mm` forward (no `nonzero`, so
    no graph break); eager, the class's own forward (`use_experts_implementation` wraps it),
    exact in every dtype."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    if torch.compiler.is_compiling():
        return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    own = inspect.unwrap(type(module).forward)
    return own(module, hidden_states, top_k_index, top_k_weights)


def register_experts_forward() -> None:
    """`EXPERTS` in transformers' ExpertsInterface (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS, experts_forward)
