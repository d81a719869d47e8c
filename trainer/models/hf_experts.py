"""Expert parallelism (`dist.ep`, engine/parallel/expert.py) for transformers' mixtures:
`model=hf_qwen3_moe` and `model=hf_mixtral`.

transformers 5 holds a sparse block's experts as one module of fused 3-D weights
(`Qwen3MoeExperts`, `MixtralExperts`: `gate_up_proj` (E, 2I, C), `down_proj` (E, C, I)),
called by the block as `experts(hidden (N, C), top_k_index (N, k), top_k_weights (N, k))`
after its own router chose. At build time (`causal_lm`) each such module becomes a subclass
of its own class (`Split<Class>`) that implements `SplitsExperts`: the parameter names, the
router, the block's forward (Mixtral's jitter included) and, until `split_experts` is called,
the experts' forward are transformers' own. Once split, a module keeps experts
[rank*local, (rank+1)*local) along dim 0 of both fused weights, and its forward sends the
block's (token, slot) assignments through `ExpertGroup.run` (all-to-all, dropless): the same
routing (the block's router output), each expert's transformers math (gate and up in one
product, act(gate) * up, down), and transformers' combine (each output times its weight,
added into the token's row in the hidden states' dtype).

Other transformers mixtures with observable routers (OLMoE, Qwen2-MoE, ...: `model.family=`)
train as before under dist.ep=1; under dist.ep > 1 their expert modules (`*Experts`) refuse the
split in one paragraph naming dist.ep (`UnsplitExperts`), whose math this module has not been
shown to reproduce.

Checkpoints name the kept slices as the unsplit model does (`...mlp.experts.gate_up_proj`),
and `ExpertParallel` writes them whole, so a checkpoint resumes under any dist.ep and
scripts/export_hf.py writes transformers' own class with every expert.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from engine.moe.grouped import group_offsets, grouped_mm
from engine.moe.routing import dispatch
from engine.parallel import LayoutError
from engine.parallel.expert import ExpertGroup

# transformers' fused expert modules whose layout and math `SplitExperts` reproduces: gated
# (gate and up concatenated along dim 1 of gate_up_proj), no bias, not transposed.
FUSED_EXPERTS = frozenset({"Qwen3MoeExperts", "MixtralExperts"})
# The config fields transformers' families count their experts in (Qwen3-MoE, OLMoE:
# num_experts; Mixtral: num_local_experts; DeepSeek-V3: n_routed_experts; ERNIE 4.5 MoE).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class SplitExperts(nn.Module):
    """The `SplitsExperts` half of `Split<Class>`: the fused experts of transformers, split
    over the expert-parallel ranks once `split_experts` is called (the module docstring)."""

    num_experts: int  # every expert's count, also once split (the routing's)
    experts_key: str  # the model.config field setting it (`experts_key`)
    gate_up_proj: nn.Parameter  # (E, 2I, C); (local, 2I, C) once split
    down_proj: nn.Parameter  # (E, C, I); (local, C, I) once split
    act_fn: nn.Module
    expert_group: ExpertGroup | None = None  # dist.ep: this rank's experts only

    def split_experts(self, group: ExpertGroup) -> list[nn.Parameter]:
        """Keep the group rank's experts, dispatch tokens to their ranks from now on; the
        kept parameters."""
        self.gate_up_proj, self.down_proj = (
            group.keep(self.gate_up_proj),
            group.keep(self.down_proj),
        )
        self.expert_group = group
        return [self.gate_up_proj, self.down_proj]

    def local_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on `rows` sorted by local expert, `counts` rows each:
        transformers' math (gate and up in one product, act(gate) * up, down), every expert
        in one grouped product each (engine/moe/grouped.py)."""
        gate_up, down = self.gate_up_proj, self.down_proj  # (local, 2I, C), (local, C, I)
        # Under FSDP2's bf16 (ExpertGroup.param_dtype) the experts compute with their weights
        # cast as FSDP2 casts the weights it shards.
        dtype = self.expert_group.param_dtype if self.expert_group is not None else None
        if dtype is not None:
            gate_up, down, rows = gate_up.to(dtype), down.to(dtype), rows.to(dtype)
        offsets = group_offsets(counts, rows.device)
        # F.linear(x, W) is x @ W^T: the weights transposed in their last two dims.
        gate, up = grouped_mm(rows, gate_up.transpose(-2, -1), offsets).chunk(2, dim=-1)
        return grouped_mm(self.act_fn(gate) * up, down.transpose(-2, -1), offsets)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.expert_group is None:  # not split: transformers' own forward
            return super().forward(hidden_states, top_k_index, top_k_weights)
        xs, d = dispatch(hidden_states, top_k_index, self.num_experts)  # (N*k, C) by expert
        ys = self.expert_group.run(xs, d.counts.tolist(), self.local_experts)  # (N*k, C)
        # transformers' combine: output x weight (their promoted dtype), into the token's row.
        w = top_k_weights.reshape(-1)[d.order].unsqueeze(-1)  # (N*k, 1)
        out = torch.zeros_like(hidden_states)  # (N, C)
        return out.index_add(0, d.tokens, (ys * w).to(out.dtype))


