"""A mixture of experts counts the parameters a token goes through (engine/moe/active.py):
its top-k routed experts, its shared experts and everything dense, for MFU (`train/mfu`),
the planner's compute time, and the banner.

Each count is checked against a hand count written out here from the config's shapes, for
the in-tree GPT (dense and mixture blocks, shared experts), transformers' Qwen3-MoE and
Mixtral, and Qwen2-MoE (a dense layer, and a shared expert behind its own gate). Before, a
transformers mixture counted every expert: Qwen3-30B-A3B's shapes planned 45.3% MFU and
12.34 s of compute per step at world 64, ep 8, about 8x its real FLOPs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from engine.distributed import DistInfo
from tests.conftest import TINY, compose_config, train_in_process
from trainer.models.gpt import GPT

T = 32  # sequence length of the FLOPs counts

# ------------------------------------------------------------------ hand counts


def linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def gated_mlp(width: int, hidden: int) -> int:
    """gate, up and down projections without bias (SwiGLU): one transformers expert."""
    return 3 * width * hidden


def test_the_in_tree_gpt_counts_top_k_routed_and_every_shared_expert() -> None:
    """GPT width 32, 2 layers: block 0 dense (MLP 4 x 32), block 1 a mixture (moe.every=2) of
    4 experts of 48 units, top-2, and one shared expert of 48 units; biases on. The token
    embedding is also the output layer (counted once, as the output layer); the position
    lookup costs nothing."""
    moe = {"experts": 4, "top_k": 2, "hidden": 48, "every": 2, "shared_experts": 1}
    model = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32, moe=moe)
    C, H = 32, 48
    norm = 2 * C  # LayerNorm with bias
    attention = linear(C, 3 * C, True) + linear(C, C, True)
    dense_block = 2 * norm + attention + linear(C, 4 * C, True) + linear(4 * C, C, True)
    one_expert = linear(C, H, True) + linear(H, C, True)
    router = 4 * C
    moe_block = 2 * norm + attention + router + 2 * one_expert + one_expert  # top-2 + shared
    active = 256 * C + dense_block + moe_block + norm  # + ln_f
    assert model.flops_per_token(T) == 6 * active + 12 * 2 * T * C
    every_expert = 4 * one_expert
    total = active + 64 * C + every_expert - 2 * one_expert  # + positions, the other 2 experts
    assert model.num_params() == total


QWEN3 = {  # configs/model/hf_qwen3_moe.yaml
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "hidden_size": 64,
    "intermediate_size": 176,
    "moe_intermediate_size": 96,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}
MIXTRAL = {  # configs/model/hf_mixtral.yaml
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
QWEN2 = {  # layer 0 dense (intermediate 176), layer 1 sparse (decoder_sparse_step=2)
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "hidden_size": 64,
    "intermediate_size": 176,
    "moe_intermediate_size": 96,
    "shared_expert_intermediate_size": 80,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def hand_count(family: str) -> int:
    """The parameters of a token's matrix products and norms, from the config's shapes:
    width 64, 4 query heads and 2 key-value heads of 16, top-2 of 8 experts; the output
    layer 256 x 64 (untied: the embedding lookup costs nothing)."""
    C, heads, kv, hd, E, k = 64, 4, 2, 16, 8, 2
    attention = linear(C, heads * hd) + 2 * linear(C, kv * hd) + linear(heads * hd, C)
    norms = 2 * C  # RMSNorm before attention and before the MLP, no bias
    router = E * C
    if family == "qwen3_moe":  # + q_norm, k_norm over the head dimension
        layer = norms + attention + 2 * hd + router + k * gated_mlp(C, 96)
        layers = 2 * layer
    elif family == "mixtral":
        layers = 2 * (norms + attention + router + k * gated_mlp(C, 96))
    else:  # qwen2_moe: q, k, v biases; a dense layer, then a sparse one with a shared expert
        attention += heads * hd + 2 * kv * hd
        dense = norms + attention + gated_mlp(C, 176)
        shared = gated_mlp(C, 80) + linear(C, 1)  # the shared expert and its sigmoid gate
        layers = dense + norms + attention + router + k * gated_mlp(C, 96) + shared
    return layers + C + linear(C, 256)  # + the final norm and the output layer


@pytest.mark.parametrize(
    ("family", "config"),
    [("qwen3_moe", QWEN3), ("mixtral", MIXTRAL), ("qwen2_moe", QWEN2)],
)
def test_transformers_mixtures_count_their_top_k_experts(family: str, config: dict) -> None:
    """FLOPs per token are 6 x the hand count + attention's 12 x layers x width x T; the
    active parameters the hand count plus the embedding lookup."""
    from trainer.models.hf import causal_lm

    model = causal_lm(family, config)
    assert model.flops_per_token(T) == 6.0 * hand_count(family) + 12.0 * 2 * 64 * T

    from engine.moe.active import active_parameters

    assert active_parameters(model) == hand_count(family) + 256 * 64


def test_a_dense_transformers_model_counts_every_parameter() -> None:
    from engine.moe.active import active_parameters
    from trainer.models.hf import causal_lm

    model = causal_lm("llama", {**{k: v for k, v in QWEN3.items() if "expert" not in k}})
    assert active_parameters(model) == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ what the run reports


def assembled(overrides: list[str]) -> Any:
    from trainer.run.assemble import assemble

    cfg = OmegaConf.to_object(compose_config(overrides))
    return assemble(cfg, DistInfo())


def test_the_run_meters_mfu_with_the_active_parameters() -> None:
    """The FLOPs the run's meter gets (`train/mfu`) are the model's active count, and its
    banner's figures the active parameters and the routing."""
    parts = assembled(["model=hf_qwen3_moe", "data.block_size=32"])
    assert parts.flops_per_token == 6.0 * hand_count("qwen3_moe") + 12.0 * 2 * 64 * 32
    assert parts.mixture is not None and parts.mixture.routing == ((8, 2),)
    assert parts.mixture.active == hand_count("qwen3_moe") + 256 * 64
    assert parts.mixture.routed == 2 * 8 * gated_mlp(64, 96)  # every expert: what ep splits
    assert parts.mixture.dispatched == 2 * 2 * 64  # 2 layers x top-2 x the width