class UnsplitExperts(nn.Module):
    """The experts of another transformers mixture (not `FUSED_EXPERTS`): dist.ep finds them
    (`SplitsExperts`) and they refuse the split, naming their class and what is split."""

    num_experts: int
    experts_key: str  # the model.config field setting it (`experts_key`)
    transformers_class: type  # the class this one extends

    def split_experts(self, group: ExpertGroup) -> list[nn.Parameter]:
        del group
        raise LayoutError(
            "dist.ep",
            f"splits the experts of transformers' {self.transformers_class.__name__}, which "
            "cumulus cannot split yet: dist.ep > 1 takes the in-tree GPT's mixtures "
            "(model.moe.experts) and transformers' Qwen3-MoE and Mixtral (model=hf_qwen3_moe, "
            "model=hf_mixtral); set dist.ep=1 to train this model with every expert on each rank",
        )


@functools.cache
def _subclass(mixin: type, cls: type) -> type:
    """`cls` with `mixin` first; a module-level name so pickling sees a real class."""
    prefix = "Split" if mixin is SplitExperts else "Unsplit"
    body = {"__module__": __name__, "transformers_class": cls}
    sub = type(f"{prefix}{cls.__name__}", (mixin, cls), body)
    globals()[sub.__name__] = sub
    return sub


def experts_key(config: dict[str, Any], num_experts: int) -> str:
    """The key of `config` (transformers' config fields, those given in model.config
    included) that sets a mixture's `num_experts`, as the user writes it:
    `model.config.<field>`."""
    for field in EXPERT_COUNT_KEYS:
        if config.get(field) == num_experts:
            return f"model.config.{field}"
    return "the number of experts in model.config"


def make_experts_splittable(model: nn.Module, config: dict[str, Any]) -> None:
    """In place, for a mixture of experts (transformers' top-k routers found; `config` its
    transformers config as a dict): each fused expert module of `FUSED_EXPERTS` becomes its
    `Split<Class>` (nothing else changes until `split_experts`), any other `*Experts` module
    holding `num_experts` its refusing `Unsplit<Class>`; both name the config field of their
    expert count (`experts_key`)."""
    for m in model.modules():
        cls = type(m)
        if isinstance(m, SplitExperts | UnsplitExperts) or not cls.__name__.endswith("Experts"):
            continue
        count = vars(m).get("num_experts")
        if cls.__name__ in FUSED_EXPERTS:
            m.__class__ = _subclass(SplitExperts, cls)
        elif isinstance(count, int):
            m.__class__ = _subclass(UnsplitExperts, cls)
        else:
            continue
        m.experts_key = experts_key(config, m.num_experts)