def test_frozen_experts_cost_their_forward_for_the_top_k_only() -> None:
    """A frozen weight costs 4 FLOPs per token, not 6 (no weight gradient): of frozen experts,
    only the top-k a token goes through save those 2."""
    from trainer.models.hf import causal_lm
    from trainer.run.assemble import ModelSizes

    model = causal_lm("qwen3_moe", QWEN3)
    for layer in model.model.layers:
        layer.mlp.experts.requires_grad_(False)
    frozen = 2 * 2 * gated_mlp(64, 96)  # 2 layers x top-2 experts
    want = 6.0 * hand_count("qwen3_moe") - 2.0 * frozen + 12.0 * 2 * 64 * T
    assert ModelSizes.of(model, T).flops_per_token == want


def banner_model_line(capsys: pytest.CaptureFixture[str], args: list[str], run: Path) -> str:
    train_in_process([*TINY, "train.max_steps=1", "logger=none", *args], run)
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  model ")]
    return line


def test_the_banner_shows_the_experts_and_the_active_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mixture's model line names its experts, its top-k and the parameters a token goes
    through (in-tree GPT and transformers' Qwen3-MoE); a dense model's line is as it was."""
    dense = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
    line = banner_model_line(capsys, [], tmp_path / "dense")
    assert line.startswith(f"  model GPT {dense.num_params() / 1e6:.2f}M params | data "), line
    moe = ["+model.moe.experts=8", "+model.moe.top_k=2", "+model.moe.hidden=64"]
    mixture = GPT(
        vocab_size=256,
        block_size=64,
        n_layer=2,
        n_head=2,
        n_embd=32,
        moe={"experts": 8, "top_k": 2, "hidden": 64},
    )
    one_expert = 2 * 32 * 64 + 64 + 32  # fc, proj and their biases
    active = mixture.num_params() - 2 * 6 * one_expert  # 6 of 8 experts idle in 2 blocks
    line = banner_model_line(capsys, moe, tmp_path / "moe")
    want = (
        f"  model GPT {mixture.num_params() / 1e6:.2f}M params "
        f"({active / 1e6:.2f}M active: 8 experts, top-2) | data "
    )
    assert line.startswith(want), line
    total = hand_count("qwen3_moe") + 256 * 64 + 2 * 6 * gated_mlp(64, 96)  # + 6 idle of 8
    active = hand_count("qwen3_moe") + 256 * 64
    line = banner_model_line(capsys, ["model=hf_qwen3_moe"], tmp_path / "hf")
    want = f"params ({active / 1e6:.2f}M active: 8 experts, top-2) | data "
    assert f" {total / 1e6:.2f}M {want}" in line, line


# Qwen3-30B-A3B's shapes (its config.json), 4096 tokens, on 64 H100s with dist.ep=8 under FSDP2.
QWEN3_30B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 4096,
}
PLAN_30B = [
    "model=hf_qwen3_moe",
    *(f"model.config.{k}={v}" for k, v in QWEN3_30B.items()),
    "data.block_size=4096",
    "train.precision=bf16",
    "train.micro_batch_size=1",
    "train.global_batch_size=64",
    "plan.world=64",
    "plan.gpu=h100",
    "dist.strategy=fsdp",
    "dist.ep=8",
    "moe=none",  # (no routing pass: the plan's FLOPs are the point here)
    "logger=none",
]


def test_a_plan_at_qwen3_30b_a3b_shapes_counts_3b_parameters_a_token_goes_through() -> None:
    """128 experts, top-8, 48 layers: a token goes through 3.3B of the 30.5B parameters
    (Qwen3-30B-A3B's name). The plan's compute time is their FLOPs over the world at half the
    H100's bf16 peak, and its MFU those FLOPs over its step time; counting every expert it
    said 8x the compute (12.34 s against 1.53 at global batch 512, MFU 45.3%)."""
    from trainer.planning.estimate import COMPUTE_EFFICIENCY
    from trainer.planning.gpus import GPUS
    from trainer.planning.plan import plan_run

    C, layers, T = 2048, 48, 4096
    attention = linear(C, 32 * 128) + 2 * linear(C, 4 * 128) + linear(32 * 128, C) + 2 * 128
    layer = 2 * C + attention + 128 * C + 8 * gated_mlp(C, 768)  # norms, router, top-8
    body = layers * layer + C + linear(C, 151936)  # + the final norm and the output layer
    cfg = OmegaConf.to_object(compose_config(PLAN_30B))
    planned = plan_run(cfg).as_json()
    assert planned["active_parameters"] == body + 151936 * C  # + the embedding lookup
    assert planned["parameters"] == body + 151936 * C + layers * 120 * gated_mlp(C, 768)
    flops = (6.0 * body + 12.0 * layers * T * C) * 64 * T  # the global batch's tokens
    peak = GPUS["h100"].bf16_flops
    est = planned["estimate"]
    assert est["compute_s"] == pytest.approx(flops / (64 * peak * COMPUTE_EFFICIENCY))
    assert est["mfu"] == pytest.approx(flops / (est["step_time_s"] * 64 * peak))
    every_expert = 6.0 * (planned["parameters"] - 151936 * C) * 64 * T
    assert est["compute_s"] < 0.15 * every_expert / (64 * peak * COMPUTE_EFFICIENCY)
